"""``kda_recurrent.compat.fla.fused_recurrent_kda_fwd``: FLA 0.6.0's call, FLA's semantics, kda's bounds policy.

CPU tests check the argument mapping against the kda-core oracle (and FLA's gate formulas written out here);
GPU tests (``@pytest.mark.gpu``) run FLA itself on the same inputs and compare.
"""

from __future__ import annotations

import pytest
import torch

from kda_core.errors import KDAError
from kda_core.oracle import recurrent_kda_ref
from kda_recurrent.compat.fla import fused_recurrent_kda_fwd

BF16 = torch.bfloat16
HAS_CUDA = torch.cuda.is_available()


def make_inputs(device, *, B=4, T=1, H=12, HV=None, K=128, N=16, varlen=False, seed=0):
    """FLA-convention inputs: A_log [HV] and dt_bias [HV*K] (FLA indexes them by value head)."""
    HV = HV or H
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, dtype=BF16, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    Bq, Tq = (1, B * T) if varlen else (B, T)
    return dict(
        q=rnd(Bq, Tq, H, K), k=rnd(Bq, Tq, H, K), v=rnd(Bq, Tq, HV, K), g=rnd(Bq, Tq, HV, K), beta=rnd(Bq, Tq, HV),
        A_log=rnd(HV, dtype=torch.float32, scale=0.5), dt_bias=rnd(HV * K, dtype=torch.float32),
        pool=rnd(N, HV, K, K, dtype=BF16, scale=0.1),
    )


def serving_kwargs(x, slots, **extra):
    """The call vLLM makes (FLA argument names)."""
    kw = dict(A_log=x["A_log"], dt_bias=x["dt_bias"], initial_state=x["pool"], inplace_final_state=True,
              state_v_first=True, ssm_state_indices=slots, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)
    kw.update(extra)
    return kw


def i32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def tol(dtype=BF16):
    return dict(rtol=2e-2, atol=2e-2) if dtype == BF16 else dict(rtol=1e-3, atol=1e-3)


def exact():
    return dict(rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# CPU: argument mapping against the oracle


def test_serving_pool_call_updates_the_pool_in_place_and_returns_it():
    x = make_inputs("cpu")
    slots = i32([3, 0, 9, 12], "cpu")
    ref_pool = x["pool"].clone()
    o, final = fused_recurrent_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], **serving_kwargs(x, slots))
    o_ref, _ = recurrent_kda_ref(
        x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"], initial_state=ref_pool,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-5.0, beta_is_logit=True,
        ssm_state_indices=slots,
    )
    assert final is x["pool"]
    torch.testing.assert_close(o, o_ref, **exact())
    torch.testing.assert_close(x["pool"], ref_pool, **exact())


def test_spec_decode_call_writes_one_checkpoint_per_token():
    x = make_inputs("cpu", T=4)
    slots = torch.arange(16, dtype=torch.int32).reshape(4, 4)
    accepted = i32([1, 4, 2, 3], "cpu")
    ref_pool = x["pool"].clone()
    o, _ = fused_recurrent_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                   **serving_kwargs(x, slots, num_accepted_tokens=accepted))
    o_ref, _ = recurrent_kda_ref(
        x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"], initial_state=ref_pool,
        use_gate_in_kernel=True, lower_bound=-5.0, beta_is_logit=True, ssm_state_indices=slots,
        num_accepted_tokens=accepted,
    )
    torch.testing.assert_close(o, o_ref, **exact())
    torch.testing.assert_close(x["pool"], ref_pool, **exact())


def test_in_place_without_indices_overwrites_initial_state_like_fla():
    x = make_inputs("cpu", B=3, T=2)
    dense = x["pool"][:3].float()
    o, final = fused_recurrent_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=dense,
                                       inplace_final_state=True, state_v_first=True, use_qk_l2norm_in_kernel=True)
    o_ref, s_ref = recurrent_kda_ref(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["pool"][:3].float(),
                                     output_final_state=True)
    assert final is dense
    torch.testing.assert_close(o, o_ref, **exact())
    torch.testing.assert_close(dense, s_ref, **exact())


