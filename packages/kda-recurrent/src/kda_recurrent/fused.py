"""``fused_kda_decode``: one T=1 step of a whole KDA layer (conv update, SiLU, the KDA step, gated RMSNorm).

FlashInfer 0.7.2's ``fused_kda_decode`` arguments and semantics (docs/design.md §8; slot ``<= 0`` null by default),
plus kda's keywords ``bias`` (the conv bias) and ``null_policy``. Routing, from tensor metadata only:

1. kda-core validates the call (``kda_core.validation_fused.validate_fused_decode``; a bad call raises a
   :class:`kda_core.errors.KDAError` naming the argument before anything runs).
2. CUDA tensors run kda-cute's fused kernel (:func:`kda_cute.fused_decode.fused_kda_decode`).
3. CPU tensors, and CUDA tensors when kda-cute is not installed (with one warning), run kda-core's reference
   (:func:`kda_core.oracle_fused.fused_kda_decode_ref`), which updates both caches in place as the kernel does.

Under ``torch.compile`` the call is the ``kda::fused_kda_decode`` custom op (it declares the conv cache, the state
pool and the output as written; its fake implementation computes nothing), whose body is this eager call.

vLLM's native op (``torch.ops._C.fused_kda_decode``, reached through ``vllm._custom_ops.fused_kda_decode``) takes the
same layer in another argument order, plus the DS conv layout and the call without the norm (both taken here too);
its adapter is :func:`kda_recurrent.compat.vllm.kimi_k3.fused_kda_decode`, whose ``torch.compile`` form is the
``kda::vllm_fused_kda_decode`` custom op defined here (vLLM's argument order; conv cache, state and ``out`` written).

:func:`packed_fused_kda_decode` is the multi-token form (spec decode: ragged windows from ``query_start_loc``, the
conv over each row's window, per-token checkpoints), FlashInfer's ``packed_fused_kda_decode``, routed the same way:
kda-cute's multi-token kernel (:func:`kda_cute.fused_spec.packed_fused_kda_decode`) on CUDA, else
:func:`kda_core.oracle_fused.packed_fused_kda_decode_ref`; under ``torch.compile`` the
``kda::packed_fused_kda_decode`` custom op.
"""

from __future__ import annotations

import warnings

import torch

from kda_core.contracts import HEAD_DIM, NullSlotPolicy
from kda_core.errors import fail
from kda_core.oracle_fused import NORM_EPS, fused_kda_decode_ref, packed_fused_kda_decode_ref
from kda_core.validation_fused import validate_fused_decode, validate_packed_fused_decode
from kda_recurrent.compat import optional_entry
from kda_recurrent.facade import BACKENDS

__all__ = ["fused_kda_decode", "packed_fused_kda_decode"]

_UNLOADED = object()
_kernel = _UNLOADED  # kda_cute.fused_decode.fused_kda_decode, imported on the first CUDA call; None if missing
_packed_kernel = _UNLOADED  # kda_cute.fused_spec.packed_fused_kda_decode, likewise
_warned = False


def _load():
    global _kernel
    _kernel = optional_entry("kda_cute.fused_decode", "fused_kda_decode")
    return _kernel


def _load_packed():
    global _packed_kernel
    _packed_kernel = optional_entry("kda_cute.fused_spec", "packed_fused_kda_decode")
    return _packed_kernel


def _warn_reference(entry: str):
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"kda_recurrent.{entry}: kda-cute is not installed; the PyTorch reference runs (slow). "
                      "Install kda-recurrent[cute].", RuntimeWarning, stacklevel=4)


def _policy(null_policy) -> NullSlotPolicy:
    try:
        return NullSlotPolicy(null_policy)
    except ValueError:
        fail("null_policy", f"a NullSlotPolicy or one of {[p.value for p in NullSlotPolicy]}", repr(null_policy))


