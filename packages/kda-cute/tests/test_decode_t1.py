"""T=1 decode kernel against kda-core's oracle (GPU), one behaviour per test."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

TILES = (8, 16, 32, 64, 128)


def _decode(case, *, output=None, **over):
    from kda_cute import kda_decode_t1

    kw = case.kwargs()
    kw.update(over)
    return kda_decode_t1(case.q, case.k, case.v, case.g, case.beta, case.pool, case.slots, output=output, **kw)


def _assert_matches_oracle(case, out, pool_after, ref_out, ref_pool):
    """State within one rounding of the pool dtype; output within bf16 rounding of the oracle's."""
    if pool_after.dtype == torch.bfloat16:
        s_tol = dict(atol=2e-3, rtol=1.6e-2)
    else:
        s_tol = dict(atol=2e-5, rtol=2e-4)
    torch.testing.assert_close(pool_after.float(), ref_pool.float(), **s_tol)
    scale = ref_out.float().abs().max().item() + 1e-6
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2 * scale, rtol=2e-2)


def _config(*args, **kwargs):
    from kda_cute.decode_t1 import DecodeT1Config

    return DecodeT1Config(*args, **kwargs)


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("gate", ["lower_bound", "softplus", "precomputed"])
@pytest.mark.parametrize("tile_v", TILES)
def test_every_tile_gate_and_pool_dtype_matches_oracle(state_dtype, gate, tile_v, make_case):
    case = make_case(5, 12, state_dtype=state_dtype, gate=gate, seed=tile_v)
    ref_out, ref_pool = case.oracle()
    out = _decode(case, config=_config(tile_v))
    _assert_matches_oracle(case, out, case.pool, ref_out, ref_pool)


@pytest.mark.parametrize("tile_v", [8, 64])
def test_the_tile_knob_reaches_the_kernel(tile_v, monkeypatch, make_case):
    monkeypatch.setenv("KDA_DECODE_TILE_V", str(tile_v))
    case = make_case(5, 12, seed=tile_v + 1)
    ref_out, ref_pool = case.oracle()
    out = _decode(case)
    _assert_matches_oracle(case, out, case.pool, ref_out, ref_pool)


# The tuning variants (ci/gpu_t1_tune.sh runs these first): rows in flight per thread and the state's cache
# operators, on a batch with inactive rows (-1 and one past the pool) among the active ones.
BF16, FP32 = torch.bfloat16, torch.float32
TUNING_VARIANTS = [  # (pool dtype, tile_v, rows_in_flight, cache_hint)
    (BF16, 16, 0, "global"), (BF16, 32, 0, "global"), (BF16, 64, 16, "stream"), (BF16, 128, 16, "stream"),
    (BF16, 128, 4, "global"), (BF16, 128, 0, "global"), (FP32, 64, 8, "global"), (FP32, 128, 16, "global"),
    (FP32, 128, 16, "stream"),
]


@pytest.mark.parametrize("state_dtype, tile_v, rows_in_flight, cache_hint", TUNING_VARIANTS,
                         ids=[f"{str(d)[6:]}-tv{t}-rif{r}-{c}" for d, t, r, c in TUNING_VARIANTS])
def test_tuning_variant_matches_oracle_and_leaves_inactive_rows_untouched(state_dtype, tile_v, rows_in_flight,
                                                                          cache_hint, make_case):
    case = make_case(7, 12, state_dtype=state_dtype, n_slots=9, slots=[4, -1, 0, 9, 8, 2, 6], seed=tile_v)
    before = case.pool.clone()
    ref_out, ref_pool = case.oracle()
    out = _decode(case, output=torch.full((7, 1, 12, 128), 3.0, dtype=torch.bfloat16, device="cuda"),
                  config=_config(tile_v, rows_in_flight=rows_in_flight, cache_hint=cache_hint))
    assert torch.count_nonzero(out[torch.tensor([1, 3], device="cuda")]) == 0
    untouched = [s for s in range(9) if s not in (4, 0, 8, 2, 6)]
    assert torch.equal(case.pool[untouched], before[untouched])
    _assert_matches_oracle(case, out, case.pool, ref_out, ref_pool)


@pytest.mark.parametrize("B", [256, 512])
def test_fp32_large_batch_policy_variant_matches_oracle(B, make_case):
    from kda_cute import decode_t1

    assert decode_t1.select_config(B, 12, torch.float32, True).bulk_ring == 8  # the swept winner's row
    case = make_case(B, 12, state_dtype=torch.float32, seed=B)
    ref_out, ref_pool = case.oracle()
    out = _decode(case)
    _assert_matches_oracle(case, out, case.pool, ref_out, ref_pool)


@pytest.mark.parametrize("B", [1, 2, 3, 7, 16, 33, 64, 100, 255, 512, 1000, 1024])
def test_batch_sizes_match_oracle_with_policy_tile(B, make_case):
    case = make_case(B, 12, seed=B)
    ref_out, ref_pool = case.oracle()
    out = _decode(case)
    _assert_matches_oracle(case, out, case.pool, ref_out, ref_pool)


@pytest.mark.parametrize("H", [8, 16, 24, 32, 48, 64, 96])
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_head_counts_match_oracle(H, state_dtype, make_case):
    case = make_case(3, H, state_dtype=state_dtype, gate="softplus", seed=H)
    ref_out, ref_pool = case.oracle()
    out = _decode(case)
    _assert_matches_oracle(case, out, case.pool, ref_out, ref_pool)


def test_fp32_precomputed_gate_and_fp32_beta_match_oracle(make_case):
    case = make_case(9, 12, gate="precomputed", g_dtype=torch.float32, seed=3)
    case.beta = case.beta.float()
    ref_out, ref_pool = case.oracle()
    out = _decode(case)
    _assert_matches_oracle(case, out, case.pool, ref_out, ref_pool)


def test_inactive_slots_give_zero_output_and_leave_pool_bitwise_untouched(make_case):
    case = make_case(6, 12, n_slots=10, slots=[3, -1, 10, 7, -2147483648, 2147483647], seed=1)
    before = case.pool.clone()
    ref_out, ref_pool = case.oracle()
    out = _decode(case, output=torch.full((6, 1, 12, 128), 7.0, dtype=torch.bfloat16, device="cuda"))
    inactive = torch.tensor([1, 2, 4, 5], device="cuda")
    assert torch.count_nonzero(out[inactive]) == 0
    untouched = [s for s in range(10) if s not in (3, 7)]
    assert torch.equal(case.pool[untouched], before[untouched])
    _assert_matches_oracle(case, out, case.pool, ref_out, ref_pool)


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_all_inactive_batch_is_a_bitwise_noop_on_the_pool(state_dtype, make_case):
    case = make_case(4, 12, state_dtype=state_dtype, n_slots=5, slots=[-1, 5, 99, -7])
    before = case.pool.clone()
    out = _decode(case)
    assert torch.equal(case.pool, before)
    assert torch.count_nonzero(out) == 0


def _decode_packed(case, *, output=None, **over):
    from kda_cute import kda_decode_t1_packed

    kw = case.kwargs()
    kw.update(over)
    return kda_decode_t1_packed(case.mixed_qkv, case.raw_gate, case.raw_beta, case.pool, case.slots,
                                num_heads=case.raw_beta.shape[1], output=output, **kw)


# (B, row_pad, row_shift, aligned): GEMM rows padded to a 16-byte multiple, padded by an odd count (every row after
# the first misaligned), shifted by one element (every pointer misaligned); B=1 ignores the row stride.
PACKED_LAYOUTS = [(37, 24, 0, True), (64, 0, 0, True), (37, 3, 0, False), (5, 0, 1, False), (1, 3, 0, True),
                  (1, 5, 1, False)]


@pytest.mark.parametrize("gate", ["lower_bound", "softplus", "precomputed"])
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("B, row_pad, row_shift, aligned", PACKED_LAYOUTS,
                         ids=[f"B{b}-pad{p}-shift{s}" for b, p, s, _ in PACKED_LAYOUTS])
