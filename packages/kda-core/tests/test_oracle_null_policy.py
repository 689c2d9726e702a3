"""The two null-slot policies in the oracles (docs/design.md §4): which rows are null, and that a null row reads and
writes nothing.

``OUT_OF_RANGE`` (kda's default, SGLang, FlashInfer): a slot is null iff it is outside [0, N). ``NONPOSITIVE`` (vLLM,
NULL_BLOCK_ID = 0): iff it is <= 0 or >= N, so slot 0 is never touched; with 2-D indices a row whose
num_accepted_tokens is outside [1, T_idx] is null as a whole. Each live row is checked against the oracle run on
that row alone (the policy must not change what a live row computes).
"""

from __future__ import annotations

import pytest
import torch

from kda_core.call_args import RecurrentArgs
from kda_core.contracts import NullSlotPolicy, null_policy_of
from kda_core.errors import KDAError
from kda_core.oracle import recurrent_kda_ref, recurrent_kda_ref_args, ucache_verify_flush_ref

OOR, NONPOS = NullSlotPolicy.OUT_OF_RANGE, NullSlotPolicy.NONPOSITIVE
F32 = dict(dtype=torch.float32, out_dtype=None)


def _close(a, b):
    """Runs over different batch subsets may differ in the last fp32 bit (vectorised reductions)."""
    if a.dtype == torch.bfloat16:
        torch.testing.assert_close(a.float(), b.float(), rtol=8e-3, atol=1e-5)  # one bf16 ulp either way
    else:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _alone(args, pool, rows, slots, **kw):
    """(o, pool) of the oracle on the given batch rows only, with their slots, on a copy of ``pool``."""
    sub = {k: (v[rows] if isinstance(v, torch.Tensor) and v.dim() >= 3 else v) for k, v in args.items()}
    return recurrent_kda_ref(**sub, initial_state=pool.clone(), ssm_state_indices=slots, **F32, **kw)


def test_the_policy_is_the_enum_or_its_string_value():
    assert null_policy_of(NONPOS) is NONPOS and null_policy_of("nonpositive") is NONPOS
    assert null_policy_of("out_of_range") is OOR
    for bad in ("NONPOSITIVE", 0, None, "vllm"):
        with pytest.raises(KDAError, match="^null_policy: expected a kda_core.contracts.NullSlotPolicy"):
            null_policy_of(bad)


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("policy", [OOR, NONPOS, "nonpositive"], ids=["out_of_range", "nonpositive", "string"])
def test_pool_rows_null_under_each_policy(kda, policy, pool_dtype):
    B, N, H, K = 5, 6, 2, 16
    args = kda.make_inputs(B=B, T=2, H=H, K=K, seed=1)
    pool = kda.make_pool(N, H, K, dtype=pool_dtype, seed=2, row_pad=17)
    before = pool.clone()
    slots = torch.tensor([3, 0, -1, N, 5], dtype=torch.int64)
    o, _ = recurrent_kda_ref(**args, initial_state=pool, ssm_state_indices=slots, null_policy=policy, **F32)
    live = [0, 4] if null_policy_of(policy) is NONPOS else [0, 1, 4]
    o_ref, pool_ref = _alone(args, before, live, slots[live])
    _close(o[live], o_ref)
    _close(pool, pool_ref)
    written = slots[live].tolist()
    untouched = [n for n in range(N) if n not in written]  # slot 0 too under NONPOSITIVE
    assert kda.same_bits(pool[untouched], before[untouched])
    for b in sorted(set(range(B)) - set(live)):
        assert torch.count_nonzero(o[b]) == 0
    assert kda.same_bits(pool[0], before[0]) is (null_policy_of(policy) is NONPOS)


def test_spec_rows_null_under_nonpositive_when_the_count_is_outside_1_to_T(kda):
    B, T, N, H, K = 4, 3, 16, 1, 16
    args = kda.make_inputs(B=B, T=T, H=H, K=K, seed=3)
    pool = kda.make_pool(N, H, K, seed=4)
    before = pool.clone()
    idx = torch.arange(B * T, dtype=torch.int32).reshape(B, T) + 1  # slots 1..12
    nat = torch.tensor([2, 0, T + 1, -(2**31)], dtype=torch.int32)
    o, _ = recurrent_kda_ref(**args, initial_state=pool, ssm_state_indices=idx, num_accepted_tokens=nat,
                             null_policy=NONPOS, **F32)
    # row 0 is live; rows 1-3 (counts 0, T + 1, INT_MIN) are null as a whole: zero output, nothing written
    o_ref, pool_ref = recurrent_kda_ref(**{k: (v[:1] if isinstance(v, torch.Tensor) and v.dim() >= 3 else v)
                                           for k, v in args.items()}, initial_state=before.clone(),
                                        ssm_state_indices=idx[:1], num_accepted_tokens=nat[:1], **F32)
    _close(o[:1], o_ref)
    _close(pool, pool_ref)
    assert torch.count_nonzero(o[1:]) == 0 and kda.same_bits(pool[4:], before[4:])  # row 0 wrote slots 1-3
    # OUT_OF_RANGE clamps those counts to a column instead (rows 1-3 run)
    o_oor, _ = recurrent_kda_ref(**args, initial_state=before.clone(), ssm_state_indices=idx,
                                 num_accepted_tokens=nat, **F32)
    assert all(torch.count_nonzero(o_oor[b]) > 0 for b in range(B))


