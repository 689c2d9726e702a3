"""The fused decode layer kernel (kda_cute.fused_decode) against kda-core's reference ``fused_kda_decode_ref``.

Inputs follow FlashInfer's tests of its fused op (docs/serving.md §5): x the first 3·H·128 columns of a
[B, 3·H·128 + 17] bf16 buffer, weight 0.1·randn [3, 4, H·128], the conv cache and the state in pages of one slot
stride each (conv [slots, C, 3] with strides (page, 1, C)), raw_beta a view of [1, B, H + 1], output_gate an
as_strided view with row stride H·128 + 7, state_indices B..1 (slot 0 is the reserved null slot). Tolerances are
FlashInfer's: output rtol 3e-2 / atol 2e-2, the conv cache bitwise, the state rtol 3e-2 / atol 2e-3.
"""

from __future__ import annotations

import pytest
import torch

from kda_core.contracts import NullSlotPolicy

D = 128
OUT_TOL = dict(rtol=3e-2, atol=2e-2)
STATE_TOL = dict(rtol=3e-2, atol=2e-3)


def _page_strides(H, state_dtype, history=3, pad=0):
    """(conv slot stride, state slot stride) in elements of one page holding both caches of a slot; ``pad``
    elements more on the state's (3 with an fp32 state: not a 16-byte multiple, the unaligned variant)."""
    conv_bytes = 3 * H * D * history * 2
    elem = torch.empty((), dtype=state_dtype).element_size()
    page = conv_bytes + H * D * D * elem
    return page // 2, page // elem + pad


def _inputs(H, B, *, state_dtype=torch.float32, seed=42, slots=None, state_pad=0):
    dev = torch.device("cuda")
    n_slots = B + 1 if slots is None else slots
    HK = H * D
    C = 3 * HK
    gen = torch.Generator(device=dev).manual_seed(seed)

    def randn(*shape, dtype=torch.float32, scale=1.0):
        return (scale * torch.randn(shape, device=dev, generator=gen)).to(dtype)

    conv_stride, state_stride = _page_strides(H, state_dtype, pad=state_pad)
    conv = torch.empty_strided((n_slots, C, 3), (conv_stride, 1, C), dtype=torch.bfloat16, device=dev)
    conv.copy_(randn(n_slots, C, 3, dtype=torch.bfloat16, scale=0.1))
    state = torch.empty_strided((n_slots, H, D, D), (state_stride, D * D, D, 1), dtype=state_dtype, device=dev)
    state.copy_(randn(n_slots, H, D, D, dtype=state_dtype, scale=0.01))
    return dict(
        x=randn(B, C + 17, dtype=torch.bfloat16)[:, :C],
        weight=randn(3, 4, HK, scale=0.1),
        conv_state=conv,
        raw_gate=randn(1, B, H, D, dtype=torch.bfloat16),
        raw_beta=randn(1, B, H + 1, dtype=torch.bfloat16)[:, :, :H],
        A_log=randn(H, scale=0.5),
        dt_bias=randn(HK, scale=0.1),
        state_indices=torch.arange(B, 0, -1, dtype=torch.int32, device=dev),
        state=state,
        output_gate=randn(B, HK + 7, dtype=torch.bfloat16).as_strided((B, H, D), (HK + 7, D, 1)),
        norm_weight=randn(D),
    )


def _clone(t):
    c = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    c.copy_(t)
    return c


def _run_both(inputs, **kwargs):
    """(kernel output, reference output, kernel caches, reference caches); both start from the same caches. The
    reference never gets the caller's ``output`` (it returns its own)."""
    from kda_core.oracle_fused import fused_kda_decode_ref
    from kda_cute.fused_decode import fused_kda_decode

    ref_kwargs = {k: v for k, v in kwargs.items() if k not in ("config", "output")}
    ref_conv, ref_state = _clone(inputs["conv_state"]), _clone(inputs["state"])
    expected = fused_kda_decode_ref(**{**inputs, "conv_state": ref_conv, "state": ref_state}, **ref_kwargs)
    actual = fused_kda_decode(**inputs, **kwargs)
    torch.cuda.synchronize()
    return actual, expected, (inputs["conv_state"], inputs["state"]), (ref_conv, ref_state)


def _assert_matches(actual, expected, caches, ref_caches):
    assert actual.shape == expected.shape and actual.dtype == torch.bfloat16
    torch.testing.assert_close(actual, expected, **OUT_TOL)
    torch.testing.assert_close(caches[0], ref_caches[0], rtol=0, atol=0)
    torch.testing.assert_close(caches[1], ref_caches[1], **STATE_TOL)


