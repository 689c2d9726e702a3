"""CPU checks of the generic kernel's spec-verify facets: every facet compiles for sm_90a (a share for sm_100a, the
conftest's ``sm100_share``), the register high-water variants of the tree and record facets do not spill, the
compile key names every facet and leaves a plain call's key as it was, and the host entry maps each spec call onto
the kernel's facets (or refuses it, naming the argument) before anything launches.

No GPU needed: conftest sets ``CUTE_DSL_ARCH``; launches on CPU tensors are recorded, not run.
"""

from __future__ import annotations

import inspect
import shutil
from types import SimpleNamespace

import pytest
import torch

from kda_core.contracts import GateMode, NullSlotPolicy
from kda_core.errors import KDAError
from kda_cute import generic as R

ARCHS = ("sm_90a", "sm_100a")
POOL, SPEC = R.StateMode.POOL, R.StateMode.SPEC

BASE = dict(
    head_dim=128, act_dtype=torch.bfloat16, g_dtype=torch.bfloat16, beta_dtype=torch.bfloat16,
    state_mode=SPEC, state_dtype=torch.bfloat16, store_final=False, has_num_accepted=False,
    varlen=False, cu_dtype=None, gate=GateMode.LOWER_BOUND, beta_is_logit=True, use_qk_l2norm=True,
    has_dt_bias=True, tile_v=32, aligned=True, null_policy=NullSlotPolicy.OUT_OF_RANGE, slot_dtype=torch.int32,
    nat_dtype=torch.int32,
)

FACETS = {
    "frozen-pool-bf16": dict(state_mode=POOL, frozen=True),
    "frozen-pool-fp32-int64-nonpositive": dict(state_mode=POOL, frozen=True, state_dtype=torch.float32,
                                               slot_dtype=torch.int64, null_policy=NullSlotPolicy.NONPOSITIVE),
    "records-bf16": dict(state_mode=POOL, frozen=True, records=True),
    "records-fp32-pool-varlen": dict(state_mode=POOL, frozen=True, records=True, state_dtype=torch.float32,
                                     varlen=True, cu_dtype=torch.int32),
    "records-fp32-act": dict(state_mode=POOL, frozen=True, records=True, act_dtype=torch.float32,
                             g_dtype=torch.float32),
    "source-pool-bf16-to-fp32": dict(state_mode=POOL, source_dtype=torch.bfloat16, state_dtype=torch.float32),
    "source-pool-fp32-int64-nonpositive": dict(state_mode=POOL, source_dtype=torch.float32,
                                               source_idx_dtype=torch.int64, slot_dtype=torch.int64,
                                               null_policy=NullSlotPolicy.NONPOSITIVE),
    "source-spec-bf16": dict(source_dtype=torch.bfloat16),
    "source-spec-fp32-varlen": dict(source_dtype=torch.float32, state_dtype=torch.float32, varlen=True,
                                    cu_dtype=torch.int64),
    "tree-bf16-int32": dict(parents_dtype=torch.int32),
    "tree-fp32-int64-nonpositive": dict(parents_dtype=torch.int64, state_dtype=torch.float32,
                                        null_policy=NullSlotPolicy.NONPOSITIVE),
    "tree-nat-varlen": dict(parents_dtype=torch.int32, has_num_accepted=True, varlen=True, cu_dtype=torch.int32),
    "tree-source": dict(parents_dtype=torch.int64, source_dtype=torch.float32, source_idx_dtype=torch.int64),
    # SGLang's verify (kda_recurrent.compat.sglang): int32 cache slots read, the buffer rows it builds in int64
    "sglang-verify": dict(parents_dtype=torch.int32, source_dtype=torch.float32, source_idx_dtype=torch.int32,
                          slot_dtype=torch.int64, state_dtype=torch.float32, varlen=True, cu_dtype=torch.int32),
}


