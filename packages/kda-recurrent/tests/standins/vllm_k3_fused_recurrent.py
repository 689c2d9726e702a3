"""Stand-in for ``vllm.models.kimi_k3.nvidia.ops.third_party.kda.fused_recurrent`` (signatures only)."""

ENGINE = "vllm-k3"


def fused_recurrent_kda_packed_decode(mixed_qkv, raw_g, raw_beta, A_log, dt_bias, lower_bound, initial_state,
                                      state_indices, scale=None, out=None):
    return ENGINE, "fused_recurrent_kda_packed_decode"


def fused_recurrent_kda(q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound, initial_state, cu_seqlens,
                        ssm_state_indices, num_accepted_tokens=None, out=None, fuse_gate=None):
    return ENGINE, "fused_recurrent_kda"


def fused_recurrent_kda_fwd(q, k, v, g, beta, scale=None, initial_state=None, inplace_final_state=True,
                            cu_seqlens=None, ssm_state_indices=None, num_accepted_tokens=None,
                            use_qk_l2norm_in_kernel=True, A_log=None, dt_bias=None, lower_bound=None,
                            use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, out=None):
    return ENGINE, "fused_recurrent_kda_fwd"
