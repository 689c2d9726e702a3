"""CPU compile checks of the generic recurrent kernel: every variant axis builds for sm_90a and sm_100a, the
largest-register variants do not spill, and the compile-cache key names every code-generation parameter.

No GPU needed: conftest sets ``CUTE_DSL_ARCH`` and ``compile_variant`` passes ``--gpu-arch`` per compile. The state
configurations are crossed with both head dims and both alignment classes; tiles, gates, dtypes and the small
const_expr flags are each varied on a fixed base (crossing them all would be thousands of compiles).
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from kda_core.contracts import GateMode, NullSlotPolicy
from kda_cute import generic as R

ARCHS = ("sm_90a", "sm_100a")

BASE = dict(
    head_dim=128, act_dtype=torch.bfloat16, g_dtype=torch.bfloat16, beta_dtype=torch.bfloat16,
    state_mode=R.StateMode.SPEC, state_dtype=torch.bfloat16, store_final=False, has_num_accepted=True,
    varlen=False, cu_dtype=None, gate=GateMode.LOWER_BOUND, beta_is_logit=True, use_qk_l2norm=True,
    has_dt_bias=True, tile_v=32, aligned=True, null_policy=NullSlotPolicy.OUT_OF_RANGE, slot_dtype=torch.int32,
    nat_dtype=torch.int32,
)

STATE_CONFIGS = {
    "pool-bf16": dict(state_mode=R.StateMode.POOL, state_dtype=torch.bfloat16),
    "pool-fp32": dict(state_mode=R.StateMode.POOL, state_dtype=torch.float32),
    "spec-bf16-nat": dict(state_mode=R.StateMode.SPEC, state_dtype=torch.bfloat16, has_num_accepted=True),
    "spec-fp32-nonat": dict(state_mode=R.StateMode.SPEC, state_dtype=torch.float32, has_num_accepted=False),
    "dense-zeros-final": dict(state_mode=R.StateMode.DENSE, state_dtype=None, store_final=True),
    "dense-bf16-nofinal": dict(state_mode=R.StateMode.DENSE, state_dtype=torch.bfloat16, store_final=False),
    "dense-fp16-final": dict(state_mode=R.StateMode.DENSE, state_dtype=torch.float16, store_final=True),
}


def _variants():
    out = {}
    for name, state in STATE_CONFIGS.items():
        for K in (128, 64):
            for aligned in (True, False):
                out[f"{name}-K{K}-{'al' if aligned else 'unal'}"] = {
                    **BASE, **state, "head_dim": K, "aligned": aligned, "tile_v": R.tile_v_choices(K)[-1]}
    for K in (128, 64):
        for tile in R.tile_v_choices(K):
            out[f"tile{tile}-K{K}"] = {**BASE, "head_dim": K, "tile_v": tile}
    for gate in GateMode:
        out[f"gate-{gate.value}"] = {**BASE, "gate": gate}
    flags = {
        "sigmoided-beta": dict(beta_is_logit=False),
        "no-l2norm": dict(use_qk_l2norm=False),
        "no-dt-bias": dict(has_dt_bias=False),
        "varlen-int32": dict(varlen=True, cu_dtype=torch.int32),
        "varlen-int64-dense": dict(varlen=True, cu_dtype=torch.int64, state_mode=R.StateMode.DENSE, state_dtype=None,
                                   store_final=True),
        "fp32-act-gate-beta": dict(act_dtype=torch.float32, g_dtype=torch.float32, beta_dtype=torch.float32),
        "fp16-act": dict(act_dtype=torch.float16),
        "precomputed-fp32-g": dict(gate=GateMode.PRECOMPUTED, g_dtype=torch.float32, beta_dtype=torch.float32),
        # the nonpositive null-slot policy (vLLM) in every mode that reads slots
        "nonpositive-spec-nat": dict(null_policy=NullSlotPolicy.NONPOSITIVE),
        "nonpositive-spec-nonat-varlen": dict(null_policy=NullSlotPolicy.NONPOSITIVE, has_num_accepted=False,
                                              varlen=True, cu_dtype=torch.int32),
        "nonpositive-pool-fp32-unaligned": dict(null_policy=NullSlotPolicy.NONPOSITIVE, state_mode=R.StateMode.POOL,
                                                state_dtype=torch.float32, aligned=False),
        # int64 indices (SGLang, FlashInfer): slots of both modes and the accepted counts
        "int64-spec-slots-nat": dict(slot_dtype=torch.int64, nat_dtype=torch.int64),
        "int64-pool-varlen": dict(slot_dtype=torch.int64, state_mode=R.StateMode.POOL, varlen=True,
                                  cu_dtype=torch.int64),
    }
    for name, flag in flags.items():
        out[name] = {**BASE, **flag}
    return out


VARIANTS = _variants()


@pytest.mark.sm100_share(lambda params, indices: list(VARIANTS).index(params["name"]) % 3 == 0)  # see conftest
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_recurrent_variant_compiles(name, arch):
    assert R.compile_variant(R.variant_key(**VARIANTS[name]), arch) is not None


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not on PATH")
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("K", [128, 64])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
def test_largest_tile_does_not_spill(K, aligned, arch, tmp_path, ptxas):
    # Most rows per thread, fp32 activations (widest raw prefetch), softplus gate (longest preamble), spec mode
    # with varlen (most live indices): the register high-water mark of each head dim.
    variant = {**BASE, "head_dim": K, "tile_v": R.tile_v_choices(K)[-1], "aligned": aligned,
               "act_dtype": torch.float32, "gate": GateMode.SOFTPLUS, "state_dtype": torch.float32,
               "varlen": True, "cu_dtype": torch.int64}
    R.compile_variant(R.variant_key(**variant), arch, ptxas.keep(tmp_path))
    (ptx,) = list(tmp_path.glob("*.ptx"))
    registers, spills = ptxas.registers_and_spills(ptx, arch)
    # The unaligned corner (scalar accesses, fp32 activations) sits at ptxas's 128-register occupancy step: at
    # K=64 ptxas keeps 4 CTAs per SM by spilling one 8-byte scalar of the sequence setup (remarks point at the
    # cu_seqlens read, outside the token loop). Allow that much there; the aligned variants must not spill.
    allowed = 0 if aligned else 64
    assert spills <= allowed, f"{registers} registers, {spills} bytes of spill traffic"
    assert registers <= 255


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not on PATH")
@pytest.mark.parametrize("arch", ARCHS)
def test_int64_indices_at_the_largest_tile_do_not_spill(arch, tmp_path, ptxas):
    # The register high-water variant of K=128 (as above) with int64 slot indices and counts: a 64-bit write slot per
    # token and 64-bit compares.
    variant = {**BASE, "tile_v": R.tile_v_choices(128)[-1], "act_dtype": torch.float32, "gate": GateMode.SOFTPLUS,
               "state_dtype": torch.float32, "varlen": True, "cu_dtype": torch.int64, "slot_dtype": torch.int64,
               "nat_dtype": torch.int64, "null_policy": NullSlotPolicy.NONPOSITIVE}
    R.compile_variant(R.variant_key(**variant), arch, ptxas.keep(tmp_path))
    (ptx,) = list(tmp_path.glob("*.ptx"))
    registers, spills = ptxas.registers_and_spills(ptx, arch)
    assert spills == 0 and registers <= 255, f"{registers} registers, {spills} bytes of spill traffic"


def test_every_code_generation_parameter_changes_the_cache_key():
    base_key = R.variant_key(**BASE)
    changes = dict(
        head_dim=64, act_dtype=torch.float32, g_dtype=torch.float32, beta_dtype=torch.float32,
        state_mode=R.StateMode.POOL, state_dtype=torch.float32, has_num_accepted=False, varlen=True,
        gate=GateMode.SOFTPLUS, beta_is_logit=False, use_qk_l2norm=False, has_dt_bias=False, tile_v=16,
        aligned=False, null_policy=NullSlotPolicy.NONPOSITIVE, slot_dtype=torch.int64, nat_dtype=torch.int64,
    )
    assert set(changes) | {"store_final", "cu_dtype"} == set(BASE)
    for name, value in changes.items():
        assert R.variant_key(**{**BASE, name: value}) != base_key, name
    dense = {**BASE, "state_mode": R.StateMode.DENSE}
    assert R.variant_key(**{**dense, "store_final": True}) != R.variant_key(**{**dense, "store_final": False})
    varlen = {**BASE, "varlen": True, "cu_dtype": torch.int32}
    assert R.variant_key(**varlen) != R.variant_key(**{**varlen, "cu_dtype": torch.int64})


def test_facts_that_cannot_change_the_code_share_one_cache_entry():
    pre = {**BASE, "gate": GateMode.PRECOMPUTED}
    assert R.variant_key(**{**pre, "has_dt_bias": True}) == R.variant_key(**{**pre, "has_dt_bias": False})
    pool = {**BASE, "state_mode": R.StateMode.POOL}
    assert R.variant_key(**{**pool, "has_num_accepted": True}) == R.variant_key(**{**pool, "has_num_accepted": False})
    assert R.variant_key(**{**pool, "store_final": True}) == R.variant_key(**{**pool, "store_final": False})
    assert R.variant_key(**{**BASE, "cu_dtype": torch.int64}) == R.variant_key(**BASE)  # not varlen
    dense = {**BASE, "state_mode": R.StateMode.DENSE}  # no slot to be null, no index to read
    assert R.variant_key(**{**dense, "null_policy": NullSlotPolicy.NONPOSITIVE}) == R.variant_key(**dense)
    assert R.variant_key(**{**dense, "slot_dtype": torch.int64}) == R.variant_key(**dense)
    no_nat = {**BASE, "has_num_accepted": False}
    assert R.variant_key(**{**no_nat, "nat_dtype": torch.int64}) == R.variant_key(**no_nat)


@pytest.mark.parametrize("K", [128, 64])
def test_schedule_picks_a_legal_tile_that_grows_with_the_call(K):
    tiles = [R.select_config(n, K).tile_v for n in (1, 12, 96, 192, 193, 768, 1536, 1537, 6144, 1 << 20)]
    assert all(t in R.tile_v_choices(K) for t in tiles)
    assert tiles == sorted(tiles)
    assert dataclasses.is_dataclass(R.select_config(1, K))


def test_schedule_policy_returns_frozen_configs_of_its_table():
    cfg = R.select_config(1, 128)
    assert isinstance(cfg, R.GenericConfig) and cfg == R.GenericConfig(16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.tile_v = 64
    assert R.select_config(1 << 20, 64) == R.GenericConfig(64)


@pytest.mark.parametrize("config", [R.GenericConfig(16), R.GenericConfig(64)], ids=["tile16", "tile64"])
def test_a_given_config_decides_the_variant(config, monkeypatch):
    calls = _spy_launches(monkeypatch)
    q, v = torch.randn(1, 2, 2, 128).bfloat16(), torch.randn(1, 2, 2, 128).bfloat16()
    R.kda_recurrent_fwd(q, q, v, v, torch.randn(1, 2, 2).bfloat16(), config=config)
    R.kda_recurrent_fwd(q, q, v, v, torch.randn(1, 2, 2).bfloat16())  # the policy: tile 16 for 2 states
    dense_precomputed = dict(
        head_dim=128, act_dtype=torch.bfloat16, g_dtype=torch.bfloat16, beta_dtype=torch.bfloat16,
        state_mode=R.StateMode.DENSE, state_dtype=None, store_final=False, has_num_accepted=False, varlen=False,
        cu_dtype=None, gate=GateMode.PRECOMPUTED, beta_is_logit=False, use_qk_l2norm=True, has_dt_bias=False,
        aligned=True)
    assert [key for key, _ in calls] == [R.variant_key(**dense_precomputed, tile_v=config.tile_v),
                                         R.variant_key(**dense_precomputed, tile_v=16)]


@pytest.mark.parametrize("policy", list(NullSlotPolicy), ids=lambda p: p.value)
def test_the_null_policy_decides_the_variant(policy, monkeypatch):
    calls = _spy_launches(monkeypatch)
    q, v = torch.randn(2, 2, 2, 64).bfloat16(), torch.randn(2, 2, 2, 64).bfloat16()
    pool = torch.randn(4, 2, 64, 64).bfloat16()
    R.kda_recurrent_fwd(q, q, v, v, torch.randn(2, 2, 2).bfloat16(), initial_state=pool,
                        ssm_state_indices=torch.tensor([1, 3], dtype=torch.int32), null_policy=policy)
    ((key, _),) = calls
    other = next(p for p in NullSlotPolicy if p is not policy)
    assert policy in key and other not in key


def test_a_null_policy_that_is_not_the_enum_raises_naming_it():
    from kda_core.errors import KDAError

    q, v = torch.randn(1, 2, 2, 64).bfloat16(), torch.randn(1, 2, 2, 64).bfloat16()
    with pytest.raises(KDAError, match="^null_policy: expected a kda_core.contracts.NullSlotPolicy"):
        R.kda_recurrent_fwd(q, q, v, v, torch.randn(1, 2, 2).bfloat16(), null_policy="nonpositive")


@pytest.mark.parametrize("config", [R.GenericConfig(128), R.GenericConfig(8), (32,)], ids=["too-big", "k64", "tuple"])
def test_an_illegal_config_raises_naming_config_before_launch(config, monkeypatch):
    from kda_core.errors import KDAError

    calls = _spy_launches(monkeypatch)
    q, v = torch.randn(1, 2, 2, 64).bfloat16(), torch.randn(1, 2, 2, 64).bfloat16()
    with pytest.raises(KDAError, match="^config: expected a GenericConfig whose tile_v is one of"):
        R.kda_recurrent_fwd(q, q, v, v, torch.randn(1, 2, 2).bfloat16(), config=config)
    assert calls == []


def test_tile_choices_keep_whole_row_groups_and_at_most_eight_rows_per_thread():
    for K in (128, 64):
        for tile in R.tile_v_choices(K):
            assert tile % R.row_groups(K) == 0
            assert tile // R.row_groups(K) <= R.MAX_ROWS_PER_THREAD
    with pytest.raises(ValueError, match="tile_v"):
        R.KDARecurrent(**{**_kernel_args(), "tile_v": 8, "head_dim": 64})


def _kernel_args():
    return dict(head_dim=128, state_mode=R.StateMode.POOL, state_dtype=None, store_final=False,
                has_num_accepted=False, varlen=False, gate=GateMode.LOWER_BOUND, beta_is_logit=True,
                use_qk_l2norm=True, has_dt_bias=True, tile_v=32, aligned=True)


def test_empty_calls_launch_nothing_and_return_zero_outputs():
    """No sequence (varlen with cu_seqlens = [0]) or no token: the output is zero-filled on the host side and the
    dense final state is the initial one; nothing is compiled or launched (runs on CPU tensors)."""
    from kda_cute import _launch

    before = _launch.cache_size()
    q = torch.randn(1, 0, 2, 64)
    v = torch.randn(1, 0, 2, 64)
    init = torch.randn(1, 2, 64, 64)
    o, final = R.kda_recurrent_fwd(q, q, v, v, torch.randn(1, 0, 2), initial_state=init, output_final_state=True)
    assert o.shape == (1, 0, 2, 64) and torch.equal(final, init)
    out = torch.full((1, 3, 2, 64), 7.0, dtype=torch.bfloat16)
    q3, v3 = torch.randn(1, 3, 2, 64), torch.randn(1, 3, 2, 64)
    o, final = R.kda_recurrent_fwd(q3, q3, v3, v3, torch.randn(1, 3, 2), cu_seqlens=torch.zeros(1, dtype=torch.int32),
                                   output=out, output_final_state=True)
    assert o is out and torch.count_nonzero(out) == 0 and final.shape == (0, 2, 64, 64)
    assert _launch.cache_size() == before


def _spy_launches(monkeypatch):
    """Route kda_recurrent_fwd's compile through the real cache, but record the launch instead of running it."""
    import inspect

    from kda_cute import _launch

    calls = []
    real = _launch.get_or_compile
    n_params = len(inspect.signature(R.KDARecurrent.__call__).parameters) - 2  # minus self and the env stream

    def spy(key, build, arch=None):
        assert real(key, build, arch) is not None

        def launch(*args):
            assert len(args) == n_params, f"{len(args)} launch arguments, the kernel takes {n_params}"
            calls.append((key, args))

        return launch

    monkeypatch.setattr(_launch, "get_or_compile", spy)
    return calls