SHAPES = [(H, B) for H in (8, 12, 16, 24, 32, 48, 64, 96) for B in (1, 4)] + [(12, 32), (12, 256)]


@pytest.mark.gpu
@pytest.mark.parametrize("H, B", SHAPES, ids=[f"h{H}-b{B}" for H, B in SHAPES])
def test_lower_bound_gate_matches_reference(H, B):
    """Kimi K3's gate, fp32 state (FlashInfer's default), every head count; B = 256 at H = 12 takes the bulk ring."""
    _assert_matches(*_run_both(_inputs(H, B)))


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B", [1, 32, 128])
def test_softplus_gate_matches_reference(B, state_dtype):
    """Kimi-Linear's softplus gate (``lower_bound=None``) at H = 32, both state dtypes (bf16 rounded on store)."""
    _assert_matches(*_run_both(_inputs(32, B, state_dtype=state_dtype), lower_bound=None))


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("ring", [0, 8], ids=["regs", "ring8"])
@pytest.mark.parametrize("B", [4, 64])
def test_both_state_paths_match_reference(B, ring, state_dtype):
    """The register path and the bulk ring, each forced at a small and a large batch (H = 12, bf16 pool too)."""
    from kda_cute.fused_decode import FusedDecodeConfig

    _assert_matches(*_run_both(_inputs(12, B, state_dtype=state_dtype), config=FusedDecodeConfig(bulk_ring=ring)))


CLUSTER_SHAPES = ((8, 33), (12, 1), (24, 4), (96, 1), (96, 33))


