"""Stand-in for ``sglang.kernels.ops.attention.kda_fused_decode`` (signatures only): SGLang's fused Kimi K3 decode
and its ``covered`` test (the stand-in's answer: never, as without its JIT kernel)."""


def covered(mixed_qkv, a, b, conv_states, ssm_states, cache_indices, onorm_g):
    return False


def kda_fused_decode(mixed_qkv, a, b, conv_states, w_q_t, w_k_t, w_v_t, conv_bias, A_log, dt_bias, onorm_g,
                     onorm_weight, ssm_states, cache_indices, scale, onorm_eps, lower_bound=None):
    return "sglang", "kda_fused_decode"
