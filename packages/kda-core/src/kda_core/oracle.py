"""Plain PyTorch references of every kda operation (DESIGN §3-§5).

Written for clarity, not speed: fp32 by default (``dtype=torch.float64`` for drift studies), on CPU or CUDA
tensors. Every kernel test compares against these functions. The pool semantics are DESIGN §4's: a slot outside
[0, N) makes its row inactive (zero output, pool neither read nor written), and every stored state is rounded once
to the pool's dtype from the running fp32/fp64 state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kda_core.contracts import L2NORM_EPS
from kda_core.errors import fail

__all__ = [
    "kda_gate_ref",
    "kda_step_ref",
    "recurrent_kda_ref",
    "recurrent_kda_wy_ref",
    "unpack_packed",
]


def kda_gate_ref(g, A_log=None, dt_bias=None, lower_bound=None, use_gate_in_kernel=True, dtype=torch.float32):
    """Log-space decay g_log [..., HV, K] from the gate input g [..., HV, K] (DESIGN §3 steps 1-2).

    A_log [H] and dt_bias [H*K] (or [H, K]) are per query head; value head hv uses query head hv // (HV // H).
    With ``use_gate_in_kernel=False`` g already is the log-space decay and is returned upcast.
    """
    g = g.to(dtype)
    if not use_gate_in_kernel:
        return g
    HV, K = g.shape[-2], g.shape[-1]
    H = A_log.numel()
    group = HV // H
    rate = torch.exp(A_log.to(dtype).reshape(H)).repeat_interleave(group)[:, None]  # [HV, 1]
    x = g
    if dt_bias is not None:
        x = x + dt_bias.to(dtype).reshape(H, K).repeat_interleave(group, dim=0)
    if lower_bound is None:
        return -rate * F.softplus(x, beta=1.0, threshold=20.0)  # softplus(x) = x for x > 20
    return lower_bound * torch.sigmoid(rate * x)


def _l2norm(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def kda_step_ref(S, q, k, v, g_log, b, scale, use_qk_l2norm_in_kernel=True):
    """One delta-rule step on fp states S [..., V, K] (DESIGN §3 steps 5-10).

    q, k, g_log: [..., K]; v: [..., V]; b: [...] (already sigmoided). Returns (S_new, o, u, k_hat).
    """
    if use_qk_l2norm_in_kernel:
        k = _l2norm(k)
        q = _l2norm(q)
    q = q * scale
    S = S * torch.exp(g_log).unsqueeze(-2)  # decay first, per key channel (column)
    p = (S * k.unsqueeze(-2)).sum(-1)
    u = b.unsqueeze(-1) * (v - p)
    S = S + u.unsqueeze(-1) * k.unsqueeze(-2)
    o = (S * q.unsqueeze(-2)).sum(-1)
    return S, o, u, k


def _token_grid(B, T, cu_seqlens, device):
    """(seq_b, seq_t, valid) of shape [N, Tmax]: where token t of sequence n lives in the [B, T] inputs."""
    if cu_seqlens is None:
        seq_b = torch.arange(B, device=device)[:, None].expand(B, T)
        seq_t = torch.arange(T, device=device)[None, :].expand(B, T)
        return seq_b, seq_t, torch.ones(B, T, dtype=torch.bool, device=device)
    if B != 1:
        fail("q", "batch size 1 when cu_seqlens is given", f"batch size {B}")
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    lens = cu[1:] - cu[:-1]
    N = lens.numel()
    t_max = int(lens.max().item()) if N else 0
    t = torch.arange(max(t_max, 1), device=device)[None, :].expand(N, max(t_max, 1))
    valid = t < lens[:, None]
    seq_t = torch.where(valid, cu[:-1, None] + t, torch.zeros_like(t))
    return torch.zeros_like(seq_t), seq_t, valid


def _prepare(q, k, v, g, beta, A_log, dt_bias, scale, use_gate_in_kernel, lower_bound, beta_is_logit, cu_seqlens,
             dtype):
    B, T, H, K = q.shape
    HV = v.shape[2]
    if HV % H:
        fail("v", f"a value-head count divisible by the query-head count {H}", HV)
    seq_b, seq_t, valid = _token_grid(B, T, cu_seqlens, q.device)
    group = HV // H

    def gather(x):
        if x.shape[1] == 0:  # no token at all (every varlen sequence empty): the grid's index 0 does not exist
            return x.new_zeros((*seq_t.shape, *x.shape[2:]))
        return x[seq_b, seq_t]

    qf = gather(q).to(dtype).repeat_interleave(group, dim=2)  # [N, Tmax, HV, K]
    kf = gather(k).to(dtype).repeat_interleave(group, dim=2)
    vf = gather(v).to(dtype)
    g_log = kda_gate_ref(gather(g), A_log, dt_bias, lower_bound, use_gate_in_kernel, dtype)
    bf = gather(beta).to(dtype)
    if beta_is_logit:
        bf = torch.sigmoid(bf)
    scale = K**-0.5 if scale is None else scale
    return qf, kf, vf, g_log, bf, scale, (seq_b, seq_t, valid)


def _scatter_output(o_seq, grid, B, T, HV, V, out_dtype, device):
    seq_b, seq_t, valid = grid
    out = torch.zeros(B, T, HV, V, dtype=out_dtype, device=device)
    out[seq_b[valid], seq_t[valid]] = o_seq[valid].to(out_dtype)
    return out


def _in_pool(slots, N):
    return (slots >= 0) & (slots < N)


def recurrent_kda_ref(
    q,
    k,
    v,
    g,
    beta,
    A_log=None,
    dt_bias=None,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=True,
    use_gate_in_kernel=False,
    lower_bound=None,
    beta_is_logit=False,
    cu_seqlens=None,
    ssm_state_indices=None,
    num_accepted_tokens=None,
    dtype=torch.float32,
    out_dtype=torch.bfloat16,
):
    """Token-loop reference of the KDA recurrence, with the facade's argument names.

    Shapes: q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV]; with ``cu_seqlens`` ([N+1]) B is 1
    and the N sequences are concatenated along T.

    State modes:
      - ``ssm_state_indices`` [N] (1-D): ``initial_state`` is the pool [P, HV, V, K] (bf16 or fp32); sequence n reads
        slot idx[n], runs its tokens in ``dtype`` and stores the final state back, rounded once.
      - ``ssm_state_indices`` [N, T] (2-D, spec decode): the first state is read from slot
        idx[n, clamp(num_accepted_tokens[n] - 1, 0, T - 1)] (column 0 without ``num_accepted_tokens``) and after
        token t the state is stored to slot idx[n, t]. A token whose slot is outside the pool is skipped: zero
        output, no write, and the running state does not absorb it.
      - no indices: ``initial_state`` is dense [N, HV, V, K] or None (zeros); final_state is [N, HV, V, K] in
        ``dtype`` when ``output_final_state``.
    A read slot outside [0, P) makes the whole sequence inactive: zero output, pool untouched.

    Returns (o [B, T, HV, V] in ``out_dtype`` (``None``: ``dtype``), final_state (the pool in pool modes)).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    out_dtype = dtype if out_dtype is None else out_dtype
    qf, kf, vf, g_log, bf, scale, grid = _prepare(
        q, k, v, g, beta, A_log, dt_bias, scale, use_gate_in_kernel, lower_bound, beta_is_logit, cu_seqlens, dtype
    )
    seq_b, seq_t, tok_valid = grid
    N, t_max = tok_valid.shape
    dev = q.device

    pool = None
    write_slots = None
    if ssm_state_indices is not None:
        pool = initial_state
        P = pool.shape[0]
        idx = ssm_state_indices.to(device=dev, dtype=torch.long)
        if idx.dim() == 1:
            if num_accepted_tokens is not None:
                fail("num_accepted_tokens", "None with 1-D ssm_state_indices", "a tensor")
            read_slots = idx
        else:
            write_slots = idx
            if num_accepted_tokens is None:
                col = torch.zeros(N, dtype=torch.long, device=dev)
            else:
                col = (num_accepted_tokens.to(device=dev, dtype=torch.long) - 1).clamp(0, idx.shape[1] - 1)
            read_slots = idx.gather(1, col[:, None])[:, 0]
        active = _in_pool(read_slots, P)
        S = pool[read_slots.clamp(0, P - 1)].to(dtype) * active[:, None, None, None]
    else:
        active = torch.ones(N, dtype=torch.bool, device=dev)
        if initial_state is None:
            S = torch.zeros(N, HV, V, K, dtype=dtype, device=dev)
        else:
            S = initial_state.to(dtype).clone()

    o_seq = torch.zeros(N, t_max, HV, V, dtype=dtype, device=dev)
    for t in range(t_max):
        step = tok_valid[:, t] & active
        if write_slots is not None:
            step = step & (t < write_slots.shape[1]) & _in_pool(write_slots[:, min(t, write_slots.shape[1] - 1)], P)
        S_new, o, _, _ = kda_step_ref(
            S, qf[:, t], kf[:, t], vf[:, t], g_log[:, t], bf[:, t], scale, use_qk_l2norm_in_kernel
        )
        m = step[:, None, None, None]
        S = torch.where(m, S_new, S)
        o_seq[:, t] = torch.where(step[:, None, None], o, torch.zeros_like(o))
        if write_slots is not None and bool(step.any()):
            pool[write_slots[step, t]] = S[step].to(pool.dtype)

    if pool is not None and write_slots is None and bool(active.any()):
        pool[read_slots[active]] = S[active].to(pool.dtype)

    o = _scatter_output(o_seq, grid, B, T, HV, V, out_dtype, dev)
    if pool is not None:
        return o, pool
    return o, (S if output_final_state else None)