def _eager(x, weight, conv_state, raw_gate, raw_beta, A_log, dt_bias, state_indices, state, output_gate,
           norm_weight, lower_bound, norm_eps, output, bias, null_policy):
    if x.is_cuda:
        fn = _kernel if _kernel is not _UNLOADED else _load()
        if fn is not None:
            return fn(x, weight, conv_state, raw_gate, raw_beta, A_log, dt_bias, state_indices, state, output_gate,
                      norm_weight, lower_bound, norm_eps, output, bias=bias, null_policy=null_policy)
        _warn_reference("fused_kda_decode")
    validate_fused_decode(x, weight, conv_state, raw_gate, raw_beta, A_log, dt_bias, state_indices, state,
                          output_gate, norm_weight, lower_bound, norm_eps, output, bias=bias, device_kind="any")
    return fused_kda_decode_ref(x, weight, conv_state, raw_gate, raw_beta, A_log, dt_bias, state_indices, state,
                                output_gate, norm_weight, lower_bound, norm_eps, output, bias=bias,
                                null_policy=null_policy)


def fused_kda_decode(
    x,
    weight,
    conv_state,
    raw_gate,
    raw_beta,
    A_log,
    dt_bias,
    state_indices,
    state,
    output_gate,
    norm_weight,
    lower_bound=-5.0,
    norm_eps=NORM_EPS,
    output=None,
    *,
    bias=None,
    null_policy=NullSlotPolicy.NONPOSITIVE,
    backend=None,
    state_indices_mode=None,
):
    """One fused T=1 decode step for B rows; updates ``conv_state`` and ``state`` in place, returns ``output``.

    Args (B rows, H heads, C = 3*H*128):
        x: [B, C] bf16, the packed q|k|v projection row (row stride free).
        weight: [3, 4, H*128] fp32 conv taps, part-major (tap 0 multiplies the oldest history column).
        conv_state: [slots, C, >= 3] bf16, channel-contiguous per column (strides [slot, 1, C], the SD layout) or
            each channel's columns contiguous (strides [slot, W, 1], the DS layout); columns 0..2 hold the history,
            oldest first.
        raw_gate: [1, B, H, 128] bf16; raw_beta: [1, B, H] bf16 (a logit); A_log [H] fp32; dt_bias [H*128] fp32
            or None; ``lower_bound`` < 0 (Kimi K3's gate) or None (softplus, Kimi-Linear).
        state_indices: [B] int32 / int64. state: [slots, H, 128, 128] bf16 or fp32 (any slot stride).
        output_gate: [B, H, 128] bf16 (strides free but the last); norm_weight [128] fp32; norm_eps >= 0. Both
            None: no gated RMSNorm (the output is the KDA step's o), as vLLM's native op allows.
        output: [1, B, H, 128] bf16, allocated when None.
        bias: [C] fp32, the conv bias, or None.
        null_policy: ``NONPOSITIVE`` (default, FlashInfer's op and vLLM: slot 0 is reserved) or ``OUT_OF_RANGE``
            (``-1`` null, slot 0 live); a slot >= slots is null under both. A null row gets zero output and
            neither cache is read or written.
        backend, state_indices_mode: the keywords later FlashInfer releases add (vLLM's K3 layer passes
            ``backend="auto", state_indices_mode="unique_or_null"`` where FlashInfer takes them), accepted so that
            call runs unchanged: ``backend`` one of ``facade.BACKENDS`` or None, ``state_indices_mode`` one of
            :data:`STATE_INDICES_MODES` or None. Neither changes what runs: every backend is kda's kernel, and the
            mode is a promise about the indices (no live slot twice) that kda's contract already asks of every call
            (duplicate live slots are a caller error, checked under ``KDA_DEBUG_VALIDATE``; docs/design.md §4).

    No host sync and no allocation when ``output`` is given (CUDA); safe under CUDA-graph capture.
    """
    policy = null_policy if type(null_policy) is NullSlotPolicy else _policy(null_policy)
    if backend is not None or state_indices_mode is not None:
        _check_flashinfer_selection(backend, state_indices_mode)
    if torch.compiler.is_compiling():
        if output is None:
            output = x.new_empty((1, x.shape[0], A_log.shape[0], HEAD_DIM), dtype=torch.bfloat16)
        torch.ops.kda.fused_kda_decode(x, weight, conv_state, raw_gate, raw_beta, A_log, dt_bias, state_indices,
                                       state, output_gate, norm_weight, lower_bound, norm_eps, output, bias,
                                       policy.value)
        return output
    return _eager(x, weight, conv_state, raw_gate, raw_beta, A_log, dt_bias, state_indices, state, output_gate,
                  norm_weight, lower_bound, norm_eps, output, bias, policy)