def test_packed_and_unpacked_entries_are_bitwise_identical(B, row_pad, row_shift, aligned, state_dtype, gate,
                                                           make_case):
    """The packed entry's host wrapper (views built in the compiled host code) against the unpacked entry on torch
    views of the same rows: same bits out, same bits in the pool, in both alignment classes."""
    from kda_core.validation import validate_packed_decode_t1

    g_dtype = torch.float32 if gate == "precomputed" else torch.bfloat16  # the fp32 precomputed gate rows too
    case = make_case(B, 12, state_dtype=state_dtype, gate=gate, g_dtype=g_dtype, row_pad=row_pad,
                     row_shift=row_shift, seed=5 + B)
    call = validate_packed_decode_t1(case.mixed_qkv, case.raw_gate, case.raw_beta, case.pool, case.slots,
                                     num_heads=12, **case.kwargs())
    assert call.aligned is aligned  # both variants are exercised
    ref_out, ref_pool = case.oracle()
    pool_a = case.pool.clone()
    out_unpacked = _decode(case)
    pool_unpacked = case.pool.clone()
    case.pool.copy_(pool_a)
    out_packed = _decode_packed(case)
    assert torch.equal(out_packed, out_unpacked)
    assert torch.equal(case.pool, pool_unpacked)
    _assert_matches_oracle(case, out_packed, case.pool, ref_out, ref_pool)


@pytest.mark.parametrize("gate", ["lower_bound", "precomputed"])
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("B, row_pad, row_shift, aligned", PACKED_LAYOUTS,
                         ids=[f"B{b}-pad{p}-shift{s}" for b, p, s, _ in PACKED_LAYOUTS])
def test_token_form_is_bitwise_the_packed_entry(B, row_pad, row_shift, aligned, state_dtype, gate, make_case):
    """kda_decode_t1_packed_tokens on vLLM's [1, B, ...] tensors (the gate and beta as token views of the same rows,
    the output a slice of a wider buffer) against the packed entry: same bits out and in the pool, nothing written
    outside the output slice, in both alignment classes."""
    from kda_cute.decode_t1 import kda_decode_t1_packed_tokens

    H = 12
    g_dtype = torch.float32 if gate == "precomputed" else torch.bfloat16
    case = make_case(B, H, state_dtype=state_dtype, gate=gate, g_dtype=g_dtype, row_pad=row_pad,
                     row_shift=row_shift, seed=7 + B)
    ref_out, ref_pool = case.oracle()
    pool_a = case.pool.clone()
    out_packed = _decode_packed(case)
    pool_packed = case.pool.clone()
    case.pool.copy_(pool_a)
    buf = torch.full((1, B, H + 1, 128), 7.0, dtype=torch.bfloat16, device="cuda")
    out = buf[:, :, :H]  # token stride (H + 1) * 128
    got = kda_decode_t1_packed_tokens(case.mixed_qkv, case.raw_gate.unsqueeze(0).unflatten(2, (H, 128)),
                                      case.raw_beta.unsqueeze(0), case.pool, case.slots, output=out, **case.kwargs())
    assert got is out
    assert torch.equal(out[0], out_packed[:, 0]) and torch.equal(case.pool, pool_packed)
    assert bool(buf[:, :, H].eq(7.0).all())
    _assert_matches_oracle(case, out.transpose(0, 1), case.pool, ref_out, ref_pool)


def test_packed_entry_with_inactive_slots_and_a_given_output(make_case):
    case = make_case(6, 12, n_slots=10, slots=[3, -1, 10, 7, -2147483648, 2147483647], row_pad=8, seed=2)
    before = case.pool.clone()
    ref_out, ref_pool = case.oracle()
    out = torch.full((6, 1, 12, 128), 7.0, dtype=torch.bfloat16, device="cuda")
    assert _decode_packed(case, output=out) is out
    assert torch.count_nonzero(out[torch.tensor([1, 2, 4, 5], device="cuda")]) == 0
    untouched = [s for s in range(10) if s not in (3, 7)]
    assert torch.equal(case.pool[untouched], before[untouched])
    _assert_matches_oracle(case, out, case.pool, ref_out, ref_pool)


def _shifted(t, shift=1):
    """Same values in a buffer offset by ``shift`` elements: the data pointer loses 16-byte alignment."""
    buf = torch.empty(t.numel() + shift, dtype=t.dtype, device=t.device)
    view = buf[shift:].view(t.shape)
    view.copy_(t.contiguous())
    return view


@pytest.mark.parametrize("arg", ["q", "k", "v", "g", "beta", "dt_bias", "output", "pool"])
def test_misaligned_argument_takes_unaligned_variant_and_matches_oracle(arg, make_case):
    case = make_case(5, 12, seed=11)
    output = None
    if arg == "output":
        output = _shifted(torch.zeros(5, 1, 12, 128, dtype=torch.bfloat16, device="cuda"))
    elif arg == "pool":
        case.pool = _shifted(case.pool)
    elif arg == "dt_bias":
        case.dt_bias = _shifted(case.dt_bias)
    else:
        setattr(case, arg, _shifted(getattr(case, arg)))
    ref_out, ref_pool = case.oracle()
    out = _decode(case, output=output)
    _assert_matches_oracle(case, out, case.pool, ref_out, ref_pool)


def test_odd_row_strides_and_padded_pool_match_oracle(make_case):
    # 3*12*128 + 3 elements per packed row: every row after the first is misaligned.
    case = make_case(7, 12, row_pad=3, pool_row_pad=8, seed=13)
    assert case.pool.stride(0) == 12 * 128 * 128 + 8
    ref_out, ref_pool = case.oracle()
    out = _decode(case)
    _assert_matches_oracle(case, out, case.pool, ref_out, ref_pool)


