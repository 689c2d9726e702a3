"""CPU compile checks of the ucache kernels for Hopper (sm_90a) and Blackwell (sm_100a).

``cute.compile`` runs without a GPU once ``CUTE_DSL_ARCH`` is set (conftest.py does it on CPU machines); the
``--gpu-arch`` option picks the target per compile, so one process builds both.
"""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("cutlass")

ARCHS = ("sm_90a", "sm_100a")

# (heads, T, w_ring, tile_v, softplus gate, aligned): the benchmark's configuration first, then the corners.
CONFIGS = (
    (12, 8, 16, 64, False, True),
    (96, 4, 32, 128, True, False),
    (8, 8, 32, 128, False, True),
)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "H{}-T{}-w{}-tv{}-{}-{}".format(
    c[0], c[1], c[2], c[3], "softplus" if c[4] else "lb", "aligned" if c[5] else "unaligned"))
def test_verify_flush_kernel_compiles(arch, config):
    from kda_cute.ucache import build_ucache_kernel

    assert build_ucache_kernel(*config, arch) is not None


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not on PATH")
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("softplus_gate", [False, True], ids=["lb", "softplus"])
@pytest.mark.parametrize("min_ctas", [0, 3], ids=["4cta", "3cta"])
def test_main_config_fits_its_register_budget_without_spills(min_ctas, softplus_gate, arch, tmp_path, ptxas):
    # T=8 w16 tile 128 (the B >= 8 schedule at H=12): 4 CTAs of 256 threads need <= 64 registers per thread, the
    # 3-CTA floor of the schedule's smaller grids <= 80.
    from kda_cute.ucache import build_ucache_kernel

    build_ucache_kernel(12, 8, 16, 128, softplus_gate, True, arch, ptxas.keep(tmp_path),
                        min_ctas=min_ctas)  # fmt: skip
    (ptx,) = list(tmp_path.glob("*.ptx"))
    registers, spills = ptxas.registers_and_spills(ptx, arch)
    budget = 80 if min_ctas == 3 else 64
    assert registers <= budget and spills == 0, f"{registers} registers, {spills} bytes of spill traffic"


def test_the_checkpoint_rows_are_prefetched_into_l2(tmp_path):
    # The kernel loads its checkpoint rows after the triangles / phase 2b, so every thread asks for its rows' L2
    # lines at the phase-1 barrier: one prefetch.global.L2 each.
    from kda_cute.ucache import build_ucache_kernel

    build_ucache_kernel(12, 8, 16, 128, False, True, "sm_90a", f"--keep-ptx --dump-dir {tmp_path}")
    (ptx,) = list(tmp_path.glob("*.ptx"))
    assert ptx.read_text().count("prefetch.global.L2") == 1


@pytest.mark.parametrize("config", [(12, 8, 16, 64, False, True), (96, 4, 32, 128, True, False),
                                    (8, 8, 32, 128, False, True), (12, 8, 16, 128, False, True)],
                         ids=["T8-w16-tv64", "T4-w32-tv128", "T8-w32-tv128", "T8-w16-tv128"])  # fmt: skip
def test_smem_estimate_matches_the_compiled_launch(config):
    # The launcher caps the resident-CTA floor (hence the register budget) by UcacheVerifyFlush.ctas_by_smem: its
    # byte count must be the dynamic shared memory the compiled launch asks for (a constant of the host code).
    from kda_cute.ucache import UcacheVerifyFlush, build_ucache_kernel

    expected = UcacheVerifyFlush(*config).smem_bytes()
    module = build_ucache_kernel(*config, "sm_90a").ir_module
    assert f"llvm.mlir.constant({expected} : i64)" in str(module)


def test_resident_cta_floor_is_capped_by_shared_memory():
    from kda_cute.ucache import MIN_CTAS_PER_SM, UcacheVerifyFlush

    main = UcacheVerifyFlush(12, 8, 16, 128, False, True)
    assert main.smem_bytes() + 1024 <= 228 * 1024 // 4
    assert main.ctas_by_smem() == 4 and main.occupancy()["min_blocks_per_mp"] == MIN_CTAS_PER_SM[128] == 4
    assert UcacheVerifyFlush(12, 8, 16, 64, False, True).occupancy()["min_blocks_per_mp"] == 4  # 5 asked
    assert UcacheVerifyFlush(12, 8, 32, 128, False, True).occupancy()["min_blocks_per_mp"] == 2
    assert UcacheVerifyFlush(12, 8, 16, 128, False, True, min_ctas=3).occupancy()["min_blocks_per_mp"] == 3
    assert UcacheVerifyFlush(12, 8, 16, 128, False, True, min_ctas=8).occupancy()["min_blocks_per_mp"] == 4


