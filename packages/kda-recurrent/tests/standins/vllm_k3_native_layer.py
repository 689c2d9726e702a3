"""Stand-in for the native-op path of ``vllm.models.kimi_k3.nvidia.kda``: the module binds ``_custom_ops`` as ``ops``
at import and reads ``ops.fused_kda_decode`` at each call."""

from vllm import _custom_ops as ops


def native_decode_function():
    """What the layer's forward calls on the native backend."""
    return ops.fused_kda_decode
