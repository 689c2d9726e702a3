"""The multi-token fused decode kernel (kda_cute.fused_spec) against kda-core's ``packed_fused_kda_decode_ref``.

Inputs follow FlashInfer's tests of its fused op (docs/serving.md §5): x the first 3·H·128 columns of a
[Ntok, 3·H·128 + 17] bf16 buffer, weight 0.1·randn [3, 4, H·128], the conv cache and the state in pages of one
slot stride each (conv [slots, C, T + 2] with strides (page, 1, C)), raw_beta a view of [1, Ntok, H + 1],
output_gate an as_strided view with row stride H·128 + 7, checkpoint slots from 1 (slot 0 is the reserved null
slot). Tolerances are FlashInfer's: output rtol 3e-2 / atol 2e-2, the conv cache bitwise, the state rtol 3e-2 /
atol 2e-3. Every case compares all slots of both caches with the reference; the null-row test checks bitwise that
the slots no live row writes are unchanged, and the fuzz that no byte around or between the cache slots changed.

The variants compiled here are kept few, since the file's time is mostly compiles: 14 of this kernel (pool dtype x
gate at T = 4, the 1-, 2-, 8- and 16-token buckets, OUT_OF_RANGE for both pool dtypes, the unaligned int64 form,
two other configs, int64 device data under OUT_OF_RANGE; the fuzz seeds reuse them) and the T = 1 kernel's one.
"""

from __future__ import annotations

import pytest
import torch

from kda_core.contracts import NullSlotPolicy

D = 128
OUT_TOL = dict(rtol=3e-2, atol=2e-2)
STATE_TOL = dict(rtol=3e-2, atol=2e-3)
NP, OOR = NullSlotPolicy.NONPOSITIVE, NullSlotPolicy.OUT_OF_RANGE
DEVICE = "cuda"


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _inputs(H, lengths, T, *, nat=None, state_dtype=torch.float32, seed=0, n_slots=None, slots=None, width=None,
            state_pad=0):
    """One call of ``len(lengths)`` rows owning ``lengths[n]`` consecutive tokens each. ``slots`` [rows, T] (default:
    distinct slots from 1, shuffled), ``nat`` [rows] (default: heterogeneous in [1, T])."""
    dev = torch.device(DEVICE)
    gen = torch.Generator(device=dev).manual_seed(seed)
    rows = len(lengths)
    n_tok = sum(lengths)
    HK = H * D
    C = 3 * HK
    n_slots = rows * T + 2 if n_slots is None else n_slots
    width = T + 2 if width is None else width

    def randn(*shape, dtype=torch.float32, scale=1.0):
        return (scale * torch.randn(shape, device=dev, generator=gen)).to(dtype)

    conv_page = C * width + 24  # elements: a page of its own per slot, as an engine's hybrid cache
    conv = torch.empty(n_slots * conv_page, dtype=torch.bfloat16, device=dev).as_strided(
        (n_slots, C, width), (conv_page, 1, C))
    conv.copy_(randn(n_slots, C, width, dtype=torch.bfloat16, scale=0.5))
    state_page = H * D * D + state_pad
    state = torch.empty(n_slots * state_page, dtype=state_dtype, device=dev).as_strided(
        (n_slots, H, D, D), (state_page, D * D, D, 1))
    state.copy_(randn(n_slots, H, D, D, dtype=state_dtype, scale=0.05))
    if slots is None:
        perm = torch.randperm(n_slots - 1, generator=gen, device=dev)[: rows * T] + 1
        slots = perm.view(rows, T).to(torch.int32)
    if nat is None:
        nat = [1 + (n * 7 + 3) % T for n in range(rows)]
    qsl = [0]
    for n in lengths:
        qsl.append(qsl[-1] + n)
    return dict(
        x=randn(n_tok, C + 17, dtype=torch.bfloat16)[:, :C],
        weight=randn(3, 4, HK, scale=0.3),
        conv_state=conv,
        raw_gate=randn(1, n_tok, H, D, dtype=torch.bfloat16),
        raw_beta=randn(1, n_tok, H + 1, dtype=torch.bfloat16)[:, :, :H],
        A_log=randn(H, scale=0.5),
        dt_bias=randn(HK, scale=0.1),
        state_indices=torch.as_tensor(slots, dtype=torch.int32, device=dev),
        state=state,
        output_gate=randn(n_tok, HK + 7, dtype=torch.bfloat16).as_strided((n_tok, H, D), (HK + 7, D, 1)),
        norm_weight=randn(D),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        num_accepted_tokens=torch.tensor(nat, dtype=torch.int32, device=dev),
    )