def test_schedule_policy_by_grid_size():
    import dataclasses

    from kda_cute.ucache import UcacheConfig, select_config

    assert select_config(1, 12) == select_config(7, 12) == UcacheConfig(64)  # under 96 (request, head) pairs
    assert select_config(8, 12) == select_config(127, 12) == UcacheConfig(128, min_ctas=3)  # the 80-register build
    assert select_config(128, 12) == select_config(1 << 20, 96) == UcacheConfig(128)  # the table's 4 CTAs
    assert UcacheConfig(128).floor == 4 and UcacheConfig(64).floor == 5 and UcacheConfig(128, 3).floor == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        select_config(1, 12).tile_v = 128


def test_vector_activation_loads_only_in_the_measured_build(tmp_path):
    # 16-byte loads of the draft inputs and the v tile in the aligned T=8 tile-128 build at 4 CTAs per SM
    # (64 registers); the 80-register build spilled with them, and T=4, tile 64 and w_ring 32 were not measured.
    from kda_cute.ucache import UcacheVerifyFlush, build_ucache_kernel

    assert UcacheVerifyFlush(12, 8, 16, 128, False, True).vector_activations()
    assert not UcacheVerifyFlush(12, 8, 16, 128, False, True, min_ctas=3).vector_activations()
    assert not UcacheVerifyFlush(12, 8, 16, 128, False, False).vector_activations()
    assert not UcacheVerifyFlush(12, 4, 16, 128, False, True).vector_activations()
    assert not UcacheVerifyFlush(12, 8, 16, 64, False, True).vector_activations()
    assert not UcacheVerifyFlush(12, 8, 32, 128, False, True).vector_activations()
    # the same build pads the rows of sK, sQ, sDec (KQ_PAD); the 80-register build keeps 128-word rows (4 words of
    # padding spilled there, 12 did not but were slower)
    assert UcacheVerifyFlush(12, 8, 16, 128, False, True).kq_row() == 132
    assert UcacheVerifyFlush(12, 8, 16, 128, False, True, min_ctas=3).kq_row() == 128
    counts = []
    for min_ctas in (0, 3):
        d = tmp_path / str(min_ctas)
        d.mkdir()
        build_ucache_kernel(12, 8, 16, 128, False, True, "sm_90a", f"--keep-ptx --dump-dir {d}",
                            min_ctas=min_ctas)  # fmt: skip
        (ptx,) = list(d.glob("*.ptx"))
        counts.append(ptx.read_text().count("st.shared.v4.b32"))
    # every k, q, gate run is two 16-byte fp32 stores: 3 * 2 more than the 80-register build's (both store v runs)
    assert counts[0] >= counts[1] + 6, counts


def test_vector_v_tile_only_in_the_80_register_build(tmp_path, monkeypatch):
    # The 80-register build (3 CTAs per SM, T=8 tile 128) reads the v tile as 16-byte runs and keeps the
    # draft inputs' scalar loads; tile 64 measured slower with it, T=4 and w_ring 32 were not measured.
    from kda_cute.ucache import UcacheVerifyFlush, build_ucache_kernel

    assert UcacheVerifyFlush(12, 8, 16, 128, False, True, min_ctas=3).vector_v()
    assert not UcacheVerifyFlush(12, 8, 16, 128, False, True).vector_v()  # vector_activations
    assert not UcacheVerifyFlush(12, 8, 16, 128, False, False, min_ctas=3).vector_v()
    assert not UcacheVerifyFlush(12, 8, 16, 64, False, True, min_ctas=3).vector_v()
    assert not UcacheVerifyFlush(12, 4, 16, 128, False, True, min_ctas=3).vector_v()
    assert not UcacheVerifyFlush(12, 8, 32, 128, False, True, min_ctas=3).vector_v()
    counts = []
    for vector in (True, False):
        monkeypatch.setattr(UcacheVerifyFlush, "vector_v", lambda self, v=vector: v)
        d = tmp_path / str(vector)
        d.mkdir()
        build_ucache_kernel(12, 8, 16, 128, False, True, "sm_90a", f"--keep-ptx --dump-dir {d}",
                            min_ctas=3)  # fmt: skip
        (ptx,) = list(d.glob("*.ptx"))
        text = ptx.read_text()
        counts.append((text.count("ld.global.v4"), text.count("st.shared.v4.b32")))
    # one 16-byte load and one 16-byte store of a v run per thread (128 runs on 256 threads) instead of 4 scalars
    assert counts[0][0] == counts[1][0] + 1 and counts[0][1] == counts[1][1] + 1, counts


