"""Pool semantics of the token-loop oracle (docs/design.md §4, §5): slots, inactive rows, spec decode, varlen, GQA,
dtypes.

Each pool behaviour is checked against the dense form of the same oracle (states passed explicitly), which the WY
and hand-formula tests pin down independently. Runs over different batch subsets may differ in the last fp32 bit
(vectorised reductions), so those comparisons carry a tight tolerance; "untouched" checks are bitwise.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from kda_core.call_args import RecurrentArgs
from kda_core.oracle import recurrent_kda_ref, recurrent_kda_ref_args

F32 = dict(dtype=torch.float32, out_dtype=None)


def _close(a, b):
    if a.dtype == torch.bfloat16:
        torch.testing.assert_close(a.float(), b.float(), rtol=8e-3, atol=1e-5)  # one bf16 ulp either way
    else:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _dense(args, S0, **kw):
    """(o, final fp32 state) of a dense run from explicit initial states S0 [n, HV, V, K]."""
    return recurrent_kda_ref(**args, initial_state=S0.float(), output_final_state=True, **F32, **kw)


def _rows(args, rows):
    return {k: (v[rows] if isinstance(v, torch.Tensor) and v.dim() >= 3 else v) for k, v in args.items()}


def _tokens(args, cols):
    return {k: (v[:, cols] if isinstance(v, torch.Tensor) and v.dim() >= 3 else v) for k, v in args.items()}


# ---------------------------------------------------------------------------------------------------------------
# Inactive rows (1-D)


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32])
def test_pool_1d_active_rows_match_dense_and_inactive_rows_are_zero_and_untouched(kda, pool_dtype):
    B, N, H, K = 5, 7, 2, 16
    args = kda.make_inputs(B=B, T=3, H=H, K=K, seed=1)
    pool = kda.make_pool(N, H, K, dtype=pool_dtype, seed=2, row_pad=16)
    pool[6] = float("nan")  # a row nobody addresses may hold anything, even NaN
    before = pool.clone()
    slots = torch.tensor([3, -1, 0, N, -7], dtype=torch.int32)
    o, out_pool = recurrent_kda_ref(**args, initial_state=pool, ssm_state_indices=slots, **F32)
    assert out_pool is pool
    active = [0, 2]
    o_ref, S_ref = _dense(_rows(args, active), before[[3, 0]])
    _close(o[active], o_ref)
    _close(pool[[3, 0]], S_ref.to(pool_dtype))
    for b in (1, 3, 4):
        assert torch.count_nonzero(o[b]) == 0
    untouched = [1, 2, 4, 5, 6]
    assert kda.same_bits(pool[untouched], before[untouched])


@pytest.mark.parametrize("two_d", [False, True])
def test_all_inactive_batch_is_a_bitwise_no_op(kda, two_d):
    B, T, N, H, K = 3, 2, 4, 2, 16
    args = kda.make_inputs(B=B, T=T, H=H, K=K, seed=4)
    pool = kda.make_pool(N, H, K, dtype=torch.bfloat16, seed=5)
    before = pool.clone()
    slots = torch.tensor([-1, N, N + 100], dtype=torch.int32)
    if two_d:
        slots = torch.stack([slots, torch.tensor([-2, -3, N], dtype=torch.int32)], dim=1)
    o, _ = recurrent_kda_ref(**args, initial_state=pool, ssm_state_indices=slots, **F32)
    assert kda.same_bits(pool, before)
    assert torch.count_nonzero(o) == 0


# ---------------------------------------------------------------------------------------------------------------
# Spec decode (2-D indices)


def test_spec_decode_reads_the_accepted_column_and_writes_every_token(kda):
    B, T, N, H, K = 3, 4, 16, 2, 16
    args = kda.make_inputs(B=B, T=T, H=H, K=K, seed=6)
    pool = kda.make_pool(N, H, K, dtype=torch.float32, seed=7)
    before = pool.clone()
    idx = torch.arange(B * T, dtype=torch.int32).reshape(B, T) + 2  # distinct slots 2..13
    accepted = torch.tensor([1, 3, 4], dtype=torch.int32)  # read columns 0, 2, 3
    o, _ = recurrent_kda_ref(**args, initial_state=pool, ssm_state_indices=idx, num_accepted_tokens=accepted, **F32)
    read = before[idx[torch.arange(B), accepted.long() - 1].long()]
    o_ref, _ = _dense(args, read)
    _close(o, o_ref)
    for t in range(T):
        _, S_t = _dense(_tokens(args, slice(0, t + 1)), read)
        _close(pool[idx[:, t].long()], S_t)
    untouched = [0, 1, 14, 15]
    assert kda.same_bits(pool[untouched], before[untouched])


def test_spec_decode_clamps_the_accepted_column_and_defaults_to_column_0(kda):
    B, T, N, H, K = 2, 3, 8, 1, 16
    args = kda.make_inputs(B=B, T=T, H=H, K=K, seed=8)
    pool = kda.make_pool(N, H, K, dtype=torch.float32, seed=9)
    idx = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    o_none, _ = recurrent_kda_ref(**args, initial_state=pool.clone(), ssm_state_indices=idx, **F32)
    o_zero, _ = recurrent_kda_ref(**args, initial_state=pool.clone(), ssm_state_indices=idx,
                                  num_accepted_tokens=torch.tensor([0, -5], dtype=torch.int32), **F32)
    o_ref, _ = _dense(args, pool[[0, 3]])
    _close(o_none, o_ref)
    _close(o_zero, o_ref)
    o_big, _ = recurrent_kda_ref(**args, initial_state=pool.clone(), ssm_state_indices=idx,
                                 num_accepted_tokens=torch.tensor([99, 3], dtype=torch.int32), **F32)
    _close(o_big, _dense(args, pool[[2, 5]])[0])


def test_spec_decode_skips_a_token_whose_write_slot_is_invalid(kda):
    B, T, N, H, K = 1, 4, 8, 2, 16
    args = kda.make_inputs(B=B, T=T, H=H, K=K, seed=10)
    pool = kda.make_pool(N, H, K, dtype=torch.float32, seed=11)
    before = pool.clone()
    idx = torch.tensor([[1, -1, 3, N]], dtype=torch.int32)  # tokens 1 and 3 are skipped
    o, _ = recurrent_kda_ref(**args, initial_state=pool, ssm_state_indices=idx, **F32)
    assert torch.count_nonzero(o[:, 1]) == 0 and torch.count_nonzero(o[:, 3]) == 0
    # token 2 runs from the state after token 0: the skipped token was not absorbed
    o_ref, S_ref = _dense(_tokens(args, [0, 2]), before[[1]])
    _close(o[:, [0, 2]], o_ref)
    _close(pool[3], S_ref[0])
    untouched = [0, 2, 4, 5, 6, 7]
    assert kda.same_bits(pool[untouched], before[untouched])


def test_spec_decode_with_an_invalid_read_slot_is_an_inactive_row(kda):
    B, T, N, H, K = 2, 2, 6, 1, 16
    args = kda.make_inputs(B=B, T=T, H=H, K=K, seed=12)
    pool = kda.make_pool(N, H, K, dtype=torch.float32, seed=13)
    before = pool.clone()
    idx = torch.tensor([[-1, 2], [3, 4]], dtype=torch.int32)
    o, _ = recurrent_kda_ref(**args, initial_state=pool, ssm_state_indices=idx,
                             num_accepted_tokens=torch.tensor([1, 1], dtype=torch.int32), **F32)
    assert torch.count_nonzero(o[0]) == 0
    assert kda.same_bits(pool[2], before[2])  # row 0 never ran, so its token-1 slot is not written
    _close(o[1:], _dense(_rows(args, [1]), before[[3]])[0])


# ---------------------------------------------------------------------------------------------------------------
# Varlen, GQA, pool dtype


def test_varlen_with_zero_length_sequences_matches_each_sequence_alone(kda):
    H, K = 2, 16
    lens = [3, 0, 1, 0, 4]
    total = sum(lens)
    args = kda.make_inputs(B=1, T=total, H=H, K=K, seed=14)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    S0 = kda.make_pool(len(lens), H, K, dtype=torch.float32, seed=15)
    o, S = recurrent_kda_ref(**args, initial_state=S0, output_final_state=True, cu_seqlens=cu, **F32)
    assert o.shape == (1, total, H, K) and S.shape == (len(lens), H, K, K)
    for n, length in enumerate(lens):
        start = int(cu[n])
        if length == 0:
            torch.testing.assert_close(S[n], S0[n], rtol=0, atol=0)  # an empty sequence keeps its state
            continue
        o_n, S_n = _dense(_tokens(args, slice(start, start + length)), S0[[n]])
        _close(o[:, start:start + length], o_n)
        _close(S[n], S_n[0])


def test_varlen_pool_with_zero_length_sequence_leaves_its_slot_bitwise(kda):
    H, K, N = 1, 16, 4
    args = kda.make_inputs(B=1, T=2, H=H, K=K, seed=16)
    cu = torch.tensor([0, 2, 2], dtype=torch.int32)
    pool = kda.make_pool(N, H, K, dtype=torch.bfloat16, seed=17)
    before = pool.clone()
    recurrent_kda_ref(**args, initial_state=pool, ssm_state_indices=torch.tensor([1, 3], dtype=torch.int32),
                      cu_seqlens=cu, **F32)
    assert kda.same_bits(pool[3], before[3]) and not kda.same_bits(pool[1], before[1])


@pytest.mark.parametrize("gate", ["lower_bound", "softplus", "precomputed"])
def test_gqa_matches_repeating_query_and_key_heads(kda, gate):
    B, T, H, HV, K = 2, 3, 2, 6, 16
    args = kda.make_inputs(B=B, T=T, H=H, HV=HV, K=K, seed=18, gate=gate)
    S0 = kda.make_pool(B, HV, K, dtype=torch.float32, seed=19)
    o, S = _dense(args, S0)
    rep = dict(args)
    group = HV // H
    rep["q"] = args["q"].repeat_interleave(group, dim=2)
    rep["k"] = args["k"].repeat_interleave(group, dim=2)
    if gate != "precomputed":
        rep["A_log"] = args["A_log"].repeat_interleave(group)
        rep["dt_bias"] = args["dt_bias"].reshape(H, K).repeat_interleave(group, dim=0).reshape(-1)
    o_rep, S_rep = _dense(rep, S0)
    _close(o, o_rep)
    _close(S, S_rep)


@pytest.mark.parametrize("two_d", [False, True])
def test_bf16_pool_is_the_fp32_pool_rounded_once(kda, two_d):
    B, T, N, H, K = 2, 4, 10, 2, 16
    args = kda.make_inputs(B=B, T=T, H=H, K=K, seed=20)
    pool_bf16 = kda.make_pool(N, H, K, dtype=torch.bfloat16, seed=21)
    pool_f32 = pool_bf16.float()  # same starting values
    idx = (torch.arange(B * T, dtype=torch.int32).reshape(B, T) + 1) if two_d else torch.tensor(
        [4, 7], dtype=torch.int32)
    o16, _ = recurrent_kda_ref(**args, initial_state=pool_bf16, ssm_state_indices=idx, **F32)
    o32, _ = recurrent_kda_ref(**args, initial_state=pool_f32, ssm_state_indices=idx, **F32)
    torch.testing.assert_close(o16, o32, rtol=0, atol=0)  # the running state is never re-read from the pool
    assert kda.same_bits(pool_bf16, pool_f32.to(torch.bfloat16))


def test_pool_output_is_bf16_by_default_and_rounded_from_fp32(kda):
    args = kda.make_inputs(B=2, T=2, H=1, K=16, seed=22)
    pool = kda.make_pool(3, 1, 16, dtype=torch.float32, seed=23)
    slots = torch.tensor([0, 2], dtype=torch.int32)
    o, _ = recurrent_kda_ref(**args, initial_state=pool.clone(), ssm_state_indices=slots)
    o32, _ = recurrent_kda_ref(**args, initial_state=pool.clone(), ssm_state_indices=slots, **F32)
    assert o.dtype == torch.bfloat16 and kda.same_bits(o, o32.to(torch.bfloat16))


# ---------------------------------------------------------------------------------------------------------------
# The facade's entry: the call's bundle, and a given output written as the kernels write it


def test_the_keyword_api_lists_the_bundles_fields_in_order():
    params = list(inspect.signature(recurrent_kda_ref).parameters.values())[: len(RecurrentArgs._fields)]
    assert [(p.name, p.default) for p in params] == [
        (n, RecurrentArgs._field_defaults.get(n, inspect.Parameter.empty)) for n in RecurrentArgs._fields]


def test_the_bundle_entry_is_the_keyword_api_and_writes_a_given_output(kda):
    args = kda.make_inputs(B=3, T=2, H=2, K=16, seed=4)
    pool = kda.make_pool(5, 2, 16, seed=5)
    slots = torch.tensor([4, -1, 1], dtype=torch.int32)
    o_kw, pool_kw = recurrent_kda_ref(**args, initial_state=pool.clone(), ssm_state_indices=slots)
    out = torch.full(o_kw.shape, 7.0, dtype=torch.bfloat16, requires_grad=True)
    bundle = RecurrentArgs(**args, initial_state=pool.clone(), ssm_state_indices=slots, output=out)
    o, pool_b = recurrent_kda_ref_args(bundle)
    assert o is out
    torch.testing.assert_close(out.detach(), o_kw, rtol=0, atol=0)
    torch.testing.assert_close(pool_b, pool_kw, rtol=0, atol=0)
