"""CPU checks of the RecoverSSM commit kernel: every variant axis builds for sm_90a (a share of them for sm_100a),
the largest tile does not spill, the layered build keeps its 16-byte accesses, the compile-cache key names every
code-generation parameter, and the host side (row chunking, layer offsets, refusals) behaves before any launch.

No GPU needed: conftest sets ``CUTE_DSL_ARCH`` and ``compile_variant`` passes ``--gpu-arch`` per compile.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from kda_core.contracts import GateMode, NullSlotPolicy
from kda_core.errors import KDAError

pytest.importorskip("cutlass")

from kda_cute import recoverssm as R  # noqa: E402

ARCHS = ("sm_90a", "sm_100a")

BASE = dict(
    head_dim=128, state_dtype=torch.bfloat16, kg_dtype=torch.bfloat16, gate=GateMode.LOWER_BOUND,
    use_qk_l2norm=True, has_dt_bias=True, qsl_dtype=torch.int32, slot_dtype=torch.int32, nat_dtype=torch.int32,
    layered=False, tile_v=64, aligned=True, null_policy=NullSlotPolicy.OUT_OF_RANGE, bulk_ring=0, has_dst=False,
)


def _variants():
    out = {}
    for state in (torch.bfloat16, torch.float32):
        for K in (128, 64):
            for aligned in (True, False):
                for layered in (False, True):
                    name = f"{'bf16' if state == torch.bfloat16 else 'fp32'}-K{K}-{'al' if aligned else 'unal'}"
                    out[f"{name}-{'layers' if layered else 'single'}"] = {
                        **BASE, "state_dtype": state, "head_dim": K, "aligned": aligned, "layered": layered,
                        "tile_v": R.tile_v_choices(K)[-1]}
    for K in (128, 64):
        for tile in R.tile_v_choices(K)[:-1]:
            out[f"tile{tile}-K{K}"] = {**BASE, "head_dim": K, "tile_v": tile}
    flags = {
        "softplus": dict(gate=GateMode.SOFTPLUS),
        "precomputed": dict(gate=GateMode.PRECOMPUTED),
        "precomputed-layers": dict(gate=GateMode.PRECOMPUTED, layered=True),
        "no-l2norm": dict(use_qk_l2norm=False),
        "no-dt-bias": dict(has_dt_bias=False),
        "no-dt-bias-layers": dict(has_dt_bias=False, layered=True),
        "no-qsl": dict(qsl_dtype=None),
        "qsl-int64": dict(qsl_dtype=torch.int64),
        "int64-slots-counts": dict(slot_dtype=torch.int64, nat_dtype=torch.int64),
        "int64-slots-int32-counts": dict(slot_dtype=torch.int64),
        "nonpositive": dict(null_policy=NullSlotPolicy.NONPOSITIVE),
        "nonpositive-int64-layers-fp32": dict(null_policy=NullSlotPolicy.NONPOSITIVE, slot_dtype=torch.int64,
                                              nat_dtype=torch.int64, qsl_dtype=torch.int64, layered=True,
                                              state_dtype=torch.float32),
        "kg-fp16": dict(kg_dtype=torch.float16),
        "kg-fp32-unaligned": dict(kg_dtype=torch.float32, aligned=False),
        "destinations-layers-nonpositive": dict(has_dst=True, layered=True, null_policy=NullSlotPolicy.NONPOSITIVE),
        "destinations-int64-unaligned-fp32": dict(has_dst=True, slot_dtype=torch.int64, aligned=False,
                                                  state_dtype=torch.float32),
    }
    for name, flag in flags.items():
        out[name] = {**BASE, **flag}
    for state in (torch.bfloat16, torch.float32):
        for layered in (False, True):
            name = f"ring8-{'bf16' if state == torch.bfloat16 else 'fp32'}-{'layers' if layered else 'single'}"
            out[name] = {**BASE, "state_dtype": state, "layered": layered, "tile_v": 128, "bulk_ring": 8}
    for state in (torch.bfloat16, torch.float32):
        out[f"ring8-{'bf16' if state == torch.bfloat16 else 'fp32'}-layers-destinations"] = {
            **BASE, "state_dtype": state, "layered": True, "tile_v": 128, "bulk_ring": 8, "has_dst": True,
            "null_policy": NullSlotPolicy.NONPOSITIVE}
    out["ring2-softplus-int64"] = {**BASE, "tile_v": 128, "bulk_ring": 2, "gate": GateMode.SOFTPLUS,
                                   "slot_dtype": torch.int64, "nat_dtype": torch.int64, "qsl_dtype": torch.int64}
    return out


VARIANTS = _variants()


@pytest.mark.sm100_share(lambda params, indices: list(VARIANTS).index(params["name"]) % 3 == 0)  # see conftest
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_commit_variant_compiles(name, arch):
    assert R.compile_variant(R.variant_key(**VARIANTS[name]), arch) is not None


def _ptx(tmp_path, arch, **variant):
    R.compile_variant(R.variant_key(**{**BASE, **variant}), arch, f"--keep-ptx --dump-dir {tmp_path}")
    (ptx,) = list(tmp_path.glob("*.ptx"))
    return ptx


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not on PATH")
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("K", [128, 64])
def test_largest_tile_does_not_spill(K, arch, tmp_path, ptxas):
    # Most rows per thread, fp32 checkpoint and kg (widest loads), softplus gate (longest preamble), layered with
    # int64 indices and offsets (most live 64-bit values): the register high-water mark of each head dim.
    ptx = _ptx(tmp_path, arch, head_dim=K, tile_v=R.tile_v_choices(K)[-1], state_dtype=torch.float32,
               kg_dtype=torch.float32, gate=GateMode.SOFTPLUS, layered=True, slot_dtype=torch.int64,
               nat_dtype=torch.int64, qsl_dtype=torch.int64)
    registers, spills = ptxas.registers_and_spills(ptx, arch)
    assert spills == 0, f"{registers} registers, {spills} bytes of spill traffic"


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not on PATH")
def test_the_bf16_tile_64_build_fits_four_ctas_per_sm(tmp_path, ptxas):
    # The schedule's build for B >= 8 at H = 12 (vLLM's form: lower-bound gate, int32 offsets and indices): at most
    # 128 registers, so four CTAs of 128 threads stay resident. Measured on the H200 (docs/recoverssm.md): at 130
    # registers (three CTAs) the commit took 10-12% longer at B = 64, 128 and 512.
    registers, spills = ptxas.registers_and_spills(_ptx(tmp_path, "sm_90a"), "sm_90a")
    assert registers <= 128 and spills == 0, f"{registers} registers, {spills} bytes of spill traffic"


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not on PATH")
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("heavy", [False, True], ids=["schedule", "heaviest"])
def test_the_tile_32_single_layer_build_fits_five_ctas_per_sm_without_spilling(heavy, arch, tmp_path, ptxas):
    # The fp32 schedule's build (tile 32) is capped to five resident CTAs (96 registers) on sm_90a; the cap must not
    # spill, also in its heaviest single-layer form (fp32 kg, softplus gate, int64 indices, unaligned). sm_100a is
    # left uncapped (capped it spills): it must not spill either.
    variant = dict(state_dtype=torch.float32, tile_v=32)
    if heavy:
        variant.update(kg_dtype=torch.float32, gate=GateMode.SOFTPLUS, slot_dtype=torch.int64, nat_dtype=torch.int64,
                       qsl_dtype=torch.int64, aligned=False)
    registers, spills = ptxas.registers_and_spills(_ptx(tmp_path, arch, **variant), arch)
    assert spills == 0, f"{registers} registers, {spills} bytes of spill traffic"
    assert registers <= 96 or arch != "sm_90a", f"{registers} registers"


@pytest.mark.parametrize("layered", [False, True], ids=["single", "layers"])
def test_aligned_build_moves_checkpoint_rows_and_kg_in_16_byte_vectors(layered, tmp_path):
    # The layer offset is declared a multiple of a vector (the host checks every layer's alignment), so the
    # layered build keeps layer 0's 16-byte accesses: per thread 8 checkpoint rows (tile 64) in and out, and a k
    # and a g run of the token it prepares.
    text = _ptx(tmp_path, "sm_90a", layered=layered).read_text()
    assert text.count("ld.global.cs.v4") >= 8 + 2
    assert text.count("st.global.cs.v4") >= 8


def test_unaligned_build_has_no_vector_global_access(tmp_path):
    text = _ptx(tmp_path, "sm_90a", aligned=False, layered=True).read_text()
    assert "ld.global.cs.v4" not in text and "st.global.cs.v4" not in text


@pytest.mark.parametrize("K,tile_v", [(128, 64), (64, 16)])
def test_smem_estimate_matches_the_compiled_launch(K, tile_v):
    # the shared memory the compiled launch asks for (a constant of the host code) is the kernel's own count: 20 KiB
    # at K=128 tile 64, under the 48 KiB a launch gets without opting in
    module = R.compile_variant(R.variant_key(**{**BASE, "head_dim": K, "tile_v": tile_v}), "sm_90a").ir_module
    kernel = R.RecoverSSMCommitKernel(head_dim=K, gate=GateMode.LOWER_BOUND, use_qk_l2norm=True, has_dt_bias=True,
                                      has_qsl=True, layered=False, tile_v=tile_v, aligned=True)
    assert f"llvm.mlir.constant({kernel.smem_bytes()} : i64)" in str(module)
    assert kernel.smem_bytes() <= 48 * 1024


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not on PATH")
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_bulk_ring_does_not_spill_and_moves_the_state_by_bulk_copies(state_dtype, arch, tmp_path, ptxas):
    # its heaviest form (softplus gate, int64 indices and offsets, layered, fp32 kg): no spill; the state's only
    # global accesses are the 1-D bulk copies (a thread-level state load would mean the ring was bypassed)
    ptx = _ptx(tmp_path, arch, state_dtype=state_dtype, tile_v=128, bulk_ring=8, gate=GateMode.SOFTPLUS,
               layered=True, slot_dtype=torch.int64, nat_dtype=torch.int64, qsl_dtype=torch.int64,
               kg_dtype=torch.float32)
    registers, spills = ptxas.registers_and_spills(ptx, arch)
    assert spills == 0, f"{registers} registers, {spills} bytes of spill traffic"
    text = ptx.read_text()
    assert "cp.async.bulk.shared::cluster.global" in text and "cp.async.bulk.global.shared::cta" in text


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_ring_smem_estimate_matches_the_compiled_launch(state_dtype):
    variant = {**BASE, "state_dtype": state_dtype, "tile_v": 128, "bulk_ring": 8}
    module = R.compile_variant(R.variant_key(**variant), "sm_90a").ir_module
    kernel = R.RecoverSSMCommitKernel(head_dim=128, gate=GateMode.LOWER_BOUND, use_qk_l2norm=True, has_dt_bias=True,
                                      has_qsl=True, layered=False, tile_v=128, aligned=True, bulk_ring=8)
    nbytes = kernel.smem_bytes(state_dtype.itemsize)
    assert f"llvm.mlir.constant({nbytes} : i64)" in str(module)
    assert nbytes <= 48 * 1024


def test_ring_configs_and_their_fallback():
    bf16 = torch.bfloat16
    ring = R.CommitConfig(128, bulk_ring=8)
    assert R.config_ok(ring, 128) and R.config_ok(R.CommitConfig(64), 128)
    for bad in (R.CommitConfig(64, bulk_ring=8), R.CommitConfig(128, bulk_ring=1), R.CommitConfig(128, bulk_ring=17),
                R.CommitConfig(128)):
        assert not R.config_ok(bad, 128), bad
    assert not R.config_ok(R.CommitConfig(64, bulk_ring=8), 64) and not R.config_ok(ring, 64)
    # eligible: K = 128, aligned, T_max within one chunk of tokens (8 at K = 128); else the register schedule
    assert R.effective_config(ring, 128, True, 8, 768, bf16) == ring
    assert R.effective_config(ring, 128, True, 9, 768, bf16) == R.CommitConfig(64)
    assert R.effective_config(ring, 128, False, 4, 768, bf16) == R.CommitConfig(64)
    assert R.effective_config(ring, 128, True, 9, 40, torch.float32) == R.CommitConfig(16)
    with pytest.raises(ValueError, match="bulk_ring"):
        R.RecoverSSMCommitKernel(head_dim=128, gate=GateMode.LOWER_BOUND, use_qk_l2norm=True, has_dt_bias=True,
                                 has_qsl=True, layered=False, tile_v=128, aligned=False, bulk_ring=8)


def test_a_ring_config_the_call_cannot_take_launches_the_register_path(monkeypatch):
    _, keys = _recorder(monkeypatch)
    state, corr, kg, slots, nat, A_log, dt_bias = _single(T_max=4)
    R.recoverssm_commit(state, corr, kg, slots, nat, A_log, dt_bias, -5.0, config=R.CommitConfig(128, bulk_ring=8))
    state, corr, kg, slots, nat, A_log, dt_bias = _single(T_max=9)
    R.recoverssm_commit(state, corr, kg, slots, nat, A_log, dt_bias, -5.0, config=R.CommitConfig(128, bulk_ring=8))
    assert [(k[11], k[14]) for k in keys] == [(128, 8), (16, 0)]  # (tile_v, bulk_ring)


def test_schedule_policy_by_grid_size():
    bf16, fp32 = torch.bfloat16, torch.float32
    assert R.select_config(1, 128, bf16) == R.select_config(48, 128, bf16) == R.CommitConfig(16)
    assert R.select_config(49, 128, bf16) == R.select_config(96, 128, bf16) == R.CommitConfig(32)
    assert R.select_config(97, 128, bf16) == R.select_config(1 << 40, 64, bf16) == R.CommitConfig(64)
    assert R.select_config(48, 128, fp32) == R.CommitConfig(16)
    assert R.select_config(49, 128, fp32) == R.select_config(1535, 128, fp32) == R.CommitConfig(32)
    # fp32 from 1536 states on (B = 128 at H = 12): the bulk ring at K = 128, the register row at K = 64
    assert R.select_config(1536, 128, fp32) == R.select_config(6144, 128, fp32) == R.CommitConfig(128, bulk_ring=8)
    assert R.select_config(6144, 64, fp32) == R.CommitConfig(32)
    for dtype in (bf16, fp32):
        for K in (64, 128):
            for n in (1, 60, 1000, 6144):
                assert R.config_ok(R.select_config(n, K, dtype), K)


def test_variant_key_normalises_only_what_cannot_change_the_code():
    base = R.variant_key(**BASE)
    assert R.variant_key(**{**BASE, "gate": GateMode.PRECOMPUTED, "has_dt_bias": True}) == \
        R.variant_key(**{**BASE, "gate": GateMode.PRECOMPUTED, "has_dt_bias": False})
    changes = dict(head_dim=64, state_dtype=torch.float32, kg_dtype=torch.float16, gate=GateMode.SOFTPLUS,
                   use_qk_l2norm=False, has_dt_bias=False, qsl_dtype=torch.int64, slot_dtype=torch.int64,
                   nat_dtype=torch.int64, layered=True, tile_v=32, aligned=False,
                   null_policy=NullSlotPolicy.NONPOSITIVE, bulk_ring=8, has_dst=True)
    assert set(changes) == set(BASE)  # every code-generation parameter is varied
    keys = {R.variant_key(**{**BASE, name: value}) for name, value in changes.items()}
    assert base not in keys and len(keys) == len(changes)


# ---- host side, no launch: a recording stand-in for the compiled function ------------------------------------


def _recorder(monkeypatch):
    calls, keys = [], []

    def get_or_compile(key, build, arch=None):
        keys.append(key)
        return lambda *args: calls.append(args)

    monkeypatch.setattr(R._launch, "get_or_compile", get_or_compile)
    monkeypatch.setattr(R._launch, "arch_for", lambda device: "sm_90a")
    return calls, keys


def _single(P=6, HV=4, H=2, K=128, T_max=4, N=3, state_dtype=torch.bfloat16):
    state = torch.zeros(P, HV, K, K, dtype=state_dtype)
    corr = torch.zeros(P, HV, T_max, K)
    kg = torch.zeros(P, HV, T_max, 2 * K, dtype=torch.bfloat16)
    slots = torch.arange(N, dtype=torch.int32)
    nat = torch.ones(N, dtype=torch.int32)
    return state, corr, kg, slots, nat, torch.zeros(H), torch.zeros(H * K)


def test_more_rows_than_grid_z_run_as_several_launches_on_row_views(monkeypatch):
    calls, _ = _recorder(monkeypatch)
    N = 2 * R.GRID_Z_MAX + 5
    state, corr, kg, _, _, A_log, dt_bias = _single()
    slots = torch.zeros(N, 2, dtype=torch.int64)[:, 1]  # a strided column view
    nat = torch.arange(N, dtype=torch.int32)
    qsl = torch.arange(N + 1, dtype=torch.int32)
    dst = torch.arange(N, dtype=torch.int64) + 7
    R.recoverssm_commit(state, corr, kg, slots, nat, A_log, dt_bias, -5.0, query_start_loc=qsl)
    R.recoverssm_commit(state, corr, kg, slots, nat, A_log, dt_bias, -5.0, query_start_loc=qsl,
                        destination_indices=dst)
    assert len(calls) == 6
    starts = [0, R.GRID_Z_MAX, 2 * R.GRID_Z_MAX]
    for i, ((s, c, g, sl, na, q, *_, d, lb), r0) in enumerate(zip(calls, starts * 2)):
        r1 = min(r0 + R.GRID_Z_MAX, N)
        assert s is state and c is corr and g is kg and lb == -5.0
        assert sl.shape[0] == na.shape[0] == r1 - r0 and q.shape[0] == r1 - r0 + 1
        assert int(na[0]) == r0 and int(q[0]) == r0 and int(q[-1]) == r1
        assert sl.stride() == slots.stride()
        if i < 3:
            assert d is None
        else:  # the destinations move with their rows
            assert d.shape[0] == r1 - r0 and int(d[0]) == r0 + 7


def test_zero_rows_launch_nothing(monkeypatch):
    calls, keys = _recorder(monkeypatch)
    state, corr, kg, _, _, A_log, dt_bias = _single()
    out = R.recoverssm_commit(state, corr, kg, torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                              A_log, dt_bias, -5.0)
    assert out is state and calls == [] and keys == []


def test_the_gate_form_follows_A_log_and_lower_bound(monkeypatch):
    calls, keys = _recorder(monkeypatch)
    state, corr, kg, slots, nat, A_log, dt_bias = _single()
    R.recoverssm_commit(state, corr, kg, slots, nat, A_log, dt_bias, -5.0)
    R.recoverssm_commit(state, corr, kg, slots, nat, A_log, None, None)
    R.recoverssm_commit(state, corr, kg, slots, nat, None, dt_bias, -5.0)
    gates = [k[4] for k in keys]
    assert gates == [GateMode.LOWER_BOUND, GateMode.SOFTPLUS, GateMode.PRECOMPUTED]
    assert [k[6] for k in keys] == [True, False, False]  # dt_bias present
    assert calls[2][6] is None and calls[2][7] is None  # the precomputed gate reads no gate parameter
    assert calls[0][-1] == -5.0


@pytest.mark.parametrize("bad", ["config", "policy", "head-dim", "heads", "dt-bias", "counts", "offsets",
                                 "destinations", "destination-dtype"])
def test_a_launch_the_kernel_cannot_take_is_refused_before_launch(bad, monkeypatch):
    # what the kernel would index out of its tensors (or cannot build) is refused on the host, naming the argument
    calls, _ = _recorder(monkeypatch)
    state, corr, kg, slots, nat, A_log, dt_bias = _single()
    kw = {}
    match = {"config": "^config: expected a CommitConfig", "policy": "^null_policy: expected",
             "head-dim": "^checkpoint_state: expected", "heads": "^A_log: expected",
             "dt-bias": r"^dt_bias: expected \[H\*K\] = \[256\]", "counts": "^num_accepted_tokens: expected",
             "offsets": r"^query_start_loc: expected \[N \+ 1\] = \[4\]",
             "destinations": r"^destination_indices: expected \[N\] = \[3\]",
             "destination-dtype": r"^destination_indices: expected .*torch.int32"}[bad]
    if bad == "config":
        kw["config"] = R.CommitConfig(128)  # 16 rows per thread at K=128
    elif bad == "policy":
        kw["null_policy"] = "nonpositive"
    elif bad == "head-dim":
        state = torch.zeros(6, 4, 96, 96)
    elif bad == "heads":
        A_log = torch.zeros(3)  # 3 does not divide HV = 4
    elif bad == "dt-bias":
        dt_bias = torch.zeros(128)
    elif bad == "counts":
        nat = nat[:2]
    elif bad == "destinations":
        kw["destination_indices"] = slots[:2]
    elif bad == "destination-dtype":
        kw["destination_indices"] = slots.long()
    else:
        kw["query_start_loc"] = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(KDAError, match=match):
        R.recoverssm_commit(state, corr, kg, slots, nat, A_log, dt_bias, -5.0, **kw)
    assert calls == []


def _layers(L=3, shared=False, **kw):
    """L layers' (state, corr, kg): separately allocated, or pages of one buffer each (shared)."""
    P, HV, K, T_max = 4, 2, 128, 3
    if shared:
        state_buf = torch.zeros(L, P, HV, K, K + 0, dtype=torch.bfloat16)
        corr_buf = torch.zeros(P, L, HV, T_max, K)  # layers interleaved inside each page
        kg_buf = torch.zeros(P, HV, L, T_max, 2 * K, dtype=torch.bfloat16)
        return ([state_buf[i] for i in range(L)], [corr_buf[:, i] for i in range(L)],
                [kg_buf[:, :, i] for i in range(L)])
    return ([torch.zeros(P, HV, K, K, dtype=torch.bfloat16) for _ in range(L)],
            [torch.zeros(P, HV, T_max, K) for _ in range(L)],
            [torch.zeros(P, HV, T_max, 2 * K, dtype=torch.bfloat16) for _ in range(L)])