def _host_call(mode, B=2, T=3, H=2, HV=4, K=64):
    """(q, k, v, g, beta, keyword arguments, pool) of one CPU call of ``mode``: pool | spec | dense | varlen."""
    q, k = torch.randn(B, T, H, K).bfloat16(), torch.randn(B, T, H, K).bfloat16()
    v, g = torch.randn(B, T, HV, K).bfloat16(), torch.randn(B, T, HV, K).bfloat16()
    beta = torch.randn(B, T, HV).bfloat16()
    kw = dict(A_log=torch.zeros(H), dt_bias=torch.zeros(H, K), lower_bound=-5.0, use_gate_in_kernel=True)
    pool = torch.randn(5, HV, K, K)
    if mode == "pool":
        kw.update(initial_state=pool, ssm_state_indices=torch.tensor([4, 0], dtype=torch.int32))
    elif mode == "spec":
        kw.update(initial_state=pool, ssm_state_indices=torch.arange(B * T, dtype=torch.int32).view(B, T) % 5,
                  num_accepted_tokens=torch.tensor([1, 3], dtype=torch.int32))
    elif mode == "dense":
        kw.update(initial_state=torch.randn(B, HV, K, K).bfloat16(), output_final_state=True)
    else:
        q, k, v, g, beta = (x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta))
        kw.update(cu_seqlens=torch.tensor([0, 2, 6], dtype=torch.int64), output_final_state=True)
    return q, k, v, g, beta, kw, pool


