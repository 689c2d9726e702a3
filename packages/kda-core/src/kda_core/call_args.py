"""The arguments of one ``recurrent_kda`` call, bundled once, in the facade's order.

``kda_recurrent.recurrent_kda`` bundles its parameters once and every layer below takes that one object instead of
its eighteen arguments: kda-core's validators (``validate_recurrent(args)``, and the hot path's
``revalidate_recurrent_t1(args)``), which return the call's description (``kda_core.validation.RecurrentCall``);
the oracle (``kda_core.oracle.recurrent_kda_ref_args(args)``); the generic kernel's launch on a validated call
(``kda_cute.generic.run(call, args)``); the facade's traced path. The ``torch.library`` op keeps a flat schema (it
is inferred from a flat signature) in this order.

The bundle holds the arguments as given, unchecked; the validated facts of the call are its description.

Cost (timeit, min of 120 x 20000 calls, Python 3.11 on the 2-core development CPU): ``RecurrentArgs(...)`` with 18
positional arguments 0.49 us (5 positional and 8 keywords: 0.97 us; the NamedTuple's ``__new__`` is Python code),
``tuple.__new__(RecurrentArgs, (...))`` 0.26 us, the plain tuple of the same 18 names 0.10 us. So the facade's T=1
hot path carries the plain tuple in this order (the re-validator takes either and unpacks it once), and the
facade makes the NamedTuple with ``tuple.__new__`` only on its full path, where validation costs far more.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["RecurrentArgs", "SpecArgs"]


class RecurrentArgs(NamedTuple):
    """One ``recurrent_kda`` call's arguments, with the facade's names, order and defaults (its docstring is the
    reference for each). Positional order is the facade's, so ``RecurrentArgs(*a, **kw)`` reads a call exactly as
    ``recurrent_kda(*a, **kw)`` does."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    A_log: torch.Tensor | None = None
    dt_bias: torch.Tensor | None = None
    scale: float | None = None
    initial_state: torch.Tensor | None = None
    output_final_state: bool = False
    use_qk_l2norm_in_kernel: bool = True
    use_gate_in_kernel: bool = False
    lower_bound: float | None = None
    beta_is_logit: bool = False
    cu_seqlens: torch.Tensor | None = None
    ssm_state_indices: torch.Tensor | None = None
    num_accepted_tokens: torch.Tensor | None = None
    output: torch.Tensor | None = None


class SpecArgs(NamedTuple):
    """The spec-decode keywords of one ``recurrent_kda`` call (FlashInfer's names; docs/design.md §9), carried beside
    :class:`RecurrentArgs` through validation, oracle and kernels. All absent (the defaults): a plain call.

    - ``initial_state_source`` [Ps, HV, V, K], ``initial_state_indices`` [N_seq]: every sequence's first state is
      read from ``initial_state_source[initial_state_indices[n]]`` (read only); ``initial_state`` with
      ``ssm_state_indices`` is then only written (per-token checkpoints with 2-D indices, the final state with 1-D).
    - ``disable_state_update``: frozen verify; no state is written anywhere.
    - ``correction_cache`` [Pr, HV, T_max, V] fp32 and ``kg_cache`` [Pr, HV, T_max, 2K] (RecoverSSM records, with a
      frozen verify): per token t < T_max of a sequence whose state was read from slot r, ``u_t`` and raw k | raw g.
    - ``parent_indices`` [N_seq, T_p] (tree verify): token t continues from the state stored for token
      ``parent_indices[n, t]`` when that lies in [0, t), else from the sequence's first state.
    """

    initial_state_source: torch.Tensor | None = None
    initial_state_indices: torch.Tensor | None = None
    disable_state_update: bool = False
    correction_cache: torch.Tensor | None = None
    kg_cache: torch.Tensor | None = None
    parent_indices: torch.Tensor | None = None
