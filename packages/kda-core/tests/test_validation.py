"""One test per validation rule: the right argument is named, with what was expected and what was given.

Calls are built on CPU tensors with ``device_kind="any"`` (the metadata path is the same on every device); the CUDA
device rules run in the GPU-marked tests at the end.
"""

from __future__ import annotations

import pytest
import torch

from kda_core import validation as V
from kda_core.call_args import RecurrentArgs
from kda_core.contracts import GateMode
from kda_core.errors import KDAError

BF16, F32 = torch.bfloat16, torch.float32
I32 = torch.int32
H, D = 12, 128


def _raises(fn, argument, fragment):
    with pytest.raises(KDAError) as info:
        fn()
    msg = str(info.value)
    assert msg.startswith(f"{argument}: expected "), msg
    assert fragment in msg, msg
    assert ", got " in msg, msg
    return msg


# ---------------------------------------------------------------------------------------------------------------
# Baseline legal calls


def t1_args(B=3, N=8, state_dtype=BF16, device="cpu"):
    mk = dict(device=device)
    return dict(
        q=torch.zeros(B, 1, H, D, dtype=BF16, **mk), k=torch.zeros(B, 1, H, D, dtype=BF16, **mk),
        v=torch.zeros(B, 1, H, D, dtype=BF16, **mk), g=torch.zeros(B, 1, H, D, dtype=BF16, **mk),
        beta=torch.zeros(B, 1, H, dtype=BF16, **mk), state_pool=torch.zeros(N, H, D, D, dtype=state_dtype, **mk),
        slot_indices=torch.zeros(B, dtype=I32, **mk), A_log=torch.zeros(H, **mk), dt_bias=torch.zeros(H * D, **mk),
        lower_bound=-5.0, device_kind="any",
    )


def t1(a):
    return V.validate_decode_t1(**a)


def packed_args(B=3, N=8, pad=0):
    return dict(
        mixed_qkv=torch.zeros(B, 3 * H * D + pad, dtype=BF16)[:, : 3 * H * D],
        raw_gate=torch.zeros(B, H * D + pad, dtype=BF16)[:, : H * D], raw_beta=torch.zeros(B, H, dtype=BF16),
        state_pool=torch.zeros(N, H, D, D, dtype=BF16), slot_indices=torch.zeros(B, dtype=I32), num_heads=H,
        A_log=torch.zeros(H), dt_bias=torch.zeros(H * D), lower_bound=-5.0, device_kind="any",
    )


def packed(a):
    return V.validate_packed_decode_t1(**a)


def rec_args(B=2, T=1, Hq=H, HV=H, K=D, mode="pool", N=8):
    a = dict(
        q=torch.zeros(B, T, Hq, K, dtype=BF16), k=torch.zeros(B, T, Hq, K, dtype=BF16),
        v=torch.zeros(B, T, HV, K, dtype=BF16), g=torch.zeros(B, T, HV, K, dtype=BF16),
        beta=torch.zeros(B, T, HV, dtype=BF16), A_log=torch.zeros(Hq), dt_bias=torch.zeros(Hq * K),
        use_gate_in_kernel=True, lower_bound=-5.0, beta_is_logit=True,
    )
    if mode == "pool":
        a.update(initial_state=torch.zeros(N, HV, K, K, dtype=BF16), ssm_state_indices=torch.zeros(B, dtype=I32))
    elif mode == "spec":
        a.update(initial_state=torch.zeros(N, HV, K, K, dtype=BF16),
                 ssm_state_indices=torch.zeros(B, T, dtype=I32), num_accepted_tokens=torch.ones(B, dtype=I32))
    return a


def rec(a):
    a = dict(a)
    device_kind = a.pop("device_kind", "any")
    return V.validate_recurrent(RecurrentArgs(**a), device_kind=device_kind)


def uc_args(B=2, T=8, N=5):
    return dict(
        A_log=torch.zeros(H), g=torch.zeros(B, T, H, D, dtype=BF16), dt_bias=torch.zeros(H * D), lower_bound=-5.0,
        q=torch.zeros(B, T, H, D, dtype=BF16), k=torch.zeros(B, T, H, D, dtype=BF16),
        v=torch.zeros(B, T, H, D, dtype=BF16), b=torch.zeros(B, T, H, dtype=BF16),
        initial_state_source=torch.zeros(N, H, D, D, dtype=BF16), initial_state_indices=torch.zeros(B, dtype=I32),
        k_cache=torch.zeros(N, H, 32, D, dtype=BF16), u_cache=torch.zeros(N, H, 32, D, dtype=BF16),
        g_cache=torch.zeros(N, H, 32, D, dtype=F32), hist_len=torch.zeros(B, dtype=I32),
        cache_base=torch.zeros(B, dtype=I32), device_kind="any",
    )


def uc(a):
    return V.validate_ucache(**a)


def _with(a, **changes):
    out = dict(a)
    out.update(changes)
    return out


def _strided_last(t):
    """The same shape with a last-dim stride of 2 (a legal torch view; not a legal kda input)."""
    big = torch.zeros(*t.shape[:-1], t.shape[-1] * 2, dtype=t.dtype)
    return big[..., ::2]


def _padded_rows(shape, dtype, row_stride):
    n, inner = shape[0], shape[1:]
    row = 1
    for x in inner:
        row *= x
    flat = torch.zeros(n * max(row_stride, row) + row, dtype=dtype)
    strides = [row_stride]
    acc = row
    for x in inner:
        acc //= x
        strides.append(acc)
    return flat.as_strided(shape, strides)


# ---------------------------------------------------------------------------------------------------------------
# Legal calls and the call descriptions


def test_legal_t1_call_is_described():
    call = t1(t1_args())
    assert (call.B, call.H, call.head_dim, call.N) == (3, H, D, 8)
    assert call.state_dtype == BF16 and call.gate_mode is GateMode.LOWER_BOUND and call.lower_bound == -5.0
    assert call.beta_is_logit is True and call.scale == pytest.approx(D**-0.5)
    assert call.aligned and call.alignment == 16 and not call.packed and not call.has_output


def test_t1_precomputed_convention_accepts_fp32_gate_and_beta_without_gate_params():
    a = _with(t1_args(state_dtype=F32), g=torch.zeros(3, 1, H, D), beta=torch.zeros(3, 1, H), A_log=None,
              dt_bias=None, use_gate_in_kernel=False, beta_is_logit=False, lower_bound=None, scale=0.5)
    call = t1(a)
    assert call.gate_mode is GateMode.PRECOMPUTED and call.g_dtype == F32 and call.state_dtype == F32
    assert call.scale == 0.5 and call.lower_bound is None


def test_t1_softplus_gate_and_2d_dt_bias():
    call = t1(_with(t1_args(), lower_bound=None, dt_bias=torch.zeros(H, D)))
    assert call.gate_mode is GateMode.SOFTPLUS


def test_t1_padded_pool_row_stride_is_legal():
    pool = _padded_rows((8, H, D, D), BF16, H * D * D + 64)
    assert t1(_with(t1_args(), state_pool=pool)).N == 8


# Relaxed serving layouts: a pool slot stride of any number of elements >= the row (the unaligned variant when its
# bytes are not a 16-byte multiple), slot indices int32 or int64 with any stride (a column of a wider table).

ODD_ROW = H * D * D + 17  # elements: 2 * ODD_ROW bytes is not a 16-byte multiple (nor 4-byte)


def _index_view(n, dtype=I32, stride=8, cols=None):
    """[n] (or [n, cols]) indices viewed out of a wider table: row stride ``stride`` elements."""
    if cols is None:
        return torch.arange(n * stride, dtype=dtype)[::stride]
    return torch.arange(n * stride * max(cols, 1), dtype=dtype).view(n, -1)[:, :cols * 2:2]


@pytest.mark.parametrize("state_dtype", [BF16, F32])
def test_an_odd_pool_slot_stride_is_legal_and_unaligned(state_dtype):
    pool = _padded_rows((8, H, D, D), state_dtype, ODD_ROW)
    call = t1(_with(t1_args(state_dtype=state_dtype), state_pool=pool))
    assert call.N == 8 and not call.aligned and call.alignment == (4 if state_dtype is F32 else 2)
    assert call is not t1(t1_args(state_dtype=state_dtype))  # the description is keyed on the alignment class
    assert packed(_with(packed_args(), state_pool=_padded_rows((8, H, D, D), BF16, ODD_ROW))).aligned is False
    r = rec(_with(rec_args(), initial_state=_padded_rows((8, H, D, D), state_dtype, ODD_ROW)))
    assert r.N == 8 and not r.aligned
    spec = rec(_with(rec_args(mode="spec"), initial_state=_padded_rows((8, H, D, D), state_dtype, ODD_ROW)))
    assert spec.mode == "spec" and not spec.aligned
    # one slot: its stride is never stepped over, so it does not decide the class
    assert t1(_with(t1_args(state_dtype=state_dtype), state_pool=_padded_rows((1, H, D, D), state_dtype,
                                                                               ODD_ROW))).aligned


@pytest.mark.parametrize("state_dtype", [BF16, F32])
def test_a_misaligned_pool_alone_is_told_apart_from_a_misaligned_activation(state_dtype):
    # others_aligned: the T=1 kernel's pool-realigning variant may run (everything but the pool read in vectors)
    pool = _padded_rows((8, H, D, D), state_dtype, ODD_ROW)
    call = t1(_with(t1_args(state_dtype=state_dtype), state_pool=pool))
    assert not call.aligned and call.others_aligned
    shifted_q = torch.zeros(3 * H * D + 8, dtype=BF16)[2:2 + 3 * H * D].view(3, 1, H, D)
    both = t1(_with(t1_args(state_dtype=state_dtype), state_pool=pool, q=shifted_q))
    assert not both.aligned and not both.others_aligned and both is not call
    assert t1(t1_args(state_dtype=state_dtype)).others_aligned  # an aligned call: both hold
    shifted_base = torch.zeros(8 * H * D * D + 2, dtype=state_dtype)[1:1 + 8 * H * D * D].view(8, H, D, D)
    assert t1(_with(t1_args(state_dtype=state_dtype), state_pool=shifted_base)).others_aligned
    assert packed(_with(packed_args(), state_pool=_padded_rows((8, H, D, D), BF16, ODD_ROW))).others_aligned
    r = rec(_with(rec_args(), initial_state=_padded_rows((8, H, D, D), state_dtype, ODD_ROW)))
    assert not r.aligned and r.others_aligned
    assert not rec(_with(rec_args(), initial_state=_padded_rows((8, H, D, D), state_dtype, ODD_ROW),
                         q=torch.zeros(2 * H * D + 1, dtype=BF16)[1:].view(2, 1, H, D))).others_aligned