@pytest.mark.parametrize("mode", ["pool", "spec", "dense", "varlen"])
def test_host_path_compiles_its_variant_and_passes_every_kernel_argument(mode, monkeypatch):
    """The entry point builds its variant through the compile cache and hands the kernel one argument per
    parameter, in order (CPU tensors: the launch itself is recorded, not run)."""
    calls = _spy_launches(monkeypatch)
    B, T, H, HV, K = 2, 3, 2, 4, 64
    q, k, v, g, beta, kw, pool = _host_call(mode, B, T, H, HV, K)
    o, final = R.kda_recurrent_fwd(q, k, v, g, beta, **kw)
    ((key, args),) = calls
    expected_mode = {"pool": R.StateMode.POOL, "spec": R.StateMode.SPEC}.get(mode, R.StateMode.DENSE)
    assert key == R.variant_key(
        head_dim=K, act_dtype=torch.bfloat16, g_dtype=torch.bfloat16, beta_dtype=torch.bfloat16,
        state_mode=expected_mode, state_dtype=None if mode == "varlen" else kw["initial_state"].dtype,
        store_final=mode in ("dense", "varlen"), has_num_accepted=mode == "spec", varlen=mode == "varlen",
        cu_dtype=torch.int64, gate=GateMode.LOWER_BOUND, beta_is_logit=False, use_qk_l2norm=True, has_dt_bias=True,
        tile_v=R.select_config(B * HV, K).tile_v, aligned=True,
    )
    assert args[0] is q and args[12] is o
    assert args[5].shape == (H,) and args[6].shape == (H * K,)  # dt_bias [H, K] flattened
    if mode in ("pool", "spec"):
        assert final is pool and args[7] is pool and args[8] is None
    else:
        assert final.dtype == torch.float32 and args[8] is final
    assert (args[10] is not None) == (mode == "spec")
    assert (args[11] is not None) == (mode == "varlen")


