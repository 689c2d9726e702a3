"""``kda_recurrent.compat.sglang.fused_recurrent_kda_packed_decode``: SGLang's KDA T=1 decode with SGLang's
semantics on kda (gate parameters per value head, beta a logit, -1 null and slot 0 live, ``out`` [B, 1, HV, V]).

CPU tests run the oracle path against a row-by-row reference built here from kda-core's step functions; GPU tests
(``@pytest.mark.gpu``) run the kernels against kda-core's oracle and, where FLA is installed, against FLA 0.6.0
(which indexes the gate parameters by value head, as SGLang does).
"""

from __future__ import annotations

import pytest
import torch

from kda_core.contracts import NullSlotPolicy
from kda_core.errors import KDAError
from kda_core.oracle_step import kda_gate_ref, kda_step_ref
from kda_recurrent.compat import sglang

BF16 = torch.bfloat16
D = 128
HAS_CUDA = torch.cuda.is_available()
TOL = dict(rtol=2e-2, atol=2e-2)
STATE_TOL = dict(rtol=2e-3, atol=2e-3)


def rnd(g, *shape, dtype=BF16, scale=1.0, device="cpu"):
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def inputs(B, H, HV=None, *, slots, n_slots=None, seed=0, K=D, device="cpu", pool_dtype=torch.float32):
    """SGLang's call: mixed_qkv rows of a wider buffer, a [B, HV*K], b [B, HV], per-value-head A_log / dt_bias, a
    NaN-filled out [B, 1, HV, V] (SGLang allocates it uninitialised)."""
    HV = HV or H
    g = torch.Generator().manual_seed(seed)
    width = 2 * H * K + HV * K
    n_slots = n_slots or B + 2
    return dict(
        mixed_qkv=rnd(g, B, width + 9, device=device)[:, :width],
        a=rnd(g, B, HV * K, device=device), b=rnd(g, B, HV, device=device),
        A_log=rnd(g, HV, dtype=torch.float32, scale=0.5, device=device),
        dt_bias=rnd(g, HV * K, dtype=torch.float32, scale=0.1, device=device),
        scale=K ** -0.5,
        initial_state=rnd(g, n_slots, HV, K, K, dtype=pool_dtype, scale=0.1, device=device),
        out=torch.full((B, 1, HV, K), float("nan"), dtype=BF16, device=device),
        ssm_state_indices=torch.tensor(slots, dtype=torch.int32, device=device),
    )


def call(x, **kw):
    return sglang.fused_recurrent_kda_packed_decode(
        mixed_qkv=x["mixed_qkv"], a=x["a"], b=x["b"], A_log=x["A_log"], dt_bias=x["dt_bias"], scale=x["scale"],
        initial_state=x["initial_state"], out=x["out"], ssm_state_indices=x["ssm_state_indices"], **kw)


def reference(x, *, l2norm=False, lower_bound=None):
    """Per row: slot < 0 or >= N is null (zero output, nothing touched); else one step with the gate of value head
    hv from A_log[hv], dt_bias[hv] and q, k of query head hv // (HV // H)."""
    pool = x["initial_state"].clone()
    HV, V, K = pool.shape[1:]
    B = x["mixed_qkv"].shape[0]
    H = (x["mixed_qkv"].shape[1] - HV * V) // (2 * K)
    q, k = x["mixed_qkv"][:, : 2 * H * K].unflatten(1, (2 * H, K)).split(H, dim=1)
    v = x["mixed_qkv"][:, 2 * H * K :].unflatten(1, (HV, V))
    o = torch.zeros(B, HV, V)
    for row, slot in enumerate(x["ssm_state_indices"].tolist()):
        if not 0 <= slot < pool.shape[0]:
            continue
        g_log = kda_gate_ref(x["a"][row].unflatten(0, (HV, K)), x["A_log"], x["dt_bias"], lower_bound)
        rep = HV // H
        S, o[row], _, _ = kda_step_ref(pool[slot].float(), q[row].float().repeat_interleave(rep, 0),
                                       k[row].float().repeat_interleave(rep, 0), v[row].float(), g_log,
                                       torch.sigmoid(x["b"][row].float()), x["scale"], l2norm)
        pool[slot] = S.to(pool.dtype)
    return o, pool