def test_an_odd_ucache_pool_or_ring_stride_is_legal_and_unaligned():
    assert uc(uc_args()).aligned
    call = uc(_with(uc_args(), initial_state_source=_padded_rows((5, H, D, D), BF16, ODD_ROW)))
    assert not call.aligned
    ring = _padded_rows((5, H, 32, D), BF16, H * 32 * D + 3)
    assert not uc(_with(uc_args(), k_cache=ring)).aligned
    assert uc(_with(uc_args(), g_cache=_padded_rows((5, H, 32, D), F32, H * 32 * D + 4))).aligned  # 16 bytes


@pytest.mark.parametrize("dtype", [I32, torch.int64])
def test_slot_index_views_of_any_stride_and_int64_are_legal(dtype):
    a = _with(t1_args(), slot_indices=_index_view(3, dtype))
    call = t1(a)
    assert call.index_dtype is dtype and call.aligned  # indices are read as scalars: not in the alignment class
    assert packed(_with(packed_args(), slot_indices=_index_view(3, dtype))).index_dtype is dtype
    r = rec(_with(rec_args(B=3), ssm_state_indices=_index_view(3, dtype)))
    assert r.mode == "pool" and r.index_dtype is dtype
    spec = _with(rec_args(B=3, T=2, mode="spec"), ssm_state_indices=_index_view(3, dtype, cols=2),
                 num_accepted_tokens=_index_view(3, dtype, stride=3))
    assert spec["ssm_state_indices"].stride() == (16, 2) and spec["num_accepted_tokens"].stride() == (3,)
    r = rec(spec)
    assert r.mode == "spec" and r.index_dtype is dtype
    col = torch.zeros(3, 4, dtype=dtype)[:, 1]  # a column of a [B, 4] table
    assert uc(_with(uc_args(B=3), initial_state_indices=col)).index_dtype is dtype
    # a stride-0 broadcast is legal metadata (duplicates are a caller error, found under KDA_DEBUG_VALIDATE)
    assert t1(_with(t1_args(), slot_indices=torch.zeros(1, dtype=dtype).expand(3))).B == 3


def test_int32_and_int64_indices_are_different_descriptions():
    """The launchers key their compiled variant on the description's identity: the index dtype is one of its facts."""
    a32, a64 = t1_args(), _with(t1_args(), slot_indices=torch.zeros(3, dtype=torch.int64))
    assert t1(a32) is not t1(a64) and t1(a32) is t1(t1_args()) and t1(a64).index_dtype is torch.int64
    assert rec(rec_args()) is not rec(_with(rec_args(), ssm_state_indices=torch.zeros(2, dtype=torch.int64)))
    assert rec(rec_args(mode="dense")).index_dtype is None
    u64 = _with(uc_args(), initial_state_indices=torch.zeros(2, dtype=torch.int64))
    assert uc(uc_args()) is not uc(u64) and uc(u64).index_dtype is torch.int64


def test_cursors_stay_int32_and_contiguous():
    _raises(lambda: uc(_with(uc_args(), hist_len=torch.zeros(2, dtype=torch.int64))), "hist_len", "dtype int32")
    _raises(lambda: uc(_with(uc_args(), hist_len=torch.zeros(4, dtype=I32)[::2])), "hist_len", "contiguous")


def test_packed_call_with_padded_row_strides_is_described():
    call = packed(packed_args(pad=8))
    assert call.packed and call.aligned and call.B == 3 and call.H == H


def test_packed_row_stride_that_breaks_16_byte_alignment_is_classified_not_rejected():
    call = packed(packed_args(pad=1))
    assert not call.aligned and call.alignment == 2


@pytest.mark.parametrize("mode", ["dense", "pool", "spec"])
def test_recurrent_modes(mode):
    call = rec(rec_args(T=3, mode=mode))
    assert call.mode == mode and call.T == 3 and call.N_seq == 2
    assert call.N == (None if mode == "dense" else 8)
    assert not call.t1_eligible


def test_recurrent_call_carries_the_lower_bound_of_its_gate():
    assert rec(rec_args()).lower_bound == -5.0
    assert rec(_with(rec_args(), lower_bound=-2)).lower_bound == -2.0
    assert rec(_with(rec_args(), lower_bound=None)).lower_bound is None  # softplus gate
    assert rec(_with(rec_args(), use_gate_in_kernel=False)).lower_bound is None  # precomputed: ignored


def test_recurrent_varlen_counts_sequences_from_cu_seqlens_shape():
    a = _with(rec_args(B=1, T=7, mode="dense"), cu_seqlens=torch.tensor([0, 3, 3, 7], dtype=torch.int64))
    call = rec(a)
    assert call.varlen and call.N_seq == 3 and call.B == 1


def test_recurrent_gqa_and_head_dim_64():
    call = rec(rec_args(T=2, Hq=2, HV=6, K=64, mode="dense"))
    assert (call.H, call.HV, call.K, call.V) == (2, 6, 64, 64)


def test_legal_ucache_call_is_described(monkeypatch):
    monkeypatch.delenv("KDA_UCACHE_WRING", raising=False)
    call = uc(uc_args())
    assert (call.B, call.T, call.H, call.N) == (2, 8, H, 5)
    assert call.w_ring == 16 and call.flush_min == 9 and call.max_hist_len == 16
    assert call.gate_mode is GateMode.LOWER_BOUND and call.aligned


@pytest.mark.parametrize("T, w_ring, flush_min", [(8, 16, 9), (4, 16, 13), (8, 32, 17), (4, 32, 25)])
def test_ucache_default_flush_min(T, w_ring, flush_min):
    call = uc(_with(uc_args(T=T), w_ring=w_ring))
    assert call.flush_min == flush_min


def test_ucache_w_ring_comes_from_the_knob(monkeypatch):
    monkeypatch.setenv("KDA_UCACHE_WRING", "32")
    assert uc(uc_args(T=4)).w_ring == 32
    monkeypatch.setenv("KDA_UCACHE_WRING", "24")
    _raises(lambda: uc(uc_args(T=4)), "KDA_UCACHE_WRING", "16, 32")


# ---------------------------------------------------------------------------------------------------------------
# T=1 rules (unpacked)

T1_RULES = [
    ("q is a tensor", lambda a: a.update(q=[0.0]), "q", "a torch.Tensor"),
    ("q has T=1", lambda a: a.update(q=torch.zeros(3, 2, H, D, dtype=BF16)), "q", "shape [B, 1, H, 128]"),
    ("q head dim 128", lambda a: a.update(q=torch.zeros(3, 1, H, 64, dtype=BF16)), "q", "shape [B, 1, H, 128]"),
    ("H in T1_HEAD_COUNTS", lambda a: a.update(q=torch.zeros(3, 1, 10, D, dtype=BF16)), "q", "a head count"),
    ("q is bf16", lambda a: a.update(q=torch.zeros(3, 1, H, D, dtype=F32)), "q", "dtype bfloat16"),
    ("q last dim contiguous", lambda a: a.update(q=_strided_last(a["q"])), "q", "contiguous last dimension"),
    ("k shape", lambda a: a.update(k=torch.zeros(2, 1, H, D, dtype=BF16)), "k", "shape [B, 1, H, K]"),
    ("k last dim contiguous", lambda a: a.update(k=_strided_last(a["k"])), "k", "contiguous last dimension"),
    ("v is bf16", lambda a: a.update(v=torch.zeros(3, 1, H, D, dtype=torch.float16)), "v", "dtype bfloat16"),
    ("v has H == HV heads", lambda a: a.update(v=torch.zeros(3, 1, 2 * H, D, dtype=BF16)), "v", "H == HV"),
    ("raw g is bf16", lambda a: a.update(g=torch.zeros(3, 1, H, D)), "g", "raw gate"),
    ("g shape", lambda a: a.update(g=torch.zeros(3, 1, H, 64, dtype=BF16)), "g", "shape"),
    ("beta shape", lambda a: a.update(beta=torch.zeros(3, H, dtype=BF16)), "beta", "shape [B, 1, H]"),
    ("raw-gate beta is bf16", lambda a: a.update(beta=torch.zeros(3, 1, H)), "beta", "raw gate"),
    ("beta is not fp16", lambda a: a.update(beta=torch.zeros(3, 1, H, dtype=torch.float16)), "beta", "dtype"),
    ("pool is a tensor", lambda a: a.update(state_pool=None), "state_pool", "a torch.Tensor"),
    ("pool heads", lambda a: a.update(state_pool=torch.zeros(8, 8, D, D, dtype=BF16)), "state_pool",
     "shape [N, H, V, K]"),
    ("pool is 4-D", lambda a: a.update(state_pool=torch.zeros(H, D, D, dtype=BF16)), "state_pool", "shape"),
    ("pool dtype", lambda a: a.update(state_pool=torch.zeros(8, H, D, D, dtype=torch.float16)), "state_pool",
     "bfloat16 or float32"),
    ("pool K contiguous", lambda a: a.update(state_pool=a["state_pool"].transpose(2, 3)), "state_pool",
     "compact inner dims"),
    ("pool heads compact", lambda a: a.update(
        state_pool=torch.zeros(8, 2 * H, D, D, dtype=BF16)[:, ::2]), "state_pool", "compact inner dims"),
    ("pool rows do not overlap", lambda a: a.update(
        state_pool=_padded_rows((8, H, D, D), BF16, H * D * D - 8)), "state_pool", f">= {H * D * D}"),
    ("slots an integer dtype kda reads", lambda a: a.update(slot_indices=torch.zeros(3, dtype=torch.int16)),
     "slot_indices", "dtype int32 or int64"),
    ("slots a tensor", lambda a: a.update(slot_indices=[0, 1, 2]), "slot_indices", "a torch.Tensor"),
    ("slots [B]", lambda a: a.update(slot_indices=torch.zeros(4, dtype=I32)), "slot_indices", "shape [B]"),
    ("slots 1-D", lambda a: a.update(slot_indices=torch.zeros(3, 1, dtype=I32)), "slot_indices", "shape [B]"),
    ("A_log required", lambda a: a.update(A_log=None), "A_log", "when use_gate_in_kernel=True"),
    ("A_log fp32", lambda a: a.update(A_log=torch.zeros(H, dtype=BF16)), "A_log", "dtype float32"),
    ("A_log [H]", lambda a: a.update(A_log=torch.zeros(H + 1)), "A_log", "shape [H]"),
    ("dt_bias shape", lambda a: a.update(dt_bias=torch.zeros(H * 64)), "dt_bias", "[H*K]"),
    ("dt_bias fp32", lambda a: a.update(dt_bias=torch.zeros(H * D, dtype=BF16)), "dt_bias", "dtype float32"),
    ("dt_bias contiguous", lambda a: a.update(dt_bias=torch.zeros(D, H).t()), "dt_bias", "contiguous"),
    ("lower_bound < 0", lambda a: a.update(lower_bound=0.0), "lower_bound", "finite negative"),
    ("lower_bound positive", lambda a: a.update(lower_bound=2.0), "lower_bound", "finite negative"),
    ("lower_bound finite", lambda a: a.update(lower_bound=float("-inf")), "lower_bound", "finite negative"),
    ("lower_bound nan", lambda a: a.update(lower_bound=float("nan")), "lower_bound", "finite negative"),
    ("lower_bound a number", lambda a: a.update(lower_bound="-5"), "lower_bound", "a negative float"),
    ("lower_bound not a tensor", lambda a: a.update(lower_bound=torch.tensor(-5.0)), "lower_bound",
     "a negative float"),
    ("scale > 0", lambda a: a.update(scale=0.0), "scale", "positive finite"),
    ("scale negative", lambda a: a.update(scale=-1.0), "scale", "positive finite"),
    ("scale finite", lambda a: a.update(scale=float("inf")), "scale", "positive finite"),
    ("scale a number", lambda a: a.update(scale="0.1"), "scale", "positive finite"),
    ("output dtype", lambda a: a.update(output=torch.zeros(3, 1, H, D)), "output", "dtype bfloat16"),
    ("output shape", lambda a: a.update(output=torch.zeros(3, H, D, dtype=BF16)), "output", "shape [B, 1, H, V]"),
    ("output last dim", lambda a: a.update(output=_strided_last(torch.zeros(3, 1, H, D, dtype=BF16))), "output",
     "contiguous last dimension"),
    ("beta_is_logit a bool", lambda a: a.update(beta_is_logit=1), "beta_is_logit", "a bool"),
    ("use_gate_in_kernel a bool", lambda a: a.update(use_gate_in_kernel="yes"), "use_gate_in_kernel", "a bool"),
    ("device_kind value", lambda a: a.update(device_kind="gpu"), "device_kind", "one of"),
    ("cuda device kind needs CUDA tensors", lambda a: a.update(device_kind="cuda"), "q", "a CUDA tensor"),
]