def test_k_first_final_state_without_initial_state_is_fla_layout():
    x = make_inputs("cpu", B=2, T=3, K=64)
    o, final = fused_recurrent_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], output_final_state=True,
                                       inplace_final_state=False, state_v_first=False)
    _, s_ref = recurrent_kda_ref(x["q"], x["k"], x["v"], x["g"], x["beta"], use_qk_l2norm_in_kernel=False,
                                 output_final_state=True)
    assert final.is_contiguous()
    torch.testing.assert_close(final, s_ref.transpose(-1, -2), **exact())


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_missing_A_log_means_fla_unit_factor(lower_bound):
    # FLA without A_log: lb * sigmoid(g + dt_bias), or -exp(1) * softplus(g + dt_bias).
    x = make_inputs("cpu")
    slots = i32([1, 2, 3, 4], "cpu")
    ref_pool = x["pool"].clone()
    o, _ = fused_recurrent_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                   **serving_kwargs(x, slots, A_log=None, lower_bound=lower_bound))
    xg = x["g"].float() + x["dt_bias"].view(12, 128)
    g_log = lower_bound * torch.sigmoid(xg) if lower_bound else -torch.e * torch.nn.functional.softplus(xg)
    o_ref, _ = recurrent_kda_ref(x["q"], x["k"], x["v"], g_log, x["beta"], initial_state=ref_pool,
                                 beta_is_logit=True, ssm_state_indices=slots)
    torch.testing.assert_close(o, o_ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(x["pool"].float(), ref_pool.float(), rtol=1e-2, atol=1e-2)


def test_gqa_gate_parameters_are_per_value_head_as_in_fla():
    x = make_inputs("cpu", H=4, HV=8, T=2)
    slots = i32([5, 1, 7, 2], "cpu")
    ref_pool = x["pool"].clone()
    o, _ = fused_recurrent_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], **serving_kwargs(x, slots))
    # FLA's formula, per value head hv: lb * sigmoid(exp(A_log[hv]) * (g + dt_bias[hv])).
    rate = torch.exp(x["A_log"])[:, None]
    g_log = -5.0 * torch.sigmoid(rate * (x["g"].float() + x["dt_bias"].view(8, 128)))
    o_ref, _ = recurrent_kda_ref(x["q"], x["k"], x["v"], g_log, x["beta"], initial_state=ref_pool,
                                 beta_is_logit=True, ssm_state_indices=slots)
    torch.testing.assert_close(o, o_ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(x["pool"].float(), ref_pool.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("name, bad, fragment", [
    ("dt_bias", lambda x: x["dt_bias"][: 4 * 128], "[HV*K]"),  # [H*K]: kda's own convention, not FLA's
    ("A_log", lambda x: x["A_log"][:4], "[HV]"),
    ("A_log", lambda x: x["A_log"].double(), "float32"),
])
def test_gqa_gate_parameters_are_validated_before_the_gate_is_computed(name, bad, fragment):
    x = make_inputs("cpu", H=4, HV=8, T=2)
    kw = serving_kwargs(x, i32([5, 1, 7, 2], "cpu"))
    kw[name] = bad(x)
    with pytest.raises(KDAError, match=f"^{name}: expected") as info:
        fused_recurrent_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
    assert fragment in str(info.value)


def test_gqa_with_an_fp64_gate_is_refused_as_the_facade_refuses_it():
    x = make_inputs("cpu", H=4, HV=8, T=2)
    with pytest.raises(KDAError, match="^g: expected"):
        fused_recurrent_kda_fwd(x["q"], x["k"], x["v"], x["g"].double(), x["beta"],
                                **serving_kwargs(x, i32([5, 1, 7, 2], "cpu")))


def test_gqa_gate_without_dt_bias_means_zeros():
    x = make_inputs("cpu", H=4, HV=8, T=2)
    slots = i32([5, 1, 7, 2], "cpu")
    ref_pool = x["pool"].clone()
    o, _ = fused_recurrent_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], **serving_kwargs(x, slots, dt_bias=None))
    g_log = -5.0 * torch.sigmoid(torch.exp(x["A_log"])[:, None] * x["g"].float())
    o_ref, _ = recurrent_kda_ref(x["q"], x["k"], x["v"], g_log, x["beta"], initial_state=ref_pool,
                                 beta_is_logit=True, ssm_state_indices=slots)
    torch.testing.assert_close(o, o_ref, rtol=1e-2, atol=1e-2)