def _captured(decode, case, out):
    """A CUDA graph of one decode call of ``case`` into ``out`` (the module is loaded by an eager call first)."""
    decode(case, output=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode(case, output=out)
    return graph


def _load_step(case, fresh):
    """Copy a fresh step's GEMM rows and slot indices into the captured case's buffers."""
    case.mixed_qkv.copy_(fresh.mixed_qkv)
    case.raw_gate.copy_(fresh.raw_gate)
    case.raw_beta.copy_(fresh.raw_beta)
    case.slots.copy_(fresh.slots)


# (entry, packed-row padding, seed of the captured case, first seed of the replayed ones)
@pytest.mark.parametrize("entry, row_pad, seed, fresh_seed", [("unpacked", 0, 17, 100), ("packed", 8, 37, 200)])
def test_cuda_graph_replay_follows_changed_inputs_and_indices(entry, row_pad, seed, fresh_seed, make_case):
    case = make_case(16, 12, n_slots=40, row_pad=row_pad, seed=seed)
    out = torch.empty(16, 1, 12, 128, dtype=torch.bfloat16, device="cuda")
    graph = _captured(_decode_packed if entry == "packed" else _decode, case, out)
    for step in range(3):
        _load_step(case, make_case(16, 12, n_slots=40, row_pad=row_pad, seed=fresh_seed + step))
        ref_out, ref_pool = case.oracle()
        graph.replay()
        torch.cuda.synchronize()
        _assert_matches_oracle(case, out, case.pool, ref_out, ref_pool)


def test_runs_on_a_non_default_stream(make_case):
    case = make_case(8, 12, seed=19)
    ref_out, ref_pool = case.oracle()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        # A long kernel first on the same stream: a launch on the default stream would race it.
        torch.cuda._sleep(2_000_000)
        out = _decode(case)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    _assert_matches_oracle(case, out, case.pool, ref_out, ref_pool)


def test_512_step_fp32_pool_drift_against_fp64_oracle_is_bounded(make_case):
    """Drift diagnostic: the fp32 pool after 512 kernel steps vs an fp64 running state."""
    B, H, steps = 4, 12, 512
    case = make_case(B, H, state_dtype=torch.float32, n_slots=B, slots=list(range(B)), seed=23)
    ref64 = case.pool.double().clone()
    worst = 0.0
    for step in range(steps):
        fresh = make_case(B, H, state_dtype=torch.float32, n_slots=B, slots=list(range(B)), seed=1000 + step)
        case.mixed_qkv.copy_(fresh.mixed_qkv)
        case.raw_gate.copy_(fresh.raw_gate)
        case.raw_beta.copy_(fresh.raw_beta)
        _, ref64 = case.oracle(pool=ref64, dtype=torch.float64)
        _decode(case)
        if step % 64 == 63 or step == steps - 1:
            rel = ((case.pool.double() - ref64).norm() / ref64.norm()).item()
            worst = max(worst, rel)
    print(f"512-step fp32 drift: worst relative Frobenius error {worst:.3e}")
    assert worst < 1e-4


def test_agrees_with_fla_in_place_kernel(make_case):
    fla = pytest.importorskip("fla.ops.kda.fused_recurrent")
    for gate in ("lower_bound", "softplus"):
        case = make_case(32, 12, n_slots=64, seed=29, gate=gate)
        q, k, v, g, beta = (x.contiguous() for x in (case.q, case.k, case.v, case.g, case.beta))
        fla_pool = case.pool.clone()
        fla_out, _ = fla.fused_recurrent_kda_fwd(
            q, k, v, g, beta, A_log=case.A_log, dt_bias=case.dt_bias, initial_state=fla_pool,
            inplace_final_state=True, state_v_first=True, ssm_state_indices=case.slots,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
            lower_bound=case.lower_bound,
        )
        out = _decode(case)
        _assert_matches_oracle(case, out, case.pool, fla_out, fla_pool)


def test_given_output_is_written_and_returned_without_allocation(make_case):
    case = make_case(3, 12, seed=31)
    out = torch.zeros(3, 1, 12, 128, dtype=torch.bfloat16, device="cuda")
    assert _decode(case, output=out) is out
    assert torch.count_nonzero(out) > 0


# ---------------------------------------------------------------------------------------------------------------
# Bulk ring (DecodeT1Config.bulk_ring): the aligned tile-128 state streamed through a shared-memory
# ring by 1-D bulk copies. Same math and rounding as the register path, so the two agree bit for bit; inactive rows
# must issue no bulk copy (their pool rows and every row not addressed stay bitwise untouched).
BULK_RINGS = (2, 4, 8, 16)
INT_MIN = -2147483648


def _bulk_slots(B, n_slots, seed):
    """B distinct pool rows out of n_slots, with -1, n_slots and INT_MIN at rows 1, B-2, B-1 when B >= 5."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(n_slots, generator=gen)[:B].tolist()
    inactive = []
    if B >= 5:
        inactive = [1, B - 2, B - 1]
        for row, bad in zip(inactive, (-1, n_slots, INT_MIN)):
            slots[row] = bad
    return slots, inactive


def _register_path_then_bulk_ring(case, ring, decode=None, tile_v=128):
    """(output, pool after) of the register path and of the bulk ring of one tile, each from the caller's pool (left
    unchanged); both on the batch-major grid (the slot-major one has its own tests below)."""
    from kda_cute import decode_t1

    decode = decode or _decode
    B, H = case.slots.shape[0], case.q.shape[2]
    start = case.pool.clone()
    results = []
    for depth in (0, ring):
        config = _config(tile_v, bulk_ring=depth)
        cfg = decode_t1.effective_config(config, B, case.pool.dtype, True, case.pool.shape[0])
        assert cfg.tile_v == tile_v and not cfg.slot_major
        assert cfg.bulk_ring == decode_t1.bulk_ring_for(tile_v, case.pool.element_size(), True, depth)
        case.pool.copy_(start)
        out = decode(case, output=torch.full((B, 1, H, 128), 7.0, dtype=torch.bfloat16, device="cuda"), config=config)
        results.append((out, case.pool.clone()))
    case.pool.copy_(start)  # the caller's pool is left as it was
    return results


def _assert_same_step(case, baseline, candidate, slots, inactive, before, ref_out, ref_pool):
    """``candidate`` (output, pool) is bitwise ``baseline``, gives zero output on the ``inactive`` rows, leaves the pool
    rows no active slot names bitwise ``before``, and matches the oracle's (``ref_out``, ``ref_pool``)."""
    (out_base, pool_base), (out, pool) = baseline, candidate
    assert torch.equal(out, out_base)
    assert torch.equal(pool, pool_base)
    if inactive:
        assert torch.count_nonzero(out[torch.tensor(inactive, device="cuda")]) == 0
    n_slots = pool.shape[0]
    untouched = sorted(set(range(n_slots)) - {s for s in slots if 0 <= s < n_slots})
    assert torch.equal(pool[untouched], before[untouched])
    _assert_matches_oracle(case, out, pool, ref_out, ref_pool)


@pytest.mark.parametrize("B", [1, 5, 37, 300])
@pytest.mark.parametrize("ring", BULK_RINGS)
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_bulk_ring_is_bitwise_the_register_path_and_leaves_unaddressed_rows_untouched(B, ring, state_dtype,
                                                                                      make_case):
    n_slots = B + 7
    slots, inactive = _bulk_slots(B, n_slots, seed=B + ring)
    case = make_case(B, 12, state_dtype=state_dtype, n_slots=n_slots, slots=slots, seed=B * 16 + ring)
    before = case.pool.clone()
    ref_out, ref_pool = case.oracle()
    regs, bulk = _register_path_then_bulk_ring(case, ring)
    _assert_same_step(case, regs, bulk, slots, inactive, before, ref_out, ref_pool)


@pytest.mark.parametrize("tile_v, ring", [(64, 4), (64, 8), (32, 2), (32, 4)])
@pytest.mark.parametrize("B", [5, 300])
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_bulk_ring_smaller_tiles_are_bitwise_the_register_path(tile_v, ring, B, state_dtype, make_case):
    """Tiles 64 and 32: several CTAs per (row, head), each streaming its own contiguous rows through its ring."""
    n_slots = B + 7
    slots, inactive = _bulk_slots(B, n_slots, seed=B + ring + tile_v)
    case = make_case(B, 12, state_dtype=state_dtype, n_slots=n_slots, slots=slots, seed=B * 16 + ring + tile_v)
    before = case.pool.clone()
    ref_out, ref_pool = case.oracle()
    assert inactive
    regs, bulk = _register_path_then_bulk_ring(case, ring, tile_v=tile_v)
    _assert_same_step(case, regs, bulk, slots, inactive, before, ref_out, ref_pool)


@pytest.mark.parametrize("gate", ["lower_bound", "softplus", "precomputed"])
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_bulk_ring_every_gate_on_a_padded_pool_is_bitwise_the_register_path(gate, state_dtype, make_case):
    g_dtype = torch.float32 if gate == "precomputed" else torch.bfloat16
    case = make_case(9, 12, state_dtype=state_dtype, gate=gate, g_dtype=g_dtype, pool_row_pad=8, seed=41)
    assert case.pool.stride(0) == 12 * 128 * 128 + 8  # chunk addresses off a padded slot stride
    ref_out, ref_pool = case.oracle()
    (out_regs, pool_regs), (out_bulk, pool_bulk) = _register_path_then_bulk_ring(case, 4)
    assert torch.equal(out_bulk, out_regs)
    assert torch.equal(pool_bulk, pool_regs)
    _assert_matches_oracle(case, out_bulk, pool_bulk, ref_out, ref_pool)