STATE_INDICES_MODES = ("unique_or_null", "positive_unique")
"""The ``state_indices_mode`` values vLLM's K3 layer names (``unique_or_null``: each index null (<= 0) or used once,
what it passes under CUDA-graph padding; ``positive_unique``: every index live and used once)."""


def _check_flashinfer_selection(backend, state_indices_mode):
    if backend is not None and (type(backend) is not str or backend not in BACKENDS):
        fail("backend", f"one of {BACKENDS} (all run kda's kernels) or None", repr(backend))
    if state_indices_mode is not None and (type(state_indices_mode) is not str
                                           or state_indices_mode not in STATE_INDICES_MODES):
        fail("state_indices_mode", f"one of {STATE_INDICES_MODES} or None", repr(state_indices_mode))


@torch.library.custom_op("kda::fused_kda_decode", mutates_args=("conv_state", "state", "output"))
def _fused_kda_decode_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    raw_gate: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None,
    state_indices: torch.Tensor,
    state: torch.Tensor,
    output_gate: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    lower_bound: float | None,
    norm_eps: float,
    output: torch.Tensor,
    bias: torch.Tensor | None,
    null_policy: str,
) -> None:
    o = _eager(x, weight, conv_state, raw_gate, raw_beta, A_log, dt_bias, state_indices, state, output_gate,
               norm_weight, lower_bound, norm_eps, output, bias, NullSlotPolicy(null_policy))
    if o is not output:
        output.copy_(o)


@_fused_kda_decode_op.register_fake
def _fused_kda_decode_fake(*args) -> None:
    """Shapes only: the op writes its arguments in place and returns nothing."""
    return None


# --------------------------------------------------------------------------------------------------------------
# vLLM's native op (its argument order; the adapter with the documented signature is
# kda_recurrent.compat.vllm.kimi_k3.fused_kda_decode)

VLLM_NULL_POLICY = NullSlotPolicy.NONPOSITIVE
"""vLLM's null slots (``NULL_BLOCK_ID`` = 0): an index <= 0 (or >= slots) is a null row."""


def vllm_native_call(x, weight, bias, conv_state, raw_g, raw_beta, A_log, dt_bias, state_indices, state, out,
                     lower_bound, output_gate, norm_weight, norm_eps):
    """vLLM's ``fused_kda_decode`` arguments in its order, run as :func:`fused_kda_decode` runs them (kernel on
    CUDA, reference elsewhere) under vLLM's null policy; ``out`` None is allocated. Returns ``out``. Under
    ``torch.compile`` the ``kda::vllm_fused_kda_decode`` custom op."""
    if torch.compiler.is_compiling():
        if out is None:
            out = x.new_empty((1, x.shape[0], A_log.shape[0], HEAD_DIM), dtype=torch.bfloat16)
        torch.ops.kda.vllm_fused_kda_decode(x, weight, bias, conv_state, raw_g, raw_beta, A_log, dt_bias,
                                            state_indices, state, out, lower_bound, output_gate, norm_weight,
                                            norm_eps)
        return out
    return _eager(x, weight, conv_state, raw_g, raw_beta, A_log, dt_bias, state_indices, state, output_gate,
                  norm_weight, lower_bound, norm_eps, out, bias, VLLM_NULL_POLICY)