@pytest.mark.parametrize("shared", [False, True], ids=["separate", "pages-of-one-buffer"])
def test_plan_offsets_are_each_layers_element_distance_from_layer_0(shared):
    states, corrs, kgs = _layers(shared=shared)
    A_logs = [torch.full((1,), float(i)) for i in range(3)]
    plan = R.RecoverSSMCommitPlan(states, corrs, kgs, A_logs, None, -5.0)
    assert plan.offsets.dtype == torch.int64 and plan.offsets.shape == (3, 3)
    for i in range(3):
        for col, seq in enumerate((states, corrs, kgs)):
            assert (seq[0].data_ptr() + int(plan.offsets[i, col]) * seq[0].element_size()) == seq[i].data_ptr()
    assert plan.A_log.shape == (3, 1) and plan.A_log[:, 0].tolist() == [0.0, 1.0, 2.0]
    assert plan.dt_bias is None


def test_plan_commit_is_one_launch_over_every_layer(monkeypatch):
    calls, keys = _recorder(monkeypatch)
    states, corrs, kgs = _layers()
    plan = R.RecoverSSMCommitPlan(states, corrs, kgs, [torch.zeros(1)] * 3, [torch.zeros(128)] * 3, None,
                                  null_policy=NullSlotPolicy.NONPOSITIVE)
    slots, nat = torch.tensor([1, 2], dtype=torch.int64), torch.tensor([1, 3], dtype=torch.int64)
    plan.commit(slots, nat)
    (call,) = calls
    assert call[0] is states[0] and call[1] is corrs[0] and call[2] is kgs[0]
    assert call[5] is None and call[6] is plan.A_log and call[7] is plan.dt_bias and call[8] is plan.offsets
    (key,) = keys
    assert key[10] is True and key[4] == GateMode.SOFTPLUS and key[13] == NullSlotPolicy.NONPOSITIVE
    assert key[8] == key[9] == torch.int64


