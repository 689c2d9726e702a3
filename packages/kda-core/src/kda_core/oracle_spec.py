"""Plain PyTorch references of the spec-decode modes of ``recurrent_kda`` and of the RecoverSSM commit
(docs/design.md §9).

:func:`spec_verify_ref` is the whole ``recurrent_kda`` call with the six spec-decode keywords of
:class:`kda_core.call_args.SpecArgs` (FlashInfer ``recurrent_kda`` keywords, docs/serving.md §5; SGLang target verify
with EAGLE-tree parents, docs/serving.md §4); :func:`recoverssm_commit_ref` and :func:`recoverssm_commit_layers_ref`
fold a frozen verify's records into a checkpoint (vLLM RecoverSSM, ``vllm/models/kimi_k3/nvidia/ops/recoverssm.py``
@ 055e47c28003156421365af985d676fc921cb075; docs/serving.md §1).

Same conventions as :mod:`kda_core.oracle`: fp32 by default, no autograd, pools and caches updated in place as the
kernels update them, device data (slot, parent and source indices, accepted counts, offsets) bounded in 64 bits
exactly as the kernels bound it, so every call validation accepts has an answer here.
"""

from __future__ import annotations

import torch

from kda_core.call_args import RecurrentArgs, SpecArgs
from kda_core.contracts import NullSlotPolicy, first_live_slot, null_policy_of
from kda_core.errors import fail
from kda_core.oracle import _in_pool, _prepare, _scatter_output, _spec_read_slots
from kda_core.oracle_step import _l2norm, kda_gate_ref, kda_step_ref
from kda_core.validation_spec import _overlap, spec_combination

__all__ = ["spec_verify_ref", "recoverssm_commit_ref", "recoverssm_commit_layers_ref"]


def _spec_mode(args: RecurrentArgs, spec: SpecArgs) -> None:
    """Refuse what validation refuses about the keyword combination (docs/design.md §9), and a pool overlapping the
    source; shapes, dtypes and strides are validation's alone (:func:`kda_core.validation_spec.validate_spec`)."""
    spec_combination(args, spec)
    src = spec.initial_state_source
    if src is not None and args.initial_state is not None and _overlap(src, args.initial_state):
        fail("initial_state", "a pool not overlapping initial_state_source", "an overlapping tensor")


def _raw_rows(x, grid, group=1):
    """x [B, T, h, D] at each sequence's tokens, [N, Tmax, h * group, D], in x's dtype (raw k and raw g)."""
    seq_b, seq_t, _ = grid
    if x.shape[1] == 0:
        rows = x.new_zeros((*seq_t.shape, *x.shape[2:]))
    else:
        rows = x[seq_b, seq_t]
    return rows.repeat_interleave(group, dim=2) if group > 1 else rows


