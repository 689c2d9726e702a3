"""Stand-in for ``sglang.srt.layers.attention.linear.kernels.kda_triton``: binds the name at import."""

from sglang.kernels.ops.attention.fla.fused_recurrent import fused_recurrent_kda_packed_decode  # noqa: F401