@pytest.mark.parametrize("grid", ["batch_major", "slot_major"])
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_bulk_ring_packed_entry_is_bitwise_the_unpacked_entry(grid, state_dtype, make_case):
    """On either grid the packed entry's ring step is bitwise the unpacked entry's, and both are bitwise the
    reference path's (the register path for the batch-major grid, the batch-major grid for the slot-major one)."""
    pair = _register_path_then_bulk_ring if grid == "batch_major" else _batch_major_then_slot_major
    case = make_case(37, 12, state_dtype=state_dtype, n_slots=40, row_pad=24, seed=43)
    (out_ref, pool_ref), (out_u, pool_u) = pair(case, 8)
    (_, _), (out_p, pool_p) = pair(case, 8, decode=_decode_packed)
    assert torch.equal(out_p, out_u) and torch.equal(out_p, out_ref)
    assert torch.equal(pool_p, pool_u) and torch.equal(pool_p, pool_ref)


@pytest.mark.parametrize("grid", ["batch_major", "slot_major"])
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_bulk_ring_all_inactive_batch_is_a_bitwise_noop_on_the_pool(grid, state_dtype, make_case):
    case = make_case(4, 12, state_dtype=state_dtype, n_slots=5, slots=[-1, 5, INT_MIN, 2147483647])
    before = case.pool.clone()
    out = _decode(case, output=torch.full((4, 1, 12, 128), 7.0, dtype=torch.bfloat16, device="cuda"),
                  config=_config(128, bulk_ring=8, slot_major=grid == "slot_major"))
    assert torch.equal(case.pool, before)
    assert torch.count_nonzero(out) == 0


# (grid, B, pool rows): the slot-major grid's rows change order and activity between replays, its grid does not
GRAPH_GRIDS = [("batch_major", 16, 40), ("slot_major", 40, 44)]


@pytest.mark.parametrize("grid, B, n_slots", GRAPH_GRIDS, ids=[g for g, _, _ in GRAPH_GRIDS])
def test_bulk_ring_cuda_graph_replay_follows_changed_inputs_and_indices(grid, B, n_slots, make_case):
    import functools

    config = _config(128, bulk_ring=4, slot_major=grid == "slot_major")
    case = make_case(B, 12, n_slots=n_slots, seed=47)
    out = torch.empty(B, 1, 12, 128, dtype=torch.bfloat16, device="cuda")
    graph = _captured(functools.partial(_decode_packed, config=config), case, out)
    for step in range(3):
        slots, inactive = _bulk_slots(B, n_slots, seed=300 + step)
        _load_step(case, make_case(B, 12, n_slots=n_slots, slots=slots, seed=300 + step))
        out.fill_(7.0)
        before = case.pool.clone()
        ref_out, ref_pool = case.oracle()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.count_nonzero(out[torch.tensor(inactive, device="cuda")]) == 0
        untouched = sorted(set(range(n_slots)) - {s for s in slots if 0 <= s < n_slots})
        assert torch.equal(case.pool[untouched], before[untouched])
        _assert_matches_oracle(case, out, case.pool, ref_out, ref_pool)


# ---------------------------------------------------------------------------------------------------------------
# Slot-major grid (DecodeT1Config.slot_major): CTA z of a head streams pool row z for the first
# batch row naming it, CTAs past the pool rows give zero output to the rows whose slot is outside [0, N). Same per-row
# math as the batch-major grid, so the two agree bit for bit on distinct slots.
def _batch_major_then_slot_major(case, ring, decode=None):
    """(output, pool after) of the batch-major and the slot-major grid (tile 128, bulk ring ``ring`` or the register
    path at 0), each from the caller's pool (left unchanged). Outputs start as 7.0 so unwritten rows show."""
    from kda_cute import decode_t1

    decode = decode or _decode
    B, H, N = case.slots.shape[0], case.q.shape[2], case.pool.shape[0]
    start = case.pool.clone()
    results = []
    for slot_major in (False, True):
        config = _config(128, bulk_ring=ring, slot_major=slot_major)
        assert decode_t1.effective_config(config, B, case.pool.dtype, True, N).slot_major is slot_major
        case.pool.copy_(start)
        out = decode(case, output=torch.full((B, 1, H, 128), 7.0, dtype=torch.bfloat16, device="cuda"), config=config)
        results.append((out, case.pool.clone()))
    case.pool.copy_(start)
    return results


# (B, pool rows): one pass of the slot scan and two (B > 1024), pools larger and smaller than the batch
SLOT_MAJOR_SHAPES = [(1, 3), (5, 12), (37, 44), (300, 300), (40, 16), (1100, 1107)]


@pytest.mark.parametrize("B, n_slots", SLOT_MAJOR_SHAPES, ids=[f"B{b}-N{n}" for b, n in SLOT_MAJOR_SHAPES])
@pytest.mark.parametrize("ring", [8, 0], ids=["ring8", "regs"])
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_slot_major_is_bitwise_the_batch_major_grid_and_leaves_unaddressed_rows_untouched(B, n_slots, ring,
                                                                                         state_dtype, make_case):
    if B > n_slots:  # more rows than pool rows: the first n_slots rows take distinct slots, the rest -1 / N / INT_MIN
        gen = torch.Generator().manual_seed(B)
        slots = torch.randperm(n_slots, generator=gen).tolist() + [(-1, n_slots, INT_MIN)[i % 3]
                                                                  for i in range(B - n_slots)]
        inactive = list(range(n_slots, B))
    else:
        slots, inactive = _bulk_slots(B, n_slots, seed=B + ring)
    case = make_case(B, 12, state_dtype=state_dtype, n_slots=n_slots, slots=slots, seed=B * 16 + ring)
    before = case.pool.clone()
    ref_out, ref_pool = case.oracle()
    batch_major, slot_major = _batch_major_then_slot_major(case, ring)
    _assert_same_step(case, batch_major, slot_major, slots, inactive, before, ref_out, ref_pool)


@pytest.mark.parametrize("B, ring", [(6, 0), (1030, 8)])
def test_slot_major_duplicate_slots_update_the_first_row_and_zero_the_others(B, ring, make_case):
    """A caller error, with a defined answer on this grid: the first batch row naming a slot streams it, later rows
    naming the same slot get zero output (as if inactive); every other row is unaffected."""
    n_slots = B + 4
    gen = torch.Generator().manual_seed(B)
    slots = torch.randperm(n_slots, generator=gen)[:B].tolist()
    dupes = {2: slots[0], 4: slots[0], B - 1: slots[1]}  # rows 2 and 4 repeat row 0's slot, the last row row 1's
    for row, slot in dupes.items():
        slots[row] = slot
    case = make_case(B, 12, n_slots=n_slots, slots=slots, seed=53)
    expected_slots = case.slots.clone()
    expected_slots[list(dupes)] = -1
    reference = make_case(B, 12, n_slots=n_slots, slots=expected_slots.tolist(), seed=53)
    ref_out, ref_pool = reference.oracle(pool=case.pool)
    out = _decode(case, output=torch.full((B, 1, 12, 128), 7.0, dtype=torch.bfloat16, device="cuda"),
                  config=_config(128, bulk_ring=ring, slot_major=True))
    assert torch.count_nonzero(out[list(dupes)]) == 0
    _assert_matches_oracle(case, out, case.pool, ref_out, ref_pool)


def test_schedule_takes_slot_major_where_the_pool_is_at_most_the_policy_factor_of_the_batch(make_case):
    """The policy end to end: a dense pool (N = B) runs slot-major, a pool of 2B rows the batch-major grid; both
    match the oracle."""
    from kda_cute import decode_t1

    for n_slots, expected in ((512, True), (1024, False)):
        assert decode_t1.select_config(512, 12, torch.bfloat16, True, n_slots).slot_major is expected
        case = make_case(512, 12, n_slots=n_slots, seed=n_slots)
        ref_out, ref_pool = case.oracle()
        out = _decode(case)
        _assert_matches_oracle(case, out, case.pool, ref_out, ref_pool)


# ---------------------------------------------------------------------------------------------------------------
# Null-slot policies (docs/design.md §4), a compile-time constant of every variant. The oracle applies OUT_OF_RANGE, so
# the reference maps every slot that is null under the policy to -1 on the host; the NONPOSITIVE kernel must then be
# bitwise the OUT_OF_RANGE kernel on those mapped slots, and leave pool row 0 bitwise untouched.
INT_MAX = 2147483647
NULL_POLICY_GRIDS = {  # name: (tile_v, bulk_ring, slot_major) of the config, every grid and staging of the kernel
    "tile16": (16, 0, False), "tile64": (64, 0, False), "ring": (128, 8, False), "slot_major_ring": (128, 8, True),
    "slot_major_regs": (128, 0, True),
}


