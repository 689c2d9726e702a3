"""Stand-in for the package ``vllm.models.kimi_k3.nvidia.ops.third_party.kda`` (re-exports by name)."""

from vllm.models.kimi_k3.nvidia.ops.third_party.kda.fused_recurrent import (  # noqa: F401
    fused_recurrent_kda,
    fused_recurrent_kda_fwd,
    fused_recurrent_kda_packed_decode,
)
