"""Stand-in for ``sglang.kernels.ops.attention.fla.fused_recurrent`` (signature only)."""


def fused_recurrent_kda_packed_decode(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out, ssm_state_indices,
                                      use_qk_l2norm_in_kernel=False, lower_bound=None):
    return "sglang", "fused_recurrent_kda_packed_decode"