def test_spec_tokens_writing_slot_0_are_skipped_under_nonpositive(kda):
    B, T, N, H, K = 1, 3, 8, 1, 16
    args = kda.make_inputs(B=B, T=T, H=H, K=K, seed=5)
    pool = kda.make_pool(N, H, K, seed=6)
    before = pool.clone()
    idx = torch.tensor([[2, 0, 4]], dtype=torch.int64)
    o, _ = recurrent_kda_ref(**args, initial_state=pool, ssm_state_indices=idx, null_policy=NONPOS, **F32)
    assert torch.count_nonzero(o[:, 1]) == 0 and kda.same_bits(pool[0], before[0])
    # the same as a null slot of the other policy at that token
    o_oor, pool_oor = recurrent_kda_ref(**args, initial_state=before.clone(),
                                        ssm_state_indices=torch.tensor([[2, -1, 4]]), **F32)
    torch.testing.assert_close(o, o_oor, rtol=0, atol=0)
    assert kda.same_bits(pool, pool_oor)
    # a read slot of 0 makes the whole row null
    o0, _ = recurrent_kda_ref(**args, initial_state=before.clone(), ssm_state_indices=torch.tensor([[0, 3, 4]]),
                              null_policy=NONPOS, **F32)
    assert torch.count_nonzero(o0) == 0


def test_varlen_sequences_at_slot_0_are_null_under_nonpositive(kda):
    H, K, N = 1, 16, 5
    args = kda.make_inputs(B=1, T=4, H=H, K=K, seed=7)
    cu = torch.tensor([0, 1, 3, 4], dtype=torch.int64)
    pool = kda.make_pool(N, H, K, dtype=torch.bfloat16, seed=8)
    before = pool.clone()
    slots = torch.tensor([2, 0, 4], dtype=torch.int32)
    o, _ = recurrent_kda_ref(**args, initial_state=pool, ssm_state_indices=slots, cu_seqlens=cu,
                             null_policy=NONPOS, **F32)
    assert torch.count_nonzero(o[:, 1:3]) == 0 and kda.same_bits(pool[0], before[0])
    o_oor, pool_oor = recurrent_kda_ref(**args, initial_state=before.clone(), cu_seqlens=cu,
                                        ssm_state_indices=torch.tensor([2, -1, 4], dtype=torch.int32), **F32)
    torch.testing.assert_close(o, o_oor, rtol=0, atol=0)
    assert kda.same_bits(pool, pool_oor)


def test_the_bundle_entry_carries_the_policy(kda):
    args = kda.make_inputs(B=2, T=1, H=1, K=16, seed=9)
    pool = kda.make_pool(3, 1, 16, seed=10)
    bundle = RecurrentArgs(**args, initial_state=pool.clone(), ssm_state_indices=torch.tensor([0, 1]))
    o, _ = recurrent_kda_ref_args(bundle, null_policy="nonpositive")
    assert torch.count_nonzero(o[0]) == 0 and torch.count_nonzero(o[1]) > 0
    with pytest.raises(KDAError, match="^null_policy: expected"):
        recurrent_kda_ref_args(bundle, null_policy="none")


def test_ucache_rows_at_slot_0_are_null_under_nonpositive():
    B, T, H, K, N = 3, 4, 2, 128, 4
    gen = torch.Generator().manual_seed(11)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    inp = dict(q=rnd(B, T, H, K), k=rnd(B, T, H, K), v=rnd(B, T, H, K), b=rnd(B, T, H))
    g = rnd(B, T, H, K)
    A_log, dt_bias = torch.zeros(H), torch.zeros(H * K)

    def state():
        return dict(initial_state_source=(torch.randn(N, H, K, K, generator=torch.Generator().manual_seed(1))
                                          * 0.3).bfloat16(),
                    k_cache=torch.zeros(N, H, 32, K, dtype=torch.bfloat16),
                    u_cache=torch.zeros(N, H, 32, K, dtype=torch.bfloat16), g_cache=torch.zeros(N, H, 32, K),
                    hist_len=torch.tensor([13, 13, 2], dtype=torch.int32),  # rows 0 and 1 would flush
                    cache_base=torch.tensor([3, 5, 0], dtype=torch.int32))

    mine, theirs = state(), state()
    before = {n: t.clone() for n, t in mine.items()}
    o = ucache_verify_flush_ref(A_log, g, dt_bias, -5.0, **inp, **mine, w_ring=16, null_policy="nonpositive",
                                initial_state_indices=torch.tensor([0, 1, 3], dtype=torch.int64))
    o_oor = ucache_verify_flush_ref(A_log, g, dt_bias, -5.0, **inp, **theirs, w_ring=16,
                                    initial_state_indices=torch.tensor([-1, 1, 3], dtype=torch.int32))
    assert torch.count_nonzero(o[0]) == 0 and torch.equal(o, o_oor)
    for name in ("initial_state_source", "k_cache", "u_cache", "g_cache"):
        assert torch.equal(mine[name][0], before[name][0]), name
        assert torch.equal(mine[name], theirs[name]), name
    assert mine["hist_len"][0] == 13 and mine["cache_base"][0] == 3  # a null row's cursors stay
    assert torch.equal(mine["hist_len"], theirs["hist_len"]) and torch.equal(mine["cache_base"], theirs["cache_base"])
