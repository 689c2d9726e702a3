"""CPU checks of the frozen verify (the ucache kernel's no-ring build, ``kda_cute.ucache.frozen_verify``): every
variant compiles for sm_90a (a share for sm_100a), within its register budget and without spills, with the shared
memory the estimate counts and only the dot products' MMAs; the launcher's compile keys, refusals and launch split.
"""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("cutlass")

ARCHS = ("sm_90a", "sm_100a")
K = 128

# name -> (heads, T, tile_v, softplus gate, aligned), keywords of build_frozen_kernel
VARIANTS = {
    "T8-tv128-4cta-records": ((12, 8, 128, False, True), dict(records=True)),
    "T8-tv128-3cta-records": ((12, 8, 128, False, True), dict(records=True, min_ctas=3)),
    "T8-tv64-records": ((12, 8, 64, False, True), dict(records=True)),
    "T4-tv128-softplus-unaligned-records-no-dt-bias": ((12, 4, 128, True, False),
                                                        dict(records=True, has_dt_bias=False)),
    "T8-tv128-4cta": ((12, 8, 128, False, True), dict()),
    "T8-tv128-4cta-records-varlen": ((12, 8, 128, False, True), dict(records=True, varlen=True)),
    "T8-tv128-3cta-records-varlen-cu64": ((12, 8, 128, False, True),
                                          dict(records=True, varlen=True, cu_int64=True, min_ctas=3)),
    "T4-tv64-records-varlen": ((32, 4, 64, False, True), dict(records=True, varlen=True)),
    "T8-tv128-nonpositive-int64-strided-records-varlen": ((12, 8, 128, False, True),
                                                          dict(records=True, varlen=True, slot_int64=True,
                                                               slots_strided=True, null_policy="NONPOSITIVE")),
    "T8-tv64-unaligned-varlen": ((12, 8, 64, False, False), dict(varlen=True)),
    "T8-tv128-4cta-fp32-records-varlen": ((12, 8, 128, False, True), dict(records=True, varlen=True, pool_fp32=True)),
    "T8-tv128-3cta-fp32-records-varlen": ((12, 8, 128, False, True),
                                          dict(records=True, varlen=True, pool_fp32=True, min_ctas=3)),
    "T8-tv64-fp32-records": ((12, 8, 64, False, True), dict(records=True, pool_fp32=True)),
    "T4-tv128-softplus-unaligned-fp32-records": ((12, 4, 128, True, False), dict(records=True, pool_fp32=True)),
}  # fmt: skip


def _keywords(kw):
    from kda_core.contracts import NullSlotPolicy

    kw = dict(kw)
    if kw.get("null_policy") == "NONPOSITIVE":
        kw["null_policy"] = NullSlotPolicy.NONPOSITIVE
    return kw


@pytest.mark.sm100_share(lambda params, indices: list(VARIANTS).index(params["name"]) % 3 == 0)  # see conftest
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_frozen_variant_compiles_within_budget(name, arch, tmp_path, ptxas):
    # Every build: the shared memory the launcher's residency cap counts (UcacheVerifyFlush.smem_bytes) is what the
    # compiled launch asks for. On sm_90a with ptxas: no spills, the tile-128 builds within the
    # registers of their resident-CTA floor (64 at 4 CTAs, 80 at 3), and only phase 2c's dot-product MMAs (8 k-steps
    # x 2 n-tiles x (x hi, x lo), and x hi S lo with an fp32 checkpoint): no ring term, no flush.
    from kda_cute.ucache import UcacheVerifyFlush, build_frozen_kernel

    args, kw = VARIANTS[name]
    kw = _keywords(kw)
    compiled = build_frozen_kernel(*args, arch, ptxas.keep(tmp_path), **kw)
    cfg_kw = {key: kw[key] for key in ("min_ctas", "has_dt_bias", "null_policy", "slot_int64", "slots_strided",
                                       "pool_fp32") if key in kw}  # fmt: skip
    cfg = UcacheVerifyFlush(args[0], args[1], 0, *args[2:], ring=False, records=kw.get("records", False),
                            varlen=kw.get("varlen", False), cu_int64=kw.get("cu_int64", False), **cfg_kw)  # fmt: skip
    assert f"llvm.mlir.constant({cfg.smem_bytes()} : i64)" in str(compiled.ir_module)
    if arch != "sm_90a" or shutil.which("ptxas") is None:
        return
    (ptx,) = list(tmp_path.glob("*.ptx"))
    assert ptx.read_text().count("mma.sync.aligned.m16n8k16") == (48 if kw.get("pool_fp32") else 32)
    registers, spills = ptxas.registers_and_spills(ptx, arch)
    assert spills == 0, f"{registers} registers, {spills} bytes of spill traffic"
    if args[2] == 128:
        budget = 80 if kw.get("min_ctas") == 3 else 64
        assert registers <= budget, f"{registers} registers, {budget} asked"