def _variants():
    out = {}
    # each facet at K = 128 in both alignment classes and at K = 64 aligned (K = 64 unaligned is the same
    # element-wise code at the other head dim: test_generic_compile.py compiles it for the plain kernel)
    for name, facet in FACETS.items():
        for K, aligned in ((128, True), (128, False), (64, True)):
            out[f"{name}-K{K}-{'al' if aligned else 'unal'}"] = {
                **BASE, **facet, "head_dim": K, "aligned": aligned, "tile_v": R.tile_v_choices(K)[-1]}
    for tile in R.tile_v_choices(128)[:-1]:  # the other tiles of the tree facet (its own token loop)
        out[f"tree-tile{tile}"] = {**BASE, **FACETS["tree-bf16-int32"], "tile_v": tile}
    for gate in (GateMode.SOFTPLUS, GateMode.PRECOMPUTED):
        out[f"records-gate-{gate.value}"] = {**BASE, **FACETS["records-bf16"], "gate": gate}
    return out


VARIANTS = _variants()


@pytest.mark.sm100_share(lambda params, indices: list(VARIANTS).index(params["name"]) % 3 == 0)  # see conftest
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_spec_variant_compiles(name, arch):
    assert R.compile_variant(R.variant_key(**VARIANTS[name]), arch) is not None


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not on PATH")
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("facet", ["tree", "records"])
def test_largest_tile_of_the_tree_and_record_facets_does_not_spill(facet, arch, tmp_path, ptxas):
    # The register high-water corner of each facet: most rows per thread, fp32 activations and states, softplus
    # gate, int64 indices, varlen; the tree keeps R_n (fp32 source) beside the running rows.
    variant = {**BASE, "tile_v": R.tile_v_choices(128)[-1], "act_dtype": torch.float32, "g_dtype": torch.float32,
               "beta_dtype": torch.float32, "gate": GateMode.SOFTPLUS, "state_dtype": torch.float32, "varlen": True,
               "cu_dtype": torch.int64, "slot_dtype": torch.int64}
    if facet == "tree":
        variant.update(parents_dtype=torch.int64, source_dtype=torch.float32, source_idx_dtype=torch.int64)
    else:
        variant.update(state_mode=POOL, frozen=True, records=True)
    R.compile_variant(R.variant_key(**variant), arch, ptxas.keep(tmp_path))
    (ptx,) = list(tmp_path.glob("*.ptx"))
    registers, spills = ptxas.registers_and_spills(ptx, arch)
    assert spills == 0 and registers <= 255, f"{registers} registers, {spills} bytes of spill traffic"


# --------------------------------------------------------------------------------------------------
# compile key
# --------------------------------------------------------------------------------------------------


def test_a_plain_call_keeps_the_key_it_had_before_the_spec_facets():
    plain = R.variant_key(**BASE)
    assert len(plain) == R._PLAIN_KEY_LEN and "spec-verify" not in plain
    off = dict(source_dtype=None, source_idx_dtype=torch.int64, frozen=False, records=False, parents_dtype=None)
    assert R.variant_key(**BASE, **off) == plain  # an index dtype without a source changes nothing


def test_every_spec_facet_changes_the_key():
    keys = {name: R.variant_key(**VARIANTS[f"{name}-K128-al"]) for name in FACETS}
    assert len(set(keys.values())) == len(keys)
    src = {**BASE, "source_dtype": torch.bfloat16}
    assert R.variant_key(**src) != R.variant_key(**{**src, "source_idx_dtype": torch.int64})
    assert R.variant_key(**src) == R.variant_key(**{**src, "source_idx_dtype": torch.int32})  # int32 by default
    for name in FACETS:
        assert keys[name] != R.variant_key(**{**VARIANTS[f"{name}-K128-al"], "source_dtype": None,
                                              "frozen": False, "records": False, "parents_dtype": None})


@pytest.mark.parametrize("bad, match", [
    (dict(state_mode=SPEC, frozen=True), "^frozen"),
    (dict(state_mode=POOL, frozen=False, records=True), "^records"),
    (dict(state_mode=POOL, parents_dtype=torch.int32), "^parents_dtype"),
    (dict(state_mode=POOL, frozen=True, source_dtype=torch.bfloat16), "^source_dtype"),
    (dict(state_mode=R.StateMode.DENSE, source_dtype=torch.bfloat16), "^source_dtype"),
])
def test_combinations_the_host_never_builds_are_refused_by_the_kernel_class(bad, match):
    with pytest.raises(ValueError, match=match):
        R.compile_variant(R.variant_key(**{**BASE, **bad}), "sm_90a")


# --------------------------------------------------------------------------------------------------
# host entry: which launch a spec call makes
# --------------------------------------------------------------------------------------------------