def _clone(t):
    c = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    c.copy_(t)
    return c


def _reference(inputs, **kwargs):
    """(output, conv cache, state) of the reference on copies of both caches."""
    from kda_core.oracle_fused import packed_fused_kda_decode_ref

    ref_kwargs = {k: v for k, v in kwargs.items() if k not in ("config", "output")}
    ref_conv, ref_state = _clone(inputs["conv_state"]), _clone(inputs["state"])
    out = packed_fused_kda_decode_ref(**{**inputs, "conv_state": ref_conv, "state": ref_state}, **ref_kwargs)
    return out, ref_conv, ref_state


def _run_both(inputs, **kwargs):
    from kda_cute.fused_spec import packed_fused_kda_decode

    expected = _reference(inputs, **kwargs)
    actual = packed_fused_kda_decode(**inputs, **kwargs)
    _sync()
    return (actual, inputs["conv_state"], inputs["state"]), expected


def _assert_matches(got, want, outputs=True):
    if outputs:
        assert got[0].shape == want[0].shape and got[0].dtype == torch.bfloat16
        torch.testing.assert_close(got[0], want[0], **OUT_TOL)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    torch.testing.assert_close(got[2], want[2], **STATE_TOL)


RAGGED = [1, 2, 4, 3, 4, 0, 4, 1]  # windows of 1, 2 and 4 tokens, an empty row


@pytest.mark.gpu
@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["lower_bound", "softplus"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("H", [12, 32])
def test_ragged_windows_match_reference(H, state_dtype, lower_bound):
    """Ragged rows of 1, 2 and 4 tokens (and an empty one) at T = 4 with heterogeneous accepted counts (every read
    column 0..3 occurs): output, conv cache (bitwise) and every checkpoint against the reference."""
    inputs = _inputs(H, RAGGED, 4, state_dtype=state_dtype, seed=H)
    assert sorted(set(inputs["num_accepted_tokens"].tolist())) == [1, 2, 3, 4]
    _assert_matches(*_run_both(inputs, lower_bound=lower_bound))


@pytest.mark.gpu
@pytest.mark.parametrize("T, lengths", [(1, [1, 1, 0, 1]), (2, [2, 1, 2, 2, 0]), (8, [8, 3, 5, 8]),
                                        (16, [16, 9, 1])], ids=["t1", "t2", "t8", "t16"])
def test_every_token_bucket_matches_reference(T, lengths):
    """T = 1 and 2 (their own buckets), 8, and 16 (the largest bucket), full and partial windows, fp32 pool."""
    _assert_matches(*_run_both(_inputs(12, lengths, T, seed=T)))


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype, config", [(torch.bfloat16, dict(rows_per_pass=2)),
                                                 (torch.float32, dict(rows_per_pass=1, min_ctas=6))],
                         ids=["bf16-rpp2", "fp32-rpp1-min6"])
def test_other_configs_match_reference(state_dtype, config):
    """The other pass sizes and a resident-CTA floor, at the target shape of the layer's spec step (T = 4, 64 rows
    of 4 tokens, H = 12)."""
    from kda_cute.fused_spec import FusedSpecConfig

    inputs = _inputs(12, [4] * 64, 4, state_dtype=state_dtype, seed=5)
    _assert_matches(*_run_both(inputs, config=FusedSpecConfig(**config)))


@pytest.mark.gpu
def test_target_shape_default_config():
    """T = 4, B = 64, H = 12, both pool dtypes share the default schedule: the shape the speed target is for."""
    for sd in (torch.bfloat16, torch.float32):
        _assert_matches(*_run_both(_inputs(12, [4] * 64, 4, state_dtype=sd, seed=6)))