def test_the_keyword_entry_takes_the_bundles_fields_then_the_launch_options():
    import inspect

    from kda_core.call_args import RecurrentArgs, SpecArgs

    params = list(inspect.signature(R.kda_recurrent_fwd).parameters.values())
    assert [(p.name, p.default) for p in params] == [
        (n, RecurrentArgs._field_defaults.get(n, inspect.Parameter.empty)) for n in RecurrentArgs._fields
    ] + list(SpecArgs._field_defaults.items()) + [("config", None), ("null_policy", NullSlotPolicy.OUT_OF_RANGE)]


@pytest.mark.parametrize("gate", ["lower_bound", "precomputed"])
@pytest.mark.parametrize("mode", ["pool", "spec", "dense", "varlen"])
def test_the_validated_entry_launches_what_the_keyword_entry_launches(mode, gate, monkeypatch):
    """run(call, args), the facade's entry, reads mode, counts, gate and scalars from kda-core's description of the
    bundle; the launch is the one kda_recurrent_fwd makes of the same arguments."""
    from kda_core.call_args import RecurrentArgs
    from kda_core.validation import validate_recurrent

    calls = _spy_launches(monkeypatch)
    q, k, v, g, beta, kw, _ = _host_call(mode)
    if gate == "precomputed":  # g is the log-decay; the gate parameters are ignored, the lower bound included
        g = -torch.rand(g.shape)
        kw.update(use_gate_in_kernel=False, scale=0.3)
    args = RecurrentArgs(q, k, v, g, beta, **kw)
    o_run, final_run = R.run(validate_recurrent(args), args)
    o_fwd, final_fwd = R.kda_recurrent_fwd(q, k, v, g, beta, **kw)
    (key_run, launch_run), (key_fwd, launch_fwd) = calls
    assert key_run == key_fwd
    assert launch_run[12] is o_run and launch_fwd[12] is o_fwd and o_run.shape == o_fwd.shape
    assert launch_run[-2:] == launch_fwd[-2:] == ((0.3, -1.0) if gate == "precomputed" else (64**-0.5, -5.0))
    for a, b in zip(launch_run[:12], launch_fwd[:12]):
        if a is not final_run:
            assert (a is None and b is None) or (a.data_ptr(), a.shape) == (b.data_ptr(), b.shape)
    assert (final_run is None) == (final_fwd is None)


