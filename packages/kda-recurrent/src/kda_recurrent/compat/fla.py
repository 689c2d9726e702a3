"""FLA's in-place KDA call, ``fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd`` (FLA 0.6.0), on kda.

vLLM and SGLang call FLA's function with a V-first state pool updated in place through ``ssm_state_indices``;
importing :func:`fused_recurrent_kda_fwd` from here instead runs the same call through
:func:`kda_recurrent.recurrent_kda` (the T=1 kernel for plain decode, the generic kernel otherwise).
"""

from __future__ import annotations

import torch

from kda_core.call_args import RecurrentArgs
from kda_core.errors import fail
from kda_core.oracle import kda_gate_ref
from kda_core.validation import validate_gate_params, validate_recurrent
from kda_recurrent.compat import constant
from kda_recurrent.facade import recurrent_kda

__all__ = ["fused_recurrent_kda_fwd"]

# FLA without A_log uses the factor 1.0 where kda uses exp(A_log): the lower-bound gate becomes
# lb * sigmoid(1.0 * x) (our A_log = 0) and the softplus gate -exp(1.0) * softplus(x) (our A_log = 1).
_A_LOG_STANDING_IN_FOR_NONE = {True: 0.0, False: 1.0}  # keyed by "lower_bound is not None"


def fused_recurrent_kda_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    scale: float | None = None,
    output_final_state: bool = False,
    inplace_final_state: bool = True,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    ssm_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    out: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FLA 0.6.0's ``fused_recurrent_kda_fwd`` (same arguments, same defaults, same return) on kda's kernels.

    Shapes (FLA's names): q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV];
    A_log [HV] and dt_bias [HV*K] fp32 or None (zeros; FLA indexes the gate parameters by VALUE head);
    ``initial_state`` is the V-first pool [N, HV, V, K] with ``ssm_state_indices`` ([N_seq] or [N_seq, T] int32),
    else dense [N_seq, HV, V, K]; ``out`` [B, T, HV, V] bf16. Returns ``(out, final_state)``.

    Argument mapping: ``use_beta_sigmoid_in_kernel`` is kda's ``beta_is_logit``; ``out`` is ``output``.

    Modes:
      - ``ssm_state_indices`` given, ``inplace_final_state=True`` (the serving call): the pool is updated in place
        and returned as final_state; 2-D indices with ``num_accepted_tokens`` write one checkpoint per token.
      - no indices, ``inplace_final_state=True``: the final state overwrites ``initial_state`` (rounded once to its
        dtype), which is returned, as FLA does.
      - no indices, ``inplace_final_state=False``: final_state is a new fp32 tensor when ``output_final_state``.

    Where kda differs from FLA (deliberately; the results of well-formed calls are the same):
      - **Bounds.** FLA reads and writes ``initial_state[idx]`` without checking ``idx``: a padding slot (-1) or a
        slot past the pool reads or corrupts foreign memory. kda makes such a row inactive (docs/design.md §4): zero
        output, the pool neither read nor written; in spec decode a token whose slot is invalid is skipped (zero
        output, no write, and the state does not absorb it). FLA reads the first state at
        ``idx[n, num_accepted_tokens[n] - 1]`` unclamped; kda reads column ``max(min(nat, T), 1) - 1``.
      - **1-D indices with T > 1.** FLA then writes the state after token t to slot ``idx[n + t]`` (its 1-D mode
        assumes one token per sequence); kda reads and writes ``idx[n]`` once, after the last token.
      - **Validation.** Malformed calls raise :class:`kda_core.errors.KDAError` before anything runs (FLA asserts
        little and may run out of bounds). So do the FLA options kda does not implement: ``state_v_first=False``
        with a state ([K, V] states would need a transposed copy per call), ``allow_neg_eigval=True``, head-wise
        beta [B, T, HV, V], ``inplace_final_state=False`` together with ``ssm_state_indices`` (FLA then writes
        per-token states to rows of a fresh tensor that only fit T=1), and unknown keyword arguments (FLA ignores
        them silently).
      - **Output dtype.** kda always writes bf16 outputs (FLA writes ``v.dtype``).
      - **GQA with the in-kernel gate** (HV > H, ``use_gate_in_kernel=True``): kda's kernels index A_log and
        dt_bias by query head, FLA by value head, so the adapter computes the log-space decay from FLA's
        per-value-head parameters itself (a few extra elementwise kernels) and runs the precomputed-gate kernel.
      - ``state_v_first=False`` without any state: FLA's [N, HV, K, V] final state is returned as a transposed
        copy of kda's V-first one.

    Example (the call vLLM makes at decode)::

        o, pool = fused_recurrent_kda_fwd(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=pool,
                                          inplace_final_state=True, state_v_first=True,
                                          ssm_state_indices=slots, use_qk_l2norm_in_kernel=True,
                                          use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                          lower_bound=-5.0)
    """
    if kwargs:
        fail("kwargs", "only FLA 0.6.0's named arguments of fused_recurrent_kda_fwd", sorted(kwargs))
    if allow_neg_eigval:
        fail("allow_neg_eigval", "False (kda implements beta in [0, 1] only)", allow_neg_eigval)
    if initial_state is not None and not state_v_first:
        fail("state_v_first", "True when a state is given (kda stores states V-first [..., V, K])", state_v_first)
    if ssm_state_indices is not None and not inplace_final_state:
        fail("inplace_final_state", "True when ssm_state_indices is given (the pool is updated in place)",
             inplace_final_state)
    if inplace_final_state and initial_state is None:
        fail("initial_state", "a state tensor when inplace_final_state=True (FLA asserts the same)", None)

    if use_gate_in_kernel and isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor) and v.dim() == 4:
        H, HV = q.shape[2], v.shape[2]
        if A_log is None:
            A_log = constant(HV, torch.float32, q.device, _A_LOG_STANDING_IN_FOR_NONE[lower_bound is not None])
        if HV != H:
            # Per-value-head gate parameters: compute the decay here (kda_gate_ref infers the head count from
            # A_log, so [HV] parameters map one-to-one onto value heads) and hand the kernel a precomputed gate.
            # Everything is validated first, so a malformed call raises its KDAError before any tensor code runs:
            # the call as the kernel will take it, then FLA's per-value-head parameters and the gate's scalar.
            validate_recurrent(RecurrentArgs(
                q, k, v, g, beta, scale=scale, initial_state=initial_state,
                output_final_state=output_final_state and ssm_state_indices is None,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, beta_is_logit=use_beta_sigmoid_in_kernel,
                cu_seqlens=cu_seqlens, ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens,
                output=out))
            validate_gate_params(A_log, dt_bias, lower_bound, HV, q.shape[3], like=q, heads_text="HV")
            g = kda_gate_ref(g, A_log, dt_bias, lower_bound, use_gate_in_kernel=True)
            A_log = dt_bias = lower_bound = None
            use_gate_in_kernel = False

    indices = ssm_state_indices
    if indices is None and inplace_final_state:
        # FLA stores the final state over initial_state: the same thing as a pool whose slot n is sequence n. The
        # dense contract still holds: one row per sequence (a shorter state would leave sequences without a row).
        n_seq = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        rows = initial_state.shape[0] if isinstance(initial_state, torch.Tensor) and initial_state.dim() else None
        if rows != n_seq:
            fail("initial_state", f"one row per sequence ([N_seq, HV, V, K], N_seq = {n_seq}) when it is updated "
                 "in place without ssm_state_indices", tuple(initial_state.shape)
                 if isinstance(initial_state, torch.Tensor) else type(initial_state).__name__)
        indices = constant(n_seq, torch.int32, q.device)

    o, final_state = recurrent_kda(
        q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state and indices is None, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, lower_bound=lower_bound, beta_is_logit=use_beta_sigmoid_in_kernel,
        cu_seqlens=cu_seqlens, ssm_state_indices=indices, num_accepted_tokens=num_accepted_tokens, output=out,
    )
    if final_state is not None and indices is None and not state_v_first:
        final_state = final_state.transpose(-1, -2).contiguous()
    return o, final_state