@pytest.mark.gpu
@pytest.mark.parametrize("policy", [NP, OOR], ids=[p.value for p in (NP, OOR)])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_null_rows_and_skipped_tokens(policy, state_dtype):
    """Rows whose conv slot is 0 / -1 / N, whose read column names a null slot, whose nat is 0, negative or > T
    (null under NONPOSITIVE; OUT_OF_RANGE clamps the column), a live row with a null checkpoint slot mid-window (that
    token skipped: zero output, the state does not absorb it) and a row of more tokens than T (the rest get zero
    output). Every slot no live row writes is bitwise unchanged, both caches."""
    T, H = 4, 12
    N = 40
    lengths = [3, 2, 4, 4, 2, 3, 4, 6, 2]
    slots = [[0, 1, 2, 3], [-1, 4, 5, 6], [N, 7, 8, 9], [10, 11, 12, 13], [14, 15, 16, 17], [18, 19, 20, 21],
             [22, 23, -1, 24], [25, 26, 27, 28], [29, N + 5, 30, 31]]
    nat = [1, 1, 1, 0, -7, 9, 1, 2, 2]
    inputs = _inputs(H, lengths, T, nat=nat, state_dtype=state_dtype, n_slots=N, slots=slots, seed=11)
    before = _clone(inputs["conv_state"]), _clone(inputs["state"])
    got, want = _run_both(inputs, null_policy=policy)
    _assert_matches(got, want)
    out = got[0][0]
    qsl = inputs["query_start_loc"].tolist()

    def zero(n, t):
        return not torch.any(out[qsl[n] + t])

    for n in (1, 2, 8):  # conv slot null (both policies), read slot N + 5 at column 1 (nat 2)
        assert all(zero(n, t) for t in range(lengths[n])), n
    assert all(zero(0, t) for t in range(3)) == (policy is NP)  # slot 0
    assert all(zero(3, t) for t in range(4)) == (policy is NP)  # nat 0
    assert all(zero(4, t) for t in range(2)) == (policy is NP)  # nat -7
    assert all(zero(5, t) for t in range(3)) == (policy is NP)  # nat 9 > T
    assert zero(6, 2) and not zero(6, 3)  # checkpoint slot -1 skipped, the next token runs
    assert zero(7, 4) and zero(7, 5) and not zero(7, 3)  # tokens past T
    written = set()
    for n, row in enumerate(slots):
        if torch.all(out[qsl[n]: qsl[n] + min(lengths[n], T)] == 0):
            continue
        written |= {s for s in row if 0 <= s < N}
    for s in range(N):
        if s not in written:
            assert torch.equal(got[1][s], before[0][s]) and torch.equal(got[2][s], before[1][s]), s


@pytest.mark.gpu
def test_strided_unaligned_and_int64_inputs():
    """An fp32 state slot stride that is no 16-byte multiple and raw_gate 2 bytes off (the unaligned variant), int64
    state_indices through a column stride of 2, int64 query_start_loc and num_accepted_tokens read through a stride,
    a conv cache wider than T + 2, a conv bias, no dt_bias, a strided 4-D output_gate and a caller's strided output
    (its padding is not written)."""
    H, T = 24, 4
    lengths = [4, 1, 3, 2]
    inputs = _inputs(H, lengths, T, state_pad=3, width=T + 5, seed=3)
    n_tok = sum(lengths)
    assert inputs["state"].stride(0) * 4 % 16
    storage = torch.randn(n_tok * H * D + 1, device=DEVICE).to(torch.bfloat16)
    inputs["raw_gate"] = storage[1:].view(1, n_tok, H, D)
    wide = torch.zeros(4, 2 * T, dtype=torch.int64, device=DEVICE)
    wide[:, ::2] = inputs["state_indices"].long()
    inputs["state_indices"] = wide[:, ::2]
    inputs["query_start_loc"] = torch.stack([inputs["query_start_loc"].long()] * 2, 1).reshape(-1)[::2]
    inputs["num_accepted_tokens"] = torch.tensor([4, 9, 1, 9, 3, 9, 2, 9], device=DEVICE)[::2]
    inputs["dt_bias"] = None
    inputs["output_gate"] = torch.randn(1, n_tok, H, D + 8, device=DEVICE).to(torch.bfloat16)[..., :D]
    out_storage = torch.zeros(1, n_tok, H, D + 8, dtype=torch.bfloat16, device=DEVICE)
    output = out_storage[..., :D]
    bias = 0.1 * torch.randn(3 * H * D, device=DEVICE)
    got, want = _run_both(inputs, bias=bias, output=output)
    assert got[0].data_ptr() == output.data_ptr()
    _assert_matches(got, want)
    assert torch.equal(out_storage[..., D:], torch.zeros_like(out_storage[..., D:]))


