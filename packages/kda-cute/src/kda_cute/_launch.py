"""Launch machinery shared by the kda-cute kernels.

Every kernel family in this package is compiled once per compile-time configuration against
*fake* tensors (symbolic batch/pool sizes, static head dims) and then called directly with torch
tensors through TVM-FFI on the caller's current stream. This module holds the pieces every family
needs, so that the cache key, the fake-tensor conventions and the alignment rule are written once.

API (small on purpose):

``arch_for(device) -> str`` / ``target_arch() -> str``
    The arch to compile for: ``CUTE_DSL_ARCH`` when set (e.g. ``"sm_90a"``; this is how CI compiles
    without a GPU), else the capability of ``device`` (the device a call's tensors live on; ``sm_90a`` on
    Hopper, ``sm_100a`` on B200), queried once per device index. ``target_arch()`` is the same for the
    current device; a launcher passes ``arch_for(<its first tensor>.device)`` to ``get_or_compile``, so
    a call on ``cuda:1`` while ``cuda:0`` is current compiles for ``cuda:1``'s architecture.
    ``arch_number("sm_100a") -> 100`` for ``const_expr`` branches.

``compile_options(arch, extra="") -> str``
    The ``cute.compile(..., options=...)`` string: TVM-FFI on, the target arch, plus ``extra``
    (e.g. ``"--keep-ptx --dump-dir D"``).

``get_or_compile(key, build, arch=None) -> compiled``
    Process-wide compile cache. ``key`` must be a tuple of *every* code-generation parameter
    (dtypes, flags, tile sizes, alignment class, ...); the arch is appended here so no caller can
    forget it (``None``: the current device's). The key holds no device index: devices of one
    architecture share each compiled function, which runs on any of them (see "Devices" below).
    An incomplete key is a silent-corruption bug: two configurations would share code.
    ``build(arch)`` runs ``cute.compile`` and is called under a lock (``cute.compile`` is not
    thread-safe). ``cache_size()`` and ``clear_cache()`` are for tests.

``fake_tensor(dtype, shape, stride, *, align_bytes) -> fake tensor``
    Row-major fake tensors. ``shape`` entries are ints or ``SymInt`` (use ``sym_size()`` for batch /
    pool sizes and reuse one object for dims that must be equal). ``stride`` entries are ints
    (static) or ``None`` (dynamic 64-bit, declared divisible by ``align_bytes // element bytes``).
    The base pointer is assumed ``align_bytes``-aligned. The TVM-FFI adapter does NOT check stride
    divisibility at call time, so the launcher must only pick the aligned configuration after
    ``alignment_of`` said so.

``fake_stream()``
    The TVM-FFI environment-stream placeholder: the compiled function then takes no stream
    argument and launches on ``torch.cuda.current_stream(d)``, ``d`` the device of its tensors.

``alignment_of(*tensors) -> int``
    The largest power of two, at most 16, dividing every tensor's data pointer (in bytes) and every
    stride (in bytes) of a dimension whose size is above 1, except the unit-stride (vector) dim.
    Reads metadata only. ``16`` means 128-bit vector accesses are legal on every row of every tensor.

``cutlass_dtype(torch_dtype)``
    torch dtype -> cutlass numeric type (bf16, fp16, fp32, int32).

Devices (docs/multi_gpu.md has the evidence): the wrapper ``cute.compile`` builds around a kernel
(``--enable-tvm-ffi``) binds one device index from its first GPU tensor and checks every other tensor
against it (a mismatch raises ValueError before launch), reads that device's stream from the TVM-FFI
environment (which the TVM-FFI call sets to torch's current stream of that device), and around the
launch calls ``cudaGetDevice`` and, only when it differs, ``cudaSetDevice`` to the tensors' device and
back. Its CUDA library is context-independent and prepared for every visible device on the first
call. So a launcher needs no device guard of its own: it must only allocate on its tensors' device
(``device=x.device``) and pick the arch with ``arch_for``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from kda_core.validation import tensor_alignment

VECTOR_BYTES = 16  # one 128-bit global load/store: the unit every fast path is built on

_CACHE: dict[tuple, Any] = {}
_COMPILE_LOCK = threading.Lock()


def _capability_arch(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    # 'a' (arch-specific) features exist from sm_90 on; older parts compile for the plain target.
    return f"sm_{major}{minor}a" if major >= 9 else f"sm_{major}{minor}"


_ARCH_BY_DEVICE: dict[int, str] = {}


def arch_for(device: torch.device) -> str:
    """The arch to compile for the device a call's tensors live on, queried once per device index.

    ``CUTE_DSL_ARCH`` still wins (read on every call, so a test or a compile check can switch it). A device without
    an index means the current one.
    """
    env = os.environ.get("CUTE_DSL_ARCH", "").strip()
    if env:
        return env
    index = device.index
    if index is None:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "kda_cute: no CUDA device and CUTE_DSL_ARCH is unset; set CUTE_DSL_ARCH=sm_90a (or sm_100a) "
                "to compile without a GPU"
            )
        index = torch.cuda.current_device()
    arch = _ARCH_BY_DEVICE.get(index)
    if arch is None:  # (the capability of a device index, not of the current device: no guard needed)
        arch = _ARCH_BY_DEVICE[index] = _capability_arch(index)
    return arch


_CURRENT = torch.device("cuda")  # no index: the current device


def target_arch() -> str:
    """Arch string the kernels are compiled for on the current device (``sm_90a``, ``sm_100a``, ...); see
    :func:`arch_for`, which a launcher should call with its tensors' device instead."""
    return arch_for(_CURRENT)


