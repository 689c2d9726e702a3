"""Plain PyTorch references of every kda operation (docs/design.md §3-§5).

Written for clarity, not speed: fp32 by default (``dtype=torch.float64`` for drift studies), on CPU or CUDA
tensors. Every kernel test compares against these functions. The pool semantics are docs/design.md §4's: a slot
outside [0, N) makes its row inactive (zero output, pool neither read nor written), and every stored state is
rounded once to the pool's dtype from the running fp32/fp64 state. Device data (slot indices, varlen offsets,
accepted counts, ucache cursors) is bounded exactly as the kernels bound it, so every input validation accepts has
an answer here. The references run without autograd: they update pools in place as the kernels do.

The ucache references live in :mod:`kda_core.oracle_ucache` and are re-exported here; the spec-decode references
(source pool, frozen verify, RecoverSSM records and commit, tree verify) live in :mod:`kda_core.oracle_spec`, which
builds on this module (import them from there: a re-export here would make the two modules import each other).
"""

from __future__ import annotations

import torch

from kda_core.call_args import RecurrentArgs
from kda_core.contracts import NullSlotPolicy, first_live_slot, null_policy_of
from kda_core.errors import fail
from kda_core.oracle_step import _l2norm, kda_gate_ref, kda_step_ref
from kda_core.oracle_ucache import commit_ucache_ref, ucache_verify_flush_ref

__all__ = [
    "kda_gate_ref",
    "kda_step_ref",
    "recurrent_kda_ref",
    "recurrent_kda_ref_args",
    "recurrent_kda_wy_ref",
    "unpack_packed",
    "ucache_verify_flush_ref",
    "commit_ucache_ref",
]


def _token_grid(B, T, cu_seqlens, device):
    """(seq_b, seq_t, valid) of shape [N, Tmax]: where token t of sequence n lives in the [B, T] inputs.

    Varlen offsets are device data and may be malformed; they are bounded as every kernel bounds them
    (docs/design.md §4), in 64 bits before anything narrows: ``bos_n = clamp(cu[n], 0, T)`` and
    ``eos_n = clamp(cu[n + 1], bos_n, T)``. Sequence n owns tokens [bos_n, eos_n), empty when the end precedes the
    start, so Tmax <= T whatever the offsets hold.
    """
    if cu_seqlens is None:
        seq_b = torch.arange(B, device=device)[:, None].expand(B, T)
        seq_t = torch.arange(T, device=device)[None, :].expand(B, T)
        return seq_b, seq_t, torch.ones(B, T, dtype=torch.bool, device=device)
    if B != 1:
        fail("q", "batch size 1 when cu_seqlens is given", f"batch size {B}")
    bos, eos = _clamped_offsets(cu_seqlens, T, device)
    lens = eos - bos
    N = lens.numel()
    t_max = int(lens.max().item()) if N else 0
    t = torch.arange(max(t_max, 1), device=device)[None, :].expand(N, max(t_max, 1))
    valid = t < lens[:, None]
    seq_t = torch.where(valid, bos[:, None] + t, torch.zeros_like(t))
    return torch.zeros_like(seq_t), seq_t, valid


def _clamped_offsets(cu_seqlens, T_total, device):
    """(bos, eos) int64 [N]: ``bos_n = clamp(cu[n], 0, T_total)``, ``eos_n = clamp(cu[n + 1], bos_n, T_total)``."""
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    bos = cu[:-1].clamp(0, T_total)
    eos = torch.maximum(cu[1:].clamp(max=T_total), bos)
    return bos, eos


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
    """The [B, T, HV, V] output: each sequence's tokens at their place, zeros elsewhere.

    Sequences are written in order, so where malformed varlen offsets make two sequences claim one token the later
    sequence's output is the one kept (the kernels leave such outputs unspecified; their states stay exact).
    """
    seq_b, seq_t, valid = grid
    out = torch.zeros(B, T, HV, V, dtype=out_dtype, device=device)
    place = (seq_b * T + seq_t)[valid]
    if place.numel() == torch.unique(place).numel():  # no token claimed twice
        out[seq_b[valid], seq_t[valid]] = o_seq[valid].to(out_dtype)
        return out
    for n, (start, count) in enumerate(zip(seq_t[:, 0].tolist(), valid.sum(1).tolist())):
        out[0, start:start + count] = o_seq[n, :count].to(out_dtype)
    return out


def _in_pool(slots, N, first=0):
    """Live slots: in [first, N) (``first`` is :func:`kda_core.contracts.first_live_slot` of the null policy)."""
    return (slots >= first) & (slots < N)


