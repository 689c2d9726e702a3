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
