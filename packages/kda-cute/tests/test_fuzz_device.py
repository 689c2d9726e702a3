"""Device-data fuzz of every kda-cute kernel: malformed slot indices, num_accepted_tokens, cu_seqlens and ucache
cursors stay bounded inside the kernel (docs/design.md §4, §5).

Kernels: the T=1 kernel (both entries; the batch-major grid with the schedule's tile and with the bulk ring, and the
slot-major grid the schedule takes for large aligned batches, forced here through its hooks because a batch of at
most 16 rows never reaches it), the generic kernel (pool mode with 1-D indices, spec mode with 2-D indices and
num_accepted_tokens, varlen cu_seqlens in pool, spec and dense modes, dense mode) and the ucache verify+flush (with
and without the cursor restart). Each test runs seeded random cases that mix valid and null device values; after
every call it checks that:

- the call raised nothing and the CUDA context is alive (``torch.cuda.synchronize()``);
- every tensor the kernel writes or indexes (pool, k/u/g rings, output, cursors, slot indices, num_accepted_tokens,
  cu_seqlens) lives inside a larger buffer whose margins, and the padding between pool and ring rows, hold canary
  bytes (0x7F); no element changed except those an active row owns (its pool rows, its ring appends, a restarted
  cursor, the output);
- rows that a null slot makes inactive got zero output;
- outputs and states match kda-core's oracle (``recurrent_kda_ref``, ``ucache_verify_flush_ref``) run on the same
  malformed values; where the clamped cu_seqlens offsets decrease somewhere only the states are compared.

Semantics the assertions rely on: a slot is null iff ``idx < 0 or idx >= N`` (zero output, pool and rings neither
read nor written); spec decode reads column ``max(min(nat, T_idx), 1) - 1`` and skips a token whose slot is null;
sequence n of a varlen call owns tokens ``[bos, eos)`` with ``bos = clamp(cu[n], 0, T_total)``,
``eos = clamp(cu[n + 1], bos, T_total)`` taken in 64 bits, and its state is the recurrence over exactly those tokens
(an empty sequence leaves its state bit for bit); ucache rows use ``P = clamp(hist_len, 0, min(w_ring, 32 - T))``
and ``base = cache_base & 31``, append at ``(base + P + s) & 31``, flush when ``P >= flush_min``, and the restart
sets ``base = (base + P) & 31, hist_len = 0``. Duplicate active slots are a caller error and never generated.

Run on a GPU: ``pytest -m "gpu and fuzz" packages/kda-cute/tests/test_fuzz_device.py``. ``KDA_FUZZ_CASES`` sets
the seeds per test (default 6). Under compute-sanitizer use fewer, and no caching allocator so that a stray access
leaves every allocation (``nox -s sanitize`` runs exactly this): ``PYTORCH_NO_CUDA_MEMORY_CACHING=1 KDA_FUZZ_CASES=2
compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 python -m pytest -q -m "gpu and fuzz"
packages/kda-cute/tests``, then the same with ``--tool racecheck``.
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.fuzz]

DEV = "cuda"
K = 128
BF16, FP32 = torch.bfloat16, torch.float32
INT_MIN, INT_MAX = -(2**31), 2**31 - 1
CANARY = 0x7F  # every byte of a margin; as bf16 0x7F7F and fp32 0x7F7F7F7F: ~3.4e38, a value no kernel writes


def _cases() -> int:
    text = os.environ.get("KDA_FUZZ_CASES", "6")
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"KDA_FUZZ_CASES: expected an int >= 1, got {text!r}")
    return int(text)


CASES = _cases()
# Share of null rows per case (cycled): mixed, mostly null, none, all (a bitwise no-op), ...
P_NULL = (0.4, 0.7, 0.0, 1.0, 0.25, 0.55)
POOL_ROWS = (8, 20, 32)  # N: fewer rows than the batch, and more
# (H, rows): B * H stays in one row of each schedule table, so the seeds of a test share one compiled variant
HEADS_AND_ROWS = ((8, 16), (12, 12))


def _seeds(first: int) -> list[int]:
    return list(range(first, first + CASES))


# ---------------------------------------------------------------------------------------------------------------
# Canary-guarded tensors


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory as integers of the element's width (NaN payloads compare bit for bit)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


class Guarded:
    """A tensor ``t`` inside a larger flat buffer: ``margin`` canary elements on both sides and ``row_pad`` canary
    elements after every dim-0 row (a padded dim-0 stride, as pools and rings allow).

    Mark what the call may write with :meth:`allowed` (a bool view with ``t``'s geometry), :meth:`snapshot` before the
    call, :meth:`assert_intact` after it: any other element of the buffer that changed fails, with its place named.
    """

    def __init__(self, shape, dtype, *, row_pad: int = 0):
        self.shape = tuple(shape)
        self.inner = math.prod(self.shape[1:])
        self.row = self.inner + row_pad
        self.margin = -(-max(self.row, 1024) // 64) * 64
        self.span = self.shape[0] * self.row
        self.buf = torch.empty(2 * self.margin + self.span, dtype=dtype, device=DEV)
        self.buf.view(torch.uint8).fill_(CANARY)
        strides = [self.row, *_contiguous_strides(self.shape[1:])]
        self.t = self.buf.as_strided(self.shape, strides, self.margin)
        self._allowed = torch.zeros(self.buf.shape, dtype=torch.bool, device=DEV)
        self._before = None

    @classmethod
    def copy_of(cls, values: torch.Tensor, *, row_pad: int = 0) -> Guarded:
        g = cls(values.shape, values.dtype, row_pad=row_pad)
        g.t.copy_(values)
        return g

    def allowed(self) -> torch.Tensor:
        return self._allowed.as_strided(self.t.shape, self.t.stride(), self.margin)

    def allow_rows(self, rows) -> None:
        rows = sorted(set(rows))
        if rows:
            self.allowed()[torch.tensor(rows, device=DEV)] = True

    def snapshot(self) -> None:
        self._before = _bits(self.buf).clone()

    def assert_intact(self, what: str) -> None:
        bad = (_bits(self.buf) != self._before) & ~self._allowed
        count = int(bad.sum())
        if count:
            places = [self._place(p) for p in bad.nonzero()[:6, 0].tolist()]
            raise AssertionError(f"{what}: {count} element(s) written that no active row owns, e.g. {places}")

    def _place(self, p: int) -> str:
        if p < self.margin:
            return f"{self.margin - p} elements before the tensor"
        q = p - self.margin
        if q >= self.span:
            return f"{q - self.span + 1} elements past its end"
        r, c = divmod(q, self.row)
        if c >= self.inner:
            return f"padding {c - self.inner} after row {r}"
        idx = []
        for n in reversed(self.shape[1:]):
            c, i = divmod(c, n)
            idx.insert(0, i)
        return f"element {(r, *idx)}"


def _contiguous_strides(shape) -> list[int]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.insert(0, step)
        step *= n
    return strides


def _snapshot(*guards: Guarded) -> None:
    for g in guards:
        g.snapshot()


def _assert_intact(ctx: str, **guards: Guarded) -> None:
    for name, g in guards.items():
        g.assert_intact(f"{ctx}: {name}")


def _sync(ctx: str) -> None:
    try:
        torch.cuda.synchronize()
    except RuntimeError as exc:  # a fault is sticky: every later test of the process fails too
        raise AssertionError(f"{ctx}: the kernel faulted: {exc}") from exc


# ---------------------------------------------------------------------------------------------------------------
# Random device data


def _nulls(N: int) -> tuple[int, ...]:
    return (-1, N, N + 5, INT_MIN, INT_MAX)


def _in_pool(s: int, N: int) -> bool:
    return 0 <= s < N


def _fuzz_slots(rng: random.Random, count: int, N: int, p_null: float) -> list[int]:
    """``count`` slot values: distinct rows of [0, N) (never a duplicate active slot), each replaced by a null form
    (repeats allowed) with probability ``p_null``; at least one valid entry unless ``p_null`` is 1."""
    valid = rng.sample(range(N), min(count, N))
    out = [valid[i] if i < len(valid) and rng.random() >= p_null else rng.choice(_nulls(N)) for i in range(count)]
    if p_null < 1 and not any(_in_pool(s, N) for s in out):
        out[0] = valid[0]
    rng.shuffle(out)
    return out


def _fuzz_nat(rng: random.Random, t_idx: int) -> int:
    return rng.choice((0, -5, INT_MIN, INT_MAX, t_idx + 3, *range(1, t_idx + 1)))


def _nat_column(nat: int, t_idx: int) -> int:
    return max(min(nat, t_idx), 1) - 1


CU_FORMS = ("valid", "overrun", "negative", "first_past_end", "non_monotonic", "int32_extremes")
CU_FORMS_WIDE = ("beyond_int32", "beyond_int32_unsorted")  # int64 offsets only
WIDE_UP = (2**31, 2**31 + 4, 2**32 + 1, 2**40, 2**63 - 1)  # 2^32 + 1 truncates to 1, 2^31 to INT_MIN
WIDE_DOWN = (-(2**31) - 1, -(2**32) + 3, -(2**63))  # -(2^32) + 3 truncates to 3


def _fuzz_cu(rng: random.Random, n_seq: int, T: int, form: str) -> list[int]:
    """``n_seq + 1`` offsets over ``T`` tokens of one malformed form (``valid``: sorted, empty sequences allowed)."""
    cu = [0, *sorted(rng.randint(0, T) for _ in range(n_seq - 1)), T]
    if form == "overrun":  # the last offsets run past the tokens, the last one possibly to INT_MAX
        k = rng.randint(1, 3)
        cu[-k:] = sorted(T + rng.randint(1, 64) for _ in range(k))
        if rng.random() < 0.5:
            cu[-1] = INT_MAX
    elif form == "negative":  # the first offsets before token 0, possibly INT_MIN
        k = rng.randint(1, 3)
        cu[:k] = sorted(rng.choice((-1, -7, -T, INT_MIN)) for _ in range(k))
    elif form == "first_past_end":  # every sequence starts past the tokens (all empty), or the later ones come back
        start = T + rng.randint(1, 9)
        cu = [start, *sorted(rng.randint(start, start + 50) for _ in range(n_seq))]
        if rng.random() < 0.5:
            cu[1:] = [rng.randint(0, T) for _ in range(n_seq)]
    elif form == "non_monotonic":  # two offsets of different value swapped: some sequence ends before it starts
        pairs = [(a, b) for a in range(len(cu)) for b in range(a + 1, len(cu)) if cu[a] < cu[b]]
        a, b = rng.choice(pairs)
        cu[a], cu[b] = cu[b], cu[a]
    elif form == "int32_extremes":
        cu = [rng.choice((INT_MIN, INT_MAX, -1, 0, T, T + 1, rng.randint(0, T))) for _ in range(n_seq + 1)]
        if rng.random() < 0.5:
            cu.sort()
    elif form == "beyond_int32":  # sorted, the ends past the int32 range: they must clamp, not truncate
        k, j = rng.randint(1, 3), rng.randint(0, 2)
        cu[-k:] = sorted(rng.choice(WIDE_UP) for _ in range(k))
        cu[:j] = sorted(rng.choice(WIDE_DOWN) for _ in range(j))
    elif form == "beyond_int32_unsorted":
        cu = [rng.choice((*WIDE_UP, *WIDE_DOWN, rng.randint(0, T))) for _ in range(n_seq + 1)]
    elif form != "valid":
        raise ValueError(form)
    return cu


def _segments(cu: list[int], T: int) -> tuple[list[tuple[int, int]], bool]:
    """([bos, eos) of every sequence after the agreed clamp, whether the clamped offsets are non-decreasing)."""
    c = [min(max(x, 0), T) for x in cu]
    segs = [(c[n], max(c[n + 1], c[n])) for n in range(len(cu) - 1)]
    return segs, all(c[i] <= c[i + 1] for i in range(len(c) - 1))



def _random_rows(N: int, H: int, dtype, seed: int, row_shape=(K, K)) -> torch.Tensor:
    gen = torch.Generator(device=DEV).manual_seed(seed + 7919)
    return (torch.randn(N, H, *row_shape, generator=gen, device=DEV) * 0.1).to(dtype)


def _int32(values) -> Guarded:
    return Guarded.copy_of(torch.tensor(values, dtype=torch.int32, device=DEV))


# ---------------------------------------------------------------------------------------------------------------
# Comparisons (the tolerances of test_decode_t1.py, test_generic.py and test_ucache.py)

T1_STATE_TOL = {BF16: dict(atol=2e-3, rtol=1.6e-2), FP32: dict(atol=2e-5, rtol=2e-4)}
GENERIC_STATE_TOL = {BF16: dict(atol=2e-3, rtol=1.6e-2), FP32: dict(atol=5e-5, rtol=5e-4)}
UCACHE_OUT_TOL = dict(atol=8e-3, rtol=8e-3)
UCACHE_STATE_TOL = dict(atol=2e-2, rtol=1e-2)
UCACHE_RING_TOL = dict(atol=1e-2, rtol=1e-2)
UCACHE_G_TOL = dict(atol=1e-4, rtol=1e-5)


def _close(actual, expected, ctx: str, what: str, **tol) -> None:
    torch.testing.assert_close(actual, expected, msg=lambda m: f"{ctx}: {what}: {m}", **tol)


def _assert_output_close(out, ref, ctx: str) -> None:
    """Within bf16 rounding (plus fp32 summation order) of the oracle's output."""
    scale = ref.float().abs().max().item() + 1e-6
    _close(out.float(), ref.float(), ctx, "output", atol=2e-2 * scale, rtol=2e-2)


def _assert_zero(t, ctx: str, what: str) -> None:
    n = int(torch.count_nonzero(t))
    assert n == 0, f"{ctx}: {what}: {n} non-zero element(s)"


# ---------------------------------------------------------------------------------------------------------------
# T=1 kernel

# name: (tile_v, bulk_ring, slot_major) of the DecodeT1Config the entry gets (None: the schedule's, batch-major at these
# sizes); the other two are the schedule of large aligned batches (bulk ring on the batch-major grid, or the slot-major
# grid)
T1_GRIDS = {"batch_major": None, "batch_major_ring": (128, 8, False), "slot_major": (128, 8, True)}


@pytest.mark.parametrize("grid", list(T1_GRIDS))
@pytest.mark.parametrize("state_dtype", [BF16, FP32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("entry", ["unpacked", "packed"])
def test_decode_t1_keeps_malformed_slots_in_bounds(entry, state_dtype, grid, make_case):
    from kda_core.validation import validate_decode_t1, validate_packed_decode_t1
    from kda_cute import decode_t1, kda_decode_t1, kda_decode_t1_packed

    config = None if T1_GRIDS[grid] is None else decode_t1.DecodeT1Config(T1_GRIDS[grid][0],
                                                                          bulk_ring=T1_GRIDS[grid][1],
                                                                          slot_major=T1_GRIDS[grid][2])
    ring, slot_major = (None, False) if config is None else (config.bulk_ring, config.slot_major)
    for i, seed in enumerate(_seeds(1000)):
        rng = random.Random(seed)
        H, B = HEADS_AND_ROWS[i % 2]
        N = rng.choice(POOL_ROWS)
        slots = _fuzz_slots(rng, B, N, P_NULL[i % len(P_NULL)])
        ctx = f"seed {seed} (B={B}, H={H}, N={N}, slots {slots})"
        case = make_case(B, H, state_dtype=state_dtype, n_slots=N, slots=slots, row_pad=8, seed=seed)
        pool = Guarded.copy_of(case.pool, row_pad=8)
        idx = Guarded.copy_of(case.slots)
        out = Guarded((B, 1, H, K), BF16)
        case.pool, case.slots = pool.t, idx.t
        if entry == "packed":
            call = validate_packed_decode_t1(case.mixed_qkv, case.raw_gate, case.raw_beta, pool.t, idx.t,
                                             num_heads=H, output=out.t, **case.kwargs())
        else:
            call = validate_decode_t1(case.q, case.k, case.v, case.g, case.beta, pool.t, idx.t, output=out.t,
                                      **case.kwargs())
        cfg = (decode_t1.select_config(B, H, state_dtype, call.aligned, N) if config is None
               else decode_t1.effective_config(config, B, state_dtype, call.aligned, N))
        assert cfg.slot_major is slot_major and (ring is None or cfg.bulk_ring > 0), f"{ctx}: would run {cfg}"
        ref_out, ref_pool = case.oracle()
        active = [b for b, s in enumerate(slots) if _in_pool(s, N)]
        pool.allow_rows(slots[b] for b in active)
        out.allowed().fill_(True)
        _snapshot(pool, idx, out)
        if entry == "packed":
            kda_decode_t1_packed(case.mixed_qkv, case.raw_gate, case.raw_beta, pool.t, idx.t, num_heads=H,
                                 output=out.t, config=config, **case.kwargs())
        else:
            kda_decode_t1(case.q, case.k, case.v, case.g, case.beta, pool.t, idx.t, output=out.t, config=config,
                          **case.kwargs())
        _sync(ctx)
        _assert_intact(ctx, state_pool=pool, slot_indices=idx, output=out)
        _assert_zero(out.t[[b for b in range(B) if b not in active]], ctx, "output of inactive rows")
        _assert_output_close(out.t, ref_out, ctx)
        _close(pool.t.float(), ref_pool.float(), ctx, "state pool", **T1_STATE_TOL[state_dtype])


# ---------------------------------------------------------------------------------------------------------------
# Generic kernel


def _run_generic(ctx, inputs, guards, out, *, pool=None, init=None, idx=None, nat=None, cu=None, final=False):
    """Validate the call's metadata (as the facade does before launching), run the oracle on copies, snapshot the
    guards and run the kernel on the guarded tensors. Returns (kernel final state or None, oracle (o, final))."""
    from kda_core.call_args import RecurrentArgs
    from kda_core.oracle import recurrent_kda_ref
    from kda_core.validation import validate_recurrent
    from kda_cute.generic import kda_recurrent_fwd

    state = pool if pool is not None else init
    kw = dict(initial_state=None if state is None else state.t, ssm_state_indices=None if idx is None else idx.t,
              num_accepted_tokens=None if nat is None else nat.t, cu_seqlens=None if cu is None else cu.t,
              output_final_state=final)
    validate_recurrent(RecurrentArgs(**inputs, **kw, output=out.t), device_kind="cuda")
    ref_kw = dict(kw, initial_state=None if state is None else state.t.clone())
    ref = recurrent_kda_ref(**inputs, **ref_kw)
    _snapshot(*guards)
    o, final_state = kda_recurrent_fwd(**inputs, **kw, output=out.t)
    _sync(ctx)
    assert o is out.t, f"{ctx}: the given output was not returned"
    return final_state, ref


def _spec_indices(rng, rows: int, t_idx: int, N: int, p_null: float):
    """2-D slot indices [rows, t_idx] (every valid entry distinct) and num_accepted_tokens [rows]."""
    flat = _fuzz_slots(rng, rows * t_idx, N, p_null)
    return [flat[r * t_idx:(r + 1) * t_idx] for r in range(rows)], [_fuzz_nat(rng, t_idx) for _ in range(rows)]


@pytest.mark.parametrize("pool_dtype", [BF16, FP32], ids=["bf16", "fp32"])
def test_generic_pool_mode_keeps_malformed_slots_in_bounds(pool_dtype, activations):
    T = 4
    for i, seed in enumerate(_seeds(2000)):
        rng = random.Random(seed)
        H, B = HEADS_AND_ROWS[i % 2]
        N = rng.choice(POOL_ROWS)
        slots = _fuzz_slots(rng, B, N, P_NULL[i % len(P_NULL)])
        ctx = f"seed {seed} (B={B}, T={T}, H={H}, N={N}, slots {slots})"
        inputs = activations(B, T, H, seed)
        pool = Guarded.copy_of(_random_rows(N, H, pool_dtype, seed), row_pad=8)
        idx = _int32(slots)
        out = Guarded((B, T, H, K), BF16)
        active = [b for b, s in enumerate(slots) if _in_pool(s, N)]
        pool.allow_rows(slots[b] for b in active)
        out.allowed().fill_(True)
        _, (ref_o, ref_pool) = _run_generic(ctx, inputs, (pool, idx, out), out, pool=pool, idx=idx)
        _assert_intact(ctx, initial_state=pool, ssm_state_indices=idx, output=out)
        _assert_zero(out.t[[b for b in range(B) if b not in active]], ctx, "output of inactive rows")
        _assert_output_close(out.t, ref_o, ctx)
        _close(pool.t.float(), ref_pool.float(), ctx, "state pool", **GENERIC_STATE_TOL[pool_dtype])


def test_generic_spec_mode_keeps_malformed_slots_and_accepted_counts_in_bounds(activations):
    B, T = 8, 4  # B * T entries, all distinct when valid: at most the 32 pool rows
    for i, seed in enumerate(_seeds(3000)):
        rng = random.Random(seed)
        H = HEADS_AND_ROWS[i % 2][0]
        N = rng.choice(POOL_ROWS)
        rows, nats = _spec_indices(rng, B, T, N, P_NULL[i % len(P_NULL)])
        ctx = f"seed {seed} (B={B}, T={T}, H={H}, N={N}, slots {rows}, num_accepted_tokens {nats})"
        inputs = activations(B, T, H, seed)
        pool = Guarded.copy_of(_random_rows(N, H, BF16, seed), row_pad=8)
        idx, nat = _int32(rows), _int32(nats)
        out = Guarded((B, T, H, K), BF16)
        active = [b for b in range(B) if _in_pool(rows[b][_nat_column(nats[b], T)], N)]
        live = [[b in active and _in_pool(rows[b][t], N) for t in range(T)] for b in range(B)]
        pool.allow_rows(rows[b][t] for b in range(B) for t in range(T) if live[b][t])
        out.allowed().fill_(True)
        _, (ref_o, ref_pool) = _run_generic(ctx, inputs, (pool, idx, nat, out), out, pool=pool, idx=idx, nat=nat)
        _assert_intact(ctx, initial_state=pool, ssm_state_indices=idx, num_accepted_tokens=nat, output=out)
        dead = torch.tensor(live, device=DEV).logical_not()
        _assert_zero(out.t[dead], ctx, "output of inactive rows and skipped tokens")
        _assert_output_close(out.t, ref_o, ctx)
        _close(pool.t.float(), ref_pool.float(), ctx, "state pool", **GENERIC_STATE_TOL[BF16])


@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("mode", ["pool", "spec", "dense"])
def test_generic_varlen_keeps_malformed_cu_seqlens_in_bounds(mode, cu_dtype, activations):
    """Every cu_seqlens form in every seed: pool mode with 1-D slots, spec mode with 2 index columns (a longer
    sequence's later tokens are skipped), dense mode with a bf16 initial state and the fp32 final state."""
    T_total, t_idx = 24, 2
    forms = CU_FORMS + (CU_FORMS_WIDE if cu_dtype == torch.int64 else ())
    for i, seed in enumerate(_seeds(4000)):
        for form in forms:
            rng = random.Random(f"{seed}-{form}")
            H, n_seq = HEADS_AND_ROWS[i % 2]
            N = rng.choice(POOL_ROWS)
            offsets = _fuzz_cu(rng, n_seq, T_total, form)
            segs, monotonic = _segments(offsets, T_total)
            lengths = [eos - bos for bos, eos in segs]
            ctx = f"seed {seed}, {form} (T={T_total}, H={H}, N={N}, cu_seqlens {offsets}"
            inputs = activations(1, T_total, H, seed)
            cu = Guarded.copy_of(torch.tensor(offsets, dtype=cu_dtype, device=DEV))
            out = Guarded((1, T_total, H, K), BF16)
            out.allowed().fill_(True)
            guards = dict(cu_seqlens=cu, output=out)
            rows = None
            if mode == "dense":
                init = Guarded.copy_of(_random_rows(n_seq, H, BF16, seed), row_pad=8)
                guards["initial_state"] = init
                kw = dict(init=init, final=True)
                live_seq = [True] * n_seq
            else:
                pool = Guarded.copy_of(_random_rows(N, H, BF16, seed), row_pad=8)
                guards["initial_state"] = pool
                p_null = P_NULL[i % len(P_NULL)]
                if mode == "pool":
                    slots = _fuzz_slots(rng, n_seq, N, p_null)
                    idx = guards["ssm_state_indices"] = _int32(slots)
                    kw = dict(pool=pool, idx=idx)
                    live_seq = [_in_pool(s, N) for s in slots]
                    # an empty sequence's state stays bit for bit, so only the non-empty ones may write
                    pool.allow_rows(slots[n] for n in range(n_seq) if live_seq[n] and lengths[n])
                    ctx += f", slots {slots}"
                else:
                    rows, nats = _spec_indices(rng, n_seq, t_idx, N, p_null)
                    idx = guards["ssm_state_indices"] = _int32(rows)
                    nat = guards["num_accepted_tokens"] = _int32(nats)
                    kw = dict(pool=pool, idx=idx, nat=nat)
                    live_seq = [_in_pool(rows[n][_nat_column(nats[n], t_idx)], N) for n in range(n_seq)]
                    pool.allow_rows(rows[n][t] for n in range(n_seq) if live_seq[n]
                                    for t in range(min(t_idx, lengths[n])) if _in_pool(rows[n][t], N))
                    ctx += f", slots {rows}, num_accepted_tokens {nats}"
            ctx += ")"
            final, (ref_o, ref_final) = _run_generic(ctx, inputs, guards.values(), out, cu=cu, **kw)
            _assert_intact(ctx, **guards)
            if mode == "dense":
                _close(final, ref_final.float(), ctx, "final state", **GENERIC_STATE_TOL[FP32])
                for n in range(n_seq):
                    if not lengths[n]:  # no token: the final state is the initial one, exactly
                        assert torch.equal(final[n], init.t[n].float()), f"{ctx}: empty sequence {n} changed state"
            else:
                _close(pool.t.float(), ref_final.float(), ctx, "state pool", **GENERIC_STATE_TOL[BF16])
            if not monotonic:
                continue  # outputs unspecified; that they stayed in bounds is checked above
            live = torch.zeros(T_total, dtype=torch.bool)
            for n, (bos, eos) in enumerate(segs):
                for t in range(eos - bos):
                    live[bos + t] = live_seq[n] and (rows is None or (t < t_idx and _in_pool(rows[n][t], N)))
            _assert_zero(out.t[0, ~live.to(DEV)], ctx, "output of tokens no active sequence computes")
            _assert_output_close(out.t, ref_o, ctx)


def test_generic_dense_mode_keeps_its_tensors_in_bounds(activations):
    """Dense states have no device indices; the output's and the initial state's margins are checked all the same."""
    T = 4
    for i, seed in enumerate(_seeds(5000)):
        H, B = HEADS_AND_ROWS[i % 2]
        ctx = f"seed {seed} (B={B}, T={T}, H={H})"
        inputs = activations(B, T, H, seed)
        init = Guarded.copy_of(_random_rows(B, H, BF16, seed), row_pad=8)
        out = Guarded((B, T, H, K), BF16)
        out.allowed().fill_(True)
        final, (ref_o, ref_final) = _run_generic(ctx, inputs, (init, out), out, init=init, final=True)
        _assert_intact(ctx, initial_state=init, output=out)
        _assert_output_close(out.t, ref_o, ctx)
        _close(final, ref_final.float(), ctx, "final state", **GENERIC_STATE_TOL[FP32])


# ---------------------------------------------------------------------------------------------------------------
# ucache verify + flush

UCACHE_SHAPES = [(12, 8, 16), (8, 4, 32)]  # (H, T, w_ring)


def _fuzz_hist(rng: random.Random, cap: int) -> int:
    if rng.random() < 0.5:
        return rng.randint(0, cap)
    return rng.choice((-1, -7, INT_MIN, INT_MAX, cap + 1, cap + 9, 32, 33))


def _fuzz_base(rng: random.Random) -> int:
    u = rng.random()
    if u < 0.5:
        return rng.randint(0, 31)
    if u < 0.75:
        return rng.choice((32, 33, -1, -32, INT_MIN, INT_MAX))
    return rng.randint(INT_MIN, INT_MAX)


@pytest.mark.parametrize("restart", [False, True], ids=["verify", "restart"])
@pytest.mark.parametrize("H, T, w_ring", UCACHE_SHAPES, ids=[f"H{h}-T{t}-w{w}" for h, t, w in UCACHE_SHAPES])
def test_ucache_keeps_malformed_slots_and_cursors_in_bounds(H, T, w_ring, restart, activations):
    from kda_core.contracts import RING_SLOTS, default_flush_min, max_hist_len
    from kda_core.oracle import ucache_verify_flush_ref
    from kda_core.validation import validate_ucache
    from kda_cute.ucache import ucache_verify_flush

    B = 16
    cap, flush_min = max_hist_len(T, w_ring), default_flush_min(T, w_ring)
    for i, seed in enumerate(_seeds(6000)):
        rng = random.Random(seed)
        N = rng.choice(POOL_ROWS)
        slots = _fuzz_slots(rng, B, N, P_NULL[i % len(P_NULL)])
        hist = [_fuzz_hist(rng, cap) for _ in range(B)]
        bases = [_fuzz_base(rng) for _ in range(B)]
        ctx = f"seed {seed} (N={N}, slots {slots}, hist_len {hist}, cache_base {bases})"
        P = [min(max(h, 0), cap) for h in hist]
        base = [c & (RING_SLOTS - 1) for c in bases]
        active = [b for b in range(B) if _in_pool(slots[b], N)]
        flush = [b for b in active if P[b] >= flush_min]
        appends = {b: [(base[b] + P[b] + s) % RING_SLOTS for s in range(T)] for b in active}

        act = activations(B, T, H, seed)
        gen = torch.Generator(device=DEV).manual_seed(seed + 104729)
        pool = Guarded.copy_of(_random_rows(N, H, BF16, seed), row_pad=8)
        # Rings stale everywhere (inf / NaN: a read of a row outside the live window shows), then the live windows
        rings = {"k_cache": Guarded((N, H, RING_SLOTS, K), BF16, row_pad=64),
                 "u_cache": Guarded((N, H, RING_SLOTS, K), BF16, row_pad=64),
                 "g_cache": Guarded((N, H, RING_SLOTS, K), FP32, row_pad=64)}
        rings["k_cache"].t.fill_(float("inf"))
        rings["u_cache"].t.fill_(float("nan"))
        rings["g_cache"].t.fill_(float("nan"))
        for b in active:
            s, live = slots[b], [(base[b] + j) % RING_SLOTS for j in range(P[b])]
            if live:
                kk = torch.randn(H, P[b], K, generator=gen, device=DEV)
                rings["k_cache"].t[s][:, live] = (kk / kk.norm(dim=-1, keepdim=True)).to(BF16)
                rings["u_cache"].t[s][:, live] = torch.randn(H, P[b], K, generator=gen, device=DEV).to(BF16)
                steps = -0.5 * torch.rand(H, P[b], K, generator=gen, device=DEV)
                rings["g_cache"].t[s][:, live] = steps.cumsum(1)
            for ring in rings.values():
                ring.allowed()[s][:, appends[b]] = True
        idx, hist_len, cache_base = _int32(slots), _int32(hist), _int32(bases)
        out = Guarded((B, T, H, K), BF16)
        out.allowed().fill_(True)
        pool.allow_rows(slots[b] for b in flush)
        if restart:
            hist_len.allow_rows(flush)
            cache_base.allow_rows(flush)
        tensors = dict(initial_state_source=pool.t, initial_state_indices=idx.t, k_cache=rings["k_cache"].t,
                       u_cache=rings["u_cache"].t, g_cache=rings["g_cache"].t, hist_len=hist_len.t,
                       cache_base=cache_base.t)
        gate = (act["A_log"], act["g"], act["dt_bias"], act["lower_bound"])
        call = validate_ucache(*gate, q=act["q"], k=act["k"], v=act["v"], b=act["beta"], **tensors,
                               flush_min=flush_min, restart_hist_on_flush=restart, w_ring=w_ring, output=out.t,
                               device_kind="cuda")
        ref_tensors = {name: t.clone() for name, t in tensors.items()}
        ref_out = ucache_verify_flush_ref(*gate, q=act["q"], k=act["k"], v=act["v"], b=act["beta"], **ref_tensors,
                                          flush_min=flush_min, restart_hist_on_flush=restart, w_ring=w_ring,
                                          scale=call.scale, out_dtype=None)
        guards = dict(initial_state_source=pool, initial_state_indices=idx, hist_len=hist_len, cache_base=cache_base,
                      output=out, **rings)
        _snapshot(*guards.values())
        ucache_verify_flush(act["A_log"], act["g"], act["dt_bias"], act["lower_bound"], act["q"], act["k"], act["v"],
                            act["beta"], pool.t, idx.t, rings["k_cache"].t, rings["u_cache"].t, rings["g_cache"].t,
                            hist_len.t, cache_base.t, flush_min, w_ring, call.scale, out.t,
                            restart_hist_on_flush=restart, aligned=call.aligned)
        _sync(ctx)
        _assert_intact(ctx, **guards)

        _assert_zero(out.t[[b for b in range(B) if b not in active]], ctx, "output of inactive rows")
        assert bool(torch.isfinite(out.t.float()).all()), f"{ctx}: non-finite output (a stale ring row was read?)"
        _close(out.t.float(), ref_out, ctx, "output", **UCACHE_OUT_TOL)
        _close(pool.t.float(), ref_tensors["initial_state_source"].float(), ctx, "state pool", **UCACHE_STATE_TOL)
        for b in active:
            s, new = slots[b], appends[b]
            for name, tol in (("k_cache", UCACHE_RING_TOL), ("u_cache", UCACHE_RING_TOL), ("g_cache", UCACHE_G_TOL)):
                _close(rings[name].t[s][:, new].float(), ref_tensors[name][s][:, new].float(), ctx,
                       f"{name} appends of row {b}", **tol)
        # the cursors: the oracle's, and the agreed restart spelled out
        _close(hist_len.t, ref_tensors["hist_len"], ctx, "hist_len", atol=0, rtol=0)
        _close(cache_base.t, ref_tensors["cache_base"], ctx, "cache_base", atol=0, rtol=0)
        expect_hist = [0 if restart and b in flush else hist[b] for b in range(B)]
        expect_base = [(base[b] + P[b]) % RING_SLOTS if restart and b in flush else bases[b] for b in range(B)]
        got_hist, got_base = hist_len.t.tolist(), cache_base.t.tolist()
        assert got_hist == expect_hist, f"{ctx}: hist_len {got_hist}, expected {expect_hist}"
        assert got_base == expect_base, f"{ctx}: cache_base {got_base}, expected {expect_base}"
