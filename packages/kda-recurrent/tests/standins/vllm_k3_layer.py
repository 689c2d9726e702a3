"""Stand-in for ``vllm.models.kimi_k3.nvidia.kda``: the layer imports the decode functions at call time."""


def decode_functions():
    """What the layer's forward resolves when it runs."""
    from vllm.models.kimi_k3.nvidia.ops.third_party.kda import fused_recurrent_kda, fused_recurrent_kda_packed_decode

    return fused_recurrent_kda_packed_decode, fused_recurrent_kda
