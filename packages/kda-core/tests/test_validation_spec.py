"""One test per spec-decode validation rule (docs/design.md §9): the right argument is named, with what was expected
and what was given; and the engines' layouts are accepted (strided index views, int64 indices, padded slot
strides, interleaved pages whose slot strides are arbitrary).

Calls are built on CPU tensors with ``device_kind="any"`` (the metadata path is the same on every device).
"""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from kda_core import validation as V
from kda_core.call_args import RecurrentArgs, SpecArgs
from kda_core.contracts import GateMode, NullSlotPolicy
from kda_core.errors import KDAError
from kda_core.validation_spec import (
    CommitCall,
    SpecCall,
    _overlap,
    validate_recoverssm_commit,
    validate_recoverssm_layers,
    validate_spec,
)

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
I32, I64 = torch.int32, torch.int64
B, T, H, HV, K = 3, 4, 2, 4, 64
ANY = dict(device_kind="any")


def _raises(fn, argument, fragment=""):
    with pytest.raises(KDAError) as info:
        fn()
    msg = str(info.value)
    assert msg.startswith(f"{argument}: expected "), msg
    assert fragment in msg, msg
    assert ", got " in msg, msg
    return msg


def _args(T=T, gate=True, **kw):
    z = dict(dtype=BF16)
    a = RecurrentArgs(
        q=torch.zeros(B, T, H, K, **z), k=torch.zeros(B, T, H, K, **z), v=torch.zeros(B, T, HV, K, **z),
        g=torch.zeros(B, T, HV, K, **z), beta=torch.zeros(B, T, HV, **z), A_log=torch.zeros(H),
        dt_bias=torch.zeros(H * K), use_gate_in_kernel=gate, lower_bound=-5.0 if gate else None,
        beta_is_logit=True,
    )
    return a._replace(**kw)


def _pool(N=8, dtype=F32, pad=0):
    row = HV * K * K
    return torch.zeros(N * (row + pad), dtype=dtype).as_strided((N, HV, K, K), (row + pad, K * K, K, 1))


def _records(Pr=8, t_max=T, kg_dtype=BF16):
    return torch.zeros(Pr, HV, t_max, K), torch.zeros(Pr, HV, t_max, 2 * K, dtype=kg_dtype)


def _idx1(n=B, dtype=I32):
    return torch.arange(1, n + 1, dtype=dtype)


def _idx2(n=B, cols=T, dtype=I32):
    return torch.arange(1, n * cols + 1, dtype=dtype).reshape(n, cols)


def _spec(a, s, **kw):
    return validate_spec(a, s, **{**ANY, **kw})


def frozen_pool():
    """A frozen verify from the pool with records (vLLM RecoverSSM verify, FlashInfer without a source)."""
    cc, kg = _records()
    return _args(initial_state=_pool(), ssm_state_indices=_idx1()), SpecArgs(disable_state_update=True,
                                                                             correction_cache=cc, kg_cache=kg)


def frozen_source():
    """A frozen verify from a source with records (FlashInfer's keywords); no pool."""
    cc, kg = _records(Pr=6)
    return _args(), SpecArgs(_pool(6), _idx1(), True, cc, kg)


def source_2d():
    """Per-token checkpoints into the pool, first state from the source (FlashInfer)."""
    return _args(initial_state=_pool(16), ssm_state_indices=_idx2()), SpecArgs(_pool(6), _idx1())


def tree():
    """SGLang target verify with EAGLE-tree parents: committed source, per-token states into a buffer."""
    return (_args(initial_state=_pool(16), ssm_state_indices=_idx2()),
            SpecArgs(_pool(6), _idx1(), parent_indices=torch.full((B, T), -1, dtype=I32)))


# ---------------------------------------------------------------------------------------------------------------
# Legal calls and their descriptions


@pytest.mark.parametrize("mode", ["dense", "pool", "spec"])
def test_default_spec_args_describe_the_plain_call(mode):
    extra = {"dense": {}, "pool": dict(initial_state=_pool(), ssm_state_indices=_idx1()),
             "spec": dict(initial_state=_pool(16), ssm_state_indices=_idx2())}[mode]
    a = _args(**extra)
    call = _spec(a, SpecArgs())
    base = V.validate_recurrent(a, **ANY)
    assert isinstance(call, SpecCall) and isinstance(call, V.RecurrentCall)
    for f in fields(V.RecurrentCall):
        assert getattr(call, f.name) == getattr(base, f.name), f.name
    assert not (call.has_source or call.frozen or call.records or call.tree)
    assert call is _spec(a, SpecArgs())  # remembered


