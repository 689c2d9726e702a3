"""T=1 decode on pools whose slot stride is any number of elements (GPU): the pool-realigning variant against
kda-core's oracle.

vLLM's paged allocator gives slot strides of row + any element count (its tests use + 17). The entries take the
pool-realigning variant for every call that is not fully aligned: the pool is read in aligned 16-byte vectors from
each row's aligned floor, with the misalignment ``m`` (a slot's first byte modulo 16) differing from slot to slot
(a slot that happens to be aligned reads as in the aligned variant), and the other tensors in vectors when they are
aligned, element-wise otherwise. The pools here live inside a guarded flat buffer: the elements before the first
slot, between slots (the stride's padding), after the last, and every slot no live row names must stay bitwise
untouched; neighbouring slots share 16-byte vectors at their ends, so a whole-vector store at a slot's edge would
show there.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.gpu

H = 12
ROW = H * 128 * 128  # elements of one slot
GUARD = 64  # elements of the buffer before the pool's first and after its last element
PADS = (1, 2, 3, 8, 17, 64)  # slot stride = ROW + pad elements


def _assert_matches_oracle(out, pool_after, ref_out, ref_pool):
    """State within one rounding of the pool dtype; output within bf16 rounding of the oracle's."""
    if pool_after.dtype == torch.bfloat16:
        s_tol = dict(atol=2e-3, rtol=1.6e-2)
    else:
        s_tol = dict(atol=2e-5, rtol=2e-4)
    torch.testing.assert_close(pool_after.float(), ref_pool.float(), **s_tol)
    scale = ref_out.float().abs().max().item() + 1e-6
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2 * scale, rtol=2e-2)


def _guarded_pool(pool: torch.Tensor, pad: int, offset: int):
    """(pool view, its flat buffer): ``pool``'s values at slot stride ROW + ``pad``, the first slot ``offset``
    elements past GUARD (so its first byte is offset * element size past the buffer's 16-byte aligned start)."""
    N = pool.shape[0]
    stride = ROW + pad
    flat = torch.randn(2 * GUARD + offset + N * stride, device="cuda").to(pool.dtype)
    view = flat.as_strided((N, H, 128, 128), (stride, 128 * 128, 128, 1), storage_offset=GUARD + offset)
    view.copy_(pool)
    return view, flat


def _slot_bytes(view: torch.Tensor, slot: int) -> int:
    return (view.data_ptr() + slot * view.stride(0) * view.element_size()) % 16


def _written_mask(view: torch.Tensor, flat: torch.Tensor, live):
    """Boolean mask over ``flat``: the elements of the slots in ``live`` (each one contiguous run of ROW)."""
    mask = torch.zeros(flat.numel(), dtype=torch.bool, device="cuda")
    first = view.storage_offset() - flat.storage_offset()
    for s in live:
        start = first + s * view.stride(0)
        mask[start : start + ROW] = True
    return mask


def _slots(B: int, N: int, policy, seed: int):
    """B slots over N pool rows: distinct live ones, and for B >= 3 a 0 (live under OUT_OF_RANGE, null under
    NONPOSITIVE) and a -1, for B >= 4 also an N; at least one row stays live under both policies. Returns (slots,
    the slots the oracle gets: -1 where null)."""
    from kda_core.contracts import NullSlotPolicy

    gen = torch.Generator().manual_seed(seed)
    slots = (torch.randperm(N - 1, generator=gen)[:B] + 1).tolist()
    if B >= 3:
        slots[0], slots[-1] = 0, -1
    if B >= 4:
        slots[1] = N
    low = 1 if policy is NullSlotPolicy.NONPOSITIVE else 0
    return slots, [s if low <= s < N else -1 for s in slots]


