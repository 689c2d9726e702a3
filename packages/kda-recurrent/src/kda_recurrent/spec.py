"""Spec-decode entries: the facade's spec keywords, and the RecoverSSM commit (docs/design.md §9).

- :func:`spec_call` runs a ``recurrent_kda`` call that carries any of the spec keywords (``initial_state_source``,
  ``initial_state_indices``, ``disable_state_update``, ``correction_cache``, ``kg_cache``, ``parent_indices``;
  :class:`kda_core.call_args.SpecArgs`): kda-core validates the pair of bundles
  (``kda_core.validation_spec.validate_spec``), then it routes:

  1. CPU tensors: the oracle (``kda_core.oracle_spec.spec_verify_ref``);
  2. a frozen verify the tensor-core kernel takes (:func:`tc_reason` says why not): ``kda_cute.ucache.frozen_verify``
     (the ucache kernel without its ring: the drafts solved in the chunked WY form on warp MMAs);
  3. every other CUDA call: the generic kernel's spec modes (``kda_cute.generic.run(call, args, spec)``).

- :func:`recoverssm_commit` folds the accepted prefix of a RecoverSSM verify's records into one layer's
  checkpoints; :class:`RecoverSSMCommit` does it for every layer of a model in one launch (built once from the
  layers' tensors, as vLLM's commit context is). Both are CUDA-graph capturable (no host sync, no allocation per
  call) and run the oracle on CPU tensors.
"""

from __future__ import annotations

import torch

from kda_core.call_args import RecurrentArgs, SpecArgs
from kda_core.contracts import T1_HEAD_COUNTS, UCACHE_T, GateMode, NullSlotPolicy, null_policy_of
from kda_core.validation import debug_check_slots, debug_checks_enabled
from kda_recurrent.compat import optional_entry
from kda_recurrent.routes import Path, Route

__all__ = ["spec_call", "spec_route", "tc_reason", "recoverssm_commit", "RecoverSSMCommit"]

# Kernel entries, imported on first use (the CuTe DSL is slow to import); None when kda-cute is missing. Tests
# replace these module attributes with recorders.
_UNLOADED = object()
_entries: dict[str, object] = {}


def _entry(module: str, name: str):
    key = f"{module}.{name}"
    fn = _entries.get(key, _UNLOADED)
    if fn is _UNLOADED:
        try:
            fn = optional_entry(module, name)
        except AttributeError:  # a kda-cute without that entry
            fn = None
        _entries[key] = fn
    return fn


def _policy(null_policy) -> NullSlotPolicy:
    return null_policy if type(null_policy) is NullSlotPolicy else null_policy_of(null_policy)


def tc_reason(call, args: RecurrentArgs, spec: SpecArgs, rows_t: int | None = None) -> str | None:
    """None when the tensor-core frozen verify takes the validated call, else why not (``explain``'s text).

    It takes frozen verifies (records or not, no tree) of the Kimi gate forms with in-kernel beta sigmoid and L2
    norm, H == HV in ``T1_HEAD_COUNTS``, K = 128, bf16 activations and a bf16 read tensor, and T in ``UCACHE_T``
    tokens per row: dense [B, T] with T in ``UCACHE_T``, or varlen rows of at most ``rows_t`` tokens (the caller's
    window, e.g. vLLM's ``spec_query_len``), compiled for the smallest T in ``UCACHE_T`` that covers them.
    """
    if not call.frozen or call.tree:
        return "not a frozen verify" if not call.frozen else "a tree verify (parents) needs the per-token states"
    if call.K != 128 or call.H != call.HV or call.H not in T1_HEAD_COUNTS:
        return f"needs K = 128 and H == HV in {T1_HEAD_COUNTS} (K={call.K}, H={call.H}, HV={call.HV})"
    if call.gate_mode == GateMode.PRECOMPUTED or not call.beta_is_logit or not call.use_qk_l2norm_in_kernel:
        return "needs the gate, the beta sigmoid and the q/k L2 norm in the kernel"
    if call.act_dtype != torch.bfloat16 or args.g.dtype != torch.bfloat16 or args.beta.dtype != torch.bfloat16:
        return "needs bf16 q, k, v, g and beta"
    read_dtype = call.source_dtype if call.has_source else call.state_dtype
    if read_dtype not in _tc_state_dtypes():
        return f"the read tensor is {read_dtype} (the tensor-core verify reads {_tc_state_dtypes()})"
    if call.varlen:
        if call.N_seq > 65535:
            return f"{call.N_seq} varlen rows (the tensor-core verify's grid takes at most 65535)"
        if rows_t is None or rows_t > max(UCACHE_T):
            return f"varlen rows of {'unknown' if rows_t is None else rows_t} tokens at most (tensor-core: <= 8)"
    elif call.T not in UCACHE_T:
        return f"T={call.T} tokens (the tensor-core verify is built for T in {UCACHE_T})"
    return None