def _spy_launches(monkeypatch):
    """Route kda_recurrent_fwd's compile through the real cache, but record the launch instead of running it."""
    from kda_cute import _launch

    calls = []
    real = _launch.get_or_compile
    n_params = len(inspect.signature(R.KDARecurrent.__call__).parameters) - 2  # minus self and the env stream

    def spy(key, build, arch=None):
        assert real(key, build, arch) is not None

        def launch(*args):
            assert len(args) == n_params, f"{len(args)} launch arguments, the kernel takes {n_params}"
            calls.append((key, dict(zip(_PARAMS, args))))

        return launch

    monkeypatch.setattr(_launch, "get_or_compile", spy)
    return calls


_PARAMS = list(inspect.signature(R.KDARecurrent.__call__).parameters)[1:-1]
B, T, K = 3, 4, 64
HV = 4


def _inputs():
    q, k = torch.randn(B, T, 2, K).bfloat16(), torch.randn(B, T, 2, K).bfloat16()
    v, g = torch.randn(B, T, HV, K).bfloat16(), torch.randn(B, T, HV, K).bfloat16()
    return dict(q=q, k=k, v=v, g=g, beta=torch.randn(B, T, HV).bfloat16(), A_log=torch.zeros(2),
                dt_bias=torch.zeros(2 * K), lower_bound=-5.0, use_gate_in_kernel=True)


def _states(P, dtype=torch.bfloat16):
    return torch.randn(P, HV, K, K).to(dtype)


def _records(Pr, T_max=3):
    return torch.zeros(Pr, HV, T_max, K), torch.zeros(Pr, HV, T_max, 2 * K).bfloat16()


def _key_facets(key):
    assert key[R._PLAIN_KEY_LEN] == "spec-verify"
    return dict(zip(("source_dtype", "source_idx_dtype", "frozen", "records", "parents_dtype"),
                    key[R._PLAIN_KEY_LEN + 1:]))


def test_a_frozen_2d_verify_is_a_frozen_pool_read_of_column_0(monkeypatch):
    calls = _spy_launches(monkeypatch)
    pool = _states(9)
    table = torch.arange(B * T * 2, dtype=torch.int64).view(B, T * 2)[:, ::2]  # strided 2-D view
    corr, kg = _records(9)
    o, final = R.kda_recurrent_fwd(**_inputs(), initial_state=pool, ssm_state_indices=table,
                                   disable_state_update=True, correction_cache=corr, kg_cache=kg)
    ((key, launch),) = calls
    assert final is pool and key[5] == POOL and key[18] == torch.int64
    assert _key_facets(key) == dict(source_dtype=None, source_idx_dtype=None, frozen=True, records=True,
                                    parents_dtype=None)
    slots = launch["mSlots"]
    assert slots.shape == (B,) and slots.data_ptr() == table.data_ptr() and slots.stride() == table.stride()[:1]
    assert launch["mState"] is pool and launch["mCorr"] is corr and launch["mKG"] is kg
    assert launch["mSource"] is None and launch["mParents"] is None and launch["mOut"] is o


def test_a_frozen_source_verify_reads_the_source_as_the_pool_and_returns_no_state(monkeypatch):
    calls = _spy_launches(monkeypatch)
    source = _states(5, torch.float32)
    src_idx = torch.tensor([4, -1, 0], dtype=torch.int32)
    o, final = R.kda_recurrent_fwd(**_inputs(), initial_state_source=source, initial_state_indices=src_idx,
                                   disable_state_update=True)
    ((key, launch),) = calls
    assert final is None and key[5] == POOL and key[6] == torch.float32
    assert _key_facets(key)["frozen"] and not _key_facets(key)["records"]
    assert launch["mState"] is source and launch["mSlots"] is src_idx and launch["mSource"] is None


@pytest.mark.parametrize("rank", [1, 2])
def test_a_source_read_writes_the_pool_through_its_indices(rank, monkeypatch):
    calls = _spy_launches(monkeypatch)
    source, pool = _states(5), _states(20, torch.float32)
    src_idx = torch.tensor([4, -1, 0], dtype=torch.int64)
    slots = torch.tensor([3, 1, 7], dtype=torch.int32) if rank == 1 else \
        torch.arange(B * T, dtype=torch.int32).view(B, T)
    o, final = R.kda_recurrent_fwd(**_inputs(), initial_state=pool, ssm_state_indices=slots,
                                   initial_state_source=source, initial_state_indices=src_idx)
    ((key, launch),) = calls
    assert final is pool and key[5] == (POOL if rank == 1 else SPEC) and key[6] == torch.float32
    assert _key_facets(key) == dict(source_dtype=torch.bfloat16, source_idx_dtype=torch.int64, frozen=False,
                                    records=False, parents_dtype=None)
    assert launch["mSource"] is source and launch["mSourceIdx"] is src_idx
    assert launch["mState"] is pool and launch["mSlots"] is slots


