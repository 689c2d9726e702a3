"""The fused decode layer's reference (docs/design.md §8) against an independent composition of its parts.

The composition: ``torch.nn.functional.conv1d`` (depthwise, groups = C) over the window, SiLU rounded to bf16, then
kda-core's recurrence reference (``recurrent_kda_ref``, in-kernel lower-bound or softplus gate, beta a logit) and a
hand-written gated RMSNorm. The multi-token form is checked against a T = 1 replay of the accepted stream.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kda_core.contracts import NullSlotPolicy
from kda_core.errors import KDAError
from kda_core.oracle import recurrent_kda_ref
from kda_core.oracle_fused import conv_taps, fused_kda_decode_ref, packed_fused_kda_decode_ref

D = 128


def _inputs(H, B, slots, *, window=3, seed=0, state_dtype=torch.float32, rows=None):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0, dtype=torch.float32):
        return (scale * torch.randn(*shape, generator=gen)).to(dtype)

    C = 3 * H * D
    rows = B if rows is None else rows
    # x: the first C columns of a GEMM row with 17 elements of padding; conv cache channel-contiguous per slot
    # (strides [slot_stride, 1, C], FlashInfer's and vLLM's SD layout) with a padded slot stride.
    x = randn(rows, C + 17, dtype=torch.bfloat16)[:, :C]
    conv = torch.empty_strided((slots, C, window), (C * window + 5, 1, C), dtype=torch.bfloat16)
    conv.copy_(randn(slots, C, window, scale=0.5, dtype=torch.bfloat16))
    state = torch.empty_strided((slots, H, D, D), (H * D * D + 17, D * D, D, 1), dtype=state_dtype)
    state.copy_(randn(slots, H, D, D, scale=0.05, dtype=state_dtype))
    return dict(
        x=x, weight=randn(3, 4, H * D, scale=0.3), conv_state=conv,
        raw_gate=randn(1, rows, H, D, dtype=torch.bfloat16),
        raw_beta=randn(1, rows, H + 1, dtype=torch.bfloat16)[..., :H],
        A_log=randn(H, scale=0.5), dt_bias=randn(H * D, scale=0.1), state=state,
        output_gate=randn(rows, H * D + 7, dtype=torch.bfloat16)[:, :H * D].view(rows, H, D),
        norm_weight=randn(D),
    )


def _clone(t):
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
    return out.copy_(t)


def _composed_t1(inp, slots, lower_bound, eps=1e-5, norm=True):
    """The T=1 layer from independent parts; returns (output, conv cache after, state after). ``norm=False``: the
    output is the recurrence's o (no gated RMSNorm)."""
    x, conv, state = inp["x"], _clone(inp["conv_state"]), _clone(inp["state"])
    B, C = x.shape
    H = C // (3 * D)
    live = [(r, s) for r, s in enumerate(slots.tolist()) if 0 < s < state.shape[0]]
    mixed = torch.zeros(B, C)
    taps = inp["weight"].permute(0, 2, 1).reshape(C, 1, 4)
    for r, s in live:
        window = torch.cat((conv[s].float(), x[r].float()[:, None]), dim=1)  # [C, 4]
        mixed[r] = F.silu(F.conv1d(window[None], taps, groups=C)[0, :, 0]).bfloat16().float()
        conv[s] = window[:, 1:].bfloat16()
    q, k, v = (mixed.view(B, 1, 3, H, D)[:, :, i].bfloat16() for i in range(3))
    pool_slots = torch.tensor([s if 0 < s < state.shape[0] else -1 for s in slots.tolist()])
    o, state = recurrent_kda_ref(
        q, k, v, inp["raw_gate"].view(B, 1, H, D), inp["raw_beta"].reshape(B, 1, H), A_log=inp["A_log"],
        dt_bias=inp["dt_bias"], initial_state=state, use_gate_in_kernel=True, lower_bound=lower_bound,
        beta_is_logit=True, ssm_state_indices=pool_slots,
    )
    if not norm:
        return o.view(1, B, H, D), conv, state
    o = o.float().view(B, H, D)
    y = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + eps) * inp["norm_weight"]
    y = y * torch.sigmoid(inp["output_gate"].float())
    return y.bfloat16().view(1, B, H, D), conv, state


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["lower_bound", "softplus"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_t1_layer_matches_conv1d_then_the_recurrence_then_the_norm(lower_bound, state_dtype):
    H, B, N = 2, 3, 6
    inp = _inputs(H, B, N, state_dtype=state_dtype)
    slots = torch.tensor([4, 1, 5], dtype=torch.int32)
    want, want_conv, want_state = _composed_t1(inp, slots, lower_bound)
    conv, state = _clone(inp["conv_state"]), _clone(inp["state"])
    got = fused_kda_decode_ref(**{**inp, "conv_state": conv, "state": state}, state_indices=slots,
                               lower_bound=lower_bound)
    assert got.shape == (1, B, H, D) and got.dtype is torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(conv, want_conv)  # the conv cache holds bf16 inputs exactly
    # conv1d and the reference sum the taps in other orders: a bf16 pool may differ by one rounding
    tol = dict(rtol=1e-5, atol=1e-5) if state_dtype is torch.float32 else dict(rtol=2**-7, atol=1e-4)
    torch.testing.assert_close(state.float(), want_state.float(), **tol)
    assert not torch.equal(state[4], inp["state"][4])


def _ds(conv):
    """The same conv cache values in the DS layout (each channel's columns contiguous: vLLM's dim-first cache)."""
    slots, C, W = conv.shape
    return torch.empty_strided((slots, C, W), (C * W + 3, W, 1), dtype=conv.dtype).copy_(conv)


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["lower_bound", "softplus"])
def test_t1_layer_without_the_norm_and_with_the_ds_conv_layout(lower_bound):
    """output_gate and norm_weight both None: the output is the recurrence's o (the composition without its norm);
    a DS conv cache gives the SD cache's results and is updated in its own layout."""
    H, B, N = 2, 3, 6
    inp = _inputs(H, B, N, seed=3)
    slots = torch.tensor([4, 0, 5], dtype=torch.int32)
    want, want_conv, want_state = _composed_t1(inp, slots, lower_bound, norm=False)
    for conv in (_clone(inp["conv_state"]), _ds(inp["conv_state"])):
        state = _clone(inp["state"])
        got = fused_kda_decode_ref(**{**inp, "conv_state": conv, "state": state, "output_gate": None,
                                      "norm_weight": None}, state_indices=slots, lower_bound=lower_bound)
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
        assert not got[0, 1].any()  # slot 0: a null row
        assert torch.equal(conv, want_conv)
        torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-5)
    with pytest.raises(KDAError, match="^norm_weight: expected output_gate and norm_weight both or neither"):
        fused_kda_decode_ref(**{**inp, "norm_weight": None}, state_indices=slots)