@torch.library.custom_op("kda::vllm_fused_kda_decode", mutates_args=("conv_state", "state", "out"))
def _vllm_fused_kda_decode_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    raw_g: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None,
    state_indices: torch.Tensor,
    state: torch.Tensor,
    out: torch.Tensor,
    lower_bound: float | None,
    output_gate: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    norm_eps: float,
) -> None:
    o = _eager(x, weight, conv_state, raw_g, raw_beta, A_log, dt_bias, state_indices, state, output_gate,
               norm_weight, lower_bound, norm_eps, out, bias, VLLM_NULL_POLICY)
    if o is not out:
        out.copy_(o)


@_vllm_fused_kda_decode_op.register_fake
def _vllm_fused_kda_decode_fake(*args) -> None:
    """Shapes only: the op writes its arguments in place and returns nothing."""
    return None


# --------------------------------------------------------------------------------------------------------------
# The multi-token form (FlashInfer's packed_fused_kda_decode)

def _eager_packed(x, weight, conv_state, raw_gate, raw_beta, A_log, dt_bias, state_indices, state, output_gate,
                  norm_weight, lower_bound, norm_eps, output, query_start_loc, num_accepted_tokens, t1_state_indices,
                  bias, null_policy):
    """kda-cute's multi-token kernel on CUDA (it validates and takes the pre-resolved T = 1 rows itself), else
    kda-core's reference on the tensors' device (T = 1 rows pre-resolved: the fused T = 1 step)."""
    if x.is_cuda:
        fn = _packed_kernel if _packed_kernel is not _UNLOADED else _load_packed()
        if fn is not None:
            return fn(x, weight, conv_state, raw_gate, raw_beta, A_log, dt_bias, state_indices, state, output_gate,
                      norm_weight, lower_bound, norm_eps, output, query_start_loc=query_start_loc,
                      num_accepted_tokens=num_accepted_tokens, t1_state_indices=t1_state_indices, bias=bias,
                      null_policy=null_policy)
        _warn_reference("packed_fused_kda_decode")
    if t1_state_indices is not None:
        if not isinstance(state_indices, torch.Tensor) or state_indices.dim() != 2 or state_indices.shape[1] != 1:
            fail("t1_state_indices", "None unless state_indices is [N, 1] (pre-resolved rows are for T = 1 only)",
                 "a value")
        return _eager(x, weight, conv_state, raw_gate, raw_beta, A_log, dt_bias, t1_state_indices, state,
                      output_gate, norm_weight, lower_bound, norm_eps, output, bias, null_policy)
    validate_packed_fused_decode(x, weight, conv_state, raw_gate, raw_beta, A_log, dt_bias, state_indices, state,
                                 output_gate, norm_weight, lower_bound, norm_eps, output,
                                 query_start_loc=query_start_loc, num_accepted_tokens=num_accepted_tokens, bias=bias,
                                 device_kind="any")
    return packed_fused_kda_decode_ref(x, weight, conv_state, raw_gate, raw_beta, A_log, dt_bias, state_indices,
                                       state, output_gate, norm_weight, lower_bound, norm_eps, output,
                                       query_start_loc=query_start_loc, num_accepted_tokens=num_accepted_tokens,
                                       bias=bias, null_policy=null_policy)