def test_plan_refreshes_its_stacked_gate_parameters_in_place():
    # weights loaded into the layers' tensors after the plan was built reach the same stacked buffers (a graph
    # captured before reads them)
    states, corrs, kgs = _layers()
    A_logs, dt_biases = [torch.zeros(2) for _ in range(3)], [torch.zeros(256) for _ in range(3)]
    plan = R.RecoverSSMCommitPlan(states, corrs, kgs, A_logs, dt_biases, -5.0)
    a_ptr, d_ptr = plan.A_log.data_ptr(), plan.dt_bias.data_ptr()
    A_logs[2].fill_(3.0)
    dt_biases[1][7] = -1.0
    assert plan.A_log[2, 0] == 0.0
    plan.refresh_gate_parameters()
    assert plan.A_log.data_ptr() == a_ptr and plan.dt_bias.data_ptr() == d_ptr
    assert plan.A_log[2].tolist() == [3.0, 3.0] and plan.A_log[:2].abs().sum() == 0
    assert plan.dt_bias[1, 7] == -1.0 and plan.dt_bias.abs().sum() == 1.0


def test_plan_takes_a_list_of_no_dt_bias_as_none():
    states, corrs, kgs = _layers()
    plan = R.RecoverSSMCommitPlan(states, corrs, kgs, [torch.zeros(2)] * 3, [None] * 3, -5.0)
    assert plan.dt_bias is None and plan.A_log.shape == (3, 2)
    with pytest.raises(KDAError, match=r"^dt_biases\[1\]: expected 256 values"):
        R.RecoverSSMCommitPlan(states, corrs, kgs, [torch.zeros(2)] * 3, [torch.zeros(256), None, None], -5.0)


