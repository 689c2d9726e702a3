"""unpack_packed: zero-copy T=1 views of one GEMM output row layout [q heads | k heads | v heads]."""

from __future__ import annotations

import pytest
import torch

from kda_core.errors import KDAError
from kda_core.oracle import unpack_packed

B, H, D = 3, 2, 8


def _packed(pad=0, beta_pad=0):
    big = torch.randn(B, 3 * H * D + pad).to(torch.bfloat16)
    mixed = big[:, : 3 * H * D]  # row stride 3*H*D + pad
    gate = torch.randn(B, H * D + pad).to(torch.bfloat16)[:, : H * D]
    beta = torch.randn(B, H + beta_pad).to(torch.bfloat16)[:, :H]
    return big, mixed, gate, beta


@pytest.mark.parametrize("pad", [0, 5, 64])
def test_views_alias_the_buffer_with_its_row_stride(pad):
    big, mixed, gate, beta = _packed(pad=pad, beta_pad=3)
    q, k, v, g, b = unpack_packed(mixed, gate, beta, H, head_dim=D)
    assert q.shape == k.shape == v.shape == g.shape == (B, 1, H, D) and b.shape == (B, 1, H)
    for i, view in enumerate((q, k, v)):
        assert view.untyped_storage().data_ptr() == big.untyped_storage().data_ptr()
        assert view.stride() == (3 * H * D + pad, 3 * H * D + pad, D, 1)
        assert torch.equal(view.reshape(B, H * D), mixed[:, i * H * D:(i + 1) * H * D])
    assert g.untyped_storage().data_ptr() == gate.untyped_storage().data_ptr()
    assert torch.equal(g.reshape(B, H * D), gate) and torch.equal(b[:, 0], beta)


def test_writes_to_the_buffer_show_through_the_views():
    big, mixed, gate, beta = _packed(pad=7)
    q, k, v, g, b = unpack_packed(mixed, gate, beta, H, head_dim=D)
    mixed[1, H * D + D + 3] = 42.0  # row 1, k, head 1, channel 3
    gate[2, 5] = -7.0
    beta[0, 1] = 9.0
    assert k[1, 0, 1, 3].item() == 42.0 and g[2, 0, 0, 5].item() == -7.0 and b[0, 0, 1].item() == 9.0


def test_views_of_a_sliced_buffer_keep_its_offset():
    big = torch.randn(B + 2, 3 * H * D).to(torch.bfloat16)
    mixed = big[2:]  # storage offset of two rows
    gate = torch.randn(B, H * D).to(torch.bfloat16)
    q, k, v, _, _ = unpack_packed(mixed, gate, torch.randn(B, H).to(torch.bfloat16), H, head_dim=D)
    assert torch.equal(v.reshape(B, H * D), big[2:, 2 * H * D:])


@pytest.mark.parametrize("which, shape, argument", [
    ("mixed", (B, 3 * H * D + 1), "mixed_qkv"), ("gate", (B, H * D - 1), "raw_gate"), ("beta", (B, H + 1), "raw_beta"),
])
def test_shape_errors_name_the_argument(which, shape, argument):
    _, mixed, gate, beta = _packed()
    parts = {"mixed": mixed, "gate": gate, "beta": beta}
    parts[which] = torch.zeros(shape, dtype=torch.bfloat16)
    with pytest.raises(KDAError, match=rf"^{argument}: expected shape"):
        unpack_packed(parts["mixed"], parts["gate"], parts["beta"], H, head_dim=D)
