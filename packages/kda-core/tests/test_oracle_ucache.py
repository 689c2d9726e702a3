"""The ucache replay oracle (docs/design.md §5) against the plain recurrence over the same accepted-token stream."""

from __future__ import annotations

import pytest
import torch

from kda_core.contracts import RING_SLOTS, default_flush_min, max_hist_len
from kda_core.oracle import kda_gate_ref, recurrent_kda_ref, ucache_verify_flush_ref
from kda_core.oracle_ucache import commit_ucache_ref

H, K = 2, 32
F64 = torch.float64


def _step_inputs(B, T, seed, lower_bound=-5.0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    return dict(q=rnd(B, T, H, K), k=rnd(B, T, H, K), v=rnd(B, T, H, K), g=rnd(B, T, H, K), b=rnd(B, T, H))


class Cache:
    """A pool, its three rings and the cursors of B requests (rows may be permuted/padded in the pool)."""

    def __init__(self, N, slots, ring_dtype=F64, g_dtype=F64, pool_dtype=F64, bases=None, seed=0):
        gen = torch.Generator().manual_seed(seed)
        B = len(slots)
        self.pool = (torch.randn(N, H, K, K, generator=gen) * 0.3).to(pool_dtype)
        self.k_cache = torch.zeros(N, H, RING_SLOTS, K, dtype=ring_dtype)
        self.u_cache = torch.zeros(N, H, RING_SLOTS, K, dtype=ring_dtype)
        self.g_cache = torch.zeros(N, H, RING_SLOTS, K, dtype=g_dtype)
        self.slots = torch.tensor(slots, dtype=torch.int32)
        self.hist_len = torch.zeros(B, dtype=torch.int32)
        self.cache_base = torch.tensor(bases if bases is not None else [0] * B, dtype=torch.int32)

    def kwargs(self):
        return dict(initial_state_source=self.pool, initial_state_indices=self.slots, k_cache=self.k_cache,
                    u_cache=self.u_cache, g_cache=self.g_cache, hist_len=self.hist_len, cache_base=self.cache_base)

    def clone(self):
        other = object.__new__(Cache)
        other.__dict__ = {k: v.clone() for k, v in self.__dict__.items()}
        return other

    def committed_state(self, T, params, w_ring=16):
        """S_commit of every request: the pool after a forced flush (flush_min=1) on a copy; S0 itself when P=0."""
        probe = self.clone()
        dummy = _step_inputs(len(self.slots), T, seed=999)
        _call(params, dummy, probe, flush_min=1, w_ring=w_ring, dtype=F64)
        return probe.pool[self.slots.long()].to(F64)


def _params(seed=0, lower_bound=-5.0):
    gen = torch.Generator().manual_seed(seed + 100)
    A_log = torch.rand(H, generator=gen) - 0.5
    dt_bias = torch.randn(H * K, generator=gen) * 0.5
    return A_log, None, dt_bias, lower_bound  # (A_log, g, dt_bias, lower_bound); g is filled per step


def _call(params, inp, cache, **kw):
    A_log, _, dt_bias, lb = params
    return ucache_verify_flush_ref(A_log, inp["g"], dt_bias, lb, q=inp["q"], k=inp["k"], v=inp["v"], b=inp["b"],
                                   **cache.kwargs(), **kw)


def _recurrence(params, inp, S0, rows=None, tokens=None):
    """Plain token-loop recurrence (fp64) of the given rows/tokens from dense states S0 [n, H, V, K]."""
    A_log, _, dt_bias, lb = params
    sel = {k: v for k, v in inp.items()}
    if rows is not None:
        sel = {k: v[rows] for k, v in sel.items()}
    if tokens is not None:
        sel = {k: v[:, tokens] for k, v in sel.items()}
    return recurrent_kda_ref(sel["q"], sel["k"], sel["v"], sel["g"], sel["b"], A_log=A_log, dt_bias=dt_bias,
                             lower_bound=lb, use_gate_in_kernel=True, beta_is_logit=True, initial_state=S0,
                             output_final_state=True, dtype=F64, out_dtype=None)


def _stream(T, w_ring, flush_min, steps, lower_bound, cache, seed, check_state=True, out_tol=1e-10):
    """Run `steps` verify steps with random acceptance; compare every draft output (and the committed state) with
    the plain recurrence of the accepted stream. Returns (flushes seen, base wraps seen, worst output error)."""
    params = _params(seed, lower_bound)
    B = len(cache.slots)
    truth = cache.pool[cache.slots.long()].to(F64).clone()
    gen = torch.Generator().manual_seed(seed)
    flushes = wraps = 0
    worst = 0.0
    for step in range(steps):
        inp = _step_inputs(B, T, seed * 1000 + step)
        P_before, base_before = cache.hist_len.clone(), cache.cache_base.clone()
        o = _call(params, inp, cache, flush_min=flush_min, w_ring=w_ring, dtype=F64, out_dtype=None)
        o_ref, _ = _recurrence(params, inp, truth)
        worst = max(worst, (o - o_ref).abs().max().item())
        torch.testing.assert_close(o, o_ref, rtol=out_tol, atol=out_tol)
        flushed = P_before >= flush_min
        flushes += int(flushed.sum())
        wraps += int((flushed & (base_before + P_before >= RING_SLOTS)).sum())
        accepted = torch.randint(1, T + 1, (B,), generator=gen, dtype=torch.int32)
        for r in range(B):
            _, S = _recurrence(params, inp, truth[[r]], rows=[r], tokens=slice(0, int(accepted[r])))
            truth[r] = S[0]
        commit_ucache_ref(cache.hist_len, cache.cache_base, accepted)
        assert int(cache.hist_len.max()) <= max_hist_len(T, w_ring)
        if check_state:
            torch.testing.assert_close(cache.committed_state(T, params, w_ring), truth, rtol=1e-10, atol=1e-10)
    return flushes, wraps, worst


@pytest.mark.parametrize("T, lower_bound", [(4, -5.0), (8, None)])
def test_replay_matches_the_recurrence_through_flushes_and_a_wrapped_base(T, lower_bound):
    cache = Cache(N=6, slots=[4, 1, 3], bases=[28, 0, 17], seed=T)
    flushes, wraps, _ = _stream(T, 16, default_flush_min(T, 16), steps=14, lower_bound=lower_bound, cache=cache,
                                seed=T)
    assert flushes >= 3 and wraps >= 1  # the stream really exercised the flush and the wrap


def test_replay_with_w_ring_32_matches_the_recurrence():
    cache = Cache(N=3, slots=[2, 0], bases=[30, 9], seed=5)
    flushes, wraps, _ = _stream(4, 32, 17, steps=14, lower_bound=-5.0, cache=cache, seed=5)
    assert flushes >= 1 and wraps >= 1


def test_replay_with_bf16_rings_and_pool_stays_close_to_the_fp64_recurrence():
    cache = Cache(N=4, slots=[3, 0], ring_dtype=torch.bfloat16, g_dtype=torch.float32, pool_dtype=torch.bfloat16,
                  bases=[27, 3], seed=7)
    flushes, _, worst = _stream(8, 16, 9, steps=10, lower_bound=-5.0, cache=cache, seed=7, check_state=False,
                                out_tol=1e-3)  # observed ~1e-4 (bf16 k^, u, pool)
    assert flushes >= 2
    assert worst > 0  # the bf16 rings really round (this is not the fp64 path by accident)


@pytest.mark.parametrize("T", [4, 8])
@pytest.mark.parametrize("flush_on_second", [False, True])
def test_two_chained_steps_equal_2T_sequential_tokens(T, flush_on_second):
    B = 2
    cache = Cache(N=5, slots=[2, 4], bases=[31, 10], seed=11)
    params = _params(11)
    S0 = cache.pool[cache.slots.long()].to(F64).clone()
    first, second = _step_inputs(B, T, 1), _step_inputs(B, T, 2)
    flush_min = 1 if flush_on_second else default_flush_min(T, 16)
    o1 = _call(params, first, cache, flush_min=flush_min, dtype=F64, out_dtype=None)  # P = 0: never flushes
    commit_ucache_ref(cache.hist_len, cache.cache_base, torch.full((B,), T, dtype=torch.int32))
    o2 = _call(params, second, cache, flush_min=flush_min, dtype=F64, out_dtype=None)
    both = {k: torch.cat([first[k], second[k]], dim=1) for k in first}
    o_ref, _ = _recurrence(params, both, S0)
    torch.testing.assert_close(torch.cat([o1, o2], dim=1), o_ref, rtol=1e-10, atol=1e-10)
    S_T = _recurrence(params, first, S0)[1]
    if flush_on_second:  # the second step folded the first step's T rows into the checkpoint
        torch.testing.assert_close(cache.pool[cache.slots.long()], S_T, rtol=1e-10, atol=1e-10)
    else:
        torch.testing.assert_close(cache.pool[cache.slots.long()], S0, rtol=0, atol=0)


@pytest.mark.parametrize("flush", [False, True])
def test_appends_land_after_the_live_window_and_a_flush_never_modifies_it(flush):
    T, P, base = 4, 13, 25  # live rows at 25..31, 0..5; appends at (25 + 13 + s) & 31 = 6..9
    cache = Cache(N=3, slots=[1], bases=[base], seed=13)
    gen = torch.Generator().manual_seed(13)
    for ring in (cache.k_cache, cache.u_cache, cache.g_cache):
        ring.copy_(torch.randn(ring.shape, generator=gen, dtype=F64) * 0.1)
    cache.g_cache[1] = -torch.rand(H, RING_SLOTS, K, generator=gen, dtype=F64)
    cache.hist_len.fill_(P)
    before = cache.clone()
    params = _params(13)
    inp = _step_inputs(1, T, 14)
    flush_min = 13 if flush else 14
    S_commit = before.committed_state(T, params)
    _call(params, inp, cache, flush_min=flush_min, dtype=F64, out_dtype=None, restart_hist_on_flush=False)

    live = [(base + j) % RING_SLOTS for j in range(P)]
    appended = [(base + P + s) % RING_SLOTS for s in range(T)]
    assert appended == [6, 7, 8, 9]
    others = [i for i in range(RING_SLOTS) if i not in appended]
    for name in ("k_cache", "u_cache", "g_cache"):
        now, then = getattr(cache, name), getattr(before, name)
        assert torch.equal(now[1][:, live], then[1][:, live]), f"{name}: live window modified"
        assert torch.equal(now[1][:, others], then[1][:, others]), f"{name}: a slot outside the appends changed"
        assert torch.equal(now[[0, 2]], then[[0, 2]]), f"{name}: another request's ring changed"
    # per-quantity appends: k^ (normalised key), cumulative log-decay (restarted on a flush)
    A_log, _, dt_bias, lb = params
    k = inp["k"][0].to(F64)
    k_hat = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(cache.k_cache[1][:, appended].transpose(0, 1), k_hat, rtol=1e-12, atol=1e-12)
    cum = kda_gate_ref(inp["g"][0], A_log, dt_bias, lb, True, F64).cumsum(0)  # [T, H, K]
    G_last = before.g_cache[1][:, live[-1]]  # [H, K]
    want_G = cum if flush else G_last[None] + cum
    torch.testing.assert_close(cache.g_cache[1][:, appended].transpose(0, 1), want_G, rtol=1e-12, atol=1e-12)
    # u, collectively: replaying the window plus the T appends gives the state after the drafts
    S_drafts = _recurrence(params, inp, S_commit)[1]
    if flush:
        torch.testing.assert_close(cache.pool[1].to(F64), S_commit[0], rtol=1e-12, atol=1e-12)
        cache.cache_base.fill_((base + P) % RING_SLOTS)
        cache.hist_len.fill_(T)
    else:
        assert torch.equal(cache.pool, before.pool)
        cache.hist_len.fill_(P + T)
    # P + T = 17 rows exceed w_ring 16's window (the cursors clamp there): the probe reads them with w_ring 32
    torch.testing.assert_close(cache.committed_state(T, params, w_ring=32), S_drafts, rtol=1e-10, atol=1e-10)


def test_inactive_rows_read_and_write_nothing():
    T, N = 4, 3
    cache = Cache(N=N, slots=[-1, 1, N], bases=[5, 0, 7], seed=17)
    cache.hist_len.copy_(torch.tensor([13, 2, 13], dtype=torch.int32))  # the inactive rows would flush
    before = cache.clone()
    o = _call(_params(17), _step_inputs(3, T, 18), cache, dtype=F64, out_dtype=None)
    assert torch.count_nonzero(o[0]) == 0 and torch.count_nonzero(o[2]) == 0 and torch.count_nonzero(o[1]) > 0
    for name in ("pool", "k_cache", "u_cache", "g_cache"):
        now, then = getattr(cache, name), getattr(before, name)
        assert torch.equal(now[[0, 2]], then[[0, 2]]), name
    assert cache.hist_len.tolist() == [13, 2, 13] and cache.cache_base.tolist() == [5, 0, 7]


def test_commit_without_restart_equals_restart_then_commit():
    T = 4
    cache = Cache(N=4, slots=[0, 1, 2, 3], bases=[30, 3, 0, 12], seed=19)
    cache.hist_len.copy_(torch.tensor([13, 2, 0, 15], dtype=torch.int32))
    other = cache.clone()
    params, inp = _params(19), _step_inputs(4, T, 20)
    accepted = torch.tensor([1, 4, 2, 3], dtype=torch.int32)
    _call(params, inp, cache, dtype=F64, restart_hist_on_flush=True)
    commit_ucache_ref(cache.hist_len, cache.cache_base, accepted)
    _call(params, inp, other, dtype=F64, restart_hist_on_flush=False)
    commit_ucache_ref(other.hist_len, other.cache_base, accepted, flush_min=default_flush_min(T, 16))
    assert cache.hist_len.tolist() == other.hist_len.tolist() == [1, 6, 2, 3]
    assert cache.cache_base.tolist() == other.cache_base.tolist() == [(30 + 13) % 32, 3, 0, (12 + 15) % 32]
