"""kda-cute: CuTe-DSL kernels for Kimi Delta Attention decode.

Importing this package never touches the GPU or the DSL: kernels compile on first use, so
``import kda_cute`` works on a machine without CUDA (``CUTE_DSL_ARCH`` lets it compile there too).
"""

from __future__ import annotations

__all__ = ["fused_kda_decode", "kda_decode_t1", "kda_decode_t1_packed", "kda_decode_t1_packed_tokens",
           "packed_fused_kda_decode"]


def __getattr__(name: str):
    # Lazy: the kernel modules import cutlass, which is slow to import and needs its CUDA libraries.
    if name in ("kda_decode_t1", "kda_decode_t1_packed", "kda_decode_t1_packed_tokens"):
        from . import decode_t1

        return getattr(decode_t1, name)
    if name == "fused_kda_decode":
        from . import fused_decode

        return fused_decode.fused_kda_decode
    if name == "packed_fused_kda_decode":
        from . import fused_spec

        return fused_spec.packed_fused_kda_decode
    raise AttributeError(f"module 'kda_cute' has no attribute {name!r}")
