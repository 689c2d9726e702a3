"""``kda_recurrent.fused_kda_decode``: the fused layer's entry (kernel on CUDA, kda-core's reference elsewhere) and
its ``torch.library`` op under ``torch.compile``."""

from __future__ import annotations

import pytest
import torch

from kda_core.contracts import NullSlotPolicy
from kda_core.errors import KDAError
from kda_core.oracle_fused import fused_kda_decode_ref
from kda_recurrent import fused_kda_decode

D = 128
H = 8  # the smallest head count the fused layer takes (kda_core.contracts.T1_HEAD_COUNTS)
HAS_CUDA = torch.cuda.is_available()


def _inputs(B, slots, H=H, device="cpu", state_dtype=torch.float32, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0, dtype=torch.float32):
        return (scale * torch.randn(*shape, generator=gen, device=device)).to(dtype)

    C = 3 * H * D
    conv = torch.empty_strided((slots, C, 3), (3 * C + 8, 1, C), dtype=torch.bfloat16, device=device)
    conv.copy_(randn(slots, C, 3, scale=0.5, dtype=torch.bfloat16))
    return dict(
        x=randn(B, C + 16, dtype=torch.bfloat16)[:, :C], weight=randn(3, 4, H * D, scale=0.3), conv_state=conv,
        raw_gate=randn(1, B, H, D, dtype=torch.bfloat16), raw_beta=randn(1, B, H, dtype=torch.bfloat16),
        A_log=randn(H, scale=0.5), dt_bias=randn(H * D, scale=0.1),
        state_indices=torch.arange(B, 0, -1, dtype=torch.int32, device=device),
        state=randn(slots, H, D, D, scale=0.05, dtype=state_dtype),
        output_gate=randn(B, H, D, dtype=torch.bfloat16), norm_weight=randn(D),
    )


def _copies(inp):
    out = dict(inp)
    for key in ("conv_state", "state"):
        t = inp[key]
        out[key] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)
    return out


@pytest.mark.parametrize("policy", list(NullSlotPolicy), ids=lambda p: p.value)
def test_cpu_call_is_the_reference_and_updates_both_caches_in_place(policy):
    inp = _inputs(B=3, slots=5)
    inp["state_indices"] = torch.tensor([2, 0, 4], dtype=torch.int32)
    ref = _copies(inp)
    want = fused_kda_decode_ref(**ref, null_policy=policy)
    got_in = _copies(inp)
    out = torch.full((1, 3, H, D), float("nan"), dtype=torch.bfloat16)
    got = fused_kda_decode(**got_in, output=out, null_policy=policy.value)
    assert got is out and torch.equal(got, want)
    assert torch.equal(got_in["conv_state"], ref["conv_state"]) and torch.equal(got_in["state"], ref["state"])
    assert not torch.equal(got_in["state"][2], inp["state"][2])  # a live row's slot was written
    row0_null = policy is NullSlotPolicy.NONPOSITIVE
    assert bool(got[0, 1].eq(0).all()) == row0_null
    assert torch.equal(got_in["state"][0], inp["state"][0]) == row0_null


def test_later_flashinfer_selection_keywords_run_the_same_call():
    """vLLM's K3 layer passes ``backend="auto", state_indices_mode="unique_or_null"`` to FlashInfer releases that take
    them: the same call here runs kda's layer unchanged (bitwise the call without them); other values are refused
    by name before anything runs."""
    inp = _inputs(B=3, slots=5)
    inp["state_indices"] = torch.tensor([2, 0, 4], dtype=torch.int32)
    plain_in, selected_in = _copies(inp), _copies(inp)
    want = fused_kda_decode(**plain_in)
    got = fused_kda_decode(**selected_in, backend="auto", state_indices_mode="unique_or_null")
    assert torch.equal(got, want) and torch.equal(selected_in["state"], plain_in["state"])
    assert torch.equal(selected_in["conv_state"], plain_in["conv_state"])
    untouched = _copies(inp)
    with pytest.raises(KDAError, match="^backend: expected one of"):
        fused_kda_decode(**untouched, backend="triton")
    with pytest.raises(KDAError, match="^state_indices_mode: expected one of"):
        fused_kda_decode(**untouched, state_indices_mode="sorted")
    assert torch.equal(untouched["state"], inp["state"]) and torch.equal(untouched["conv_state"], inp["conv_state"])


