"""64-bit offsets: every kernel reads and writes pool rows (and ucache ring rows) that lie past 2^31 elements.

A 32-bit slot offset (slot * row elements, or its byte count) would wrap past 2^31 elements or 2^32 bytes: the kernel
would then fault, or read and write another slot's row. Each test builds one pool past that line, touches its last
slot and slots in the middle of its upper half (plus low slots and null slots of every form), and checks:

- the touched rows against kda-core's oracle, run on just those rows gathered into a small pool (touched rows that
  the call does not write, e.g. an inactive spec row's checkpoints, stay bit for bit);
- that no other row changed: every row of the pool starts as canary bytes (0x7F) and a chunked scan after the call
  finds no row off the canary but the touched ones and the sentinels; the sentinels (the rows next to every touched
  one, row 0, and the rows a 32-bit wrap of a touched row's element or byte offset would land on) hold random data
  and must be bit for bit unchanged;
- zero output for the null rows.

Sizes (H = 12 heads): the T=1 and generic pools have 16384 fp32 rows (3.2e9 elements, 12.9 GB: byte offsets past
2^33) or 24576 bf16 rows (4.8e9 elements, 9.7 GB: element offsets past 2^32); the ucache test has 45056 slots, its
bf16 pool 8.9e9 elements (17.7 GB) and each ring 2.2e9 (past 2^31; k and u 4.4 GB, g 8.9 GB). A test skips, saying
how much it needs, when the GPU has less free memory; memory is released after every test.

Run on a GPU (not part of the fuzz marker, so not under compute-sanitizer):
``pytest -m gpu packages/kda-cute/tests/test_pool_64bit.py``.
"""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.gpu

DEV = "cuda"
K = 128
H = 12
BF16, FP32 = torch.bfloat16, torch.float32
INT_MIN, INT_MAX = -(2**31), 2**31 - 1
CANARY = 0x7F
POOL_ROWS = {FP32: 16384, BF16: 24576}
UCACHE_ROWS = 45056
SLACK_BYTES = 2 << 30  # activations, outputs, the gathered rows and the scan's chunks
STATE_TOL = {BF16: dict(atol=2e-3, rtol=1.6e-2), FP32: dict(atol=5e-5, rtol=5e-4)}


@pytest.fixture(autouse=True)
def _release_memory():
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _require_free(nbytes: int) -> None:
    gc.collect()
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    if free < nbytes + SLACK_BYTES:
        pytest.skip(f"needs {(nbytes + SLACK_BYTES) / 2**30:.1f} GiB of free GPU memory for rows past 2^31 elements, "
                    f"{free / 2**30:.1f} GiB free")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _rows_tensor(rows) -> torch.Tensor:
    return torch.tensor(list(rows), dtype=torch.long, device=DEV)


class CanaryRows:
    """A [N, ...] tensor too large to copy: every row holds the canary bytes except the rows a test fills."""

    def __init__(self, shape, dtype):
        self.t = torch.empty(shape, dtype=dtype, device=DEV)
        self.t.view(torch.uint8).fill_(CANARY)

    def fill(self, rows, values: torch.Tensor) -> None:
        self.t[_rows_tensor(rows)] = values

    def rows_off_canary(self, chunk_rows: int = 256) -> set[int]:
        bits = _bits(self.t).reshape(self.t.shape[0], -1)
        pattern = int.from_bytes(bytes([CANARY]) * self.t.element_size(), "little", signed=True)
        found: set[int] = set()
        for r0 in range(0, bits.shape[0], chunk_rows):
            found.update(((bits[r0:r0 + chunk_rows] != pattern).any(dim=1).nonzero()[:, 0] + r0).tolist())
        return found


def _sentinels(touched, t: torch.Tensor) -> list[int]:
    """Row 0 and the rows next to every touched row, and where a 32-bit wrap of a touched row's element offset or
    byte offset would land; touched rows excluded."""
    N, row, elem = t.shape[0], t.stride(0), t.element_size()
    rows = {0}
    for s in touched:
        rows.update((s - 1, s + 1))
        for unit in (1, elem):
            rows.add(((s * row * unit) % 2**32) // (row * unit))
    return sorted(r for r in rows if 0 <= r < N and r not in touched)



def _random(shape, dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device=DEV) * 0.1).to(dtype)