def _tc_state_dtypes() -> tuple:
    """The read-tensor dtypes the tensor-core frozen verify takes (``kda_cute.ucache.FROZEN_STATE_DTYPES``; bf16
    where kda-cute does not say)."""
    if _entry("kda_cute.ucache", "frozen_verify") is None:
        return ()
    return _entry("kda_cute.ucache", "FROZEN_STATE_DTYPES") or (torch.bfloat16,)


def spec_call(args: RecurrentArgs, spec: SpecArgs, null_policy=NullSlotPolicy.OUT_OF_RANGE, rows_t: int | None = None):
    """Validate and run a ``recurrent_kda`` call with spec keywords; returns what ``recurrent_kda`` returns.

    ``rows_t``: an upper bound on every varlen row's token count that the caller knows (vLLM's ``spec_query_len``,
    FlashInfer's ``1 + num_spec_tokens``), so a varlen frozen verify can take the tensor-core kernel; rows longer
    than it are malformed device data (their tokens past ``rows_t`` get no output written).
    """
    from kda_core.validation_spec import debug_check_spec_slots, validate_spec

    null_policy = _policy(null_policy)
    call = validate_spec(args, spec, null_policy, device_kind="any")
    if debug_checks_enabled():  # KDA_DEBUG_VALIDATE: the slots this call writes (pool, record rows), no repeats
        debug_check_spec_slots(args, spec, call)
    path = spec_route(call, args, spec, rows_t).path
    if path is Path.FROZEN_TC:
        o = _run_tc(_entry("kda_cute.ucache", "frozen_verify"), call, args, spec, null_policy, rows_t)
        return o, (None if call.has_source else args.initial_state)
    if path is Path.GENERIC:
        return _entry("kda_cute.generic", "run")(call, args, spec, null_policy=null_policy)
    from kda_core.oracle_spec import spec_verify_ref

    return spec_verify_ref(args, spec, null_policy=null_policy)


def spec_route(call, args: RecurrentArgs, spec: SpecArgs, rows_t: int | None = None) -> Route:
    """Where a validated spec call runs, and why (the routing of the module docstring; ``explain`` returns it)."""
    if not call.on_cuda:
        return Route(Path.ORACLE, f"tensors on {args.q.device.type}: the PyTorch oracle runs (the kernels need CUDA)")
    why_not = tc_reason(call, args, spec, rows_t)
    if why_not is None:
        if _entry("kda_cute.ucache", "frozen_verify") is not None:
            return Route(Path.FROZEN_TC, "frozen verify on the tensor-core kernel (the ucache kernel without a ring)")
        why_not = "kda_cute.ucache.frozen_verify is not importable"
    if _entry("kda_cute.generic", "run") is not None:
        return Route(Path.GENERIC, f"generic kernel, spec modes ({why_not})")
    return Route(Path.ORACLE, "kda-cute's generic kernel is not importable: the oracle runs")


def _run_tc(tc, call, args: RecurrentArgs, spec: SpecArgs, null_policy, rows_t):
    """The tensor-core frozen verify on a validated call: the read tensor and its slots (a column view of 2-D
    indices), records when given; varlen compiled for the smallest T in ``UCACHE_T`` covering ``rows_t``."""
    q, k, v, g, beta, A_log, dt_bias, scale = args[:8]
    if call.has_source:
        pool, slots = spec.initial_state_source, spec.initial_state_indices
    else:
        pool, slots = args.initial_state, args.ssm_state_indices
        if slots.dim() == 2:
            slots = slots[:, 0]
    output = args.output
    if output is None:
        output = torch.empty(v.shape, dtype=torch.bfloat16, device=v.device)
    t_draft = None
    if call.varlen:
        t_draft = min(t for t in UCACHE_T if t >= rows_t)
    tc(A_log.reshape(-1), g, None if dt_bias is None else dt_bias.reshape(-1), call.lower_bound, q, k, v, beta,
       pool, slots, call.scale, output, correction_cache=spec.correction_cache, kg_cache=spec.kg_cache,
       cu_seqlens=args.cu_seqlens, t_draft=t_draft,
       aligned=call.aligned and (not call.records or call.records_aligned), null_policy=null_policy)
    return output


