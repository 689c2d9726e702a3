"""Stand-in for ``vllm.third_party.flash_linear_attention.ops.kda`` (signature only)."""


def fused_recurrent_kda(q, k, v, g, beta=None, scale=None, initial_state=None, inplace_final_state=True,
                        use_qk_l2norm_in_kernel=True, cu_seqlens=None, ssm_state_indices=None,
                        num_accepted_tokens=None, out=None, sigmoid_beta=False, a_log=None, g_bias=None,
                        compute_gate=False, lower_bound=-5.0, **kwargs):
    return "vllm-fla", "fused_recurrent_kda"
