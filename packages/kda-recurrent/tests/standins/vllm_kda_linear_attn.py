"""Stand-in for ``vllm.model_executor.layers.mamba.gdn.kda_linear_attn``: binds the name at import."""

from vllm.third_party.flash_linear_attention.ops.kda import fused_recurrent_kda  # noqa: F401