def test_no_ring_config_allocates_no_ring_tiles():
    from kda_cute.ucache import UcacheVerifyFlush

    ring = UcacheVerifyFlush(12, 8, 16, 128, False, True)
    frozen = UcacheVerifyFlush(12, 8, 16, 128, False, True, ring=False)
    assert frozen.kpad == 0 and frozen.max_rows == 0 and frozen.w_ring == 0
    # the ring build's sUp, sWK, sWKc, sM and sBdec: 13 KB at T=8 w16 tile 128
    assert ring.smem_bytes() - frozen.smem_bytes() == 4 * (7 * 136 + 128 + 128 * 16 + 16 * 132 + 15 * 16 + 16 + 128)
    with pytest.raises(ValueError, match="frozen-verify"):
        UcacheVerifyFlush(12, 8, 16, 128, False, True, records=True)


# ---- the launcher (host side: no GPU, the build replaced by a recorder) ------------------------------------------


def _recorder(monkeypatch):
    from kda_cute import _launch, ucache

    launches = []
    monkeypatch.setattr(ucache, "build_frozen_kernel",
                        lambda *a, **kw: (lambda *args: launches.append((a, kw, args))))  # fmt: skip
    _launch.clear_cache()
    return launches


def _call(B=2, T=8, H=12, *, records=False, varlen=False, cu=None, t_draft="auto", slots=None, pool_dtype=None,
          **kw):
    import torch

    from kda_cute import ucache

    rows, tokens = (1, 5 * max(B, 1)) if varlen else (B, T)
    act = torch.empty(1, 1, 1, K, dtype=torch.bfloat16).expand(rows, tokens, H, K)
    pool = torch.empty(3, H, K, K, dtype=pool_dtype or torch.bfloat16)
    cc = kg = None
    if records:
        cc = torch.empty(3, H, T, K)
        kg = torch.empty(3, H, T, 2 * K, dtype=torch.bfloat16)
    if varlen and cu is None:
        cu = torch.zeros(B + 1, dtype=torch.int32)
    if t_draft == "auto":
        t_draft = T if varlen else None
    slots = torch.zeros(B, dtype=torch.int32) if slots is None else slots
    return ucache.frozen_verify(torch.zeros(H), act, None, -5.0, act, act, act, act[..., 0], pool, slots, 1.0, act,
                                correction_cache=cc, kg_cache=kg, cu_seqlens=cu if varlen else None, t_draft=t_draft,
                                **kw)  # fmt: skip


def test_compile_key_separates_every_code_generation_parameter(monkeypatch):
    import torch

    from kda_core.contracts import NullSlotPolicy
    from kda_cute import _launch
    from kda_cute.ucache import UcacheConfig

    launches = _recorder(monkeypatch)
    calls = ({}, {"T": 4}, {"H": 24}, {"records": True}, {"varlen": True}, {"varlen": True, "records": True},
             {"varlen": True, "cu": torch.zeros(3, dtype=torch.int64)}, {"aligned": False},
             {"null_policy": NullSlotPolicy.NONPOSITIVE}, {"slots": torch.zeros(2, dtype=torch.int64)},
             {"slots": torch.zeros(2, 3, dtype=torch.int32)[:, 1]}, {"config": UcacheConfig(128, 3)}, {"B": 128},
             {"pool_dtype": torch.float32},
             {}, {"records": True}, {"varlen": True})  # fmt: skip
    for kw in calls:
        _call(**kw)
    assert len(launches) == len(calls) and _launch.cache_size() == len(calls) - 3  # the last three are cache hits
    records = [kw["records"] for _, kw, _ in launches]
    varlen = [kw["varlen"] for _, kw, _ in launches]
    assert records[3] and records[5] and not records[4] and varlen[4] and varlen[5] and not varlen[3]
    assert launches[6][1]["cu_int64"] and not launches[4][1]["cu_int64"]
    assert launches[13][1]["pool_fp32"] and not launches[0][1]["pool_fp32"]
    _launch.clear_cache()


def test_arguments_reach_the_kernel_in_its_order(monkeypatch):
    import torch

    launches = _recorder(monkeypatch)
    cu = torch.zeros(3, dtype=torch.int32)
    _call(records=True, varlen=True, cu=cu)
    ((_, _, args),) = launches
    assert len(args) == 21 and all(a is None for a in args[9:14])  # no ring, no cursors
    assert args[15].dtype == torch.float32 and args[16].shape[-1] == 2 * K and args[17] is cu
    assert args[-1] == 0 and args[-3] == 1.0 and args[-2] == -5.0  # flush_min unused, scale, lower_bound