def test_varlen_offsets_are_clamped_in_64_bits_before_narrowing(tmp_path):
    """The int64 cu_seqlens variant clamps each offset to [0, T_total] with 64-bit min / max (an offset past 2^31
    must clamp, not wrap), and the zero-fill loops run from those clamped values."""
    variant = {**BASE, "varlen": True, "cu_dtype": torch.int64, "state_mode": R.StateMode.POOL}
    R.compile_variant(R.variant_key(**variant), "sm_90a", f"--keep-ptx --dump-dir {tmp_path}")
    (ptx,) = list(tmp_path.glob("*.ptx"))
    text = ptx.read_text()
    assert text.count("min.s64") >= 2 and text.count("max.s64") >= 2


def test_no_value_head_launches_nothing(monkeypatch):
    calls = _spy_launches(monkeypatch)
    q = torch.randn(2, 3, 2, 64)
    v = torch.randn(2, 3, 0, 64)
    o, final = R.kda_recurrent_fwd(q, q, v, v, torch.randn(2, 3, 0), output_final_state=True)
    assert calls == [] and o.shape == (2, 3, 0, 64) and final.shape == (2, 0, 64, 64)


def test_more_value_heads_than_grid_y_holds_raises_naming_v(monkeypatch):
    from kda_core.errors import KDAError

    calls = _spy_launches(monkeypatch)
    q = torch.empty(1, 1, 1, 64, dtype=torch.bfloat16)
    v = torch.empty(1, 1, 1, 64, dtype=torch.bfloat16).expand(1, 1, R.MAX_VALUE_HEADS + 1, 64)
    with pytest.raises(KDAError, match="^v: expected at most 65535 value heads"):
        R.kda_recurrent_fwd(q, q, v, v, torch.empty(1, 1, R.MAX_VALUE_HEADS + 1))
    assert calls == []


