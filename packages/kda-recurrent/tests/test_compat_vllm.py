"""``kda_recurrent.compat.vllm``: vLLM's KDA decode calls (Kimi K3, Kimi-Linear) with vLLM's semantics on kda.

The inputs are those of vLLM's ``tests/models/kimi_k3/test_kda.py`` (docs/serving.md §3): ``mixed_qkv`` the first
3·H·D columns of a [B, 3·H·D + 1] buffer, a pool whose slots are 17 elements longer than a state, slot indices
column 0 of a [B, 8] buffer numbered from 1, spec rows of a block table with accepted counts [1, 2, 3], a NaN-filled
output buffer. CPU tests run the oracle path against a token-by-token reference built here from kda-core's step
functions (an independent reading of the call: where q, k, v, the gate and beta sit, which slot is read and
written); GPU tests (``@pytest.mark.gpu``) run the kernels against kda-core's oracle and, where FLA is installed,
against FLA 0.6.0 on the same inputs.
"""

from __future__ import annotations

import pytest
import torch

from kda_core.contracts import NullSlotPolicy
from kda_core.errors import KDAError
from kda_core.oracle_step import kda_gate_ref, kda_step_ref
from kda_recurrent.compat.vllm import kimi_k3, kimi_linear

BF16 = torch.bfloat16
D = 128
HAS_CUDA = torch.cuda.is_available()
TOL = dict(rtol=2e-2, atol=2e-2)  # bf16 outputs
STATE_TOL = dict(rtol=2e-3, atol=2e-3)  # fp32 states


def gen(seed):
    return torch.Generator().manual_seed(seed)


def rnd(g, *shape, dtype=BF16, scale=1.0, device="cpu"):
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def padded_pool(g, slots, H, pad, *, scale=1.0, device="cpu", dtype=torch.float32):
    """[slots, H, D, D] view of a [slots, H*D*D + pad] buffer (slot stride H*D*D + pad)."""
    buf = rnd(g, slots, H * D * D + pad, dtype=dtype, scale=scale, device=device)
    return buf[:, : H * D * D].view(slots, H, D, D)


def slot_column(values, stride, device="cpu"):
    """int32 indices as column 0 of a zero [len, stride] buffer (index stride ``stride``)."""
    buf = torch.zeros(len(values), stride, dtype=torch.int32, device=device)
    buf[:, 0] = torch.tensor(values, dtype=torch.int32)
    return buf[:, 0]


def packed_inputs(B, H, *, seed=0, pad=17, index_stride=8, slots=None, device="cpu"):
    g = gen(seed)
    mixed = rnd(g, B, 3 * H * D + 1, device=device)[:, : 3 * H * D]
    return dict(
        mixed_qkv=mixed, raw_g=rnd(g, 1, B, H, D, device=device), raw_beta=rnd(g, 1, B, H, device=device),
        A_log=rnd(g, H, dtype=torch.float32, scale=0.5, device=device),
        dt_bias=rnd(g, H, D, dtype=torch.float32, scale=0.1, device=device),
        initial_state=padded_pool(g, B + 1, H, pad, device=device),
        state_indices=slot_column(list(range(1, B + 1)) if slots is None else slots, index_stride, device),
    )


def live(slot, n_slots, policy):
    low = 0 if policy is NullSlotPolicy.NONPOSITIVE else -1
    return low < slot < n_slots


def step_rows(q, k, v, g_raw, beta_logit, A_log, dt_bias, lower_bound, pool, slots, *, policy, l2norm=True,
              scale=None, gate=True, beta_is_logit=True):
    """T=1 reference: per row, read pool[slot], one kda step, write it back; null rows give zeros.
    q, k [B, H, K]; v [B, HV, V]; g_raw [B, HV, K]; beta_logit [B, HV]. Returns (o [B, HV, V] fp32, new pool)."""
    pool = pool.clone()
    B, H, K = q.shape
    HV = v.shape[1]
    scale = K ** -0.5 if scale is None else scale
    o = torch.zeros(B, HV, v.shape[2])
    for b, slot in enumerate(slots.tolist()):
        if not live(slot, pool.shape[0], policy):
            continue
        g_log = kda_gate_ref(g_raw[b], A_log, dt_bias, lower_bound) if gate else g_raw[b].float()
        beta = torch.sigmoid(beta_logit[b].float()) if beta_is_logit else beta_logit[b].float()
        rep = HV // H
        S, o[b], _, _ = kda_step_ref(pool[slot].float(), q[b].float().repeat_interleave(rep, 0),
                                     k[b].float().repeat_interleave(rep, 0), v[b].float(), g_log, beta, scale, l2norm)
        pool[slot] = S.to(pool.dtype)
    return o, pool


