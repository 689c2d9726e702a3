"""The fused decode call's validation (kda_core.validation_fused): each broken rule names its argument.

CPU tensors with ``device_kind="any"`` (the metadata path is the same on every device); H = 8, the smallest head
count, keeps the state small.
"""

from __future__ import annotations

import pytest
import torch

from kda_core.contracts import GateMode
from kda_core.errors import KDAError
from kda_core.validation_fused import FusedDecodeCall, validate_fused_decode

BF16, F32 = torch.bfloat16, torch.float32
H, D = 8, 128
C = 3 * H * D


def _args(B=3, N=4, state_dtype=F32, state_pad=0, conv_pad=5):
    conv = torch.zeros(N * (C * 3 + conv_pad), dtype=BF16).as_strided((N, C, 3), (C * 3 + conv_pad, 1, C))
    state = torch.zeros(N * (H * D * D + state_pad), dtype=state_dtype).as_strided(
        (N, H, D, D), (H * D * D + state_pad, D * D, D, 1))
    return dict(
        x=torch.zeros(B, C + 17, dtype=BF16)[:, :C], weight=torch.zeros(3, 4, H * D), conv_state=conv,
        raw_gate=torch.zeros(1, B, H, D, dtype=BF16), raw_beta=torch.zeros(1, B, H + 1, dtype=BF16)[..., :H],
        A_log=torch.zeros(H), dt_bias=torch.zeros(H * D), state_indices=torch.arange(B, dtype=torch.int32),
        state=state, output_gate=torch.zeros(B, H * D + 7, dtype=BF16).as_strided((B, H, D), (H * D + 7, D, 1)),
        norm_weight=torch.ones(D), device_kind="any",
    )


def _raises(args, argument, fragment):
    with pytest.raises(KDAError) as info:
        validate_fused_decode(**args)
    msg = str(info.value)
    assert msg.startswith(f"{argument}: expected "), msg
    assert fragment in msg and ", got " in msg, msg


def test_legal_call_is_described_and_remembered():
    a = _args()
    call = validate_fused_decode(**a)
    assert isinstance(call, FusedDecodeCall)
    assert (call.B, call.H, call.N, call.state_dtype, call.index_dtype) == (3, H, 4, F32, torch.int32)
    assert call.gate_mode is GateMode.LOWER_BOUND and call.lower_bound == -5.0 and call.norm_eps == 1e-5
    assert call.has_dt_bias and not call.has_bias and not call.has_output
    assert validate_fused_decode(**_args()) is call or validate_fused_decode(**a) is call


def test_optional_and_alternative_forms():
    a = _args()
    a.update(dt_bias=None, lower_bound=None, state_indices=torch.zeros(3, dtype=torch.int64),
             output_gate=torch.zeros(1, 3, H, D, dtype=BF16), bias=torch.zeros(C),
             output=torch.zeros(1, 3, H, D, dtype=BF16))
    call = validate_fused_decode(**a)
    assert call.gate_mode is GateMode.SOFTPLUS and call.lower_bound is None
    assert not call.has_dt_bias and call.has_bias and call.has_output and call.index_dtype is torch.int64
    a["dt_bias"] = torch.zeros(H, D)  # the [H, 128] form
    assert validate_fused_decode(**a).has_dt_bias
    b = _args(B=0)  # an empty batch is legal (the entry returns at once)
    assert validate_fused_decode(**b).B == 0


def test_conv_layouts_and_the_optional_norm():
    """Both conv cache layouts (SD: columns channel-contiguous; DS: each channel's columns contiguous, vLLM's
    dim-first cache, also in a page wider than the slot) and the call without the gated RMSNorm (output_gate and
    norm_weight both None) are legal and told apart in the description, which the launcher keys its variant on."""
    a = _args()
    sd = validate_fused_decode(**a)
    assert sd.conv_layout == "sd" and sd.has_norm
    for conv in (torch.zeros(4, C, 3, dtype=BF16), torch.zeros(4 * (C * 3 + 9), dtype=BF16).as_strided(
            (4, C, 3), (C * 3 + 9, 3, 1)), torch.zeros(4, C, 5, dtype=BF16)):
        ds = validate_fused_decode(**{**a, "conv_state": conv})
        assert ds.conv_layout == "ds" and ds is not sd and ds.N == 4
    bare = validate_fused_decode(**{**a, "output_gate": None, "norm_weight": None})
    assert not bare.has_norm and bare is not sd and bare.conv_layout == "sd"


def test_alignment_is_a_classification():
    assert validate_fused_decode(**_args(state_pad=0)).aligned
    unaligned = validate_fused_decode(**_args(state_pad=3))  # a slot stride that is no 16-byte multiple: legal
    assert not unaligned.aligned and unaligned.alignment == 4
    a = _args()
    a["raw_gate"] = torch.zeros(3 * H * D + 1, dtype=BF16)[1:].view(1, 3, H, D)  # pointer 2 bytes off
    assert not validate_fused_decode(**a).aligned