@pytest.mark.parametrize("bad", ["stride", "dtype", "count", "grid-y"])
def test_plan_refuses_layers_it_cannot_address_from_layer_0(bad):
    states, corrs, kgs = _layers()
    match = {"stride": r"^kg_caches\[1\]: expected layer 0's shape", "dtype": r"^checkpoint_states\[2\]: expected",
             "count": "^correction_caches: expected 3 layers", "grid-y": "^checkpoint_states: expected at most"}[bad]
    if bad == "stride":
        kgs[1] = torch.zeros(4, 2, 3, 2 * 128 + 8, dtype=torch.bfloat16)[..., : 2 * 128]
    elif bad == "dtype":
        states[2] = states[2].float()
    elif bad == "count":
        corrs = corrs[:2]
    else:
        HV = R.GRID_Y_MAX // 2 + 1  # two layers of HV heads: one past the grid y limit (broadcast views, no memory)
        states = [torch.zeros(1, 1, 128, 128, dtype=torch.bfloat16).expand(1, HV, 128, 128)] * 2
        corrs = [torch.zeros(1, 1, 1, 128).expand(1, HV, 1, 128)] * 2
        kgs = [torch.zeros(1, 1, 1, 256, dtype=torch.bfloat16).expand(1, HV, 1, 256)] * 2
    with pytest.raises(KDAError, match=match):
        R.RecoverSSMCommitPlan(states, corrs, kgs, None, None, None)
