"""The ucache API on the CPU (oracle path): capacity rules, allocators, the caller's commit, and the end-to-end
promise of docs/design.md §5 — a serving loop of verify steps and commits gives, for every draft token, the output of
the plain recurrence over the accepted token stream, through flushes and a wrapped ring."""

from __future__ import annotations

import pytest
import torch

from kda_core.contracts import RING_SLOTS, NullSlotPolicy, default_flush_min, max_flush_min, max_hist_len
from kda_core.errors import KDAError
from kda_core.oracle import recurrent_kda_ref, ucache_verify_flush_ref
from kda_recurrent.ucache import (
    allocate_cursors,
    allocate_ucache,
    commit_ucache,
    kda_delta_rule_mtp_ucache_flush,
)

K = 128


def make_inputs(B=2, T=4, H=8, N=4, seed=0, hist=None, base=None):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    k_cache, u_cache, g_cache = allocate_ucache(N, H, "cpu")
    hist_len, cache_base = allocate_cursors(B, "cpu")
    if hist is not None:
        hist_len.fill_(hist)
        kk = randn(N, H, RING_SLOTS, K)
        k_cache.copy_((kk / kk.norm(dim=-1, keepdim=True)).bfloat16())
        u_cache.copy_(randn(N, H, RING_SLOTS, K).bfloat16())
        g_cache.copy_((-0.3 * torch.rand(N, H, RING_SLOTS, K, generator=gen)).cumsum(2))
    if base is not None:
        cache_base.fill_(base)
    return dict(
        A_log=torch.log(torch.rand(H, generator=gen) * 15 + 1), g=randn(B, T, H, K).bfloat16(),
        dt_bias=randn(H * K, scale=0.5), q=randn(B, T, H, K).bfloat16(), k=randn(B, T, H, K).bfloat16(),
        v=randn(B, T, H, K).bfloat16(), b=randn(B, T, H).bfloat16(),
        initial_state_source=randn(N, H, K, K, scale=0.1).bfloat16(),
        initial_state_indices=torch.randperm(N, generator=gen)[:B].to(torch.int32),
        k_cache=k_cache, u_cache=u_cache, g_cache=g_cache, hist_len=hist_len, cache_base=cache_base,
    )  # fmt: skip


def clone(inputs):
    return {n: t.clone() for n, t in inputs.items()}


def call(inputs, **kw):
    x = dict(inputs)
    return kda_delta_rule_mtp_ucache_flush(x.pop("A_log"), x.pop("g"), x.pop("dt_bias"), **x, **kw)


# ---------------------------------------------------------------------------------------------------------------
# the call on the oracle path


def test_cpu_call_equals_the_oracle_and_updates_in_place():
    x = make_inputs(hist=default_flush_min(4, 16), base=30)
    mine, ref = clone(x), clone(x)
    out = call(mine)
    expected = ucache_verify_flush_ref(
        ref["A_log"], ref["g"], ref["dt_bias"], -5.0, **{n: t for n, t in ref.items()
                                                          if n not in ("A_log", "g", "dt_bias")})  # fmt: skip
    assert out.dtype == torch.bfloat16 and out.shape == (2, 4, 8, K)
    assert torch.equal(out, expected)
    for name in ("initial_state_source", "k_cache", "u_cache", "g_cache", "hist_len", "cache_base"):
        assert torch.equal(mine[name], ref[name]), name
    assert not torch.equal(mine["initial_state_source"], x["initial_state_source"])  # the rows flushed


def test_output_argument_is_filled_and_returned():
    x = make_inputs()
    out = torch.empty(2, 4, 8, K, dtype=torch.bfloat16)
    assert call(clone(x), output=out) is out
    assert torch.equal(out, call(clone(x)))


def test_restart_hist_on_flush_applies_the_flush_part_of_the_commit():
    fm = default_flush_min(4, 16)
    x = make_inputs(hist=fm, base=25)
    restarted, kept = clone(x), clone(x)
    call(restarted)
    call(kept, restart_hist_on_flush=False)
    assert restarted["hist_len"].tolist() == [0, 0]
    assert restarted["cache_base"].tolist() == [(25 + fm) % RING_SLOTS] * 2
    assert kept["hist_len"].tolist() == [fm, fm] and kept["cache_base"].tolist() == [25, 25]
    # committing afterwards lands on the same cursors either way
    accepted = torch.tensor([2, 3])
    commit_ucache(restarted["hist_len"], restarted["cache_base"], accepted)
    commit_ucache(kept["hist_len"], kept["cache_base"], accepted, flush_min=fm)
    assert torch.equal(restarted["hist_len"], kept["hist_len"])
    assert torch.equal(restarted["cache_base"], kept["cache_base"])