@pytest.mark.gpu
def test_out_of_range_offsets_and_counts_are_bounded():
    """Offsets below 0 and past Ntok clamp (64-bit: 2^40 clamps, not truncates), a decreasing pair leaves a row
    empty and the next row's start before the previous end; nat INT_MIN and 2^31 - 1 read the first / last column
    (all three index tensors int64).
    The clamped starts decrease, so outputs are unspecified: every state and the conv cache match the reference."""
    H, T = 12, 4
    inputs = _inputs(H, [2, 3, 2, 1], T, seed=9)
    inputs["state_indices"] = inputs["state_indices"].long()
    inputs["query_start_loc"] = torch.tensor([-5, 2, 1, 6, 2**40], dtype=torch.int64, device=DEVICE)
    inputs["num_accepted_tokens"] = torch.tensor([-(2**31), 2**31 - 1, 2, 3], dtype=torch.int64, device=DEVICE)
    _assert_matches(*_run_both(inputs, null_policy=OOR), outputs=False)


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager():
    """Capture once; change the activations, the slots, the accepted counts and the offsets in place: the replay
    computes the new call, bitwise what an eager call gives on the same caches (and the reference's answer)."""
    from kda_cute.fused_spec import packed_fused_kda_decode

    H, T = 12, 4
    lengths = [4, 2, 3, 1]
    inputs = _inputs(H, lengths, T, seed=21)
    output = torch.empty(1, sum(lengths), H, D, dtype=torch.bfloat16, device=DEVICE)
    packed_fused_kda_decode(**inputs, output=output)  # compile and load before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        packed_fused_kda_decode(**inputs, output=output)
    fresh = _inputs(H, lengths, T, seed=22)
    for name in ("x", "raw_gate", "raw_beta", "output_gate"):
        inputs[name].copy_(fresh[name])
    inputs["state_indices"].copy_(fresh["state_indices"])
    inputs["num_accepted_tokens"].copy_(torch.tensor([2, 4, 1, 3], dtype=torch.int32))
    inputs["query_start_loc"].copy_(torch.tensor([0, 3, 5, 9, 10], dtype=torch.int32))
    eager_conv, eager_state = _clone(inputs["conv_state"]), _clone(inputs["state"])
    want = _reference(inputs)
    eager = packed_fused_kda_decode(**{**inputs, "conv_state": eager_conv, "state": eager_state})
    output.fill_(1.0)
    graph.replay()
    _sync()
    assert torch.equal(output, eager)
    assert torch.equal(inputs["conv_state"], eager_conv) and torch.equal(inputs["state"], eager_state)
    _assert_matches((output, inputs["conv_state"], inputs["state"]), want)


@pytest.mark.gpu
def test_empty_calls():
    """No token: returns at once; no row: every output zero; neither cache touched."""
    from kda_cute.fused_spec import packed_fused_kda_decode

    inputs = _inputs(12, [], 4, n_slots=3)
    assert packed_fused_kda_decode(**inputs).shape == (1, 0, 12, D)
    inputs = _inputs(12, [3], 4, n_slots=6)
    inputs.update(state_indices=inputs["state_indices"][:0], query_start_loc=inputs["query_start_loc"][:1],
                  num_accepted_tokens=inputs["num_accepted_tokens"][:0])
    before = _clone(inputs["conv_state"]), _clone(inputs["state"])
    out = packed_fused_kda_decode(**inputs)
    _sync()
    assert out.shape == (1, 3, 12, D) and not torch.any(out)
    assert torch.equal(inputs["conv_state"], before[0]) and torch.equal(inputs["state"], before[1])


