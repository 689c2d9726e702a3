"""The oracle against FLA 0.6.0's in-place pool kernel (the call vLLM and SGLang make today), on a CUDA GPU.

``fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd(..., state_v_first=True, inplace_final_state=True,
ssm_state_indices=...)`` updates a V-first pool [N, HV, V, K] in place. FLA indexes A_log and dt_bias by value
head; with H == HV (the T=1 shapes) that is the oracle's per-query-head indexing. FLA has no bounds checks, so every
slot here is valid. Skips where CUDA or fla-core is missing. Each case prints its largest differences (run with -s).
"""

from __future__ import annotations

import pytest
import torch

from kda_core.oracle import recurrent_kda_ref

pytestmark = pytest.mark.gpu

H, K = 12, 128


@pytest.fixture(scope="module")
def fla_fwd():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    module = pytest.importorskip("fla.ops.kda.fused_recurrent", reason="fla-core is not installed")
    return module.fused_recurrent_kda_fwd


def _inputs(B, T, gate, seed):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to("cuda")

    args = dict(q=rnd(B, T, H, K).bfloat16(), k=rnd(B, T, H, K).bfloat16(), v=rnd(B, T, H, K).bfloat16())
    if gate == "precomputed":
        args["g"] = -torch.rand(B, T, H, K, generator=gen).cuda() * 2.0  # fp32 log-decay
        args["beta"] = torch.rand(B, T, H, generator=gen).cuda()  # already sigmoided
        gate_args = dict(A_log=None, dt_bias=None, lower_bound=None, use_gate_in_kernel=False)
        beta_is_logit = False
    else:
        args["g"] = rnd(B, T, H, K).bfloat16()
        args["beta"] = rnd(B, T, H).bfloat16()
        gate_args = dict(A_log=rnd(H, scale=0.5), dt_bias=rnd(H * K, scale=0.5),
                         lower_bound=-5.0 if gate == "lower_bound" else None, use_gate_in_kernel=True)
        beta_is_logit = True
    return args, gate_args, beta_is_logit


def _compare(fla_fwd, B, T, N, gate, pool_dtype, idx, accepted=None, seed=0):
    args, gate_args, beta_is_logit = _inputs(B, T, gate, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    pool = (torch.randn(N, H, K, K, generator=gen) * 0.5).to(device="cuda", dtype=pool_dtype)
    pool_fla, pool_ref = pool.clone(), pool.clone()
    o_fla, _ = fla_fwd(
        **args, **gate_args, initial_state=pool_fla, inplace_final_state=True, state_v_first=True,
        ssm_state_indices=idx, num_accepted_tokens=accepted, use_qk_l2norm_in_kernel=True,
        use_beta_sigmoid_in_kernel=beta_is_logit,
    )
    o_ref, _ = recurrent_kda_ref(
        **args, **gate_args, initial_state=pool_ref, ssm_state_indices=idx, num_accepted_tokens=accepted,
        use_qk_l2norm_in_kernel=True, beta_is_logit=beta_is_logit,
    )
    torch.cuda.synchronize()
    do = (o_fla.float() - o_ref.float()).abs().max().item()
    dS = (pool_fla.float() - pool_ref.float()).abs().max().item()
    print(f"\n[oracle vs FLA] B={B} T={T} gate={gate} pool={pool_dtype} indices={tuple(idx.shape)}: "
          f"max|o diff|={do:.3e} (max|o|={o_ref.float().abs().max().item():.3f}), max|pool diff|={dS:.3e}")
    written = torch.zeros(N, dtype=torch.bool, device="cuda")
    written[idx.reshape(-1).long()] = True
    assert torch.equal(pool_fla[~written], pool[~written]) and torch.equal(pool_ref[~written], pool[~written])
    torch.testing.assert_close(o_fla.float(), o_ref.float(), rtol=1e-2, atol=1e-2)
    tol = dict(rtol=1e-2, atol=1e-2) if pool_dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool_fla.float(), pool_ref.float(), **tol)


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32], ids=["bf16_pool", "fp32_pool"])
@pytest.mark.parametrize("gate", ["lower_bound", "softplus", "precomputed"])
def test_t1_decode_on_a_permuted_pool_matches_fla(fla_fwd, gate, pool_dtype):
    B, N = 33, 80
    idx = torch.randperm(N, generator=torch.Generator().manual_seed(3))[:B].to(torch.int32).cuda()
    _compare(fla_fwd, B, 1, N, gate, pool_dtype, idx, seed=11)


@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
@pytest.mark.parametrize("T", [4, 8])
def test_spec_decode_checkpoints_match_fla(fla_fwd, gate, T):
    B, N = 9, 9 * T + 7
    idx = torch.randperm(N, generator=torch.Generator().manual_seed(T))[: B * T].to(torch.int32).reshape(B, T)
    accepted = torch.randint(1, T + 1, (B,), generator=torch.Generator().manual_seed(T + 1), dtype=torch.int32)
    _compare(fla_fwd, B, T, N, gate, torch.bfloat16, idx.cuda(), accepted.cuda(), seed=T)