def test_bad_arguments_raise_the_kda_error_naming_them():
    inp = _inputs(B=2, slots=3)
    with pytest.raises(KDAError, match="^null_policy: expected"):
        fused_kda_decode(**inp, null_policy="sometimes")
    with pytest.raises(KDAError, match="^norm_weight: expected"):
        fused_kda_decode(**{**inp, "norm_weight": inp["norm_weight"][:64]})


def test_torch_compile_fullgraph_matches_eager_on_cpu():
    inp = _inputs(B=2, slots=3, seed=1)
    eager_in, compiled_in = _copies(inp), _copies(inp)
    want = fused_kda_decode(**eager_in)

    def layer(x, weight, conv_state, raw_gate, raw_beta, A_log, dt_bias, state_indices, state, output_gate,
              norm_weight):
        return fused_kda_decode(x, weight, conv_state, raw_gate, raw_beta, A_log, dt_bias, state_indices, state,
                                output_gate, norm_weight) * 2

    got = torch.compile(layer, fullgraph=True, backend="eager")(**compiled_in)
    assert torch.equal(got, want * 2)
    assert torch.equal(compiled_in["state"], eager_in["state"])
    assert torch.equal(compiled_in["conv_state"], eager_in["conv_state"])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_call_is_the_kernel_and_matches_the_reference(state_dtype):
    from kda_cute.fused_decode import fused_kda_decode as kernel

    inp = _inputs(B=4, slots=6, H=12, device="cuda", state_dtype=state_dtype, seed=2)
    a, b, ref = _copies(inp), _copies(inp), _copies(inp)
    got = fused_kda_decode(**a)
    direct = kernel(**b)
    torch.cuda.synchronize()
    assert torch.equal(got, direct) and torch.equal(a["state"], b["state"])
    want = fused_kda_decode_ref(**ref)
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=2e-2)
    assert torch.equal(a["conv_state"], ref["conv_state"])


def test_ds_conv_layout_and_no_norm_in_eager_and_compiled_calls():
    """The DS conv cache and the call without the gated RMSNorm (both None) through the entry and through the
    ``kda::fused_kda_decode`` op under ``torch.compile``: the reference's results, the DS cache updated in place."""
    inp = _inputs(B=3, slots=5, seed=4)
    conv = inp["conv_state"]
    inp["conv_state"] = torch.empty_strided(conv.shape, (conv.shape[1] * 3 + 6, 3, 1), dtype=conv.dtype).copy_(conv)
    inp["output_gate"] = inp["norm_weight"] = None
    ref, eager_in, compiled_in = _copies(inp), _copies(inp), _copies(inp)
    want = fused_kda_decode_ref(**ref)
    assert torch.equal(fused_kda_decode(**eager_in), want)
    assert torch.equal(eager_in["conv_state"], ref["conv_state"]) and torch.equal(eager_in["state"], ref["state"])
    assert eager_in["conv_state"].stride()[1:] == (3, 1)

    def layer(x, weight, conv_state, raw_gate, raw_beta, A_log, dt_bias, state_indices, state):
        return fused_kda_decode(x, weight, conv_state, raw_gate, raw_beta, A_log, dt_bias, state_indices, state,
                                None, None, None)

    args = {k: v for k, v in compiled_in.items() if k not in ("output_gate", "norm_weight")}
    got = torch.compile(layer, fullgraph=True, backend="aot_eager")(**args)  # lower_bound None: the softplus gate
    soft = _copies(inp)
    assert torch.equal(got, fused_kda_decode_ref(**soft, lower_bound=None)) and not torch.equal(got, want)
    assert torch.equal(compiled_in["conv_state"], soft["conv_state"]) and torch.equal(compiled_in["state"],
                                                                                      soft["state"])
