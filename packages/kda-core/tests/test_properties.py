"""Property-based tests (hypothesis, bounded example counts: see conftest's ``kda-ci`` profile).

Shapes, strides and slot-index patterns are drawn at random; each property compares against an independent
statement of the rule (brute-force alignment, per-sequence dense runs, untouched rows bitwise).
"""

from __future__ import annotations

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kda_core import validation as V  # noqa: E402
from kda_core.call_args import RecurrentArgs  # noqa: E402
from kda_core.contracts import T1_HEAD_COUNTS  # noqa: E402
from kda_core.oracle import recurrent_kda_ref  # noqa: E402

F32 = dict(dtype=torch.float32, out_dtype=None)
DTYPES = [torch.bfloat16, torch.float32, torch.uint8, torch.float64]


def _brute_alignment(t):
    values = [t.data_ptr()] + [s * t.element_size() for n, s in zip(t.shape, t.stride()) if n > 1 and s != 1]
    return max(a for a in (1, 2, 4, 8, 16) if all(v % a == 0 for v in values))


@st.composite
def strided_views(draw, dims=None):
    """A random as_strided view (non-overlapping, in bounds) of a fresh buffer: sizes, padded strides, offset."""
    ndim = draw(st.integers(1, 4)) if dims is None else dims
    sizes = [draw(st.integers(1, 5)) for _ in range(ndim)]
    strides = [0] * ndim
    acc = 1
    for i in reversed(range(ndim)):
        strides[i] = acc
        acc = acc * sizes[i] + draw(st.integers(0, 9))
    offset = draw(st.integers(0, 17))
    dtype = draw(st.sampled_from(DTYPES))
    buf = torch.zeros(offset + acc + 1, dtype=dtype)
    return buf.as_strided(sizes, strides, offset)


@given(strided_views())
def test_tensor_alignment_matches_brute_force(view):
    assert V.tensor_alignment(view) == _brute_alignment(view)
    assert V.is_aligned(view) == (_brute_alignment(view) == 16)


@st.composite
def t1_calls(draw):
    """A legal T=1 call whose activations are strided views (free batch/head strides, shifted pointers)."""
    B = draw(st.integers(1, 6))
    H = draw(st.sampled_from(T1_HEAD_COUNTS[:3]))
    D = 128

    def act():
        head_pad = draw(st.sampled_from([0, 0, 1, 8, 64]))
        row_pad = draw(st.sampled_from([0, 0, 3, 8]))
        shift = draw(st.sampled_from([0, 0, 1, 2, 4, 8]))
        head = D + head_pad
        row = H * head + row_pad
        buf = torch.zeros(shift + B * row + 1, dtype=torch.bfloat16)
        return buf.as_strided((B, 1, H, D), (row, row, head, 1), shift)

    state_dtype = draw(st.sampled_from([torch.bfloat16, torch.float32]))
    N = draw(st.integers(1, 9))
    row_pad = draw(st.sampled_from([0, 8, 64]))
    pool_shift = draw(st.sampled_from([0, 0, 4, 8]))
    row = H * D * D + row_pad
    pool = torch.zeros(pool_shift + N * row, dtype=state_dtype).as_strided((N, H, D, D), (row, D * D, D, 1),
                                                                          pool_shift)
    return dict(q=act(), k=act(), v=act(), g=act(), beta=torch.zeros(B, 1, H, dtype=torch.bfloat16),
                state_pool=pool, slot_indices=torch.zeros(B, dtype=torch.int32), A_log=torch.zeros(H),
                dt_bias=torch.zeros(H * D), lower_bound=-5.0, output=act() if draw(st.booleans()) else None,
                device_kind="any")


@given(t1_calls())
def test_legal_t1_calls_are_accepted_and_alignment_is_the_minimum(call_args):
    call = V.validate_decode_t1(**call_args)
    vector_read = [call_args[n] for n in ("q", "k", "v", "g", "state_pool", "dt_bias", "output")
                   if call_args[n] is not None]
    want = min(_brute_alignment(t) for t in vector_read)
    assert call.alignment == want and call.aligned == (want == 16)
    assert call.B == call_args["q"].shape[0] and call.N == call_args["state_pool"].shape[0]


@given(B=st.integers(1, 4), T=st.integers(1, 5), H=st.integers(1, 3), group=st.integers(1, 3),
       K=st.sampled_from([64, 128]), mode=st.sampled_from(["dense", "pool", "spec"]), N=st.integers(1, 6))
def test_legal_recurrent_calls_are_described(B, T, H, group, K, mode, N):
    HV = H * group
    z = torch.zeros
    args = dict(q=z(B, T, H, K, dtype=torch.bfloat16), k=z(B, T, H, K, dtype=torch.bfloat16),
                v=z(B, T, HV, K, dtype=torch.bfloat16), g=z(B, T, HV, K), beta=z(B, T, HV))
    if mode == "pool":
        args.update(initial_state=z(N, HV, K, K), ssm_state_indices=z(B, dtype=torch.int32))
    elif mode == "spec":
        args.update(initial_state=z(N, HV, K, K, dtype=torch.bfloat16), ssm_state_indices=z(B, T, dtype=torch.int32),
                    num_accepted_tokens=z(B, dtype=torch.int32))
    call = V.validate_recurrent(RecurrentArgs(**args))
    assert (call.mode, call.B, call.T, call.H, call.HV, call.K) == (mode, B, T, H, HV, K)
    assert call.N == (None if mode == "dense" else N)
    assert not call.t1_eligible  # CPU tensors always run the oracle


