"""Host-side validation of every kda call (docs/design.md §2, §4, §5): metadata only.

Each ``validate_*`` function checks shapes, dtypes, strides, alignment, devices and scalar arguments of one
operation, raises :class:`kda_core.errors.KDAError` (``"<argument>: expected <what>, got <what>"``) on the first
broken rule, and otherwise returns a small frozen dataclass describing the call, which the launchers key their
compile caches on and the facade routes on.

What these functions never do: read a tensor's values (no ``.item()``, ``.tolist()``, no comparison that
materialises), synchronise the device, or allocate on it, so they are safe during CUDA-graph capture and cost a few
microseconds. Value checks that do synchronise (duplicate active slots, ucache cursor ranges) are separate
``debug_check_*`` functions, run only when :func:`debug_checks_enabled` says so (``KDA_DEBUG_VALIDATE=1`` and no
graph capture in progress).

Policies written down here:

- A slot index outside [0, N) is legal: its row is inactive (zero output, pool untouched). Validation never looks
  at index values; the kernels bound-check them against N.
- Alignment is a classification, never a rejection: a legal tensor whose pointer or strides are not 16-byte
  multiples sets ``aligned=False`` and takes the unaligned kernel variant. The T=1 descriptions also say whether
  every tensor but the state pool is aligned (``others_aligned``): a pool whose slot stride is any number of elements
  (vLLM's paged allocator) then takes the T=1 kernel's pool-realigning variant, everything else in vectors.
- ``device_kind="cuda"`` (the kernel launchers) requires every tensor on one CUDA device; ``device_kind="any"``
  (the oracle path, tests on CPU or ``meta`` tensors) requires only that they share one device. Devices are compared
  by index, which is -1 for both cpu and meta, so off CUDA the full validators also compare ``is_meta``.
- Nothing a kernel writes may alias: the output (and the ucache step's pool, rings and cursors) shares no byte with
  another argument, and no two of its own elements share bytes (no stride 0, no overlapping rows). Byte ranges and
  strides are metadata; see "Aliasing" below.
- Descriptions are immutable and remembered by the facts they are made of, so a repeated call returns the same
  object (see ``_MEMO``).
- The launchers' hot path re-validates a call whose facts were described before (``revalidate_*``): it reads the
  facts of the memo key and the rules a kernel's compiled TVM-FFI wrapper cannot check, and leaves the rest to that
  wrapper, which checks it in C before launch; on a wrapper rejection the caller runs the full validator for the
  error. The contract is written down above ``revalidate_decode_t1``.
- fp32 ``g`` / ``beta`` on the T=1 path belong to the precomputed convention (``use_gate_in_kernel=False``: g is a
  log-space decay, often produced in fp32 by a separate gate kernel); the raw-gate convention takes bf16.
- With ``use_gate_in_kernel=False`` the gate parameters ``A_log``, ``dt_bias`` and ``lower_bound`` are ignored
  (the FLA / FlashInfer convention), so adapters may pass them unconditionally.
- A ``recurrent_kda`` call reaches its validators as one :class:`kda_core.call_args.RecurrentArgs` (built once by
  the facade), and its description goes with that bundle to the chosen entry. The T=1 decode validators keep their
  flat positional form: kda-cute's T=1 entry takes its own argument order (``decode_t1._run(call, q, k, v, g, beta,
  pool, slots, ...)``), which the facade reads out of the bundle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real
from operator import mul as _mul

import torch

from kda_core import knobs
from kda_core.call_args import RecurrentArgs
from kda_core.contracts import (
    GENERIC_HEAD_DIMS,
    HEAD_DIM,
    RING_SLOTS,
    T1_HEAD_COUNTS,
    UCACHE_T,
    UCACHE_WRING,
    GateMode,
    NullSlotPolicy,
    default_flush_min,
    first_live_slot,
    gate_mode,
    max_flush_min,
    max_hist_len,
    null_policy_of,
)
from kda_core.errors import KDAError, fail

__all__ = [
    "DecodeT1Call",
    "RecurrentCall",
    "UcacheCall",
    "tensor_alignment",
    "is_aligned",
    "validate_decode_t1",
    "validate_packed_decode_t1",
    "validate_packed_tokens_decode_t1",
    "validate_recurrent",
    "validate_ucache",
    "revalidate_decode_t1",
    "revalidate_packed_decode_t1",
    "revalidate_packed_tokens_decode_t1",
    "revalidate_recurrent_t1",
    "revalidate_recurrent_t1_varlen",
    "WRAPPER_REJECTED",
    "debug_checks_enabled",
    "debug_check_slots",
    "debug_check_ucache_cursors",
    "validate_gate_params",
]

_BF16 = torch.bfloat16
_F16 = torch.float16
_F32 = torch.float32
_I32 = torch.int32
_I64 = torch.int64
_POOL_DTYPES = (_BF16, _F32)
_BF16_ONLY = (_BF16,)
_F32_ONLY = (_F32,)
_T1_PRECOMPUTED_TYPES = (_BF16, _F32)
_Tensor = torch.Tensor
_ACT_DTYPES = (_BF16, _F16, _F32)  # the generic path; the T=1 and ucache kernels take bf16
_DEVICE_KINDS = ("cuda", "any")
VECTOR_BYTES = 16
"""One 128-bit global access: a tensor is 'aligned' when every row it is read by starts on such a boundary."""


# ----------------------------------------------------------------------------------------------------------------
# Call descriptions


# Building a frozen dataclass costs ~1 µs (object.__setattr__ per field), a fifth of the T=1 budget. Descriptions are
# immutable and a serving loop validates the same few call shapes every step, so each distinct description is built
# once and then found by a key of the facts it is made of (~0.25 µs).
_MEMO: dict = {}
_MEMO_MAX = 4096


def _remember(key, call):
    if len(_MEMO) >= _MEMO_MAX:  # many distinct batch sizes: start over rather than grow without bound
        _MEMO.clear()
    _MEMO[key] = call
    return call


@dataclass(frozen=True)
class DecodeT1Call:
    """A validated T=1 decode call (unpacked or packed inputs); what the T=1 launcher needs to pick a kernel."""

    B: int
    H: int
    head_dim: int
    N: int
    """Pool rows; slots outside [0, N) are inactive rows."""
    state_dtype: torch.dtype
    g_dtype: torch.dtype
    beta_dtype: torch.dtype
    gate_mode: GateMode
    beta_is_logit: bool
    lower_bound: float | None
    scale: float
    aligned: bool
    """Every vector-read tensor is 16-byte aligned (pointer and strides): the fast variant may run."""
    alignment: int
    """The largest of 16/8/4/2/1 bytes that holds for all of them."""
    packed: bool
    has_output: bool
    has_dt_bias: bool = True
    """The gate is in the kernel and dt_bias was given (absent: zeros, the kernel's variant without it)."""
    index_dtype: torch.dtype = torch.int32
    """The slot indices' dtype (int32 or int64): the kernel reads them as they are, so it is a compiled variant."""
    others_aligned: bool = False
    """Every vector-read tensor except the state pool is 16-byte aligned (whatever the pool's pointer and row stride):
    with ``aligned`` False, the T=1 kernel's pool-realigning variant may run."""


@dataclass(frozen=True)
class RecurrentCall:
    """A validated ``recurrent_kda`` call, and whether the T=1 kernel can take it (``t1_reason`` says why)."""

    mode: str
    """"dense" (no indices), "pool" (1-D indices, in place) or "spec" (2-D indices, one checkpoint per token)."""
    B: int
    T: int
    N_seq: int
    H: int
    HV: int
    K: int
    V: int
    N: int | None
    """Pool rows (pool and spec modes), else None."""
    varlen: bool
    gate_mode: GateMode
    lower_bound: float | None
    """The lower-bound gate's floor (None for the softplus and precomputed gates)."""
    beta_is_logit: bool
    use_qk_l2norm_in_kernel: bool
    output_final_state: bool
    state_dtype: torch.dtype | None
    """Dtype of the pool, or of the dense initial state (None: zeros)."""
    act_dtype: torch.dtype
    scale: float
    aligned: bool
    alignment: int
    on_cuda: bool
    t1_eligible: bool
    t1_reason: str
    has_dt_bias: bool = True
    """The gate is in the kernel and dt_bias was given (absent: zeros, the kernels' variant without it)."""
    index_dtype: torch.dtype | None = torch.int32
    """The slot indices' dtype, int32 or int64 (None in dense mode): a compiled variant of every kernel."""
    others_aligned: bool = False
    """As :attr:`DecodeT1Call.others_aligned`: every vector-read tensor except the pool (``initial_state`` in pool and
    spec modes) is 16-byte aligned."""


@dataclass(frozen=True)
class UcacheCall:
    """A validated ucache verify(+flush) call (docs/design.md §5)."""

    B: int
    T: int
    H: int
    head_dim: int
    N: int
    w_ring: int
    flush_min: int
    max_hist_len: int
    gate_mode: GateMode
    lower_bound: float | None
    scale: float
    restart_hist_on_flush: bool
    aligned: bool
    alignment: int
    has_output: bool
    index_dtype: torch.dtype = torch.int32
    """The slot indices' dtype (int32 or int64, any stride)."""


# ----------------------------------------------------------------------------------------------------------------
# Alignment


def tensor_alignment(t: torch.Tensor) -> int:
    """Largest of 16/8/4/2/1 bytes dividing ``t``'s data pointer and every non-unit stride in bytes.

    Strides of size-1 dimensions (never stepped over) and unit strides (the contiguous dimension, read in vectors)
    are ignored. Reads metadata only; ``meta`` tensors report pointer 0.
    """
    elem = t.element_size()
    acc = t.data_ptr()
    for n, s in zip(t.shape, t.stride()):
        if n > 1 and s != 1:
            acc |= s * elem
    return _pow2_alignment(acc)


def _pow2_alignment(acc: int) -> int:
    if acc % 16 == 0:
        return 16
    if acc % 8 == 0:
        return 8
    if acc % 4 == 0:
        return 4
    if acc % 2 == 0:
        return 2
    return 1


def _key_bits(acc: int, pool_bits: int) -> int:
    """The alignment facts of a memo key: the low 4 bits of every tensor but the pool (``acc``), and above them the
    pool's own (its pointer and row stride), so that a misaligned pool and a misaligned activation are told apart."""
    return (acc & 15) | (pool_bits & 15) << 4


def _alignment_all(tensors) -> int:
    acc = 0
    for t in tensors:
        if t is None:
            continue
        elem = t.element_size()
        acc |= t.data_ptr()
        for n, s in zip(t.shape, t.stride()):
            if n > 1 and s != 1:
                acc |= s * elem
    return _pow2_alignment(acc)


def is_aligned(*tensors: torch.Tensor | None, bytes: int = VECTOR_BYTES) -> bool:  # noqa: A002 (the brief's name)
    """True when every given tensor (``None`` skipped) is ``bytes``-aligned in the sense of :func:`tensor_alignment`."""
    if bytes not in (1, 2, 4, 8, 16):
        fail("bytes", "one of 1, 2, 4, 8, 16", bytes)
    return _alignment_all(tensors) >= bytes


# ----------------------------------------------------------------------------------------------------------------
# Shared checks (each raises through fail() naming the argument)
#
# The T=1 path must cost a few microseconds in Python, where each tensor attribute read costs 50-100 ns: every
# tensor's metadata is read once, by one helper that checks it and returns the bits its alignment depends on.


def _check(name: str, t, shape: tuple, shape_text: str, dtypes: tuple, dtype_text: str, dev: int) -> None:
    """Type, exact shape, dtype and device index of one tensor."""
    if not isinstance(t, _Tensor):
        fail(name, "a torch.Tensor", type(t).__name__)
    if t.shape != shape:
        fail(name, f"shape {shape_text} = {tuple(shape)}", tuple(t.shape))
    if t.dtype not in dtypes:
        fail(name, f"dtype {dtype_text}", t.dtype)
    if t.get_device() != dev:
        _fail_device(name, t, dev)


def _device_index(name: str, t, device_kind: str) -> int:
    """The device index every tensor of the call must share (``t``'s; -1 off CUDA), after the device_kind rule.

    Devices are compared by ``get_device()`` (a tenth of the cost of comparing ``torch.device`` objects), which
    tells CUDA devices apart but not cpu from meta; neither of those launches a kernel, so that is harmless.
    """
    dev = t.get_device()
    if device_kind == "cuda":
        if dev < 0:
            fail(name, "a CUDA tensor (device_kind='cuda'; the oracle path passes device_kind='any')", t.device)
    elif device_kind != "any":
        fail("device_kind", f"one of {_DEVICE_KINDS}", repr(device_kind))
    return dev


def _fail_device(name: str, t, dev: int):
    where = f"cuda:{dev}" if dev >= 0 else "the CPU (or meta)"
    fail(name, f"a tensor on {where}, the device of the call's first tensor", t.device)


def _act(name: str, t, shape: tuple, shape_text: str, dtypes: tuple, dtype_text: str, dev: int) -> int:
    """A 4-D activation [B, T, heads, head_dim]: type, shape, dtype and a contiguous last dim (other strides free).

    Returns the data pointer OR'ed with the byte stride of every other dimension it steps over (size > 1), whose
    lowest set bit is the tensor's alignment.
    """
    if not isinstance(t, _Tensor):
        fail(name, "a torch.Tensor", type(t).__name__)
    if t.shape != shape:
        fail(name, f"shape {shape_text} = {tuple(shape)}", tuple(t.shape))
    if t.dtype not in dtypes:
        fail(name, f"dtype {dtype_text}", t.dtype)
    if t.get_device() != dev:
        _fail_device(name, t, dev)
    st = t.stride()
    if st[3] != 1:
        fail(name, "a contiguous last dimension (stride 1; other strides are free)", f"strides {st}")
    # OR the element strides first: the lowest set bit of the OR, times the (power-of-two) element size, is the
    # lowest set bit of every byte stride.
    stepped = st[2] if shape[2] > 1 else 0
    if shape[0] > 1:
        stepped |= st[0]
    if shape[1] > 1:
        stepped |= st[1]
    return t.data_ptr() | stepped * t.element_size()


def _index(name: str, t, n: int, text: str, dev: int) -> None:
    """An int32 [n] contiguous index/cursor tensor (values are never read)."""
    if not isinstance(t, _Tensor):
        fail(name, "a torch.Tensor", type(t).__name__)
    if t.shape != (n,):
        fail(name, f"shape {text} = ({n},)", tuple(t.shape))
    if t.dtype is not _I32:
        fail(name, "dtype int32", t.dtype)
    if t.get_device() != dev:
        _fail_device(name, t, dev)
    if n > 1 and t.stride(0) != 1:
        fail(name, "a contiguous 1-D tensor (stride 1)", f"stride {t.stride(0)}")


def _slots(name: str, t, n: int, text: str, dev: int) -> None:
    """Slot indices or per-row counts [n]: int32 or int64, any stride (a column of a wider table; values are never
    read)."""
    if not isinstance(t, _Tensor):
        fail(name, "a torch.Tensor", type(t).__name__)
    if t.shape != (n,):
        fail(name, f"shape {text} = ({n},)", tuple(t.shape))
    if t.dtype is not _I32 and t.dtype is not _I64:
        fail(name, "dtype int32 or int64", t.dtype)
    if t.get_device() != dev:
        _fail_device(name, t, dev)


def _rows(name: str, t, row_shape: tuple, dtypes: tuple, dtype_text: str, what: str, dev: int) -> int:
    """A pool or ring [N, *row_shape]: inner dims compact (last contiguous), dim-0 stride any number of elements
    >= the row (padding allowed). Returns N. The inner strides are 16-byte multiples, so its pointer and its row
    stride in bytes decide its alignment (:func:`_row_bits`): a row stride that is not a 16-byte multiple takes
    the unaligned variant."""
    if not isinstance(t, _Tensor):
        fail(name, "a torch.Tensor", type(t).__name__)
    shape = t.shape
    a, b, c = row_shape
    if len(shape) != 4 or shape[1] != a or shape[2] != b or shape[3] != c:
        fail(name, f"shape {what} = (N, {', '.join(map(str, row_shape))})", tuple(shape))
    if t.dtype not in dtypes:
        fail(name, f"dtype {dtype_text}", t.dtype)
    if t.get_device() != dev:
        _fail_device(name, t, dev)
    st = t.stride()
    if st[1] != b * c or st[2] != c or st[3] != 1:
        fail(name, f"compact inner dims (strides ({b * c}, {c}, 1), K contiguous)", f"strides {st}")
    if shape[0] > 1 and st[0] < a * b * c:
        fail(name, f"a dim-0 (row) stride >= {a * b * c} elements (the row; rows must not overlap)",
             f"stride {st[0]}")
    return shape[0]


def _row_bits(t) -> int:
    """Alignment bits of a checked pool or ring: its pointer, OR'ed with its row stride in bytes when it has more
    than one row (the inner strides are 16-byte multiples)."""
    if t.shape[0] > 1:
        return t.data_ptr() | t.stride()[0] * t.element_size()
    return t.data_ptr()


# ----------------------------------------------------------------------------------------------------------------
# Aliasing (metadata only: data pointers, sizes, strides)
#
# A tensor a kernel writes (the output; the pool, rings and cursors of the ucache step) must not share a byte with
# anything else of the call, nor write one byte twice: CTAs would race on it, or a write would land in a pool row no
# batch row owns. The rule is on byte ranges, [first byte, one past the last byte], which is conservative for two
# interleaved views of one buffer, and on strides: sorted by stride, each dimension of size > 1 must step at least
# the span of the dimensions inside it (no stride 0, no overlapping rows). Meta tensors have no addresses and are
# not compared.


def _span(t) -> int:
    """Bytes from ``t``'s first element to one past its last (sum of (size - 1) * stride, plus one element); 0 when
    it has no element."""
    shape = t.shape
    if 0 in shape:
        return 0
    st = t.stride()
    return (sum(map(_mul, shape, st)) - sum(st) + 1) * t.element_size()


def _self_overlapping(shape, stride) -> bool:
    """Whether two indices of a tensor with these sizes and strides can name one element (stride 0 included)."""
    extent = 1
    for s, n in sorted((s, n) for n, s in zip(shape, stride) if n > 1):
        if s < extent:
            return True
        extent += (n - 1) * s
    return False


def _check_written(name: str, t, others) -> None:
    """``t`` (checked for shape, dtype and device) writes each of its elements once and shares no byte with the
    ``others``, (name, tensor or None) pairs; raises naming ``name``."""
    if not t.is_contiguous() and _self_overlapping(t.shape, t.stride()):
        fail(name, "a tensor whose elements do not overlap (sorted by stride, each dimension steps at least the "
                   "span of the dimensions inside it; no stride 0)", f"shape {tuple(t.shape)}, strides {t.stride()}")
    _check_disjoint(name, t, others)


def _check_disjoint(name: str, t, others) -> None:
    """``t`` shares no byte with any of the ``others`` ((name, tensor or None) pairs); raises naming ``name``.

    Only pointer 0 can be a meta tensor's, so ``is_meta`` is read only then."""
    span = _span(t)
    lo = t.data_ptr()
    if not span or (not lo and t.is_meta):
        return
    hi = lo + span
    for other_name, o in others:
        if o is not None and (p := o.data_ptr()) < hi and (p or not o.is_meta):
            other = _span(o)
            if other and lo < p + other:
                fail(name, f"a tensor that shares no byte with {other_name}",
                     f"bytes [{lo:#x}, {hi:#x}) overlapping {other_name}'s [{p:#x}, {p + other:#x})")


def _check_pairwise_disjoint(tensors) -> None:
    """No two of the (name, tensor) pairs share a byte; a clash is named by the later tensor of the pair. Each
    tensor's byte range is computed once (a range per pair cost ~45 us for the ucache step's seven tensors)."""
    ranges = []
    for name, t in tensors:
        span = _span(t)
        lo = t.data_ptr()
        if not span or (not lo and t.is_meta):
            continue
        hi = lo + span
        for other_name, p, q in ranges:
            if p < hi and lo < q:
                fail(name, f"a tensor that shares no byte with {other_name}",
                     f"bytes [{lo:#x}, {hi:#x}) overlapping {other_name}'s [{p:#x}, {q:#x})")
        ranges.append((name, lo, hi))


def _check_host_kind(first_name: str, first, tensors) -> None:
    """cpu and meta tensors both report device index -1: off CUDA, tell them apart (the (name, tensor or None)
    pairs must all be meta or all not, as ``first`` is)."""
    meta = first.is_meta
    for name, t in tensors:
        if t is not None and t.is_meta != meta:
            fail(name, f"a tensor on {first.device}, the device of {first_name}", t.device)


def _is_number(x) -> bool:
    t = type(x)
    return t is float or t is int or (t is not bool and isinstance(x, Real))


def _check_scalar_args(lower_bound, scale, K: int, use_gate: bool) -> float:
    if use_gate and lower_bound is not None:
        if not _is_number(lower_bound):
            fail("lower_bound", "a negative float or None", type(lower_bound).__name__)
        if not (lower_bound < 0 and math.isfinite(lower_bound)):
            fail("lower_bound", "a finite negative float (the floor of the log-decay) or None", lower_bound)
    if scale is None:
        return K**-0.5
    if not _is_number(scale):
        fail("scale", "a positive finite float or None", type(scale).__name__)
    if not (scale > 0 and math.isfinite(scale)):
        fail("scale", "a positive finite float or None", scale)
    return float(scale)


def _check_gate_params(A_log, dt_bias, H: int, K: int, use_gate: bool, dev: int, heads: str = "H") -> int:
    """With the gate in the kernel: A_log fp32 [H] required, dt_bias fp32 [H*K] or [H, K] contiguous or None (zeros).
    Without it they are ignored (not read, not checked). Returns dt_bias's pointer for the alignment class (0 when
    unused or absent). ``heads`` names the head count in the messages (the FLA adapter's per-value-head gate: HV)."""
    if not use_gate:
        return 0
    if A_log is None:
        fail("A_log", f"an fp32 tensor [{heads}] = ({H},) when use_gate_in_kernel=True", None)
    _check("A_log", A_log, (H,), f"[{heads}]", _F32_ONLY, "float32", dev)
    if dt_bias is None:
        return 0
    if not isinstance(dt_bias, _Tensor):
        fail("dt_bias", "a torch.Tensor", type(dt_bias).__name__)
    shape = dt_bias.shape
    if shape != (H * K,) and shape != (H, K):
        fail("dt_bias", f"shape [{heads}*K] = ({H * K},) or [{heads}, K] = ({H}, {K})", tuple(shape))
    if dt_bias.dtype is not _F32:
        fail("dt_bias", "dtype float32", dt_bias.dtype)
    if dt_bias.get_device() != dev:
        _fail_device("dt_bias", dt_bias, dev)
    if not dt_bias.is_contiguous():
        fail("dt_bias", "a contiguous tensor", f"strides {dt_bias.stride()}")
    return dt_bias.data_ptr()


def validate_gate_params(A_log, dt_bias, lower_bound, heads: int, head_dim: int, *, like,
                         heads_text: str = "H") -> None:
    """The in-kernel gate's parameters for ``heads`` heads of ``head_dim`` channels: A_log fp32 [heads], dt_bias
    fp32 [heads*head_dim] or [heads, head_dim] contiguous or None, on the device of the tensor ``like``, and
    ``lower_bound`` a finite negative float or None. For callers that index the gate by another head count than the
    kernels (the FLA adapter: by value head, ``heads_text="HV"``)."""
    _check_gate_params(A_log, dt_bias, heads, head_dim, True, like.get_device(), heads_text)
    _check_scalar_args(lower_bound, None, head_dim, True)
    if like.get_device() < 0:
        _check_host_kind("q", like, (("A_log", A_log), ("dt_bias", dt_bias)))


def _gate_and_scale(use_gate: bool, A_log, dt_bias, lower_bound, scale, H: int, K: int, dev: int):
    """Hot-path gate parameter and scalar checks shared by the T=1 and recurrent validators: (dt_bias pointer bits
    for the alignment fold, or 0 without the gate; the lower bound as remembered, None without the gate; the scale,
    defaulted). A broken rule goes to the full checkers, which raise the argument's error."""
    ptr = 0
    lb = None  # ignored (and unchecked) with a precomputed gate
    if use_gate:
        if (not isinstance(A_log, _Tensor) or A_log.shape != (H,) or A_log.dtype is not _F32
                or A_log.get_device() != dev
                or (dt_bias is not None and (
                    not isinstance(dt_bias, _Tensor) or ((ds := dt_bias.shape) != (H * K,) and ds != (H, K))
                    or dt_bias.dtype is not _F32 or dt_bias.get_device() != dev or not dt_bias.is_contiguous()))):
            _check_gate_params(A_log, dt_bias, H, K, True, dev)
        if dt_bias is not None:
            ptr = dt_bias.data_ptr()
        if lower_bound is not None and (type(lower_bound) is not float or not -_INF < lower_bound < 0.0):
            _check_scalar_args(lower_bound, None, K, True)  # raises unless another legal number type
        lb = lower_bound
    if scale is None:
        scale = _DEFAULT_SCALE[K]
    elif type(scale) is not float or not 0.0 < scale < _INF:
        scale = _check_scalar_args(None, scale, K, False)
    return ptr, lb, scale


def _check_flag(name: str, value) -> None:
    if value is not True and value is not False:
        fail(name, "a bool", type(value).__name__)


# ----------------------------------------------------------------------------------------------------------------
# T=1 decode
#
# The hot path of the three validators below reads each tensor's metadata once and tests every rule of that tensor
# in one condition; only when the condition fails does it call the tensor's checker above, which re-tests the rules
# in their documented order and raises the first broken one (so the messages come from one place). A legal call
# costs one Python -> C call per fact read (shape, stride, dtype, device, data pointer), a handful of comparisons and
# one dictionary lookup of a flat key; the facts of the description are derived only when the key is new.

_T1_HEADS = frozenset(T1_HEAD_COUNTS)
_ELEM_BYTES = {_BF16: 2, _F16: 2, _F32: 4}
_DEFAULT_SCALE = {K: K**-0.5 for K in GENERIC_HEAD_DIMS}
_INF = math.inf
_HEAD_ELEMS = HEAD_DIM * HEAD_DIM
_T1_TEXT = "[B, 1, H, K] (H == HV on the T=1 path)"


def _t1_tail(B, H, g_dtype, beta_dtype, state_pool, slot_indices, A_log, dt_bias, lower_bound, use_gate_in_kernel,
             beta_is_logit, scale, output, names, dev, acc, is_packed, inputs) -> DecodeT1Call:
    """Checks shared by the unpacked and packed T=1 entries once the activations (``inputs``, (name, tensor) pairs)
    gave B, H and their alignment bits ``acc``; then the description, found by its facts."""
    if use_gate_in_kernel is not True and use_gate_in_kernel is not False:
        _check_flag("use_gate_in_kernel", use_gate_in_kernel)
    if beta_is_logit is not True and beta_is_logit is not False:
        _check_flag("beta_is_logit", beta_is_logit)
    types = _BF16_ONLY if use_gate_in_kernel else _T1_PRECOMPUTED_TYPES
    if g_dtype not in types or beta_dtype not in types:
        text = ("bfloat16 (raw gate; float32 only with use_gate_in_kernel=False)" if use_gate_in_kernel else
                "bfloat16 or float32 (precomputed gate)")
        if g_dtype not in types:
            fail(names[0], f"dtype {text}", g_dtype)
        fail(names[1], f"dtype {text}", beta_dtype)

    # state_pool [N, H, V, K]: inner dims compact, row stride any number of elements >= the row.
    if not isinstance(state_pool, _Tensor):
        _rows("state_pool", state_pool, (H, HEAD_DIM, HEAD_DIM), _POOL_DTYPES, "bfloat16 or float32", "[N, H, V, K]",
              dev)
    ps = state_pool.shape
    pst = state_pool.stride()
    state_dtype = state_pool.dtype
    if (len(ps) != 4 or ps[1] != H or ps[2] != HEAD_DIM or ps[3] != HEAD_DIM
            or (state_dtype is not _BF16 and state_dtype is not _F32) or state_pool.get_device() != dev
            or pst[1] != _HEAD_ELEMS or pst[2] != HEAD_DIM or pst[3] != 1
            or (ps[0] > 1 and pst[0] < H * _HEAD_ELEMS)):
        _rows("state_pool", state_pool, (H, HEAD_DIM, HEAD_DIM), _POOL_DTYPES, "bfloat16 or float32", "[N, H, V, K]",
              dev)
    N = ps[0]
    pool_bits = state_pool.data_ptr()  # kept apart from acc: the pool alone may be misaligned (others_aligned)
    if N > 1:  # the row stride in bytes: one that is not a 16-byte multiple takes the unaligned variant
        pool_bits |= pst[0] * (4 if state_dtype is _F32 else 2)

    if (not isinstance(slot_indices, _Tensor) or slot_indices.shape != (B,)
            or ((index_dtype := slot_indices.dtype) is not _I32 and index_dtype is not _I64)
            or slot_indices.get_device() != dev):
        _slots("slot_indices", slot_indices, B, "[B]", dev)

    dt_bias_ptr, lb, scale = _gate_and_scale(use_gate_in_kernel, A_log, dt_bias, lower_bound, scale, H, HEAD_DIM, dev)
    acc |= dt_bias_ptr

    if output is not None:
        so = output.stride() if isinstance(output, _Tensor) else None
        if (so is None or output.shape != (B, 1, H, HEAD_DIM) or output.dtype is not _BF16
                or output.get_device() != dev or so[3] != 1):
            _act("output", output, (B, 1, H, HEAD_DIM), "[B, 1, H, V]", _BF16_ONLY, "bfloat16", dev)
        acc |= output.data_ptr() | ((so[0] if B > 1 else 0) | (so[2] if H > 1 else 0)) * 2
    others = inputs + (("state_pool", state_pool), ("slot_indices", slot_indices))
    if use_gate_in_kernel:
        others += (("A_log", A_log), ("dt_bias", dt_bias))
    if dev < 0:
        _check_host_kind(inputs[0][0], inputs[0][1], others[1:] + (("output", output),))
    if output is not None:
        _check_written("output", output, others)

    # (use_gate, lower_bound) determine the gate mode and hash faster than the enum (a Python-level __hash__).
    has_dt_bias = use_gate_in_kernel and dt_bias is not None
    key = ("t1", B, H, N, state_dtype, g_dtype, beta_dtype, use_gate_in_kernel, lb, beta_is_logit, scale,
           _key_bits(acc, pool_bits), is_packed, output is not None, has_dt_bias, index_dtype)
    call = _MEMO.get(key)
    if call is None:
        alignment = _pow2_alignment(acc | pool_bits)
        call = _remember(key, DecodeT1Call(
            B=B, H=H, head_dim=HEAD_DIM, N=N, state_dtype=state_dtype, g_dtype=g_dtype, beta_dtype=beta_dtype,
            gate_mode=gate_mode(use_gate_in_kernel, lower_bound), beta_is_logit=beta_is_logit,
            lower_bound=None if lb is None else float(lb), scale=scale, aligned=alignment >= VECTOR_BYTES,
            alignment=alignment, packed=is_packed, has_output=output is not None, has_dt_bias=has_dt_bias,
            index_dtype=index_dtype, others_aligned=_pow2_alignment(acc) >= VECTOR_BYTES,
        ))
    return call


def validate_decode_t1(
    q,
    k,
    v,
    g,
    beta,
    state_pool,
    slot_indices,
    *,
    A_log=None,
    dt_bias=None,
    lower_bound=None,
    use_gate_in_kernel=True,
    beta_is_logit=True,
    scale=None,
    output=None,
    device_kind="cuda",
) -> DecodeT1Call:
    """Validate one T=1 decode call on a state pool (the T=1 kernel's contract, docs/design.md §2-§4).

    q, k, v, g [B, 1, H, 128] with H == HV in ``T1_HEAD_COUNTS``, beta [B, 1, H]: bf16 (g and beta may be fp32 with
    ``use_gate_in_kernel=False``), last dim contiguous, other strides free. state_pool [N, H, 128, 128] bf16 or fp32,
    K contiguous, inner dims compact, dim-0 stride any number of elements >= H*128*128 (one that is not a 16-byte
    multiple takes the unaligned variant). slot_indices int32 or int64 [B], any stride (values are not read: null
    slots are inactive rows). A_log fp32 [H] is required with
    ``use_gate_in_kernel``, dt_bias fp32 [H*128] or [H, 128] is optional (None: zeros); ``lower_bound`` < 0 selects
    the lower-bound gate, None the softplus gate. ``output`` bf16 [B, 1, H, 128], sharing no byte with another
    argument and none between its own elements. ``device_kind``: "cuda" (the kernel) or "any" (the oracle).
    """
    if not isinstance(q, _Tensor):
        fail("q", "a torch.Tensor", type(q).__name__)
    shape = q.shape
    if len(shape) != 4 or shape[1] != 1 or shape[3] != HEAD_DIM:
        fail("q", f"shape [B, 1, H, {HEAD_DIM}] (T=1 decode)", tuple(shape))
    B, _, H, _ = shape
    if H not in _T1_HEADS:
        fail("q", f"a head count H (dim 2) in {T1_HEAD_COUNTS}", H)
    dev = q.get_device()
    if device_kind != "any":
        _device_index("q", q, device_kind)  # "cuda" needs dev >= 0; anything else is not a device kind
    sq = q.stride()
    if q.dtype is not _BF16 or sq[3] != 1:
        _act("q", q, shape, _T1_TEXT, _BF16_ONLY, "bfloat16", dev)
    if not isinstance(k, _Tensor) or k.shape != shape or k.dtype is not _BF16 or k.get_device() != dev:
        _act("k", k, shape, _T1_TEXT, _BF16_ONLY, "bfloat16", dev)
    sk = k.stride()
    if sk[3] != 1:
        _act("k", k, shape, _T1_TEXT, _BF16_ONLY, "bfloat16", dev)
    if not isinstance(v, _Tensor) or v.shape != shape or v.dtype is not _BF16 or v.get_device() != dev:
        _act("v", v, shape, _T1_TEXT, _BF16_ONLY, "bfloat16", dev)
    sv = v.stride()
    if sv[3] != 1:
        _act("v", v, shape, _T1_TEXT, _BF16_ONLY, "bfloat16", dev)
    if (not isinstance(g, _Tensor) or g.shape != shape or ((g_dtype := g.dtype) is not _BF16 and g_dtype is not _F32)
            or g.get_device() != dev):
        _act("g", g, shape, _T1_TEXT, _T1_PRECOMPUTED_TYPES, "bfloat16 or float32", dev)
    sg = g.stride()
    if sg[3] != 1:
        _act("g", g, shape, _T1_TEXT, _T1_PRECOMPUTED_TYPES, "bfloat16 or float32", dev)
    if (not isinstance(beta, _Tensor) or beta.shape != (B, 1, H)
            or ((beta_dtype := beta.dtype) is not _BF16 and beta_dtype is not _F32) or beta.get_device() != dev):
        _check("beta", beta, (B, 1, H), "[B, 1, H]", _T1_PRECOMPUTED_TYPES, "bfloat16 or float32", dev)
    # Alignment bits: the pointers, and the byte strides of the dims a row steps over (dim 1 has one token). The
    # lowest set bit of an OR of element strides, times the power-of-two element size, is that of the byte strides.
    bf16_steps = ((sq[0] | sk[0] | sv[0]) if B > 1 else 0) | ((sq[2] | sk[2] | sv[2]) if H > 1 else 0)
    g_steps = (sg[0] if B > 1 else 0) | (sg[2] if H > 1 else 0)
    acc = (q.data_ptr() | k.data_ptr() | v.data_ptr() | g.data_ptr() | bf16_steps * 2
           | g_steps * (4 if g_dtype is _F32 else 2))
    return _t1_tail(B, H, g_dtype, beta_dtype, state_pool, slot_indices, A_log, dt_bias, lower_bound,
                    use_gate_in_kernel, beta_is_logit, scale, output, ("g", "beta"), dev, acc, False,
                    (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)))


