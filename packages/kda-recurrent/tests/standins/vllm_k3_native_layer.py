"""Stand-in for the fused paths of ``vllm.models.kimi_k3.nvidia.kda``: the module binds ``_custom_ops`` as ``ops``
at import and reads ``ops.fused_kda_decode`` at each call; it binds ``flashinfer_packed_fused_kda_decode`` by name
at import; its backend choices read the module's ``is_fused_kda_decode_supported`` and
``is_flashinfer_fused_kda_spec_decode_supported`` when a layer is built (signatures as the engine's; the stand-in's
answers are vLLM's dtype rules only: an fp32 state for the native op; for the spec-decode backend whether FlashInfer
is there, ``FLASHINFER``)."""

import torch
from vllm import _custom_ops as ops
from vllm.utils.flashinfer import flashinfer_packed_fused_kda_decode

DIM_FIRST = [False]  # what vLLM's ``is_conv_state_dim_first()`` answers (its conv-state layout option)
FLASHINFER = [False]  # whether vLLM's own spec-decode test finds FlashInfer's kernel (SM100 with FlashInfer)


def is_conv_state_dim_first():
    return DIM_FIRST[0]


def native_decode_function():
    """What the layer's forward calls on the native backend."""
    return ops.fused_kda_decode


def spec_decode_function():
    """What the layer's forward calls on the fused spec-decode backend."""
    return flashinfer_packed_fused_kda_decode


def is_fused_kda_decode_supported(num_heads, head_dim, conv_width, num_spec, input_dtype, conv_state_dtype,
                                  recurrent_state_dtype):
    return recurrent_state_dtype == torch.float32


def is_flashinfer_fused_kda_spec_decode_supported(num_heads, head_dim, conv_width, num_spec, input_dtype,
                                                  conv_state_dtype, recurrent_state_dtype, lower_bound,
                                                  use_recoverssm):
    return FLASHINFER[0]


def decode_backend(recurrent_state_dtype, num_heads=12):
    """The layer's choice at construction: the module attribute is read at call time."""
    native = is_fused_kda_decode_supported(num_heads, 128, 4, 0, torch.bfloat16, torch.bfloat16,
                                           recurrent_state_dtype)
    return "native" if native else "triton"


def spec_decode_backend(recurrent_state_dtype, num_spec=3, lower_bound=-5.0, use_recoverssm=False, num_heads=12):
    fused = is_flashinfer_fused_kda_spec_decode_supported(num_heads, 128, 4, num_spec, torch.bfloat16,
                                                          torch.bfloat16, recurrent_state_dtype, lower_bound,
                                                          use_recoverssm)
    return "flashinfer" if fused else "native"