def _decode(entry, case, pool, slots, out, null_policy):
    from kda_cute.decode_t1 import kda_decode_t1, kda_decode_t1_packed, kda_decode_t1_packed_tokens

    kw = dict(case.kwargs(), null_policy=null_policy)
    if entry == "packed":
        return kda_decode_t1_packed(case.mixed_qkv, case.raw_gate, case.raw_beta, pool, slots,
                                    num_heads=case.raw_beta.shape[1], output=out, **kw)
    if entry == "tokens":
        B = case.mixed_qkv.shape[0]
        return kda_decode_t1_packed_tokens(case.mixed_qkv, case.raw_gate.view(1, B, H, 128),
                                           case.raw_beta.view(1, B, H), pool, slots,
                                           output=out.view(1, B, H, 128), **kw).view(B, 1, H, 128)
    return kda_decode_t1(case.q, case.k, case.v, case.g, case.beta, pool, slots, output=out, **kw)


def _description(case, pool):
    from kda_core.validation import validate_decode_t1

    return validate_decode_t1(case.q, case.k, case.v, case.g, case.beta, pool,
                              torch.zeros(case.q.shape[0], dtype=torch.int32, device="cuda"), **case.kwargs())


@pytest.mark.parametrize("row_pad", [0, 1], ids=["act-aligned", "act-misaligned"])
@pytest.mark.parametrize("policy", ["out_of_range", "nonpositive"])
@pytest.mark.parametrize("B", [1, 3, 64])
@pytest.mark.parametrize("pad", PADS)
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_every_misalignment_matches_the_oracle_and_leaves_every_other_byte_untouched(state_dtype, pad, B, policy,
                                                                                     row_pad, make_case):
    """Every first-slot offset of 0..15 bytes (in elements) crossed with the stride's padding: the slots' own
    misalignments cover every m the dtype allows. ``row_pad`` 1: the activations' rows one element longer than
    3*H*128 (vLLM K3's mixed_qkv in bench_serving.py), so they are read element-wise, the pool still realigned."""
    from kda_core.contracts import NullSlotPolicy

    policy = NullSlotPolicy(policy)
    N = B + 5
    slots, mapped = _slots(B, N, policy, seed=pad * 7 + B)
    case = make_case(B, H, state_dtype=state_dtype, n_slots=N, slots=[max(s, 0) % N for s in slots], seed=pad + B,
                     row_pad=row_pad)
    live = [s for s in mapped if s >= 0]
    reference = dataclasses.replace(case, slots=torch.tensor(mapped, dtype=torch.int32, device="cuda"))
    ref_out, ref_pool = reference.oracle()
    seen = set()
    for offset in range(16 // case.pool.element_size()):
        view, flat = _guarded_pool(case.pool, pad, offset)
        call = _description(case, view)
        pool_aligned = _slot_bytes(view, 0) == 0 and pad * view.element_size() % 16 == 0
        assert call.others_aligned is (row_pad == 0 or B == 1)  # (one row: its stride is never stepped over)
        assert call.aligned is (pool_aligned and call.others_aligned)
        seen |= {_slot_bytes(view, s) for s in live}
        before = flat.clone()
        out = torch.full((B, 1, H, 128), 7.0, dtype=torch.bfloat16, device="cuda")
        _decode("unpacked", case, view, torch.tensor(slots, dtype=torch.int32, device="cuda"), out, policy)
        torch.cuda.synchronize()
        keep = ~_written_mask(view, flat, live)
        assert torch.equal(flat[keep], before[keep]), f"a byte outside the live slots changed (offset {offset})"
        inactive = [b for b, s in enumerate(mapped) if s < 0]
        if inactive:
            assert torch.count_nonzero(out[torch.tensor(inactive, device="cuda")]) == 0
        _assert_matches_oracle(out, view[live], ref_out, ref_pool[live])
    assert seen == set(range(0, 16, case.pool.element_size()))  # every misalignment the pool dtype allows


@pytest.mark.parametrize("row_pad", [0, 1], ids=["act-aligned", "act-misaligned"])
@pytest.mark.parametrize("entry", ["packed", "tokens"])
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("pad", [1, 17])
def test_the_packed_entries_on_an_odd_pool_are_bitwise_the_unpacked_entry(pad, state_dtype, entry, row_pad,
                                                                          make_case):
    from kda_core.contracts import NullSlotPolicy

    B, N = 37, 44
    policy = NullSlotPolicy.NONPOSITIVE
    slots, mapped = _slots(B, N, policy, seed=pad)
    case = make_case(B, H, state_dtype=state_dtype, n_slots=N, slots=[max(s, 0) % N for s in slots], seed=90 + pad,
                     row_pad=row_pad)
    view, flat = _guarded_pool(case.pool, pad, 1)
    before = flat.clone()
    idx = torch.tensor(slots, dtype=torch.int32, device="cuda")
    unpacked = _decode("unpacked", case, view, idx, torch.empty(B, 1, H, 128, dtype=torch.bfloat16, device="cuda"),
                       policy)
    unpacked_flat = flat.clone()
    flat.copy_(before)
    packed = _decode(entry, case, view, idx, torch.empty(B, 1, H, 128, dtype=torch.bfloat16, device="cuda"), policy)
    assert torch.equal(packed, unpacked) and torch.equal(flat, unpacked_flat)
    ref_out, ref_pool = dataclasses.replace(case, slots=torch.tensor(mapped, dtype=torch.int32,
                                                                      device="cuda")).oracle()
    live = [s for s in mapped if s >= 0]
    _assert_matches_oracle(packed, view[live], ref_out, ref_pool[live])


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("tile_v", [8, 16, 32, 64, 128])
def test_every_tile_and_rows_in_flight_on_an_odd_pool_matches_the_oracle(tile_v, state_dtype, make_case):
    from kda_cute.decode_t1 import DecodeT1Config, kda_decode_t1

    B, N, pad = 9, 16, 17
    case = make_case(B, H, state_dtype=state_dtype, n_slots=N, seed=tile_v)
    ref_out, ref_pool = case.oracle()
    live = case.slots.tolist()
    # 16 rows with the stream hint: the bf16 schedule's tile-128 row where no ring runs
    for rows_in_flight, hint in ((0, "stream"), (16, "global"), (16, "stream"), (1, "stream")):
        view, flat = _guarded_pool(case.pool, pad, 3)
        before = flat.clone()
        out = kda_decode_t1(case.q, case.k, case.v, case.g, case.beta, view, case.slots, **case.kwargs(),
                            config=DecodeT1Config(tile_v, rows_in_flight=rows_in_flight, cache_hint=hint))
        torch.cuda.synchronize()
        keep = ~_written_mask(view, flat, live)
        assert torch.equal(flat[keep], before[keep])
        _assert_matches_oracle(out, view[live], ref_out, ref_pool[live])


@pytest.mark.parametrize("policy", ["out_of_range", "nonpositive"])
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("tile_v, bulk_ring", [(32, 3), (32, 4), (64, 3), (64, 8), (128, 3), (128, 8), (128, 16)])
def test_the_realigning_ring_is_bitwise_the_register_path_at_every_misalignment(tile_v, bulk_ring, state_dtype,
                                                                                 policy, make_case):
    """The ring on the aligned grid of each tile's run (chunk 0 one vector short, the run's head and tail vectors in
    pieces from global memory, each row's straddling vector in pieces in shared memory): every first-slot offset and
    two paddings give every misalignment m, including 0; outputs and the whole buffer are bitwise those of the
    register path (the same rows, coefficients and row math), and no byte outside the live slots changes."""
    from kda_core.contracts import NullSlotPolicy
    from kda_cute.decode_t1 import DecodeT1Config, kda_decode_t1

    policy = NullSlotPolicy(policy)
    B, N = 9, 16
    slots, mapped = _slots(B, N, policy, seed=tile_v + bulk_ring)
    case = make_case(B, H, state_dtype=state_dtype, n_slots=N, slots=[max(s, 0) % N for s in slots],
                     seed=tile_v * bulk_ring)
    live = [s for s in mapped if s >= 0]
    ref_out, ref_pool = dataclasses.replace(case, slots=torch.tensor(mapped, dtype=torch.int32, device="cuda")).oracle()
    idx = torch.tensor(slots, dtype=torch.int32, device="cuda")
    seen = set()
    for pad in (1, 17):
        for offset in range(16 // case.pool.element_size()):
            results = []
            for ring in (bulk_ring, 0):
                view, flat = _guarded_pool(case.pool, pad, offset)
                before = flat.clone()
                out = kda_decode_t1(case.q, case.k, case.v, case.g, case.beta, view, idx, **case.kwargs(),
                                    null_policy=policy, config=DecodeT1Config(tile_v, bulk_ring=ring))
                torch.cuda.synchronize()
                keep = ~_written_mask(view, flat, live)
                assert torch.equal(flat[keep], before[keep]), f"a byte outside the live slots changed (ring {ring})"
                results.append((out, view.clone()))  # (the guards are random: each buffer's own)
            (ring_out, ring_pool), (reg_out, reg_pool) = results
            assert torch.equal(ring_out, reg_out) and torch.equal(ring_pool, reg_pool), (pad, offset)
            seen |= {_slot_bytes(view, s) for s in live}
            _assert_matches_oracle(ring_out, view[live], ref_out, ref_pool[live])
    assert seen == set(range(0, 16, case.pool.element_size()))


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("B", [256, 512])
def test_the_large_batch_schedule_on_an_odd_pool_matches_the_oracle(B, state_dtype, make_case):
    """The schedule's large rows (a ring, and a slot-major grid for a pool of about B rows, on an aligned pool) run
    tile 128 on the realigning variant: its ring with both pool dtypes (no slot-major grid)."""
    N = B + 8
    case = make_case(B, H, state_dtype=state_dtype, n_slots=N, seed=B)
    ref_out, ref_pool = case.oracle()
    view, flat = _guarded_pool(case.pool, 17, 0)
    before = flat.clone()
    out = _decode("packed", case, view, case.slots, torch.empty(B, 1, H, 128, dtype=torch.bfloat16, device="cuda"),
                  _policy("out_of_range"))
    torch.cuda.synchronize()
    live = case.slots.tolist()
    keep = ~_written_mask(view, flat, live)
    assert torch.equal(flat[keep], before[keep])
    _assert_matches_oracle(out, view[live], ref_out, ref_pool[live])


def _policy(name):
    from kda_core.contracts import NullSlotPolicy

    return NullSlotPolicy(name)


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cuda_graph_replay_on_an_odd_pool_follows_changed_inputs_and_indices(state_dtype, make_case):
    B, N, pad = 16, 40, 17
    case = make_case(B, H, state_dtype=state_dtype, n_slots=N, seed=5)
    view, flat = _guarded_pool(case.pool, pad, 1)
    case = dataclasses.replace(case, pool=view)
    out = torch.empty(B, 1, H, 128, dtype=torch.bfloat16, device="cuda")
    policy = _policy("out_of_range")
    _decode("packed", case, view, case.slots, out, policy)  # loads the module before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _decode("packed", case, view, case.slots, out, policy)
    for step in range(3):
        fresh = make_case(B, H, state_dtype=state_dtype, n_slots=N, seed=300 + step)
        case.mixed_qkv.copy_(fresh.mixed_qkv)
        case.raw_gate.copy_(fresh.raw_gate)
        case.raw_beta.copy_(fresh.raw_beta)
        case.slots.copy_(fresh.slots)
        ref_out, ref_pool = case.oracle()
        before = flat.clone()
        graph.replay()
        torch.cuda.synchronize()
        live = case.slots.tolist()
        keep = ~_written_mask(view, flat, live)
        assert torch.equal(flat[keep], before[keep])
        _assert_matches_oracle(out, view[live], ref_out, ref_pool[live])


@pytest.mark.parametrize("policy", ["out_of_range", "nonpositive"])
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("tile_v, bulk_ring", [(16, 0), (128, 0), (64, 3), (128, 3), (128, 8)])
def test_varlen_on_an_odd_pool_matches_the_oracle(tile_v, bulk_ring, state_dtype, policy, make_case):
    """One-token sequences (the realigned T=1 path: the register path, or the realigning ring with ``bulk_ring``),
    longer ones (the token loop, element-wise on this pool), an empty one and null slots, through the varlen entry
    (decode_t1._run_varlen with kda-core's description of the same tokens as a dense call, its B set to the sequence
    count, as test_decode_t1.py's varlen tests). With a ring, outputs and the whole buffer are also bitwise those of
    the register path."""
    from kda_core.oracle import recurrent_kda_ref
    from kda_cute import decode_t1

    policy = _policy(policy)
    lengths = [1, 3, 0, 1, 1, 2, 1, 1]
    slots = [7, 3, 9, 0, 12, -1, 5, 1]
    N, lead = 14, 1
    T = lead + sum(lengths)
    cu = [lead + sum(lengths[:n]) for n in range(len(lengths) + 1)]
    low = 1 if policy is decode_t1.NullSlotPolicy.NONPOSITIVE else 0
    mapped = [s if low <= s < N else -1 for s in slots]
    case = make_case(T, H, state_dtype=state_dtype, n_slots=N, slots=[0] * T, seed=tile_v)
    view, flat = _guarded_pool(case.pool, 17, 1)
    tokens = [x.transpose(0, 1) for x in (case.q, case.k, case.v, case.g, case.beta)]
    ref_out = torch.zeros(1, T, H, 128, dtype=torch.bfloat16, device="cuda")
    ref_pool = case.pool.clone()
    for n, slot in enumerate(mapped):
        if lengths[n]:
            o, ref_pool = recurrent_kda_ref(
                *(x[:, cu[n]:cu[n + 1]] for x in tokens), A_log=case.A_log, dt_bias=case.dt_bias,
                initial_state=ref_pool, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=case.use_gate_in_kernel,
                lower_bound=case.lower_bound, beta_is_logit=case.beta_is_logit,
                ssm_state_indices=torch.tensor([slot], device="cuda"))
            ref_out[:, cu[n]:cu[n + 1]] = o
    call = dataclasses.replace(_description(case, view), B=len(slots))
    assert not call.aligned and call.others_aligned
    live = sorted({s for s, n in zip(mapped, lengths) if s >= 0 and n})
    results = []
    for ring in sorted({bulk_ring, 0}, reverse=True):
        view, flat = _guarded_pool(case.pool, 17, 1)
        before = flat.clone()
        out = torch.full((1, T, H, 128), 7.0, dtype=torch.bfloat16, device="cuda")
        decode_t1._run_varlen(call, *tokens, view, torch.tensor(slots, dtype=torch.int32, device="cuda"),
                              torch.tensor(cu, dtype=torch.int32, device="cuda"), case.A_log, case.dt_bias, True, out,
                              null_policy=policy, config=decode_t1.DecodeT1Config(tile_v, bulk_ring=ring))
        torch.cuda.synchronize()
        keep = ~_written_mask(view, flat, live)
        assert torch.equal(flat[keep], before[keep]), f"a byte outside the live slots changed (ring {ring})"
        assert torch.count_nonzero(out[0, :lead]) == 0
        _assert_matches_oracle(out, view[live], ref_out, ref_pool[live])
        results.append((out, view.clone()))
    if bulk_ring:
        (ring_out, ring_pool), (reg_out, reg_pool) = results
        assert torch.equal(ring_out, reg_out) and torch.equal(ring_pool, reg_pool)