def test_inactive_rows_are_zero_and_touch_nothing():
    x = make_inputs(hist=default_flush_min(4, 16))
    x["initial_state_indices"] = torch.tensor([-1, 4], dtype=torch.int32)  # N = 4: both out of range
    mine = clone(x)
    out = call(mine)
    assert torch.equal(out, torch.zeros_like(out))
    for name in ("initial_state_source", "k_cache", "u_cache", "g_cache", "hist_len", "cache_base"):
        assert torch.equal(mine[name], x[name]), name


@pytest.mark.parametrize("policy", ["nonpositive", NullSlotPolicy.NONPOSITIVE])
def test_a_row_at_slot_0_is_null_under_the_nonpositive_policy(policy):
    x = make_inputs(B=3, N=4, hist=default_flush_min(4, 16), base=6)
    x["initial_state_indices"] = torch.tensor([0, 2, 0], dtype=torch.int64)  # vLLM's padding slot, twice
    mine, ref = clone(x), clone(x)
    out = call(mine, null_policy=policy)
    expected = ucache_verify_flush_ref(
        ref["A_log"], ref["g"], ref["dt_bias"], -5.0, null_policy="nonpositive",
        **{n: t for n, t in ref.items() if n not in ("A_log", "g", "dt_bias")})  # fmt: skip
    assert torch.equal(out, expected) and torch.count_nonzero(out[[0, 2]]) == 0 and torch.count_nonzero(out[1]) > 0
    for name in ("initial_state_source", "k_cache", "u_cache", "g_cache"):
        assert torch.equal(mine[name][0], x[name][0]), name  # slot 0 never touched
        assert torch.equal(mine[name], ref[name]), name
    assert mine["hist_len"][[0, 2]].tolist() == x["hist_len"][[0, 2]].tolist()
    # the default policy runs slot 0
    assert torch.count_nonzero(call(clone(x) | {"initial_state_indices": torch.tensor([0, 2, 1])})[0]) > 0


def test_a_bad_null_policy_is_named():
    with pytest.raises(KDAError, match="^null_policy: expected"):
        call(make_inputs(), null_policy="zero")


def test_debug_validation_lets_slot_0_repeat_under_nonpositive(monkeypatch):
    monkeypatch.setenv("KDA_DEBUG_VALIDATE", "1")
    x = make_inputs(B=2)
    x["initial_state_indices"] = torch.tensor([0, 0], dtype=torch.int32)
    with pytest.raises(KDAError, match="^initial_state_indices: expected distinct"):
        call(clone(x))
    call(clone(x), null_policy="nonpositive")


def test_w_ring_comes_from_the_knob_when_not_passed(monkeypatch):
    x = make_inputs()
    monkeypatch.setenv("KDA_UCACHE_WRING", "32")
    with pytest.raises(KDAError, match="flush_min"):
        call(clone(x), flush_min=9)  # legal for w_ring 16, not for 32
    call(clone(x), flush_min=17)
    monkeypatch.setenv("KDA_UCACHE_WRING", "24")
    with pytest.raises(KDAError, match="KDA_UCACHE_WRING"):
        call(clone(x))


# ---------------------------------------------------------------------------------------------------------------
# capacity rules


@pytest.mark.parametrize("T,w_ring", [(4, 16), (8, 16), (4, 32), (8, 32)])
def test_flush_min_above_the_ring_capacity_is_rejected(T, w_ring):
    x = make_inputs(T=T)
    top = max_flush_min(T, w_ring)
    call(clone(x), flush_min=top, w_ring=w_ring)
    with pytest.raises(KDAError, match="flush_min") as err:
        call(clone(x), flush_min=top + 1, w_ring=w_ring)
    assert str(top + 1) in str(err.value)


def test_w_ring_32_needs_flush_min_above_16():
    with pytest.raises(KDAError, match="flush_min"):
        call(make_inputs(T=4), flush_min=16, w_ring=32)


@pytest.mark.parametrize("T", [1, 2, 6, 16])
def test_draft_lengths_other_than_4_and_8_are_rejected(T):
    with pytest.raises(KDAError, match="T"):
        call(make_inputs(T=T))


@pytest.mark.parametrize("w_ring", [8, 24, 64])
def test_w_ring_other_than_16_and_32_is_rejected(w_ring):
    with pytest.raises(KDAError, match="w_ring"):
        call(make_inputs(), w_ring=w_ring)