def packed_ref(x, lower_bound, policy=NullSlotPolicy.NONPOSITIVE):
    H = x["initial_state"].shape[1]
    q, k, v = x["mixed_qkv"].unflatten(1, (3 * H, D)).split(H, dim=1)
    return step_rows(q, k, v, x["raw_g"][0], x["raw_beta"][0], x["A_log"], x["dt_bias"], lower_bound,
                     x["initial_state"], x["state_indices"], policy=policy)


def assert_untouched_except(pool, before, slots):
    keep = torch.ones(pool.shape[0], dtype=torch.bool)
    keep[list(slots)] = False
    assert torch.equal(pool[keep], before[keep])


# ---------------------------------------------------------------------------------------------------------------
# Kimi K3 packed decode (CPU: the oracle path)


@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("B", [1, 8])
def test_k3_packed_decode_matches_reference(B, lower_bound):
    H = 8
    x = packed_inputs(B, H)
    before = x["initial_state"].clone()
    o_ref, pool_ref = packed_ref(x, lower_bound)
    out, pool = kimi_k3.fused_recurrent_kda_packed_decode(
        x["mixed_qkv"], x["raw_g"], x["raw_beta"], x["A_log"], x["dt_bias"], lower_bound, x["initial_state"],
        x["state_indices"])
    assert pool is x["initial_state"]
    assert out.shape == (1, B, H, D) and out.dtype == BF16  # allocated in mixed_qkv's dtype
    torch.testing.assert_close(out[0].float(), o_ref, **TOL)
    torch.testing.assert_close(pool, pool_ref, **STATE_TOL)
    assert torch.equal(pool[0], before[0])  # block 0: vLLM's null block


def test_k3_packed_decode_writes_the_given_out():
    B, H = 4, 8
    x = packed_inputs(B, H, seed=1)
    buf = torch.full((1, B, H * D + 11), float("nan"), dtype=BF16)
    out = buf[..., : H * D].unflatten(2, (H, D))
    o_ref, _ = packed_ref(x, -5.0)
    result, _ = kimi_k3.fused_recurrent_kda_packed_decode(
        x["mixed_qkv"], x["raw_g"], x["raw_beta"], x["A_log"], x["dt_bias"], -5.0, x["initial_state"],
        x["state_indices"], out=out)
    assert result is out
    torch.testing.assert_close(out[0].float(), o_ref, **TOL)
    assert torch.isnan(buf[..., H * D :]).all()  # the padding past each row is not written


def test_k3_packed_decode_null_rows_touch_nothing():
    # Under vLLM's policy 0 and negatives are null, and so is an index past the pool (kda's bound).
    B, H = 5, 8
    x = packed_inputs(B, H, seed=2, slots=[0, 3, -1, 6, 1])  # pool of B + 1 = 6 slots: 6 is past it
    before = x["initial_state"].clone()
    out = torch.full((1, B, H, D), float("nan"), dtype=BF16)
    o_ref, pool_ref = packed_ref(x, -5.0)
    kimi_k3.fused_recurrent_kda_packed_decode(
        x["mixed_qkv"], x["raw_g"], x["raw_beta"], x["A_log"], x["dt_bias"], -5.0, x["initial_state"],
        x["state_indices"], out=out)
    for row in (0, 2, 3):
        assert torch.equal(out[0, row], torch.zeros(H, D, dtype=BF16))
    torch.testing.assert_close(out[0].float(), o_ref, **TOL)
    assert_untouched_except(x["initial_state"], before, [3, 1])
    torch.testing.assert_close(x["initial_state"], pool_ref, **STATE_TOL)


