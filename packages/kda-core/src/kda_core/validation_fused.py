"""Host-side validation of the fused KDA decode layer call (docs/design.md §8; FlashInfer's ``fused_kda_decode``).

Metadata only, as every validator of :mod:`kda_core.validation`: shapes, dtypes, strides, devices, alignment and
scalar arguments; no tensor value is read, nothing synchronises or allocates, so the check is safe during CUDA-graph
capture. A broken rule raises :class:`kda_core.errors.KDAError` naming the argument; a legal call returns a
:class:`FusedDecodeCall`, remembered by its facts (a repeated call returns the same object, which the launcher keys
its memo on).

What the fused kernel takes (B rows, H heads in ``T1_HEAD_COUNTS``, C = 3·H·128 conv channels):

- ``x`` [B, C] bf16, channels contiguous, row stride >= C (a view of the projection's output rows).
- ``weight`` [3, 4, H·128] fp32 contiguous (part-major conv taps); ``bias`` [C] fp32 contiguous or None.
- ``conv_state`` [slots, C, W >= 3] bf16 in one of two layouts, told apart by the strides:
  the channel-contiguous "SD" layout (strides (slot, 1, column), column stride >= C) or the column-contiguous
  "DS" layout (strides (slot, channel, 1), channel stride >= W: vLLM's dim-first conv cache); either way the slot
  stride is past the slot's last element (any value: pages shared with the state pool are legal). The kernel
  reads and writes columns 0..2 only.
- ``raw_gate`` [1, B, H, 128] bf16, last dim contiguous (other strides free); ``raw_beta`` [1, B, H] bf16, any
  strides; ``output_gate`` [B, H, 128] or [1, B, H, 128] bf16, last dim contiguous, and ``norm_weight`` [128] fp32
  contiguous: both, or both None (no gated RMSNorm: the output is the KDA step's o, as vLLM's native op without
  its norm arguments).
- ``A_log`` [H] fp32; ``dt_bias`` [H·128] or [H, 128] fp32 contiguous or None (zeros); ``lower_bound`` a finite
  negative float or None (softplus gate); ``norm_eps`` a finite float >= 0 (read only with the norm).
- ``state_indices`` [B] int32 or int64, any stride (values are device data, bounded in the kernel).
- ``state`` [slots, H, 128, 128] bf16 or fp32, inner dims compact, slot stride >= H·128·128 elements (any value:
  a stride that is not a 16-byte multiple takes the unaligned variant). As many slots as ``conv_state``.
- ``output`` [1, B, H, 128] bf16 or None, last dim contiguous, sharing no byte with any other argument.

Alignment is a classification, never a rejection: the tensors the kernel reads in 16-byte vectors (the state rows,
``raw_gate``, ``dt_bias``) decide ``aligned``; the others are read one element per thread.

Not checked (documented caller rules): ``conv_state`` and ``state`` may share pages (an engine's hybrid cache), so
their byte ranges are not compared with each other; duplicate live slots are a caller error, detected only by
:func:`kda_core.validation.debug_check_slots` under ``KDA_DEBUG_VALIDATE``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kda_core.contracts import HEAD_DIM, T1_HEAD_COUNTS, GateMode, gate_mode
from kda_core.errors import fail
from kda_core.validation import (
    VECTOR_BYTES,
    _check_gate_params,
    _check_host_kind,
    _check_scalar_args,
    _check_written,
    _fail_device,
    _is_number,
    _pow2_alignment,
)

__all__ = ["FusedDecodeCall", "validate_fused_decode", "CONV_WIDTH", "CONV_HISTORY", "CONV_SD", "CONV_DS",
           "CONV_LAYOUTS", "conv_layout"]

CONV_WIDTH = 4
CONV_HISTORY = CONV_WIDTH - 1
CONV_SD = "sd"
CONV_DS = "ds"
CONV_LAYOUTS = (CONV_SD, CONV_DS)
_PARTS = 3  # q | k | v
_Tensor = torch.Tensor
_BF16 = torch.bfloat16
_F32 = torch.float32
_INDEX_DTYPES = (torch.int32, torch.int64)
_DEVICE_KINDS = ("cuda", "any")


@dataclass(frozen=True)
class FusedDecodeCall:
    """A validated fused decode call: what the launcher needs to pick and run a kernel variant."""

    B: int
    H: int
    N: int
    """Slots of both caches; a slot outside the null policy's live range makes its row inactive."""
    state_dtype: torch.dtype
    index_dtype: torch.dtype
    gate_mode: GateMode
    lower_bound: float | None
    norm_eps: float
    has_dt_bias: bool
    has_bias: bool
    aligned: bool
    """The state rows, raw_gate and dt_bias are 16-byte aligned (pointers and stepped strides)."""
    alignment: int
    has_output: bool
    has_norm: bool = True
    """``output_gate`` and ``norm_weight`` given: the gated RMSNorm runs (else the output is o)."""
    conv_layout: str = CONV_SD
    """``CONV_SD`` (channel-contiguous columns) or ``CONV_DS`` (each channel's columns contiguous)."""