@pytest.mark.gpu
@pytest.mark.parametrize("lower_bound, policy",
                         [(-5.0, NullSlotPolicy.NONPOSITIVE), (None, NullSlotPolicy.OUT_OF_RANGE)],
                         ids=["lower_bound-nonpositive", "softplus-out_of_range"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cluster", [2, 4, 8])
def test_cluster_variant_matches_reference(cluster, state_dtype, lower_bound, policy):
    """The cluster variant forced (C CTAs per (row, head), 128 / C rows each) at H in {8, 12, 24, 96} and B in {1,
    4, 33}: output, conv cache (bitwise) and state against the reference. Row 0 names slot 0 (live under
    OUT_OF_RANGE; under NONPOSITIVE null, from B = 4 on) and, from B = 4, row 2 slot -1 (null under both): a null
    row's cluster writes zeros and leaves both caches as the reference does."""
    from kda_cute.fused_decode import FusedDecodeConfig

    for H, B in CLUSTER_SHAPES:
        inputs = _inputs(H, B, state_dtype=state_dtype, seed=H + B)
        slots = inputs["state_indices"]
        if B >= 4 or policy is NullSlotPolicy.OUT_OF_RANGE:  # (B = 1 under NONPOSITIVE keeps its one live row)
            slots[0] = 0
        if B >= 4:
            slots[2] = -1
        result = _run_both(inputs, lower_bound=lower_bound, null_policy=policy,
                           config=FusedDecodeConfig(cluster=cluster))
        _assert_matches(*result)
        actual = result[0]
        null_rows = [0, 2] if B >= 4 else []
        if policy is NullSlotPolicy.OUT_OF_RANGE:
            null_rows = null_rows[1:]  # slot 0 is live there
        for r in null_rows:
            assert not torch.any(actual[0, r]), (H, B, r)


def _ds(conv):
    """The conv cache's values in the DS layout (strides (slot, 3, 1) in a slot of the same size: vLLM's dim-first
    cache)."""
    slots, C, W = conv.shape
    ds = torch.empty_strided((slots, C, W), (conv.stride(0), W, 1), dtype=conv.dtype, device=conv.device)
    return ds.copy_(conv)


FORMS = [("sd", False), ("ds", True), ("ds", False)]


@pytest.mark.gpu
@pytest.mark.parametrize("layout, norm", FORMS, ids=[f"{c}-{'norm' if n else 'nonorm'}" for c, n in FORMS])
@pytest.mark.parametrize("path", ["regs", "ring8", "cluster4"])
@pytest.mark.parametrize("H, B", [(12, 1), (24, 4), (96, 4)], ids=["h12-b1", "h24-b4", "h96-b4"])
def test_vllm_native_forms_match_reference(H, B, path, layout, norm):
    """The DS conv layout and the call without the gated RMSNorm (vLLM's native op's other forms; docs/serving.md
    §1) on the register path, the bulk ring and a cluster: output, conv cache (bitwise, in its own layout) and state
    against the reference; row 0 names the null slot 0 from B = 4 on."""
    from kda_cute.fused_decode import FusedDecodeConfig

    config = {"regs": FusedDecodeConfig(), "ring8": FusedDecodeConfig(bulk_ring=8),
              "cluster4": FusedDecodeConfig(cluster=4)}[path]
    inputs = _inputs(H, B, seed=H + B)
    if layout == "ds":
        inputs["conv_state"] = _ds(inputs["conv_state"])
    if not norm:
        inputs["output_gate"] = inputs["norm_weight"] = None
    if B >= 4:
        inputs["state_indices"][0] = 0
    before_conv = _clone(inputs["conv_state"])
    result = _run_both(inputs, config=config)
    _assert_matches(*result)
    assert result[2][0].stride() == before_conv.stride()
    if B >= 4:
        assert not result[0][0, 0].any()
        assert torch.equal(result[2][0][0], before_conv[0])


@pytest.mark.gpu
@pytest.mark.parametrize("policy", list(NullSlotPolicy), ids=[p.value for p in NullSlotPolicy])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_null_rows(policy, state_dtype):
    """Slots 0, -1 and N (and N + 7): zero output and neither cache read or written for a null row; slot 0 is live
    under OUT_OF_RANGE only. Every slot no live row names is bitwise untouched (both caches)."""
    H, B = 12, 6
    inputs = _inputs(H, B, state_dtype=state_dtype, slots=5)
    N = 5
    slots = [0, -1, N, 3, N + 7, 1]
    inputs["state_indices"] = torch.tensor(slots, dtype=torch.int32, device="cuda")
    before = _clone(inputs["conv_state"]), _clone(inputs["state"])
    actual, expected, caches, ref_caches = _run_both(inputs, null_policy=policy)
    _assert_matches(actual, expected, caches, ref_caches)
    live = {3, 1} | ({0} if policy is NullSlotPolicy.OUT_OF_RANGE else set())
    for r, s in enumerate(slots):
        if s not in live:
            assert torch.equal(actual[0, r], torch.zeros_like(actual[0, r])), (r, s)
    for s in range(N):
        same = torch.equal(caches[0][s], before[0][s]) and torch.equal(caches[1][s], before[1][s])
        assert same == (s not in live), (s, policy)


@pytest.mark.gpu
def test_strided_and_unaligned_inputs():
    """An fp32 state slot stride that is no 16-byte multiple and raw_gate 2 bytes off (the unaligned variant), int64
    indices read through a stride of 2, a conv bias, no dt_bias, the 4-D output_gate and a caller's strided
    output."""
    H, B = 24, 4
    inputs = _inputs(H, B, state_pad=3)
    assert inputs["state"].stride(0) * 4 % 16
    gate_storage = torch.randn(B * H * D + 1, device="cuda").to(torch.bfloat16)
    inputs["raw_gate"] = gate_storage[1:].view(1, B, H, D)
    inputs["state_indices"] = torch.tensor([4, 9, 2, 9, 1, 9, 3, 9], dtype=torch.int64, device="cuda")[::2]
    inputs["dt_bias"] = None
    inputs["output_gate"] = torch.randn(1, B, H, D, device="cuda").to(torch.bfloat16)
    out_storage = torch.zeros(1, B, H, D + 8, dtype=torch.bfloat16, device="cuda")
    output = out_storage[..., :D]
    bias = 0.1 * torch.randn(3 * H * D, device="cuda")
    actual, expected, caches, ref_caches = _run_both(inputs, bias=bias, output=output)
    assert actual.data_ptr() == output.data_ptr() != expected.data_ptr()
    _assert_matches(actual, expected, caches, ref_caches)
    assert torch.equal(out_storage[..., D:], torch.zeros_like(out_storage[..., D:]))  # the padding is not written


@pytest.mark.gpu
@pytest.mark.parametrize("cluster", [1, 8], ids=["cta", "cluster8"])
@pytest.mark.parametrize("state_dtype, lower_bound", [(torch.float32, -5.0), (torch.bfloat16, None)],
                         ids=["fp32-lower_bound", "bf16-softplus"])
def test_cuda_graph_replay_with_changed_inputs_and_slots(state_dtype, lower_bound, cluster):
    """Capture once, then change the activations and the slots in place: the replay computes the new call (the
    one-CTA path and the cluster variant)."""
    from kda_core.oracle_fused import fused_kda_decode_ref
    from kda_cute.fused_decode import FusedDecodeConfig, fused_kda_decode

    H, B = 12, 4
    config = FusedDecodeConfig(cluster=cluster)
    inputs = _inputs(H, B, state_dtype=state_dtype, slots=8)
    output = torch.empty(1, B, H, D, dtype=torch.bfloat16, device="cuda")
    fused_kda_decode(**inputs, lower_bound=lower_bound, output=output, config=config)  # compile, load before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_kda_decode(**inputs, lower_bound=lower_bound, output=output, config=config)
    assert captured.data_ptr() == output.data_ptr()
    fresh = _inputs(H, B, state_dtype=state_dtype, slots=8, seed=7)
    for name in ("x", "raw_gate", "raw_beta", "output_gate"):
        inputs[name].copy_(fresh[name])
    inputs["state_indices"].copy_(torch.tensor([6, 0, 2, 5], dtype=torch.int32))  # slot 0: a null row
    ref_conv, ref_state = _clone(inputs["conv_state"]), _clone(inputs["state"])
    expected = fused_kda_decode_ref(**{**inputs, "conv_state": ref_conv, "state": ref_state}, lower_bound=lower_bound)
    output.fill_(1.0)
    graph.replay()
    torch.cuda.synchronize()
    _assert_matches(output, expected, (inputs["conv_state"], inputs["state"]), (ref_conv, ref_state))
    assert torch.equal(output[0, 1], torch.zeros_like(output[0, 1]))


@pytest.mark.gpu
def test_empty_batch_returns_at_once():
    from kda_cute.fused_decode import fused_kda_decode

    inputs = _inputs(12, 0, slots=3)
    before = _clone(inputs["state"])
    out = fused_kda_decode(**inputs)
    assert out.shape == (1, 0, 12, D)
    assert torch.equal(inputs["state"], before)


@pytest.mark.gpu
def test_slot_offset_past_two_to_the_31_elements():
    """A bf16 state pool of more than 2^31 elements (H = 8: 16400 slots, 4.3 GB): the last slot's offset needs 64
    bits; only that slot is initialised and compared."""
    from kda_core.oracle_fused import fused_kda_decode_ref
    from kda_cute.fused_decode import fused_kda_decode

    H, N = 8, 16400
    assert N * H * D * D > 2**31
    small = _inputs(H, 1, state_dtype=torch.bfloat16, slots=2)
    state = torch.empty(N, H, D, D, dtype=torch.bfloat16, device="cuda")
    conv = torch.zeros(N, 3, 3 * H * D, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    slot = N - 1
    state[slot].copy_(small["state"][1])
    conv[slot].copy_(small["conv_state"][1])
    inputs = {**small, "state": state, "conv_state": conv,
              "state_indices": torch.tensor([slot], dtype=torch.int32, device="cuda")}
    ref_conv = small["conv_state"][1:2].clone()
    ref_state = small["state"][1:2].clone()
    ref = {**small, "conv_state": ref_conv, "state": ref_state,
           "state_indices": torch.tensor([0], dtype=torch.int32, device="cuda")}
    expected = fused_kda_decode_ref(**ref, null_policy=NullSlotPolicy.OUT_OF_RANGE)
    actual = fused_kda_decode(**inputs)
    torch.cuda.synchronize()
    torch.testing.assert_close(actual, expected, **OUT_TOL)
    torch.testing.assert_close(conv[slot], ref_conv[0], rtol=0, atol=0)
    torch.testing.assert_close(state[slot], ref_state[0], **STATE_TOL)


@pytest.mark.gpu
def test_debug_validate_names_duplicate_live_slots(monkeypatch):
    """With KDA_DEBUG_VALIDATE=1 two rows naming one live slot are refused before launch (both caches untouched);
    rows sharing the null slot 0 are not duplicates under NONPOSITIVE."""
    from kda_core.errors import KDAError
    from kda_cute.fused_decode import fused_kda_decode

    inputs = _inputs(12, 3, slots=4)
    monkeypatch.setenv("KDA_DEBUG_VALIDATE", "1")
    inputs["state_indices"] = torch.tensor([2, 1, 2], dtype=torch.int32, device="cuda")
    before = _clone(inputs["conv_state"]), _clone(inputs["state"])
    with pytest.raises(KDAError, match="^state_indices: expected distinct active slots"):
        fused_kda_decode(**inputs)
    torch.cuda.synchronize()
    assert torch.equal(inputs["conv_state"], before[0]) and torch.equal(inputs["state"], before[1])
    inputs["state_indices"] = torch.tensor([0, 1, 0], dtype=torch.int32, device="cuda")
    out = fused_kda_decode(**inputs)
    torch.cuda.synchronize()
    assert torch.equal(out[0, 0], torch.zeros_like(out[0, 0])) and torch.equal(out[0, 2], out[0, 0])