@pytest.mark.gpu
def test_t1_state_indices_is_the_t1_kernel():
    """FlashInfer's pre-resolved T = 1 rows: the call is the T = 1 fused kernel on them."""
    from kda_cute.fused_decode import fused_kda_decode
    from kda_cute.fused_spec import packed_fused_kda_decode

    inputs = _inputs(12, [1, 1, 1], 1, seed=4)
    t1 = inputs["state_indices"][:, 0].contiguous()
    conv, state = _clone(inputs["conv_state"]), _clone(inputs["state"])
    got = packed_fused_kda_decode(**inputs, t1_state_indices=t1)
    rest = {k: v for k, v in inputs.items() if k not in ("query_start_loc", "num_accepted_tokens", "state_indices")}
    want = fused_kda_decode(**{**rest, "conv_state": conv, "state": state}, state_indices=t1)
    _sync()
    assert torch.equal(got, want) and torch.equal(inputs["conv_state"], conv) and torch.equal(inputs["state"], state)


@pytest.mark.gpu
def test_debug_validate_names_duplicate_live_slots(monkeypatch):
    """With KDA_DEBUG_VALIDATE=1 two checkpoints naming one live slot are refused before launch (both caches
    untouched); the null slot 0 may repeat under NONPOSITIVE."""
    from kda_core.errors import KDAError
    from kda_cute.fused_spec import packed_fused_kda_decode

    inputs = _inputs(12, [2, 2], 2, n_slots=8)
    monkeypatch.setenv("KDA_DEBUG_VALIDATE", "1")
    inputs["state_indices"].copy_(torch.tensor([[1, 2], [3, 2]], dtype=torch.int32))
    before = _clone(inputs["conv_state"]), _clone(inputs["state"])
    with pytest.raises(KDAError, match="^state_indices: expected distinct active slots"):
        packed_fused_kda_decode(**inputs)
    _sync()
    assert torch.equal(inputs["conv_state"], before[0]) and torch.equal(inputs["state"], before[1])
    inputs["state_indices"].copy_(torch.tensor([[1, 0], [3, 0]], dtype=torch.int32))
    _assert_matches(*_run_both(inputs))


# ---- device-data fuzz (``-m "gpu and fuzz"``: ``nox -s sanitize`` runs it) -----------------------------------------

INT_MIN, INT_MAX = -(2**31), 2**31 - 1
CANARY = 0x7F  # every byte of a margin (bf16 0x7F7F, fp32 0x7F7F7F7F: ~3.4e38, a value no kernel writes)
MARGIN = 4096  # bytes of canary before and after every written tensor


def _fuzz_cases() -> int:
    import os

    text = os.environ.get("KDA_FUZZ_CASES", "6")
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"KDA_FUZZ_CASES: expected an int >= 1, got {text!r}")
    return int(text)


def _guarded(shape, strides, dtype, span):
    """(storage bytes, view): a tensor of ``span`` elements with MARGIN canary bytes on both sides; padding between
    its strided rows keeps the canary too."""
    elem = torch.empty((), dtype=dtype).element_size()
    raw = torch.full((2 * MARGIN + span * elem,), CANARY, dtype=torch.uint8, device=DEVICE)
    view = raw[MARGIN: MARGIN + span * elem].view(dtype).as_strided(shape, strides)
    return raw, view


def _canary_intact(raw, view):
    """Every byte of ``raw`` outside ``view``'s elements is still the canary."""
    flat = raw[MARGIN: raw.numel() - MARGIN].view(view.dtype)
    inside = torch.zeros(flat.shape, dtype=torch.bool, device=raw.device)
    inside.as_strided(view.shape, view.stride()).fill_(True)
    outside = torch.ones(raw.shape, dtype=torch.bool, device=raw.device)
    outside[MARGIN: raw.numel() - MARGIN] = ~inside.repeat_interleave(flat.element_size())
    return bool(torch.all(raw[outside] == CANARY))