def test_tree_parents_ride_with_2d_indices(monkeypatch):
    calls = _spy_launches(monkeypatch)
    pool = _states(20)
    slots = torch.arange(B * T, dtype=torch.int32).view(B, T)
    parents = torch.tensor([[-1, 0, 0, 1]], dtype=torch.int64).expand(B, T)
    R.kda_recurrent_fwd(**_inputs(), initial_state=pool, ssm_state_indices=slots, parent_indices=parents,
                        num_accepted_tokens=torch.tensor([1, 2, 3], dtype=torch.int32))
    ((key, launch),) = calls
    assert key[5] == SPEC and key[8] and _key_facets(key)["parents_dtype"] == torch.int64
    assert launch["mParents"] is parents


def test_a_plain_call_through_spec_args_launches_the_plain_variant(monkeypatch):
    from kda_core.call_args import RecurrentArgs, SpecArgs
    from kda_core.validation import validate_recurrent

    calls = _spy_launches(monkeypatch)
    pool = _states(9)
    args = RecurrentArgs(**_inputs(), initial_state=pool, ssm_state_indices=torch.tensor([1, 5, 2], dtype=torch.int32))
    call = validate_recurrent(args)
    R.run(call, args)
    R.run(call, args, SpecArgs())
    R.run(call, args, None)
    keys = [key for key, _ in calls]
    assert keys[0] == keys[1] == keys[2] and len(keys[0]) == R._PLAIN_KEY_LEN
    for _, launch in calls:
        assert all(launch[name] is None for name in ("mSource", "mSourceIdx", "mCorr", "mKG", "mParents"))


def test_the_validated_entry_launches_what_the_keyword_entry_launches_for_a_spec_call(monkeypatch):
    from kda_core.call_args import RecurrentArgs, SpecArgs

    calls = _spy_launches(monkeypatch)
    inputs = _inputs()
    source, pool = _states(5), _states(20)
    slots = torch.arange(B * T, dtype=torch.int32).view(B, T)
    spec_kw = dict(initial_state_source=source, initial_state_indices=torch.tensor([4, -1, 0], dtype=torch.int32),
                   parent_indices=torch.zeros(B, 2, dtype=torch.int32))
    args = RecurrentArgs(**inputs, initial_state=pool, ssm_state_indices=slots)
    # the facts run() reads from a description (kda-core's RecurrentCall and SpecCall both carry them)
    call = SimpleNamespace(mode="spec", N_seq=B, HV=HV, K=K, gate_mode=GateMode.LOWER_BOUND, scale=K**-0.5,
                           lower_bound=-5.0)
    o_run, final_run = R.run(call, args, SpecArgs(**spec_kw))
    o_fwd, final_fwd = R.kda_recurrent_fwd(**inputs, initial_state=pool, ssm_state_indices=slots, **spec_kw)
    (key_run, launch_run), (key_fwd, launch_fwd) = calls
    assert key_run == key_fwd and final_run is final_fwd is pool
    for name in _PARAMS:
        a, b = launch_run[name], launch_fwd[name]
        if name == "mOut":
            assert a is o_run and b is o_fwd
        elif isinstance(a, torch.Tensor):
            assert a.data_ptr() == b.data_ptr() and a.shape == b.shape
        else:
            assert a == b


def _refused(monkeypatch, match, **kw):
    calls = _spy_launches(monkeypatch)
    with pytest.raises(KDAError, match=match):
        R.kda_recurrent_fwd(**_inputs(), **kw)
    assert calls == []


POOL9 = dict(initial_state=torch.randn(9, HV, K, K).bfloat16(), ssm_state_indices=torch.tensor([1, 2, 3]))
SOURCE5 = dict(initial_state_source=torch.randn(5, HV, K, K).bfloat16(),
               initial_state_indices=torch.tensor([1, 2, 3], dtype=torch.int32))