# ---------------------------------------------------------------------------------------------------------------
# RecoverSSM commit


def _debug_check_written(state_indices, destination_indices, P, null_policy):
    """KDA_DEBUG_VALIDATE: the slots a commit writes (its destinations, else its slots) repeat no live slot."""
    if debug_checks_enabled():
        if destination_indices is None:
            debug_check_slots(state_indices, P, argument="state_indices", null_policy=null_policy)
        else:
            debug_check_slots(destination_indices, P, argument="destination_indices", null_policy=null_policy)


def recoverssm_commit(checkpoint_state, correction_cache, kg_cache, state_indices, num_accepted_tokens, A_log,
                      dt_bias, lower_bound, *, query_start_loc=None, use_qk_l2norm_in_kernel=True,
                      null_policy=NullSlotPolicy.OUT_OF_RANGE, destination_indices=None):
    """Fold the accepted prefix of a RecoverSSM verify's records into one layer's checkpoints, in place.

    For row n with slot ``s = state_indices[n]`` and ``commit_len = clamp(num_accepted_tokens[n], 0, min(len_n,
    T_max))`` (``len_n`` the row's token count from ``query_start_loc``, T_max without it), per value head, in fp32
    from the checkpoint: for t < commit_len, ``S <- S * exp(g_log(raw g_t)) + u_t k^_t^T`` with u_t from
    ``correction_cache[s, hv, t]`` and raw k | raw g from ``kg_cache[s, hv, t]`` (the records the verify wrote);
    stored rounded once. This is the recurrence's own update, so the checkpoint becomes the state the recurrence
    reaches over the accepted tokens. A null slot (``null_policy``) or a zero commit length touches nothing.

    Args:
        checkpoint_state: [P, HV, V, K] bf16 or fp32 (inner dims compact, slot stride free), updated in place.
        correction_cache: [P, HV, T_max, V] fp32; kg_cache: [P, HV, T_max, 2K] (the activations' dtype).
        state_indices, num_accepted_tokens: [N] int32 or int64, any stride (device data, bounded in the kernel).
        A_log: [H] fp32 or None (then raw g is the log decay itself); dt_bias: [H*K] fp32 or None; lower_bound:
            < 0 (Kimi K3's gate) or None (softplus).
        query_start_loc: [N + 1] int32/int64 or None. null_policy: ``NullSlotPolicy`` or its string value.
        destination_indices: [N] of state_indices' dtype, any stride, or None (in place): row n reads slot
            ``state_indices[n]`` (checkpoint and records) and stores the folded state in slot
            ``destination_indices[n]`` instead (null under ``null_policy``: the row commits nothing); the source slot
            is left as it was unless the two are equal. (vLLM's prefix-cache align mode moves a state to another
            block this way.)

    Returns ``checkpoint_state``.
    """
    from kda_core.validation_spec import validate_recoverssm_commit

    null_policy = _policy(null_policy)
    call = validate_recoverssm_commit(checkpoint_state, correction_cache, kg_cache, state_indices,
                                      num_accepted_tokens, A_log, dt_bias, lower_bound,
                                      query_start_loc=query_start_loc, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                      null_policy=null_policy, destination_indices=destination_indices,
                                      device_kind="any")
    _debug_check_written(state_indices, destination_indices, checkpoint_state.shape[0], null_policy)
    fn = _entry("kda_cute.recoverssm", "recoverssm_commit") if call.on_cuda else None
    if fn is None:
        from kda_core.oracle_spec import recoverssm_commit_ref

        return recoverssm_commit_ref(checkpoint_state, correction_cache, kg_cache, state_indices, num_accepted_tokens,
                                     A_log, dt_bias, lower_bound, query_start_loc=query_start_loc,
                                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, null_policy=null_policy,
                                     destination_indices=destination_indices)
    fn(checkpoint_state, correction_cache, kg_cache, state_indices, num_accepted_tokens, A_log, dt_bias, lower_bound,
       query_start_loc=query_start_loc, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, null_policy=null_policy,
       destination_indices=destination_indices)
    return checkpoint_state