@pytest.mark.parametrize("arch", ARCHS)
def test_cursor_restart_kernel_compiles(arch):
    from kda_cute.ucache import build_restart_kernel

    assert build_restart_kernel(arch) is not None


def test_compile_cache_key_separates_every_code_generation_parameter(monkeypatch):
    from kda_cute import _launch, ucache
    from kda_cute.ucache import UcacheConfig

    built = []
    monkeypatch.setattr(ucache, "build_ucache_kernel", lambda *args, **kw: built.append(args) or (lambda *a: None))
    monkeypatch.setattr(ucache, "restart_cursors", lambda *a: None)
    import torch

    def call(B=2, T=8, H=12, w_ring=16, lower_bound=-5.0, aligned=True, config=None):
        q = torch.empty(B, T, H, 128)
        ucache.ucache_verify_flush(None, None, None, lower_bound, q, None, None, None, None,
                                   torch.zeros(B, dtype=torch.int32), None, None, None, None, None, 9, w_ring, 1.0,
                                   None, aligned=aligned, config=config)  # fmt: skip

    _launch.clear_cache()
    # The schedule: tile 64 at B=2 H=12; tile 128 asks for 3 CTAs below 1536 (request, head) pairs and for the
    # table's 4 from there (B=128 at H=12), a different build. UcacheConfig(128) and UcacheConfig(128, 4) ask for
    # the same floor: one build.
    for kwargs in ({}, {"T": 4}, {"H": 24}, {"w_ring": 32}, {"lower_bound": None}, {"aligned": False},
                   {"config": UcacheConfig(128, 3)}, {"B": 128}, {"config": UcacheConfig(128, 5)}, {},
                   {"config": UcacheConfig(64)}, {"B": 128, "config": UcacheConfig(128, 4)}):
        call(**kwargs)
    assert len(built) == 9  # the last three calls are cache hits
    _launch.clear_cache()


@pytest.mark.parametrize("config", ["tile32", "negative-floor", "tuple"])
def test_an_illegal_config_raises_naming_config_before_launch(config, monkeypatch):
    import torch

    from kda_core.errors import KDAError
    from kda_cute.ucache import UcacheConfig

    launches = _recording_launcher(monkeypatch)
    bad = {"tile32": UcacheConfig(32), "negative-floor": UcacheConfig(128, -1), "tuple": (128, 3)}[config]
    q = torch.empty(2, 8, 2, 128)
    with pytest.raises(KDAError, match="^config: expected a UcacheConfig"):
        from kda_cute import ucache

        ucache.ucache_verify_flush(None, None, None, -5.0, q, None, None, None, None, None, None, None, None, None,
                                   None, 9, 16, 1.0, None, config=bad)  # fmt: skip
    assert launches == []


@pytest.mark.parametrize("arch", ARCHS)
def test_absent_dt_bias_variant_compiles(arch):
    from kda_cute.ucache import build_ucache_kernel

    assert build_ucache_kernel(12, 8, 16, 128, False, True, arch, has_dt_bias=False) is not None


def _recording_launcher(monkeypatch):
    """Replace both builds by recorders: [(kind, args of each launch)]."""
    from kda_cute import _launch, ucache

    launches = []
    monkeypatch.setattr(ucache, "build_ucache_kernel",
                        lambda *a, **kw: (lambda *args: launches.append(("verify", args, kw))))
    monkeypatch.setattr(ucache, "build_restart_kernel",
                        lambda arch, *a: (lambda *args: launches.append(("restart", args))))
    _launch.clear_cache()
    return launches


def _verify_call(B, H=2, T=8, dt_bias=True, restart=True, **kw):
    import torch

    from kda_cute import ucache

    row = lambda *shape: torch.empty(1, *shape, dtype=torch.bfloat16).expand(B, *shape)  # noqa: E731
    ints = torch.zeros(1, dtype=torch.int32).expand(B)
    pool, ring = torch.empty(3, H, 128, 128, dtype=torch.bfloat16), torch.empty(3, H, 32, 128)
    output = row(T, H, 128)
    return ucache.ucache_verify_flush(
        torch.zeros(H), row(T, H, 128), torch.zeros(H * 128) if dt_bias else None, -5.0, row(T, H, 128),
        row(T, H, 128), row(T, H, 128), row(T, H), pool, ints, ring, ring, ring, ints, ints, 9, 16, 1.0, output,
        restart_hist_on_flush=restart, **kw,
    )  # fmt: skip