_MEMO: dict = {}
_MEMO_MAX = 1024


def _tensor(name, t):
    if not isinstance(t, _Tensor):
        fail(name, "a torch.Tensor", type(t).__name__)


def _same_device(name, t, dev):
    if t.get_device() != dev:
        _fail_device(name, t, dev)


def _bits(t) -> int:
    """Pointer OR'ed with the byte stride of every dimension of size > 1 that is not the unit-stride one."""
    acc = t.data_ptr()
    elem = t.element_size()
    for n, s in zip(t.shape, t.stride()):
        if n > 1 and s != 1:
            acc |= s * elem
    return acc


def _last_contiguous(name, t):
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        fail(name, "a contiguous last dimension (stride 1; other strides are free)", f"strides {t.stride()}")


def _activation(name, t, shape, text, dev):
    _tensor(name, t)
    if tuple(t.shape) != shape:
        fail(name, f"shape {text} = {shape}", tuple(t.shape))
    if t.dtype is not _BF16:
        fail(name, "dtype bfloat16", t.dtype)
    _same_device(name, t, dev)


def _contiguous_f32(name, t, shape, text, dev):
    _tensor(name, t)
    if tuple(t.shape) != shape:
        fail(name, f"shape {text} = {shape}", tuple(t.shape))
    if t.dtype is not _F32:
        fail(name, "dtype float32", t.dtype)
    _same_device(name, t, dev)
    if not t.is_contiguous():
        fail(name, "a contiguous tensor", f"strides {t.stride()}")


def conv_layout(conv_state) -> str:
    """``CONV_DS`` when the conv cache's columns are contiguous per channel (column stride 1, channel stride > 1),
    else ``CONV_SD``; metadata only (:func:`_check_conv_state` says whether the layout is legal)."""
    _, s_chan, s_col = conv_state.stride()
    return CONV_DS if s_col == 1 and s_chan != 1 else CONV_SD


def _check_conv_state(conv_state, C: int, dev: int, *, ds_ok: bool = False) -> int:
    """The conv cache's rules (the module docstring); returns its slot count. ``ds_ok``: the DS layout is legal
    too (the T=1 call); without it only SD is."""
    _tensor("conv_state", conv_state)
    shape = tuple(conv_state.shape)
    if len(shape) != 3 or shape[1] != C or shape[2] < CONV_HISTORY:
        fail("conv_state", f"shape [slots, 3*H*128, >= {CONV_HISTORY}] = (slots, {C}, >= {CONV_HISTORY})", shape)
    if conv_state.dtype is not _BF16:
        fail("conv_state", "dtype bfloat16", conv_state.dtype)
    _same_device("conv_state", conv_state, dev)
    slots, _, width = shape
    s_slot, s_chan, s_col = conv_state.stride()
    if ds_ok and conv_layout(conv_state) == CONV_DS:
        if s_chan < width:
            fail("conv_state", f"a channel stride >= {width} in the DS layout (channels must not overlap)",
                 f"strides {conv_state.stride()}")
        span = (C - 1) * s_chan + width  # elements of one slot
        if slots > 1 and s_slot < span:
            fail("conv_state", f"a slot stride >= {span} elements (slots must not overlap)",
                 f"strides {conv_state.stride()}")
        return slots
    if s_chan != 1:
        layouts = ("the channel-contiguous (SD) layout, strides (slot_stride, 1, column_stride), or the DS layout, "
                   "strides (slot_stride, channel_stride, 1)") if ds_ok else \
            "the channel-contiguous (SD) layout: strides (slot_stride, 1, column_stride)"
        fail("conv_state", layouts, f"strides {conv_state.stride()}")
    if width > 1 and s_col < C:
        fail("conv_state", f"a column stride >= {C} (columns must not overlap)", f"strides {conv_state.stride()}")
    span = (width - 1) * s_col + C  # elements of one slot
    if slots > 1 and s_slot < span:
        fail("conv_state", f"a slot stride >= {span} elements (slots must not overlap)",
             f"strides {conv_state.stride()}")
    return slots


