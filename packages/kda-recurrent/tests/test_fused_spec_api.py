"""``kda_recurrent.packed_fused_kda_decode``: the multi-token fused layer entry (FlashInfer's signature), eager and as
the ``kda::packed_fused_kda_decode`` op, against kda-core's reference (``packed_fused_kda_decode_ref``) on copies of
both caches. The inputs are those of the kda-cute kernel tests: ragged rows from ``query_start_loc``, a
heterogeneous ``num_accepted_tokens``, paged conv and state caches, strided x / beta / output-gate views. CPU cases
run the reference path; ``gpu`` cases the kernel.
"""

from __future__ import annotations

import pytest
import torch

from kda_core.errors import KDAError
from kda_core.oracle_fused import packed_fused_kda_decode_ref
from kda_recurrent import packed_fused_kda_decode

D = 128
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                 reason="needs a CUDA GPU")])]


def inputs(H, lengths, T, device, *, state_dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows, n_tok, HK = len(lengths), sum(lengths), H * D
    C, width, n_slots = 3 * HK, T + 2, len(lengths) * T + 2

    def randn(*shape, dtype=torch.float32, scale=1.0):
        return (scale * torch.randn(shape, generator=gen)).to(device=device, dtype=dtype)

    page = C * width + 24
    conv = torch.empty(n_slots * page, dtype=torch.bfloat16, device=device).as_strided((n_slots, C, width),
                                                                                       (page, 1, C))
    conv.copy_(randn(n_slots, C, width, dtype=torch.bfloat16, scale=0.5))
    slots = (torch.randperm(n_slots - 1, generator=gen)[: rows * T] + 1).view(rows, T).to(torch.int32)
    qsl = torch.tensor([0] + [sum(lengths[: i + 1]) for i in range(rows)], dtype=torch.int32)
    return dict(
        x=randn(n_tok, C + 17, dtype=torch.bfloat16)[:, :C], weight=randn(3, 4, HK, scale=0.3), conv_state=conv,
        raw_gate=randn(1, n_tok, H, D, dtype=torch.bfloat16),
        raw_beta=randn(1, n_tok, H + 1, dtype=torch.bfloat16)[:, :, :H], A_log=randn(H, scale=0.5),
        dt_bias=randn(HK, scale=0.1), state_indices=slots.to(device), state=randn(n_slots, H, D, D, scale=0.05,
                                                                                 dtype=state_dtype),
        output_gate=randn(n_tok, H, D, dtype=torch.bfloat16), norm_weight=randn(D),
        query_start_loc=qsl.to(device),
        num_accepted_tokens=torch.tensor([1 + (n * 7 + 3) % T for n in range(rows)], dtype=torch.int32,
                                         device=device),
    )  # fmt: skip


def copies(x):
    return {**x, "conv_state": x["conv_state"].clone(), "state": x["state"].clone()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_entry_matches_the_reference(device, state_dtype):
    x = inputs(12, [4, 1, 3, 2], 4, device, state_dtype=state_dtype)
    ref = copies(x)
    want = packed_fused_kda_decode_ref(**ref)
    got = packed_fused_kda_decode(**x)
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=2e-2)
    assert torch.equal(x["conv_state"], ref["conv_state"])  # the conv cache bitwise
    torch.testing.assert_close(x["state"].float(), ref["state"].float(), rtol=0, atol=2e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_the_compiled_op_writes_what_the_eager_call_writes(device):
    x = inputs(12, [2, 3], 4, device, seed=1)
    eager = copies(x)
    out = torch.empty(1, 5, 12, D, dtype=torch.bfloat16, device=device)
    packed_fused_kda_decode(**eager, output=out.clone())
    want = packed_fused_kda_decode(**copies(x))

    @torch.compile(backend="eager", fullgraph=True)
    def step(conv_state, state, output):
        return packed_fused_kda_decode(**{**x, "conv_state": conv_state, "state": state}, output=output)

    traced = copies(x)
    got = step(traced["conv_state"], traced["state"], out)
    assert got is out or torch.equal(got, out)
    torch.testing.assert_close(out.float(), want.float(), rtol=0, atol=0)
    assert torch.equal(traced["conv_state"], eager["conv_state"])
    assert torch.equal(traced["state"], eager["state"])


def test_refusals_name_the_argument():
    x = inputs(12, [2], 2, "cpu")
    with pytest.raises(KDAError, match="num_accepted_tokens"):
        packed_fused_kda_decode(**{**x, "num_accepted_tokens": x["num_accepted_tokens"][:0]})
    with pytest.raises(KDAError, match="t1_state_indices"):  # pre-resolved T = 1 rows with T = 2 windows
        packed_fused_kda_decode(**x, t1_state_indices=torch.ones(2, dtype=torch.int32))