@pytest.mark.parametrize("policy, slots, dead", [
    (NullSlotPolicy.NONPOSITIVE, [0, -1, 2, 9], [0, 1, 3]),
    (NullSlotPolicy.OUT_OF_RANGE, [0, -1, 2, 9], [1, 3]),
], ids=["nonpositive", "out_of_range"])
def test_null_rows_get_zero_output_and_leave_both_caches_untouched(policy, slots, dead):
    H, N = 1, 4
    inp = _inputs(H, len(slots), N, seed=1)
    conv, state = _clone(inp["conv_state"]), _clone(inp["state"])
    out = fused_kda_decode_ref(**{**inp, "conv_state": conv, "state": state},
                               state_indices=torch.tensor(slots, dtype=torch.int32), null_policy=policy)
    for r in range(len(slots)):
        assert bool(out[0, r].eq(0).all()) == (r in dead)
    touched = {s for r, s in enumerate(slots) if r not in dead}
    for s in range(N):
        assert torch.equal(conv[s], inp["conv_state"][s]) == (s not in touched)
        assert torch.equal(state[s], inp["state"][s]) == (s not in touched)


def test_multi_token_with_one_token_per_row_is_the_t1_step():
    H, B, N = 1, 3, 5
    inp = _inputs(H, B, N, seed=2)
    slots = torch.tensor([3, 1, 4], dtype=torch.int32)
    conv1, state1 = _clone(inp["conv_state"]), _clone(inp["state"])
    want = fused_kda_decode_ref(**{**inp, "conv_state": conv1, "state": state1}, state_indices=slots)
    conv2, state2 = _clone(inp["conv_state"]), _clone(inp["state"])
    got = packed_fused_kda_decode_ref(
        **{**inp, "conv_state": conv2, "state": state2}, state_indices=slots[:, None],
        query_start_loc=torch.arange(B + 1, dtype=torch.int32), num_accepted_tokens=torch.ones(B, dtype=torch.int32))
    assert torch.equal(got, want) and torch.equal(conv2, conv1) and torch.equal(state2, state1)


def _step_inputs(base, sl):
    tok = dict(base)
    tok["x"], tok["output_gate"] = base["x"][sl], base["output_gate"][sl]
    tok["raw_gate"], tok["raw_beta"] = base["raw_gate"][:, sl], base["raw_beta"][:, sl]
    return tok