def _check_state(state, H: int, dev: int) -> int:
    _tensor("state", state)
    shape = tuple(state.shape)
    if len(shape) != 4 or shape[1:] != (H, HEAD_DIM, HEAD_DIM):
        fail("state", f"shape [slots, H, 128, 128] = (slots, {H}, {HEAD_DIM}, {HEAD_DIM})", shape)
    if state.dtype not in (_BF16, _F32):
        fail("state", "dtype bfloat16 or float32", state.dtype)
    _same_device("state", state, dev)
    st = state.stride()
    if st[1] != HEAD_DIM * HEAD_DIM or st[2] != HEAD_DIM or st[3] != 1:
        fail("state", f"compact inner dims (strides ({HEAD_DIM * HEAD_DIM}, {HEAD_DIM}, 1), K contiguous)",
             f"strides {st}")
    if shape[0] > 1 and st[0] < H * HEAD_DIM * HEAD_DIM:
        fail("state", f"a slot stride >= {H * HEAD_DIM * HEAD_DIM} elements (slots must not overlap)",
             f"stride {st[0]}")
    return shape[0]


def validate_fused_decode(
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
    norm_eps=1e-5,
    output=None,
    *,
    bias=None,
    device_kind="cuda",
) -> FusedDecodeCall:
    """Validate one T=1 fused decode call (the argument rules are in the module docstring); returns its
    description. ``device_kind``: "cuda" (the kernel: every tensor on one CUDA device) or "any" (one shared device,
    e.g. CPU or meta tensors in tests)."""
    _tensor("x", x)
    if device_kind not in _DEVICE_KINDS:
        fail("device_kind", f"one of {_DEVICE_KINDS}", repr(device_kind))
    if x.dim() != 2 or x.shape[1] % (_PARTS * HEAD_DIM):
        fail("x", "shape [B, 3*H*128] (the packed q|k|v projection rows)", tuple(x.shape))
    B, C = x.shape
    H = C // (_PARTS * HEAD_DIM)
    if H not in T1_HEAD_COUNTS:
        fail("x", f"3*H*128 channels with H in {T1_HEAD_COUNTS}", f"{C} channels (H = {H})")
    if x.dtype is not _BF16:
        fail("x", "dtype bfloat16", x.dtype)
    dev = x.get_device()
    if device_kind == "cuda" and dev < 0:
        fail("x", "a CUDA tensor (device_kind='cuda'; tests on other devices pass device_kind='any')", x.device)
    _last_contiguous("x", x)
    if B > 1 and x.stride(0) < C:
        fail("x", f"a row stride >= {C} (rows must not overlap)", f"strides {x.stride()}")
    HK = H * HEAD_DIM

    _contiguous_f32("weight", weight, (_PARTS, CONV_WIDTH, HK), "[3, 4, H*128]", dev)
    if bias is not None:
        _contiguous_f32("bias", bias, (C,), "[3*H*128]", dev)
    n_conv = _check_conv_state(conv_state, C, dev, ds_ok=True)

    _activation("raw_gate", raw_gate, (1, B, H, HEAD_DIM), "[1, B, H, 128]", dev)
    _last_contiguous("raw_gate", raw_gate)
    _activation("raw_beta", raw_beta, (1, B, H), "[1, B, H]", dev)
    if A_log is None:
        fail("A_log", f"an fp32 tensor [H] = ({H},) (the layer's gate is computed in the kernel)", None)
    _check_gate_params(A_log, dt_bias, H, HEAD_DIM, True, dev)
    _check_scalar_args(lower_bound, None, HEAD_DIM, True)

    _tensor("state_indices", state_indices)
    if tuple(state_indices.shape) != (B,):
        fail("state_indices", f"shape [B] = ({B},)", tuple(state_indices.shape))
    if state_indices.dtype not in _INDEX_DTYPES:
        fail("state_indices", "dtype int32 or int64", state_indices.dtype)
    _same_device("state_indices", state_indices, dev)

    N = _check_state(state, H, dev)
    if N != n_conv:
        fail("state", f"as many slots as conv_state ({n_conv}; one slot owns both caches)", N)

    has_norm = output_gate is not None or norm_weight is not None
    if has_norm:
        if output_gate is None:
            fail("output_gate", "a bf16 tensor [B, H, 128] when norm_weight is given (both or neither)", None)
        if norm_weight is None:
            fail("norm_weight", "an fp32 tensor [128] when output_gate is given (both or neither)", None)
        _tensor("output_gate", output_gate)
        og_shape = (B, H, HEAD_DIM) if output_gate.dim() == 3 else (1, B, H, HEAD_DIM)
        _activation("output_gate", output_gate, og_shape, "[B, H, 128] or [1, B, H, 128]", dev)
        _last_contiguous("output_gate", output_gate)
        _contiguous_f32("norm_weight", norm_weight, (HEAD_DIM,), "[128]", dev)
    if not _is_number(norm_eps) or not (norm_eps >= 0 and math.isfinite(norm_eps)):
        fail("norm_eps", "a finite float >= 0", norm_eps)

    inputs = (("x", x), ("weight", weight), ("bias", bias), ("conv_state", conv_state), ("raw_gate", raw_gate),
              ("raw_beta", raw_beta), ("A_log", A_log), ("dt_bias", dt_bias), ("state_indices", state_indices),
              ("state", state), ("output_gate", output_gate), ("norm_weight", norm_weight))
    if output is not None:
        _activation("output", output, (1, B, H, HEAD_DIM), "[1, B, H, 128]", dev)
        _last_contiguous("output", output)
    if dev < 0:
        _check_host_kind("x", x, inputs[1:] + (("output", output),))
    if output is not None:
        _check_written("output", output, inputs)

    acc = _bits(state) | _bits(raw_gate) | (dt_bias.data_ptr() if dt_bias is not None else 0)
    has_output = output is not None
    layout = conv_layout(conv_state)
    key = (B, H, N, state.dtype, state_indices.dtype, lower_bound, float(norm_eps), dt_bias is not None,
           bias is not None, acc & 15, has_output, has_norm, layout)
    call = _MEMO.get(key)
    if call is None:
        alignment = _pow2_alignment(acc)
        if len(_MEMO) >= _MEMO_MAX:
            _MEMO.clear()
        call = _MEMO[key] = FusedDecodeCall(
            B=B, H=H, N=N, state_dtype=state.dtype, index_dtype=state_indices.dtype,
            gate_mode=gate_mode(True, lower_bound), lower_bound=None if lower_bound is None else float(lower_bound),
            norm_eps=float(norm_eps), has_dt_bias=dt_bias is not None, has_bias=bias is not None,
            aligned=alignment >= VECTOR_BYTES, alignment=alignment, has_output=has_output, has_norm=has_norm,
            conv_layout=layout)
    return call