def _policy_slots(B, N, policy, seed):
    """B slots over a pool of N rows: distinct live rows, pool row 0 named once (and, under NONPOSITIVE, by three
    more rows: vLLM's padding rows), and -1, N, INT_MIN, INT_MAX. Returns (slots, the slots the oracle gets)."""
    from kda_core.contracts import NullSlotPolicy

    gen = torch.Generator().manual_seed(seed)
    slots = (torch.randperm(N - 1, generator=gen)[:B] + 1).tolist()
    slots[3] = 0
    for row, bad in zip((1, 10, 20, B - 1), (-1, N, INT_MIN, INT_MAX)):
        slots[row] = bad
    if policy is NullSlotPolicy.NONPOSITIVE:
        for row in (6, 12, 25):
            slots[row] = 0
    low = 1 if policy is NullSlotPolicy.NONPOSITIVE else 0
    return slots, [s if low <= s < N else -1 for s in slots]


@pytest.mark.parametrize("entry", ["unpacked", "packed"])
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("grid", list(NULL_POLICY_GRIDS))
@pytest.mark.parametrize("policy", ["out_of_range", "nonpositive"])
def test_null_policy_matches_the_oracle_on_host_mapped_slots(policy, grid, state_dtype, entry, make_case):
    import dataclasses

    from kda_core.contracts import NullSlotPolicy
    from kda_cute import decode_t1

    policy = NullSlotPolicy(policy)
    B, N, H = 37, 44, 12
    tile_v, ring, slot_major = NULL_POLICY_GRIDS[grid]
    config = decode_t1.DecodeT1Config(tile_v, bulk_ring=ring, slot_major=slot_major)
    cfg = decode_t1.effective_config(config, B, state_dtype, True, N)
    assert (cfg.bulk_ring > 0, cfg.slot_major) == (ring > 0, slot_major)
    slots, mapped = _policy_slots(B, N, policy, seed=sum(map(ord, grid + policy.value)))
    case = make_case(B, H, state_dtype=state_dtype, n_slots=N, slots=slots, seed=61)
    reference = dataclasses.replace(case, slots=torch.tensor(mapped, dtype=torch.int32, device="cuda"))
    before = case.pool.clone()
    ref_out, ref_pool = reference.oracle()
    decode = _decode_packed if entry == "packed" else _decode

    def run(c, null_policy):
        c.pool.copy_(before)
        out = decode(c, output=torch.full((B, 1, H, 128), 7.0, dtype=torch.bfloat16, device="cuda"),
                     null_policy=null_policy, config=config)
        return out, c.pool.clone()

    mapped_out, mapped_pool = run(reference, NullSlotPolicy.OUT_OF_RANGE)
    out, pool = run(case, policy)
    assert torch.equal(out, mapped_out) and torch.equal(pool, mapped_pool)
    inactive = [b for b, s in enumerate(mapped) if s < 0]
    assert torch.count_nonzero(out[torch.tensor(inactive, device="cuda")]) == 0
    untouched = sorted(set(range(N)) - {s for s in mapped if s >= 0})
    assert (0 in untouched) is (policy is NullSlotPolicy.NONPOSITIVE)
    assert torch.equal(pool[untouched], before[untouched])
    _assert_matches_oracle(case, out, pool, ref_out, ref_pool)


@pytest.mark.parametrize("grid", ["tile16", "slot_major_ring"])
def test_nonpositive_all_null_batch_is_a_bitwise_noop_on_the_pool(grid, make_case):
    from kda_core.contracts import NullSlotPolicy
    from kda_cute import decode_t1

    tile_v, ring, slot_major = NULL_POLICY_GRIDS[grid]
    case = make_case(5, 12, n_slots=4, slots=[0, 0, -1, 4, 0])
    before = case.pool.clone()
    out = _decode(case, output=torch.full((5, 1, 12, 128), 7.0, dtype=torch.bfloat16, device="cuda"),
                  null_policy=NullSlotPolicy.NONPOSITIVE,
                  config=decode_t1.DecodeT1Config(tile_v, bulk_ring=ring, slot_major=slot_major))
    assert torch.equal(case.pool, before)
    assert torch.count_nonzero(out) == 0


# ---------------------------------------------------------------------------------------------------------------
# Layouts the engines use that kda-core's validators still reject (docs/design.md §4: never rejected, never read out
# of bounds): a pool slot stride of any element count, strided and int64 slot indices. The kernel takes them as they
# are; these tests launch it through _run / _run_packed with the description of the same call in a legal layout,
# fitted to the real one (the alignment class of an odd pool stride), as kda-core will once it accepts them.
def _described_run(case, entry, out, *, slots=None, aligned=None, others_aligned=None, **kw):
    """Launch ``case`` (its pool and ``slots`` as they are) on the description kda-core gives the same call with a
    compact pool and contiguous int32 slots (``aligned`` / ``others_aligned`` override its alignment class)."""
    import dataclasses

    from kda_core.validation import validate_decode_t1, validate_packed_decode_t1
    from kda_cute import decode_t1

    slots = case.slots if slots is None else slots
    legal = dict(state_pool=torch.empty(case.pool.shape, dtype=case.pool.dtype, device="cuda"),
                 slot_indices=torch.zeros(slots.shape, dtype=torch.int32, device="cuda"), output=out, **case.kwargs())
    if entry == "packed":
        call = validate_packed_decode_t1(case.mixed_qkv, case.raw_gate, case.raw_beta, num_heads=case.q.shape[2],
                                         **legal)
    else:
        call = validate_decode_t1(case.q, case.k, case.v, case.g, case.beta, **legal)
    call = dataclasses.replace(call, aligned=call.aligned if aligned is None else aligned,
                               others_aligned=call.others_aligned if others_aligned is None else others_aligned)
    if entry == "packed":
        return decode_t1._run_packed(call, case.mixed_qkv, case.raw_gate, case.raw_beta, case.pool, slots, case.A_log,
                                     case.dt_bias, True, out, **kw)
    return decode_t1._run(call, case.q, case.k, case.v, case.g, case.beta, case.pool, slots, case.A_log, case.dt_bias,
                          True, out, **kw)


@pytest.mark.parametrize("entry", ["unpacked", "packed"])
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("pad", [17, 1])
@pytest.mark.parametrize("activations", ["vectors", "elementwise"])
def test_a_pool_slot_stride_of_any_element_count_runs_the_unaligned_variant(activations, pad, state_dtype, entry,
                                                                             make_case):
    """The pool-realigning variant the entries take, with the other tensors in vectors (described as aligned) or
    element-wise (described as misaligned too)."""
    from kda_cute.decode_t1 import DecodeT1Config

    B, N, H = 9, 13, 12
    slots, inactive = _bulk_slots(B, N, seed=pad)
    case = make_case(B, H, state_dtype=state_dtype, n_slots=N, slots=slots, pool_row_pad=pad, seed=80 + pad)
    assert case.pool.stride(0) == H * 128 * 128 + pad
    storage = case.pool.as_strided((N, H * 128 * 128 + pad), (H * 128 * 128 + pad, 1))
    before = storage.clone()
    ref_out, ref_pool = case.oracle()
    out = torch.full((B, 1, H, 128), 7.0, dtype=torch.bfloat16, device="cuda")
    # The large-batch schedule asked for: the ring and the slot-major grid need 16-byte strides, so it runs the
    # register path of tile 128.
    _described_run(case, entry, out, aligned=False, others_aligned=activations == "vectors",
                   config=DecodeT1Config(128, bulk_ring=8, slot_major=True))
    assert torch.count_nonzero(out[torch.tensor(inactive, device="cuda")]) == 0
    assert torch.equal(storage[:, H * 128 * 128:], before[:, H * 128 * 128:])  # the padding between slots
    untouched = sorted(set(range(N)) - {s for s in slots if 0 <= s < N})
    assert torch.equal(storage[untouched], before[untouched])
    _assert_matches_oracle(case, out, case.pool, ref_out, ref_pool)