def _packed_rows(name, t, B, row, dev):
    """Checker of one packed GEMM-output operand [B, row] (raises the first broken rule)."""
    if not isinstance(t, _Tensor):
        fail(name, "a torch.Tensor", type(t).__name__)
    if t.shape != (B, row):
        fail(name, f"shape [B, {row // HEAD_DIM}*{HEAD_DIM}] = {(B, row)}", tuple(t.shape))
    if t.get_device() != dev:
        _fail_device(name, t, dev)
    st = t.stride()
    if st[1] != 1:
        fail(name, "a contiguous last dimension (stride 1; the row stride is free)", f"strides {st}")
    if B > 1 and st[0] < row:
        fail(name, f"a row stride >= the row ({row} elements; rows must not overlap)", f"stride {st[0]}")


def validate_packed_decode_t1(
    mixed_qkv,
    raw_gate,
    raw_beta,
    state_pool,
    slot_indices,
    *,
    num_heads,
    A_log=None,
    dt_bias=None,
    lower_bound=None,
    use_gate_in_kernel=True,
    beta_is_logit=True,
    scale=None,
    output=None,
    device_kind="cuda",
) -> DecodeT1Call:
    """Validate a packed T=1 decode call: rows of one GEMM output (row strides may exceed the row).

    mixed_qkv [B, 3*H*128] bf16 laid out [q heads | k heads | v heads]; raw_gate [B, H*128]; raw_beta [B, H]; each
    with a contiguous last dim (raw_beta: any strides) and a row stride of at least its row (padding allowed,
    overlap not). The rest as :func:`validate_decode_t1`.
    """
    H = num_heads
    if type(H) is not int:
        fail("num_heads", f"an int in {T1_HEAD_COUNTS}", type(num_heads).__name__)
    if H not in _T1_HEADS:
        fail("num_heads", f"a head count in {T1_HEAD_COUNTS}", H)
    width = 3 * H * HEAD_DIM
    if not isinstance(mixed_qkv, _Tensor):
        fail("mixed_qkv", "a torch.Tensor", type(mixed_qkv).__name__)
    shape = mixed_qkv.shape
    if len(shape) != 2 or shape[1] != width:
        fail("mixed_qkv", f"shape [B, 3*num_heads*{HEAD_DIM}] = (B, {width})", tuple(shape))
    if mixed_qkv.dtype is not _BF16:
        fail("mixed_qkv", "dtype bfloat16", mixed_qkv.dtype)
    B = shape[0]
    dev = mixed_qkv.get_device()
    if device_kind != "any":
        _device_index("mixed_qkv", mixed_qkv, device_kind)
    sm = mixed_qkv.stride()
    if sm[1] != 1 or (B > 1 and sm[0] < width):
        _packed_rows("mixed_qkv", mixed_qkv, B, width, dev)
    gate_row = H * HEAD_DIM
    if not isinstance(raw_gate, _Tensor) or raw_gate.shape != (B, gate_row) or raw_gate.get_device() != dev:
        _packed_rows("raw_gate", raw_gate, B, gate_row, dev)
    sr = raw_gate.stride()
    if sr[1] != 1 or (B > 1 and sr[0] < gate_row):
        _packed_rows("raw_gate", raw_gate, B, gate_row, dev)
    g_dtype = raw_gate.dtype
    if (not isinstance(raw_beta, _Tensor) or raw_beta.shape != (B, H)
            or ((beta_dtype := raw_beta.dtype) is not _BF16 and beta_dtype is not _F32)
            or raw_beta.get_device() != dev):
        _check("raw_beta", raw_beta, (B, H), "[B, num_heads]", _T1_PRECOMPUTED_TYPES, "bfloat16 or float32", dev)
    acc = mixed_qkv.data_ptr() | raw_gate.data_ptr()
    if B > 1:
        acc |= sm[0] * 2 | sr[0] * (4 if g_dtype is _F32 else 2)
    return _t1_tail(B, H, g_dtype, beta_dtype, state_pool, slot_indices, A_log, dt_bias, lower_bound,
                    use_gate_in_kernel, beta_is_logit, scale, output, ("raw_gate", "raw_beta"), dev, acc, True,
                    (("mixed_qkv", mixed_qkv), ("raw_gate", raw_gate), ("raw_beta", raw_beta)))