def test_serving_call_without_dt_bias_means_zeros():
    x = make_inputs("cpu")
    slots = i32([1, 2, 3, 4], "cpu")
    absent, zeros = x["pool"].clone(), x["pool"].clone()
    o, _ = fused_recurrent_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                   **serving_kwargs(x, slots, dt_bias=None, initial_state=absent))
    o_zeros, _ = fused_recurrent_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                         **serving_kwargs(x, slots, dt_bias=torch.zeros_like(x["dt_bias"]),
                                                          initial_state=zeros))
    torch.testing.assert_close(o, o_zeros, **exact())
    torch.testing.assert_close(absent, zeros, **exact())


def test_in_place_dense_state_with_fewer_rows_than_sequences_is_refused():
    x = make_inputs("cpu", B=3, T=2)
    with pytest.raises(KDAError, match="^initial_state: expected one row per sequence"):
        fused_recurrent_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["pool"][:2].float(),
                                inplace_final_state=True, state_v_first=True)


def test_duplicate_slots_are_refused_under_debug_validation(monkeypatch):
    monkeypatch.setenv("KDA_DEBUG_VALIDATE", "1")
    x = make_inputs("cpu")
    with pytest.raises(KDAError, match="^ssm_state_indices: expected distinct active slots"):
        fused_recurrent_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                **serving_kwargs(x, i32([1, 2, 1, 4], "cpu")))


def test_padding_slot_is_inactive_where_fla_would_write_out_of_bounds():
    x = make_inputs("cpu")
    before = x["pool"].clone()
    slots = i32([-1, 2, 16, 4], "cpu")  # -1 and N=16 are outside the pool
    o, _ = fused_recurrent_kda_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], **serving_kwargs(x, slots))
    assert o[0].eq(0).all() and o[2].eq(0).all()
    untouched = [s for s in range(16) if s not in (2, 4)]
    assert torch.equal(x["pool"][untouched], before[untouched])


@pytest.mark.parametrize(
    "argument, change",
    [
        ("state_v_first", dict(state_v_first=False)),
        ("allow_neg_eigval", dict(allow_neg_eigval=True, use_beta_sigmoid_in_kernel=True)),
        ("inplace_final_state", dict(inplace_final_state=False)),
        ("kwargs", dict(transpose_state_layout=True)),
        ("initial_state", dict(initial_state=None, ssm_state_indices=None)),
        ("ssm_state_indices", dict(ssm_state_indices=torch.zeros(4, dtype=torch.float32))),  # int32/int64 only
        ("beta", dict(beta=torch.zeros(4, 1, 12, 128, dtype=BF16))),
    ],
)
def test_calls_kda_does_not_implement_raise_the_kda_error(argument, change):
    x = make_inputs("cpu")
    before = x["pool"].clone()
    kw = serving_kwargs(x, i32([0, 1, 2, 3], "cpu"))
    kw.update(change)
    beta = kw.pop("beta", x["beta"])
    with pytest.raises(KDAError, match=rf"^{argument}: expected"):
        fused_recurrent_kda_fwd(x["q"], x["k"], x["v"], x["g"], beta, **kw)
    assert torch.equal(x["pool"], before)