BAD = [
    ("x", dict(x=torch.zeros(3, C, dtype=F32)), "dtype bfloat16"),
    ("x", dict(x=torch.zeros(3, C + 1, dtype=BF16)), "[B, 3*H*128]"),
    ("x", dict(x=torch.zeros(3, 3 * 7 * D, dtype=BF16)), "H in"),
    ("x", dict(x=torch.zeros(C, 3, dtype=BF16).t()), "contiguous last dimension"),
    ("x", dict(x=torch.zeros(C * 3, dtype=BF16).as_strided((3, C), (C // 2, 1))), "row stride"),
    ("weight", dict(weight=torch.zeros(3, 4, H * D, dtype=BF16)), "dtype float32"),
    ("weight", dict(weight=torch.zeros(4, 3, H * D)), "[3, 4, H*128]"),
    ("weight", dict(weight=torch.zeros(3, H * D, 4).transpose(1, 2)), "contiguous"),
    ("bias", dict(bias=torch.zeros(C - 1)), "[3*H*128]"),
    ("conv_state", dict(conv_state=torch.zeros(4 * C * 6, dtype=BF16).as_strided((4, C, 3), (C * 6, 2, C * 2))),
     "channel-contiguous (SD) layout"),
    ("conv_state", dict(conv_state=torch.zeros(4 * C * 3, dtype=BF16).as_strided((4, C, 3), (C * 3, 2, 1))),
     "channel stride >= 3 in the DS layout"),
    ("conv_state", dict(conv_state=torch.zeros(4 * C * 3, dtype=BF16).as_strided((4, C, 3), (C * 2, 3, 1))),
     "slot stride >= "),
    ("conv_state", dict(conv_state=torch.zeros(4, 3, C, dtype=BF16).transpose(1, 2)[:, :, :2]), ">= 3"),
    ("conv_state", dict(conv_state=torch.zeros(4, 3, C, dtype=F32).transpose(1, 2)), "dtype bfloat16"),
    ("conv_state", dict(conv_state=torch.zeros(4 * C * 3, dtype=BF16).as_strided((4, C, 3), (C * 2, 1, C))),
     "slot stride"),
    ("raw_gate", dict(raw_gate=torch.zeros(3, H, D, dtype=BF16)), "[1, B, H, 128]"),
    ("raw_gate", dict(raw_gate=torch.zeros(1, 3, D, H, dtype=BF16).transpose(2, 3)), "contiguous last"),
    ("raw_beta", dict(raw_beta=torch.zeros(1, 3, H, dtype=F32)), "dtype bfloat16"),
    ("raw_beta", dict(raw_beta=torch.zeros(3, H, dtype=BF16)), "[1, B, H]"),
    ("A_log", dict(A_log=torch.zeros(H + 1)), "[H]"),
    ("A_log", dict(A_log=None), "computed in the kernel"),
    ("dt_bias", dict(dt_bias=torch.zeros(H * D, dtype=BF16)), "float32"),
    ("lower_bound", dict(lower_bound=1.0), "negative"),
    ("state_indices", dict(state_indices=torch.zeros(4, dtype=torch.int32)), "[B]"),
    ("state_indices", dict(state_indices=torch.zeros(3, dtype=torch.int16)), "int32 or int64"),
    ("state", dict(state=torch.zeros(3, H, D, D)), "as many slots as conv_state"),
    ("state", dict(state=torch.zeros(4, H, D, D, dtype=torch.float16)), "bfloat16 or float32"),
    ("state", dict(state=torch.zeros(4, H, D, D).transpose(2, 3)), "compact inner dims"),
    ("state", dict(state=torch.zeros(4, H + 1, D, D)), "[slots, H, 128, 128]"),
    ("output_gate", dict(output_gate=torch.zeros(3, H * D, dtype=BF16)), "[B, H, 128]"),
    ("output_gate", dict(output_gate=torch.zeros(3, H, D)), "dtype bfloat16"),
    ("norm_weight", dict(norm_weight=torch.zeros(D, dtype=BF16)), "float32"),
    ("norm_weight", dict(norm_weight=torch.zeros(2 * D)), "[128]"),
    ("norm_weight", dict(norm_weight=None), "both or neither"),
    ("output_gate", dict(output_gate=None), "both or neither"),
    ("norm_eps", dict(norm_eps=-1.0), ">= 0"),
    ("norm_eps", dict(norm_eps=float("nan")), ">= 0"),
    ("output", dict(output=torch.zeros(3, 1, H, D, dtype=BF16)), "[1, B, H, 128]"),
    ("output", dict(output=torch.zeros(1, 3, H, D)), "dtype bfloat16"),
    ("output", dict(output=torch.zeros(1, 1, H, D, dtype=BF16).expand(1, 3, H, D)), "do not overlap"),
    ("device_kind", dict(device_kind="gpu"), "one of"),
]


@pytest.mark.parametrize("argument, change, fragment", BAD, ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(BAD)])
def test_bad_argument_is_named(argument, change, fragment):
    a = _args()
    a.update(change)
    _raises(a, argument, fragment)


def test_output_aliasing_an_input_is_refused():
    a = _args()
    a["output"] = a["raw_gate"]  # same shape and dtype, shares every byte
    _raises(a, "output", "shares no byte with raw_gate")
    b = _args()
    b["output"] = b["x"][:, : H * D].unflatten(1, (H, D)).unsqueeze(0)  # a view of x's first columns
    _raises(b, "output", "shares no byte with x")


def test_cuda_kind_needs_a_cuda_tensor():
    a = _args()
    a["device_kind"] = "cuda"
    _raises(a, "x", "a CUDA tensor")


def test_meta_and_cpu_tensors_are_not_mixed():
    a = _args()
    a["norm_weight"] = torch.ones(D, device="meta")
    _raises(a, "norm_weight", "a tensor on")


@pytest.mark.gpu
def test_tensor_on_another_device_is_named():
    a = _args()
    a["device_kind"] = "cuda"
    a["x"] = a["x"].cuda()
    _raises(a, "weight", "the device of the call's first tensor")