def _shape_text(t):
    return tuple(t.shape) if isinstance(t, _Tensor) else type(t).__name__


def validate_packed_tokens_decode_t1(
    mixed_qkv,
    raw_gate,
    raw_beta,
    state_pool,
    slot_indices,
    *,
    A_log=None,
    dt_bias=None,
    lower_bound=None,
    use_gate_in_kernel=True,
    beta_is_logit=True,
    scale=None,
    output=None,
    device_kind="cuda",
) -> DecodeT1Call:
    """Validate a packed T=1 decode call in the token form (vLLM Kimi K3's): mixed_qkv [B, 3*H*128] as
    :func:`validate_packed_decode_t1`'s; raw_gate [1, B, H, 128] with each token's [H, 128] compact (strides
    [*, *, 128, 1]); raw_beta [1, B, H] (any strides); output None or bf16 [1, B, H, 128] (last dim contiguous).
    H is raw_gate's dim 2. The description is :func:`validate_packed_decode_t1`'s of the [B, H*128], [B, H] and
    [B, 1, H, 128] views of the same memory (the same elements, the same facts)."""
    if not isinstance(raw_gate, _Tensor) or len(gs := raw_gate.shape) != 4 or gs[0] != 1:
        fail("raw_gate", f"a 4-D tensor [1, B, H, {HEAD_DIM}] (one token per sequence)", _shape_text(raw_gate))
    _, B, H, K = gs
    if raw_gate.stride()[2:] != (K, 1):
        fail("raw_gate", f"each token's [H, K] contiguous (strides [*, *, {K}, 1])", f"strides {raw_gate.stride()}")
    if not isinstance(raw_beta, _Tensor) or raw_beta.dim() != 3 or raw_beta.shape[0] != 1:
        fail("raw_beta", "a 3-D tensor [1, B, H]", _shape_text(raw_beta))
    if isinstance(output, _Tensor) and (output.dim() != 4 or output.shape[0] != 1):
        fail("output", f"None or a tensor [1, B, H, {HEAD_DIM}]", tuple(output.shape))
    return validate_packed_decode_t1(
        mixed_qkv, raw_gate.view(B, H * K), raw_beta[0], state_pool, slot_indices, num_heads=H, A_log=A_log,
        dt_bias=dt_bias, lower_bound=lower_bound, use_gate_in_kernel=use_gate_in_kernel, beta_is_logit=beta_is_logit,
        scale=scale, output=output.transpose(0, 1) if isinstance(output, _Tensor) else output,
        device_kind=device_kind)