@pytest.mark.parametrize("mutate, argument, fragment", [r[1:] for r in T1_RULES], ids=[r[0] for r in T1_RULES])
def test_t1_rule(mutate, argument, fragment):
    a = t1_args()
    mutate(a)
    _raises(lambda: t1(a), argument, fragment)


def test_t1_message_says_what_was_given():
    a = _with(t1_args(), slot_indices=torch.zeros(3, dtype=torch.uint8))
    assert _raises(lambda: t1(a), "slot_indices", "int32 or int64").endswith("got torch.uint8")
    a = _with(t1_args(), q=torch.zeros(3, 1, 10, D, dtype=BF16))
    assert _raises(lambda: t1(a), "q", "head count").endswith("got 10")


def test_precomputed_gate_ignores_gate_parameters():
    call = t1(_with(t1_args(), use_gate_in_kernel=False, A_log=None, dt_bias=None, lower_bound=3.0))
    assert call.gate_mode is GateMode.PRECOMPUTED and call.lower_bound is None


# ---------------------------------------------------------------------------------------------------------------
# Packed rules

PACKED_RULES = [
    ("num_heads int", lambda a: a.update(num_heads=12.0), "num_heads", "an int"),
    ("num_heads in counts", lambda a: a.update(num_heads=7), "num_heads", "a head count"),
    ("mixed_qkv tensor", lambda a: a.update(mixed_qkv=None), "mixed_qkv", "a torch.Tensor"),
    ("mixed_qkv width", lambda a: a.update(mixed_qkv=torch.zeros(3, 2 * H * D, dtype=BF16)), "mixed_qkv",
     "3*num_heads*128"),
    ("mixed_qkv 2-D", lambda a: a.update(mixed_qkv=torch.zeros(3, 1, 3 * H * D, dtype=BF16)), "mixed_qkv",
     "shape"),
    ("mixed_qkv bf16", lambda a: a.update(mixed_qkv=torch.zeros(3, 3 * H * D)), "mixed_qkv", "dtype bfloat16"),
    ("mixed_qkv last dim", lambda a: a.update(mixed_qkv=_strided_last(torch.zeros(3, 3 * H * D, dtype=BF16))),
     "mixed_qkv", "contiguous last dimension"),
    ("mixed_qkv rows do not overlap", lambda a: a.update(
        mixed_qkv=torch.zeros(6 * H * D, dtype=BF16).as_strided((3, 3 * H * D), (H * D, 1))), "mixed_qkv",
     "row stride >="),
    ("raw_gate shape", lambda a: a.update(raw_gate=torch.zeros(3, H * 64, dtype=BF16)), "raw_gate", "shape"),
    ("raw_gate batch", lambda a: a.update(raw_gate=torch.zeros(2, H * D, dtype=BF16)), "raw_gate", "shape"),
    ("raw_gate bf16 with raw gate", lambda a: a.update(raw_gate=torch.zeros(3, H * D)), "raw_gate", "raw gate"),
    ("raw_gate rows", lambda a: a.update(
        raw_gate=torch.zeros(2 * H * D, dtype=BF16).as_strided((3, H * D), (8, 1))), "raw_gate", "row stride >="),
    ("raw_beta shape", lambda a: a.update(raw_beta=torch.zeros(3, 1, H, dtype=BF16)), "raw_beta",
     "shape [B, num_heads]"),
    ("raw_beta dtype", lambda a: a.update(raw_beta=torch.zeros(3, H, dtype=torch.float16)), "raw_beta", "dtype"),
    ("pool heads follow num_heads", lambda a: a.update(state_pool=torch.zeros(4, 8, D, D, dtype=BF16)),
     "state_pool", "shape"),
    ("slots [B]", lambda a: a.update(slot_indices=torch.zeros(2, dtype=I32)), "slot_indices", "shape [B]"),
]


@pytest.mark.parametrize("mutate, argument, fragment", [r[1:] for r in PACKED_RULES],
                         ids=[r[0] for r in PACKED_RULES])
def test_packed_rule(mutate, argument, fragment):
    a = packed_args()
    mutate(a)
    _raises(lambda: packed(a), argument, fragment)


def test_packed_and_unpacked_views_of_one_buffer_describe_the_same_call():
    from kda_core.oracle import unpack_packed

    a = packed_args(pad=16)
    q, k, v, g, beta = unpack_packed(a["mixed_qkv"], a["raw_gate"], a["raw_beta"], H)
    call_p = packed(a)
    call_u = t1(dict(q=q, k=k, v=v, g=g, beta=beta, state_pool=a["state_pool"], slot_indices=a["slot_indices"],
                     A_log=a["A_log"], dt_bias=a["dt_bias"], lower_bound=-5.0, device_kind="any"))
    for field in ("B", "H", "N", "state_dtype", "g_dtype", "beta_dtype", "gate_mode", "scale", "aligned"):
        assert getattr(call_p, field) == getattr(call_u, field), field


# ---------------------------------------------------------------------------------------------------------------
# recurrent_kda rules

REC_RULES = [
    ("q tensor", "pool", lambda a: a.update(q=None), "q", "a torch.Tensor"),
    ("q 4-D", "pool", lambda a: a.update(q=torch.zeros(2, H, D, dtype=BF16)), "q", "4-D"),
    ("head dim in GENERIC_HEAD_DIMS", "dense", lambda a: a.update(
        q=torch.zeros(2, 1, H, 32, dtype=BF16), k=torch.zeros(2, 1, H, 32, dtype=BF16)), "q", "(64, 128)"),
    ("q dtype", "pool", lambda a: a.update(q=torch.zeros(2, 1, H, D, dtype=torch.float64)), "q", "dtype"),
    ("k shape of q", "pool", lambda a: a.update(k=torch.zeros(2, 1, H, 64, dtype=BF16)), "k", "the shape of q"),
    ("k dtype of q", "pool", lambda a: a.update(k=torch.zeros(2, 1, H, D)), "k", "the dtype of q"),
    ("k last dim", "pool", lambda a: a.update(k=_strided_last(a["k"])), "k", "contiguous last dimension"),
    ("v shape", "pool", lambda a: a.update(v=torch.zeros(2, 2, H, D, dtype=BF16)), "v", "shape [B, T, HV, V]"),
    ("V == K", "dense", lambda a: a.update(v=torch.zeros(2, 1, H, 64, dtype=BF16)), "v", "V == K"),
    ("HV % H == 0", "dense", lambda a: a.update(
        v=torch.zeros(2, 1, 18, D, dtype=BF16), g=torch.zeros(2, 1, 18, D, dtype=BF16),
        beta=torch.zeros(2, 1, 18, dtype=BF16)), "v", "divisible"),
    ("v dtype of q", "pool", lambda a: a.update(v=torch.zeros(2, 1, H, D, dtype=torch.float16)), "v",
     "the dtype of q"),
    ("g shape [B, T, HV, K]", "pool", lambda a: a.update(g=torch.zeros(2, 1, H, 64, dtype=BF16)), "g", "shape"),
    ("g dtype", "pool", lambda a: a.update(g=torch.zeros(2, 1, H, D, dtype=torch.float64)), "g", "dtype"),
    ("g last dim", "pool", lambda a: a.update(g=_strided_last(a["g"])), "g", "contiguous last dimension"),
    ("beta shape", "pool", lambda a: a.update(beta=torch.zeros(2, 1, H, 1, dtype=BF16)), "beta", "shape"),
    ("beta dtype", "pool", lambda a: a.update(beta=torch.zeros(2, 1, H, dtype=I32)), "beta", "dtype"),
    ("cu_seqlens 1-D", "dense", lambda a: a.update(
        q=a["q"][:1], k=a["k"][:1], v=a["v"][:1], g=a["g"][:1], beta=a["beta"][:1],
        cu_seqlens=torch.zeros(2, 2, dtype=I32)), "cu_seqlens", "1-D"),
    ("cu_seqlens integer", "dense", lambda a: a.update(
        q=a["q"][:1], k=a["k"][:1], v=a["v"][:1], g=a["g"][:1], beta=a["beta"][:1],
        cu_seqlens=torch.zeros(3)), "cu_seqlens", "int32 or int64"),
    ("cu_seqlens needs B == 1", "dense", lambda a: a.update(cu_seqlens=torch.zeros(3, dtype=I32)), "q",
     "B == 1"),
    ("indices int32 or int64", "pool", lambda a: a.update(ssm_state_indices=torch.zeros(2, dtype=torch.int16)),
     "ssm_state_indices", "dtype int32 or int64"),
    ("2-D indices int32 or int64", "spec", lambda a: a.update(ssm_state_indices=torch.zeros(2, 1)),
     "ssm_state_indices", "dtype int32 or int64"),
    ("1-D indices [N_seq]", "pool", lambda a: a.update(ssm_state_indices=torch.zeros(3, dtype=I32)),
     "ssm_state_indices", "[N_seq]"),
    ("2-D indices [N_seq, T]", "spec", lambda a: a.update(ssm_state_indices=torch.zeros(2, 2, dtype=I32)),
     "ssm_state_indices", "[N_seq, T]"),
    ("indices at most 2-D", "pool", lambda a: a.update(ssm_state_indices=torch.zeros(2, 1, 1, dtype=I32)),
     "ssm_state_indices", "1-D [N_seq] or 2-D"),
    ("pool required with indices", "pool", lambda a: a.update(initial_state=None), "initial_state",
     "the state pool"),
    ("pool heads", "pool", lambda a: a.update(initial_state=torch.zeros(8, 6, D, D, dtype=BF16)),
     "initial_state", "[N, HV, V, K]"),
    ("pool dtype", "pool", lambda a: a.update(initial_state=torch.zeros(8, H, D, D, dtype=torch.float16)),
     "initial_state", "bfloat16 or float32"),
    ("pool K contiguous", "spec", lambda a: a.update(initial_state=a["initial_state"].transpose(2, 3)),
     "initial_state", "compact inner dims"),
    ("pool rows do not overlap", "pool", lambda a: a.update(
        initial_state=_padded_rows((8, H, D, D), BF16, H * D * D - 2)), "initial_state", f">= {H * D * D}"),
    ("dense state shape", "dense", lambda a: a.update(initial_state=torch.zeros(3, H, D, D)), "initial_state",
     "[N_seq, HV, V, K]"),
    ("accepted tokens need 2-D indices", "pool", lambda a: a.update(
        num_accepted_tokens=torch.ones(2, dtype=I32)), "num_accepted_tokens", "2-D"),
    ("accepted tokens int32 or int64", "spec", lambda a: a.update(num_accepted_tokens=torch.ones(2)),
     "num_accepted_tokens", "dtype int32 or int64"),
    ("accepted tokens [N_seq]", "spec", lambda a: a.update(num_accepted_tokens=torch.ones(3, dtype=I32)),
     "num_accepted_tokens", "[N_seq]"),
    ("A_log with in-kernel gate", "pool", lambda a: a.update(A_log=None), "A_log", "use_gate_in_kernel=True"),
    ("dt_bias shape", "pool", lambda a: a.update(dt_bias=torch.zeros(3)), "dt_bias", "shape"),
    ("lower_bound < 0", "pool", lambda a: a.update(lower_bound=1.0), "lower_bound", "negative"),
    ("scale > 0", "pool", lambda a: a.update(scale=-0.1), "scale", "positive"),
    ("output shape", "pool", lambda a: a.update(output=torch.zeros(2, 1, H, 64, dtype=BF16)), "output", "shape"),
    ("output bf16", "pool", lambda a: a.update(output=torch.zeros(2, 1, H, D)), "output", "dtype bfloat16"),
    ("output_final_state bool", "pool", lambda a: a.update(output_final_state=None), "output_final_state",
     "a bool"),
    ("use_qk_l2norm_in_kernel bool", "pool", lambda a: a.update(use_qk_l2norm_in_kernel=0),
     "use_qk_l2norm_in_kernel", "a bool"),
    ("device_kind cuda", "pool", lambda a: a.update(device_kind="cuda"), "q", "a CUDA tensor"),
]