def test_an_empty_batch_launches_neither_kernel(monkeypatch):
    from kda_cute import _launch

    launches = _recording_launcher(monkeypatch)
    out = _verify_call(0)
    assert launches == [] and out.shape == (0, 8, 2, 128) and _launch.cache_size() == 0
    _launch.clear_cache()


def test_a_batch_past_grid_z_runs_as_several_verify_launches_and_one_restart(monkeypatch):
    from kda_cute import _launch, ucache

    launches = _recording_launcher(monkeypatch)
    B = ucache.GRID_Z_MAX + 3
    _verify_call(B)
    verify = [args for kind, args, *_ in launches if kind == "verify"]
    assert [args[0].shape[0] for args in verify] == [ucache.GRID_Z_MAX, 3]
    for args in verify:
        for i, a in enumerate(args[:15]):
            if i in ucache._BATCH_ARGS:
                assert a.shape[0] == args[0].shape[0], i
        assert args[7].shape[0] == 3  # the pool is not sliced
    ((kind, restart),) = [x for x in launches if x[0] == "restart"]
    assert restart[0].shape[0] == B  # one thread per row on grid x
    _launch.clear_cache()


def test_restart_kernel_gets_the_verify_kernels_history_cap(monkeypatch):
    from kda_core.contracts import max_hist_len
    from kda_cute import _launch

    launches = _recording_launcher(monkeypatch)
    for T in (4, 8):
        _verify_call(2, T=T)
    caps = [args[-1] for kind, args, *_ in launches if kind == "restart"]
    assert caps == [max_hist_len(4, 16), max_hist_len(8, 16)]
    _launch.clear_cache()


def test_an_absent_dt_bias_is_a_separate_build(monkeypatch):
    from kda_cute import _launch

    launches = _recording_launcher(monkeypatch)
    for with_bias in (True, False, True):
        _verify_call(2, dt_bias=with_bias, restart=False)
    assert [kw["has_dt_bias"] for kind, _, kw in launches] == [True, False, True]
    assert _launch.cache_size() == 2
    _launch.clear_cache()


def test_more_heads_than_grid_y_holds_raise_naming_q(monkeypatch):
    import torch

    from kda_core.errors import KDAError
    from kda_cute import ucache

    launches = _recording_launcher(monkeypatch)
    q = torch.empty(1, 8, 1, 128).expand(1, 8, ucache.GRID_Y_MAX + 1, 128)
    with pytest.raises(KDAError, match="^q: expected at most 65535 heads"):
        ucache.ucache_verify_flush(None, None, None, -5.0, q, None, None, None, None, None, None, None, None, None,
                                   None, 9, 16, 1.0, None)  # fmt: skip
    assert launches == []


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("config", [(12, 8, 16, 128, False, True), (96, 4, 32, 64, True, False)],
                         ids=["T8-w16-tv128", "T4-w32-tv64-unaligned"])  # fmt: skip
def test_nonpositive_policy_variants_compile(arch, config):
    from kda_core.contracts import NullSlotPolicy
    from kda_cute.ucache import build_restart_kernel, build_ucache_kernel

    assert build_ucache_kernel(*config, arch, null_policy=NullSlotPolicy.NONPOSITIVE) is not None
    assert build_restart_kernel(arch, NullSlotPolicy.NONPOSITIVE) is not None


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not on PATH")
@pytest.mark.parametrize("min_ctas", [0, 3], ids=["4cta", "3cta"])
def test_nonpositive_main_config_fits_the_same_register_budget(min_ctas, tmp_path, ptxas):
    from kda_core.contracts import NullSlotPolicy
    from kda_cute.ucache import build_ucache_kernel

    build_ucache_kernel(12, 8, 16, 128, False, True, "sm_90a", ptxas.keep(tmp_path),
                        min_ctas=min_ctas, null_policy=NullSlotPolicy.NONPOSITIVE)  # fmt: skip
    (ptx,) = list(tmp_path.glob("*.ptx"))
    registers, spills = ptxas.registers_and_spills(ptx, "sm_90a")
    assert registers <= (80 if min_ctas == 3 else 64) and spills == 0, f"{registers} registers, {spills} bytes spilled"