# ----------------------------------------------------------------------------------------------------------------
# Re-validation of a call whose facts were described before: the launchers' hot path
#
# A serving loop repeats a few call shapes, and on the H200's host each tensor fact read from Python costs 60-175 ns:
# the full validators above read about 36 of them per T=1 call (5-7 us). The ``revalidate_*`` functions read only
#   (a) the facts of the full validator's memo key (B, H, N, the dtypes and flags that pick a kernel variant, the
#       gate scalars, the alignment bits of every pointer and stride), and
#   (b) the rules a kernel's compiled TVM-FFI wrapper cannot check: widths tied to H (the packed rows, dt_bias),
#       row strides that must not overlap (packed rows; pool rows >= one row), and the first tensor on a CUDA
#       device,
# and return the full validator's description when it has described these facts before; on a new key (or when a
# read fails: not a tensor, wrong rank) they run the full validator, which remembers the description or raises.
#
# The contract with the caller (kda-cute's T=1 launchers, the facade's T=1 path): every other rule of the full
# validator is checked in C, before launch, by the compiled wrapper the caller then calls with these tensors:
# each argument is a tensor of the variant's ndim and dtype on a CUDA device, all on one device index; static dims
# and strides hold (head dims 128, contiguous last dims, the pool's compact inner strides); dims shared between
# arguments agree (B, H, N); the aligned variant's pointers are 16-byte aligned. When the wrapper rejects an
# argument (ValueError or TypeError, raised before anything launches) the caller runs the full validator, which
# raises the KDAError naming it. kda-cute's GPU tests (test_decode_t1.py, "wrapper-checked") pass one broken
# argument of each such kind after a good call of the same facts and expect that KDAError with the pool untouched.

_REVALIDATE_MISS = (AttributeError, TypeError, IndexError, KeyError)  # a read that fails: the full validator says why
WRAPPER_REJECTED = (ValueError, TypeError)
"""What a compiled TVM-FFI wrapper raises when it rejects an argument, before anything launches: the callers of the
re-validators catch it and run the full validator."""
_LAUNCH_DEVICE_MIN = 0
"""The lowest device index the re-validators accept for the first tensor (CUDA: >= 0). Only the CPU tests (the
``on_cpu`` fixture of tests/test_validation.py) set -1, to re-validate CPU tensors as CUDA ones."""