@pytest.mark.parametrize("mode, mutate, argument, fragment", [r[1:] for r in REC_RULES],
                         ids=[r[0] for r in REC_RULES])
def test_recurrent_rule(mode, mutate, argument, fragment):
    a = rec_args(mode=mode)
    mutate(a)
    _raises(lambda: rec(a), argument, fragment)


def test_recurrent_varlen_spec_indices_take_any_column_count():
    a = _with(rec_args(B=1, T=5, mode="dense"), cu_seqlens=torch.tensor([0, 2, 5], dtype=I32),
              initial_state=torch.zeros(4, H, D, D, dtype=BF16), ssm_state_indices=torch.zeros(2, 3, dtype=I32))
    assert rec(a).mode == "spec"


# ---------------------------------------------------------------------------------------------------------------
# T=1 eligibility of recurrent_kda calls

ELIGIBILITY = [
    ("T > 1", dict(T=2), None, "T=2"),
    ("varlen spec", dict(B=1, T=3, mode="spec"), lambda a: a.update(
        cu_seqlens=torch.tensor([0, 3], dtype=I32)), "2-D ssm_state_indices"),
    ("varlen dense", dict(B=1, T=3, mode="dense"), lambda a: a.update(
        cu_seqlens=torch.tensor([0, 1, 3], dtype=I32)), "no ssm_state_indices"),
    ("varlen GQA", dict(B=1, T=3, Hq=4, HV=H), lambda a: a.update(
        cu_seqlens=torch.tensor([0, 3], dtype=I32)), "GQA"),
    ("varlen fp32", dict(B=1, T=3), lambda a: a.update(
        cu_seqlens=torch.tensor([0, 3], dtype=I32), **{n: a[n].float() for n in ("q", "k", "v")}), "bfloat16"),
    ("dense", dict(mode="dense"), None, "no ssm_state_indices"),
    ("spec", dict(mode="spec"), None, "2-D ssm_state_indices"),
    ("GQA", dict(Hq=4, HV=H), None, "GQA"),
    ("head count", dict(Hq=4, HV=4), None, "H=4"),
    ("head dim", dict(K=64), None, "head dim 64"),
    ("fp32 activations", dict(), lambda a: a.update(**{n: a[n].float() for n in ("q", "k", "v")}), "bfloat16"),
    ("fp32 raw gate", dict(), lambda a: a.update(g=a["g"].float()), "g in torch.float32"),
    ("fp16 beta", dict(), lambda a: a.update(beta=a["beta"].half()), "beta in torch.float16"),
    ("no l2 norm", dict(), lambda a: a.update(use_qk_l2norm_in_kernel=False), "use_qk_l2norm_in_kernel=False"),
    ("CPU", dict(), None, "not on a CUDA device"),
]


@pytest.mark.parametrize("shape, mutate, reason", [r[1:] for r in ELIGIBILITY], ids=[r[0] for r in ELIGIBILITY])
def test_t1_ineligibility_reason(shape, mutate, reason):
    a = rec_args(**shape)
    if mutate:
        mutate(a)
    call = rec(a)
    assert not call.t1_eligible
    assert call.t1_reason.startswith("not eligible") and reason in call.t1_reason, call.t1_reason


@pytest.mark.parametrize("cu_dtype", [I32, torch.int64])
def test_varlen_decode_in_pool_mode_is_for_the_t1_kernels_varlen_entry(cu_dtype):
    """[1, T, H, 128] + cu_seqlens, 1-D indices: eligible but for the device, whatever the (unread) offsets hold."""
    for n_seq, T in ((3, 3), (3, 7), (4, 0)):
        a = _with(rec_args(B=1, T=T), cu_seqlens=torch.zeros(n_seq + 1, dtype=cu_dtype),
                  ssm_state_indices=torch.zeros(n_seq, dtype=I32))
        call = rec(a)
        assert call.varlen and call.mode == "pool" and call.N_seq == n_seq and call.T == T
        assert call.t1_reason == "not eligible: tensors not on a CUDA device (the oracle runs the call)"
    a["ssm_state_indices"] = _index_view(4, torch.int64)  # any index layout, as the batch entry
    assert rec(a).index_dtype is torch.int64 and "CUDA" in rec(a).t1_reason


def test_precomputed_fp32_gate_is_not_a_reason_to_leave_the_t1_path():
    a = _with(rec_args(), g=torch.zeros(2, 1, H, D), beta=torch.zeros(2, 1, H), use_gate_in_kernel=False)
    assert "CUDA" in rec(a).t1_reason  # only the device is missing


# ---------------------------------------------------------------------------------------------------------------
# ucache rules

UC_RULES = [
    ("T in {4, 8}", lambda a: a.update(**{n: torch.zeros(2, 6, H, D, dtype=BF16) for n in "qkvg"}), "q",
     "T in (4, 8)"),
    ("q head dim", lambda a: a.update(q=torch.zeros(2, 8, H, 64, dtype=BF16)), "q", "shape [B, T, H, 128]"),
    ("heads in counts", lambda a: a.update(q=torch.zeros(2, 8, 6, D, dtype=BF16)), "q", "a head count"),
    ("q bf16", lambda a: a.update(q=torch.zeros(2, 8, H, D)), "q", "dtype bfloat16"),
    ("k shape", lambda a: a.update(k=torch.zeros(2, 4, H, D, dtype=BF16)), "k", "shape"),
    ("v bf16", lambda a: a.update(v=torch.zeros(2, 8, H, D)), "v", "dtype bfloat16"),
    ("g bf16", lambda a: a.update(g=torch.zeros(2, 8, H, D)), "g", "dtype bfloat16"),
    ("b shape", lambda a: a.update(b=torch.zeros(2, 8, H, 1, dtype=BF16)), "b", "shape [B, T, H]"),
    ("b bf16", lambda a: a.update(b=torch.zeros(2, 8, H)), "b", "dtype bfloat16"),
    ("A_log required", lambda a: a.update(A_log=None), "A_log", "fp32 tensor"),
    ("dt_bias fp32", lambda a: a.update(dt_bias=torch.zeros(H * D, dtype=BF16)), "dt_bias", "float32"),
    ("lower_bound < 0", lambda a: a.update(lower_bound=0.5), "lower_bound", "negative"),
    ("scale > 0", lambda a: a.update(scale=0), "scale", "positive"),
    ("pool bf16", lambda a: a.update(initial_state_source=torch.zeros(5, H, D, D)), "initial_state_source",
     "dtype bfloat16"),
    ("pool shape", lambda a: a.update(initial_state_source=torch.zeros(5, H, D, 64, dtype=BF16)),
     "initial_state_source", "shape"),
    ("pool rows do not overlap", lambda a: a.update(
        initial_state_source=_padded_rows((5, H, D, D), BF16, H * D * D - 3)), "initial_state_source",
     f">= {H * D * D}"),
    ("ring rows do not overlap", lambda a: a.update(
        g_cache=_padded_rows((5, H, 32, D), F32, H * 32 * D - 1)), "g_cache", f">= {H * 32 * D}"),
    ("k ring N = pool rows", lambda a: a.update(k_cache=torch.zeros(4, H, 32, D, dtype=BF16)), "k_cache",
     "N = pool rows"),
    ("k ring 32 slots", lambda a: a.update(k_cache=torch.zeros(5, H, 16, D, dtype=BF16)), "k_cache", "32"),
    ("u ring bf16", lambda a: a.update(u_cache=torch.zeros(5, H, 32, D)), "u_cache", "dtype bfloat16"),
    ("g ring fp32", lambda a: a.update(g_cache=torch.zeros(5, H, 32, D, dtype=BF16)), "g_cache", "dtype float32"),
    ("ring compact", lambda a: a.update(g_cache=torch.zeros(5, H, D, 32).transpose(2, 3)), "g_cache",
     "compact inner dims"),
    ("indices int32 or int64", lambda a: a.update(initial_state_indices=torch.zeros(2, dtype=torch.int16)),
     "initial_state_indices", "dtype int32 or int64"),
    ("hist_len [B]", lambda a: a.update(hist_len=torch.zeros(3, dtype=I32)), "hist_len", "shape [B]"),
    ("cache_base int32", lambda a: a.update(cache_base=torch.zeros(2, dtype=torch.int16)), "cache_base",
     "dtype int32"),
    ("cache_base contiguous", lambda a: a.update(cache_base=torch.zeros(4, dtype=I32)[::2]), "cache_base",
     "contiguous"),
    ("w_ring 16 or 32", lambda a: a.update(w_ring=24), "w_ring", "(16, 32)"),
    ("w_ring an int", lambda a: a.update(w_ring=16.0), "w_ring", "(16, 32)"),
    ("flush_min >= 1", lambda a: a.update(flush_min=0), "flush_min", ">= 1"),
    ("flush_min <= max (T=8, w16)", lambda a: a.update(flush_min=10), "flush_min", "= 9"),
    ("flush_min > 16 with w_ring 32", lambda a: a.update(w_ring=32, flush_min=16), "flush_min", "> 16"),
    ("flush_min <= max (T=8, w32)", lambda a: a.update(w_ring=32, flush_min=18), "flush_min", "= 17"),
    ("flush_min an int", lambda a: a.update(flush_min=9.0), "flush_min", "an int"),
    ("restart flag bool", lambda a: a.update(restart_hist_on_flush=None), "restart_hist_on_flush", "a bool"),
    ("output shape", lambda a: a.update(output=torch.zeros(2, 8, H, 64, dtype=BF16)), "output", "shape"),
    ("device_kind cuda", lambda a: a.update(device_kind="cuda"), "q", "a CUDA tensor"),
]