def test_frozen_verify_from_the_pool_with_records_is_described():
    call = _spec(*frozen_pool())
    assert call.frozen and call.records and not call.has_source
    assert (call.mode, call.N, call.read_rows, call.t_max, call.kg_dtype) == ("pool", 8, 8, T, BF16)
    assert not call.t1_eligible


def test_frozen_verify_from_a_source_is_described():
    call = _spec(*frozen_source())
    assert call.frozen and call.has_source and call.records
    assert (call.mode, call.N, call.source_rows, call.read_rows, call.source_dtype) == ("dense", None, 6, 6, F32)
    assert call.source_index_dtype is I32


def test_frozen_verify_with_2d_indices_and_no_records():
    a = _args(initial_state=_pool(16), ssm_state_indices=_idx2())
    call = _spec(a, SpecArgs(disable_state_update=True))
    assert call.frozen and call.mode == "spec" and not call.records


@pytest.mark.parametrize("two_d", [False, True])
def test_source_with_writes_is_described(two_d):
    a = _args(initial_state=_pool(16, BF16), ssm_state_indices=_idx2() if two_d else _idx1())
    call = _spec(a, SpecArgs(_pool(6), _idx1(dtype=I64)))
    assert call.has_source and not call.frozen
    assert (call.mode, call.N, call.source_rows, call.state_dtype, call.source_dtype) == (
        "spec" if two_d else "pool", 16, 6, BF16, F32)
    assert call.source_index_dtype is I64


def test_tree_verify_is_described():
    call = _spec(*tree())
    assert call.tree and call.parent_cols == T and call.parent_dtype is I32


def test_tree_verify_without_a_source_and_with_accepted_counts():
    a = _args(initial_state=_pool(16), ssm_state_indices=_idx2(), num_accepted_tokens=torch.ones(B, dtype=I64))
    call = _spec(a, SpecArgs(parent_indices=torch.zeros(B, 2, dtype=I64)))
    assert call.tree and call.parent_cols == 2 and call.parent_dtype is I64


def test_varlen_frozen_verify_with_records_counts_sequences_from_cu_seqlens():
    cc, kg = _records(Pr=5, t_max=3)
    a = RecurrentArgs(*[x.reshape(1, B * T, *x.shape[2:]) if isinstance(x, torch.Tensor) and x.dim() >= 3 else x
                        for x in _args()])
    call = _spec(a._replace(cu_seqlens=torch.tensor([0, 3, 5, 7, 12], dtype=I32)),
                 SpecArgs(_pool(5), _idx1(4), True, cc, kg))
    assert call.N_seq == 4 and call.t_max == 3 and call.varlen


def test_records_in_fp32_and_fp16_follow_the_activation_dtype():
    for dtype in (F32, F16):
        a = _args()
        a = a._replace(**{f: getattr(a, f).to(dtype) for f in ("q", "k", "v", "g", "beta")})
        cc, kg = _records(Pr=6, kg_dtype=dtype)
        assert _spec(a, SpecArgs(_pool(6), _idx1(), True, cc, kg)).kg_dtype is dtype


def test_engine_layouts_are_accepted():
    """Index views of stride 8 (a column of a wider table), int64 indices, slot strides of +17 elements (legal,
    unaligned), record caches whose slot stride is arbitrary."""
    table = torch.zeros(B, 8, dtype=I64)
    src = _pool(6, F32, pad=17)
    pool = _pool(16, BF16, pad=17)
    a = _args(initial_state=pool, ssm_state_indices=torch.zeros(B, 8 * T, dtype=I32)[:, ::8])
    parents = torch.zeros(B, 8 * T, dtype=I64)[:, ::8]
    call = _spec(a, SpecArgs(src, table[:, 0], parent_indices=parents))
    assert call.tree and not call.aligned and call.source_index_dtype is I64
    # records with slot strides that are no multiple of anything, a frozen verify from the padded source
    cc = torch.zeros(6 * (HV * T * K + 5)).as_strided((6, HV, T, K), (HV * T * K + 5, T * K, K, 1))
    kg = torch.zeros(6 * (HV * T * 2 * K + 3), dtype=BF16).as_strided((6, HV, T, 2 * K),
                                                                       (HV * T * 2 * K + 3, T * 2 * K, 2 * K, 1))
    call = _spec(_args(), SpecArgs(src, table[:, 0], True, cc, kg))
    assert call.records and not call.records_aligned and not call.aligned