def _t1_output_range(output, B, H, d=0):
    """(first byte, one past the last, alignment bits) of a T=1 output [B, 1, H, 128] bf16, or None when two of its
    elements share bytes (rows or heads overlapping, stride 0): the full validator then raises. H > 1 on this path.
    ``d``: the dim the B rows step along (0; 1 for the varlen form's [1, T, H, 128] tokens, B = T).
    """
    so = output.stride()
    s0, s2 = so[d], so[2]
    lo = output.data_ptr()
    if B < 2:
        if s2 < HEAD_DIM:
            return None
        return lo, lo + ((H - 1) * s2 + HEAD_DIM) * 2, lo | s2 * 2
    if not ((s2 >= HEAD_DIM and s0 >= (H - 1) * s2 + HEAD_DIM) or (s0 >= HEAD_DIM and s2 >= (B - 1) * s0 + HEAD_DIM)):
        return None
    return lo, lo + ((B - 1) * s0 + (H - 1) * s2 + HEAD_DIM) * 2, lo | (s0 | s2) * 2


def _t1_recheck_tail(B, H, state_pool, slot_indices, A_log, dt_bias, lower_bound, use_gate_in_kernel, scale, out,
                     acc):
    """(b)-rules and key facts shared by the T=1 re-validators after the activations: (N, state dtype, lower bound
    as remembered, scale, alignment bits, has output), or None when a rule the wrapper cannot check is broken (the
    full validator then raises it). ``out``: the output's :func:`_t1_output_range`, or None without an output; its
    range must miss the pool, the slot indices and the gate parameters (the activations are the caller's)."""
    ps = state_pool.shape
    if B < 1 or ps[1] != H:  # B == 0 launches nothing, so no wrapper would check the rest
        return None
    N = ps[0]
    row = H * _HEAD_ELEMS
    state_dtype = state_pool.dtype
    elem = 4 if state_dtype is _F32 else 2
    pp = state_pool.data_ptr()
    pool_bits = pp
    if N > 1:
        pst0 = state_pool.stride()[0]
        if pst0 < row:
            return None
        pool_bits |= pst0 * elem
    index_dtype = slot_indices.dtype
    if out is not None:
        lo, hi, bits = out
        acc |= bits
        if (N and pp < hi and lo < pp + ((N - 1) * pst0 + row if N > 1 else row) * elem
                or (p := slot_indices.data_ptr()) < hi
                and lo < p + ((B - 1) * slot_indices.stride()[0] + 1) * (8 if index_dtype is _I64 else 4)):
            return None
    lb = None
    has_dt_bias = False
    if use_gate_in_kernel:
        if dt_bias is not None:
            has_dt_bias = True
            ds = dt_bias.shape
            if ds != (H * HEAD_DIM,) and (ds != (H, HEAD_DIM) or not dt_bias.is_contiguous()):
                return None
            p = dt_bias.data_ptr()
            acc |= p
            if out is not None and p < hi and lo < p + H * HEAD_DIM * 4:
                return None
        if out is not None and (p := A_log.data_ptr()) < hi and lo < p + H * 4:
            return None
        if lower_bound is not None and (type(lower_bound) is not float or not -_INF < lower_bound < 0.0):
            return None
        lb = lower_bound
    if scale is None:
        scale = _DEFAULT_SCALE[HEAD_DIM]
    elif type(scale) is not float or not 0.0 < scale < _INF:
        return None
    return N, state_dtype, lb, scale, _key_bits(acc, pool_bits), out is not None, has_dt_bias, index_dtype


def _t1_activation_bits(q, k, v, g, beta, B, H, g_dtype, out, d=0):
    """Alignment bits of the T=1 activations q, k, v (bf16) and g: their pointers and the byte strides of the dims
    a row steps over (batch when B > 1, heads: H > 1 on the T=1 path); -1 when one of them, or beta, shares a byte
    with the output (``out``: its :func:`_t1_output_range`, or None). ``d``: the rows' dim, as there."""
    sq, sk, sv, sg = q.stride(), k.stride(), v.stride(), g.stride()
    if d:  # the varlen form: rows are tokens (dim 1); dim 0 has size 1 and is never stepped over
        sq, sk, sv, sg = (sq[1], 0, sq[2]), (sk[1], 0, sk[2]), (sv[1], 0, sv[2]), (sg[1], 0, sg[2])
    pq, pk, pv, pg = q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr()
    g_elem = 4 if g_dtype is _F32 else 2
    if out is not None:
        lo, hi, _ = out
        r, h = B - 1, H - 1
        if (pq < hi and lo < pq + (r * sq[0] + h * sq[2] + HEAD_DIM) * 2
                or pk < hi and lo < pk + (r * sk[0] + h * sk[2] + HEAD_DIM) * 2
                or pv < hi and lo < pv + (r * sv[0] + h * sv[2] + HEAD_DIM) * 2
                or pg < hi and lo < pg + (r * sg[0] + h * sg[2] + HEAD_DIM) * g_elem
                or (pb := beta.data_ptr()) < hi
                and lo < pb + (r * (sb := beta.stride())[d] + h * sb[2] + 1) * (4 if beta.dtype is _F32 else 2)):
            return -1
    bf16_steps = ((sq[0] | sk[0] | sv[0]) if B > 1 else 0) | sq[2] | sk[2] | sv[2]
    g_steps = (sg[0] if B > 1 else 0) | sg[2]
    return pq | pk | pv | pg | bf16_steps * 2 | g_steps * g_elem


def _t1_remembered(B, H, g_dtype, beta_dtype, is_packed, state_pool, slot_indices, A_log, dt_bias, lower_bound,
                   use_gate_in_kernel, beta_is_logit, scale, out, acc):
    """The T=1 validators' remembered description of these facts (their memo key, spelled as ``_t1_tail`` spells
    it), or None: a new key, or a rule of :func:`_t1_recheck_tail` broken."""
    tail = _t1_recheck_tail(B, H, state_pool, slot_indices, A_log, dt_bias, lower_bound, use_gate_in_kernel, scale,
                            out, acc)
    if tail is None:
        return None
    N, state_dtype, lb, sc, bits, has_output, has_dt_bias, index_dtype = tail
    return _MEMO.get(("t1", B, H, N, state_dtype, g_dtype, beta_dtype, use_gate_in_kernel, lb, beta_is_logit, sc, bits,
                      is_packed, has_output, has_dt_bias, index_dtype))


def revalidate_decode_t1(q, k, v, g, beta, state_pool, slot_indices, A_log, dt_bias, lower_bound, use_gate_in_kernel,
                         beta_is_logit, scale, output) -> DecodeT1Call:
    """:func:`validate_decode_t1` (device_kind "cuda") for a launcher whose compiled wrapper checks the rest; see the
    contract above. Positional arguments, in the entry's order."""
    try:
        if ((use_gate_in_kernel is True or use_gate_in_kernel is False)
                and (beta_is_logit is True or beta_is_logit is False) and q.get_device() >= _LAUNCH_DEVICE_MIN):
            shape = q.shape
            B, H = shape[0], shape[2]
            g_dtype = g.dtype
            out = None if output is None else _t1_output_range(output, B, H)
            if output is None or out is not None:
                acc = _t1_activation_bits(q, k, v, g, beta, B, H, g_dtype, out)
                if acc >= 0:
                    call = _t1_remembered(B, H, g_dtype, beta.dtype, False, state_pool, slot_indices, A_log, dt_bias,
                                          lower_bound, use_gate_in_kernel, beta_is_logit, scale, out, acc)
                    if call is not None:
                        return call
    except _REVALIDATE_MISS:
        pass
    return validate_decode_t1(q, k, v, g, beta, state_pool, slot_indices, A_log=A_log, dt_bias=dt_bias,
                              lower_bound=lower_bound, use_gate_in_kernel=use_gate_in_kernel,
                              beta_is_logit=beta_is_logit, scale=scale, output=output)


def revalidate_packed_decode_t1(mixed_qkv, raw_gate, raw_beta, state_pool, slot_indices, num_heads, A_log, dt_bias,
                                lower_bound, use_gate_in_kernel, beta_is_logit, scale, output) -> DecodeT1Call:
    """:func:`validate_packed_decode_t1` (device_kind "cuda") for a launcher whose compiled wrapper checks the rest;
    see the contract above. Positional arguments, in the entry's order."""
    H = num_heads
    try:
        if (type(H) is int and H in _T1_HEADS and (use_gate_in_kernel is True or use_gate_in_kernel is False)
                and (beta_is_logit is True or beta_is_logit is False) and mixed_qkv.get_device() >= _LAUNCH_DEVICE_MIN):
            row = H * HEAD_DIM
            shape = mixed_qkv.shape
            B = shape[0]
            sm, sr = mixed_qkv.stride(), raw_gate.stride()
            if shape[1] == 3 * row and raw_gate.shape[1] == row and (B < 2 or (sm[0] >= 3 * row and sr[0] >= row)):
                g_dtype = raw_gate.dtype
                pm, pr = mixed_qkv.data_ptr(), raw_gate.data_ptr()
                acc = pm | pr
                if B > 1:
                    acc |= sm[0] * 2 | sr[0] * (4 if g_dtype is _F32 else 2)
                out = None
                if output is not None:
                    out = _t1_output_range(output, B, H)
                    if out is None:
                        raise KeyError  # overlapping output rows: the full validator says so
                    lo, hi, _ = out
                    r = B - 1
                    if (pm < hi and lo < pm + (r * sm[0] + 3 * row) * 2
                            or pr < hi and lo < pr + (r * sr[0] + row) * (4 if g_dtype is _F32 else 2)
                            or (pb := raw_beta.data_ptr()) < hi
                            and lo < pb + (r * (sb := raw_beta.stride())[0] + (H - 1) * sb[1] + 1)
                            * (4 if raw_beta.dtype is _F32 else 2)):
                        raise KeyError
                call = _t1_remembered(B, H, g_dtype, raw_beta.dtype, True, state_pool, slot_indices, A_log, dt_bias,
                                      lower_bound, use_gate_in_kernel, beta_is_logit, scale, out, acc)
                if call is not None:
                    return call
    except _REVALIDATE_MISS:
        pass
    return validate_packed_decode_t1(mixed_qkv, raw_gate, raw_beta, state_pool, slot_indices, num_heads=num_heads,
                                     A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                                     use_gate_in_kernel=use_gate_in_kernel, beta_is_logit=beta_is_logit, scale=scale,
                                     output=output)