@pytest.mark.parametrize("mutate, argument, fragment", [r[1:] for r in UC_RULES], ids=[r[0] for r in UC_RULES])
def test_ucache_rule(mutate, argument, fragment, monkeypatch):
    monkeypatch.delenv("KDA_UCACHE_WRING", raising=False)
    a = uc_args()
    mutate(a)
    _raises(lambda: uc(a), argument, fragment)


def test_ucache_flush_min_bounds_for_t4():
    assert uc(_with(uc_args(T=4), flush_min=13)).flush_min == 13
    _raises(lambda: uc(_with(uc_args(T=4), flush_min=14)), "flush_min", "= 13")
    assert uc(_with(uc_args(T=4), w_ring=32, flush_min=17)).flush_min == 17
    _raises(lambda: uc(_with(uc_args(T=4), w_ring=32, flush_min=26)), "flush_min", "= 25")


def test_ucache_softplus_gate():
    assert uc(_with(uc_args(), lower_bound=None)).gate_mode is GateMode.SOFTPLUS


# ---------------------------------------------------------------------------------------------------------------
# Alignment: classified, never rejected


def test_tensor_alignment_of_fresh_and_shifted_tensors():
    base = torch.zeros(64, dtype=BF16)
    assert V.tensor_alignment(base) == 16
    assert V.tensor_alignment(base[1:]) == 2
    assert V.tensor_alignment(base[2:]) == 4
    assert V.tensor_alignment(base[4:]) == 8
    assert V.tensor_alignment(base[8:]) == 16
    assert V.tensor_alignment(torch.zeros(16)[1:]) == 4
    assert V.tensor_alignment(torch.zeros(16, dtype=torch.uint8)[3:]) == 1


def test_tensor_alignment_reads_strides_of_stepped_dims_only():
    rows = torch.zeros(4, 130, dtype=BF16)[:, :128]  # row stride 260 bytes
    assert V.tensor_alignment(rows) == 4
    one_row = torch.zeros(1, 130, dtype=BF16)[:, :128]  # a single row is never stepped over
    assert V.tensor_alignment(one_row) == 16
    odd_unit = torch.zeros(64, dtype=BF16).as_strided((8, 1), (8, 3))  # size-1 dim with an odd stride
    assert V.tensor_alignment(odd_unit) == 16


def test_is_aligned_over_several_tensors():
    a, b = torch.zeros(32, dtype=BF16), torch.zeros(33, dtype=BF16)[1:]
    assert V.is_aligned(a, None)
    assert not V.is_aligned(a, b)
    assert V.is_aligned(a, b, bytes=2)
    _raises(lambda: V.is_aligned(a, bytes=3), "bytes", "one of")


@pytest.mark.parametrize("name", ["q", "k", "v", "g", "output"])
def test_t1_shifted_activation_takes_the_unaligned_variant(name):
    a = t1_args()
    shape = (3, 1, H, D)
    a[name] = torch.zeros(3 * H * D + 1, dtype=BF16)[1:].view(shape)
    call = t1(a)
    assert not call.aligned and call.alignment == 2


def test_t1_shifted_pool_and_dt_bias_take_the_unaligned_variant():
    pool = torch.zeros(8 * H * D * D + 4, dtype=BF16)[4:].view(8, H, D, D)
    assert t1(_with(t1_args(), state_pool=pool)).alignment == 8
    dt = torch.zeros(H * D + 1)[1:]
    assert t1(_with(t1_args(), dt_bias=dt)).alignment == 4


def test_t1_odd_head_stride_takes_the_unaligned_variant():
    q = torch.zeros(3, 1, H, D + 1, dtype=BF16)[..., :D]
    assert t1(_with(t1_args(), q=q)).alignment == 2


def test_recurrent_and_ucache_classify_alignment():
    a = rec_args()
    a["v"] = torch.zeros(2 * H * D + 4, dtype=BF16)[4:].view(2, 1, H, D)
    assert rec(a).alignment == 8 and not rec(a).aligned
    u = uc_args()
    u["g_cache"] = torch.zeros(5 * H * 32 * D + 1)[1:].view(5, H, 32, D)
    assert uc(u).alignment == 4


# ---------------------------------------------------------------------------------------------------------------
# Metadata only


def _meta(args):
    return {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in args.items()}


def test_validation_works_on_meta_tensors():
    assert t1(_meta(t1_args())).B == 3
    assert packed(_meta(packed_args(pad=8))).packed
    assert rec(_meta(rec_args(T=4, mode="spec"))).mode == "spec"
    assert uc(_meta(uc_args())).T == 8


def test_validation_never_reads_values(monkeypatch):
    def boom(*_args, **_kw):
        raise AssertionError("validation read a tensor value")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "any", "all"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    t1(t1_args())
    packed(packed_args(pad=8))
    rec(rec_args(T=2, mode="spec"))
    rec(_with(rec_args(B=1, T=3, mode="dense"), cu_seqlens=torch.tensor([0, 1, 3], dtype=I32)))
    uc(uc_args())
    with pytest.raises(KDAError):  # the error path only formats metadata too
        t1(_with(t1_args(), slot_indices=torch.zeros(5, dtype=I32)))


# ---------------------------------------------------------------------------------------------------------------
# Debug value checks


def test_debug_checks_follow_the_knob(monkeypatch):
    monkeypatch.delenv("KDA_DEBUG_VALIDATE", raising=False)
    assert V.debug_checks_enabled() is False
    monkeypatch.setenv("KDA_DEBUG_VALIDATE", "1")
    assert V.debug_checks_enabled() is (not torch.cuda.is_available() or
                                        not torch.cuda.is_current_stream_capturing())
    monkeypatch.setenv("KDA_DEBUG_VALIDATE", "maybe")
    _raises(V.debug_checks_enabled, "KDA_DEBUG_VALIDATE", "0/1")


def test_debug_check_slots_finds_duplicate_active_slots():
    V.debug_check_slots(torch.tensor([3, 1, 0], dtype=I32), 4)
    V.debug_check_slots(torch.tensor([-1, -1, 4, 4, 2], dtype=I32), 4)  # inactive duplicates are padding
    msg = _raises(lambda: V.debug_check_slots(torch.tensor([2, 0, 2, -1], dtype=I32), 4), "slot_indices",
                  "distinct active slots")
    assert "[2]" in msg
    _raises(lambda: V.debug_check_slots(torch.tensor([[0, 1], [2, 1]], dtype=I32), 4), "slot_indices", "distinct")


def test_debug_check_slots_under_the_nonpositive_policy_lets_slot_0_repeat():
    padded = torch.tensor([0, 3, 0, 0, 1], dtype=torch.int64)
    V.debug_check_slots(padded, 4, null_policy="nonpositive")
    V.debug_check_slots(torch.tensor([[0, 2], [0, 3]], dtype=I32), 4, null_policy=V.NullSlotPolicy.NONPOSITIVE)
    _raises(lambda: V.debug_check_slots(padded, 4), "slot_indices", "distinct active slots in [0, 4)")
    _raises(lambda: V.debug_check_slots(torch.tensor([0, 2, 2]), 4, null_policy="nonpositive"), "slot_indices",
            "distinct active slots in [1, 4)")
    _raises(lambda: V.debug_check_slots(padded, 4, null_policy="vllm"), "null_policy", "NullSlotPolicy")
    # ucache cursors of a row at slot 0 are padding under NONPOSITIVE
    V.debug_check_ucache_cursors(torch.tensor([99, 0], dtype=I32), torch.tensor([0, 0], dtype=I32), 4, 16,
                                 slot_indices=torch.tensor([0, 1], dtype=I32), N=2, null_policy="nonpositive")
    _raises(lambda: V.debug_check_ucache_cursors(torch.tensor([99, 0], dtype=I32), torch.tensor([0, 0], dtype=I32),
                                                 4, 16, slot_indices=torch.tensor([0, 1], dtype=I32), N=2),
            "hist_len", "at row 0")


def test_debug_check_ucache_cursors():
    V.debug_check_ucache_cursors(torch.tensor([0, 16], dtype=I32), torch.tensor([0, 31], dtype=I32), 8, 16)
    _raises(lambda: V.debug_check_ucache_cursors(torch.tensor([17], dtype=I32), torch.tensor([0], dtype=I32), 8, 16),
            "hist_len", "[0, 16]")
    _raises(lambda: V.debug_check_ucache_cursors(torch.tensor([25], dtype=I32), torch.tensor([0], dtype=I32), 8, 32),
            "hist_len", "[0, 24]")
    _raises(lambda: V.debug_check_ucache_cursors(torch.tensor([-1], dtype=I32), torch.tensor([0], dtype=I32), 4, 16),
            "hist_len", "at row 0")
    _raises(lambda: V.debug_check_ucache_cursors(torch.tensor([0, 0], dtype=I32), torch.tensor([0, 32], dtype=I32),
                                                 4, 16), "cache_base", "[0, 32)")
    # rows whose slot is inactive are padding: their cursors are not checked
    V.debug_check_ucache_cursors(torch.tensor([0, 99], dtype=I32), torch.tensor([0, -5], dtype=I32), 4, 16,
                                 slot_indices=torch.tensor([0, -1], dtype=I32), N=2)


# ---------------------------------------------------------------------------------------------------------------
# CUDA device rules


