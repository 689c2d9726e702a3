"""The token loop and the chunked WY form are two derivations of one recurrence: in fp64 they must agree."""

from __future__ import annotations

import pytest
import torch

from kda_core.oracle import recurrent_kda_ref, recurrent_kda_wy_ref

F64 = dict(dtype=torch.float64, out_dtype=None)


@pytest.mark.parametrize("T", [1, 2, 5, 8, 16])
@pytest.mark.parametrize("gate", ["lower_bound", "softplus", "precomputed"])
def test_wy_form_matches_token_loop_dense(kda, T, gate):
    args = kda.make_inputs(B=2, T=T, H=2, K=16, seed=T, gate=gate, beta_is_logit=gate != "precomputed")
    S0 = kda.make_pool(2, 2, 16, dtype=torch.float64, seed=T + 7)
    o_loop, s_loop = recurrent_kda_ref(**args, initial_state=S0, output_final_state=True, **F64)
    o_wy, s_wy = recurrent_kda_wy_ref(**args, initial_state=S0, output_final_state=True, **F64)
    torch.testing.assert_close(o_wy, o_loop, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(s_wy, s_loop, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("l2norm", [True, False])
def test_wy_form_matches_token_loop_without_l2norm_and_zero_state(kda, l2norm):
    args = kda.make_inputs(B=3, T=6, H=2, K=16, seed=11, gate="softplus")
    if not l2norm:  # unnormalised keys need small values for a stable delta rule
        args["q"], args["k"] = args["q"] * 0.1, args["k"] * 0.1
    kw = dict(use_qk_l2norm_in_kernel=l2norm, output_final_state=True, **F64)
    o_loop, s_loop = recurrent_kda_ref(**args, **kw)
    o_wy, s_wy = recurrent_kda_wy_ref(**args, **kw)
    torch.testing.assert_close(o_wy, o_loop, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(s_wy, s_loop, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("T", [1, 4, 16])
def test_wy_form_matches_token_loop_on_a_pool_with_inactive_rows(kda, T):
    B, N, H, K = 4, 6, 2, 16
    args = kda.make_inputs(B=B, T=T, H=H, K=K, seed=3 * T, gate="lower_bound")
    pool = kda.make_pool(N, H, K, dtype=torch.float64, seed=5, row_pad=8)
    slots = torch.tensor([4, -1, 0, N], dtype=torch.int32)  # rows 1 and 3 inactive
    pool_loop, pool_wy = pool.clone(), pool.clone()
    o_loop, _ = recurrent_kda_ref(**args, initial_state=pool_loop, ssm_state_indices=slots, **F64)
    o_wy, _ = recurrent_kda_wy_ref(**args, initial_state=pool_wy, ssm_state_indices=slots, **F64)
    torch.testing.assert_close(o_wy, o_loop, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(pool_wy, pool_loop, rtol=1e-9, atol=1e-10)
    assert not torch.equal(pool_loop[4], pool[4]) and not torch.equal(pool_loop[0], pool[0])
    assert torch.equal(o_wy[1], torch.zeros_like(o_wy[1])) and torch.equal(o_wy[3], torch.zeros_like(o_wy[3]))


def test_wy_form_refuses_more_than_16_tokens(kda):
    from kda_core.errors import KDAError

    args = kda.make_inputs(B=1, T=17, H=1, K=8)
    with pytest.raises(KDAError, match=r"^q: expected at most 16 tokens"):
        recurrent_kda_wy_ref(**args)