def test_k3_packed_decode_calls_the_packed_kernel_with_the_tensors_as_they_are(monkeypatch):
    # The CUDA branch, taken here with CPU tensors and a recorder in place of kda-cute's entry (the token form):
    # the kernel gets the caller's tensors themselves (no view, no copy), vLLM's null policy, and the result is the
    # caller's out.
    B, H = 3, 8
    x = packed_inputs(B, H, seed=3)
    seen = {}

    def entry(mixed_qkv, raw_gate, raw_beta, state_pool, slot_indices, **kw):
        seen.update(kw, mixed_qkv=mixed_qkv, raw_gate=raw_gate, raw_beta=raw_beta, pool=state_pool,
                    slots=slot_indices)
        return kw["output"] if kw["output"] is not None else torch.empty(1, raw_gate.shape[1], H, D, dtype=BF16)

    monkeypatch.setattr(kimi_k3, "_KERNEL_DEVICE_MIN", -1)
    monkeypatch.setattr(kimi_k3, "_packed_entry", entry)
    out = torch.empty(1, B, H, D, dtype=BF16)
    result, pool = kimi_k3.fused_recurrent_kda_packed_decode(
        x["mixed_qkv"], x["raw_g"], x["raw_beta"], x["A_log"], x["dt_bias"], -5.0, x["initial_state"],
        x["state_indices"], scale=0.1, out=out)
    assert result is out and pool is x["initial_state"]
    assert seen["mixed_qkv"] is x["mixed_qkv"] and seen["pool"] is x["initial_state"]
    assert seen["slots"] is x["state_indices"]
    assert seen["raw_gate"] is x["raw_g"] and seen["raw_beta"] is x["raw_beta"] and seen["output"] is out
    assert "num_heads" not in seen and seen["null_policy"] is NullSlotPolicy.NONPOSITIVE
    assert seen["A_log"] is x["A_log"] and seen["dt_bias"] is x["dt_bias"]
    assert seen["lower_bound"] == -5.0 and seen["scale"] == 0.1
    result, _ = kimi_k3.fused_recurrent_kda_packed_decode(
        x["mixed_qkv"], x["raw_g"], x["raw_beta"], x["A_log"], x["dt_bias"], None, x["initial_state"],
        x["state_indices"])
    assert result.shape == (1, B, H, D) and result.dtype == x["mixed_qkv"].dtype  # allocated when out is None
    assert seen["lower_bound"] is None and seen["scale"] is None


def test_k3_packed_decode_empty_batch():
    x = packed_inputs(0, 8)
    before = x["initial_state"].clone()
    out, pool = kimi_k3.fused_recurrent_kda_packed_decode(
        x["mixed_qkv"], x["raw_g"], x["raw_beta"], x["A_log"], x["dt_bias"], -5.0, x["initial_state"],
        x["state_indices"])
    assert out.shape == (1, 0, 8, D) and pool is x["initial_state"] and torch.equal(pool, before)


@pytest.mark.parametrize("argument, change", [
    ("raw_g", lambda x: dict(raw_g=x["raw_g"][0])),  # [B, H, K]: not vLLM's [1, B, H, K]
    ("raw_g", lambda x: dict(raw_g=x["raw_g"].transpose(2, 3))),  # [H, K] of a token not compact
    ("raw_beta", lambda x: dict(raw_beta=x["raw_beta"][0])),
    ("initial_state", lambda x: dict(initial_state=x["initial_state"][0])),
])
def test_k3_packed_decode_refuses_malformed_calls(argument, change):
    B, H = 2, 8
    x = packed_inputs(B, H, seed=4)
    before = x["initial_state"].clone()
    x.update(change(x))
    with pytest.raises(KDAError, match=rf"^{argument}: expected"):
        kimi_k3.fused_recurrent_kda_packed_decode(
            x["mixed_qkv"], x["raw_g"], x["raw_beta"], x["A_log"], x["dt_bias"], -5.0, x["initial_state"],
            x["state_indices"])
    if argument != "initial_state":
        assert torch.equal(x["initial_state"], before)


# ---------------------------------------------------------------------------------------------------------------
# Kimi K3 speculative decode