@pytest.mark.gpu
def test_cuda_calls_are_eligible_and_mixed_devices_are_named():
    a = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in t1_args().items()}
    a["device_kind"] = "cuda"
    assert t1(a).aligned
    a["slot_indices"] = a["slot_indices"].cpu()
    _raises(lambda: t1(a), "slot_indices", "cuda:0")
    r = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in rec_args().items()}
    call = rec(r)
    assert call.on_cuda and call.t1_eligible and call.t1_reason.startswith("eligible")
    r["dt_bias"] = r["dt_bias"].cpu()
    _raises(lambda: rec(r), "dt_bias", "cuda:0")


# ---------------------------------------------------------------------------------------------------------------
# Descriptions are remembered by the facts they are made of


def test_a_repeated_call_returns_the_same_description_and_a_changed_fact_a_new_one():
    a = t1_args()
    first = t1(a)
    assert t1(t1_args()) is first  # same shapes, dtypes, scalars and alignment class
    shifted = _with(a, q=torch.zeros(3 * H * D + 1, dtype=BF16)[1:].view(3, 1, H, D))
    assert not t1(shifted).aligned and t1(a).aligned
    assert t1(_with(a, lower_bound=-2.0)).lower_bound == -2.0 and t1(a).lower_bound == -5.0
    assert t1(_with(a, scale=0.25)).scale == 0.25
    assert t1(_with(a, beta_is_logit=False)).beta_is_logit is False


def test_precomputed_calls_with_any_ignored_lower_bound_share_a_description():
    a = _with(t1_args(), use_gate_in_kernel=False)
    assert t1(_with(a, lower_bound=[1, 2])) is t1(_with(a, lower_bound=None))  # unhashable and ignored


def test_remembered_descriptions_are_bounded():
    for B in range(1, V._MEMO_MAX + 50):
        V.validate_recurrent(RecurrentArgs(*(torch.empty(B, 1, 1, 64, device="meta") for _ in range(4)),
                                           torch.empty(B, 1, 1, device="meta")))
    assert len(V._MEMO) <= V._MEMO_MAX


def test_precomputed_gate_does_not_check_ignored_gate_tensors():
    a = _with(t1_args(), use_gate_in_kernel=False, A_log=torch.zeros(3, dtype=BF16), dt_bias=torch.zeros(5))
    assert t1(a).gate_mode is GateMode.PRECOMPUTED
    r = _with(rec_args(), use_gate_in_kernel=False, A_log="unused", dt_bias=torch.zeros(2, 2))
    assert rec(r).gate_mode is GateMode.PRECOMPUTED


# ---------------------------------------------------------------------------------------------------------------
# Re-validation (the launchers' hot path): the facts of the memo key plus the rules a compiled wrapper cannot check.
# On CPU tensors the device floor is lowered and the full validators take device_kind="any", as a CUDA call would.


@pytest.fixture
def on_cpu(monkeypatch):
    import functools

    monkeypatch.setattr(V, "_LAUNCH_DEVICE_MIN", -1)
    for name in ("validate_decode_t1", "validate_packed_decode_t1"):
        monkeypatch.setattr(V, name, functools.partial(getattr(V, name), device_kind="any"))


def _reval_packed(a):
    a = dict(a)
    a.pop("device_kind", None)
    return V.revalidate_packed_decode_t1(
        a["mixed_qkv"], a["raw_gate"], a["raw_beta"], a["state_pool"], a["slot_indices"], a["num_heads"],
        a["A_log"], a["dt_bias"], a.get("lower_bound"), a.get("use_gate_in_kernel", True), a.get("beta_is_logit", True),
        a.get("scale"), a.get("output"))


def _reval_t1(a):
    return V.revalidate_decode_t1(
        a["q"], a["k"], a["v"], a["g"], a["beta"], a["state_pool"], a["slot_indices"], a["A_log"], a["dt_bias"],
        a.get("lower_bound"), a.get("use_gate_in_kernel", True), a.get("beta_is_logit", True), a.get("scale"),
        a.get("output"))


def test_cpu_tensors_miss_the_hot_path_and_get_the_full_validators_device_error():
    a = packed_args()
    packed(a)  # described with device_kind="any"; the launch floor still refuses the CPU tensor
    _raises(lambda: _reval_packed(a), "mixed_qkv", "a CUDA tensor")
    _raises(lambda: _reval_t1(t1_args()), "q", "a CUDA tensor")


def test_revalidation_returns_the_full_validators_description(on_cpu):
    a = packed_args(B=4, pad=8)
    assert _reval_packed(a) is packed(a)
    b = t1_args(B=4)
    b["output"] = torch.zeros(4, 1, H, D, dtype=BF16)
    assert _reval_t1(b) is t1(b)
    # Every fact of the key is read: a changed one is another description, exactly the full validator's.
    shifted = _with(a, raw_gate=torch.zeros(4 * H * D + 1, dtype=BF16)[1:].view(4, H * D))
    assert not _reval_packed(shifted).aligned and _reval_packed(shifted) is packed(shifted)
    assert _reval_packed(_with(a, lower_bound=-2.0)).lower_bound == -2.0
    assert _reval_packed(_with(a, scale=0.5)).scale == 0.5
    assert _reval_packed(_with(a, beta_is_logit=False)).beta_is_logit is False
    assert _reval_packed(_with(a, state_pool=torch.zeros(8, H, D, D))).state_dtype is F32
    pre = _with(a, use_gate_in_kernel=False, raw_gate=torch.zeros(4, H * D), raw_beta=torch.zeros(4, H))
    assert _reval_packed(pre) is packed(pre) and _reval_packed(pre).g_dtype is F32
    shifted_out = _with(b, output=torch.zeros(4 * H * D + 1, dtype=BF16)[1:].view(4, 1, H, D))
    assert not _reval_t1(shifted_out).aligned and _reval_t1(b).aligned


def test_revalidation_takes_the_relaxed_layouts_and_keys_them(on_cpu):
    a = _with(t1_args(B=4), slot_indices=_index_view(4, torch.int64),
              state_pool=_padded_rows((8, H, D, D), BF16, ODD_ROW))
    call = _reval_t1(a)
    assert call is t1(a) and call.index_dtype is torch.int64 and not call.aligned
    assert _reval_t1(_with(a, slot_indices=_index_view(4, I32))).index_dtype is I32
    assert _reval_t1(_with(a, state_pool=torch.zeros(8, H, D, D, dtype=BF16))).aligned
    assert call.others_aligned
    shifted = _with(a, q=torch.zeros(4 * H * D + 1, dtype=BF16)[1:].view(4, 1, H, D))
    assert _reval_t1(shifted) is t1(shifted) and not _reval_t1(shifted).others_aligned
    p = _with(packed_args(B=4), slot_indices=_index_view(4, torch.int64))
    assert _reval_packed(p) is packed(p) and _reval_packed(p).index_dtype is torch.int64
    # An output overlapping a strided index view is found by the index view's span (not B elements from its
    # start), after a good call of the same facts described them.
    good = _with(t1_args(B=4), output=torch.zeros(4, 1, H, D, dtype=BF16),
                 slot_indices=torch.zeros(4 * 64, dtype=torch.int64)[::64])
    assert _reval_t1(good).has_output
    buf = torch.zeros(4 * H * D + 512, dtype=BF16)  # slot 0 at byte 0, slot 3 at byte 1536: inside the output
    bad = _with(good, output=buf[512:].view(4, 1, H, D), slot_indices=buf.view(torch.int64)[::64][:4])
    _raises(lambda: _reval_t1(bad), "output", "slot_indices")


def test_a_described_call_is_not_validated_again(on_cpu, monkeypatch):
    a, b = packed_args(B=5), t1_args(B=5)
    first_packed, first_t1 = _reval_packed(a), _reval_t1(b)

    def full(*args, **kw):
        raise AssertionError("the full validator ran on a described call")

    monkeypatch.setattr(V, "validate_packed_decode_t1", full)
    monkeypatch.setattr(V, "validate_decode_t1", full)
    assert _reval_packed(packed_args(B=5)) is first_packed  # new tensors, the same facts
    assert _reval_t1(t1_args(B=5)) is first_t1


# Rules a compiled wrapper cannot check: broken after a good call of the same facts, the full validator names them.
REVALIDATED_RULES = [
    ("num_heads", lambda a: a.update(num_heads=7), "num_heads", "a head count"),
    ("mixed_qkv width", lambda a: a.update(mixed_qkv=torch.zeros(3, 2 * H * D, dtype=BF16)), "mixed_qkv", "shape"),
    ("mixed_qkv overlap", lambda a: a.update(
        mixed_qkv=torch.zeros(6 * H * D, dtype=BF16).as_strided((3, 3 * H * D), (H * D, 1))), "mixed_qkv",
     "row stride >="),
    ("raw_gate width", lambda a: a.update(raw_gate=torch.zeros(3, H * 64, dtype=BF16)), "raw_gate", "shape"),
    ("raw_gate overlap", lambda a: a.update(
        raw_gate=torch.zeros(2 * H * D, dtype=BF16).as_strided((3, H * D), (8, 1))), "raw_gate", "row stride >="),
    ("pool heads", lambda a: a.update(state_pool=torch.zeros(8, 8, D, D, dtype=BF16)), "state_pool", "shape"),
    ("pool rows overlap", lambda a: a.update(state_pool=_padded_rows((8, H, D, D), BF16, H * D * D - 4)),
     "state_pool", f">= {H * D * D}"),
    ("dt_bias size", lambda a: a.update(dt_bias=torch.zeros(100)), "dt_bias", "shape"),
    ("dt_bias 2-D contiguous", lambda a: a.update(dt_bias=torch.zeros(D, H).t()), "dt_bias", "contiguous"),
    ("lower_bound", lambda a: a.update(lower_bound=0.5), "lower_bound", "negative"),
    ("scale", lambda a: a.update(scale=-1.0), "scale", "positive"),
    ("flag", lambda a: a.update(beta_is_logit=1), "beta_is_logit", "a bool"),
    ("not a tensor", lambda a: a.update(raw_gate=[1, 2]), "raw_gate", "a torch.Tensor"),
]


@pytest.mark.parametrize("mutate, argument, fragment", [r[1:] for r in REVALIDATED_RULES],
                         ids=[r[0] for r in REVALIDATED_RULES])
def test_revalidation_checks_what_the_wrapper_cannot(on_cpu, mutate, argument, fragment):
    a = packed_args()
    _reval_packed(a)  # the good call: its facts are now described
    mutate(a)
    _raises(lambda: _reval_packed(a), argument, fragment)


def test_an_empty_batch_is_always_fully_validated(on_cpu, monkeypatch):
    a = packed_args(B=0)
    assert _reval_packed(a).B == 0
    calls = []
    monkeypatch.setattr(V, "validate_packed_decode_t1", lambda *x, **kw: calls.append(1))
    _reval_packed(a)
    assert calls == [1]  # no compiled wrapper runs for B == 0, so nothing is left to one


