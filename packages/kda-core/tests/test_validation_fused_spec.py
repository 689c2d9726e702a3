"""The multi-token fused decode call's validation (kda_core.validation_fused.validate_packed_fused_decode): each
broken rule names its argument, and every call it accepts has an answer from the reference.

CPU tensors with ``device_kind="any"``; H = 8 keeps the state small.
"""

from __future__ import annotations

import pytest
import torch

from kda_core.contracts import GateMode, NullSlotPolicy
from kda_core.errors import KDAError
from kda_core.oracle_fused import packed_fused_kda_decode_ref
from kda_core.validation_fused import MAX_FUSED_SPEC_TOKENS, PackedFusedDecodeCall, validate_packed_fused_decode

BF16, F32 = torch.bfloat16, torch.float32
H, D = 8, 128
C = 3 * H * D


def _args(n_tok=5, rows=3, T=2, N=6, width=None, state_dtype=F32):
    width = T + 2 if width is None else width
    conv = torch.zeros(N * (C * width + 5), dtype=BF16).as_strided((N, C, width), (C * width + 5, 1, C))
    return dict(
        x=torch.zeros(n_tok, C + 17, dtype=BF16)[:, :C], weight=torch.zeros(3, 4, H * D), conv_state=conv,
        raw_gate=torch.zeros(1, n_tok, H, D, dtype=BF16),
        raw_beta=torch.zeros(1, n_tok, H + 1, dtype=BF16)[..., :H], A_log=torch.zeros(H), dt_bias=torch.zeros(H * D),
        state_indices=torch.arange(1, rows * T + 1, dtype=torch.int32).view(rows, T) % N,
        state=torch.zeros(N, H, D, D, dtype=state_dtype),
        output_gate=torch.zeros(n_tok, H * D + 7, dtype=BF16).as_strided((n_tok, H, D), (H * D + 7, D, 1)),
        norm_weight=torch.ones(D), query_start_loc=torch.tensor([0, 2, 3, 5][: rows + 1], dtype=torch.int32),
        num_accepted_tokens=torch.ones(rows, dtype=torch.int32), device_kind="any",
    )


def _raises(args, argument, fragment):
    with pytest.raises(KDAError) as info:
        validate_packed_fused_decode(**args)
    msg = str(info.value)
    assert msg.startswith(f"{argument}: expected "), msg
    assert fragment in msg and ", got " in msg, msg


def test_legal_call_is_described_and_remembered():
    a = _args()
    call = validate_packed_fused_decode(**a)
    assert isinstance(call, PackedFusedDecodeCall)
    assert (call.tokens, call.rows, call.T, call.H, call.N) == (5, 3, 2, H, 6)
    assert (call.state_dtype, call.index_dtype, call.qsl_dtype, call.nat_dtype) == (F32,) + (torch.int32,) * 3
    assert call.gate_mode is GateMode.LOWER_BOUND and call.lower_bound == -5.0 and call.norm_eps == 1e-5
    assert call.has_dt_bias and not call.has_bias and not call.has_output
    assert validate_packed_fused_decode(**a) is call


def test_optional_and_alternative_forms():
    a = _args(state_dtype=BF16, width=9)
    a.update(dt_bias=None, lower_bound=None, state_indices=torch.zeros(6, 6, dtype=torch.int64)[::2, :2],
             query_start_loc=torch.zeros(8, dtype=torch.int64)[::2], num_accepted_tokens=torch.zeros(3,
                                                                                                    dtype=torch.int64),
             output_gate=torch.zeros(1, 5, H, D, dtype=BF16), bias=torch.zeros(C),
             output=torch.zeros(1, 5, H, D, dtype=BF16))
    call = validate_packed_fused_decode(**a)
    assert call.gate_mode is GateMode.SOFTPLUS and call.lower_bound is None and call.state_dtype is BF16
    assert not call.has_dt_bias and call.has_bias and call.has_output
    assert (call.index_dtype, call.qsl_dtype, call.nat_dtype) == (torch.int64,) * 3
    validate_packed_fused_decode(**{**_args(), "dt_bias": torch.zeros(H, D)})  # the [H, 128] form
    validate_packed_fused_decode(**_args(n_tok=0, rows=0))  # nothing to run: still a legal call
    validate_packed_fused_decode(**_args(T=MAX_FUSED_SPEC_TOKENS))