SLOTS2D = torch.arange(B * T, dtype=torch.int32).view(B, T)
NAT = torch.tensor([1, 2, 3], dtype=torch.int32)


@pytest.mark.parametrize("kw, match", [
    (dict(**POOL9, disable_state_update=True, num_accepted_tokens=NAT), "^num_accepted_tokens: expected None"),
    (dict(**POOL9, disable_state_update=True, output_final_state=True), "^output_final_state: expected False"),
    (dict(**POOL9, disable_state_update=True, parent_indices=SLOTS2D), "^parent_indices: expected None"),
    (dict(**POOL9, **SOURCE5, disable_state_update=True), "^initial_state: expected None"),
    (dict(disable_state_update=True), "^initial_state: expected the pool"),
    (dict(**POOL9, correction_cache=torch.zeros(9, HV, 3, K), kg_cache=torch.zeros(9, HV, 3, 2 * K).bfloat16()),
     "^correction_cache: expected None unless disable_state_update=True"),
    (dict(**POOL9, disable_state_update=True, correction_cache=torch.zeros(9, HV, 3, K)),
     "^kg_cache: expected correction_cache and kg_cache together"),
    (dict(**POOL9, disable_state_update=True, correction_cache=torch.zeros(9, HV, 3, K),
          kg_cache=torch.zeros(9, HV, 3, 2 * K)), "^kg_cache: expected k's dtype"),
    (dict(**SOURCE5), "^initial_state: expected the pool"),
    (dict(initial_state=POOL9["initial_state"], ssm_state_indices=SLOTS2D, **SOURCE5, num_accepted_tokens=NAT),
     "^num_accepted_tokens: expected None with initial_state_source"),
    (dict(**POOL9, initial_state_indices=SOURCE5["initial_state_indices"]),
     "^initial_state_source: expected initial_state_source and initial_state_indices together"),
    (dict(**POOL9, parent_indices=SLOTS2D), "^ssm_state_indices: expected 2-D"),
    (dict(initial_state=torch.randn(99, HV, K, K).bfloat16(), ssm_state_indices=torch.zeros(B, 65, dtype=torch.int32),
          parent_indices=SLOTS2D), "^ssm_state_indices: expected at most 64 columns with parent_indices"),
], ids=["frozen-nat", "frozen-final", "frozen-tree", "frozen-source-pool", "frozen-nothing", "records-unfrozen",
        "records-half", "kg-dtype", "source-no-pool", "source-nat", "source-half", "tree-1d", "tree-too-wide"])
def test_spec_combinations_the_kernel_does_not_take_are_refused_before_launch(kw, match, monkeypatch):
    _refused(monkeypatch, match, **kw)


def test_debug_validate_checks_the_slots_a_spec_call_writes(monkeypatch):
    calls = _spy_launches(monkeypatch)
    pool = _states(9)
    dup = torch.tensor([2, 2, 5], dtype=torch.int32)
    monkeypatch.setenv("KDA_DEBUG_VALIDATE", "1")
    # a frozen read without records writes nothing: repeated read slots (padding clamped to one slot) are legal
    R.kda_recurrent_fwd(**_inputs(), initial_state=pool, ssm_state_indices=dup, disable_state_update=True)
    assert len(calls) == 1
    corr, kg = _records(9)
    with pytest.raises(KDAError, match="^ssm_state_indices: expected distinct active slots"):
        R.kda_recurrent_fwd(**_inputs(), initial_state=pool, ssm_state_indices=dup, disable_state_update=True,
                            correction_cache=corr, kg_cache=kg)
    with pytest.raises(KDAError, match="^initial_state_indices: expected distinct active slots"):
        R.kda_recurrent_fwd(**_inputs(), initial_state_source=pool, initial_state_indices=dup,
                            disable_state_update=True, correction_cache=corr, kg_cache=kg)
    # a source read may repeat (it is read only); the pool slots it writes may not
    R.kda_recurrent_fwd(**_inputs(), initial_state=_states(9), ssm_state_indices=torch.tensor([1, 3, 4]),
                        initial_state_source=pool, initial_state_indices=dup)
    assert len(calls) == 2
    with pytest.raises(KDAError, match="^ssm_state_indices: expected distinct active slots"):
        R.kda_recurrent_fwd(**_inputs(), initial_state=_states(9), ssm_state_indices=dup,
                            initial_state_source=pool, initial_state_indices=torch.tensor([1, 3, 4]))
    assert len(calls) == 2