def revalidate_packed_tokens_decode_t1(mixed_qkv, raw_gate, raw_beta, state_pool, slot_indices, A_log, dt_bias,
                                       lower_bound, use_gate_in_kernel, beta_is_logit, scale, output) -> DecodeT1Call:
    """:func:`validate_packed_tokens_decode_t1` (device_kind "cuda") for a launcher whose compiled wrapper checks the
    rest (ranks, dtypes, static dims and strides: the tokens' dim 0 of size 1, the head dims 128, each token's
    [H, 128] compact; the sizes shared between arguments); see the contract above. Rows are tokens, stepped along
    dim 1 of raw_gate, raw_beta and output. Positional arguments, in the entry's order."""
    try:
        if ((use_gate_in_kernel is True or use_gate_in_kernel is False)
                and (beta_is_logit is True or beta_is_logit is False) and mixed_qkv.get_device() >= _LAUNCH_DEVICE_MIN):
            _, B, H, _ = raw_gate.shape
            if raw_beta.dim() != 3:  # else the output-overlap test below may skip raw_beta's strides, by address
                raise KeyError
            row = H * HEAD_DIM
            shape = mixed_qkv.shape
            sm, sr = mixed_qkv.stride(), raw_gate.stride()
            if H in _T1_HEADS and shape[1] == 3 * row and (B < 2 or (sm[0] >= 3 * row and sr[1] >= row)):
                g_dtype = raw_gate.dtype
                pm, pr = mixed_qkv.data_ptr(), raw_gate.data_ptr()
                acc = pm | pr
                if B > 1:
                    acc |= sm[0] * 2 | sr[1] * (4 if g_dtype is _F32 else 2)
                out = None
                if output is not None:
                    out = _t1_output_range(output, B, H, 1)
                    if out is None:
                        raise KeyError  # overlapping output tokens: the full validator says so
                    lo, hi, _ = out
                    r = B - 1
                    if (pm < hi and lo < pm + (r * sm[0] + 3 * row) * 2
                            or pr < hi and lo < pr + (r * sr[1] + row) * (4 if g_dtype is _F32 else 2)
                            or (pb := raw_beta.data_ptr()) < hi
                            and lo < pb + (r * (sb := raw_beta.stride())[1] + (H - 1) * sb[2] + 1)
                            * (4 if raw_beta.dtype is _F32 else 2)):
                        raise KeyError
                call = _t1_remembered(B, H, g_dtype, raw_beta.dtype, True, state_pool, slot_indices, A_log, dt_bias,
                                      lower_bound, use_gate_in_kernel, beta_is_logit, scale, out, acc)
                if call is not None:
                    return call
    except _REVALIDATE_MISS + (ValueError,):  # ValueError: raw_gate is not 4-D
        pass
    return validate_packed_tokens_decode_t1(mixed_qkv, raw_gate, raw_beta, state_pool, slot_indices, A_log=A_log,
                                            dt_bias=dt_bias, lower_bound=lower_bound,
                                            use_gate_in_kernel=use_gate_in_kernel, beta_is_logit=beta_is_logit,
                                            scale=scale, output=output)


# ----------------------------------------------------------------------------------------------------------------
# Multi-token recurrence (the facade's contract)