def _small_indices(indices, touched) -> torch.Tensor:
    """The slot indices renumbered into the gathered rows (position in ``touched``); null slots become -1."""
    where = {s: j for j, s in enumerate(touched)}
    renumber = lambda s: where.get(s, -1)  # noqa: E731
    small = [[renumber(s) for s in row] for row in indices] if isinstance(indices[0], list) else \
        [renumber(s) for s in indices]
    return torch.tensor(small, dtype=torch.int32, device=DEV)


def _setup_rows(rows: CanaryRows, touched, seed: int):
    """Random data in the touched rows and the sentinels; returns (sentinels, their copy, the touched rows' copy)."""
    sentinels = _sentinels(touched, rows.t)
    rows.fill(touched, _random((len(touched), *rows.t.shape[1:]), rows.t.dtype, seed))
    rows.fill(sentinels, _random((len(sentinels), *rows.t.shape[1:]), rows.t.dtype, seed + 1))
    return sentinels, rows.t[_rows_tensor(sentinels)].clone(), rows.t[_rows_tensor(touched)].clone()


def _assert_rows_confined(name: str, rows: CanaryRows, touched, sentinels, sentinels_before) -> None:
    stray = sorted(rows.rows_off_canary() - set(touched) - set(sentinels))
    assert not stray, f"{name}: rows {stray[:8]} ({len(stray)} in all) written that no active row owns"
    now = _bits(rows.t[_rows_tensor(sentinels)]).reshape(len(sentinels), -1)
    changed = (now != _bits(sentinels_before).reshape(len(sentinels), -1)).any(dim=1).nonzero()[:, 0].tolist()
    assert not changed, f"{name}: sentinel rows {[sentinels[j] for j in changed]} changed"


def _assert_touched_rows(name: str, rows: CanaryRows, touched, written, start, ref, tol) -> None:
    """Touched rows the call writes match the oracle's ``ref``; the others are bit for bit ``start``."""
    now = rows.t[_rows_tensor(touched)]
    for j, s in enumerate(touched):
        if s in written:
            torch.testing.assert_close(now[j].float(), ref[j].float(), **tol,
                                       msg=lambda m, s=s: f"{name}: row {s}: {m}")
        else:
            assert torch.equal(_bits(now[j]), _bits(start[j])), f"{name}: row {s} changed but nothing writes it"


def _assert_output(out, ref_out, null_rows) -> None:
    if null_rows:
        assert int(torch.count_nonzero(out[null_rows])) == 0, "output of null rows is not zero"
    scale = ref_out.float().abs().max().item() + 1e-6
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2 * scale, rtol=2e-2)


def _pool_slots(N: int) -> list[int]:
    """12 rows: the last slots, slots in the middle of the upper half, a low slot, and null slots of every form."""
    M = 3 * N // 4
    return [N - 1, -1, M, N, N - 2, INT_MIN, M + 2, INT_MAX, 1, N + 5, -7, N - 4]


def _nat_column(nat: int, t_idx: int) -> int:
    return max(min(nat, t_idx), 1) - 1


