"""The oracle's answer to malformed device data and to edge shapes validation accepts (docs/design.md §4, §5).

Varlen offsets, accepted counts and ucache cursors are device data: the kernels bound them, and the oracle bounds
them the same way, so a kernel test can compare against it. Each test states one rule against a call whose data is
well formed.
"""

from __future__ import annotations

import pytest
import torch

from kda_core.contracts import RING_SLOTS, max_hist_len
from kda_core.oracle import recurrent_kda_ref, ucache_verify_flush_ref

F64 = dict(dtype=torch.float64, out_dtype=None)
I32 = torch.int32
I64 = torch.int64
INT_MIN, INT_MAX = -(2**31), 2**31 - 1
TIGHT = dict(rtol=1e-12, atol=1e-12)  # a batch of sequences and one alone round alike up to fp64 reassociation


def _varlen(kda, T, seed=0):
    args = kda.make_inputs(B=1, T=T, H=2, K=16, seed=seed)
    S0 = torch.randn(3, 2, 16, 16, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    return args, S0


def _run(args, S0, cu):
    n = cu.numel() - 1
    return recurrent_kda_ref(**args, initial_state=S0[:n], output_final_state=True, cu_seqlens=cu, **F64)


def _same(a, b):
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------------------------
# cu_seqlens: bos_n = clamp(cu[n], 0, T), eos_n = clamp(cu[n + 1], bos_n, T), in 64 bits


def test_an_offset_past_the_token_count_ends_the_sequence_at_the_last_token(kda):
    args, S0 = _varlen(kda, T=6)
    _same(_run(args, S0, torch.tensor([0, 2, 6 + 5], dtype=I32)), _run(args, S0, torch.tensor([0, 2, 6], dtype=I32)))


def test_a_negative_offset_starts_the_sequence_at_token_zero(kda):
    args, S0 = _varlen(kda, T=6)
    _same(_run(args, S0, torch.tensor([-3, 2, 6], dtype=I32)), _run(args, S0, torch.tensor([0, 2, 6], dtype=I32)))


def test_offsets_all_past_the_tokens_make_every_sequence_empty(kda):
    args, S0 = _varlen(kda, T=4)
    o, S = _run(args, S0, torch.tensor([4 + 2, 4 + 5], dtype=I32))
    assert torch.count_nonzero(o) == 0
    torch.testing.assert_close(S, S0[:1], rtol=0, atol=0)


def test_int64_offsets_beyond_int32_clamp_instead_of_wrapping(kda):
    args, S0 = _varlen(kda, T=3)
    # 2**32 + 1 truncated to 32 bits is 1; clamped it is the token count
    _same(_run(args, S0, torch.tensor([0, 2**32 + 1], dtype=I64)), _run(args, S0, torch.tensor([0, 3], dtype=I64)))


def test_a_huge_int64_offset_allocates_nothing_beyond_the_tokens(kda):
    args, S0 = _varlen(kda, T=3)
    _same(_run(args, S0, torch.tensor([0, 2**62], dtype=I64)), _run(args, S0, torch.tensor([0, 3], dtype=I64)))


def test_non_monotonic_offsets_keep_every_state_exact_and_later_outputs_win(kda):
    T = 12
    args, S0 = _varlen(kda, T=T)
    o, S = _run(args, S0, torch.tensor([0, 6, 3, 12], dtype=I32))  # sequences [0, 6), [6, 6) and [3, 12)

    def alone(n, lo, hi):
        part = {k: (v[:, lo:hi] if isinstance(v, torch.Tensor) and v.dim() >= 3 else v) for k, v in args.items()}
        return recurrent_kda_ref(**part, initial_state=S0[n:n + 1], output_final_state=True, **F64)

    (o0, s0), (o2, s2) = alone(0, 0, 6), alone(2, 3, 12)
    torch.testing.assert_close(S[0], s0[0], **TIGHT)
    torch.testing.assert_close(S[1], S0[1], **TIGHT)  # the sequence whose end precedes its start: no token
    torch.testing.assert_close(S[2], s2[0], **TIGHT)
    torch.testing.assert_close(o[0, :3], o0[0, :3], **TIGHT)
    torch.testing.assert_close(o[0, 3:], o2[0], **TIGHT)  # tokens 3..5: the later sequence's outputs


def test_tokens_outside_every_sequence_have_zero_output(kda):
    args, S0 = _varlen(kda, T=8)
    o, _ = _run(args, S0, torch.tensor([2, 4, 5], dtype=I32))
    assert torch.count_nonzero(o[0, :2]) == 0 and torch.count_nonzero(o[0, 5:]) == 0
    assert torch.count_nonzero(o[0, 2:5]) > 0


# ----------------------------------------------------------------------------------------------------------------
# num_accepted_tokens: the read column is max(min(nat, T_idx), 1) - 1


@pytest.mark.parametrize("nat, col", [(INT_MIN, 0), (0, 0), (-5, 0), (1, 0), (2, 1), (3 + 3, 2), (INT_MAX, 2)])
def test_spec_decode_reads_the_column_the_accepted_count_selects(kda, nat, col):
    T, N = 3, 6
    args = kda.make_inputs(B=1, T=T, H=2, K=16, seed=3)
    pool = kda.make_pool(N, 2, 16, seed=4, dtype=torch.float64)
    idx = torch.tensor([[1, 3, 5]], dtype=I32)
    o, _ = recurrent_kda_ref(**args, initial_state=pool.clone(), ssm_state_indices=idx,
                             num_accepted_tokens=torch.tensor([nat], dtype=I32), **F64)
    want, _ = recurrent_kda_ref(**args, initial_state=pool.clone(), ssm_state_indices=idx[:, col], **F64)
    torch.testing.assert_close(o, want, rtol=0, atol=0)


def test_the_most_negative_int64_accepted_count_reads_the_first_column(kda):
    args = kda.make_inputs(B=1, T=3, H=2, K=16, seed=3)
    pool = kda.make_pool(6, 2, 16, seed=4, dtype=torch.float64)
    idx = torch.tensor([[1, 3, 5]], dtype=I32)
    o, _ = recurrent_kda_ref(**args, initial_state=pool.clone(), ssm_state_indices=idx,
                             num_accepted_tokens=torch.tensor([-(2**63)], dtype=I64), **F64)
    want, _ = recurrent_kda_ref(**args, initial_state=pool.clone(), ssm_state_indices=idx[:, 0], **F64)
    torch.testing.assert_close(o, want, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------------------------
# Edge shapes validation accepts


def test_an_empty_pool_makes_every_row_inactive(kda):
    args = kda.make_inputs(B=3, T=2, H=2, K=16)
    pool = torch.zeros(0, 2, 16, 16)
    o, out_pool = recurrent_kda_ref(**args, initial_state=pool, ssm_state_indices=torch.tensor([-1, 0, 3], dtype=I32))
    assert torch.count_nonzero(o) == 0 and out_pool is pool


def test_an_empty_pool_in_spec_decode_makes_every_token_inactive(kda):
    args = kda.make_inputs(B=2, T=2, H=2, K=16)
    o, _ = recurrent_kda_ref(**args, initial_state=torch.zeros(0, 2, 16, 16),
                             ssm_state_indices=torch.zeros(2, 2, dtype=I32))
    assert torch.count_nonzero(o) == 0


def test_spec_decode_without_tokens_leaves_the_pool_untouched(kda):
    args = kda.make_inputs(B=2, T=0, H=2, K=16)
    pool = kda.make_pool(4, 2, 16)
    before = pool.clone()
    o, _ = recurrent_kda_ref(**args, initial_state=pool, ssm_state_indices=torch.zeros(2, 0, dtype=I32),
                             num_accepted_tokens=torch.ones(2, dtype=I32))
    assert o.shape == (2, 0, 2, 16)
    assert kda.same_bits(pool, before)


def test_a_pool_that_requires_grad_is_updated_in_place(kda):
    args = kda.make_inputs(B=2, T=2, H=2, K=16)
    slots = torch.tensor([2, 0], dtype=I32)
    plain = kda.make_pool(3, 2, 16).clone()
    leaf = plain.clone().requires_grad_(True)
    o_leaf, _ = recurrent_kda_ref(**args, initial_state=leaf, ssm_state_indices=slots)
    o_plain, _ = recurrent_kda_ref(**args, initial_state=plain, ssm_state_indices=slots)
    assert torch.equal(o_leaf, o_plain) and torch.equal(leaf.detach(), plain)


# ----------------------------------------------------------------------------------------------------------------
# ucache cursors: P = clamp(hist_len, 0, min(w_ring, 32 - T)), base = cache_base & 31


def _ucache(hist, base, T=4, N=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    H, K = 2, 128

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    ring = (N, H, RING_SLOTS, K)
    state = dict(
        initial_state_source=(torch.randn(N, H, K, K, generator=gen) * 0.1).to(torch.bfloat16),
        k_cache=rnd(*ring) * 0.1, u_cache=rnd(*ring) * 0.1, g_cache=-torch.rand(ring, generator=gen) * 0.05,
        initial_state_indices=torch.tensor([1], dtype=I32), hist_len=torch.tensor([hist], dtype=I32),
        cache_base=torch.tensor([base], dtype=I32),
    )
    inputs = dict(q=rnd(1, T, H, K), k=rnd(1, T, H, K), v=rnd(1, T, H, K), b=rnd(1, T, H))
    return torch.rand(H, generator=gen) - 0.5, rnd(1, T, H, K), torch.randn(H * K, generator=gen) * 0.1, inputs, state


def _verify(hist, base, flush_min=1, **kw):
    A_log, g, dt_bias, inputs, state = _ucache(hist, base)
    out = ucache_verify_flush_ref(A_log, g, dt_bias, -5.0, **inputs, **state, flush_min=flush_min, w_ring=16, **kw)
    return out, state


def _same_step(a, b, cursors=True):
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
    names = ("initial_state_source", "k_cache", "u_cache", "g_cache") + (("hist_len", "cache_base") if cursors else ())
    for name in names:
        assert torch.equal(a[1][name], b[1][name]), name


def test_a_hist_len_above_the_window_replays_the_full_window():
    top = max_hist_len(4, 16)
    _same_step(_verify(top + 9, 5, restart_hist_on_flush=False), _verify(top, 5, restart_hist_on_flush=False),
               cursors=False)


def test_a_negative_hist_len_replays_nothing():
    _same_step(_verify(-7, 5, flush_min=3), _verify(0, 5, flush_min=3), cursors=False)


@pytest.mark.parametrize("base", [32 + 5, -27, INT_MIN + 5])
def test_cache_base_is_read_modulo_the_ring(base):
    a, b = _verify(6, base, restart_hist_on_flush=False), _verify(6, base & 31, restart_hist_on_flush=False)
    _same_step(a, b, cursors=False)


def test_the_restart_advances_the_base_by_the_clamped_hist_len():
    top = max_hist_len(4, 16)
    _, state = _verify(top + 9, 37)
    assert state["hist_len"].tolist() == [0]
    assert state["cache_base"].tolist() == [(37 % 32 + top) % 32]