def validate_recurrent(args: RecurrentArgs, *, device_kind="any") -> RecurrentCall:
    """Validate a ``recurrent_kda`` call, given as its :class:`kda_core.call_args.RecurrentArgs`, and decide T=1
    eligibility.

    q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV]; K == V in ``GENERIC_HEAD_DIMS``;
    HV % H == 0; q, k, v one dtype of bf16/fp16/fp32, g and beta any of those; last dims contiguous.
    ``cu_seqlens`` int32/int64 1-D [N_seq + 1] requires B == 1 (its values are not read).
    Modes: ``ssm_state_indices`` None -> "dense" (``initial_state`` None or [N_seq, HV, V, K]);
    1-D [N_seq] -> "pool"; 2-D [N_seq, T] ([N_seq, >= 1] with cu_seqlens: the max tokens) -> "spec", where
    ``num_accepted_tokens`` [N_seq] is optional (and only allowed there); indices and counts int32 or int64, any
    strides. In pool and spec modes ``initial_state`` is the pool [N, HV, V, K], bf16 or fp32, K contiguous, inner
    dims compact, dim-0 stride any number of elements >= HV*V*K (one that is not a 16-byte multiple makes the call
    unaligned). ``output`` bf16 [B, T, HV, V]. ``device_kind``: "any" (default; the facade runs
    CPU calls on the oracle) or "cuda".
    """
    if type(args) is not RecurrentArgs:
        fail("args", "a kda_core.call_args.RecurrentArgs (the call's arguments, bundled)", type(args).__name__)
    (q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
     use_gate_in_kernel, lower_bound, beta_is_logit, cu_seqlens, ssm_state_indices, num_accepted_tokens, output) = args
    if not isinstance(q, _Tensor):
        fail("q", "a torch.Tensor", type(q).__name__)
    shape = q.shape
    if len(shape) != 4:
        fail("q", "a 4-D tensor [B, T, H, K]", tuple(shape))
    B, T, H, K = shape
    if K not in GENERIC_HEAD_DIMS:
        fail("q", f"a head dim K (dim 3) in {GENERIC_HEAD_DIMS}", K)
    act = q.dtype
    if act not in _ACT_DTYPES:
        fail("q", "dtype bfloat16, float16 or float32", act)
    dev = q.get_device()
    if device_kind != "any":
        _device_index("q", q, device_kind)
    sq = q.stride()
    if sq[3] != 1:
        _act("q", q, shape, "[B, T, H, K]", _ACT_DTYPES, "bfloat16, float16 or float32", dev)
    if not isinstance(k, _Tensor) or k.shape != shape or k.dtype is not act or k.get_device() != dev:
        _act("k", k, shape, "[B, T, H, K] (the shape of q)", (act,), f"{act} (the dtype of q)", dev)
    sk = k.stride()
    if sk[3] != 1:
        _act("k", k, shape, "[B, T, H, K] (the shape of q)", (act,), f"{act} (the dtype of q)", dev)
    if not isinstance(v, _Tensor):
        fail("v", "a torch.Tensor", type(v).__name__)
    vs = v.shape
    if len(vs) != 4 or vs[0] != B or vs[1] != T or vs[3] != K:
        fail("v", f"shape [B, T, HV, V] with B, T, V = {B}, {T}, {K} (V == K)", tuple(vs))
    HV = vs[2]
    if H < 1:
        fail("q", "a query-head count H (dim 2) >= 1", H)
    if HV < 1 or HV % H:
        fail("v", f"a value-head count HV (dim 2) >= 1 and divisible by the query-head count H = {H}", HV)
    sv = v.stride()
    if v.dtype is not act or v.get_device() != dev or sv[3] != 1:
        _act("v", v, vs, "[B, T, HV, V]", (act,), f"{act} (the dtype of q)", dev)
    if (not isinstance(g, _Tensor) or g.shape != vs or (g_dtype := g.dtype) not in _ACT_DTYPES
            or g.get_device() != dev):
        _act("g", g, vs, "[B, T, HV, K]", _ACT_DTYPES, "bfloat16, float16 or float32", dev)
    sg = g.stride()
    if sg[3] != 1:
        _act("g", g, vs, "[B, T, HV, K]", _ACT_DTYPES, "bfloat16, float16 or float32", dev)
    if (not isinstance(beta, _Tensor) or beta.shape != (B, T, HV) or (beta_dtype := beta.dtype) not in _ACT_DTYPES
            or beta.get_device() != dev):
        _check("beta", beta, (B, T, HV), "[B, T, HV]", _ACT_DTYPES, "bfloat16, float16 or float32", dev)
    if output_final_state is not True and output_final_state is not False:
        _check_flag("output_final_state", output_final_state)
    if use_qk_l2norm_in_kernel is not True and use_qk_l2norm_in_kernel is not False:
        _check_flag("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    if use_gate_in_kernel is not True and use_gate_in_kernel is not False:
        _check_flag("use_gate_in_kernel", use_gate_in_kernel)
    if beta_is_logit is not True and beta_is_logit is not False:
        _check_flag("beta_is_logit", beta_is_logit)
    # Alignment bits (see validate_decode_t1): pointers and the byte strides of every stepped dim.
    qkv_steps = (((sq[0] | sk[0] | sv[0]) if B > 1 else 0) | ((sq[1] | sk[1] | sv[1]) if T > 1 else 0)
                 | ((sq[2] | sk[2]) if H > 1 else 0) | (sv[2] if HV > 1 else 0))
    g_steps = (sg[0] if B > 1 else 0) | (sg[1] if T > 1 else 0) | (sg[2] if HV > 1 else 0)
    acc = (q.data_ptr() | k.data_ptr() | v.data_ptr() | g.data_ptr() | qkv_steps * _ELEM_BYTES[act]
           | g_steps * _ELEM_BYTES[g_dtype])

    varlen = cu_seqlens is not None
    if varlen:
        if not isinstance(cu_seqlens, _Tensor):
            fail("cu_seqlens", "a torch.Tensor", type(cu_seqlens).__name__)
        if len(cu_seqlens.shape) != 1 or cu_seqlens.shape[0] < 1:
            fail("cu_seqlens", "a 1-D tensor [N_seq + 1] of sequence offsets", tuple(cu_seqlens.shape))
        if cu_seqlens.dtype is not _I32 and cu_seqlens.dtype is not _I64:
            fail("cu_seqlens", "dtype int32 or int64", cu_seqlens.dtype)
        if cu_seqlens.get_device() != dev:
            _fail_device("cu_seqlens", cu_seqlens, dev)
        if B != 1:
            fail("q", "batch size B == 1 when cu_seqlens is given (sequences concatenated along T)", f"B={B}")
        N_seq = cu_seqlens.shape[0] - 1
    else:
        N_seq = B

    mode = "dense"
    N = None
    state_dtype = index_dtype = None
    pool_bits = 0
    idx = ssm_state_indices
    if idx is not None:
        if not isinstance(idx, _Tensor):
            fail("ssm_state_indices", "a torch.Tensor", type(idx).__name__)
        index_dtype = idx.dtype
        if index_dtype is not _I32 and index_dtype is not _I64:
            fail("ssm_state_indices", "dtype int32 or int64", index_dtype)
        if idx.get_device() != dev:
            _fail_device("ssm_state_indices", idx, dev)
        ishape = idx.shape
        if len(ishape) == 1:  # any stride: the kernels read a column of a wider table as it is
            mode = "pool"
            if ishape[0] != N_seq:
                _slots("ssm_state_indices", idx, N_seq, "[N_seq] (one slot per sequence)", dev)
        elif len(ishape) == 2:  # any strides (the generic kernel reads both)
            mode = "spec"
            cols_ok = ishape[1] >= 1 if varlen else ishape[1] == T
            if ishape[0] != N_seq or not cols_ok:
                want = f"[N_seq, max tokens] = ({N_seq}, >= 1)" if varlen else f"[N_seq, T] = {(N_seq, T)}"
                fail("ssm_state_indices", f"2-D shape {want} (one write slot per token)", tuple(ishape))
        else:
            fail("ssm_state_indices", "a 1-D [N_seq] or 2-D [N_seq, T] tensor", tuple(ishape))
        pool = initial_state
        if pool is None:
            fail("initial_state", "the state pool [N, HV, V, K] when ssm_state_indices is given", None)
        if not isinstance(pool, _Tensor):
            _rows("initial_state", pool, (HV, K, K), _POOL_DTYPES, "bfloat16 or float32 (a pool)", "[N, HV, V, K]",
                  dev)
        ps = pool.shape
        pst = pool.stride()
        state_dtype = pool.dtype
        if (len(ps) != 4 or ps[1] != HV or ps[2] != K or ps[3] != K
                or (state_dtype is not _BF16 and state_dtype is not _F32) or pool.get_device() != dev
                or pst[1] != K * K or pst[2] != K or pst[3] != 1
                or (ps[0] > 1 and pst[0] < HV * K * K)):
            _rows("initial_state", pool, (HV, K, K), _POOL_DTYPES, "bfloat16 or float32 (a pool)", "[N, HV, V, K]",
                  dev)
        N = ps[0]
        pool_bits = pool.data_ptr()  # kept apart from acc, as in the T=1 validators (others_aligned)
        if N > 1:  # the row stride in bytes (a padded pool whose stride is not a 16-byte multiple: unaligned)
            pool_bits |= pst[0] * (4 if state_dtype is _F32 else 2)
    elif initial_state is not None:
        _check("initial_state", initial_state, (N_seq, HV, K, K), "[N_seq, HV, V, K]", _ACT_DTYPES,
               "bfloat16, float16 or float32", dev)
        state_dtype = initial_state.dtype
    if num_accepted_tokens is not None:
        if mode != "spec":
            fail("num_accepted_tokens", "None unless ssm_state_indices is 2-D [N_seq, T] (spec decode)",
                 "a tensor")
        _slots("num_accepted_tokens", num_accepted_tokens, N_seq, "[N_seq]", dev)

    dt_bias_ptr, lb, scale = _gate_and_scale(use_gate_in_kernel, A_log, dt_bias, lower_bound, scale, H, K, dev)
    acc |= dt_bias_ptr
    if output is not None:
        so = output.stride() if isinstance(output, _Tensor) else None
        if (so is None or output.shape != vs or output.dtype is not _BF16 or output.get_device() != dev
                or so[3] != 1):
            _act("output", output, vs, "[B, T, HV, V]", _BF16_ONLY, "bfloat16", dev)
        acc |= output.data_ptr() | (((so[0] if B > 1 else 0) | (so[1] if T > 1 else 0)
                                     | (so[2] if HV > 1 else 0)) * 2)
    others = (("k", k), ("v", v), ("g", g), ("beta", beta), ("cu_seqlens", cu_seqlens),
              ("ssm_state_indices", ssm_state_indices), ("initial_state", initial_state),
              ("num_accepted_tokens", num_accepted_tokens))
    if use_gate_in_kernel:
        others += (("A_log", A_log), ("dt_bias", dt_bias))
    if dev < 0:
        _check_host_kind("q", q, others + (("output", output),))
    if output is not None:
        _check_written("output", output, (("q", q),) + others)
    on_cuda = dev >= 0
    has_dt_bias = use_gate_in_kernel and dt_bias is not None
    key = ("recurrent", mode, B, T, N_seq, H, HV, K, N, varlen, use_gate_in_kernel, lb, beta_is_logit,
           use_qk_l2norm_in_kernel, output_final_state, state_dtype, act, g_dtype, beta_dtype, scale,
           _key_bits(acc, pool_bits), has_dt_bias, index_dtype, on_cuda)
    call = _MEMO.get(key)
    if call is None:
        alignment = _pow2_alignment(acc | pool_bits)
        aligned = alignment >= VECTOR_BYTES
        gmode = gate_mode(use_gate_in_kernel, lower_bound)
        reason = _t1_reason(T, varlen, mode, H, HV, K, act, g_dtype, beta_dtype, gmode, use_qk_l2norm_in_kernel,
                            on_cuda)
        call = _remember(key, RecurrentCall(
            mode=mode, B=B, T=T, N_seq=N_seq, H=H, HV=HV, K=K, V=K, N=N, varlen=varlen, gate_mode=gmode,
            lower_bound=None if lb is None else float(lb), beta_is_logit=beta_is_logit,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, output_final_state=output_final_state,
            state_dtype=state_dtype, act_dtype=act, scale=scale,
            aligned=aligned, alignment=alignment, on_cuda=on_cuda, t1_eligible=reason is None,
            t1_reason=reason or (_T1_VARLEN_OK if varlen else _T1_OK)[aligned], has_dt_bias=has_dt_bias,
            index_dtype=index_dtype, others_aligned=_pow2_alignment(acc) >= VECTOR_BYTES,
        ))
    return call


def revalidate_recurrent_t1(args: tuple) -> RecurrentCall | None:
    """The remembered :func:`validate_recurrent` description of a T=1-eligible CUDA call whose facts it described
    before, read as the T=1 re-validators do (see the contract above them), or None: then the caller runs the full
    validator. Only for a caller that launches the T=1 kernel on the result; any other route needs the full one.

    ``args``: the call's arguments in :class:`kda_core.call_args.RecurrentArgs` order, that NamedTuple or a plain
    tuple (the facade's hot path passes the plain one, ~0.2 us cheaper to build); unpacked once, not read by field.
    """
    try:
        (q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
         use_gate_in_kernel, lower_bound, beta_is_logit, cu_seqlens, ssm_state_indices, num_accepted_tokens,
         output) = args
        if (cu_seqlens is None and num_accepted_tokens is None and output_final_state is False
                and ssm_state_indices is not None and initial_state is not None
                and (use_qk_l2norm_in_kernel is True or use_qk_l2norm_in_kernel is False)
                and (use_gate_in_kernel is True or use_gate_in_kernel is False)
                and (beta_is_logit is True or beta_is_logit is False) and q.get_device() >= _LAUNCH_DEVICE_MIN):
            B, T, H, K = q.shape
            g_dtype = g.dtype
            # The bits as the T=1 path has them (T == 1, H == HV, bf16 q/k/v): only such a description is returned.
            out = None if output is None else _t1_output_range(output, B, H)
            acc = -1 if output is not None and out is None else _t1_activation_bits(q, k, v, g, beta, B, H, g_dtype,
                                                                                    out)
            tail = None if acc < 0 else _t1_recheck_tail(B, H, initial_state, ssm_state_indices, A_log, dt_bias,
                                                         lower_bound, use_gate_in_kernel, scale, out, acc)
            if tail is not None:
                N, state_dtype, lb, sc, bits, _, has_dt_bias, index_dtype = tail
                call = _MEMO.get(("recurrent", "pool", B, T, B, H, H, K, N, False, use_gate_in_kernel, lb,
                                  beta_is_logit, use_qk_l2norm_in_kernel, False, state_dtype, q.dtype, g_dtype,
                                  beta.dtype, sc, bits, has_dt_bias, index_dtype, True))
                if call is not None and call.t1_eligible:
                    return call
    except _REVALIDATE_MISS + (ValueError,):  # ValueError: q is not 4-D, or args not 18 long
        pass
    return None


def revalidate_recurrent_t1_varlen(args: tuple) -> RecurrentCall | None:
    """:func:`revalidate_recurrent_t1` for the varlen decode form: ``[1, T, H, 128]`` tokens + ``cu_seqlens``
    [S + 1] with 1-D ``ssm_state_indices`` [S] (the T=1 kernel's varlen entry, ``decode_t1._run_varlen``, whose
    compiled wrapper checks ranks, dtypes, static dims and the sizes shared between its arguments). Returns the
    remembered T=1-eligible CUDA description of these facts, or None: then the caller runs the full validator.

    Read here besides the T=1 facts (rows are tokens, stepped along dim 1): the token count T >= 1 and the sequence
    count S >= 1 (with none of either nothing launches, so no wrapper would check the rest), ``cu_seqlens`` one
    longer than the indices and of an index dtype (sizes the wrapper takes independently), and that the output
    shares no byte with ``cu_seqlens``. The offsets' values are device data, never read here.
    """
    try:
        (q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
         use_gate_in_kernel, lower_bound, beta_is_logit, cu_seqlens, ssm_state_indices, num_accepted_tokens,
         output) = args
        if (num_accepted_tokens is None and output_final_state is False and cu_seqlens is not None
                and ssm_state_indices is not None and initial_state is not None
                and (use_qk_l2norm_in_kernel is True or use_qk_l2norm_in_kernel is False)
                and (use_gate_in_kernel is True or use_gate_in_kernel is False)
                and (beta_is_logit is True or beta_is_logit is False) and q.get_device() >= _LAUNCH_DEVICE_MIN):
            B, T, H, K = q.shape
            S = ssm_state_indices.shape[0]
            cu_dtype = cu_seqlens.dtype
            if T < 1 or cu_seqlens.shape[0] != S + 1 or (cu_dtype is not _I32 and cu_dtype is not _I64):
                return None
            g_dtype = g.dtype
            out = None if output is None else _t1_output_range(output, T, H, 1)
            acc = -1 if output is not None and out is None else _t1_activation_bits(q, k, v, g, beta, T, H, g_dtype,
                                                                                    out, 1)
            tail = None if acc < 0 else _t1_recheck_tail(S, H, initial_state, ssm_state_indices, A_log, dt_bias,
                                                         lower_bound, use_gate_in_kernel, scale, out, acc)
            if tail is not None:
                if out is not None:
                    lo, hi, _ = out
                    if (p := cu_seqlens.data_ptr()) < hi and lo < p + (S * cu_seqlens.stride()[0] + 1) * (
                            8 if cu_dtype is _I64 else 4):
                        return None
                N, state_dtype, lb, sc, bits, _, has_dt_bias, index_dtype = tail
                call = _MEMO.get(("recurrent", "pool", B, T, S, H, H, K, N, True, use_gate_in_kernel, lb,
                                  beta_is_logit, use_qk_l2norm_in_kernel, False, state_dtype, q.dtype, g_dtype,
                                  beta.dtype, sc, bits, has_dt_bias, index_dtype, True))
                if call is not None and call.t1_eligible:
                    return call
    except _REVALIDATE_MISS + (ValueError,):  # ValueError: q is not 4-D, or args not 18 long
        pass
    return None


_T1_VARLEN_OK = {
    aligned: "eligible (varlen entry): [1, T, H, 128] tokens + cu_seqlens, pool with 1-D slot indices, H == HV in "
    "T1_HEAD_COUNTS, K = V = 128, bf16" + ("" if aligned else "; misaligned tensors take the unaligned variant")
    + "; the offsets are device data, read and bounded in the kernel, never on the host (a one-token sequence "
    "takes the T=1 step, any other length the kernel's exact token loop)"
    for aligned in (True, False)
}
_T1_OK = {
    True: "eligible: T=1, pool with 1-D slot indices, H == HV in T1_HEAD_COUNTS, K = V = 128, bf16, aligned",
    False: "eligible: T=1, pool with 1-D slot indices, H == HV in T1_HEAD_COUNTS, K = V = 128, bf16; misaligned "
    "tensors take the unaligned variant",
}


def _t1_reason(T, varlen, mode, H, HV, K, act, g_dtype, beta_dtype, gmode, l2norm, on_cuda):
    """Why the T=1 kernel cannot take the call, or None when it can (mirrors :func:`validate_decode_t1`). With
    ``cu_seqlens`` (B == 1 then) the T tokens are the sequences' concatenation: its varlen entry takes them."""
    if T != 1 and not varlen:
        return f"not eligible: T={T} tokens per sequence (the T=1 kernel takes one, or [1, T] with cu_seqlens)"
    if mode == "dense":
        return "not eligible: no ssm_state_indices (the T=1 kernel updates a state pool in place by slot)"
    if mode == "spec":
        return "not eligible: 2-D ssm_state_indices (spec-decode checkpoints go to the generic kernel)"
    if H != HV:
        return f"not eligible: GQA H={H}, HV={HV} (the T=1 kernel needs H == HV)"
    if H not in T1_HEAD_COUNTS:
        return f"not eligible: H={H} is not one of the T=1 head counts {T1_HEAD_COUNTS}"
    if K != HEAD_DIM:
        return f"not eligible: head dim {K} (the T=1 kernel is built for {HEAD_DIM})"
    if act is not _BF16:
        return f"not eligible: q, k, v in {act} (the T=1 kernel takes bfloat16)"
    types = _T1_PRECOMPUTED_TYPES if gmode is GateMode.PRECOMPUTED else _BF16_ONLY
    if g_dtype not in types:
        return f"not eligible: g in {g_dtype} (bfloat16, or float32 only with use_gate_in_kernel=False)"
    if beta_dtype not in types:
        return f"not eligible: beta in {beta_dtype} (bfloat16, or float32 only with use_gate_in_kernel=False)"
    if not l2norm:
        # kda-cute compiles a variant without the norm, but only the normalised one is tested against the oracle
        # on the GPU; widen this rule once the other is.
        return "not eligible: use_qk_l2norm_in_kernel=False (the T=1 kernel is validated with the in-kernel norm)"
    if not on_cuda:
        return "not eligible: tensors not on a CUDA device (the oracle runs the call)"
    return None


# ----------------------------------------------------------------------------------------------------------------
# ucache verify + flush


def validate_ucache(
    A_log,
    g,
    dt_bias,
    lower_bound=-5.0,
    *,
    q,
    k,
    v,
    b,
    initial_state_source,
    initial_state_indices,
    k_cache,
    u_cache,
    g_cache,
    hist_len,
    cache_base,
    flush_min=None,
    restart_hist_on_flush=True,
    w_ring=None,
    scale=None,
    output=None,
    device_kind="cuda",
) -> UcacheCall:
    """Validate a ucache verify(+flush) call (docs/design.md §5; the signature of ``kda_delta_rule_mtp_ucache_flush``).

    q, k, v, g [B, T, H, 128] bf16 with T in {4, 8} and H == HV in ``T1_HEAD_COUNTS``; b [B, T, H] bf16 beta
    logits; A_log fp32 [H]; dt_bias fp32 [H*128] or [H, 128] or None (zeros); lower_bound < 0 (None: the softplus
    gate).
    initial_state_source: bf16 pool [N, H, 128, 128]; k_cache, u_cache bf16 and g_cache fp32 rings
    [N, H, 32, 128]; inner dims compact, row stride any number of elements >= the row (one that is not a 16-byte
    multiple takes the unaligned variant). initial_state_indices int32 or int64 [B], any stride; hist_len,
    cache_base int32 [B] contiguous. w_ring: the argument or ``KDA_UCACHE_WRING``, in {16, 32}. flush_min: default
    ``default_flush_min(T, w_ring)``; 1 <= flush_min <= ``max_flush_min(T, w_ring)``, and > 16 when w_ring == 32.
    """
    if not isinstance(q, _Tensor):
        fail("q", "a torch.Tensor", type(q).__name__)
    shape = q.shape
    if len(shape) != 4 or shape[3] != HEAD_DIM:
        fail("q", f"shape [B, T, H, {HEAD_DIM}]", tuple(shape))
    B, T, H, _ = shape
    if T not in UCACHE_T:
        fail("q", f"T in {UCACHE_T} draft tokens (dim 1)", f"T={T}")
    if H not in T1_HEAD_COUNTS:
        fail("q", f"a head count H (dim 2) in {T1_HEAD_COUNTS}", H)
    dev = _device_index("q", q, device_kind)
    text = "[B, T, H, 128]"
    acc = _act("q", q, shape, text, _BF16_ONLY, "bfloat16", dev)
    acc |= _act("k", k, shape, text, _BF16_ONLY, "bfloat16", dev)
    acc |= _act("v", v, shape, text, _BF16_ONLY, "bfloat16", dev)
    acc |= _act("g", g, shape, text, _BF16_ONLY, "bfloat16", dev)
    _check("b", b, (B, T, H), "[B, T, H]", _BF16_ONLY, "bfloat16", dev)
    acc |= _check_gate_params(A_log, dt_bias, H, HEAD_DIM, True, dev)
    scale = _check_scalar_args(lower_bound, scale, HEAD_DIM, True)
    pool = initial_state_source
    N = _rows("initial_state_source", pool, (H, HEAD_DIM, HEAD_DIM), _BF16_ONLY, "bfloat16", "[N, H, V, K]", dev)
    acc |= _row_bits(pool)
    ring = (N, H, RING_SLOTS, HEAD_DIM)
    for name, t, dtypes, dtype_text in (("k_cache", k_cache, _BF16_ONLY, "bfloat16"),
                                        ("u_cache", u_cache, _BF16_ONLY, "bfloat16"),
                                        ("g_cache", g_cache, _F32_ONLY, "float32")):
        _check(name, t, ring, "[N, H, 32, 128] (N = pool rows)", dtypes, dtype_text, dev)
        _rows(name, t, ring[1:], dtypes, dtype_text, "[N, H, 32, 128]", dev)
        acc |= _row_bits(t)
    _slots("initial_state_indices", initial_state_indices, B, "[B]", dev)
    _index("hist_len", hist_len, B, "[B]", dev)
    _index("cache_base", cache_base, B, "[B]", dev)
    # What the step writes (pool, rings, cursors) must not alias anything else it touches; each of these is
    # compared with the ones before it and named when it is the later one.
    state = (("initial_state_source", pool), ("initial_state_indices", initial_state_indices),
             ("k_cache", k_cache), ("u_cache", u_cache), ("g_cache", g_cache), ("hist_len", hist_len),
             ("cache_base", cache_base))
    _check_pairwise_disjoint(state)
    if w_ring is None:
        w_ring = knobs.get("KDA_UCACHE_WRING")
    elif type(w_ring) is not int or w_ring not in UCACHE_WRING:
        fail("w_ring", f"one of {UCACHE_WRING} (or None: KDA_UCACHE_WRING)", repr(w_ring))
    top = max_flush_min(T, w_ring)
    if flush_min is None:
        flush_min = default_flush_min(T, w_ring)
    elif type(flush_min) is not int:
        fail("flush_min", "an int or None", type(flush_min).__name__)
    low = 17 if w_ring == 32 else 1
    if not low <= flush_min <= top:
        rule = "> 16 (w_ring 32)" if w_ring == 32 else ">= 1"
        fail("flush_min", f"{rule} and <= min(w_ring - T + 1, 33 - 2T) = {top} (T={T}, w_ring={w_ring})", flush_min)
    _check_flag("restart_hist_on_flush", restart_hist_on_flush)
    inputs = (("k", k), ("v", v), ("g", g), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias))
    if dev < 0:
        _check_host_kind("q", q, inputs + state + (("output", output),))
    if output is not None:
        acc |= _act("output", output, shape, text, _BF16_ONLY, "bfloat16", dev)
        _check_written("output", output, (("q", q),) + inputs + state)
    alignment = _pow2_alignment(acc)
    key = ("ucache", B, T, H, N, w_ring, flush_min, lower_bound, scale, restart_hist_on_flush, alignment,
           output is not None, initial_state_indices.dtype)
    call = _MEMO.get(key)
    if call is None:
        call = _remember(key, UcacheCall(
            B=B, T=T, H=H, head_dim=HEAD_DIM, N=N, w_ring=w_ring, flush_min=flush_min,
            max_hist_len=max_hist_len(T, w_ring), gate_mode=gate_mode(True, lower_bound),
            lower_bound=None if lower_bound is None else float(lower_bound), scale=scale,
            restart_hist_on_flush=restart_hist_on_flush, aligned=alignment >= VECTOR_BYTES, alignment=alignment,
            has_output=output is not None, index_dtype=initial_state_indices.dtype,
        ))
    return call