def spec_inputs(H, *, seed=0, device="cpu", rows=((1, 2, 3), (4, 5, 6), (7, 8, 9)), accepted=(1, 2, 3)):
    """vLLM's spec-decode test inputs: 3 requests x 3 tokens, strided views of padded buffers."""
    g = gen(seed)
    n, T = len(rows), len(rows[0])
    ntok = n * T
    qkv = rnd(g, 1, ntok, 3 * H * D + 7, device=device)[..., : 3 * H * D].unflatten(2, (3 * H, D))
    q, k, v = qkv.split(H, dim=2)
    table = torch.zeros(n, T + 2, dtype=torch.int32)  # block-table rows: row stride T + 2, column stride 1
    table[:, :T] = torch.tensor(rows, dtype=torch.int32)
    return dict(
        q=q, k=k, v=v,
        raw_g=rnd(g, 1, ntok, H * D + 5, device=device)[..., : H * D].unflatten(2, (H, D)),
        raw_beta=rnd(g, 1, ntok, H + 1, device=device)[..., :H],
        A_log=rnd(g, H, dtype=torch.float32, scale=0.5, device=device),
        dt_bias=rnd(g, H * D, dtype=torch.float32, scale=0.1, device=device),
        initial_state=padded_pool(g, 10, H, 17, scale=0.01, device=device),
        cu_seqlens=torch.arange(0, ntok + 1, T, dtype=torch.int32, device=device),
        ssm_state_indices=table.to(device)[:, :T],
        num_accepted_tokens=torch.tensor(accepted, dtype=torch.int32, device=device),
    )


def spec_ref(x, lower_bound):
    """Per request: read column nat - 1 (a row with nat outside [1, T] is null), then after token t write column t
    when that slot is live (else the token is skipped: zero output, the state does not absorb it)."""
    pool = x["initial_state"].clone()
    T = x["ssm_state_indices"].shape[1]
    H, K = x["q"].shape[2], x["q"].shape[3]
    o = torch.zeros(x["v"].shape[1], H, D)
    n_slots = pool.shape[0]
    for n, (row, nat) in enumerate(zip(x["ssm_state_indices"].tolist(), x["num_accepted_tokens"].tolist())):
        if not 1 <= nat <= T or not live(row[nat - 1], n_slots, NullSlotPolicy.NONPOSITIVE):
            continue
        S = pool[row[nat - 1]].float()
        for t in range(T):
            i = n * T + t
            if not live(row[t], n_slots, NullSlotPolicy.NONPOSITIVE):
                continue
            g_log = kda_gate_ref(x["raw_g"][0, i], x["A_log"], x["dt_bias"], lower_bound)
            S, o[i], _, _ = kda_step_ref(S, x["q"][0, i].float(), x["k"][0, i].float(), x["v"][0, i].float(), g_log,
                                         torch.sigmoid(x["raw_beta"][0, i].float()), K ** -0.5)
            pool[row[t]] = S.to(pool.dtype)
    return o, pool


def spec_call(x, lower_bound, **kw):
    return kimi_k3.fused_recurrent_kda(
        x["q"], x["k"], x["v"], x["raw_g"], x["raw_beta"], x["A_log"], x["dt_bias"], lower_bound, x["initial_state"],
        x["cu_seqlens"], x["ssm_state_indices"], x["num_accepted_tokens"], **kw)


@pytest.mark.parametrize("fuse_gate", [None, True, False])
def test_k3_spec_decode_matches_reference(fuse_gate):
    H = 8
    x = spec_inputs(H)
    before = x["initial_state"].clone()
    buf = torch.full((1, 9, H * D + 11), float("nan"), dtype=BF16)
    out = buf[..., : H * D].unflatten(2, (H, D))
    o_ref, pool_ref = spec_ref(x, -5.0)
    result, pool = spec_call(x, -5.0, out=out, fuse_gate=fuse_gate)
    assert result is out and pool is x["initial_state"]
    assert torch.isnan(buf[..., H * D :]).all()
    torch.testing.assert_close(out[0].float(), o_ref, **TOL)
    torch.testing.assert_close(pool, pool_ref, **STATE_TOL)
    assert torch.equal(pool[0], before[0])


def test_k3_spec_decode_null_rows_and_tokens():
    # Row 0: nat 0 -> null as a whole; row 1: nat 4 > T -> null as a whole; row 2: slot 0 in column 1 -> token 1
    # skipped, tokens 0 and 2 run.
    H = 8
    x = spec_inputs(H, seed=5, rows=((1, 2, 3), (4, 5, 6), (7, 0, 9)), accepted=(0, 4, 1))
    before = x["initial_state"].clone()
    o_ref, pool_ref = spec_ref(x, None)
    out, pool = spec_call(x, None)
    assert torch.equal(out[0, :6], torch.zeros(6, H, D, dtype=BF16))
    assert torch.equal(out[0, 7], torch.zeros(H, D, dtype=BF16))
    torch.testing.assert_close(out[0].float(), o_ref, **TOL)
    assert_untouched_except(pool, before, [7, 9])
    torch.testing.assert_close(pool, pool_ref, **STATE_TOL)