@pytest.mark.parametrize("entry", ["unpacked", "packed"])
@pytest.mark.parametrize("grid", ["tile16", "ring", "slot_major_ring"])
def test_strided_slot_indices_are_read_as_they_are(grid, entry, make_case):
    from kda_cute.decode_t1 import DecodeT1Config

    B, N, H = 37, 44, 12
    slots, inactive = _bulk_slots(B, N, seed=90)
    case = make_case(B, H, n_slots=N, slots=slots, seed=91)
    buffer = torch.full((B, 8), 3, dtype=torch.int32, device="cuda")  # every other entry names a live slot
    buffer[:, 0] = case.slots
    strided = buffer[:, 0]
    assert strided.stride() == (8,)
    tile_v, ring, slot_major = NULL_POLICY_GRIDS[grid]
    before = case.pool.clone()
    ref_out, ref_pool = case.oracle()
    out = torch.full((B, 1, H, 128), 7.0, dtype=torch.bfloat16, device="cuda")
    _described_run(case, entry, out, slots=strided,
                   config=DecodeT1Config(tile_v, bulk_ring=ring, slot_major=slot_major))
    assert torch.count_nonzero(out[torch.tensor(inactive, device="cuda")]) == 0
    untouched = sorted(set(range(N)) - {s for s in slots if 0 <= s < N})
    assert torch.equal(case.pool[untouched], before[untouched])
    _assert_matches_oracle(case, out, case.pool, ref_out, ref_pool)


@pytest.mark.parametrize("entry", ["unpacked", "packed"])
@pytest.mark.parametrize("grid", ["tile16", "ring", "slot_major_ring", "slot_major_regs"])
@pytest.mark.parametrize("policy", ["out_of_range", "nonpositive"])
def test_int64_slot_indices_are_compared_in_64_bits(policy, grid, entry, make_case):
    """Values past the int32 range are null, never truncated onto a live slot (2^32 + s is not slot s); the result is
    bitwise that of the int32 indices with every null slot mapped to -1."""
    from kda_core.contracts import NullSlotPolicy
    from kda_cute.decode_t1 import DecodeT1Config

    policy = NullSlotPolicy(policy)
    B, N, H = 37, 44, 12
    slots, mapped = _policy_slots(B, N, policy, seed=95)
    wide = list(slots)
    for row, value in zip((2, 15, 22, 30, 33), (2**32 + 5, 2**32, -(2**40) + 7, 2**63 - 1, -(2**63))):
        wide[row], mapped[row] = value, -1
    case = make_case(B, H, n_slots=N, slots=mapped, seed=96)
    tile_v, ring, slot_major = NULL_POLICY_GRIDS[grid]
    config = DecodeT1Config(tile_v, bulk_ring=ring, slot_major=slot_major)
    before = case.pool.clone()
    ref_out, ref_pool = case.oracle()
    out32 = torch.full((B, 1, H, 128), 7.0, dtype=torch.bfloat16, device="cuda")
    _described_run(case, entry, out32, config=config)  # OUT_OF_RANGE on the mapped int32 slots
    pool32 = case.pool.clone()
    case.pool.copy_(before)
    out = torch.full((B, 1, H, 128), 7.0, dtype=torch.bfloat16, device="cuda")
    _described_run(case, entry, out, slots=torch.tensor(wide, dtype=torch.int64, device="cuda"), null_policy=policy,
                   config=config)
    assert torch.equal(out, out32) and torch.equal(case.pool, pool32)
    untouched = sorted(set(range(N)) - {s for s in mapped if s >= 0})
    assert torch.equal(case.pool[untouched], before[untouched])
    _assert_matches_oracle(case, out, case.pool, ref_out, ref_pool)


@pytest.mark.parametrize("entry", ["unpacked", "packed"])
@pytest.mark.parametrize("layout", ["transposed", "every_other"])
def test_strided_beta_and_gate_views_match_the_oracle(layout, entry, make_case):
    """Layouts kda-core already accepts: beta / raw_beta with any strides (a transposed buffer, every other head of a
    wider row), next to row-padded raw_gate and mixed_qkv rows (vLLM's raw_g [1, B, H, K] with a free token stride)."""
    from kda_core.oracle import unpack_packed

    B, H = 9, 12
    case = make_case(B, H, row_pad=24, seed=98)
    if layout == "transposed":
        raw_beta = case.raw_beta.t().contiguous().t()
        assert raw_beta.stride() == (1, B)
    else:
        buffer = torch.zeros(B, 2 * H + 1, dtype=case.raw_beta.dtype, device="cuda")
        buffer[:, 0 : 2 * H : 2] = case.raw_beta
        raw_beta = buffer[:, 0 : 2 * H : 2]
        assert raw_beta.stride() == (2 * H + 1, 2)
    case.raw_beta = raw_beta
    case.q, case.k, case.v, case.g, case.beta = unpack_packed(case.mixed_qkv, case.raw_gate, raw_beta, H)
    ref_out, ref_pool = case.oracle()
    out = _decode_packed(case) if entry == "packed" else _decode(case)
    _assert_matches_oracle(case, out, case.pool, ref_out, ref_pool)


# Wrapper-checked rules: after a good call has described its facts, kda-core's re-validation reads only what the
# compiled TVM-FFI wrapper cannot check and the wrapper checks the rest before launch. One broken argument of each
# kind the wrapper owns must still get the full validator's KDAError naming it, with nothing written.
def _unpacked_entry(case, out, **over):
    from kda_cute import kda_decode_t1

    args = dict(q=case.q, k=case.k, v=case.v, g=case.g, beta=case.beta, state_pool=case.pool,
                slot_indices=case.slots, **case.kwargs(), output=out)
    args.update(over)
    return kda_decode_t1(**args)


def _packed_entry(case, out, **over):
    from kda_cute import kda_decode_t1_packed

    args = dict(mixed_qkv=case.mixed_qkv, raw_gate=case.raw_gate, raw_beta=case.raw_beta, state_pool=case.pool,
                slot_indices=case.slots, num_heads=case.raw_beta.shape[1], **case.kwargs(), output=out)
    args.update(over)
    return kda_decode_t1_packed(**args)


WRAPPER_CHECKED = [  # (entry, argument, how to break it)
    ("unpacked", "q", lambda c: c.q[..., :64]),
    ("unpacked", "k", lambda c: c.k.float()),
    ("unpacked", "v", lambda c: c.v[:2]),
    ("unpacked", "beta", lambda c: c.beta[..., :4]),
    ("unpacked", "k", lambda c: c.k.cpu()),
    ("packed", "mixed_qkv", lambda c: c.mixed_qkv.float()),
    ("packed", "raw_beta", lambda c: c.raw_beta[:, :4]),
    ("packed", "raw_beta", lambda c: c.raw_beta[:2]),
    ("packed", "state_pool", lambda c: c.pool.transpose(2, 3)),
    ("packed", "slot_indices", lambda c: c.slots.float()),  # int32 and int64 are taken
    ("packed", "slot_indices", lambda c: c.slots[:2]),
    ("packed", "A_log", lambda c: None),
    ("packed", "A_log", lambda c: c.A_log.half()),
    ("packed", "A_log", lambda c: c.A_log[:4]),
    ("packed", "dt_bias", lambda c: c.dt_bias.half()),
    ("packed", "output", lambda c: torch.zeros(3, 1, 12, 128, device="cuda")),
    ("packed", "output", lambda c: torch.zeros(3, 1, 12, 128, dtype=torch.bfloat16, device="cuda")[..., :64]),
    ("packed", "output", lambda c: torch.zeros(3, 1, 8, 128, dtype=torch.bfloat16, device="cuda")),
]