# ----------------------------------------------------------------------------------------------------------------
# Debug value checks (these synchronise; never in the hot path)


def debug_checks_enabled() -> bool:
    """``KDA_DEBUG_VALIDATE`` is on and no CUDA graph is being captured on the current stream."""
    if not knobs.get("KDA_DEBUG_VALIDATE"):
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def debug_check_slots(slot_indices: torch.Tensor, N: int, *, argument: str = "slot_indices",
                      null_policy=NullSlotPolicy.OUT_OF_RANGE) -> None:
    """Raise when two active entries of ``slot_indices`` name the same pool slot.

    1-D indices [B] (one slot per row) and 2-D indices [B, T] (spec decode: one checkpoint slot per token) are
    flattened, so a slot two rows share and a slot one row names for two of its checkpoints both count; null
    entries are inactive and never count: under ``null_policy`` ``OUT_OF_RANGE`` those outside [0, N), under
    ``NONPOSITIVE`` (vLLM's padding slot 0) those <= 0 or >= N, so slot 0 may repeat. Two writers of one slot
    race on the device and corrupt a request's state (docs/design.md §4). Reads values: syncs (run it only where
    :func:`debug_checks_enabled`).
    """
    first = first_live_slot(null_policy_of(null_policy))
    if not isinstance(slot_indices, _Tensor):
        fail(argument, "a torch.Tensor of slot indices", type(slot_indices).__name__)
    if slot_indices.dim() not in (1, 2):
        fail(argument, "1-D [B] or 2-D [B, T] slot indices", tuple(slot_indices.shape))
    if slot_indices.dtype.is_floating_point or slot_indices.dtype is torch.bool:
        fail(argument, "an integer tensor of slot indices", slot_indices.dtype)
    flat = slot_indices.reshape(-1).to(torch.int64)
    active = flat[(flat >= first) & (flat < N)]
    if active.numel() < 2:
        return
    uniq, counts = torch.unique(active, return_counts=True)
    dup = uniq[counts > 1]
    if dup.numel():
        slot = int(dup[0])
        where = (slot_indices == slot).nonzero().tolist()
        fail(argument, f"distinct active slots in [{first}, {N}) (duplicates race on the pool)",
             f"slots {dup[:8].tolist()} more than once (slot {slot} at {where[:4]})")


def debug_check_ucache_cursors(
    hist_len: torch.Tensor,
    cache_base: torch.Tensor,
    T: int,
    w_ring: int,
    *,
    slot_indices: torch.Tensor | None = None,
    N: int | None = None,
    null_policy=NullSlotPolicy.OUT_OF_RANGE,
) -> None:
    """Raise when a cursor is out of range: hist_len in [0, min(w_ring, 32 - T)], cache_base in [0, 32).

    With ``slot_indices`` and ``N`` only active rows (a slot that is not null under ``null_policy``) are checked.
    Reads values: syncs.
    """
    top = max_hist_len(T, w_ring)
    rows = torch.ones(hist_len.shape, dtype=torch.bool, device=hist_len.device)
    if slot_indices is not None:
        if N is None:
            raise KDAError("N: expected the pool row count when slot_indices is given, got None")
        rows = (slot_indices >= first_live_slot(null_policy_of(null_policy))) & (slot_indices < N)
    bad_len = rows & ((hist_len < 0) | (hist_len > top))
    if bool(bad_len.any()):
        i = int(bad_len.nonzero()[0, 0])
        fail("hist_len", f"values in [0, min(w_ring, 32 - T)] = [0, {top}] (T={T}, w_ring={w_ring})",
             f"{int(hist_len[i])} at row {i}")
    bad_base = rows & ((cache_base < 0) | (cache_base >= RING_SLOTS))
    if bool(bad_base.any()):
        i = int(bad_base.nonzero()[0, 0])
        fail("cache_base", f"values in [0, {RING_SLOTS})", f"{int(cache_base[i])} at row {i}")