def test_k3_spec_decode_refuses_bad_fuse_gate():
    x = spec_inputs(8)
    with pytest.raises(KDAError, match=r"^fuse_gate: expected"):
        spec_call(x, -5.0, fuse_gate="yes")


# ---------------------------------------------------------------------------------------------------------------
# Kimi-Linear (the shared KDA layer)


def linear_inputs(N, H, *, seed=0, slots, extra=2, device="cpu"):
    """The layer's decode call: [1, N, H, K] q, k, v; a log-space gate and a sigmoided fp32 beta; slot indices for
    every decode row (``extra`` more than the ``cu_seqlens`` sequences, as the layer passes them)."""
    g = gen(seed)
    A_log = rnd(g, 1, 1, H, 1, dtype=torch.float32, scale=0.5, device=device)
    dt_bias = rnd(g, H * D, dtype=torch.float32, scale=0.1, device=device)
    raw = rnd(g, 1, N, H, D, device=device)
    return dict(
        q=rnd(g, 1, N, H, D, device=device), k=rnd(g, 1, N, H, D, device=device),
        v=rnd(g, 1, N, H, D, device=device), raw=raw, A_log=A_log, dt_bias=dt_bias,
        g=kda_gate_ref(raw, A_log.reshape(-1), dt_bias, None),
        beta_logit=rnd(g, 1, N, H, device=device),
        initial_state=rnd(g, N + 3, H, D, D, dtype=torch.float32, scale=0.1, device=device),
        cu_seqlens=torch.arange(N + 1, dtype=torch.int32, device=device),
        ssm_state_indices=torch.tensor(list(slots) + [1] * extra, dtype=torch.int32, device=device),
    )


def linear_ref(x, *, compute_gate=False, lower_bound=None):
    N = x["q"].shape[1]
    g_raw = x["raw"][0] if compute_gate else x["g"][0]
    return step_rows(x["q"][0], x["k"][0], x["v"][0], g_raw, x["beta_logit"][0], x["A_log"].reshape(-1),
                     x["dt_bias"], lower_bound, x["initial_state"], x["ssm_state_indices"][:N],
                     policy=NullSlotPolicy.NONPOSITIVE, gate=compute_gate)


def test_kimi_linear_decode_call_matches_reference():
    N, H = 4, 8
    x = linear_inputs(N, H, slots=[2, 0, 5, 1])  # slot 0: a padding row under vLLM's policy
    before = x["initial_state"].clone()
    o_ref, pool_ref = linear_ref(x)
    beta = torch.sigmoid(x["beta_logit"].float())  # the layer's beta: sigmoided in fp32 in the projection
    o, final = kimi_linear.fused_recurrent_kda(
        q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=beta, initial_state=x["initial_state"],
        use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu_seqlens"], ssm_state_indices=x["ssm_state_indices"])
    assert final is x["initial_state"] and o.shape == (1, N, H, D)
    torch.testing.assert_close(o[0].float(), o_ref, **TOL)
    torch.testing.assert_close(final, pool_ref, **STATE_TOL)
    assert torch.equal(o[0, 1], torch.zeros(H, D, dtype=BF16))
    assert_untouched_except(final, before, [2, 5, 1])


def test_kimi_linear_compute_gate_and_sigmoid_beta():
    N, H = 3, 8
    x = linear_inputs(N, H, seed=1, slots=[3, 1, 2], extra=0)
    o_ref, pool_ref = linear_ref(x, compute_gate=True, lower_bound=-5.0)
    out = torch.empty(1, N, H, D, dtype=BF16)
    o, final = kimi_linear.fused_recurrent_kda(
        x["q"], x["k"], x["v"], x["raw"], x["beta_logit"], initial_state=x["initial_state"],
        cu_seqlens=x["cu_seqlens"], ssm_state_indices=x["ssm_state_indices"], out=out, sigmoid_beta=True,
        a_log=x["A_log"], g_bias=x["dt_bias"], compute_gate=True, lower_bound=-5.0)
    assert o is out
    torch.testing.assert_close(o[0].float(), o_ref, **TOL)
    torch.testing.assert_close(final, pool_ref, **STATE_TOL)


@pytest.mark.parametrize("argument, change", [
    ("kwargs", dict(head_first=False)),
    ("beta", dict(beta=None)),
    ("inplace_final_state", dict(inplace_final_state=False)),
    ("ssm_state_indices", dict(ssm_state_indices=None)),
    ("initial_state", dict(initial_state=None)),
    ("a_log", dict(compute_gate=True, a_log=None)),
    ("lower_bound", dict(compute_gate=True, lower_bound=None)),
    ("compute_gate", dict(compute_gate=1)),
])
def test_kimi_linear_refuses_what_the_layer_does_not_pass(argument, change):
    N, H = 2, 8
    x = linear_inputs(N, H, slots=[1, 2], extra=0)
    before = x["initial_state"].clone()
    kw = dict(beta=torch.sigmoid(x["beta_logit"].float()), initial_state=x["initial_state"],
              cu_seqlens=x["cu_seqlens"], ssm_state_indices=x["ssm_state_indices"], a_log=x["A_log"],
              g_bias=x["dt_bias"])
    kw.update(change)
    with pytest.raises(KDAError, match=rf"^{argument}: expected"):
        kimi_linear.fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], **kw)
    assert torch.equal(x["initial_state"], before)


