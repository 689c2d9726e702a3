"""Stand-in for ``vllm.models.kimi_k3.nvidia.ops.recoverssm`` (signatures only)."""

ENGINE = "vllm-k3-recoverssm"


def kda_recoverssm_verify(q, k, v, raw_g, raw_beta, A_log, dt_bias, lower_bound, checkpoint_state, correction_cache,
                          kg_cache, query_start_loc, state_indices, spec_query_len, out=None):
    return ENGINE, "kda_recoverssm_verify"


class KDARecoverSSMCommitContext:
    @classmethod
    def create(cls, layers, *, spec_query_len, max_num_reqs):
        return ENGINE, "create"

    def commit(self, num_accepted_tokens, state_indices, query_start_loc, request_indices=None, block_table=None,
               num_computed_tokens=None, mamba_block_size=None):
        return ENGINE, "commit"
