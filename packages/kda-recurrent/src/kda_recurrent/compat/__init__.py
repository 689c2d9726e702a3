"""Drop-in adapters for the calls serving stacks make today.

- :mod:`kda_recurrent.compat.fla`: ``fused_recurrent_kda_fwd``, FLA 0.6.0's in-place pool call.
- :mod:`kda_recurrent.compat.vllm`: vLLM's vendored Kimi K3 and Kimi-Linear KDA decode calls (slot ``<= 0`` null).
- :mod:`kda_recurrent.compat.sglang`: SGLang's vendored packed KDA decode call (``-1`` null).

The helpers below are the adapters' shared pieces.
"""

from __future__ import annotations

import importlib

import torch


def optional_entry(module: str, name: str):
    """``module.name`` (a kda-cute kernel entry), or None when kda-cute cannot be imported. Adapters call it on their
    first CUDA call: importing the CuTe DSL is slow, and kda-recurrent runs without kda-cute (the oracle)."""
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        return None


def shape_text(x):
    """A refused argument as an error message shows it: its shape, or its type when it is not a tensor."""
    return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


_CAPABILITY: dict[int, tuple[int, int]] = {}  # CUDA device index -> its compute capability, asked once


def capability_of(x: torch.Tensor) -> tuple[int, int] | None:
    """The compute capability of the CUDA device ``x`` lives on (cached per device index), None off CUDA: adapters
    that stand in for an engine kernel on some GPUs only ask it per call."""
    if not x.is_cuda:
        return None
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    got = _CAPABILITY.get(index)
    if got is None:
        got = _CAPABILITY[index] = tuple(torch.cuda.get_device_capability(index))
    return got


_CONSTANTS: dict[tuple, torch.Tensor] = {}  # (size, dtype, device, value) -> a read-only constant adapters index with


def constant(size: int, dtype: torch.dtype, device: torch.device, value=None) -> torch.Tensor:
    """A read-only constant [size] of ``dtype`` on ``device``: ``arange(size)`` when ``value`` is None, else ``value``
    everywhere; made once and kept, so an adapter's per-call index arithmetic launches no fill. While a CUDA graph is
    being captured on the current stream a new one is made and not kept: its fill is a captured kernel that has not
    run, so a kept tensor would hold garbage for eager calls until the graph's first replay."""
    key = (size, dtype, torch.device(device), value)
    t = _CONSTANTS.get(key)
    if t is None:
        if value is None:
            t = torch.arange(size, dtype=dtype, device=device)
        else:
            t = torch.full((size,), value, dtype=dtype, device=device)
        if keepable(t):
            _CONSTANTS[key] = t
    return t


def keepable(t: torch.Tensor) -> bool:
    """Whether a tensor an adapter just made may be kept for later calls: not while a CUDA graph is being captured
    on the current stream, where its memory is the graph's and the kernels that fill it have not run yet."""
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())
