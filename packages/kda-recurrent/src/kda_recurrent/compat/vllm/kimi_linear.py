"""vLLM's shared KDA layer (Kimi-Linear): its recurrent decode call ``fused_recurrent_kda``, on kda's kernels.

Read from the stored engine sources:

- The function replaced: vllm-project/vllm ``vllm/third_party/flash_linear_attention/ops/kda.py``
  @ 933876c388fb129ad82590660e6506614559cb86 (``fused_recurrent_kda`` and the ``fused_recurrent_kda_fwd`` it wraps:
  every keyword, its defaults, the ``(o, final_state)`` return).
- Its caller: ``KDAAttentionBase._forward`` in ``vllm/model_executor/layers/mamba/gdn/kda_linear_attn.py``
  @ eda8c32aa92dc346443a4b9890f9dc71633af9c4, which imports the name at module level and, for a pure-decode batch,
  calls ``fused_recurrent_kda(q=, k=, v=, g=, beta=, initial_state=pool, use_qk_l2norm_in_kernel=True,
  cu_seqlens=query_start_loc[:num_decodes + 1], ssm_state_indices=<every decode row's block>)`` with [1, N, H, K]
  tensors, a gate already in log space (``fused_kda_gate``, softplus) and beta already sigmoided in fp32.
- docs/serving.md §2.

Supported: the pool call the layer makes (``initial_state`` with ``ssm_state_indices``, 1-D or 2-D with
``num_accepted_tokens``, ``inplace_final_state=True``), ``scale``, ``use_qk_l2norm_in_kernel``, ``out``,
``sigmoid_beta`` (beta is a logit) and ``compute_gate`` with ``a_log``, ``g_bias``, ``lower_bound`` (the bounded
gate, the only one vLLM's ``compute_gate`` implements). Refused with a :class:`kda_core.errors.KDAError` naming the
argument: the dense forms (no pool or no indices), ``inplace_final_state=False``, ``beta=None``, ``compute_gate``
without its parameters, unknown keyword arguments (vLLM ignores them).

Null policy: vLLM's, ``NullSlotPolicy.NONPOSITIVE`` (an index ``<= 0`` is null; docs/design.md §4). Indices past
the ``len(cu_seqlens) - 1`` sequences are ignored, as vLLM's kernel ignores them (the layer passes every decode
row's block with ``cu_seqlens`` cut to the decode rows); they are sliced off (a view).
"""

from __future__ import annotations

from kda_core.contracts import NullSlotPolicy
from kda_core.errors import fail
from kda_recurrent.facade import recurrent_kda

__all__ = ["fused_recurrent_kda"]

_NULL_POLICY = NullSlotPolicy.NONPOSITIVE


def fused_recurrent_kda(
    q,
    k,
    v,
    g,
    beta=None,
    scale=None,
    initial_state=None,
    inplace_final_state=True,
    use_qk_l2norm_in_kernel=True,
    cu_seqlens=None,
    ssm_state_indices=None,
    num_accepted_tokens=None,
    out=None,
    sigmoid_beta=False,
    a_log=None,
    g_bias=None,
    compute_gate=False,
    lower_bound=-5.0,
    **kwargs,
):
    """vLLM's ``fused_recurrent_kda`` (same arguments, defaults and return) on :func:`kda_recurrent.recurrent_kda`.

    Args (B = 1 with ``cu_seqlens``; H heads, K = V = 128 or 64):
        q, k: [B, T, H, K]; v: [B, T, HV, V]; bf16 (other strides free: kda does not copy them contiguous).
        g: [B, T, HV, K]: the log-space decay, or with ``compute_gate=True`` the raw gate.
        beta: [B, T, HV] sigmoided (fp32 from the layer), or a logit with ``sigmoid_beta=True``.
        scale: None (K ** -0.5) or a float.
        initial_state: the pool [slots, HV, V, K], updated in place. ``inplace_final_state``: True.
        cu_seqlens: [n + 1] int offsets or None. ssm_state_indices: [n] (or longer: the first n are read) or
            [n, T] with ``num_accepted_tokens`` [n].
        out: None (a new bf16 tensor like v) or a bf16 [B, T, HV, V] buffer.
        compute_gate, a_log (e.g. the layer's [1, 1, H, 1] parameter), g_bias [H * K], lower_bound: the bounded gate
            ``lower_bound * sigmoid(exp(a_log) * (g + g_bias))`` computed in the kernel. ``lower_bound`` is not
            read without ``compute_gate``.

    Returns ``(o, final_state)``: the output (``out`` when given) and the pool.
    """
    if kwargs:
        fail("kwargs", "only the named arguments of vLLM's fused_recurrent_kda", sorted(kwargs))
    if beta is None:
        fail("beta", "a tensor [B, T, HV] (sigmoided, or a logit with sigmoid_beta=True)", None)
    if inplace_final_state is not True:
        fail("inplace_final_state", "True (the pool is updated in place; vLLM's layer passes nothing else)",
             repr(inplace_final_state))
    if initial_state is None:
        fail("initial_state", "the state pool [slots, HV, V, K] (the layer's call)", None)
    if ssm_state_indices is None:
        fail("ssm_state_indices", "the slot indices into the pool (the layer's call)", None)
    if compute_gate is True:
        if a_log is None:
            fail("a_log", "a tensor with compute_gate=True", None)
        if g_bias is None:
            fail("g_bias", "a tensor with compute_gate=True", None)
        if lower_bound is None:
            fail("lower_bound", "a negative float with compute_gate=True (the bounded gate is the one it computes)",
                 None)
        A_log, dt_bias = a_log.reshape(-1), g_bias.reshape(-1)
    elif compute_gate is False:
        A_log = dt_bias = lower_bound = None
    else:
        fail("compute_gate", "True or False", repr(compute_gate))
    if cu_seqlens is not None:
        # Shape reads only (no dim() calls: a 0-d tensor raises IndexError, a non-tensor AttributeError; the facade's
        # validator then names it). A cu_seqlens of another rank is the validator's too.
        try:
            n = cu_seqlens.shape[0] - 1
            if n >= 0:
                if ssm_state_indices.shape[0] > n:
                    ssm_state_indices = ssm_state_indices[:n]
                if num_accepted_tokens is not None and num_accepted_tokens.shape[0] > n:
                    num_accepted_tokens = num_accepted_tokens[:n]
        except (AttributeError, IndexError, TypeError):
            pass
    # positional up to output, in the facade's order (keywords cost the call about 0.3 us more)
    return recurrent_kda(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, False, use_qk_l2norm_in_kernel,
                         compute_gate, lower_bound, sigmoid_beta, cu_seqlens, ssm_state_indices, num_accepted_tokens,
                         out, null_policy=_NULL_POLICY)