@pytest.mark.parametrize("mode", ["pool", "spec"])
def test_debug_validate_rejects_duplicate_active_slots_before_launch(mode, monkeypatch):
    from kda_core.errors import KDAError

    calls = _spy_launches(monkeypatch)
    B, T, H, K = 2, 2, 2, 64
    q, v = torch.randn(B, T, H, K).bfloat16(), torch.randn(B, T, H, K).bfloat16()
    beta = torch.randn(B, T, H).bfloat16()
    pool = torch.randn(6, H, K, K)
    slots = torch.tensor([3, 3], dtype=torch.int32) if mode == "pool" else \
        torch.tensor([[0, 1], [2, 1]], dtype=torch.int32)
    monkeypatch.setenv("KDA_DEBUG_VALIDATE", "1")
    with pytest.raises(KDAError, match="^ssm_state_indices: expected distinct active slots"):
        R.kda_recurrent_fwd(q, q, v, v, beta, initial_state=pool, ssm_state_indices=slots)
    assert calls == []
    monkeypatch.setenv("KDA_DEBUG_VALIDATE", "0")  # off: the caller's error reaches the kernel unchecked
    R.kda_recurrent_fwd(q, q, v, v, beta, initial_state=pool, ssm_state_indices=slots)
    assert len(calls) == 1


def test_debug_validate_under_nonpositive_lets_slot_0_repeat(monkeypatch):
    # vLLM's padding rows all carry slot 0, which nonpositive makes null: not a duplicate of anything.
    from kda_core.errors import KDAError

    calls = _spy_launches(monkeypatch)
    B, T, H, K = 3, 2, 2, 64
    q, v = torch.randn(B, T, H, K).bfloat16(), torch.randn(B, T, H, K).bfloat16()
    beta = torch.randn(B, T, H).bfloat16()
    pool = torch.randn(6, H, K, K)
    slots = torch.tensor([0, 0, 2], dtype=torch.int32)
    monkeypatch.setenv("KDA_DEBUG_VALIDATE", "1")
    R.kda_recurrent_fwd(q, q, v, v, beta, initial_state=pool, ssm_state_indices=slots,
                        null_policy=NullSlotPolicy.NONPOSITIVE)
    assert len(calls) == 1
    with pytest.raises(KDAError, match="^ssm_state_indices: expected distinct active slots"):
        R.kda_recurrent_fwd(q, q, v, v, beta, initial_state=pool, ssm_state_indices=slots)
    assert len(calls) == 1