@pytest.mark.parametrize(
    "kw, argument",
    [
        (dict(varlen=True, t_draft=None), "t_draft"),
        (dict(varlen=True, t_draft=6), "t_draft"),
        (dict(t_draft=4), "t_draft"),
        (dict(T=6), "q"),
        (dict(varlen=True, cu="short"), "cu_seqlens"),
        (dict(slots="three"), "slot_indices"),
        (dict(records="correction only"), "kg_cache"),
        (dict(records="few heads"), "correction_cache"),
        (dict(records="kg positions"), "kg_cache"),
        (dict(config=(128, 3)), "config"),
        (dict(null_policy="nonpositive"), "null_policy"),
    ],
    ids=["varlen-no-T", "varlen-T6", "dense-T-mismatch", "dense-T6", "cu-shape", "slots-per-request", "records-pair",
         "correction-shape", "kg-shape", "config", "policy"],
)  # fmt: skip
def test_refusals_name_the_argument_before_launch(kw, argument, monkeypatch):
    import torch

    from kda_core.errors import KDAError
    from kda_cute import ucache

    launches = _recorder(monkeypatch)
    kw = dict(kw)
    if kw.get("cu") == "short":
        kw["cu"] = torch.zeros(2, dtype=torch.int32)  # B + 1 = 3 expected
    if kw.get("slots") == "three":
        kw["slots"] = torch.zeros(3, dtype=torch.int32)  # q has 2 requests
    records = kw.pop("records", False)
    if isinstance(records, str):
        H, T = 12, 8
        pool = torch.empty(3, H, K, K, dtype=torch.bfloat16)
        act = torch.empty(2, T, H, K, dtype=torch.bfloat16)
        cc = torch.empty(3, H if records != "few heads" else 2, T, K)
        kg = torch.empty(3, H, T if records != "kg positions" else T - 1, 2 * K, dtype=torch.bfloat16)
        if records == "correction only":
            kg = None
        with pytest.raises(KDAError, match=f"^{argument}: expected"):
            ucache.frozen_verify(torch.zeros(H), act, None, -5.0, act, act, act, act[..., 0], pool,
                                 torch.zeros(2, dtype=torch.int32), 1.0, act, correction_cache=cc, kg_cache=kg)
    else:
        with pytest.raises(KDAError, match=f"^{argument}: expected"):
            _call(**kw)
    assert launches == []


def test_an_empty_batch_launches_nothing(monkeypatch):
    from kda_cute import _launch

    launches = _recorder(monkeypatch)
    out = _call(0)
    assert launches == [] and out.shape == (0, 8, 12, K) and _launch.cache_size() == 0
    assert _call(0, varlen=True, records=True).shape[0] == 1 and launches == []


def test_varlen_activations_without_tokens_launch_nothing(monkeypatch):
    # Every row is empty: no output, no record, and no token for a missing token's load to land on (the kernel loads
    # a row the view has and zeroes it with a select); the same call with tokens launches once.
    import torch

    from kda_cute import _launch, ucache

    launches = _recorder(monkeypatch)
    H = 12
    act = torch.empty(1, 0, H, K, dtype=torch.bfloat16)
    pool = torch.empty(3, H, K, K, dtype=torch.bfloat16)
    cu = torch.zeros(3, dtype=torch.int32)
    out = ucache.frozen_verify(torch.zeros(H), act, None, -5.0, act, act, act, act[..., 0], pool,
                               torch.ones(2, dtype=torch.int32), 1.0, act, cu_seqlens=cu, t_draft=8)
    assert out is act and launches == []
    _call(2, varlen=True)
    assert len(launches) == 1
    _launch.clear_cache()


def test_a_dense_batch_past_grid_z_runs_as_several_launches(monkeypatch):
    from kda_cute import _launch, ucache

    launches = _recorder(monkeypatch)
    B = ucache.GRID_Z_MAX + 3
    _call(B, records=True)
    sizes = [args[8].shape[0] for _, _, args in launches]
    assert sizes == [ucache.GRID_Z_MAX, 3]
    for _, _, args in launches:
        for i in ucache._FROZEN_BATCH_ARGS:
            assert args[i].shape[0] == args[8].shape[0], i
        assert args[7].shape[0] == 3 and args[15].shape[0] == 3  # the pool and records are not sliced
    _launch.clear_cache()


def test_varlen_rows_past_grid_z_raise_naming_cu_seqlens(monkeypatch):
    # one launch zeroes the tokens no row owns (its first and last rows): more rows than grid z are refused
    import torch

    from kda_core.errors import KDAError
    from kda_cute import ucache

    launches = _recorder(monkeypatch)
    B = ucache.GRID_Z_MAX + 1
    with pytest.raises(KDAError, match="^cu_seqlens: expected at most 65535 rows"):
        _call(B, varlen=True, cu=torch.zeros(B + 1, dtype=torch.int32))
    assert launches == []


def test_debug_validate_refuses_duplicate_record_rows(monkeypatch):
    import torch

    from kda_core.contracts import NullSlotPolicy
    from kda_core.errors import KDAError

    launches = _recorder(monkeypatch)
    monkeypatch.setenv("KDA_DEBUG_VALIDATE", "1")
    slots = torch.tensor([0, 0], dtype=torch.int32)
    _call(slots=slots, records=True, null_policy=NullSlotPolicy.NONPOSITIVE)  # slot 0 is null there: it may repeat
    _call(slots=slots)  # no records: nothing is written, a read-only slot may repeat
    assert len(launches) == 2
    with pytest.raises(KDAError, match="^slot_indices: expected distinct active slots"):
        _call(slots=slots, records=True)
    assert len(launches) == 2
