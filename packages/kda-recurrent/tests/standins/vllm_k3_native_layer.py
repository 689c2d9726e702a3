"""Stand-in for the native-op path of ``vllm.models.kimi_k3.nvidia.kda``: the module binds ``_custom_ops`` as ``ops``
at import and reads ``ops.fused_kda_decode`` at each call; its backend choice reads the module's
``is_fused_kda_decode_supported`` when a layer is built (signature as the engine's; the stand-in's answer is
vLLM's dtype rule only: an fp32 state)."""

import torch
from vllm import _custom_ops as ops


def native_decode_function():
    """What the layer's forward calls on the native backend."""
    return ops.fused_kda_decode


def is_fused_kda_decode_supported(num_heads, head_dim, conv_width, num_spec, input_dtype, conv_state_dtype,
                                  recurrent_state_dtype):
    return recurrent_state_dtype == torch.float32


def decode_backend(recurrent_state_dtype, num_heads=12):
    """The layer's choice at construction: the module attribute is read at call time."""
    native = is_fused_kda_decode_supported(num_heads, 128, 4, 0, torch.bfloat16, torch.bfloat16,
                                           recurrent_state_dtype)
    return "native" if native else "triton"