@pytest.mark.parametrize("entry, argument, bad", WRAPPER_CHECKED,
                         ids=[f"{e}-{a}-{i}" for i, (e, a, _) in enumerate(WRAPPER_CHECKED)])
def test_wrapper_checked_argument_after_a_good_call_raises_kdaerror_and_writes_nothing(entry, argument, bad,
                                                                                        make_case):
    from kda_core.errors import KDAError

    call = _packed_entry if entry == "packed" else _unpacked_entry
    case = make_case(3, 12, n_slots=4, slots=[0, 2, 3])
    out = torch.empty(3, 1, 12, 128, dtype=torch.bfloat16, device="cuda")
    call(case, out)  # the good call: its facts are now described, so the next one takes the hot path
    torch.cuda.synchronize()
    pool_before, out_before = case.pool.clone(), out.clone()
    broken = bad(case)
    with pytest.raises(KDAError, match=rf"^{argument}: expected"):
        if argument == "output":
            call(case, broken)
        else:
            call(case, out, **{argument: broken})
    torch.cuda.synchronize()
    assert torch.equal(case.pool, pool_before) and torch.equal(out, out_before)


def _tokens_of(case):
    H = case.raw_beta.shape[1]
    return case.raw_gate.unsqueeze(0).unflatten(2, (H, 128)), case.raw_beta.unsqueeze(0)


TOKENS_WRAPPER_CHECKED = [
    ("raw_gate", lambda c, g, b, o: dict(raw_gate=g.transpose(2, 3).contiguous().transpose(2, 3))),
    ("raw_gate", lambda c, g, b, o: dict(raw_gate=g.half())),
    ("raw_beta", lambda c, g, b, o: dict(raw_beta=b.double())),
    ("slot_indices", lambda c, g, b, o: dict(slot_indices=c.slots[:2])),
    ("A_log", lambda c, g, b, o: dict(A_log=c.A_log.half())),
    ("state_pool", lambda c, g, b, o: dict(state_pool=c.pool.transpose(2, 3))),
    ("output", lambda c, g, b, o: dict(output=torch.zeros(o.shape, device="cuda"))),
    ("output", lambda c, g, b, o: dict(output=o[..., :64])),
]


@pytest.mark.parametrize("argument, bad", TOKENS_WRAPPER_CHECKED,
                         ids=[f"{a}-{i}" for i, (a, _) in enumerate(TOKENS_WRAPPER_CHECKED)])
def test_token_form_wrapper_checked_argument_after_a_good_call_raises_kdaerror_and_writes_nothing(argument, bad,
                                                                                                  make_case):
    from kda_core.errors import KDAError
    from kda_cute.decode_t1 import kda_decode_t1_packed_tokens

    case = make_case(3, 12, n_slots=4, slots=[0, 2, 3])
    gate, beta = _tokens_of(case)
    out = torch.empty(1, 3, 12, 128, dtype=torch.bfloat16, device="cuda")
    args = dict(raw_gate=gate, raw_beta=beta, state_pool=case.pool, slot_indices=case.slots, output=out)
    kda_decode_t1_packed_tokens(case.mixed_qkv, **args, **case.kwargs())  # described: the next call is hot
    torch.cuda.synchronize()
    pool_before, out_before = case.pool.clone(), out.clone()
    broken = {**args, **case.kwargs(), **bad(case, gate, beta, out)}
    with pytest.raises(KDAError, match=rf"^{argument}: expected"):
        kda_decode_t1_packed_tokens(case.mixed_qkv, **broken)
    torch.cuda.synchronize()
    assert torch.equal(case.pool, pool_before) and torch.equal(out, out_before)


# Launch geometry and absent dt_bias.


@pytest.mark.parametrize("entry", ["unpacked", "packed"])
def test_a_batch_past_grid_z_on_the_batch_major_grid_matches_oracle(entry, make_case):
    # B > 65535 rows on the batch-major grid (tile 64 is never slot-major) run as two launches; the active rows sit
    # on both sides of the split, every other row is inactive and must get a zero output.
    from kda_core.oracle import recurrent_kda_ref
    from kda_cute import decode_t1, kda_decode_t1_packed

    Z = decode_t1.GRID_Z_MAX
    B, H = Z + 6, 8
    config = decode_t1.DecodeT1Config(64)
    rows = [0, 1, Z - 2, Z - 1, Z, Z + 1, B - 1]
    slots = torch.full((B,), -1, dtype=torch.int32)
    slots[rows] = torch.arange(len(rows), dtype=torch.int32) * 3
    case = make_case(B, H, n_slots=3 * len(rows), slots=slots, seed=70)
    ref_pool = case.pool.clone()
    out = torch.full((B, 1, H, 128), 7.0, dtype=torch.bfloat16, device="cuda")
    if entry == "packed":
        kda_decode_t1_packed(case.mixed_qkv, case.raw_gate, case.raw_beta, case.pool, case.slots, num_heads=H,
                             output=out, config=config, **case.kwargs())
    else:
        _decode(case, output=out, config=config)
    idx = torch.tensor(rows, device="cuda")
    ref_out, ref_pool = recurrent_kda_ref(
        case.q[idx], case.k[idx], case.v[idx], case.g[idx], case.beta[idx], A_log=case.A_log, dt_bias=case.dt_bias,
        initial_state=ref_pool, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=case.lower_bound,
        beta_is_logit=True, ssm_state_indices=case.slots[idx].long())
    torch.cuda.synchronize()
    _assert_matches_oracle(case, out[idx], case.pool, ref_out, ref_pool)
    inactive = torch.ones(B, dtype=torch.bool, device="cuda")
    inactive[idx] = False
    assert torch.count_nonzero(out[inactive]) == 0


@pytest.mark.parametrize("entry", ["unpacked", "packed"])
@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
def test_an_absent_dt_bias_is_zeros(entry, gate, make_case):
    from kda_cute import kda_decode_t1_packed

    case = make_case(6, 12, gate=gate, seed=71)
    kw = {**case.kwargs(), "dt_bias": None}
    case.dt_bias = torch.zeros(12 * 128, device="cuda")
    ref_out, ref_pool = case.oracle()
    if entry == "packed":
        out = kda_decode_t1_packed(case.mixed_qkv, case.raw_gate, case.raw_beta, case.pool, case.slots,
                                   num_heads=12, **kw)
    else:
        out = _decode(case, **kw)
    _assert_matches_oracle(case, out, case.pool, ref_out, ref_pool)


# ---------------------------------------------------------------------------------------------------------------
# Varlen decode on the T=1 kernel (KDADecodeT1Varlen, decode_t1._run_varlen): tokens [1, T, H, 128] + cu_seqlens
# [S + 1], as FlashInfer and SGLang call decode. Offsets are device data, bounded in the kernel (bos = clamp(cu[n], 0,
# T), eos = clamp(cu[n + 1], bos, T), in 64 bits); a one-token sequence takes the T=1 path, any other length the
# token loop, exactly. kda-core does not describe this form yet: the tests launch it through _run_varlen with the
# description of the same tokens as a dense call, its B set to the sequence count.
def _varlen_call(case, n_seq, entry_slots):
    import dataclasses

    from kda_core.validation import validate_decode_t1

    T = case.q.shape[0]
    call = validate_decode_t1(case.q, case.k, case.v, case.g, case.beta, case.pool,
                              torch.zeros(T, dtype=torch.int32, device="cuda"), **case.kwargs())
    return dataclasses.replace(call, B=n_seq)


def _tokens(x):
    """[T, 1, ...] rows -> the varlen form's [1, T, ...] view of the same memory."""
    return x.transpose(0, 1)


def _run_varlen(case, slots, cu, *, output=None, **kw):
    from kda_cute import decode_t1

    call = _varlen_call(case, slots.shape[0], slots)
    return decode_t1._run_varlen(call, _tokens(case.q), _tokens(case.k), _tokens(case.v), _tokens(case.g),
                                 _tokens(case.beta), case.pool, slots, cu, case.A_log, case.dt_bias, True, output, **kw)