def test_recurrent_revalidation_returns_only_t1_eligible_cuda_descriptions(on_cpu):
    a = rec_args(B=3)
    args = RecurrentArgs(**a)
    rec(a)
    assert V.revalidate_recurrent_t1(args) is None  # described, but on the CPU: not T=1 eligible
    assert V.revalidate_recurrent_t1(args._replace(cu_seqlens=torch.zeros(4, dtype=I32))) is None  # varlen
    assert V.revalidate_recurrent_t1(args._replace(output_final_state=True)) is None
    assert V.revalidate_recurrent_t1(args._replace(g=[1])) is None  # a failing read
    assert V.revalidate_recurrent_t1(tuple(args)[:17]) is None  # not the call's bundle: the full validator says so


def test_recurrent_validation_takes_the_calls_bundle():
    a = rec_args()
    _raises(lambda: V.validate_recurrent(tuple(RecurrentArgs(**a))), "args", "RecurrentArgs")
    assert RecurrentArgs(**a) == tuple(RecurrentArgs(**a))  # a tuple in the facade's order, nothing more


def test_recurrent_revalidation_finds_a_cuda_description_by_its_facts(on_cpu, monkeypatch):
    import dataclasses

    a = rec_args(B=3)
    args = RecurrentArgs(**a)
    call = rec(a)
    # Store the description a CUDA call with these facts gets (the key's last fact is on_cuda).
    key = next(k for k, v in V._MEMO.items() if v is call)
    cuda_call = dataclasses.replace(call, on_cuda=True, t1_eligible=True)
    monkeypatch.setitem(V._MEMO, (*key[:-1], True), cuda_call)
    assert V.revalidate_recurrent_t1(args) is cuda_call
    assert V.revalidate_recurrent_t1(args._replace(use_qk_l2norm_in_kernel=False)) is None  # another key
    overlapping = _padded_rows((8, H, D, D), BF16, H * D * D - 8)
    assert V.revalidate_recurrent_t1(args._replace(initial_state=overlapping)) is None  # the wrapper cannot check
    # int64 indices are another compiled variant: another description, not this one
    assert V.revalidate_recurrent_t1(args._replace(ssm_state_indices=torch.zeros(3, dtype=torch.int64))) is None


def _varlen_args(T=5, S=3, out=True, cu_dtype=I32):
    """A varlen decode call [1, T, H, 128] + cu_seqlens [S + 1], 1-D indices [S], with an output."""
    a = rec_args(B=1, T=T)
    a.update(cu_seqlens=torch.arange(S + 1, dtype=cu_dtype), ssm_state_indices=torch.arange(S, dtype=I32) + 1)
    if out:
        a["output"] = torch.zeros(1, T, H, D, dtype=BF16)
    return a


@pytest.fixture
def cuda_twins(monkeypatch):
    """Every recurrent description the full validator remembers on CPU tensors is also stored under the key a CUDA
    call of the same facts has (its last fact, on_cuda), T=1 eligible as such a call is."""
    import dataclasses

    monkeypatch.setattr(V, "_MEMO", {})
    remember = V._remember

    def twin(key, call):
        call = remember(key, call)
        if key[0] == "recurrent" and key[-1] is False and "not on a CUDA device" in call.t1_reason:
            V._MEMO[(*key[:-1], True)] = dataclasses.replace(call, on_cuda=True, t1_eligible=True)
        return call

    monkeypatch.setattr(V, "_remember", twin)


def test_varlen_revalidation_finds_the_cuda_description_by_its_facts(on_cpu, cuda_twins):
    a = _varlen_args()
    rec(a)
    call = V.revalidate_recurrent_t1_varlen(tuple(RecurrentArgs(**a)))
    assert call is not None and call.varlen and call.on_cuda and call.T == 5 and call.N_seq == 3 and call.aligned
    assert V.revalidate_recurrent_t1_varlen(RecurrentArgs(**_varlen_args())) is call  # new tensors, same facts
    assert V.revalidate_recurrent_t1(RecurrentArgs(**a)) is None  # the T=1 re-validator never takes varlen
    # Every fact of the key is read: a changed one is another description (none yet), or the same when equal.
    assert V.revalidate_recurrent_t1_varlen(RecurrentArgs(**_with(a, scale=0.5))) is None
    assert V.revalidate_recurrent_t1_varlen(RecurrentArgs(**_varlen_args(T=6))) is None
    assert V.revalidate_recurrent_t1_varlen(RecurrentArgs(**_varlen_args(S=4))) is None
    assert V.revalidate_recurrent_t1_varlen(RecurrentArgs(**_varlen_args(cu_dtype=torch.int64))) is call
    assert V.revalidate_recurrent_t1_varlen(RecurrentArgs(**_varlen_args(out=False))) is call  # (no key fact)
    # a token stride that is not a 16-byte multiple is another alignment class, and so is a shifted output
    wide = torch.zeros(1, 5, H * D + 1, dtype=BF16)[..., : H * D].view(1, 5, H, D)
    assert V.revalidate_recurrent_t1_varlen(RecurrentArgs(**_with(a, q=wide))) is None
    shifted = _with(a, output=torch.zeros(5 * H * D + 1, dtype=BF16)[1:].view(1, 5, H, D))
    assert V.revalidate_recurrent_t1_varlen(RecurrentArgs(**shifted)) is None
    assert not rec(shifted).aligned and V.revalidate_recurrent_t1_varlen(RecurrentArgs(**shifted)) is not None


def _out_over(a, name):
    """An output [1, T, H, 128] whose bytes cover the start of the tensor ``name`` (a view of the same storage)."""
    t = a[name]
    T = a["q"].shape[1]
    n = T * H * D * 2 // t.element_size() + t.numel()
    buf = torch.zeros(n, dtype=t.dtype)
    over = dict(a)
    over[name] = buf[: t.numel()].view(t.shape) if t.dim() != 4 else buf[: t.numel()].view(t.shape)
    over["output"] = buf.view(torch.bfloat16)[: T * H * D].view(1, T, H, D)
    return over


# Rules the varlen re-validator reads itself (its wrapper cannot check them): broken after a good call of the same
# facts, it returns None and the full validator names the argument.
VARLEN_RULES = [
    ("indices count", lambda a: a.update(ssm_state_indices=torch.arange(2, dtype=I32)), "ssm_state_indices",
     "[N_seq]"),
    ("cu_seqlens dtype", lambda a: a.update(cu_seqlens=torch.arange(4.0)), "cu_seqlens", "int32 or int64"),
    ("output over cu_seqlens", lambda a: a.update(_out_over(a, "cu_seqlens")), "output", "cu_seqlens"),
    ("output over the indices", lambda a: a.update(_out_over(a, "ssm_state_indices")), "output",
     "ssm_state_indices"),
    ("output over q", lambda a: a.update(output=a["q"]), "output", "q"),
    ("output over beta", lambda a: a.update(_out_over(a, "beta")), "output", "beta"),
    ("output tokens overlap", lambda a: a.update(
        output=torch.zeros(H * D, dtype=BF16).as_strided((1, 5, H, D), (0, 0, D, 1))), "output", "overlap"),
    ("pool heads", lambda a: a.update(initial_state=torch.zeros(8, 8, D, D, dtype=BF16)), "initial_state", "shape"),
    ("pool rows overlap", lambda a: a.update(initial_state=_padded_rows((8, H, D, D), BF16, H * D * D - 4)),
     "initial_state", "rows must not overlap"),
    ("dt_bias size", lambda a: a.update(dt_bias=torch.zeros(100)), "dt_bias", "shape"),
    ("lower_bound", lambda a: a.update(lower_bound=0.5), "lower_bound", "negative"),
    ("scale", lambda a: a.update(scale=-1.0), "scale", "positive"),
    ("flag", lambda a: a.update(beta_is_logit=1), "beta_is_logit", "a bool"),
    ("num_accepted_tokens", lambda a: a.update(num_accepted_tokens=torch.ones(3, dtype=I32)), "num_accepted_tokens",
     "None"),
    ("not a tensor", lambda a: a.update(g=[1, 2]), "g", "a torch.Tensor"),
]


@pytest.mark.parametrize("mutate, argument, fragment", [r[1:] for r in VARLEN_RULES],
                         ids=[r[0] for r in VARLEN_RULES])
def test_varlen_revalidation_checks_what_the_wrapper_cannot(on_cpu, cuda_twins, mutate, argument, fragment):
    a = _varlen_args()
    rec(a)
    assert V.revalidate_recurrent_t1_varlen(RecurrentArgs(**a)) is not None  # the good call is described
    mutate(a)
    assert V.revalidate_recurrent_t1_varlen(RecurrentArgs(**a)) is None
    _raises(lambda: rec(a), argument, fragment)


def test_varlen_revalidation_leaves_calls_that_launch_nothing_to_the_full_validator(on_cpu, cuda_twins):
    for a in (_varlen_args(T=0), _varlen_args(S=0)):  # no token, no sequence: no wrapper would check the rest
        rec(a)
        assert V.revalidate_recurrent_t1_varlen(RecurrentArgs(**a)) is None
    a = _varlen_args()
    rec(a)
    assert V.revalidate_recurrent_t1_varlen(RecurrentArgs(**_with(a, output_final_state=True))) is None
    assert V.revalidate_recurrent_t1_varlen(tuple(RecurrentArgs(**a))[:17]) is None
    assert V.revalidate_recurrent_t1_varlen(RecurrentArgs(**_with(a, cu_seqlens=None))) is None


def test_cpu_tensors_never_take_the_varlen_hot_path(cuda_twins):
    a = _varlen_args()
    rec(a)
    assert V.revalidate_recurrent_t1_varlen(RecurrentArgs(**a)) is None  # the launch floor refuses the CPU tensor


# ---------------------------------------------------------------------------------------------------------------
# What a kernel writes aliases nothing (metadata: data pointers, sizes, strides)


def _t1_out(B=3):
    return torch.zeros(B, 1, H, D, dtype=BF16)


T1_ALIASED_OUTPUTS = [
    # (case, builder of args with an output, the argument the output overlaps or None for self-overlap)
    ("a pool row", lambda a: a.update(output=a["state_pool"][2].reshape(-1)[: 3 * H * D].view(3, 1, H, D)),
     "state_pool"),
    ("q itself", lambda a: a.update(output=a["q"]), "q"),
    ("part of v", lambda a: a.update(v=(buf := torch.zeros(4, 1, H, D, dtype=BF16))[:3], output=buf[1:]), "v"),
    ("beta's bytes", lambda a: a.update(output=(buf := torch.zeros(3 * H * D, dtype=BF16)).view(3, 1, H, D),
                                        beta=buf[: 3 * H].view(3, 1, H)), "beta"),
    ("the slot indices", lambda a: a.update(output=(buf := torch.zeros(3 * H * D, dtype=BF16)).view(3, 1, H, D),
                                            slot_indices=buf.view(torch.int32)[:3]), "slot_indices"),
    ("dt_bias", lambda a: a.update(output=(buf := torch.zeros(3 * H * D * 2, dtype=BF16)).view(3, 1, H, 2 * D)[..., :D],
                                   dt_bias=buf.view(F32)[: H * D]), "dt_bias"),
    ("a batch stride of 0", lambda a: a.update(output=torch.zeros(1, 1, H, D, dtype=BF16).expand(3, 1, H, D)), None),
    ("rows overlapping", lambda a: a.update(output=torch.zeros(4 * H * D, dtype=BF16).as_strided(
        (3, 1, H, D), (D, D, D, 1))), None),
]