def test_ring_shorter_than_the_pool_is_rejected():
    x = make_inputs()
    x["g_cache"] = x["g_cache"][:3]
    with pytest.raises(KDAError, match="g_cache"):
        call(x)


def test_out_of_range_cursors_raise_under_debug_validation(monkeypatch):
    x = make_inputs(T=8)
    x["hist_len"].fill_(max_hist_len(8, 16) + 1)
    monkeypatch.setenv("KDA_DEBUG_VALIDATE", "1")
    with pytest.raises(KDAError, match="hist_len"):
        call(clone(x))
    x["hist_len"].fill_(0)
    x["cache_base"].fill_(RING_SLOTS)
    with pytest.raises(KDAError, match="cache_base"):
        call(clone(x))


def test_duplicate_active_slots_raise_under_debug_validation(monkeypatch):
    x = make_inputs()
    x["initial_state_indices"] = torch.tensor([1, 1], dtype=torch.int32)
    monkeypatch.setenv("KDA_DEBUG_VALIDATE", "1")
    with pytest.raises(KDAError, match="initial_state_indices"):
        call(x)


# ---------------------------------------------------------------------------------------------------------------
# allocators and the commit


def test_allocators_return_zeroed_rings_and_cursors():
    k_cache, u_cache, g_cache = allocate_ucache(5, 12, "cpu")
    assert k_cache.shape == u_cache.shape == g_cache.shape == (5, 12, RING_SLOTS, K)
    assert (k_cache.dtype, u_cache.dtype, g_cache.dtype) == (torch.bfloat16, torch.bfloat16, torch.float32)
    assert not k_cache.any() and not u_cache.any() and not g_cache.any()
    hist_len, cache_base = allocate_cursors(7, "cpu")
    assert hist_len.dtype == cache_base.dtype == torch.int32 and hist_len.shape == cache_base.shape == (7,)
    assert not hist_len.any() and not cache_base.any()
    with pytest.raises(KDAError, match="pool_rows"):
        allocate_ucache(0, 12, "cpu")
    with pytest.raises(KDAError, match="batch"):
        allocate_cursors(-1, "cpu")


def test_commit_without_flush_min_adds_the_accepted_tokens():
    hist_len = torch.tensor([0, 5, 9], dtype=torch.int32)
    cache_base = torch.tensor([3, 31, 0], dtype=torch.int32)
    commit_ucache(hist_len, cache_base, torch.tensor([1, 4, 8]))
    assert hist_len.tolist() == [1, 9, 17] and cache_base.tolist() == [3, 31, 0]


def test_commit_with_flush_min_slides_the_base_of_flushed_rows():
    hist_len = torch.tensor([8, 9, 12], dtype=torch.int32)
    cache_base = torch.tensor([3, 30, 20], dtype=torch.int32)
    commit_ucache(hist_len, cache_base, torch.tensor([2, 3, 1], dtype=torch.int32), flush_min=9)
    assert hist_len.tolist() == [10, 3, 1]
    assert cache_base.tolist() == [3, (30 + 9) % 32, (20 + 12) % 32]


@pytest.mark.parametrize("bad", ["hist_len", "cache_base", "accepted"])
def test_commit_rejects_wrong_dtypes_and_shapes(bad):
    args = dict(hist_len=torch.zeros(3, dtype=torch.int32), cache_base=torch.zeros(3, dtype=torch.int32),
                accepted=torch.ones(3, dtype=torch.int32))  # fmt: skip
    args[bad] = torch.zeros(3, dtype=torch.float32) if bad != "accepted" else torch.ones(4, dtype=torch.int32)
    name = "num_accepted_tokens" if bad == "accepted" else bad
    with pytest.raises(KDAError, match=name):
        commit_ucache(args["hist_len"], args["cache_base"], args["accepted"])


# ---------------------------------------------------------------------------------------------------------------
# the serving loop