# --------------------------------------------------------------------------------------------------
# The multi-token form (spec decode): FlashInfer's ``packed_fused_kda_decode``
# --------------------------------------------------------------------------------------------------

MAX_FUSED_SPEC_TOKENS = 16
"""Most checkpoint columns (``state_indices.shape[1]``, T) the multi-token fused kernel takes: its per-token
vectors live in shared memory sized at compile time (about 2.5 KB per token and head)."""

__all__ += ["PackedFusedDecodeCall", "validate_packed_fused_decode", "MAX_FUSED_SPEC_TOKENS"]


@dataclass(frozen=True)
class PackedFusedDecodeCall:
    """A validated multi-token fused decode call (:func:`validate_packed_fused_decode`)."""

    tokens: int
    """Rows of ``x`` (the packed tokens of every request)."""
    rows: int
    """Requests: rows of ``state_indices``, ``query_start_loc`` has one more entry."""
    T: int
    """Checkpoint columns of ``state_indices`` (at most this many tokens per request run)."""
    H: int
    N: int
    """Slots of both caches."""
    state_dtype: torch.dtype
    index_dtype: torch.dtype
    qsl_dtype: torch.dtype
    nat_dtype: torch.dtype
    gate_mode: GateMode
    lower_bound: float | None
    norm_eps: float
    has_dt_bias: bool
    has_bias: bool
    aligned: bool
    """The state rows, raw_gate and dt_bias are 16-byte aligned (pointers and stepped strides)."""
    alignment: int
    has_output: bool