def arch_number(arch: str) -> int:
    """``"sm_100a" -> 100``."""
    digits = "".join(ch for ch in arch.split("_", 1)[-1] if ch.isdigit())
    return int(digits)


def compile_options(arch: str, extra: str = "") -> str:
    return f"--enable-tvm-ffi --gpu-arch {arch} {extra}".strip()


def get_or_compile(key: tuple, build: Callable[[str], Any], arch: str | None = None) -> Any:
    """Return the compiled function for ``key`` (+ arch), compiling it with ``build(arch)`` once. ``arch``: the
    tensors' (``arch_for(t.device)``); None takes the current device's, which is right only when the call's
    tensors are on the current device or every device has one architecture."""
    arch = arch or target_arch()
    full_key = (*key, arch)
    fn = _CACHE.get(full_key)
    if fn is not None:
        return fn
    with _COMPILE_LOCK:
        fn = _CACHE.get(full_key)
        if fn is None:
            fn = build(arch)
            _CACHE[full_key] = fn
    return fn


def cache_size() -> int:
    return len(_CACHE)


def clear_cache() -> None:
    with _COMPILE_LOCK:
        _CACHE.clear()


def cutlass_dtype(dtype: torch.dtype):
    import cutlass

    table = {
        torch.bfloat16: cutlass.BFloat16,
        torch.float16: cutlass.Float16,
        torch.float32: cutlass.Float32,
        torch.int32: cutlass.Int32,
        torch.int64: cutlass.Int64,
    }
    try:
        return table[dtype]
    except KeyError:
        raise TypeError(f"kda_cute: no cutlass type for torch dtype {dtype}") from None


def sym_size():
    """A fresh symbolic size (batch, pool rows). Reuse one object for dims that must be equal."""
    import cutlass.cute as cute

    return cute.sym_int()


def fake_tensor(dtype, shape: tuple, stride: tuple, *, align_bytes: int = VECTOR_BYTES):
    """Fake gmem tensor; ``None`` in ``stride`` = dynamic stride divisible by ``align_bytes``."""
    import cutlass.cute as cute

    if len(shape) != len(stride):
        raise ValueError(f"fake_tensor: shape {shape} and stride {stride} differ in rank")
    elem_bytes = max(dtype.width // 8, 1)
    divisibility = max(align_bytes // elem_bytes, 1)
    full_stride = tuple(
        cute.sym_int64(divisibility=divisibility) if s is None else s for s in stride
    )
    return cute.runtime.make_fake_tensor(
        dtype, shape, full_stride, assumed_align=max(align_bytes, elem_bytes)
    )


def fake_stream():
    import cutlass.cute as cute

    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


def alignment_of(*tensors: torch.Tensor | None) -> int:
    """Largest power of two <= 16 dividing every pointer and every non-unit byte stride of a dim of size > 1.

    kda-core's rule (``kda_core.validation.tensor_alignment``), taken over several tensors; ``None`` is skipped.
    """
    return min((tensor_alignment(t) for t in tensors if t is not None), default=VECTOR_BYTES)