@pytest.mark.parametrize("seed", [0, 1])
def test_chained_spec_steps_equal_t1_steps_over_the_accepted_stream(seed):
    """Steps of T = 3 with per-token checkpoints in slots [1, 2, 3]; after a step accepting ``a`` tokens the next one
    reads its state from column a - 1 (nat = a) and its conv window from columns a - 1 .. a + 1 of the same conv
    slot (column 0's slot). Outputs of accepted tokens, the state reached and the conv history after the accepted
    tokens equal T = 1 steps over the accepted stream."""
    H, T, steps = 1, 3, 4
    gen = torch.Generator().manual_seed(10 + seed)
    N = 1 + T
    base = _inputs(H, T * steps, N, window=T + 2, seed=20 + seed)
    conv, state = _clone(base["conv_state"]), _clone(base["state"])
    # the T=1 replay: a 3-column conv cache and one state slot, seeded with what the spec row reads first
    ref_conv = torch.zeros(2, 3 * H * D, 3, dtype=torch.bfloat16)
    ref_conv[1] = base["conv_state"][1, :, 0:3]
    ref_state = torch.zeros(2, H, D, D, dtype=base["state"].dtype)
    ref_state[1] = base["state"][1]
    idx = torch.tensor([[1, 2, 3]], dtype=torch.int32)
    nat = 1
    for step in range(steps):
        sl = slice(step * T, (step + 1) * T)
        out = packed_fused_kda_decode_ref(
            **{**_step_inputs(base, sl), "conv_state": conv, "state": state}, state_indices=idx,
            query_start_loc=torch.tensor([0, T], dtype=torch.int32),
            num_accepted_tokens=torch.tensor([nat], dtype=torch.int32))
        accepted = int(torch.randint(1, T + 1, (1,), generator=gen))
        for t in range(accepted):
            r = step * T + t
            want = fused_kda_decode_ref(**{**_step_inputs(base, slice(r, r + 1)), "conv_state": ref_conv,
                                           "state": ref_state}, state_indices=torch.tensor([1], dtype=torch.int32))
            torch.testing.assert_close(out[0, t].float(), want[0, 0].float(), rtol=1e-2, atol=1e-2)
        nat = accepted
        # what the next step will read: the checkpoint of token nat - 1 and conv columns nat - 1 .. nat + 1
        torch.testing.assert_close(state[idx[0, nat - 1]].float(), ref_state[1].float(), rtol=1e-5, atol=1e-5)
        assert torch.equal(conv[1, :, nat - 1:nat + 2], ref_conv[1])


def test_nonpositive_multi_token_rows_with_nat_out_of_range_are_null():
    H, T = 1, 2
    base = _inputs(H, 2 * T, 5, window=T + 2, seed=5)
    conv, state = _clone(base["conv_state"]), _clone(base["state"])
    out = packed_fused_kda_decode_ref(
        **{**base, "conv_state": conv, "state": state}, state_indices=torch.tensor([[1, 2], [3, 4]], dtype=torch.int32),
        query_start_loc=torch.tensor([0, T, 2 * T], dtype=torch.int32),
        num_accepted_tokens=torch.tensor([0, T + 1], dtype=torch.int32))
    assert bool(out.eq(0).all())
    assert torch.equal(conv, base["conv_state"]) and torch.equal(state, base["state"])
    # the same counts under OUT_OF_RANGE read columns 0 and T - 1
    out = packed_fused_kda_decode_ref(
        **{**base, "conv_state": conv, "state": state}, state_indices=torch.tensor([[1, 2], [3, 4]], dtype=torch.int32),
        query_start_loc=torch.tensor([0, T, 2 * T], dtype=torch.int32),
        num_accepted_tokens=torch.tensor([0, T + 1], dtype=torch.int32), null_policy=NullSlotPolicy.OUT_OF_RANGE)
    assert not bool(out.eq(0).all())


def test_malformed_offsets_are_clamped_and_rows_past_t_tokens_are_cut():
    H, T = 1, 2
    base = _inputs(H, 5, 4, window=T + 2, seed=6)
    conv, state = _clone(base["conv_state"]), _clone(base["state"])
    out = packed_fused_kda_decode_ref(
        **{**base, "conv_state": conv, "state": state}, state_indices=torch.tensor([[1, 2]], dtype=torch.int32),
        query_start_loc=torch.tensor([-7, 2**40]), num_accepted_tokens=torch.tensor([1], dtype=torch.int32))
    assert not bool(out[0, :T].eq(0).all()) and bool(out[0, T:].eq(0).all())  # five tokens claimed, T = 2 run


def test_shape_errors_name_the_argument():
    inp = _inputs(1, 2, 3)
    with pytest.raises(KDAError, match="state"):
        fused_kda_decode_ref(**{**inp, "state": inp["state"][:2]}, state_indices=torch.tensor([1, 2]))
    with pytest.raises(KDAError, match="weight"):
        conv_taps(torch.zeros(4, 3, 128))
    with pytest.raises(KDAError, match="conv_state"):
        packed_fused_kda_decode_ref(**inp, state_indices=torch.tensor([[1, 2]]), query_start_loc=torch.tensor([0, 2]),
                                    num_accepted_tokens=torch.tensor([1]))