def test_no_sequence_launches_nothing_in_any_spec_mode(monkeypatch):
    calls = _spy_launches(monkeypatch)
    inputs = {name: (t[:0] if isinstance(t, torch.Tensor) and t.dim() >= 3 else t) for name, t in _inputs().items()}
    corr, kg = _records(9)
    o, final = R.kda_recurrent_fwd(**inputs, initial_state=_states(9),
                                   ssm_state_indices=torch.zeros(0, dtype=torch.int32), disable_state_update=True,
                                   correction_cache=corr, kg_cache=kg)
    assert calls == [] and o.shape == (0, T, HV, K) and torch.count_nonzero(corr) == 0


def test_2d_indices_without_a_column_read_nothing(monkeypatch):
    # no read column and no write slot: every row inactive (the oracle's), so nothing reads the empty table
    calls = _spy_launches(monkeypatch)
    pool = _states(9)
    out = torch.full((B, T, HV, K), 5.0).bfloat16()
    empty = torch.zeros(B, 0, dtype=torch.int32)
    o, final = R.kda_recurrent_fwd(**_inputs(), initial_state=pool, ssm_state_indices=empty, output=out)
    assert calls == [] and o is out and final is pool and torch.count_nonzero(out) == 0
    R.kda_recurrent_fwd(**_inputs(), initial_state=pool, ssm_state_indices=empty, disable_state_update=True)
    ((_, launch),) = calls
    assert launch["mSlots"].shape == (B,) and (launch["mSlots"] == -1).all()


def _spec_calls():
    """(RecurrentArgs keywords, SpecArgs keywords) of one call per spec facet, on CPU tensors."""
    slots1, slots2 = torch.tensor([3, 1, 7], dtype=torch.int32), torch.arange(B * T, dtype=torch.int32).view(B, T)
    src = dict(initial_state_source=_states(6, torch.float32),
               initial_state_indices=torch.tensor([5, -1, 0], dtype=torch.int64))
    corr, kg = _records(6)
    return {
        "frozen-1d": (dict(initial_state=_states(20), ssm_state_indices=slots1), dict(disable_state_update=True)),
        "frozen-2d": (dict(initial_state=_states(20), ssm_state_indices=slots2), dict(disable_state_update=True)),
        "frozen-source-records": ({}, dict(**src, disable_state_update=True, correction_cache=corr, kg_cache=kg)),
        "source-1d": (dict(initial_state=_states(20), ssm_state_indices=slots1), src),
        "source-2d-tree": (dict(initial_state=_states(20), ssm_state_indices=slots2),
                           dict(**src, parent_indices=torch.tensor([[-1, 0, 0, 2]] * B))),
    }


@pytest.mark.parametrize("name", list(_spec_calls()))
def test_run_on_validate_spec_launches_what_the_keyword_entry_launches(name, monkeypatch):
    from kda_core.call_args import RecurrentArgs, SpecArgs
    from kda_core.validation_spec import validate_spec

    calls = _spy_launches(monkeypatch)
    state_kw, spec_kw = _spec_calls()[name]
    inputs = _inputs()
    args, spec = RecurrentArgs(**inputs, **state_kw), SpecArgs(**spec_kw)
    call = validate_spec(args, spec, NullSlotPolicy.NONPOSITIVE, device_kind="any")
    o_run, final_run = R.run(call, args, spec, null_policy=NullSlotPolicy.NONPOSITIVE)
    o_fwd, final_fwd = R.kda_recurrent_fwd(**inputs, **state_kw, **spec_kw, null_policy=NullSlotPolicy.NONPOSITIVE)
    (key_run, launch_run), (key_fwd, launch_fwd) = calls
    assert key_run == key_fwd and len(key_run) > R._PLAIN_KEY_LEN and final_run is final_fwd
    for param in _PARAMS:
        a, b = launch_run[param], launch_fwd[param]
        if param == "mOut":
            assert a is o_run and b is o_fwd
        elif isinstance(a, torch.Tensor):
            assert (a.data_ptr(), a.shape, a.stride()) == (b.data_ptr(), b.shape, b.stride())
        else:
            assert a == b