@torch.no_grad()
def spec_verify_ref(args: RecurrentArgs, spec: SpecArgs, *, null_policy=NullSlotPolicy.OUT_OF_RANGE,
                    dtype=torch.float32, out_dtype=torch.bfloat16):
    """Token-loop reference of one ``recurrent_kda`` call with the spec-decode keywords (docs/design.md §9).

    With ``SpecArgs()`` (all defaults) this is :func:`kda_core.oracle.recurrent_kda_ref_args`, bitwise.

    First state R_n of sequence n (the tensor it is read from is the *read tensor*, its row the *read slot* r):
      - ``initial_state_source`` [Ps, HV, V, K] with ``initial_state_indices`` [N_seq]:
        ``r = initial_state_indices[n]``, ``R_n = source[r]``; r null under ``null_policy`` against Ps makes the
        sequence inactive (zero outputs, nothing read or written, no records). ``num_accepted_tokens`` is refused.
      - otherwise the pool ``initial_state`` at ``ssm_state_indices[n]`` (1-D), or at ``ssm_state_indices[n, col]``
        (2-D, ``col = max(min(nat, T_idx), 1) - 1``, column 0 without ``num_accepted_tokens`` and always column 0
        with ``disable_state_update=True``), null rows as in :func:`kda_core.oracle.recurrent_kda_ref`.
      R_n is read before the call writes anything (a pool slot the row also writes holds R_n for the whole call).

    Writes:
      - ``disable_state_update=True`` (frozen verify): every token of an active sequence runs and nothing is
        written but the output (and the records); the read tensor is bitwise untouched. Only the read slot of
        2-D indices matters. Refused: ``num_accepted_tokens``, ``output_final_state=True``, ``parent_indices``;
        without a source, a missing pool or indices; with a source, a pool or indices (nobody would write them).
      - otherwise, with a source: 2-D indices store the state after token t to ``initial_state[idx[n, t]]`` for
        t < T_idx (a null write slot or t >= T_idx skips the token: zero output, no write, not absorbed); 1-D
        indices store the final state to ``initial_state[idx[n]]`` unless that slot is null (outputs are computed
        either way). ``initial_state`` overlapping the source is refused (KDAError naming ``initial_state``).
      - no source and no frozen verify: the plain call.

    Records (``correction_cache`` [Pr, HV, T_max, V] and ``kg_cache`` [Pr, HV, T_max, 2K], both or neither, only
    with a frozen verify; Pr is the read tensor's row count): for an active sequence with read slot r and token
    t < min(T_n, T_max): ``correction_cache[r, hv, t] = u_t`` (in ``dtype`` then the cache's dtype: the step's
    ``b (v - S' k^)``), ``kg_cache[r, hv, t, :K] = k_t`` of query head hv // G and ``kg_cache[r, hv, t, K:] = g_t``,
    both raw (as given, unnormalised). Nothing else of either cache is written.

    Tree verify (``parent_indices`` [N_seq, T_p]; 2-D indices, no frozen verify): token t has parent
    ``p = parent_indices[n, t]`` for t < T_p, else t - 1 (compared in 64 bits). With 0 <= p < t it starts from the
    state stored for token p (``initial_state[idx[n, p]]`` as this call wrote it, so rounded to the pool's dtype)
    and is dead when token p was dead or skipped; otherwise it starts from R_n. A skipped token (null write slot, or
    t >= T_idx) and a dead one have zero output and write nothing.

    Returns (o [B, T, HV, V] in ``out_dtype`` (None: ``dtype``), the pool ``initial_state`` when
    ``ssm_state_indices`` is given, else the final dense state when ``output_final_state``, else None).
    """
    if not isinstance(spec, SpecArgs):
        fail("spec", "a kda_core.call_args.SpecArgs", type(spec).__name__)
    a = args
    _spec_mode(a, spec)
    null_policy = null_policy_of(null_policy)
    first = first_live_slot(null_policy)
    out_dtype = dtype if out_dtype is None else out_dtype
    B, T, H, K = a.q.shape
    HV, V = a.v.shape[2], a.v.shape[3]
    qf, kf, vf, g_log, bf, scale, grid = _prepare(
        a.q, a.k, a.v, a.g, a.beta, a.A_log, a.dt_bias, a.scale, a.use_gate_in_kernel, a.lower_bound,
        a.beta_is_logit, a.cu_seqlens, dtype,
    )
    _, _, tok_valid = grid
    N, t_max = tok_valid.shape
    dev = a.q.device
    frozen = bool(spec.disable_state_update)
    src = spec.initial_state_source
    pool = a.initial_state if a.ssm_state_indices is not None else None
    idx = None if a.ssm_state_indices is None else a.ssm_state_indices.to(device=dev, dtype=torch.long)

    # First states: the read tensor, its read slots, the active rows.
    write_slots = None  # 2-D write columns (per-token checkpoints)
    final_slots = None  # 1-D final-state slots
    if src is not None:
        read_tensor = src
        read_slots = spec.initial_state_indices.to(device=dev, dtype=torch.long).reshape(-1)
        if read_slots.numel() != N:
            fail("initial_state_indices", f"shape [{N}] (one per sequence)", tuple(spec.initial_state_indices.shape))
        if idx is not None and not frozen:
            if idx.dim() == 1:
                final_slots = idx
            else:
                write_slots = idx
    elif idx is not None:
        read_tensor = pool
        if idx.dim() == 1:
            if a.num_accepted_tokens is not None:
                fail("num_accepted_tokens", "None with 1-D ssm_state_indices", "a tensor")
            read_slots = idx
            if not frozen:
                final_slots = idx
        elif frozen:
            read_slots = _spec_read_slots(idx, None, dev, null_policy)
        else:
            write_slots = idx
            read_slots = _spec_read_slots(idx, a.num_accepted_tokens, dev, null_policy)
    else:
        read_tensor = read_slots = None

    if read_tensor is not None:
        Pr = read_tensor.shape[0]
        active = _in_pool(read_slots, Pr, first)
        S = torch.zeros(N, HV, V, K, dtype=dtype, device=dev)
        if bool(active.any()):
            S[active] = read_tensor[read_slots[active]].to(dtype)
    else:
        active = torch.ones(N, dtype=torch.bool, device=dev)
        S = torch.zeros(N, HV, V, K, dtype=dtype, device=dev) if a.initial_state is None else \
            a.initial_state.to(dtype).clone()
    P = None if pool is None else pool.shape[0]

    records = spec.correction_cache is not None
    if records:
        cc, kg = spec.correction_cache, spec.kg_cache
        T_rec = cc.shape[2]
        k_raw = _raw_rows(a.k, grid, HV // H)  # [N, Tmax, HV, K]
        g_raw = _raw_rows(a.g, grid)

    tree = spec.parent_indices is not None
    if tree:
        parents = spec.parent_indices.to(device=dev, dtype=torch.long)
        T_p = parents.shape[1]
        R = S
        ok = torch.zeros(N, t_max, dtype=torch.bool, device=dev)  # token ran (neither skipped nor dead)
        rows = torch.arange(N, device=dev)

    o_seq = torch.zeros(N, t_max, HV, V, dtype=dtype, device=dev)
    for t in range(t_max):
        step = tok_valid[:, t] & active
        if write_slots is not None:
            step = step & (t < write_slots.shape[1]) & _in_pool(write_slots[:, min(t, write_slots.shape[1] - 1)], P,
                                                                first)
        if tree:
            p = parents[:, t] if t < T_p else torch.full((N,), t - 1, dtype=torch.long, device=dev)
            from_parent = (p >= 0) & (p < t)
            pc = torch.where(from_parent, p, torch.zeros_like(p))
            live_parent = from_parent & ok[rows, pc]
            step = step & ~(from_parent & ~live_parent)  # a dead parent: the token is dead too
            S_in = R
            if bool(live_parent.any()):  # the state stored for token p, read back from its slot (pool dtype)
                slot = write_slots[rows, pc.clamp(max=write_slots.shape[1] - 1)]
                slot = torch.where(live_parent, slot, torch.full_like(slot, first))
                S_in = torch.where(live_parent[:, None, None, None], pool[slot].to(dtype), R)
        else:
            S_in = S
        S_new, o, u, _ = kda_step_ref(
            S_in, qf[:, t], kf[:, t], vf[:, t], g_log[:, t], bf[:, t], scale, a.use_qk_l2norm_in_kernel
        )
        m = step[:, None, None, None]
        S = torch.where(m, S_new, S)
        o_seq[:, t] = torch.where(step[:, None, None], o, torch.zeros_like(o))
        if tree:
            ok[:, t] = step
            if bool(step.any()):
                pool[write_slots[step, t]] = S_new[step].to(pool.dtype)
        elif write_slots is not None and bool(step.any()):
            pool[write_slots[step, t]] = S[step].to(pool.dtype)
        if records and t < T_rec and bool(step.any()):
            r = read_slots[step]
            cc[r, :, t] = u[step].to(cc.dtype)
            kg[r, :, t, :K] = k_raw[step, t].to(kg.dtype)
            kg[r, :, t, K:] = g_raw[step, t].to(kg.dtype)

    if final_slots is not None:
        keep = active & _in_pool(final_slots, P, first)
        if bool(keep.any()):
            pool[final_slots[keep]] = S[keep].to(pool.dtype)

    o = _scatter_output(o_seq, grid, B, T, HV, V, out_dtype, dev)
    if a.output is not None:
        o = a.output.copy_(o)
    if pool is not None:
        return o, pool
    return o, (S if a.output_final_state and not frozen and src is None else None)


def _commit_lengths(num_accepted_tokens, query_start_loc, N, T_max, dev):
    """commit_len_n = clamp(nat[n], 0, min(len_n, T_max)) in 64 bits, len_n = max(qsl[n+1] - qsl[n], 0) (T_max
    without ``query_start_loc``)."""
    nat = num_accepted_tokens.to(device=dev, dtype=torch.long).reshape(-1)
    if query_start_loc is None:
        lens = torch.full((N,), T_max, dtype=torch.long, device=dev)
    else:
        qsl = query_start_loc.to(device=dev, dtype=torch.long).reshape(-1)
        lens = (qsl[1:N + 1] - qsl[:N]).clamp(min=0)
    return torch.minimum(nat.clamp(min=0), lens.clamp(max=T_max))


@torch.no_grad()
def recoverssm_commit_ref(checkpoint_state, correction_cache, kg_cache, state_indices, num_accepted_tokens, A_log,
                          dt_bias, lower_bound, *, query_start_loc=None, use_qk_l2norm_in_kernel=True,
                          null_policy=NullSlotPolicy.OUT_OF_RANGE, destination_indices=None, dtype=torch.float32):
    """Fold a frozen verify's RecoverSSM records into the checkpoint, in place (docs/design.md §9; vLLM RecoverSSM
    ``vllm/models/kimi_k3/nvidia/ops/recoverssm.py`` @ 055e47c28003156421365af985d676fc921cb075).

    checkpoint_state [P, HV, V, K] (bf16/fp32), correction_cache [P, HV, T_max, V] fp32, kg_cache [P, HV, T_max, 2K]
    (raw k | raw g), state_indices [N], num_accepted_tokens [N], query_start_loc [N + 1] or None.

    ``len_n = max(qsl[n+1] - qsl[n], 0)`` (T_max without offsets) and ``commit_len_n = clamp(nat[n], 0,
    min(len_n, T_max))``, in 64 bits. Row n is null (nothing read or written) iff ``state_indices[n]`` is null under
    ``null_policy`` against P or commit_len_n == 0. Otherwise, per value head, from S = checkpoint[s] in ``dtype``,
    for t < commit_len: ``S = S * exp(gate(g_t))[None, :] + u_t[:, None] * k^_t[None, :]`` with k^_t the L2-normalised
    raw key (raw with ``use_qk_l2norm_in_kernel=False``), ``gate`` docs/design.md §3 steps 1-2 with A_log [H] /
    dt_bias [H*K] of query head hv // (HV // H) (``lower_bound`` None: softplus form; ``A_log`` None: the raw g is
    the log decay and ``dt_bias`` is unused), ``u_t = correction_cache[s, hv, t]``; S is stored rounded once.

    ``destination_indices`` [N] (the dtype of ``state_indices``) or None: row n stores S in slot
    ``d = destination_indices[n]`` instead of s (read from s, its records from s; slot s is then left as it was
    unless d == s); a null d under ``null_policy`` makes the row null. None: d = s (in place).

    Returns ``checkpoint_state``.
    """
    null_policy = null_policy_of(null_policy)
    first = first_live_slot(null_policy)
    P, HV, V, K = checkpoint_state.shape
    T_max = correction_cache.shape[2]
    dev = checkpoint_state.device
    slots = state_indices.to(device=dev, dtype=torch.long).reshape(-1)
    N = slots.numel()
    commit = _commit_lengths(num_accepted_tokens, query_start_loc, N, T_max, dev)
    live = _in_pool(slots, P, first) & (commit > 0)
    dst = slots
    if destination_indices is not None:
        dst = destination_indices.to(device=dev, dtype=torch.long).reshape(-1)
        live &= _in_pool(dst, P, first)
    if not bool(live.any()):
        return checkpoint_state
    s = slots[live]
    n_len = commit[live]
    S = checkpoint_state[s].to(dtype)
    use_gate = A_log is not None
    for t in range(int(n_len.max().item())):
        run = (t < n_len)[:, None, None, None]
        kgt = kg_cache[s, :, t].to(dtype)  # [n, HV, 2K]
        k, graw = kgt[..., :K], kgt[..., K:]
        if use_qk_l2norm_in_kernel:
            k = _l2norm(k)
        g_log = kda_gate_ref(graw, A_log, dt_bias, lower_bound, use_gate, dtype)
        u = correction_cache[s, :, t].to(dtype)  # [n, HV, V]
        S_new = S * torch.exp(g_log).unsqueeze(-2) + u.unsqueeze(-1) * k.unsqueeze(-2)
        S = torch.where(run, S_new, S)
    checkpoint_state[dst[live]] = S.to(checkpoint_state.dtype)
    return checkpoint_state


def recoverssm_commit_layers_ref(checkpoints, correction_caches, kg_caches, A_logs, dt_biases, lower_bound,
                                 state_indices, num_accepted_tokens, *, query_start_loc=None,
                                 use_qk_l2norm_in_kernel=True, null_policy=NullSlotPolicy.OUT_OF_RANGE,
                                 destination_indices=None, dtype=torch.float32):
    """:func:`recoverssm_commit_ref` for L layers sharing slots, destinations, accepted counts and offsets (vLLM
    commits every layer in one launch): per layer i, checkpoint ``checkpoints[i]``, caches ``correction_caches[i]`` /
    ``kg_caches[i]``, ``A_logs[i]`` and ``dt_biases[i]`` (either list may be None: None for every layer), one
    ``lower_bound``. Returns the list of checkpoints."""
    L = len(checkpoints)
    A_logs = [None] * L if A_logs is None else list(A_logs)
    dt_biases = [None] * L if dt_biases is None else list(dt_biases)
    for name, seq in (("correction_caches", correction_caches), ("kg_caches", kg_caches), ("A_logs", A_logs),
                      ("dt_biases", dt_biases)):
        if len(seq) != L:
            fail(name, f"{L} entries (one per layer)", len(seq))
    for i in range(L):
        recoverssm_commit_ref(checkpoints[i], correction_caches[i], kg_caches[i], state_indices, num_accepted_tokens,
                              A_logs[i], dt_biases[i], lower_bound, query_start_loc=query_start_loc,
                              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, null_policy=null_policy,
                              destination_indices=destination_indices, dtype=dtype)
    return list(checkpoints)