@pytest.mark.parametrize("change, argument, fragment", [
    (dict(state_indices=torch.ones(3, dtype=torch.int32)), "state_indices", "2-D"),
    (dict(state_indices=torch.ones(3, 0, dtype=torch.int32)), "state_indices", "1 to 16 columns"),
    (dict(state_indices=torch.ones(3, 2, dtype=torch.int16)), "state_indices", "int32 or int64"),
    (dict(query_start_loc=torch.zeros(3, dtype=torch.int32)), "query_start_loc", "[N + 1] = (4,)"),
    (dict(query_start_loc=torch.zeros(4)), "query_start_loc", "int32 or int64"),
    (dict(num_accepted_tokens=torch.ones(4, dtype=torch.int32)), "num_accepted_tokens", "[N] = (3,)"),
    (dict(num_accepted_tokens=torch.ones(3, dtype=torch.uint8)), "num_accepted_tokens", "int32 or int64"),
    (dict(raw_gate=torch.zeros(1, 4, H, D, dtype=BF16)), "raw_gate", "[1, Ntok, H, 128]"),
    (dict(raw_beta=torch.zeros(1, 5, H, dtype=F32)), "raw_beta", "bfloat16"),
    (dict(output_gate=torch.zeros(4, H, D, dtype=BF16)), "output_gate", "[Ntok, H, 128]"),
    (dict(output=torch.zeros(1, 5, H, D)), "output", "bfloat16"),
    (dict(x=torch.zeros(5, C + 1, dtype=BF16)), "x", "[Ntok, 3*H*128]"),
    (dict(A_log=None), "A_log", "fp32 tensor"),
    (dict(lower_bound=0.5), "lower_bound", "negative"),
    (dict(norm_eps=-1.0), "norm_eps", ">= 0"),
])
def test_each_rule_names_its_argument(change, argument, fragment):
    _raises({**_args(), **change}, argument, fragment)


def test_conv_window_and_slot_counts():
    """The conv cache needs T + 2 columns (the T-token window) and as many slots as the state."""
    _raises(_args(T=4, width=5), "conv_state", "T + 2 = 6")
    _raises({**_args(), "state": torch.zeros(5, H, D, D)}, "state", "as many slots as conv_state")
    _raises({**_args(T=MAX_FUSED_SPEC_TOKENS + 1)}, "state_indices", f"1 to {MAX_FUSED_SPEC_TOKENS} columns")


def test_output_overlapping_an_input_is_refused():
    a = _args()
    out = a["raw_gate"]
    _raises({**a, "output": out}, "output", "shares no byte")


@pytest.mark.parametrize("policy", list(NullSlotPolicy), ids=[p.value for p in NullSlotPolicy])
def test_accepted_calls_have_a_reference_answer(policy):
    """A call the validator accepts runs in the reference (ragged rows, an empty row, a row longer than T,
    out-of-range device data: all bounded), whichever policy."""
    a = _args(n_tok=7, rows=3, T=2, N=6)
    a["query_start_loc"] = torch.tensor([-3, 2, 2, 99], dtype=torch.int32)
    a["num_accepted_tokens"] = torch.tensor([-(2**31), 5, 2], dtype=torch.int32)
    a["state_indices"] = torch.tensor([[1, 2], [3, -1], [4, 99]], dtype=torch.int32)
    validate_packed_fused_decode(**a)
    ref = {k: v for k, v in a.items() if k != "device_kind"}
    out = packed_fused_kda_decode_ref(**ref, null_policy=policy)
    assert out.shape == (1, 7, H, D) and torch.isfinite(out.float()).all()