@pytest.mark.parametrize("restart", [True, False])
def test_serving_loop_matches_the_plain_recurrence_over_accepted_tokens(restart):
    """Steps of T drafts, random acceptance, commits: each draft output equals the recurrence from the state
    after all accepted tokens so far, through several flushes and ring wraps."""
    B, T, H, N, steps = 2, 4, 8, 3, 9
    gen = torch.Generator().manual_seed(7)
    fm = default_flush_min(T, 16)
    x = make_inputs(B=B, T=T, H=H, N=N, seed=1)
    x["initial_state_indices"] = torch.tensor([2, 0], dtype=torch.int32)
    dense = x["initial_state_source"][x["initial_state_indices"].long()].float()  # [B, H, V, K]
    flushes = 0
    for step in range(steps):
        drafts = {n: (torch.randn(B, T, H, K, generator=gen)).bfloat16() for n in ("q", "k", "v", "g")}
        drafts["b"] = torch.randn(B, T, H, generator=gen).bfloat16()
        x.update(drafts)
        flushes += int((x["hist_len"] >= fm).sum())
        out = call(x, restart_hist_on_flush=restart)
        expected, _ = recurrent_kda_ref(
            drafts["q"], drafts["k"], drafts["v"], drafts["g"], drafts["b"], A_log=x["A_log"], dt_bias=x["dt_bias"],
            initial_state=dense, use_gate_in_kernel=True, lower_bound=-5.0, beta_is_logit=True,
        )  # fmt: skip
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2, msg=f"step {step}")
        accepted = torch.randint(1, T + 1, (B,), generator=gen)
        flush_min = None if restart else fm
        commit_ucache(x["hist_len"], x["cache_base"], accepted, flush_min=flush_min)
        # advance the plain recurrence by each request's accepted prefix
        for i in range(B):
            n = int(accepted[i])
            _, state = recurrent_kda_ref(
                drafts["q"][i : i + 1, :n], drafts["k"][i : i + 1, :n], drafts["v"][i : i + 1, :n],
                drafts["g"][i : i + 1, :n], drafts["b"][i : i + 1, :n], A_log=x["A_log"], dt_bias=x["dt_bias"],
                initial_state=dense[i : i + 1], output_final_state=True, use_gate_in_kernel=True, lower_bound=-5.0,
                beta_is_logit=True,
            )  # fmt: skip
            dense[i] = state[0]
    assert flushes >= 2
    assert int(x["cache_base"].max()) > 0


# ---------------------------------------------------------------------------------------------------------------
# on the GPU: the kernel behind the same API, and CUDA-graph capture of a whole step


def test_dt_bias_is_optional_and_means_zeros():
    x = make_inputs(hist=default_flush_min(4, 16))
    absent, zeros = clone(x), clone(x)
    absent["dt_bias"] = None
    zeros["dt_bias"] = torch.zeros_like(x["dt_bias"])
    assert torch.equal(call(absent), call(zeros))
    for name in ("initial_state_source", "k_cache", "u_cache", "g_cache", "hist_len", "cache_base"):
        assert torch.equal(absent[name], zeros[name]), name


def test_cursors_that_alias_each_other_are_refused():
    x = make_inputs()
    x["cache_base"] = x["hist_len"]
    with pytest.raises(KDAError, match="^cache_base: expected a tensor that shares no byte with hist_len"):
        call(x)


def test_meta_tensors_are_refused_on_the_cpu_path():
    x = {n: t.to("meta") for n, t in make_inputs().items()}
    with pytest.raises(KDAError, match="^q: expected tensors with data"):
        call(x)


