"""Stand-in for ``sglang.srt.layers.attention.linear.kda_backend``: binds the fused-decode module at import and reads
its ``covered`` and ``kda_fused_decode`` attributes per call."""

from sglang.kernels.ops.attention import kda_fused_decode


def fused_decode_functions():
    """What the backend's decode calls: (the test, the kernel)."""
    return kda_fused_decode.covered, kda_fused_decode.kda_fused_decode