def check(x, o_ref, pool_ref, before, live_slots):
    torch.testing.assert_close(x["out"][:, 0].float(), o_ref, **TOL)
    torch.testing.assert_close(x["initial_state"], pool_ref, **STATE_TOL)
    keep = torch.ones(before.shape[0], dtype=torch.bool)
    keep[list(live_slots)] = False
    assert torch.equal(x["initial_state"][keep], before[keep])


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("l2norm", [False, True])
def test_packed_decode_matches_reference(l2norm, lower_bound):
    x = inputs(4, 8, slots=[2, 0, 5, 1])  # slot 0 is live in SGLang
    before = x["initial_state"].clone()
    o_ref, pool_ref = reference(x, l2norm=l2norm, lower_bound=lower_bound)
    out, pool = call(x, use_qk_l2norm_in_kernel=l2norm, lower_bound=lower_bound)
    assert out is x["out"] and pool is x["initial_state"]
    check(x, o_ref, pool_ref, before, [2, 0, 5, 1])
    assert not torch.equal(x["initial_state"][0], before[0])


def test_default_is_no_l2_norm():
    x = inputs(2, 8, slots=[1, 3])
    o_ref, _ = reference(x, l2norm=False)
    call(x)
    torch.testing.assert_close(x["out"][:, 0].float(), o_ref, **TOL)


def test_null_rows_never_wrap():
    # -1 and the pool's size are null: zero output, and the last slot (where -1 would wrap) bitwise untouched.
    B, N = 4, 6
    x = inputs(B, 8, slots=[-1, 3, N, -1], n_slots=N, seed=1)
    before = x["initial_state"].clone()
    o_ref, pool_ref = reference(x, l2norm=True)
    call(x, use_qk_l2norm_in_kernel=True)
    for row in (0, 2, 3):
        assert torch.equal(x["out"][row], torch.zeros(1, 8, D, dtype=BF16))
    check(x, o_ref, pool_ref, before, [3])
    assert torch.equal(x["initial_state"][N - 1], before[N - 1])


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_gqa_takes_the_gate_per_value_head(lower_bound):
    # HV = 2 H: A_log and dt_bias are per value head (SGLang's indexing), q and k shared by two value heads.
    x = inputs(3, 8, 16, slots=[4, -1, 1], seed=2)
    before = x["initial_state"].clone()
    o_ref, pool_ref = reference(x, l2norm=True, lower_bound=lower_bound)
    out, _ = call(x, use_qk_l2norm_in_kernel=True, lower_bound=lower_bound)
    assert out is x["out"]
    check(x, o_ref, pool_ref, before, [4, 1])


def test_empty_batch():
    x = inputs(0, 8, slots=[], n_slots=3)
    before = x["initial_state"].clone()
    out, pool = call(x)
    assert out is x["out"] and out.shape == (0, 1, 8, D) and torch.equal(pool, before)


def test_kernel_branch_gets_the_arguments_as_they_are(monkeypatch):
    # H == HV, K = V = 128: kda-cute's packed entry (a recorder here, CPU tensors) takes SGLang's tensors unchanged,
    # with SGLang's null policy; a GQA call does not reach it.
    seen = {}

    def entry(mixed_qkv, raw_gate, raw_beta, state_pool, slot_indices, **kw):
        seen.update(kw, args=(mixed_qkv, raw_gate, raw_beta, state_pool, slot_indices))
        return kw["output"]

    monkeypatch.setattr(sglang, "_KERNEL_DEVICE_MIN", -1)
    monkeypatch.setattr(sglang, "_packed_entry", entry)
    x = inputs(2, 8, slots=[0, 1], seed=3)
    out, pool = call(x, use_qk_l2norm_in_kernel=True, lower_bound=-5.0)
    assert out is x["out"] and pool is x["initial_state"]
    for got, want in zip(seen["args"], ("mixed_qkv", "a", "b", "initial_state", "ssm_state_indices")):
        assert got is x[want]
    assert seen["output"] is x["out"] and seen["A_log"] is x["A_log"] and seen["dt_bias"] is x["dt_bias"]
    assert seen["num_heads"] == 8 and seen["null_policy"] is NullSlotPolicy.OUT_OF_RANGE
    assert seen["use_qk_l2norm_in_kernel"] is True and seen["lower_bound"] == -5.0 and seen["scale"] == x["scale"]
    seen.clear()
    x = inputs(2, 8, 16, slots=[0, 1], seed=3)
    call(x, use_qk_l2norm_in_kernel=True)
    assert not seen