_PACKED_MEMO: dict = {}


def _int_vector(name, t, n: int, text: str, dev: int):
    _tensor(name, t)
    if tuple(t.shape) != (n,):
        fail(name, f"shape {text} = ({n},)", tuple(t.shape))
    if t.dtype not in _INDEX_DTYPES:
        fail(name, "dtype int32 or int64", t.dtype)
    _same_device(name, t, dev)


def validate_packed_fused_decode(
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
    norm_eps=1e-5,
    output=None,
    *,
    query_start_loc,
    num_accepted_tokens,
    bias=None,
    device_kind="cuda",
) -> PackedFusedDecodeCall:
    """Validate one multi-token fused decode call (docs/design.md §8, the multi-token form); returns its description.

    The rules of :func:`validate_fused_decode` with Ntok packed token rows in place of B: ``x`` [Ntok, 3·H·128],
    ``raw_gate`` [1, Ntok, H, 128], ``raw_beta`` [1, Ntok, H], ``output_gate`` [Ntok, H, 128] or
    [1, Ntok, H, 128], ``output`` [1, Ntok, H, 128]; and

    - ``state_indices`` [rows, T] int32 or int64, 1 <= T <= ``MAX_FUSED_SPEC_TOKENS``, any strides (column 0 is the
      row's conv slot, column t token t's checkpoint);
    - ``query_start_loc`` [rows + 1] and ``num_accepted_tokens`` [rows], int32 or int64, any stride (values are
      device data, bounded in the kernel: docs/design.md §4);
    - ``conv_state`` [slots, C, W >= T + 2] (the T-token conv window), the SD layout as for T = 1.

    Metadata only (no value is read, no sync): CUDA-graph safe. ``device_kind`` as in
    :func:`validate_fused_decode`."""
    _tensor("x", x)
    if device_kind not in _DEVICE_KINDS:
        fail("device_kind", f"one of {_DEVICE_KINDS}", repr(device_kind))
    if x.dim() != 2 or x.shape[1] % (_PARTS * HEAD_DIM):
        fail("x", "shape [Ntok, 3*H*128] (the packed q|k|v projection rows of every token)", tuple(x.shape))
    Ntok, C = x.shape
    H = C // (_PARTS * HEAD_DIM)
    if H not in T1_HEAD_COUNTS:
        fail("x", f"3*H*128 channels with H in {T1_HEAD_COUNTS}", f"{C} channels (H = {H})")
    if x.dtype is not _BF16:
        fail("x", "dtype bfloat16", x.dtype)
    dev = x.get_device()
    if device_kind == "cuda" and dev < 0:
        fail("x", "a CUDA tensor (device_kind='cuda'; tests on other devices pass device_kind='any')", x.device)
    _last_contiguous("x", x)
    if Ntok > 1 and x.stride(0) < C:
        fail("x", f"a row stride >= {C} (rows must not overlap)", f"strides {x.stride()}")
    HK = H * HEAD_DIM

    _tensor("state_indices", state_indices)
    if state_indices.dim() != 2:
        fail("state_indices", "a 2-D [N, T] tensor (one checkpoint slot per token)", tuple(state_indices.shape))
    rows, T = state_indices.shape
    if not 1 <= T <= MAX_FUSED_SPEC_TOKENS:
        fail("state_indices", f"1 to {MAX_FUSED_SPEC_TOKENS} columns (T checkpoint slots per row)", T)
    if state_indices.dtype not in _INDEX_DTYPES:
        fail("state_indices", "dtype int32 or int64", state_indices.dtype)
    _same_device("state_indices", state_indices, dev)
    _int_vector("query_start_loc", query_start_loc, rows + 1, "[N + 1]", dev)
    _int_vector("num_accepted_tokens", num_accepted_tokens, rows, "[N]", dev)

    _contiguous_f32("weight", weight, (_PARTS, CONV_WIDTH, HK), "[3, 4, H*128]", dev)
    if bias is not None:
        _contiguous_f32("bias", bias, (C,), "[3*H*128]", dev)
    n_conv = _check_conv_state(conv_state, C, dev)
    if conv_state.shape[2] < T + 2:
        fail("conv_state", f"at least T + 2 = {T + 2} columns (the T-token conv window)", conv_state.shape[2])

    _activation("raw_gate", raw_gate, (1, Ntok, H, HEAD_DIM), "[1, Ntok, H, 128]", dev)
    _last_contiguous("raw_gate", raw_gate)
    _activation("raw_beta", raw_beta, (1, Ntok, H), "[1, Ntok, H]", dev)
    if A_log is None:
        fail("A_log", f"an fp32 tensor [H] = ({H},) (the layer's gate is computed in the kernel)", None)
    _check_gate_params(A_log, dt_bias, H, HEAD_DIM, True, dev)
    _check_scalar_args(lower_bound, None, HEAD_DIM, True)

    N = _check_state(state, H, dev)
    if N != n_conv:
        fail("state", f"as many slots as conv_state ({n_conv}; one slot owns both caches)", N)

    _tensor("output_gate", output_gate)
    og_shape = (Ntok, H, HEAD_DIM) if output_gate.dim() == 3 else (1, Ntok, H, HEAD_DIM)
    _activation("output_gate", output_gate, og_shape, "[Ntok, H, 128] or [1, Ntok, H, 128]", dev)
    _last_contiguous("output_gate", output_gate)
    _contiguous_f32("norm_weight", norm_weight, (HEAD_DIM,), "[128]", dev)
    if not _is_number(norm_eps) or not (norm_eps >= 0 and math.isfinite(norm_eps)):
        fail("norm_eps", "a finite float >= 0", norm_eps)

    inputs = (("x", x), ("weight", weight), ("bias", bias), ("conv_state", conv_state), ("raw_gate", raw_gate),
              ("raw_beta", raw_beta), ("A_log", A_log), ("dt_bias", dt_bias), ("state_indices", state_indices),
              ("state", state), ("output_gate", output_gate), ("norm_weight", norm_weight),
              ("query_start_loc", query_start_loc), ("num_accepted_tokens", num_accepted_tokens))
    if output is not None:
        _activation("output", output, (1, Ntok, H, HEAD_DIM), "[1, Ntok, H, 128]", dev)
        _last_contiguous("output", output)
    if dev < 0:
        _check_host_kind("x", x, inputs[1:] + (("output", output),))
    if output is not None:
        _check_written("output", output, inputs)

    acc = _bits(state) | _bits(raw_gate) | (dt_bias.data_ptr() if dt_bias is not None else 0)
    has_output = output is not None
    key = (Ntok, rows, T, H, N, state.dtype, state_indices.dtype, query_start_loc.dtype, num_accepted_tokens.dtype,
           lower_bound, float(norm_eps), dt_bias is not None, bias is not None, acc & 15, has_output)
    call = _PACKED_MEMO.get(key)
    if call is None:
        alignment = _pow2_alignment(acc)
        if len(_PACKED_MEMO) >= _MEMO_MAX:
            _PACKED_MEMO.clear()
        call = _PACKED_MEMO[key] = PackedFusedDecodeCall(
            tokens=Ntok, rows=rows, T=T, H=H, N=N, state_dtype=state.dtype, index_dtype=state_indices.dtype,
            qsl_dtype=query_start_loc.dtype, nat_dtype=num_accepted_tokens.dtype,
            gate_mode=gate_mode(True, lower_bound), lower_bound=None if lower_bound is None else float(lower_bound),
            norm_eps=float(norm_eps), has_dt_bias=dt_bias is not None, has_bias=bias is not None,
            aligned=alignment >= VECTOR_BYTES, alignment=alignment, has_output=has_output)
    return call