def test_the_null_policy_is_a_separate_build_of_both_kernels(monkeypatch):
    from kda_core.contracts import NullSlotPolicy
    from kda_cute import _launch

    launches = _recording_launcher(monkeypatch)
    for policy in (NullSlotPolicy.OUT_OF_RANGE, NullSlotPolicy.NONPOSITIVE, NullSlotPolicy.OUT_OF_RANGE):
        _verify_call(2, null_policy=policy)
    policies = [entry[2]["null_policy"] for entry in launches if entry[0] == "verify"]
    assert policies == [NullSlotPolicy.OUT_OF_RANGE, NullSlotPolicy.NONPOSITIVE, NullSlotPolicy.OUT_OF_RANGE]
    assert _launch.cache_size() == 4  # verify and restart, per policy
    _launch.clear_cache()


def test_a_null_policy_that_is_not_the_enum_raises_naming_it(monkeypatch):
    from kda_core.errors import KDAError

    launches = _recording_launcher(monkeypatch)
    with pytest.raises(KDAError, match="^null_policy: expected a kda_core.contracts.NullSlotPolicy"):
        _verify_call(2, null_policy="nonpositive")
    assert launches == []


def test_debug_validate_under_nonpositive_lets_slot_0_repeat(monkeypatch):
    import torch

    from kda_core.contracts import NullSlotPolicy
    from kda_core.errors import KDAError
    from kda_cute import ucache

    launches = _recording_launcher(monkeypatch)
    monkeypatch.setenv("KDA_DEBUG_VALIDATE", "1")
    q = torch.empty(3, 8, 2, 128)
    pool = torch.empty(4, 2, 128, 128)
    slots = torch.tensor([0, 0, 2], dtype=torch.int32)

    def call(**kw):
        ucache.ucache_verify_flush(None, None, None, -5.0, q, None, None, None, pool, slots, None, None, None, None,
                                   None, 9, 16, 1.0, None, **kw)  # fmt: skip

    call(null_policy=NullSlotPolicy.NONPOSITIVE)
    assert len(launches) == 1
    with pytest.raises(KDAError, match="^slot_indices: expected distinct active slots"):
        call()
    assert len(launches) == 1
    ucache._launch.clear_cache()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("slot_int64", [False, True], ids=["int32", "int64"])
def test_strided_and_int64_slot_variants_compile(arch, slot_int64):
    from kda_cute.ucache import build_restart_kernel, build_ucache_kernel

    assert build_ucache_kernel(12, 8, 16, 128, False, True, arch, slot_int64=slot_int64, slots_strided=True)
    assert build_restart_kernel(arch, slot_int64=slot_int64) is not None


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not on PATH")
@pytest.mark.parametrize("min_ctas", [0, 3], ids=["4cta", "3cta"])
def test_int64_strided_slots_fit_the_main_configs_register_budget(min_ctas, tmp_path, ptxas):
    from kda_core.contracts import NullSlotPolicy
    from kda_cute.ucache import build_ucache_kernel

    build_ucache_kernel(12, 8, 16, 128, False, True, "sm_90a", ptxas.keep(tmp_path), min_ctas=min_ctas,
                        null_policy=NullSlotPolicy.NONPOSITIVE, slot_int64=True, slots_strided=True)  # fmt: skip
    (ptx,) = list(tmp_path.glob("*.ptx"))
    registers, spills = ptxas.registers_and_spills(ptx, "sm_90a")
    assert registers <= (80 if min_ctas == 3 else 64) and spills == 0, f"{registers} registers, {spills} bytes spilled"


def test_slot_width_and_stride_are_separate_builds(monkeypatch):
    import torch

    from kda_cute import _launch, ucache

    launches = _recording_launcher(monkeypatch)
    q = torch.empty(3, 8, 2, 128)
    column = torch.zeros(3, 8, dtype=torch.int32)[:, 0]  # stride 8
    for slots in (torch.zeros(3, dtype=torch.int32), column, torch.zeros(3, dtype=torch.int64), column.long(),
                  torch.zeros(3, 8, dtype=torch.int64)[:, 2], torch.zeros(1, 5, dtype=torch.int32)[:, 0].expand(3)):
        ucache.ucache_verify_flush(None, None, None, -5.0, q, None, None, None, torch.empty(4), slots, None, None,
                                   None, None, None, 9, 16, 1.0, None)  # fmt: skip
    layouts = [(e[2]["slot_int64"], e[2]["slots_strided"]) for e in launches if e[0] == "verify"]
    assert layouts == [(False, False), (False, True), (True, False), (True, False), (True, True), (False, True)]
    assert _launch.cache_size() == 4
    _launch.clear_cache()