def _paged(P, t_max, state_dtype=F32, kg_dtype=BF16, pad=48):
    """vLLM-style pages: each block holds its state, then its correction rows, then its raw k | g rows, in one
    byte buffer; every view's slot stride is the page."""
    es = torch.tensor([], dtype=state_dtype).element_size()
    state_b = HV * K * K * es
    cc_b = HV * t_max * K * 4
    kg_b = HV * t_max * 2 * K * 2
    page = state_b + cc_b + kg_b + pad
    buf = torch.zeros(P * page, dtype=torch.uint8)
    state = buf.view(state_dtype).as_strided((P, HV, K, K), (page // es, K * K, K, 1), 0)
    cc = buf.view(F32).as_strided((P, HV, t_max, K), (page // 4, t_max * K, K, 1), state_b // 4)
    kg = buf.view(kg_dtype).as_strided((P, HV, t_max, 2 * K), (page // 2, t_max * 2 * K, 2 * K, 1),
                                       (state_b + cc_b) // 2)
    return state, cc, kg


@pytest.mark.parametrize("state_dtype", [F32, BF16])
def test_interleaved_pages_are_accepted_for_verify_and_commit(state_dtype):
    state, cc, kg = _paged(8, T, state_dtype)
    a = _args(initial_state=state, ssm_state_indices=torch.zeros(B, 8, dtype=I32)[:, 0])
    call = _spec(a, SpecArgs(disable_state_update=True, correction_cache=cc, kg_cache=kg))
    assert call.records and call.read_rows == 8
    c = validate_recoverssm_commit(state, cc, kg, _idx1(), torch.zeros(B, 8, dtype=I64)[:, 3], torch.zeros(H),
                                   torch.zeros(H * K), -5.0, query_start_loc=torch.arange(B + 1), **ANY)
    assert isinstance(c, CommitCall) and (c.P, c.H, c.HV, c.t_max, c.state_dtype) == (8, H, HV, T, state_dtype)


def test_pages_whose_rows_collide_are_refused():
    state, cc, kg = _paged(8, T)
    bad = cc.as_strided(cc.shape, cc.stride(), cc.storage_offset() - 8)  # starts 8 floats inside the state
    a = _args(initial_state=state, ssm_state_indices=_idx1())
    _raises(lambda: _spec(a, SpecArgs(disable_state_update=True, correction_cache=bad, kg_cache=kg)),
            "correction_cache", "shares no byte with initial_state")


def test_specs_on_meta_tensors_read_no_values():
    a = _args(initial_state=_pool(16).to("meta"), ssm_state_indices=_idx2().to("meta"))
    a = RecurrentArgs(*[x.to("meta") if isinstance(x, torch.Tensor) else x for x in a])
    call = _spec(a, SpecArgs(_pool(6).to("meta"), _idx1().to("meta"), parent_indices=_idx2().to("meta")))
    assert call.tree and call.has_source


def test_the_null_policy_is_part_of_the_description():
    a, s = frozen_pool()
    assert _spec(a, s, null_policy="nonpositive").null_policy is NullSlotPolicy.NONPOSITIVE
    assert _spec(a, s).null_policy is NullSlotPolicy.OUT_OF_RANGE


# ---------------------------------------------------------------------------------------------------------------
# Refusals of validate_spec, one per rule


def _with(make, args=None, spec=None):
    def build():
        a, s = make()
        if args:
            a = a._replace(**args(a))
        if spec:
            s = s._replace(**spec(a, s))
        return a, s
    return build


def _overlapping_pool():
    buf = torch.zeros(2 * 16 * HV * K * K)
    pool = buf[: 16 * HV * K * K].view(16, HV, K, K)
    src = buf[HV * K * K: 7 * HV * K * K].view(6, HV, K, K)
    return _args(initial_state=pool, ssm_state_indices=_idx2()), SpecArgs(src, _idx1())


def _output_on_source():
    a, s = frozen_source()
    src = torch.zeros(6, HV, K, K, dtype=BF16)
    return a._replace(output=src.view(-1)[: B * T * HV * K].view(B, T, HV, K)), s._replace(
        initial_state_source=src)


def _pool_on_q():
    buf = torch.zeros(20 * HV * K * K, dtype=BF16)
    pool = buf.view(20, HV, K, K)
    q = buf[: B * T * H * K].view(B, T, H, K)
    return _args(q=q, initial_state=pool, ssm_state_indices=_idx1()), SpecArgs(_pool(6), _idx1())


SPEC_RULES = [
    (_with(frozen_pool, spec=lambda a, s: dict(kg_cache=None)), "kg_cache", "come together"),
    (_with(frozen_pool, spec=lambda a, s: dict(correction_cache=None)), "correction_cache", "come together"),
    (_with(frozen_pool, spec=lambda a, s: dict(disable_state_update=False)), "correction_cache", "frozen verify"),
    (_with(frozen_pool, spec=lambda a, s: dict(disable_state_update=1)), "disable_state_update", "a bool"),
    (_with(frozen_pool, spec=lambda a, s: dict(initial_state_indices=_idx1())), "initial_state_indices",
     "None without initial_state_source"),
    (_with(frozen_source, spec=lambda a, s: dict(initial_state_indices=None)), "initial_state_indices",
     "with initial_state_source"),
    (_with(source_2d, args=lambda a: dict(num_accepted_tokens=_idx1())), "num_accepted_tokens",
     "initial_state_source"),
    (_with(frozen_pool, args=lambda a: dict(initial_state=_pool(16), ssm_state_indices=_idx2(),
                                             num_accepted_tokens=_idx1())), "num_accepted_tokens",
     "disable_state_update=True"),
    (_with(frozen_pool, args=lambda a: dict(output_final_state=True)), "output_final_state", "False"),
    (_with(frozen_pool, args=lambda a: dict(initial_state=_pool(16), ssm_state_indices=_idx2()),
           spec=lambda a, s: dict(parent_indices=_idx2(), correction_cache=None, kg_cache=None)),
     "parent_indices", "disable_state_update=True"),
    (_with(frozen_pool, args=lambda a: dict(initial_state=None)), "initial_state", "frozen verify"),
    (_with(frozen_pool, args=lambda a: dict(ssm_state_indices=None)), "ssm_state_indices", "pool read"),
    (_with(frozen_source, args=lambda a: dict(initial_state=_pool())), "initial_state", "nothing is written"),
    (_with(frozen_source, args=lambda a: dict(ssm_state_indices=_idx1())), "ssm_state_indices",
     "nothing is written"),
    (_with(source_2d, args=lambda a: dict(initial_state=None)), "initial_state", "written pool"),
    (_with(source_2d, args=lambda a: dict(ssm_state_indices=None)), "ssm_state_indices", "write slots"),
    (_with(tree, args=lambda a: dict(ssm_state_indices=_idx1())), "ssm_state_indices", "2-D"),
    (_with(tree, args=lambda a: dict(ssm_state_indices=None, initial_state=None)), "initial_state",
     "written pool"),
    # the source
    (_with(source_2d, spec=lambda a, s: dict(initial_state_source=torch.zeros(6, HV + 1, K, K))),
     "initial_state_source", "[Ps, HV, V, K]"),
    (_with(source_2d, spec=lambda a, s: dict(initial_state_source=_pool(6, F16))), "initial_state_source",
     "bfloat16 or float32"),
    (_with(source_2d, spec=lambda a, s: dict(initial_state_source=_pool(6).transpose(2, 3))),
     "initial_state_source", "compact inner dims"),
    (_with(source_2d, spec=lambda a, s: dict(initial_state_source=_pool(6).as_strided((6, HV, K, K),
                                                                                   (7, K * K, K, 1)))),
     "initial_state_source", "row) stride"),
    (_with(source_2d, spec=lambda a, s: dict(initial_state_indices=_idx1(B + 1))), "initial_state_indices",
     "[N_seq]"),
    (_with(source_2d, spec=lambda a, s: dict(initial_state_indices=_idx1().float())), "initial_state_indices",
     "int32 or int64"),
    (_with(source_2d, spec=lambda a, s: dict(initial_state_indices=_idx2())), "initial_state_indices", "[N_seq]"),
    # the records
    (_with(frozen_pool, spec=lambda a, s: dict(correction_cache=_records(Pr=7)[0])), "correction_cache",
     "(8, 4, T_max, 64)"),
    (_with(frozen_source, spec=lambda a, s: dict(correction_cache=_records(Pr=8)[0])), "correction_cache",
     "(6, 4, T_max, 64)"),
    (_with(frozen_pool, spec=lambda a, s: dict(correction_cache=_records()[0].bfloat16())), "correction_cache",
     "float32"),
    (_with(frozen_pool, spec=lambda a, s: dict(correction_cache=torch.zeros(8, HV, K, T).transpose(2, 3))),
     "correction_cache", "contiguous last"),
    (_with(frozen_pool, spec=lambda a, s: dict(correction_cache=torch.zeros(8, HV, 0, K),
                                               kg_cache=torch.zeros(8, HV, 0, 2 * K, dtype=BF16))),
     "correction_cache", "T_max >= 1"),
    (_with(frozen_pool, spec=lambda a, s: dict(kg_cache=torch.zeros(8, HV, T, K, dtype=BF16))), "kg_cache", "2K"),
    (_with(frozen_pool, spec=lambda a, s: dict(kg_cache=_records()[1].float())), "kg_cache", "the dtype of k"),
    (_with(frozen_pool, spec=lambda a, s: dict(kg_cache=_records(t_max=T + 1)[1])), "kg_cache", "T_max (dim 2) = 4"),
    (_with(frozen_pool, spec=lambda a, s: dict(kg_cache=torch.zeros(8, HV, 2 * K, T, dtype=BF16).transpose(2, 3))),
     "kg_cache", "contiguous last"),
    (_with(frozen_pool, args=lambda a: dict(g=a.g.float())), "g", "the dtype of k"),
    # the parents
    (_with(tree, spec=lambda a, s: dict(parent_indices=torch.zeros(B + 1, T, dtype=I32))), "parent_indices",
     "[N_seq, T_p]"),
    (_with(tree, spec=lambda a, s: dict(parent_indices=torch.zeros(B, dtype=I32))), "parent_indices",
     "[N_seq, T_p]"),
    (_with(tree, spec=lambda a, s: dict(parent_indices=torch.zeros(B, T))), "parent_indices", "int32 or int64"),
    (_with(tree, spec=lambda a, s: dict(parent_indices=[[0] * T] * B)), "parent_indices", "torch.Tensor"),
    # aliasing
    (_overlapping_pool, "initial_state", "shares no byte with initial_state_source"),
    (_output_on_source, "output", "shares no byte with initial_state_source"),
    (_pool_on_q, "initial_state", "shares no byte with q"),
    (_with(frozen_pool, spec=lambda a, s: dict(correction_cache=torch.zeros(8, HV, 1, K).expand(8, HV, T, K))),
     "correction_cache", "do not overlap"),
    (_with(frozen_pool, spec=lambda a, s: dict(correction_cache=a.initial_state.view(-1)[: 8 * HV * T * K]
                                               .view(8, HV, T, K))), "correction_cache", "shares no byte"),
    # the plain part is validate_recurrent's
    (_with(source_2d, args=lambda a: dict(v=torch.zeros(B, T, HV + 1, K, dtype=BF16))), "v", "HV"),
]


@pytest.mark.parametrize("make, argument, fragment", SPEC_RULES)
def test_spec_rule(make, argument, fragment):
    a, s = make()
    _raises(lambda: _spec(a, s), argument, fragment)


def test_spec_bundles_and_modes_are_checked():
    a, s = frozen_pool()
    _raises(lambda: _spec(a, tuple(s)), "spec", "SpecArgs")
    _raises(lambda: _spec(tuple(a), s), "args", "RecurrentArgs")
    _raises(lambda: _spec(a, s, null_policy="vllm"), "null_policy")
    _raises(lambda: _spec(a, s, device_kind="gpu"), "device_kind")
    _raises(lambda: validate_spec(a, s), "q", "CUDA")  # the launchers' default device_kind
    src = _pool(6).to("meta")
    a2, s2 = frozen_source()
    _raises(lambda: _spec(a2, s2._replace(initial_state_source=src)), "initial_state_source", "device")


def test_refusals_and_the_oracle_agree_on_combinations(kda):
    """The oracle refuses each combination validation refuses, naming the same argument."""
    from kda_core.oracle_spec import spec_verify_ref

    for make, argument, _ in SPEC_RULES[:18]:
        a, s = make()
        with pytest.raises(KDAError) as info:
            _spec(a, s)
        assert str(info.value).startswith(f"{argument}:")
        with pytest.raises(KDAError) as info:
            spec_verify_ref(a, s)
        assert str(info.value).startswith(f"{argument}:"), (argument, str(info.value))


# ---------------------------------------------------------------------------------------------------------------
# RecoverSSM commit


def commit_args(P=8, t_max=T, **kw):
    cc, kg = _records(P, t_max)
    a = dict(checkpoint_state=_pool(P), correction_cache=cc, kg_cache=kg, state_indices=_idx1(),
             num_accepted_tokens=_idx1(), A_log=torch.zeros(H), dt_bias=torch.zeros(H * K), lower_bound=-5.0,
             query_start_loc=torch.arange(B + 1, dtype=I32), device_kind="any")
    a.update(kw)
    return a


def test_commit_is_described():
    c = validate_recoverssm_commit(**commit_args())
    assert (c.N, c.P, c.H, c.HV, c.K, c.V, c.t_max, c.layers) == (B, 8, H, HV, K, K, T, 1)
    assert c.gate_mode is GateMode.LOWER_BOUND and c.lower_bound == -5.0 and c.has_dt_bias
    assert (c.index_dtype, c.nat_dtype, c.qsl_dtype) == (I32, I32, I32)
    assert c is validate_recoverssm_commit(**commit_args()) or c == validate_recoverssm_commit(**commit_args())


def test_commit_gate_forms_and_optional_arguments():
    c = validate_recoverssm_commit(**commit_args(A_log=None, dt_bias=None, lower_bound=None, query_start_loc=None))
    assert c.gate_mode is GateMode.PRECOMPUTED and c.H == HV and c.qsl_dtype is None and not c.has_dt_bias
    c = validate_recoverssm_commit(**commit_args(lower_bound=None, dt_bias=torch.zeros(H, K)))
    assert c.gate_mode is GateMode.SOFTPLUS and c.lower_bound is None
    c = validate_recoverssm_commit(**commit_args(A_log=torch.zeros(1), dt_bias=None))  # GQA: one query head
    assert c.H == 1 and not c.has_dt_bias


def test_commit_takes_strided_int64_rows_and_padded_checkpoints():
    table = torch.zeros(B, 8, dtype=I64)
    qsl = torch.zeros(B + 1, 3, dtype=I64)[:, 1]
    c = validate_recoverssm_commit(**commit_args(checkpoint_state=_pool(8, BF16, pad=17), state_indices=table[:, 0],
                                                 num_accepted_tokens=table[:, 5], query_start_loc=qsl))
    assert c.state_dtype is BF16 and not c.aligned and c.index_dtype is I64 and c.qsl_dtype is I64


COMMIT_RULES = [
    (dict(checkpoint_state=torch.zeros(8, HV, 32, 32)), "checkpoint_state", "V == K in"),
    (dict(checkpoint_state=torch.zeros(8, HV, K, K, dtype=F16)), "checkpoint_state", "bfloat16 or float32"),
    (dict(checkpoint_state=_pool(8).as_strided((8, HV, K, K), (5, K * K, K, 1))), "checkpoint_state", "stride"),
    (dict(checkpoint_state=[0]), "checkpoint_state", "torch.Tensor"),
    (dict(correction_cache=_records(7)[0]), "correction_cache", "(8, 4, T_max, 64)"),
    (dict(correction_cache=_records()[0].double()), "correction_cache", "float32"),
    (dict(kg_cache=torch.zeros(8, HV, T, K, dtype=BF16)), "kg_cache", "2K"),
    (dict(kg_cache=_records(t_max=T + 1)[1]), "kg_cache", "T_max (dim 2) = 4"),
    (dict(kg_cache=_records()[1].to(I32)), "kg_cache", "bfloat16, float16 or float32"),
    (dict(state_indices=_idx2()), "state_indices", "1-D"),
    (dict(state_indices=_idx1().float()), "state_indices", "int32 or int64"),
    (dict(num_accepted_tokens=_idx1(B + 1)), "num_accepted_tokens", "[N]"),
    (dict(num_accepted_tokens=_idx1().float()), "num_accepted_tokens", "int32 or int64"),
    (dict(query_start_loc=torch.arange(B, dtype=I32)), "query_start_loc", "[N + 1]"),
    (dict(query_start_loc=torch.arange(B + 1).float()), "query_start_loc", "int32 or int64"),
    (dict(A_log=torch.zeros(3)), "A_log", "dividing HV"),
    (dict(A_log=torch.zeros(H, dtype=BF16)), "A_log", "float32"),
    (dict(A_log=torch.zeros(H, 1)), "A_log", "1-D"),
    (dict(dt_bias=torch.zeros(H * K + 1)), "dt_bias", "[H*K]"),
    (dict(dt_bias=torch.zeros(H * K, dtype=BF16)), "dt_bias", "float32"),
    (dict(dt_bias=torch.zeros(K, H).t()), "dt_bias", "contiguous"),
    (dict(lower_bound=1.0), "lower_bound", "negative"),
    (dict(lower_bound="x"), "lower_bound", "negative"),
    (dict(use_qk_l2norm_in_kernel=None), "use_qk_l2norm_in_kernel", "a bool"),
    (dict(null_policy=0), "null_policy", "NullSlotPolicy"),
    (dict(device_kind="cpu"), "device_kind", "one of"),
    (dict(device_kind="cuda"), "checkpoint_state", "CUDA"),
]


@pytest.mark.parametrize("change, argument, fragment", COMMIT_RULES)
def test_commit_rule(change, argument, fragment):
    _raises(lambda: validate_recoverssm_commit(**commit_args(**change)), argument, fragment)


def test_commit_checkpoint_must_not_overlap_what_it_reads():
    a = commit_args()
    ck = a["checkpoint_state"]
    a["correction_cache"] = ck.view(-1)[: 8 * HV * T * K].view(8, HV, T, K)
    _raises(lambda: validate_recoverssm_commit(**a), "checkpoint_state", "shares no byte with correction_cache")
    a = commit_args()
    a["num_accepted_tokens"] = a["state_indices"]  # reading one tensor twice is fine
    validate_recoverssm_commit(**a)
    a = commit_args()
    a["A_log"] = a["checkpoint_state"].view(-1)[:H]
    _raises(lambda: validate_recoverssm_commit(**a), "checkpoint_state", "shares no byte with A_log")


def test_commit_rejects_meta_mixed_with_cpu():
    _raises(lambda: validate_recoverssm_commit(**commit_args(state_indices=_idx1().to("meta"))), "state_indices",
            "device")


# ---------------------------------------------------------------------------------------------------------------
# Multi-layer commit


def layer_args(L=3, paged=False, **kw):
    cks, ccs, kgs = [], [], []
    for _ in range(L):
        if paged:
            ck, cc, kg = _paged(8, T)
        else:
            ck, (cc, kg) = _pool(8), _records()
        cks.append(ck)
        ccs.append(cc)
        kgs.append(kg)
    a = dict(checkpoints=cks, correction_caches=ccs, kg_caches=kgs, A_logs=[torch.zeros(H) for _ in range(L)],
             dt_biases=[torch.zeros(H * K) for _ in range(L)], lower_bound=-5.0, state_indices=_idx1(),
             num_accepted_tokens=_idx1(), query_start_loc=None, device_kind="any")
    a.update(kw)
    return a


@pytest.mark.parametrize("paged", [False, True])
def test_layers_are_described(paged):
    c = validate_recoverssm_layers(**layer_args(paged=paged))
    assert c.layers == 3 and c.P == 8 and c.gate_mode is GateMode.LOWER_BOUND


def test_layers_in_one_buffer_of_interleaved_pages_are_accepted():
    """Every layer's pages in one allocation (a hybrid allocator): layer i's block j at page i * P + j."""
    P, L = 4, 3
    state, cc, kg = _paged(P * L, T)
    a = layer_args(L=L, checkpoints=[state[i * P:(i + 1) * P] for i in range(L)],
                   correction_caches=[cc[i * P:(i + 1) * P] for i in range(L)],
                   kg_caches=[kg[i * P:(i + 1) * P] for i in range(L)])
    assert validate_recoverssm_layers(**a).layers == L


def test_layers_without_gate_parameters():
    c = validate_recoverssm_layers(**layer_args(A_logs=None, dt_biases=None))
    assert c.gate_mode is GateMode.PRECOMPUTED


def _layer_change(field, i, value):
    def change(a):
        a[field] = list(a[field])
        a[field][i] = value(a[field][i]) if callable(value) else value
    return change


LAYER_RULES = [
    (_layer_change("checkpoints", 1, lambda t: _pool(8, pad=16)), "checkpoints[1]", "layer 0's layout"),
    (_layer_change("checkpoints", 2, lambda t: t.to(BF16)), "checkpoints[2]", "layer 0's layout"),
    (_layer_change("correction_caches", 1, lambda t: _records(8, T + 1)[0]), "correction_caches[1]",
     "layer 0's layout"),
    (_layer_change("kg_caches", 2, lambda t: t.half()), "kg_caches[2]", "layer 0's layout"),
    (_layer_change("A_logs", 1, None), "A_logs[1]", "fp32"),
    (_layer_change("A_logs", 0, None), "A_logs[0]", "fp32"),
    (_layer_change("A_logs", 1, lambda t: torch.zeros(1)), "A_logs[1]", "layer 0's shape"),
    (_layer_change("A_logs", 2, lambda t: t.double()), "A_logs[2]", "float32"),
    (_layer_change("dt_biases", 1, None), "dt_biases[1]", "exactly when layer 0 has one"),
    (_layer_change("dt_biases", 1, lambda t: t.reshape(H, K)), "dt_biases[1]", "layer 0's shape"),
    (_layer_change("dt_biases", 2, lambda t: torch.zeros(H * K + 2)), "dt_biases[2]", "[H*K]"),
    (_layer_change("checkpoints", 1, lambda t: None), "checkpoints[1]", "torch.Tensor"),
    (_layer_change("A_logs", 1, lambda t: [0.0] * H), "A_logs[1]", "torch.Tensor"),
    (_layer_change("dt_biases", 2, lambda t: t.reshape(H, K).t()), "dt_biases[2]", "[H*K]"),
]


@pytest.mark.parametrize("change, argument, fragment", LAYER_RULES)
def test_layer_rule(change, argument, fragment):
    a = layer_args()
    change(a)
    _raises(lambda: validate_recoverssm_layers(**a), argument, fragment)


def test_layer_lists_are_checked():
    _raises(lambda: validate_recoverssm_layers(**layer_args(checkpoints=[])), "checkpoints", "non-empty")
    a = layer_args()
    a["kg_caches"] = a["kg_caches"][:2]
    _raises(lambda: validate_recoverssm_layers(**a), "kg_caches", "3 entries")
    _raises(lambda: validate_recoverssm_layers(**layer_args(A_logs=[torch.zeros(H)])), "A_logs", "3 entries")


def test_layers_must_not_share_a_checkpoint():
    a = layer_args()
    a["checkpoints"][2] = a["checkpoints"][0]
    _raises(lambda: validate_recoverssm_layers(**a), "checkpoints[0]", "shares no byte with checkpoints[2]")
    a = layer_args()
    a["correction_caches"][1] = a["checkpoints"][0].view(-1)[: 8 * HV * T * K].view(8, HV, T, K)
    _raises(lambda: validate_recoverssm_layers(**a), "checkpoints[0]", "correction_caches[1]")


# ---------------------------------------------------------------------------------------------------------------
# The overlap rule against brute force

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def two_views(draw):
    """Two [P, n] views of one byte buffer (elements of 4 bytes), each with its own offset, row stride and row
    length; half the time both share one row stride (pages)."""
    s0 = draw(st.integers(1, 12))
    views = []
    for _ in range(2):
        P = draw(st.integers(1, 4))
        n = draw(st.integers(1, 5))
        s = s0 if draw(st.booleans()) else draw(st.integers(1, 12))
        inner = draw(st.sampled_from([1, 2]))
        views.append((P, n, s, inner, draw(st.integers(0, 20))))
    return views


def _bytes_of(P, n, s, inner, off):
    return {4 * (off + i * s + j * inner) + b for i in range(P) for j in range(n) for b in range(4)}


@given(two_views())
def test_overlap_is_sound_and_exact_for_pages(views):
    buf = torch.zeros(200)
    (Pa, na, sa, ia, oa), (Pb, nb, sb, ib, ob) = views
    a = buf.as_strided((Pa, na), (sa, ia), oa)
    b = buf.as_strided((Pb, nb), (sb, ib), ob)
    real = bool(_bytes_of(*views[0]) & _bytes_of(*views[1]))
    said = _overlap(a, b)
    assert said or not real  # never misses a shared byte
    paged = Pa > 1 and Pb > 1 and sa == sb and (na - 1) * ia + 1 <= sa and (nb - 1) * ib + 1 <= sb
    if paged and ia == 1 and ib == 1:  # compact rows: the row intervals are the bytes, so the answer is exact
        assert said == real


# ---------------------------------------------------------------------------------------------------------------
# Duplicate written slots (debug checks: read values)


def test_debug_check_spec_slots_flags_duplicate_written_slots_only():
    from kda_core.validation_spec import debug_check_spec_slots

    a, s = frozen_source()
    s = s._replace(initial_state_indices=torch.tensor([1, 1, 2], dtype=I32))
    _raises(lambda: debug_check_spec_slots(a, s, _spec(a, s)), "initial_state_indices", "distinct")
    a, s = frozen_pool()
    a = a._replace(ssm_state_indices=torch.tensor([3, -1, 3], dtype=I32))
    _raises(lambda: debug_check_spec_slots(a, s, _spec(a, s)), "ssm_state_indices", "distinct")
    a, s = frozen_pool()
    a = a._replace(ssm_state_indices=torch.tensor([[3, 3, 3, 3], [4, 4, 4, 4], [5, 5, 5, 5]], dtype=I32))
    debug_check_spec_slots(a, s, _spec(a, s))  # frozen: columns past 0 are never written; records by column 0
    a, s = source_2d()
    s = s._replace(initial_state_indices=torch.tensor([1, 1, 1], dtype=I32))
    debug_check_spec_slots(a, s, _spec(a, s))  # a source slot read by several rows is fine
    a = a._replace(ssm_state_indices=torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 1]], dtype=I32))
    _raises(lambda: debug_check_spec_slots(a, s, _spec(a, s)), "ssm_state_indices", "distinct")
    a = a._replace(ssm_state_indices=torch.tensor([[0, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 0]], dtype=I32))
    debug_check_spec_slots(a, s, _spec(a, s, null_policy="nonpositive"))  # slot 0 is null under NONPOSITIVE


def test_tree_verify_refuses_more_index_columns_than_the_kernel_tracks():
    from kda_core.call_args import RecurrentArgs, SpecArgs
    from kda_core.contracts import MAX_TREE_TOKENS
    from kda_core.errors import KDAError
    from kda_core.validation_spec import validate_spec

    T = MAX_TREE_TOKENS + 1
    q = torch.zeros(1, T, 2, 64, dtype=torch.bfloat16)
    beta = torch.zeros(1, T, 2, dtype=torch.bfloat16)
    pool = torch.zeros(T + 1, 2, 64, 64)
    idx = torch.arange(T, dtype=torch.int32)[None]
    args = RecurrentArgs(q, q, q, q, beta, initial_state=pool, ssm_state_indices=idx)
    spec = SpecArgs(initial_state_source=pool.clone(), initial_state_indices=torch.zeros(1, dtype=torch.int32),
                    parent_indices=torch.zeros(1, T, dtype=torch.int32))
    with pytest.raises(KDAError, match="ssm_state_indices.*at most 64 columns"):
        validate_spec(args, spec, device_kind="any")