@pytest.mark.parametrize("argument, change", [
    ("mixed_qkv", lambda x: dict(mixed_qkv=x["mixed_qkv"][:, :-128])),
    ("a", lambda x: dict(a=x["a"].unflatten(1, (16, D)))),
    ("b", lambda x: dict(b=x["b"][:, :-1])),
    ("initial_state", lambda x: dict(initial_state=x["initial_state"][0])),
])
def test_refuses_malformed_calls(argument, change):
    x = inputs(2, 8, 16, slots=[0, 1])  # the GQA path validates on the host; H == HV validates in the kernel
    before = x["initial_state"].clone()
    x.update(change(x))
    with pytest.raises(KDAError, match=rf"^{argument}: expected"):
        call(x)
    if argument != "initial_state":
        assert torch.equal(x["initial_state"], before)


# ---------------------------------------------------------------------------------------------------------------
# GPU


def oracle(x, *, l2norm, lower_bound):
    from kda_core.oracle import recurrent_kda_ref

    HV, V, K = x["initial_state"].shape[1:]
    B = x["mixed_qkv"].shape[0]
    H = (x["mixed_qkv"].shape[1] - HV * V) // (2 * K)
    q, k = (t.unsqueeze(1) for t in x["mixed_qkv"][:, : 2 * H * K].unflatten(1, (2 * H, K)).split(H, dim=1))
    v = x["mixed_qkv"][:, 2 * H * K :].unflatten(1, (HV, V)).unsqueeze(1)
    g = kda_gate_ref(x["a"].view(B, 1, HV, K), x["A_log"], x["dt_bias"], lower_bound)  # per value head
    return recurrent_kda_ref(q, k, v, g, x["b"].unsqueeze(1), scale=x["scale"],
                             initial_state=x["initial_state"].clone(), use_qk_l2norm_in_kernel=l2norm,
                             beta_is_logit=True, ssm_state_indices=x["ssm_state_indices"],
                             null_policy=NullSlotPolicy.OUT_OF_RANGE)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("pool_dtype", [torch.float32, BF16])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("H, HV", [(12, 12), (24, 24), (12, 24)])
def test_gpu_packed_decode_matches_oracle(H, HV, lower_bound, pool_dtype):
    B, N = 16, 20
    slots = [-1, 0] + list(range(2, B))  # -1 null, slot 0 live
    x = inputs(B, H, HV, slots=slots, n_slots=N, device="cuda", pool_dtype=pool_dtype)
    before = x["initial_state"].clone()
    o_ref, pool_ref = oracle(x, l2norm=True, lower_bound=lower_bound)
    call(x, use_qk_l2norm_in_kernel=True, lower_bound=lower_bound)
    torch.cuda.synchronize()
    torch.testing.assert_close(x["out"], o_ref, **TOL)
    state_tol = STATE_TOL if pool_dtype == torch.float32 else TOL
    torch.testing.assert_close(x["initial_state"].float(), pool_ref.float(), **state_tol)
    assert torch.equal(x["out"][0], torch.zeros_like(x["out"][0]))
    assert torch.equal(x["initial_state"][N - 1], before[N - 1])  # -1 does not wrap to the last slot


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("H, HV", [(12, 12), (12, 24)])
def test_gpu_packed_decode_matches_fla(H, HV):
    fla_fwd = pytest.importorskip("fla.ops.kda.fused_recurrent").fused_recurrent_kda_fwd
    B = 8
    x = inputs(B, H, HV, slots=list(range(B)), device="cuda")  # every slot live: FLA does not check indices
    K = D
    q, k = (t.unsqueeze(1).contiguous() for t in x["mixed_qkv"][:, : 2 * H * K].unflatten(1, (2 * H, K)).split(H, 1))
    v = x["mixed_qkv"][:, 2 * H * K :].unflatten(1, (HV, K)).unsqueeze(1).contiguous()
    pool_fla = x["initial_state"].clone()
    o_fla, _ = fla_fwd(q, k, v, x["a"].view(B, 1, HV, K), x["b"].unsqueeze(1), A_log=x["A_log"],
                       dt_bias=x["dt_bias"], scale=x["scale"], initial_state=pool_fla, inplace_final_state=True,
                       state_v_first=True, ssm_state_indices=x["ssm_state_indices"], use_qk_l2norm_in_kernel=True,
                       use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=None)
    call(x, use_qk_l2norm_in_kernel=True)
    torch.cuda.synchronize()
    torch.testing.assert_close(x["out"], o_fla.to(BF16), **TOL)
    torch.testing.assert_close(x["initial_state"], pool_fla, **STATE_TOL)