# ---------------------------------------------------------------------------------------------------------------
# GPU: against FLA 0.6.0 itself


def _fla():
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    module = pytest.importorskip("fla.ops.kda.fused_recurrent")
    return module.fused_recurrent_kda_fwd


def _both(call_kwargs_for, x):
    """Run FLA and the adapter on separate copies of the pool; return (o_fla, pool_fla, o_kda, pool_kda)."""
    fla_fwd = _fla()
    results = []
    for fwd in (fla_fwd, fused_recurrent_kda_fwd):
        pool = x["pool"].clone()
        o, final = fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], **call_kwargs_for(pool))
        torch.cuda.synchronize()
        results += [o, final]
    return results


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("B", [1, 8, 64])
def test_gpu_decode_pool_call_matches_fla(B):
    x = make_inputs("cuda", B=B, N=2 * B + 5)
    # Distinct slots: duplicate active slots are a caller error (two CTAs race on one state). N = 2B + 5 is odd, so
    # the stride 2 is coprime with it; the old stride 7 repeated slots at B=8 (N=21) and B=64 (N=133 = 7 * 19).
    slot_list = [(2 * b + 3) % (2 * B + 5) for b in range(B)]
    assert len(set(slot_list)) == B
    slots = i32(slot_list, "cuda")
    o_fla, pool_fla, o_kda, pool_kda = _both(lambda pool: serving_kwargs({**x, "pool": pool}, slots), x)
    torch.testing.assert_close(o_kda, o_fla, **tol())
    torch.testing.assert_close(pool_kda.float(), pool_fla.float(), **tol())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("T", [4, 8])
def test_gpu_spec_decode_call_matches_fla(T):
    B, N = 16, 16 * T + 4
    x = make_inputs("cuda", B=B, T=T, N=N)
    slots = torch.randperm(N, generator=torch.Generator().manual_seed(1))[: B * T].reshape(B, T)
    slots = slots.to(device="cuda", dtype=torch.int32)
    accepted = i32([1 + b % T for b in range(B)], "cuda")
    o_fla, pool_fla, o_kda, pool_kda = _both(
        lambda pool: serving_kwargs({**x, "pool": pool}, slots, num_accepted_tokens=accepted), x)
    torch.testing.assert_close(o_kda, o_fla, **tol())
    torch.testing.assert_close(pool_kda.float(), pool_fla.float(), **tol())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_varlen_decode_call_matches_fla():
    # vLLM's decode batch: B == 1, one token per sequence, cu_seqlens = arange(N_seq + 1).
    n_seq = 32
    x = make_inputs("cuda", B=n_seq, varlen=True, N=64)
    cu = torch.arange(n_seq + 1, dtype=torch.int32, device="cuda")
    slots = i32(list(range(1, 2 * n_seq, 2)), "cuda")
    o_fla, pool_fla, o_kda, pool_kda = _both(
        lambda pool: serving_kwargs({**x, "pool": pool}, slots, cu_seqlens=cu), x)
    torch.testing.assert_close(o_kda, o_fla, **tol())
    torch.testing.assert_close(pool_kda.float(), pool_fla.float(), **tol())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_dense_prefill_chunk_with_final_state_matches_fla():
    x = make_inputs("cuda", B=4, T=16, H=4, HV=8)
    h0 = x["pool"][:4].float()
    kwargs = dict(A_log=x["A_log"], dt_bias=x["dt_bias"], initial_state=h0, output_final_state=True,
                  inplace_final_state=False, state_v_first=True, use_qk_l2norm_in_kernel=True,
                  use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)
    o_fla, s_fla, o_kda, s_kda = _both(lambda pool: kwargs, x)
    torch.testing.assert_close(o_kda, o_fla, **tol())
    torch.testing.assert_close(s_kda, s_fla, rtol=2e-3, atol=2e-3)
