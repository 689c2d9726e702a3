"""``torch.library`` custom op of the facade, so ``torch.compile(fullgraph=True)`` traces a decode layer.

``kda::recurrent_kda`` takes every argument of :func:`kda_recurrent.recurrent_kda`, flat (torch.library infers the
schema from a flat signature), in the facade's order, which is that of :class:`kda_core.call_args.RecurrentArgs`, then
``null_policy`` as its string value (a schema has no enum type), and runs the facade's eager call on them (validation,
routing, kernel; the facade bundles them) as one opaque node. It declares what it writes: ``output`` always, and
``initial_state`` (the pool, written in place when ``ssm_state_indices`` is given). Its return value is the dense final
state (fp32 [N_seq, HV, V, K]) when one is asked for, or with 1-D indices (no cu_seqlens) the gathered per-sequence
states, else an empty tensor: a custom op cannot return an alias of its input, so the facade's traced call hands the
pool back itself.

Routing inside the op happens when the compiled graph runs, not when it is traced, so ``KDA_T1_FAST_PATH`` keeps
working on a compiled model, and the op body is what a CUDA graph captures: kernel launches on the current stream,
no host synchronisation. The fake implementation only computes shapes, so tracing never touches the kernels.

Imports point one way: this module imports the facade (for the body); the facade reaches the op through
``torch.ops.kda.recurrent_kda`` while ``torch.compiler.is_compiling()``, once the package has imported this module
(``kda_recurrent/__init__.py`` does). Eager calls skip the dispatcher.
"""

from __future__ import annotations

import torch

from kda_core.call_args import RecurrentArgs
from kda_recurrent import facade as _facade

__all__ = ["recurrent_kda_traced"]

_FINAL_STATE_DTYPE = torch.float32


@torch.library.custom_op("kda::recurrent_kda", mutates_args=("initial_state", "output"))
def _recurrent_kda_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    scale: float | None,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
    use_gate_in_kernel: bool,
    lower_bound: float | None,
    beta_is_logit: bool,
    cu_seqlens: torch.Tensor | None,
    ssm_state_indices: torch.Tensor | None,
    num_accepted_tokens: torch.Tensor | None,
    output: torch.Tensor,
    null_policy: str = "out_of_range",
) -> torch.Tensor:
    # The schema is the bundle's fields in order (torch.library infers it from this signature), which is the facade's
    # positional order, then the null policy's string value; the graph runs outside tracing, so this is the facade's
    # eager call.
    o, final_state = _facade.recurrent_kda(
        q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
        use_gate_in_kernel, lower_bound, beta_is_logit, cu_seqlens, ssm_state_indices, num_accepted_tokens, output,
        null_policy=null_policy,
    )
    if o is not output:  # a path that allocated its own output despite being given one
        output.copy_(o)
    if output_final_state and (ssm_state_indices is None or (ssm_state_indices.dim() == 1 and cu_seqlens is None)):
        return final_state  # the dense final states, or the gathered per-sequence states (a copy, not the pool)
    return q.new_empty((0,), dtype=_FINAL_STATE_DTYPE)


@_recurrent_kda_op.register_fake
def _recurrent_kda_fake(*flat):
    """Shapes only: the op's arguments in the schema's order (the bundle's, then the null policy)."""
    a = RecurrentArgs(*flat[:len(RecurrentArgs._fields)])
    q, v, idx = a.q, a.v, a.ssm_state_indices
    if a.output_final_state and idx is None:
        n_seq = q.shape[0] if a.cu_seqlens is None else a.cu_seqlens.shape[0] - 1
        return q.new_empty((n_seq, v.shape[2], v.shape[3], q.shape[3]), dtype=_FINAL_STATE_DTYPE)
    if a.output_final_state and idx.dim() == 1 and a.cu_seqlens is None:  # gathered, in the pool's dtype
        return q.new_empty((idx.shape[0], *a.initial_state.shape[1:]), dtype=a.initial_state.dtype)
    return q.new_empty((0,), dtype=_FINAL_STATE_DTYPE)


# The facade builds its traced call on the op (kda_recurrent.facade._traced); re-exported under its old name.
recurrent_kda_traced = _facade._traced