def _spec_read_slots(idx, num_accepted_tokens, dev, null_policy=NullSlotPolicy.OUT_OF_RANGE):
    """The slot each spec-decode row reads its first state from: ``idx[n, col]`` with
    ``col = max(min(nat, T_idx), 1) - 1`` in 64 bits (so INT_MIN, 0 and negatives read column 0 and counts above
    the T_idx columns read the last), column 0 without ``num_accepted_tokens``; -1 (inactive) without columns.
    Under ``NONPOSITIVE`` a row whose count is outside [1, T_idx] is null as a whole (-1: nothing read or written,
    docs/design.md §4)."""
    N, T_idx = idx.shape
    if T_idx == 0:
        return torch.full((N,), -1, dtype=torch.long, device=dev)
    if num_accepted_tokens is None:
        return idx[:, 0]
    nat = num_accepted_tokens.to(device=dev, dtype=torch.long)
    col = nat.clamp(max=T_idx).clamp(min=1) - 1
    read = idx.gather(1, col[:, None])[:, 0]
    if null_policy is NullSlotPolicy.NONPOSITIVE:
        read = torch.where((nat >= 1) & (nat <= T_idx), read, torch.full_like(read, -1))
    return read


@torch.no_grad()  # a pool that requires grad is still updated in place, as the kernels update it
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
    output=None,
    dtype=torch.float32,
    out_dtype=torch.bfloat16,
    *,
    null_policy=NullSlotPolicy.OUT_OF_RANGE,
):
    """Token-loop reference of the KDA recurrence, with the facade's argument names and order
    (:func:`recurrent_kda_ref_args` takes them bundled).

    Shapes: q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV]; with ``cu_seqlens`` ([N+1]) B is 1
    and the N sequences are concatenated along T.

    State modes:
      - ``ssm_state_indices`` [N] (1-D): ``initial_state`` is the pool [P, HV, V, K] (bf16 or fp32); sequence n reads
        slot idx[n], runs its tokens in ``dtype`` and stores the final state back, rounded once.
      - ``ssm_state_indices`` [N, T] (2-D, spec decode): the first state is read from slot
        idx[n, max(min(num_accepted_tokens[n], T), 1) - 1] (column 0 without ``num_accepted_tokens``) and after
        token t the state is stored to slot idx[n, t]. A token whose slot is outside the pool is skipped: zero
        output, no write, and the running state does not absorb it.
      - no indices: ``initial_state`` is dense [N, HV, V, K] or None (zeros); final_state is [N, HV, V, K] in
        ``dtype`` when ``output_final_state``.
    A null read slot makes the whole sequence inactive: zero output, pool untouched.

    ``null_policy`` (docs/design.md §4; the enum or its string value): ``OUT_OF_RANGE`` (the default) makes a slot
    null iff it is outside [0, P); ``NONPOSITIVE`` (vLLM) iff it is <= 0 or >= P, so slot 0 is never read or
    written, and with 2-D indices a row whose ``num_accepted_tokens`` is outside [1, T_idx] is null as a whole
    (zero outputs, nothing read or written).

    ``output``: a [B, T, HV, V] tensor the output is written into (converted to its dtype) and returned as ``o``,
    as the kernels do; None allocates.

    Returns (o [B, T, HV, V] in ``out_dtype`` (``None``: ``dtype``), final_state (the pool in pool modes)).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    null_policy = null_policy_of(null_policy)
    first = first_live_slot(null_policy)
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
            read_slots = _spec_read_slots(idx, num_accepted_tokens, dev, null_policy)
        active = _in_pool(read_slots, P, first)
        S = torch.zeros(N, HV, V, K, dtype=dtype, device=dev)
        if bool(active.any()):
            S[active] = pool[read_slots[active]].to(dtype)
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
            step = step & (t < write_slots.shape[1]) & _in_pool(write_slots[:, min(t, write_slots.shape[1] - 1)], P,
                                                                first)
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
    if output is not None:
        o = output.copy_(o)  # under no_grad: an output that requires grad is written as the kernels write it
    if pool is not None:
        return o, pool
    return o, (S if output_final_state else None)


def recurrent_kda_ref_args(args: RecurrentArgs, *, dtype=torch.float32, out_dtype=torch.bfloat16,
                           null_policy=NullSlotPolicy.OUT_OF_RANGE):
    """:func:`recurrent_kda_ref` on a call's :class:`kda_core.call_args.RecurrentArgs` (the facade's oracle path).
    The bundle's order is that function's positional order, so this is the one body."""
    return recurrent_kda_ref(*args, dtype=dtype, out_dtype=out_dtype, null_policy=null_policy)


@torch.no_grad()
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
        S0 = torch.zeros(B, HV, V, K, dtype=dtype, device=dev)
        if bool(active.any()):
            S0[active] = pool[slots[active]].to(dtype)
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