@pytest.mark.parametrize("grid", ["batch_major", "slot_major"])
@pytest.mark.parametrize("state_dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_decode_t1_updates_pool_rows_past_2_31_elements(state_dtype, grid, activations):
    from kda_core.oracle import recurrent_kda_ref
    from kda_cute import decode_t1, kda_decode_t1

    N = POOL_ROWS[state_dtype]
    _require_free(N * H * K * K * state_dtype.itemsize)
    slot_major = grid == "slot_major"
    # the large-batch schedule, forced: tile 128, bulk ring, slot-major grid; else the schedule's batch-major one
    config = decode_t1.DecodeT1Config(128, bulk_ring=8, slot_major=True) if slot_major else None
    slots = _pool_slots(N)
    B = len(slots)
    cfg = decode_t1.select_config(B, H, state_dtype, True, N) if config is None else config
    assert decode_t1.effective_config(cfg, B, state_dtype, True, N).slot_major is slot_major
    touched = sorted(s for s in slots if 0 <= s < N)
    pool = CanaryRows((N, H, K, K), state_dtype)
    sentinels, sentinels_before, start = _setup_rows(pool, touched, seed=11)
    act = activations(B, 1, H, seed=12)
    ref_out, ref_rows = recurrent_kda_ref(**act, initial_state=start.clone(),
                                          ssm_state_indices=_small_indices(slots, touched))
    q, k, v, g, beta = (act.pop(name) for name in ("q", "k", "v", "g", "beta"))
    out = kda_decode_t1(q, k, v, g, beta, pool.t, torch.tensor(slots, dtype=torch.int32, device=DEV), config=config,
                        **act)
    torch.cuda.synchronize()
    _assert_rows_confined("state pool", pool, touched, sentinels, sentinels_before)
    _assert_touched_rows("state pool", pool, touched, set(touched), start, ref_rows, STATE_TOL[state_dtype])
    _assert_output(out, ref_out, [b for b, s in enumerate(slots) if not 0 <= s < N])


@pytest.mark.parametrize("state_dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_generic_pool_mode_updates_rows_past_2_31_elements(state_dtype, activations):
    from kda_core.oracle import recurrent_kda_ref
    from kda_cute.generic import kda_recurrent_fwd

    N = POOL_ROWS[state_dtype]
    _require_free(N * H * K * K * state_dtype.itemsize)
    slots = _pool_slots(N)
    touched = sorted(s for s in slots if 0 <= s < N)
    pool = CanaryRows((N, H, K, K), state_dtype)
    sentinels, sentinels_before, start = _setup_rows(pool, touched, seed=21)
    act = activations(len(slots), 2, H, seed=22)
    ref_out, ref_rows = recurrent_kda_ref(**act, initial_state=start.clone(),
                                          ssm_state_indices=_small_indices(slots, touched))
    out, _ = kda_recurrent_fwd(**act, initial_state=pool.t,
                               ssm_state_indices=torch.tensor(slots, dtype=torch.int32, device=DEV))
    torch.cuda.synchronize()
    _assert_rows_confined("state pool", pool, touched, sentinels, sentinels_before)
    _assert_touched_rows("state pool", pool, touched, set(touched), start, ref_rows, STATE_TOL[state_dtype])
    _assert_output(out, ref_out, [b for b, s in enumerate(slots) if not 0 <= s < N])


def _spec_rows(N: int) -> tuple[list[list[int]], list[int]]:
    """8 requests x 4 checkpoint slots in the upper half and at the end, null slots and every kind of
    num_accepted_tokens (valid, 0, negative, INT_MIN, INT_MAX, T + 3); the read column follows the agreed clamp."""
    M = 3 * N // 4
    rows = [[N - 1, N - 2, N - 3, N - 4], [M, M + 1, -1, M + 3], [-1, M + 5, M + 6, M + 7],
            [N, INT_MIN, N + 5, INT_MAX], [M - 8, M - 7, N - 6, N - 8], [1, 2, -1, -1], [-1, -1, -1, N - 10],
            [M + 10, N - 12, M + 12, -1]]
    nats = [4, INT_MIN, 1, 2, 7, 0, INT_MAX, -5]
    return rows, nats


@pytest.mark.parametrize("state_dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_generic_spec_mode_updates_checkpoint_rows_past_2_31_elements(state_dtype, activations):
    from kda_core.oracle import recurrent_kda_ref
    from kda_cute.generic import kda_recurrent_fwd

    N = POOL_ROWS[state_dtype]
    _require_free(N * H * K * K * state_dtype.itemsize)
    rows, nats = _spec_rows(N)
    B, T = len(rows), len(rows[0])
    valid = lambda s: 0 <= s < N  # noqa: E731
    touched = sorted(s for row in rows for s in row if valid(s))
    active = [b for b in range(B) if valid(rows[b][_nat_column(nats[b], T)])]
    written = {s for b in active for s in rows[b] if valid(s)}
    assert written != set(touched)  # an inactive request's checkpoints are gathered too, and must stay
    pool = CanaryRows((N, H, K, K), state_dtype)
    sentinels, sentinels_before, start = _setup_rows(pool, touched, seed=31)
    act = activations(B, T, H, seed=32)
    nat = torch.tensor(nats, dtype=torch.int32, device=DEV)
    ref_out, ref_rows = recurrent_kda_ref(**act, initial_state=start.clone(),
                                          ssm_state_indices=_small_indices(rows, touched), num_accepted_tokens=nat)
    out, _ = kda_recurrent_fwd(**act, initial_state=pool.t,
                               ssm_state_indices=torch.tensor(rows, dtype=torch.int32, device=DEV),
                               num_accepted_tokens=nat)
    torch.cuda.synchronize()
    _assert_rows_confined("state pool", pool, touched, sentinels, sentinels_before)
    _assert_touched_rows("state pool", pool, touched, written, start, ref_rows, STATE_TOL[state_dtype])
    _assert_output(out, ref_out, [b for b in range(B) if b not in active])


def test_ucache_updates_pool_and_ring_rows_past_2_31_elements(activations):
    from kda_core.contracts import RING_SLOTS, default_flush_min, max_hist_len
    from kda_core.oracle import ucache_verify_flush_ref
    from kda_core.validation import validate_ucache
    from kda_cute.ucache import ucache_verify_flush

    N, T, w_ring = UCACHE_ROWS, 8, 16
    ring_shape = (N, H, RING_SLOTS, K)
    _require_free(N * H * K * K * 2 + 2 * N * H * RING_SLOTS * K * 2 + N * H * RING_SLOTS * K * 4)
    cap, flush_min = max_hist_len(T, w_ring), default_flush_min(T, w_ring)
    M = 3 * N // 4
    slots = [N - 1, M, -1, N - 3, N, M + 2, INT_MIN, 1]
    hist = [flush_min, 5, 0, cap, 3, INT_MAX, 2, -4]  # INT_MAX folds the capped window, -4 an empty one
    bases = [0, 31, 5, INT_MIN, 7, 30, 1, -1]
    B = len(slots)
    P = [min(max(h, 0), cap) for h in hist]
    base = [c & (RING_SLOTS - 1) for c in bases]
    active = [b for b in range(B) if 0 <= slots[b] < N]
    flush = [b for b in active if P[b] >= flush_min]
    touched = sorted(slots[b] for b in active)
    where = {s: j for j, s in enumerate(touched)}

    pool = CanaryRows((N, H, K, K), BF16)
    sentinels, sentinels_before, start = _setup_rows(pool, touched, seed=41)
    rings = {"k_cache": CanaryRows(ring_shape, BF16), "u_cache": CanaryRows(ring_shape, BF16),
             "g_cache": CanaryRows(ring_shape, FP32)}
    gen = torch.Generator(device=DEV).manual_seed(42)
    ring_start, ring_sentinels = {}, {}
    for name, ring in rings.items():
        rows = torch.full((len(touched), H, RING_SLOTS, K), float("inf" if name == "k_cache" else "nan"),
                          dtype=ring.t.dtype, device=DEV)  # stale rows: a read of one shows as a non-finite result
        for b in active:
            live = [(base[b] + j) % RING_SLOTS for j in range(P[b])]
            if not live:
                continue
            x = torch.randn(H, P[b], K, generator=gen, device=DEV)
            if name == "k_cache":
                x = x / x.norm(dim=-1, keepdim=True)
            elif name == "g_cache":
                x = (-0.5 * torch.rand(H, P[b], K, generator=gen, device=DEV)).cumsum(1)
            rows[where[slots[b]]][:, live] = x.to(ring.t.dtype)
        ring.fill(touched, rows)
        ring_start[name] = rows
        ring_sentinels[name] = _sentinels(touched, ring.t)
        ring.fill(ring_sentinels[name], _random((len(ring_sentinels[name]), H, RING_SLOTS, K), ring.t.dtype, 43))
    ring_sentinels_before = {name: ring.t[_rows_tensor(ring_sentinels[name])].clone() for name, ring in rings.items()}

    act = activations(B, T, H, seed=44)
    slot_t = torch.tensor(slots, dtype=torch.int32, device=DEV)
    hist_t = torch.tensor(hist, dtype=torch.int32, device=DEV)
    base_t = torch.tensor(bases, dtype=torch.int32, device=DEV)
    gate = (act["A_log"], act["g"], act["dt_bias"], act["lower_bound"])
    call = validate_ucache(*gate, q=act["q"], k=act["k"], v=act["v"], b=act["beta"], initial_state_source=pool.t,
                           initial_state_indices=slot_t, k_cache=rings["k_cache"].t, u_cache=rings["u_cache"].t,
                           g_cache=rings["g_cache"].t, hist_len=hist_t, cache_base=base_t, flush_min=flush_min,
                           restart_hist_on_flush=True, w_ring=w_ring, device_kind="cuda")
    small = dict(initial_state_source=start.clone(), k_cache=ring_start["k_cache"].clone(),
                 u_cache=ring_start["u_cache"].clone(), g_cache=ring_start["g_cache"].clone(),
                 hist_len=hist_t.clone(), cache_base=base_t.clone())
    ref_out = ucache_verify_flush_ref(*gate, q=act["q"], k=act["k"], v=act["v"], b=act["beta"],
                                      initial_state_indices=_small_indices(slots, touched), **small,
                                      flush_min=flush_min, restart_hist_on_flush=True, w_ring=w_ring,
                                      scale=call.scale, out_dtype=None)
    out = torch.empty(B, T, H, K, dtype=BF16, device=DEV)
    ucache_verify_flush(act["A_log"], act["g"], act["dt_bias"], act["lower_bound"], act["q"], act["k"], act["v"],
                        act["beta"], pool.t, slot_t, rings["k_cache"].t, rings["u_cache"].t, rings["g_cache"].t,
                        hist_t, base_t, flush_min, w_ring, call.scale, out, restart_hist_on_flush=True,
                        aligned=call.aligned)
    torch.cuda.synchronize()

    _assert_rows_confined("state pool", pool, touched, sentinels, sentinels_before)
    _assert_touched_rows("state pool", pool, touched, {slots[b] for b in flush}, start,
                         small["initial_state_source"], dict(atol=2e-2, rtol=1e-2))
    for name, ring in rings.items():
        _assert_rows_confined(name, ring, touched, ring_sentinels[name], ring_sentinels_before[name])
        now = ring.t[_rows_tensor(touched)]
        tol = dict(atol=1e-4, rtol=1e-5) if name == "g_cache" else dict(atol=1e-2, rtol=1e-2)
        for b in active:
            j = where[slots[b]]
            new = [(base[b] + P[b] + s) % RING_SLOTS for s in range(T)]
            keep = [p for p in range(RING_SLOTS) if p not in new]
            torch.testing.assert_close(now[j][:, new].float(), small[name][j][:, new].float(), **tol,
                                       msg=lambda m, b=b, name=name: f"{name} appends of row {b}: {m}")
            assert torch.equal(_bits(now[j][:, keep]), _bits(ring_start[name][j][:, keep])), \
                f"{name}: slot {slots[b]} changed outside its appends"
    assert int(torch.count_nonzero(out[[b for b in range(B) if b not in active]])) == 0, "null rows' output"
    torch.testing.assert_close(out.float(), ref_out, atol=8e-3, rtol=8e-3)
    expect_hist = [0 if b in flush else hist[b] for b in range(B)]
    expect_base = [(base[b] + P[b]) % RING_SLOTS if b in flush else bases[b] for b in range(B)]
    assert hist_t.tolist() == small["hist_len"].tolist() == expect_hist, f"hist_len {hist_t.tolist()}"
    assert base_t.tolist() == small["cache_base"].tolist() == expect_base, f"cache_base {base_t.tolist()}"