FUZZ_VARIANTS = ((NP, False, torch.bfloat16), (OOR, True, torch.float32), (NP, False, torch.float32),
                 (OOR, False, torch.float32), (NP, False, torch.bfloat16), (OOR, True, torch.float32))


@pytest.mark.gpu
@pytest.mark.fuzz
@pytest.mark.parametrize("seed", range(_fuzz_cases()))
def test_fuzz_malformed_device_data(seed):
    """Random rows mixing valid and malformed device data: offsets below 0, past Ntok, decreasing and 2^40 (int64);
    accepted counts INT_MIN, 0, -1, T + 1, INT_MAX; slots -1, N, INT_MIN, INT_MAX (0 too under NONPOSITIVE) and
    checkpoint slots null mid-row. After each call the CUDA context is alive, no canary byte around the caches, the
    output or between the cache slots changed, both caches match the reference and, where the clamped offsets do not
    decrease, so does the output."""
    import random

    from kda_cute.fused_spec import packed_fused_kda_decode

    rnd = random.Random(seed)
    # (policy, int64 device data, pool dtype) by seed: the variants the other tests compile, so fuzzing adds none
    policy, wide, state_dtype = FUZZ_VARIANTS[seed % len(FUZZ_VARIANTS)]
    H, T = 12, rnd.choice((3, 4))
    rows = rnd.randint(1, 9)
    N = rows * T + 5
    HK = H * D
    C = 3 * HK
    W = T + 2
    lengths = [rnd.choice((0, 1, 2, T, T, T + 2)) for _ in range(rows)]
    n_tok = max(sum(lengths), 1)
    base = _inputs(H, [n_tok], 1, state_dtype=state_dtype, seed=seed, n_slots=N)  # activations of n_tok tokens

    conv_page = C * W + 24
    conv_raw, conv = _guarded((N, C, W), (conv_page, 1, C), torch.bfloat16, N * conv_page)
    conv.copy_(torch.randn(N, C, W, device=DEVICE).mul_(0.5).to(torch.bfloat16))
    state_page = H * D * D + 8
    state_raw, state = _guarded((N, H, D, D), (state_page, D * D, D, 1), state_dtype, N * state_page)
    state.copy_(torch.randn(N, H, D, D, device=DEVICE).mul_(0.05).to(state_dtype))
    out_raw, output = _guarded((1, n_tok, H, D), (n_tok * HK, HK, D, 1), torch.bfloat16, n_tok * HK)

    live = [s + 1 for s in rnd.sample(range(N - 1), rows * T)]  # distinct, never slot 0
    nulls = [-1, N, N + 7, INT_MIN, INT_MAX] + ([0] if policy is NP else []) + ([2**40, -(2**40)] if wide else [])
    slots = [[live[n * T + t] if rnd.random() > 0.15 else rnd.choice(nulls) for t in range(T)] for n in range(rows)]
    qsl = [0]
    for n in lengths:
        qsl.append(qsl[-1] + n)
    for n in range(rows + 1):
        if rnd.random() < 0.2:
            qsl[n] = rnd.choice([-3, n_tok + 5, qsl[max(n - 1, 0)] - 1] + ([2**40, -(2**40)] if wide else []))
    nat = [rnd.choice((INT_MIN, -1, 0, T + 1, INT_MAX) if rnd.random() < 0.25 else range(1, T + 1))
           for _ in range(rows)]
    idt = torch.int64 if wide else torch.int32
    inputs = {**base, "conv_state": conv, "state": state,
              "state_indices": torch.tensor(slots, dtype=idt, device=DEVICE),
              "query_start_loc": torch.tensor(qsl, dtype=idt, device=DEVICE),
              "num_accepted_tokens": torch.tensor(nat, dtype=idt, device=DEVICE)}
    want = _reference(inputs, null_policy=policy)
    packed_fused_kda_decode(**inputs, output=output, null_policy=policy)
    _sync()
    starts = [min(max(q, 0), n_tok) for q in qsl[:-1]]
    monotone = all(a <= b for a, b in zip(starts, starts[1:]))
    _assert_matches((output, conv, state), want, outputs=monotone)
    for raw, view in ((conv_raw, conv), (state_raw, state), (out_raw, output)):
        assert _canary_intact(raw, view)