# ---------------------------------------------------------------------------------------------------------------
# Oracle properties over index patterns


def _inputs(B, T, H, K, seed):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen).to(torch.bfloat16)  # noqa: E731
    return dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, H, K), g=r(B, T, H, K), beta=r(B, T, H),
                A_log=torch.rand(H, generator=gen) - 0.5, dt_bias=torch.randn(H * K, generator=gen) * 0.3,
                use_gate_in_kernel=True, lower_bound=-5.0, beta_is_logit=True)


def _pool(N, H, K, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(N, H, K, K, generator=gen) * 0.5).to(dtype)


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@st.composite
def slot_patterns(draw, B, N):
    """B slots: distinct active slots in [0, N), the rest inactive (negative or >= N)."""
    n_active = draw(st.integers(0, min(B, N)))
    active = draw(st.permutations(range(N)))[:n_active]
    inactive = [draw(st.sampled_from([-1, -2, -1000, N, N + 1, 2**31 - 1])) for _ in range(B - n_active)]
    order = draw(st.permutations(range(B)))
    slots = (list(active) + inactive)
    return [slots[i] for i in order]


@given(data=st.data(), B=st.integers(1, 5), T=st.integers(1, 3), N=st.integers(1, 6),
       pool_dtype=st.sampled_from([torch.bfloat16, torch.float32]))
def test_pool_1d_any_slot_pattern(data, B, T, N, pool_dtype):
    H, K = 1, 16
    slots = data.draw(slot_patterns(B, N))
    args = _inputs(B, T, H, K, seed=B * 100 + T * 10 + N)
    pool = _pool(N, H, K, seed=N, dtype=pool_dtype)
    before = pool.clone()
    idx = torch.tensor(slots, dtype=torch.int32)
    o, _ = recurrent_kda_ref(**args, initial_state=pool, ssm_state_indices=idx, **F32)
    for b, s in enumerate(slots):
        if 0 <= s < N:
            row = {k: (v[[b]] if isinstance(v, torch.Tensor) and v.dim() >= 3 else v) for k, v in args.items()}
            o_b, S_b = recurrent_kda_ref(**row, initial_state=before[[s]].float(), output_final_state=True, **F32)
            _close(o[[b]], o_b)
            torch.testing.assert_close(pool[s].float(), S_b[0].to(pool_dtype).float(), rtol=8e-3, atol=1e-5)
        else:
            assert torch.count_nonzero(o[b]) == 0
    untouched = [s for s in range(N) if s not in slots]
    assert torch.equal(pool[untouched], before[untouched])


@given(data=st.data(), B=st.integers(1, 3), T=st.integers(1, 4))
def test_spec_decode_any_index_pattern_matches_a_token_by_token_reference(data, B, T):
    H, K = 1, 16
    N = B * T + 1
    flat = data.draw(st.permutations(range(N)))[: B * T]
    cells = [s if data.draw(st.integers(0, 3)) else data.draw(st.sampled_from([-1, N])) for s in flat]
    idx = torch.tensor(cells, dtype=torch.int32).reshape(B, T)
    accepted = torch.tensor([data.draw(st.integers(0, T + 1)) for _ in range(B)], dtype=torch.int32)
    args = _inputs(B, T, H, K, seed=7 * B + T)
    pool = _pool(N, H, K, seed=3, dtype=torch.float32)
    before = pool.clone()
    o, _ = recurrent_kda_ref(**args, initial_state=pool, ssm_state_indices=idx, num_accepted_tokens=accepted, **F32)

    want_pool = before.clone()
    for b in range(B):
        read = int(idx[b, min(max(int(accepted[b]) - 1, 0), T - 1)])
        if not 0 <= read < N:
            assert torch.count_nonzero(o[b]) == 0
            continue
        S = before[[read]]
        for t in range(T):
            slot = int(idx[b, t])
            if not 0 <= slot < N:
                assert torch.count_nonzero(o[b, t]) == 0  # skipped: zero output, state unchanged
                continue
            tok = {k: (v[[b]][:, [t]] if isinstance(v, torch.Tensor) and v.dim() >= 3 else v)
                   for k, v in args.items()}
            o_t, S = recurrent_kda_ref(**tok, initial_state=S, output_final_state=True, **F32)
            _close(o[b, t], o_t[0, 0])
            want_pool[slot] = S[0]
    _close(pool, want_pool)


@given(lens=st.lists(st.integers(0, 3), min_size=1, max_size=5))
def test_varlen_any_lengths_match_each_sequence_alone(lens):
    H, K = 1, 16
    total = sum(lens)
    args = _inputs(1, max(total, 1), H, K, seed=len(lens) + total)
    if total == 0:
        args = {k: (v[:, :0] if isinstance(v, torch.Tensor) and v.dim() >= 3 else v) for k, v in args.items()}
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    S0 = _pool(len(lens), H, K, seed=5, dtype=torch.float32)
    o, S = recurrent_kda_ref(**args, initial_state=S0, output_final_state=True, cu_seqlens=cu, **F32)
    for n, length in enumerate(lens):
        start = int(cu[n])
        seq = {k: (v[:, start:start + length] if isinstance(v, torch.Tensor) and v.dim() >= 3 else v)
               for k, v in args.items()}
        if length == 0:
            assert torch.equal(S[n], S0[n])
            continue
        o_n, S_n = recurrent_kda_ref(**seq, initial_state=S0[[n]], output_final_state=True, **F32)
        _close(o[:, start:start + length], o_n)
        _close(S[n], S_n[0])
