"""Reference of the ReplaySSM "ucache" verify+flush step and the caller's commit (docs/design.md §5).

Per request b (pool slot s = initial_state_indices[b]) and head h, the ring holds P logical rows j < P at physical
slot (base + j) & 31: k^_j (bf16), u_j (bf16) and G_j (fp32, cumulative log-decay since the checkpoint S0, per
channel). The cursors are device data and are bounded as every kernel bounds them: P = clamp(hist_len[b], 0,
max_hist_len) with max_hist_len = min(w_ring, 32 - T), and base = cache_base[b] & 31. With bdec = exp(G_{P-1}) and
w_j = exp(G_{P-1} - G_j):

    S_commit = S0 * bdec + sum_{j<P} u_j (w_j * k^_j)^T

The T draft tokens run from S_commit with the decay restarting at 0; every draft s is appended at physical slot
(base + P + s) & 31 (k^_s, u_s, and G = G_{P-1} + cum_s on a verify row or cum_s on a flush row). When
P >= flush_min the step also stores S_commit to the pool (one rounding); the drafts of this call are not folded,
and with restart_hist_on_flush the row's cursors become base = (base + P) & 31, hist_len = 0.
"""

from __future__ import annotations

import torch

from kda_core.contracts import (
    RING_SLOTS,
    NullSlotPolicy,
    default_flush_min,
    first_live_slot,
    max_hist_len,
    null_policy_of,
)
from kda_core.oracle_step import kda_gate_ref, kda_step_ref

__all__ = ["ucache_verify_flush_ref", "commit_ucache_ref"]


@torch.no_grad()
def ucache_verify_flush_ref(
    A_log,
    g,
    dt_bias,
    lower_bound=-5.0,
    *,
    q,
    k,
    v,
    b,
    initial_state_source,
    initial_state_indices,
    k_cache,
    u_cache,
    g_cache,
    hist_len,
    cache_base,
    flush_min=None,
    restart_hist_on_flush=True,
    w_ring=16,
    scale=None,
    use_qk_l2norm_in_kernel=True,
    dtype=torch.float32,
    out_dtype=torch.bfloat16,
    null_policy=NullSlotPolicy.OUT_OF_RANGE,
):
    """One verify(+flush) step; mutates the pool, the rings and (restart_hist_on_flush) the cursors in place.

    q, k, v, g: [B, T, H, 128] bf16; b: [B, T, H] beta logits; A_log [H], dt_bias [H*128] fp32 or None (zeros);
    initial_state_source: pool [N, H, 128, 128]; initial_state_indices, hist_len, cache_base: int32 [B];
    k_cache, u_cache: [N, H, 32, 128] bf16; g_cache: [N, H, 32, 128] fp32. lower_bound None is the softplus gate.
    Returns the draft outputs [B, T, H, 128] in ``out_dtype`` (``None``: ``dtype``).
    ``null_policy`` (docs/design.md §4; the enum or its string value): a row whose slot is null (``OUT_OF_RANGE``:
    outside [0, N); ``NONPOSITIVE``: <= 0 or >= N) gets zero output, and neither its pool row, its rings nor its
    cursors are read or written.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    pool = initial_state_source
    N = pool.shape[0]
    first = first_live_slot(null_policy_of(null_policy))
    if flush_min is None:
        flush_min = default_flush_min(T, w_ring)
    scale = K**-0.5 if scale is None else scale
    out_dtype = dtype if out_dtype is None else out_dtype
    out = torch.zeros(B, T, H, V, dtype=dtype, device=q.device)
    top = max_hist_len(T, w_ring)
    slots = initial_state_indices.tolist()
    lens = hist_len.tolist()
    bases = cache_base.tolist()
    for i in range(B):
        s = slots[i]
        if not first <= s < N:
            continue  # inactive row: nothing read or written
        P = min(max(lens[i], 0), top)  # the cursors as the kernels read them
        base = bases[i] & (RING_SLOTS - 1)
        phys = [(base + j) % RING_SLOTS for j in range(P)]
        S0 = pool[s].to(dtype)  # [H, V, K]
        if P > 0:
            kh = k_cache[s][:, phys].to(dtype)  # [H, P, K]
            uh = u_cache[s][:, phys].to(dtype)  # [H, P, V]
            Gh = g_cache[s][:, phys].to(dtype)  # [H, P, K]
            g_last = Gh[:, -1]
            w = torch.exp(g_last[:, None, :] - Gh)
            S = S0 * torch.exp(g_last)[:, None, :] + torch.einsum("hpv,hpk->hvk", uh, w * kh)
        else:
            g_last = torch.zeros(H, K, dtype=dtype, device=q.device)
            S = S0.clone()
        flush = P >= flush_min
        if flush:
            pool[s] = S.to(pool.dtype)
        g_log = kda_gate_ref(g[i], A_log, dt_bias, lower_bound, True, dtype)  # [T, H, K]
        beta = torch.sigmoid(b[i].to(dtype))  # [T, H]
        cum = torch.zeros(H, K, dtype=dtype, device=q.device)
        for t in range(T):
            cum = cum + g_log[t]
            S, o, u, k_hat = kda_step_ref(
                S, q[i, t].to(dtype), k[i, t].to(dtype), v[i, t].to(dtype), g_log[t], beta[t], scale,
                use_qk_l2norm_in_kernel,
            )
            out[i, t] = o
            slot = (base + P + t) % RING_SLOTS
            k_cache[s, :, slot] = k_hat.to(k_cache.dtype)
            u_cache[s, :, slot] = u.to(u_cache.dtype)
            g_cache[s, :, slot] = (cum if flush else g_last + cum).to(g_cache.dtype)
        if flush and restart_hist_on_flush:
            cache_base[i] = (base + P) & (RING_SLOTS - 1)
            hist_len[i] = 0
    return out.to(out_dtype)


def commit_ucache_ref(hist_len, cache_base, num_accepted_tokens, flush_min=None):
    """The caller's commit after sampling, in place.

    ``flush_min=None``: the step ran with restart_hist_on_flush=True (flush rows already restarted), so every row
    does hist_len += accepted. Otherwise rows with hist_len >= flush_min flushed: base = (base + hist_len) & 31,
    hist_len = accepted; the other rows hist_len += accepted.
    """
    acc = num_accepted_tokens.to(hist_len.dtype)
    if flush_min is None:
        hist_len += acc
        return hist_len, cache_base
    flushed = hist_len >= flush_min
    cache_base.copy_(torch.where(flushed, (cache_base + hist_len) % RING_SLOTS, cache_base))
    hist_len.copy_(torch.where(flushed, acc, hist_len + acc))
    return hist_len, cache_base