# ---------------------------------------------------------------------------------------------------------------
# GPU: the kernels against kda-core's oracle, and against FLA 0.6.0 where it is installed


def oracle(*args, **kw):
    from kda_core.oracle import recurrent_kda_ref

    return recurrent_kda_ref(*args, null_policy=NullSlotPolicy.NONPOSITIVE, **kw)


def packed_oracle(x, lower_bound):
    H = x["initial_state"].shape[1]
    q, k, v = (t.unsqueeze(1) for t in x["mixed_qkv"].unflatten(1, (3 * H, D)).split(H, dim=1))
    pool = x["initial_state"].clone()
    o, pool = oracle(q, k, v, x["raw_g"].transpose(0, 1), x["raw_beta"].transpose(0, 1), A_log=x["A_log"],
                     dt_bias=x["dt_bias"], initial_state=pool, use_gate_in_kernel=True, lower_bound=lower_bound,
                     beta_is_logit=True, ssm_state_indices=x["state_indices"])
    return o.transpose(0, 1), pool


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("index_stride", [1, 8])
@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("B", [1, 8, 32])
@pytest.mark.parametrize("H", [12, 24])
def test_gpu_k3_packed_decode_matches_oracle(H, B, lower_bound, index_stride):
    x = packed_inputs(B, H, device="cuda", index_stride=index_stride)
    o_ref, pool_ref = packed_oracle(x, lower_bound)
    out, pool = kimi_k3.fused_recurrent_kda_packed_decode(
        x["mixed_qkv"], x["raw_g"], x["raw_beta"], x["A_log"], x["dt_bias"], lower_bound, x["initial_state"],
        x["state_indices"])
    torch.cuda.synchronize()
    torch.testing.assert_close(out, o_ref, **TOL)
    torch.testing.assert_close(pool, pool_ref, **STATE_TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("H", [12, 24])
def test_gpu_k3_packed_decode_null_rows(H):
    B = 6
    x = packed_inputs(B, H, device="cuda", slots=[0, 3, -1, 7, 1, 0])  # 7 is past the 7-slot pool's last (6)
    before = x["initial_state"].clone()
    out = torch.full((1, B, H, D), float("nan"), dtype=BF16, device="cuda")
    kimi_k3.fused_recurrent_kda_packed_decode(
        x["mixed_qkv"], x["raw_g"], x["raw_beta"], x["A_log"], x["dt_bias"], -5.0, x["initial_state"],
        x["state_indices"], out=out)
    torch.cuda.synchronize()
    for row in (0, 2, 3, 5):
        assert torch.equal(out[0, row], torch.zeros(H, D, dtype=BF16, device="cuda"))
    keep = torch.ones(B + 1, dtype=torch.bool)
    keep[[3, 1]] = False
    assert torch.equal(x["initial_state"][keep], before[keep])  # slot 0 bitwise untouched


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("fuse_gate", [None, False])
@pytest.mark.parametrize("H", [12, 24])
def test_gpu_k3_spec_decode_matches_oracle(H, fuse_gate):
    x = spec_inputs(H, device="cuda")
    pool = x["initial_state"].clone()
    o_ref, pool_ref = oracle(x["q"], x["k"], x["v"], x["raw_g"], x["raw_beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                             initial_state=pool, use_gate_in_kernel=True, lower_bound=-5.0, beta_is_logit=True,
                             cu_seqlens=x["cu_seqlens"], ssm_state_indices=x["ssm_state_indices"],
                             num_accepted_tokens=x["num_accepted_tokens"])
    buf = torch.full((1, 9, H * D + 11), float("nan"), dtype=BF16, device="cuda")
    out = buf[..., : H * D].unflatten(2, (H, D))
    result, _ = spec_call(x, -5.0, out=out, fuse_gate=fuse_gate)
    torch.cuda.synchronize()
    assert result is out and torch.isnan(buf[..., H * D :]).all()
    torch.testing.assert_close(out, o_ref, **TOL)
    torch.testing.assert_close(x["initial_state"], pool_ref, rtol=3e-3, atol=3e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("H", [12, 24])
def test_gpu_kimi_linear_decode_matches_oracle(H):
    N = 16
    x = linear_inputs(N, H, device="cuda", slots=[0] + list(range(2, N + 1)))
    beta = torch.sigmoid(x["beta_logit"].float())
    pool = x["initial_state"].clone()
    o_ref, pool_ref = oracle(x["q"], x["k"], x["v"], x["g"], beta, initial_state=pool, cu_seqlens=x["cu_seqlens"],
                             ssm_state_indices=x["ssm_state_indices"][:N])
    o, final = kimi_linear.fused_recurrent_kda(
        q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=beta, initial_state=x["initial_state"],
        use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu_seqlens"], ssm_state_indices=x["ssm_state_indices"])
    torch.cuda.synchronize()
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(final, pool_ref, **STATE_TOL)


def _fla_fwd():
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    return pytest.importorskip("fla.ops.kda.fused_recurrent").fused_recurrent_kda_fwd


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("H", [12, 24])
def test_gpu_k3_packed_decode_matches_fla(H, lower_bound):
    # FLA takes the same call on compact copies (its pool and indices: contiguous); every slot is live, since FLA
    # does not check indices.
    fla_fwd = _fla_fwd()
    B = 8
    x = packed_inputs(B, H, device="cuda")
    q, k, v = (t.unsqueeze(1).contiguous() for t in x["mixed_qkv"].unflatten(1, (3 * H, D)).split(H, dim=1))
    pool_fla = x["initial_state"].contiguous()
    o_fla, _ = fla_fwd(q, k, v, x["raw_g"].transpose(0, 1).contiguous(), x["raw_beta"].transpose(0, 1).contiguous(),
                       A_log=x["A_log"], dt_bias=x["dt_bias"].reshape(-1), initial_state=pool_fla,
                       inplace_final_state=True, state_v_first=True, ssm_state_indices=x["state_indices"].contiguous(),
                       use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                       lower_bound=lower_bound)
    out, pool = kimi_k3.fused_recurrent_kda_packed_decode(
        x["mixed_qkv"], x["raw_g"], x["raw_beta"], x["A_log"], x["dt_bias"], lower_bound, x["initial_state"],
        x["state_indices"])
    torch.cuda.synchronize()
    torch.testing.assert_close(out, o_fla.transpose(0, 1).to(BF16), **TOL)
    torch.testing.assert_close(pool, pool_fla, **STATE_TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("H", [12, 24])
def test_gpu_k3_spec_decode_matches_fla(H):
    fla_fwd = _fla_fwd()
    x = spec_inputs(H, device="cuda")
    pool_fla = x["initial_state"].contiguous()
    o_fla, _ = fla_fwd(*(x[n].contiguous() for n in ("q", "k", "v", "raw_g", "raw_beta")), A_log=x["A_log"],
                       dt_bias=x["dt_bias"], initial_state=pool_fla, inplace_final_state=True, state_v_first=True,
                       cu_seqlens=x["cu_seqlens"], ssm_state_indices=x["ssm_state_indices"].contiguous(),
                       num_accepted_tokens=x["num_accepted_tokens"], use_qk_l2norm_in_kernel=True,
                       use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)
    out, pool = spec_call(x, -5.0)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, o_fla.to(BF16), **TOL)
    torch.testing.assert_close(pool, pool_fla, rtol=3e-3, atol=3e-3)