class RecoverSSMCommit:
    """The RecoverSSM commit of every layer of a model in one launch (vLLM's commit context, kda's kernel).

    Built once from the layers' tensors (lists, one entry per layer): checkpoints [P, HV, V, K], correction caches
    [P, HV, T_max, V] fp32 and kg caches [P, HV, T_max, 2K], which must share shape, dtype and strides within each
    kind (their base pointers are free: layers are allocated apart), and each layer's A_log [H] and dt_bias [H*K]
    (copied, stacked, at construction: rebuild after changing them); one ``lower_bound``. ``commit`` then folds the
    accepted prefix of every layer, as :func:`recoverssm_commit` does for one.

    Example::

        ctx = RecoverSSMCommit(checkpoints, corrections, kgs, A_logs, dt_biases, lower_bound=-5.0,
                               null_policy="nonpositive")
        ctx.commit(state_indices, num_accepted_tokens, query_start_loc)   # after sampling, every step
    """

    def __init__(self, checkpoints, correction_caches, kg_caches, A_logs, dt_biases, lower_bound, *,
                 use_qk_l2norm_in_kernel=True, null_policy=NullSlotPolicy.OUT_OF_RANGE):
        from kda_core.validation_spec import validate_recoverssm_layers

        self.null_policy = _policy(null_policy)
        # The layers are validated once here (O(L^2) aliasing pairs), against an empty row set; each commit then
        # validates only its rows, against layer 0 (every layer shares its layout).
        no_rows = torch.empty(0, dtype=torch.int32, device=checkpoints[0].device)
        self.call = validate_recoverssm_layers(list(checkpoints), list(correction_caches), list(kg_caches),
                                               None if A_logs is None else list(A_logs),
                                               None if dt_biases is None else list(dt_biases), lower_bound, no_rows,
                                               no_rows, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                               null_policy=self.null_policy, device_kind="any")
        self.checkpoints = tuple(checkpoints)
        self.correction_caches = tuple(correction_caches)
        self.kg_caches = tuple(kg_caches)
        self.A_logs = None if A_logs is None else tuple(A_logs)
        self.dt_biases = None if dt_biases is None else tuple(dt_biases)
        self.lower_bound = lower_bound
        self.use_qk_l2norm_in_kernel = use_qk_l2norm_in_kernel
        self._plan = None
        if self.call.on_cuda:
            plan = _entry("kda_cute.recoverssm", "RecoverSSMCommitPlan")
            if plan is not None:
                self._plan = plan(self.checkpoints, self.correction_caches, self.kg_caches, self.A_logs,
                                  self.dt_biases, lower_bound, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                  null_policy=self.null_policy)

    def commit(self, state_indices, num_accepted_tokens, query_start_loc=None, destination_indices=None):
        """Fold every layer's accepted prefix (the rows' slots, accepted counts and, optionally, token offsets), in
        place or into ``destination_indices`` (as in :func:`recoverssm_commit`)."""
        from kda_core.validation_spec import validate_recoverssm_commit

        validate_recoverssm_commit(self.checkpoints[0], self.correction_caches[0], self.kg_caches[0], state_indices,
                                   num_accepted_tokens, None if self.A_logs is None else self.A_logs[0],
                                   None if self.dt_biases is None else self.dt_biases[0], self.lower_bound,
                                   query_start_loc=query_start_loc,
                                   use_qk_l2norm_in_kernel=self.use_qk_l2norm_in_kernel, null_policy=self.null_policy,
                                   destination_indices=destination_indices, device_kind="any")
        _debug_check_written(state_indices, destination_indices, self.checkpoints[0].shape[0], self.null_policy)
        if self._plan is not None:
            self._plan.commit(state_indices, num_accepted_tokens, query_start_loc, destination_indices)
            return
        from kda_core.oracle_spec import recoverssm_commit_layers_ref

        recoverssm_commit_layers_ref(self.checkpoints, self.correction_caches, self.kg_caches, self.A_logs,
                                     self.dt_biases, self.lower_bound, state_indices, num_accepted_tokens,
                                     query_start_loc=query_start_loc,
                                     use_qk_l2norm_in_kernel=self.use_qk_l2norm_in_kernel,
                                     null_policy=self.null_policy, destination_indices=destination_indices)