def test_an_output_that_requires_grad_is_written():
    x = make_inputs()
    out = torch.zeros(2, 4, 8, K, dtype=torch.bfloat16, requires_grad=True)
    assert call(clone(x), output=out) is out
    assert torch.equal(out.detach(), call(clone(x)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_call_without_dt_bias_matches_the_oracle_with_zeros():
    x = cuda_inputs(B=2, T=4, H=8, N=4, hist=5, base=3, seed=5)
    mine, ref = clone(x), clone(x)
    mine["dt_bias"] = None
    out = call(mine)
    expected = ucache_verify_flush_ref(
        ref["A_log"], ref["g"], None, -5.0, out_dtype=None,
        **{n: t for n, t in ref.items() if n not in ("A_log", "g", "dt_bias")},
    )  # fmt: skip
    torch.testing.assert_close(out.float(), expected, atol=8e-3, rtol=8e-3)


def cuda_inputs(**kw):
    return {n: t.cuda() for n, t in make_inputs(**kw).items()}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("restart", [True, False])
def test_gpu_call_matches_the_oracle(restart):
    x = cuda_inputs(B=4, T=8, H=12, N=9, hist=9, base=27, seed=3)
    x["initial_state_indices"] = torch.tensor([5, -1, 0, 8], dtype=torch.int32, device="cuda")
    mine, ref = clone(x), clone(x)
    out = call(mine, restart_hist_on_flush=restart)
    expected = ucache_verify_flush_ref(
        ref["A_log"], ref["g"], ref["dt_bias"], -5.0, restart_hist_on_flush=restart, out_dtype=None,
        **{n: t for n, t in ref.items() if n not in ("A_log", "g", "dt_bias")},
    )  # fmt: skip
    torch.testing.assert_close(out.float(), expected, atol=8e-3, rtol=8e-3)
    torch.testing.assert_close(mine["initial_state_source"].float(), ref["initial_state_source"].float(),
                               atol=2e-2, rtol=1e-2)  # fmt: skip
    for name in ("k_cache", "u_cache"):
        torch.testing.assert_close(mine[name].float(), ref[name].float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(mine["g_cache"], ref["g_cache"], atol=1e-4, rtol=1e-5)
    assert torch.equal(mine["hist_len"], ref["hist_len"]) and torch.equal(mine["cache_base"], ref["cache_base"])


def _odd_rows(t, pad):
    """The same values in a tensor whose dim-0 stride is ``pad`` elements longer than the row."""
    row = t[0].numel()
    flat = torch.zeros(t.shape[0] * (row + pad), dtype=t.dtype, device=t.device)
    out = flat.as_strided(t.shape, (row + pad, *t.stride()[1:]))
    out.copy_(t)
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("policy", ["out_of_range", "nonpositive"])
@pytest.mark.parametrize("layout", ["compact", "odd strides, strided int64 slots"])
def test_gpu_null_policy_and_serving_layouts_match_the_oracle(policy, layout):
    x = cuda_inputs(B=4, T=8, H=12, N=9, hist=9, base=27, seed=4)
    slots = torch.tensor([5, 0, -1, 8], dtype=torch.int32, device="cuda")
    if layout == "compact":
        x["initial_state_indices"] = slots
    else:
        x["initial_state_indices"] = torch.zeros(4, 3, dtype=torch.int64, device="cuda")[:, 1]
        x["initial_state_indices"].copy_(slots)
        for name in ("initial_state_source", "k_cache", "u_cache", "g_cache"):
            x[name] = _odd_rows(x[name], 17)
    mine, ref = clone(x), clone(x)
    if layout != "compact":  # clone() makes them compact again: keep the odd layout for the kernel's copy
        for name in ("initial_state_source", "k_cache", "u_cache", "g_cache"):
            mine[name] = _odd_rows(x[name], 17)
        mine["initial_state_indices"] = x["initial_state_indices"]
    out = call(mine, null_policy=policy)
    expected = ucache_verify_flush_ref(
        ref["A_log"], ref["g"], ref["dt_bias"], -5.0, out_dtype=None, null_policy=policy,
        **{n: t for n, t in ref.items() if n not in ("A_log", "g", "dt_bias")},
    )  # fmt: skip
    torch.testing.assert_close(out.float(), expected, atol=8e-3, rtol=8e-3)
    torch.testing.assert_close(mine["initial_state_source"].float(), ref["initial_state_source"].float(),
                               atol=2e-2, rtol=1e-2)  # fmt: skip
    for name in ("k_cache", "u_cache"):
        torch.testing.assert_close(mine[name].float(), ref[name].float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(mine["g_cache"], ref["g_cache"], atol=1e-4, rtol=1e-5)
    assert torch.equal(mine["hist_len"], ref["hist_len"]) and torch.equal(mine["cache_base"], ref["cache_base"])
    if policy == "nonpositive":
        for name in ("initial_state_source", "k_cache", "u_cache", "g_cache"):
            assert torch.equal(mine[name][0], x[name][0]), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_step_and_commit_replay_from_a_cuda_graph_like_eager():
    fm = default_flush_min(8, 16)
    x = cuda_inputs(B=4, T=8, H=12, N=6, hist=fm, base=30, seed=4)
    accepted = torch.tensor([8, 1, 3, 5], dtype=torch.int32, device="cuda")
    out = torch.empty(4, 8, 12, K, dtype=torch.bfloat16, device="cuda")

    def step(state):
        call(state, restart_hist_on_flush=False, output=out)
        commit_ucache(state["hist_len"], state["cache_base"], accepted, flush_min=fm)

    eager = clone(x)
    step(eager)
    out_eager = out.clone()
    graphed = clone(x)
    step(clone(x))  # load the kernels before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(graphed)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, out_eager)
    for name, t in eager.items():
        assert torch.equal(graphed[name], t), name
    assert graphed["hist_len"].tolist() == accepted.tolist()  # every row flushed, then kept its accepted drafts