def _varlen_reference(case, bounds, mapped):
    """(output [1, T, H, 128], pool after) from kda-core's oracle, one sequence at a time on its clamped token range
    [bos, eos) at its slot (``mapped``: -1 where null), later sequences overwriting earlier ones' outputs, zeros on
    the tokens no sequence covers."""
    from kda_core.oracle import recurrent_kda_ref

    T, H = case.q.shape[0], case.q.shape[2]
    out = torch.zeros(1, T, H, 128, dtype=torch.bfloat16, device="cuda")
    pool = case.pool.clone()
    for (bos, eos), slot in zip(bounds, mapped):
        if eos <= bos:
            continue
        o, pool = recurrent_kda_ref(
            *(_tokens(x)[:, bos:eos] for x in (case.q, case.k, case.v, case.g, case.beta)), A_log=case.A_log,
            dt_bias=case.dt_bias, initial_state=pool, use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=case.use_gate_in_kernel, lower_bound=case.lower_bound, beta_is_logit=case.beta_is_logit,
            ssm_state_indices=torch.tensor([slot], device="cuda"))
        out[:, bos:eos] = o
    return out, pool


def _clamped(cu, T):
    bounds = []
    for n in range(len(cu) - 1):
        bos = min(max(cu[n], 0), T)
        bounds.append((bos, min(max(cu[n + 1], bos), T)))
    return bounds


VARLEN_GRIDS = {"tile16": (16, 0), "tile32": (32, 0), "tile64": (64, 0), "ring": (128, 8)}


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("grid", list(VARLEN_GRIDS))
def test_varlen_of_one_token_sequences_is_bitwise_the_dense_call(grid, state_dtype, make_case):
    from kda_cute.decode_t1 import DecodeT1Config

    S, N, H = 37, 44, 12
    slots, inactive = _bulk_slots(S, N, seed=110)
    case = make_case(S, H, state_dtype=state_dtype, n_slots=N, slots=slots, row_pad=8, seed=111)
    tile_v, ring = VARLEN_GRIDS[grid]
    config = DecodeT1Config(tile_v, bulk_ring=ring)
    before = case.pool.clone()
    dense = _decode(case, output=torch.full((S, 1, H, 128), 7.0, dtype=torch.bfloat16, device="cuda"), config=config)
    dense_pool = case.pool.clone()
    case.pool.copy_(before)
    cu = torch.arange(S + 1, dtype=torch.int32, device="cuda")
    out = _run_varlen(case, case.slots, cu, output=torch.full((1, S, H, 128), 7.0, dtype=torch.bfloat16,
                                                               device="cuda"), config=config)
    assert torch.equal(out[0], dense[:, 0]) and torch.equal(case.pool, dense_pool)
    assert torch.count_nonzero(out[0, inactive]) == 0


@pytest.mark.parametrize("gate, policy", [("lower_bound", "out_of_range"), ("lower_bound", "nonpositive"),
                                          ("softplus", "out_of_range"), ("precomputed", "nonpositive")])
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("grid", list(VARLEN_GRIDS))
def test_varlen_sequences_of_any_length_match_the_oracle(grid, state_dtype, gate, policy, make_case):
    """Lengths 0-5 (the token loop for all but 1), null slots of every length, two uncovered tokens before the first
    sequence and one after the last (zero output); slots no live sequence names stay bitwise untouched. Every gate
    mode: the token loop runs a thread's rows rolled or unrolled by gate, pool dtype and tile (``TOKEN_LOOP_ROLLED``);
    ``precomputed`` as vLLM Kimi-Linear calls it (fp32 log decay, beta in (0, 1), slot 0 null)."""
    from kda_core.contracts import NullSlotPolicy
    from kda_cute.decode_t1 import DecodeT1Config

    policy = NullSlotPolicy(policy)
    lengths = [1, 3, 0, 1, 5, 1, 2, 1, 4, 1, 1, 2]
    slots = [7, 3, 9, 0, 12, -1, 5, 13, 2, 11, 0, 1]  # row 3 and 10 name slot 0 (distinct live slots otherwise)
    if policy is NullSlotPolicy.OUT_OF_RANGE:
        slots[10] = 6
    N, H, lead, tail = 14, 12, 2, 1
    T = lead + sum(lengths) + tail
    cu = [lead + sum(lengths[:n]) for n in range(len(lengths) + 1)]
    low = 1 if policy is NullSlotPolicy.NONPOSITIVE else 0
    mapped = [s if low <= s < N else -1 for s in slots]
    g_dtype = torch.float32 if gate == "precomputed" else torch.bfloat16
    case = make_case(T, H, state_dtype=state_dtype, gate=gate, g_dtype=g_dtype, n_slots=N, slots=[0] * T, seed=112)
    before = case.pool.clone()
    ref_out, ref_pool = _varlen_reference(case, _clamped(cu, T), mapped)
    tile_v, ring = VARLEN_GRIDS[grid]
    out = _run_varlen(case, torch.tensor(slots, dtype=torch.int32, device="cuda"),
                      torch.tensor(cu, dtype=torch.int32, device="cuda"),
                      output=torch.full((1, T, H, 128), 7.0, dtype=torch.bfloat16, device="cuda"), null_policy=policy,
                      config=DecodeT1Config(tile_v, bulk_ring=ring))
    untouched = sorted(set(range(N)) - {s for s, n in zip(mapped, lengths) if s >= 0 and n})
    assert (0 in untouched) is (policy is NullSlotPolicy.NONPOSITIVE)
    assert torch.equal(case.pool[untouched], before[untouched])
    assert torch.count_nonzero(out[0, :lead]) == 0 and torch.count_nonzero(out[0, T - tail:]) == 0
    _assert_matches_oracle(case, out, case.pool, ref_out, ref_pool)


@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64], ids=["cu32", "cu64"])
@pytest.mark.parametrize("grid", ["tile16", "ring"])
def test_varlen_malformed_offsets_are_clamped_and_every_state_stays_exact(grid, cu_dtype, make_case):
    """Negative offsets, offsets past T (past 2^31 in int64: clamped, not truncated), a decreasing pair: every
    sequence's state is the recurrence over its clamped token range; outputs stay in bounds (not compared)."""
    from kda_cute.decode_t1 import DecodeT1Config

    N, H, T = 12, 12, 10
    big = 2**40 if cu_dtype is torch.int64 else 2**31 - 1
    cu = [-5, 1, 3, 2, 4, 6, big, -(2**31)]  # [0,1) [1,3) [3,3) [2,4) [4,6) [6,10) [10,10)
    slots = [4, 8, 1, 10, 2, 6, 0]
    case = make_case(T, H, n_slots=N, slots=[0] * T, seed=113)
    before = case.pool.clone()
    _, ref_pool = _varlen_reference(case, _clamped(cu, T), slots)
    tile_v, ring = VARLEN_GRIDS[grid]
    out = torch.full((1, T + 4, H, 128), 7.0, dtype=torch.bfloat16, device="cuda")  # 4 guard tokens past T
    _run_varlen(case, torch.tensor(slots, dtype=torch.int32, device="cuda"), torch.tensor(cu, dtype=cu_dtype,
                device="cuda"), output=out[:, :T], config=DecodeT1Config(tile_v, bulk_ring=ring))
    torch.cuda.synchronize()
    assert torch.all(out[:, T:] == 7.0)
    touched = {s for s, (bos, eos) in zip(slots, _clamped(cu, T)) if eos > bos}
    assert touched == {4, 8, 10, 2, 6}
    untouched = sorted(set(range(N)) - touched)
    assert torch.equal(case.pool[untouched], before[untouched])
    s_tol = dict(atol=2e-3, rtol=1.6e-2)
    torch.testing.assert_close(case.pool.float(), ref_pool.float(), **s_tol)