def recurrent_kda_wy_ref(
    q,
    k,
    v,
    g,
    beta,
    A_log=None,
    dt_bias=None,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=True,
    use_gate_in_kernel=False,
    lower_bound=None,
    beta_is_logit=False,
    ssm_state_indices=None,
    dtype=torch.float32,
    out_dtype=torch.bfloat16,
):
    """The same recurrence as :func:`recurrent_kda_ref` for one chunk of T <= 16 tokens, in the chunked (WY) form.

    With cum_t the per-channel cumulative log-decay and D[t, s] = exp(cum_t - cum_s) (s <= t):
      u = (I + diag(b) A)^-1 diag(b) (v - S0 (exp(cum) * k)),  A[t, s] = sum_c k_t k_s D[t, s]  (s < t)
      o_t = S0 (exp(cum_t) * q_t) + sum_{s<=t} u_s (sum_c k_s q_t D[t, s])
      S_T = S0 * exp(cum_T) + sum_s u_s (k_s * D[T, s])^T
    Dense states or a pool with 1-D indices; no varlen, no spec decode.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if T > 16:
        fail("q", "at most 16 tokens for the WY chunk form", f"T={T}")
    out_dtype = dtype if out_dtype is None else out_dtype
    qf, kf, vf, g_log, bf, scale, grid = _prepare(
        q, k, v, g, beta, A_log, dt_bias, scale, use_gate_in_kernel, lower_bound, beta_is_logit, None, dtype
    )
    dev = q.device
    if use_qk_l2norm_in_kernel:
        kf, qf = _l2norm(kf), _l2norm(qf)
    qf = qf * scale
    pool = None
    if ssm_state_indices is not None:
        pool = initial_state
        slots = ssm_state_indices.to(device=dev, dtype=torch.long)
        active = _in_pool(slots, pool.shape[0])
        S0 = pool[slots.clamp(0, pool.shape[0] - 1)].to(dtype) * active[:, None, None, None]
    else:
        active = torch.ones(B, dtype=torch.bool, device=dev)
        S0 = torch.zeros(B, HV, V, K, dtype=dtype, device=dev) if initial_state is None else initial_state.to(dtype)

    # [B, HV, T, .] layout
    kf, qf, vf, g_log = (x.transpose(1, 2) for x in (kf, qf, vf, g_log))
    bf = bf.transpose(1, 2)
    cum = g_log.cumsum(2)  # [B, HV, T, K]
    causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
    expo = cum[:, :, :, None, :] - cum[:, :, None, :, :]  # [B, HV, t, s, K]
    D = torch.exp(torch.where(causal[None, None, :, :, None], expo, torch.full_like(expo, -torch.inf)))
    strict = causal & ~torch.eye(T, dtype=torch.bool, device=dev)
    A = torch.einsum("bhtc,bhsc,bhtsc->bhts", kf, kf, D) * strict
    gam = torch.exp(cum)
    S0k = torch.einsum("bhvc,bhtc->bhtv", S0, gam * kf)
    rhs = bf[..., None] * (vf - S0k)
    eye = torch.eye(T, dtype=dtype, device=dev)
    U = torch.linalg.solve_triangular(eye + bf[..., None] * A, rhs, upper=False)
    QK = torch.einsum("bhtc,bhsc,bhtsc->bhts", qf, kf, D) * causal
    o = torch.einsum("bhvc,bhtc->bhtv", S0, gam * qf) + torch.einsum("bhts,bhsv->bhtv", QK, U)
    S_T = S0 * gam[:, :, -1, None, :] + torch.einsum("bhsv,bhsc->bhvc", U, kf * D[:, :, -1])
    o = o * active[:, None, None, None]
    o = o.transpose(1, 2).to(out_dtype)
    if pool is not None:
        if bool(active.any()):
            pool[slots[active]] = S_T[active].to(pool.dtype)
        return o, pool
    return o, (S_T if output_final_state else None)


def unpack_packed(mixed_qkv, raw_gate, raw_beta, num_heads, head_dim=128):
    """Zero-copy T=1 views of the packed decode inputs (rows of one GEMM output; row strides may be padded).

    mixed_qkv [B, 3*H*D] laid out [q heads | k heads | v heads]; raw_gate [B, H*D]; raw_beta [B, H].
    Returns q, k, v, g [B, 1, H, D] and beta [B, 1, H].
    """
    B = mixed_qkv.shape[0]
    H, D = num_heads, head_dim
    if mixed_qkv.dim() != 2 or mixed_qkv.shape[1] != 3 * H * D:
        fail("mixed_qkv", f"shape [B, {3 * H * D}] (3 * num_heads * head_dim)", tuple(mixed_qkv.shape))
    if raw_gate.dim() != 2 or tuple(raw_gate.shape) != (B, H * D):
        fail("raw_gate", f"shape [{B}, {H * D}]", tuple(raw_gate.shape))
    if raw_beta.dim() != 2 or tuple(raw_beta.shape) != (B, H):
        fail("raw_beta", f"shape [{B}, {H}]", tuple(raw_beta.shape))
    rs = mixed_qkv.stride(0)

    def part(i):
        return mixed_qkv[:, i * H * D : (i + 1) * H * D].as_strided((B, 1, H, D), (rs, rs, D, 1),
                                                                    mixed_qkv.storage_offset() + i * H * D)

    g = raw_gate.as_strided((B, 1, H, D), (raw_gate.stride(0), raw_gate.stride(0), D, 1), raw_gate.storage_offset())
    beta = raw_beta.as_strided((B, 1, H), (raw_beta.stride(0), raw_beta.stride(0), raw_beta.stride(1)),
                               raw_beta.storage_offset())
    return part(0), part(1), part(2), g, beta


__all__ += ["ucache_verify_flush_ref", "commit_ucache_ref"]  # noqa: F822 (resolved by __getattr__ below)


def __getattr__(name):
    # The ucache references live in oracle_ucache, which imports this module's step; resolving them lazily lets
    # either module be imported first without a circular import.
    if name in ("ucache_verify_flush_ref", "commit_ucache_ref"):
        from kda_core import oracle_ucache

        return getattr(oracle_ucache, name)
    raise AttributeError(f"module 'kda_core.oracle' has no attribute {name!r}")