def packed_fused_kda_decode(
    x,
    weight,
    conv_state,
    raw_gate,
    raw_beta,
    A_log,
    dt_bias,
    state_indices,
    state,
    output_gate,
    norm_weight,
    lower_bound=-5.0,
    norm_eps=NORM_EPS,
    output=None,
    *,
    query_start_loc,
    num_accepted_tokens,
    t1_state_indices=None,
    bias=None,
    null_policy=NullSlotPolicy.NONPOSITIVE,
):
    """One fused spec-decode step of a whole KDA layer over ragged windows (FlashInfer 0.7.2's
    ``packed_fused_kda_decode``; docs/design.md §8, the multi-token form). Updates ``conv_state`` and ``state`` in
    place and returns ``output`` [1, Ntok, H, 128] bf16.

    Args (Ntok packed tokens, N rows of at most T tokens, H heads, C = 3*H*128):
        x: [Ntok, C] bf16 (row stride free); weight [3, 4, H*128] fp32; conv_state [slots, C, >= T + 2] bf16 (SD
            layout: strides [slot, 1, C]); raw_gate [1, Ntok, H, 128], raw_beta [1, Ntok, H] bf16; A_log [H], dt_bias
            [H*128] fp32 (or None); output_gate [Ntok, H, 128] (or [1, Ntok, H, 128]) bf16, norm_weight [128] fp32.
        state_indices: [N, T] int32/int64 (column 0: the row's conv slot; column t: token t's checkpoint);
            state [slots, H, 128, 128] bf16 or fp32.
        query_start_loc: [N + 1] offsets; num_accepted_tokens: [N] (the state is read from column
            ``max(min(nat, T), 1) - 1``); device data, bounded in the kernel.
        t1_state_indices: FlashInfer's pre-resolved T = 1 rows ([Ntok] slots, with ``state_indices`` [N, 1]): the
            call is then the T = 1 step (:func:`fused_kda_decode`).
        bias: [C] fp32 conv bias or None; null_policy: ``NONPOSITIVE`` (FlashInfer's, vLLM's) or ``OUT_OF_RANGE``.

    A null row (its conv slot or its read slot) gets zero output and touches neither cache. On CUDA it is one
    launch of kda-cute's multi-token kernel (CUDA-graph capturable); elsewhere kda-core's reference.
    """
    policy = null_policy if type(null_policy) is NullSlotPolicy else _policy(null_policy)
    if torch.compiler.is_compiling():
        if output is None:
            output = x.new_empty((1, x.shape[0], A_log.shape[0], HEAD_DIM), dtype=torch.bfloat16)
        torch.ops.kda.packed_fused_kda_decode(x, weight, conv_state, raw_gate, raw_beta, A_log, dt_bias,
                                              state_indices, state, output_gate, norm_weight, lower_bound, norm_eps,
                                              output, query_start_loc, num_accepted_tokens, t1_state_indices, bias,
                                              policy.value)
        return output
    return _eager_packed(x, weight, conv_state, raw_gate, raw_beta, A_log, dt_bias, state_indices, state,
                         output_gate, norm_weight, lower_bound, norm_eps, output, query_start_loc,
                         num_accepted_tokens, t1_state_indices, bias, policy)


@torch.library.custom_op("kda::packed_fused_kda_decode", mutates_args=("conv_state", "state", "output"))
def _packed_fused_kda_decode_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    raw_gate: torch.Tensor,
    raw_beta: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None,
    state_indices: torch.Tensor,
    state: torch.Tensor,
    output_gate: torch.Tensor,
    norm_weight: torch.Tensor,
    lower_bound: float | None,
    norm_eps: float,
    output: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_accepted_tokens: torch.Tensor,
    t1_state_indices: torch.Tensor | None,
    bias: torch.Tensor | None,
    null_policy: str,
) -> None:
    o = _eager_packed(x, weight, conv_state, raw_gate, raw_beta, A_log, dt_bias, state_indices, state, output_gate,
                      norm_weight, lower_bound, norm_eps, output, query_start_loc, num_accepted_tokens,
                      t1_state_indices, bias, NullSlotPolicy(null_policy))
    if o is not output:
        output.copy_(o)


@_packed_fused_kda_decode_op.register_fake
def _packed_fused_kda_decode_fake(*args) -> None:
    """Shapes only: the op writes its arguments in place and returns nothing."""
    return None