@pytest.mark.parametrize("case, build, other", T1_ALIASED_OUTPUTS, ids=[c[0] for c in T1_ALIASED_OUTPUTS])
def test_t1_refuses_an_output_that_aliases(case, build, other):
    a = t1_args()
    build(a)
    _raises(lambda: t1(a), "output", "shares no byte with " + other if other else "do not overlap")


@pytest.mark.parametrize("case, build, other", T1_ALIASED_OUTPUTS, ids=[c[0] for c in T1_ALIASED_OUTPUTS])
def test_t1_revalidation_refuses_an_output_that_aliases(on_cpu, case, build, other):
    a = t1_args()
    legal = dict(a, output=_t1_out())
    t1(legal)  # the facts described before, with an output of its own
    build(a)
    _raises(lambda: _reval_t1(a), "output", "shares no byte with " + other if other else "do not overlap")


def test_t1_accepts_outputs_whose_rows_are_padded_or_heads_major():
    t1(dict(t1_args(), output=torch.zeros(3, 1, H, D + 8, dtype=BF16)[..., :D]))
    t1(dict(t1_args(), output=torch.zeros(H, 3, 1, D, dtype=BF16).permute(1, 2, 0, 3)))


def test_t1_revalidation_finds_a_call_with_a_legal_output(on_cpu):
    a = dict(t1_args(), output=_t1_out())
    assert _reval_t1(a) is t1(a)


@pytest.mark.parametrize("case, build, other", [
    ("mixed_qkv", lambda a: a.update(output=a["mixed_qkv"][:, : H * D].unsqueeze(1).unflatten(2, (H, D))),
     "mixed_qkv"),
    ("a pool row", lambda a: a.update(output=a["state_pool"][1].reshape(-1)[: 3 * H * D].view(3, 1, H, D)),
     "state_pool"),
    ("raw_beta", lambda a: a.update(output=(buf := torch.zeros(3 * H * D, dtype=BF16)).view(3, 1, H, D),
                                    raw_beta=buf[: 3 * H].view(3, H)), "raw_beta"),
    ("a batch stride of 0", lambda a: a.update(output=torch.zeros(1, 1, H, D, dtype=BF16).expand(3, 1, H, D)), None),
])
def test_packed_t1_and_its_revalidation_refuse_an_output_that_aliases(on_cpu, case, build, other):
    a = packed_args()
    packed(dict(a, output=_t1_out()))
    build(a)
    fragment = "shares no byte with " + other if other else "do not overlap"
    _raises(lambda: packed(a), "output", fragment)
    _raises(lambda: _reval_packed(a), "output", fragment)


@pytest.mark.parametrize("case, build, other", [
    ("a pool row", lambda a: a.update(output=a["initial_state"][3].reshape(-1)[: 2 * H * D].view(2, 1, H, D)),
     "initial_state"),
    ("q itself", lambda a: a.update(output=a["q"]), "q"),
    ("the slot indices", lambda a: a.update(output=(buf := torch.zeros(2 * H * D, dtype=BF16)).view(2, 1, H, D),
                                            ssm_state_indices=buf.view(torch.int32)[:2]), "ssm_state_indices"),
    ("a batch stride of 0", lambda a: a.update(output=torch.zeros(1, 1, H, D, dtype=BF16).expand(2, 1, H, D)), None),
    ("tokens overlapping", lambda a: a.update(
        q=torch.zeros(2, 3, H, D, dtype=BF16), k=torch.zeros(2, 3, H, D, dtype=BF16),
        v=torch.zeros(2, 3, H, D, dtype=BF16), g=torch.zeros(2, 3, H, D, dtype=BF16),
        beta=torch.zeros(2, 3, H, dtype=BF16), initial_state=None, ssm_state_indices=None,
        output=torch.zeros(2, 1, H, D, dtype=BF16).expand(2, 3, H, D)), None),
])
def test_recurrent_refuses_an_output_that_aliases(case, build, other):
    a = rec_args()
    build(a)
    _raises(lambda: rec(a), "output", "shares no byte with " + other if other else "do not overlap")


def test_recurrent_t1_revalidation_refuses_an_output_over_a_pool_row(on_cpu, monkeypatch):
    import dataclasses

    a = dict(rec_args(B=3), output=_t1_out())
    args = RecurrentArgs(**a)
    call = rec(a)
    key = next(k for k, v in V._MEMO.items() if v is call)
    monkeypatch.setitem(V._MEMO, (*key[:-1], True), dataclasses.replace(call, on_cuda=True, t1_eligible=True))
    assert V.revalidate_recurrent_t1(args) is not None
    row = a["initial_state"][5].reshape(-1)[: 3 * H * D].view(3, 1, H, D)
    assert V.revalidate_recurrent_t1(args._replace(output=row)) is None  # the full validator then raises


@pytest.mark.parametrize("case, build, other", [
    ("a ring", lambda a: a.update(output=a["u_cache"][1].reshape(-1)[: 2 * 8 * H * D].view(2, 8, H, D)), "u_cache"),
    ("the g ring", lambda a: a.update(output=a["g_cache"][0].reshape(-1).view(BF16)[: 2 * 8 * H * D].view(
        2, 8, H, D)), "g_cache"),
    ("the pool", lambda a: a.update(output=a["initial_state_source"][4].reshape(-1)[: 2 * 8 * H * D].view(
        2, 8, H, D)), "initial_state_source"),
    ("q itself", lambda a: a.update(output=a["q"]), "q"),
    ("a token stride of 0", lambda a: a.update(output=torch.zeros(2, 1, H, D, dtype=BF16).expand(2, 8, H, D)), None),
])
def test_ucache_refuses_an_output_that_aliases(case, build, other):
    a = uc_args()
    build(a)
    _raises(lambda: uc(a), "output", "shares no byte with " + other if other else "do not overlap")


@pytest.mark.parametrize("later, earlier", [
    ("hist_len", "initial_state_indices"), ("cache_base", "initial_state_indices"), ("cache_base", "hist_len"),
])
def test_ucache_refuses_cursors_that_alias_each_other(later, earlier):
    a = uc_args()
    a[later] = a[earlier]
    _raises(lambda: uc(a), later, "shares no byte with " + earlier)


def test_ucache_refuses_a_cursor_inside_the_pool():
    a = uc_args()
    a["hist_len"] = a["initial_state_source"].view(-1).view(torch.int32)[:2]
    _raises(lambda: uc(a), "hist_len", "shares no byte with initial_state_source")


def test_ucache_refuses_slot_indices_inside_a_ring():
    a = uc_args()
    a["initial_state_indices"] = torch.zeros(2, dtype=I32)
    a["cache_base"] = a["k_cache"].view(-1).view(torch.int32)[4:6]
    _raises(lambda: uc(a), "cache_base", "shares no byte with k_cache")


# ---------------------------------------------------------------------------------------------------------------
# Empty head counts, cpu versus meta, optional dt_bias


def test_recurrent_refuses_zero_value_heads():
    a = rec_args(mode="dense")
    a.update(v=torch.zeros(2, 1, 0, D, dtype=BF16), g=torch.zeros(2, 1, 0, D, dtype=BF16),
             beta=torch.zeros(2, 1, 0, dtype=BF16))
    _raises(lambda: rec(a), "v", "HV (dim 2) >= 1")


def test_recurrent_refuses_zero_query_heads():
    a = rec_args(mode="dense")
    a.update(q=torch.zeros(2, 1, 0, D, dtype=BF16), k=torch.zeros(2, 1, 0, D, dtype=BF16))
    _raises(lambda: rec(a), "q", "H (dim 2) >= 1")


def test_recurrent_refuses_a_zero_head_dim():
    a = rec_args(mode="dense", K=D)
    a.update(q=torch.zeros(2, 1, H, 0, dtype=BF16))
    _raises(lambda: rec(a), "q", "head dim")


@pytest.mark.parametrize("name", ["initial_state", "ssm_state_indices", "v"])
def test_recurrent_tells_a_meta_tensor_from_a_cpu_call(name):
    a = rec_args()
    a[name] = a[name].to("meta")
    _raises(lambda: rec(a), name, "the device of q")


def test_t1_tells_a_meta_pool_from_a_cpu_call():
    a = t1_args()
    a["state_pool"] = a["state_pool"].to("meta")
    _raises(lambda: t1(a), "state_pool", "the device of q")


def test_ucache_tells_a_meta_cursor_from_a_cpu_call():
    a = uc_args()
    a["hist_len"] = a["hist_len"].to("meta")
    _raises(lambda: uc(a), "hist_len", "the device of q")


def test_dt_bias_is_optional_with_the_gate_in_the_kernel():
    assert not t1(dict(t1_args(), dt_bias=None)).has_dt_bias
    assert t1(t1_args()).has_dt_bias
    assert not packed(dict(packed_args(), dt_bias=None)).has_dt_bias
    assert not rec(dict(rec_args(), dt_bias=None)).has_dt_bias
    uc(dict(uc_args(), dt_bias=None))


def test_t1_revalidation_tells_a_call_without_dt_bias_from_one_with_it(on_cpu):
    a = t1_args()
    without = dict(a, dt_bias=None)
    assert _reval_t1(without) is t1(without)
    assert _reval_t1(a) is t1(a)
    assert t1(a) is not t1(without)


# ---------------------------------------------------------------------------------------------------------------
# Duplicate active slots (the debug value check)


def test_debug_slot_check_refuses_a_slot_two_rows_share():
    _raises(lambda: V.debug_check_slots(torch.tensor([0, 3, 3], dtype=I32), 8), "slot_indices", "distinct active")


def test_debug_slot_check_ignores_inactive_duplicates():
    V.debug_check_slots(torch.tensor([-1, -1, 8, 8, 2], dtype=I32), 8)


def test_debug_slot_check_refuses_a_checkpoint_slot_two_spec_rows_share():
    idx = torch.tensor([[0, 1, 2], [3, 4, 1]], dtype=I32)
    _raises(lambda: V.debug_check_slots(idx, 8, argument="ssm_state_indices"), "ssm_state_indices", "slots [1]")


def test_debug_slot_check_refuses_a_slot_one_spec_row_names_twice():
    _raises(lambda: V.debug_check_slots(torch.tensor([[5, 6, 5]], dtype=I32), 8), "slot_indices", "slots [5]")


def test_debug_slot_check_refuses_three_dimensional_indices():
    _raises(lambda: V.debug_check_slots(torch.zeros(2, 2, 2, dtype=I32), 8), "slot_indices", "1-D [B] or 2-D")
