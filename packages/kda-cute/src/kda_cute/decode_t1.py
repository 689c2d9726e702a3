"""T=1 KDA decode: one delta-rule step per (sequence, head) on a V-first state pool, in place.

Math: docs/design.md §3. Contracts: docs/design.md §2 and §4 (slots outside [0, N) are inactive: zero output, pool
neither read nor written; the check runs in the kernel against the pool's row count).

Work split. The state of one (slot, head) is [V=128 rows, K=128 channels], K contiguous. Once the
per-channel decay a[c], k^, q^ and b are known, every state row is independent:

    S'[v,:] = a * S[v,:];  p = S'[v,:].k^;  u = b (v[v] - p);  S_new[v,:] = S' + u k^
    o[v]    = S'[v,:].q^ + u (k^.q^)          (the fp32 S_new's dot with q^, regrouped)

so a CTA owns (batch row, head, tile of ``tile_v`` rows) and 128 threads. Each 16-lane half-warp
owns one row at a time; lane l holds channels [8l, 8l+8): one 16-byte load per row for a bf16 pool,
two for fp32. The two row dots are 16-lane xor butterflies. Half-warp w takes rows w, w+8, w+16, ...
of the tile, so at every step the CTA touches 8 consecutive rows (2 KB contiguous for bf16).

Latency decides small calls: the activation loads are issued before the slot index arrives, the state
rows as soon as it does, and the gate/normalisation preamble runs under the rows' load latency.
Memory-level parallelism decides large calls (a pure stream of the state): each thread issues the loads
of ``rows_in_flight`` of its rows before it uses any (or streams them through a shared-memory ring, ``bulk_ring``).
The state's loads and stores carry a cache hint: streaming (.cs, the state is touched once per step) by
default, ld.cg / st.wb where the schedule says so (the fp32 large-batch row, measured).

Variants (compile-time): pool dtype x gate mode x beta logit x l2norm x dt_bias present x g/beta dtypes x tile_v x
alignment (aligned; pool realigned: only the pool misaligned, any slot stride,
:meth:`KDADecodeT1.update_state_realigned`; element-wise) x rows in flight x cache hint x bulk ring (1-D bulk copies
through a shared-memory ring, tiles 32-128, aligned or pool-realigned; the schedule's large rows) x slot-major grid
x null-slot policy x index dtype x entry (batch rows, the packed GEMM rows, or the varlen form's tokens +
cu_seqlens). Batch, pool rows and the head count are runtime values (the head count only enters the grid and the
index math), so one compiled function serves every B and every H.

Schedule: :func:`select_config` (the measured table ``_SCHEDULE``) returns a :class:`DecodeT1Config`; the entries
take ``config=`` to run another one (benchmarks and tests sweep that way; serving leaves it None).
"""

import dataclasses
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, const_expr

from kda_core import knobs
from kda_core.contracts import HEAD_DIM, GateMode, NullSlotPolicy
from kda_core.errors import fail
from kda_core.validation import (
    WRAPPER_REJECTED,
    debug_check_slots,
    debug_checks_enabled,
    revalidate_decode_t1,
    revalidate_packed_decode_t1,
    revalidate_packed_tokens_decode_t1,
    validate_decode_t1,
    validate_packed_decode_t1,
    validate_packed_tokens_decode_t1,
)

from . import _bulk_ring, _lane_math, _launch

__all__ = ["DecodeT1Config", "select_config", "effective_config", "kda_decode_t1", "kda_decode_t1_packed",
           "KDADecodeT1", "KDADecodeT1Packed", "KDADecodeT1Varlen"]

THREADS = 128  # 8 half-warps of 16 lanes
HALF_WARP = 16
ROW_GROUPS = THREADS // HALF_WARP  # state rows a CTA touches per step
CHANNELS_PER_LANE = HEAD_DIM // HALF_WARP  # 8 -> one 16-byte bf16 vector
TILE_V_CHOICES = (8, 16, 32, 64, 128)
SMEM_MAX_BYTES = 48 * 1024  # the default dynamic shared-memory limit per CTA
ROW_REGS_IN_FLIGHT = 32  # default register budget for raw state rows in flight per thread (8 bf16 / 4 fp32 rows)
# Cache operators of the state's loads / stores: "stream" = ld.cs / st.cs (evict-first), "global" = ld.cg (L2
# only) / st.wb. (The plain ld.ca / st.wb measured no better than these on the H200 and was dropped.)
CACHE_HINTS = ("stream", "global")
# Bulk ring (``bulk_ring``): the state streams global -> shared -> global in chunks of BULK_CHUNK_ROWS rows (the rows
# the CTA touches per step: 2 KB bf16 / 4 KB fp32, contiguous) by 1-D cp.async.bulk, issued by one thread.
BULK_CHUNK_ROWS = ROW_GROUPS
BULK_RING_MAX = 16  # = the tile-128 state's chunks
BULK_TILES = (32, 64, 128)  # tiles of at least 4 chunks (a ring of >= 2 with refills)
# The pool-realigning ring's last row of a chunk reads its end vector, the next chunk's first, while its own chunk is
# updated, so the next chunk must already be loaded: issued no later than the previous step (depth >= 3).
REALIGNED_RING_MIN = 3


@dataclass(frozen=True)
class DecodeT1Config:
    """Schedule of one launch: state rows per CTA (the grid is (128 / tile_v, H, B)) and how rows are staged.

    :func:`select_config` returns one; ``kda_decode_t1(..., config=...)`` runs another (sweeps, tests). A requested
    config is fitted to the call by :func:`effective_config` (a ring or a slot-major grid the call's layout cannot
    take is dropped), so any legal config runs on any call.

    ``rows_in_flight``: each thread keeps that many rows in registers before it uses any (0 = as many as
    ``ROW_REGS_IN_FLIGHT`` registers hold; capped at its rows of the tile). ``cache_hint``: one of ``CACHE_HINTS``.

    ``bulk_ring`` (0 = off): ring depth, in chunks of ``BULK_CHUNK_ROWS`` rows, of a shared-memory ring that one thread
    fills with 1-D bulk loads (cp.async.bulk + mbarrier) and drains with bulk stores; the threads update each chunk in
    place in shared memory. Only tiles 32-128 of the aligned and the pool-realigning variants (see
    :func:`bulk_ring_for`); it replaces the other staging options; the table uses it for the large rows of both pool
    dtypes (docs/decode_t1.md, "Bulk ring"; the realigning one: "Pool realigning ring").

    ``slot_major``: the grid walks the pool's rows instead of the batch's (docs/decode_t1.md, "Slot-major grid"): CTA z
    of a head streams pool row z for the batch row that names it, so the state is visited in address order whatever
    the order of ``slot_indices``; tile 128, aligned only (see :func:`slot_major_for`).
    """

    tile_v: int
    rows_in_flight: int = 0
    cache_hint: str = "stream"
    bulk_ring: int = 0
    slot_major: bool = False

    def __post_init__(self):
        if self.tile_v not in TILE_V_CHOICES:
            fail("config.tile_v", f"one of {TILE_V_CHOICES}", self.tile_v)
        if not isinstance(self.rows_in_flight, int) or self.rows_in_flight < 0:
            fail("config.rows_in_flight", "an integer >= 0", self.rows_in_flight)
        if self.cache_hint not in CACHE_HINTS:
            fail("config.cache_hint", f"one of {CACHE_HINTS}", self.cache_hint)
        if self.bulk_ring and not 2 <= self.bulk_ring <= BULK_RING_MAX:
            fail("config.bulk_ring", f"0 or an integer in [2, {BULK_RING_MAX}]", self.bulk_ring)


# Schedule table: per pool dtype, rows (max B*H states, config), the last unbounded. Small calls are latency-bound
# (small tiles, just enough CTAs for 132 SMs), large ones bandwidth-bound (tile 128, the bulk ring). A ring row
# keeps its register-path fields for the calls the ring cannot take (unaligned: see effective_config).
# Measured: H200, 2026-11-29 to 12-01, bench_packed_kda_decode.py --tile-v/--rows-in-flight/--cache-hint/--bulk-ring
# sweeps, H=12, CUDA graphs (the points: docs/decode_t1.md, "Schedule"). The bf16 ring row's register fields (16
# rows in flight) serve the calls without a ring, the pool-realigning variant on a `+17` slot stride: H200,
# 2026-12-02, vLLM K3's packed call, rows in flight 2 / 4 / 8 / 16 at B = 64, 256, 512 (H=12): 16 fastest at each,
# 2-8% under 8 (docs/decode_t1.md, "Pool realigning variant").
_SCHEDULE = {
    torch.bfloat16: ((12, DecodeT1Config(16)), (24, DecodeT1Config(32)), (48, DecodeT1Config(16)),
                     (96, DecodeT1Config(32)), (384, DecodeT1Config(64)),
                     (1 << 62, DecodeT1Config(128, rows_in_flight=16, bulk_ring=8))),
    torch.float32: ((48, DecodeT1Config(16)), (96, DecodeT1Config(32)), (287, DecodeT1Config(64)),
                    (1 << 62, DecodeT1Config(128, rows_in_flight=16, cache_hint="global", bulk_ring=8))),
}

# The pool-realigning variant (any slot stride) runs the ring rows on its own ring (update_state_realigned_ring), with
# both pool dtypes and in the varlen form too. Measured against those rows' register fields: H200, 2026-12-06, vLLM K3's
# packed call (lower-bound gate) on a `+17` pool, H=12, CUDA graphs, one process (docs/decode_t1.md, "Pool realigning
# ring"): bf16 ring 34.05 / 64.16 / 121.1 us against 35.55 / 67.46 / 134.6 on the register path at B = 128 / 256 /
# 512, a tie at B = 64 (16.96 / 16.90); fp32 (H100, same call) 39.07 / 285.6 against 43.94 / 300.9 at B = 64 / 512;
# vLLM Kimi-Linear's [1, N] + cu_seqlens call, fp32, ring 41.19 / 292.4 us against 42.72 / 298.2 at B = 64 / 512
# (H100). Outputs and pool bitwise the register path's in every case.

# Slot-major grid, taken by the ring rows from SLOT_MAJOR_MIN_STATES (B*H) on when the pool has at most
# SLOT_MAJOR_MAX_POOL_PER_ROW rows per batch row. Measured: H200, 2026-12-01, bench_packed_kda_decode.py --slot-major
# off on --pool-factor 1 1.25 1.5 2, H=12, CUDA graphs, permuted slots (docs/decode_t1.md, "Slot-major grid").
SLOT_MAJOR_MIN_STATES = {torch.bfloat16: 3840, torch.float32: 3072}
SLOT_MAJOR_MAX_POOL_PER_ROW = 1.25
GRID_Z_MAX = 65535  # CUDA's limit on gridDim.z
SCAN_UNROLL = 8  # slot indices each thread of a slot-major CTA loads at once (1024 rows per pass of the CTA)

# The varlen form's token loop (the exact fallback for a sequence of length != 1) runs a thread's state rows unrolled
# (one copy of the body per row) except for the builds this set names, by (gate mode, pool bits, tile_v), which run
# them rolled (one copy). The loop is the varlen kernel's register peak, so it sets the one-token path's residency, and
# the one-token path's schedule moves with it. Measured: H100 80GB HBM3, 2026-12-07, vLLM Kimi-Linear's [1, N] +
# cu_seqlens call on its `+17` pool (precomputed gate), H = 12, CUDA graphs, one process, unrolled -> rolled, us
# (docs/decode_t1.md, "Varlen form"): fp32 tile 32 (B = 8) 4.69 -> 4.48, the fp32 ring (tile 128) 40.7 -> 39.2 at B = 64
# (74 registers against 88: 6 CTAs per SM, as the plain call), level from B = 256; bf16 tile 32 (B = 8) 3.84 -> 3.60.
# Rolled was slower at tile 16 (fp32 2.38 -> 2.59 at B = 1, bf16 2.56 -> 2.62), bf16 tile 64 and the bf16 ring (1-2%).
# The lower-bound gate's bf16 ring build is rolled because unrolled it spills (64 bytes on sm_90a, 704 on sm_100a;
# ptxas), not timed.
TOKEN_LOOP_ROLLED = {(GateMode.PRECOMPUTED, 32, 32), (GateMode.PRECOMPUTED, 32, 128), (GateMode.PRECOMPUTED, 16, 32),
                     (GateMode.LOWER_BOUND, 16, 128)}


def slot_major_compiles(tile_v: int, aligned: bool) -> bool:
    """The slot-major grid's compile-time conditions: tile 128 (a CTA owns its head's whole state and output row)
    and the aligned variant (16-byte zero stores of the rows it answers for)."""
    return tile_v == HEAD_DIM and bool(aligned)


def slot_major_for(tile_v: int, aligned: bool, B: int, N: int | None, requested: bool) -> bool:
    """Whether a slot-major grid may run: requested, :func:`slot_major_compiles`, and a grid of N + ceil(B / 128)
    CTAs per head within CUDA's gridDim.z."""
    return bool(requested and slot_major_compiles(tile_v, aligned) and N is not None
                and N + -(-B // THREADS) <= GRID_Z_MAX)


def select_config(B: int, H: int, state_dtype: torch.dtype, aligned: bool, N: int | None = None,
                  realign: bool = False) -> DecodeT1Config:
    """The schedule policy: the ``_SCHEDULE`` row of B*H states, fitted to the call (:func:`effective_config`).

    ``KDA_DECODE_TILE_V`` (if non-zero) forces the tile. ``N``: pool rows (None: the slot-major grid is not
    considered). ``realign``: the call runs the pool-realigning variant (``aligned`` False), whose ring rows take its
    own ring."""
    states = B * H
    cfg = next(c for limit, c in _SCHEDULE[state_dtype] if states <= limit)
    forced = knobs.get("KDA_DECODE_TILE_V")
    if forced:
        if forced not in TILE_V_CHOICES:
            fail("KDA_DECODE_TILE_V", f"one of {TILE_V_CHOICES}", forced)
        cfg = dataclasses.replace(cfg, tile_v=forced)
    ring = bulk_ring_for(cfg.tile_v, state_dtype.itemsize, aligned, cfg.bulk_ring)
    slot_major = (bool(ring) and states >= SLOT_MAJOR_MIN_STATES[state_dtype] and N is not None
                  and N <= SLOT_MAJOR_MAX_POOL_PER_ROW * B)
    return effective_config(dataclasses.replace(cfg, slot_major=slot_major), B, state_dtype, aligned, N, realign)


def effective_config(config: DecodeT1Config, B: int, state_dtype: torch.dtype, aligned: bool,
                     N: int | None = None, realign: bool = False) -> DecodeT1Config:
    """What ``config`` runs as on a call of B rows, this pool dtype and alignment class and N pool rows.

    The ring only where :func:`bulk_ring_for` gives one (it then replaces rows in flight and the cache hint, which
    read as 0 and "stream"; ``realign``: the pool-realigning variant's ring); the slot-major grid only where
    :func:`slot_major_for` allows it. Every other field is kept as requested."""
    ring = bulk_ring_for(config.tile_v, state_dtype.itemsize, aligned, config.bulk_ring, realigned=realign)
    fields = dict(bulk_ring=ring, slot_major=slot_major_for(config.tile_v, aligned, B, N, config.slot_major))
    if ring:
        fields.update(rows_in_flight=0, cache_hint="stream")
    return dataclasses.replace(config, **fields)


def bulk_ring_for(tile_v: int, state_bytes: int, aligned: bool, requested: int, realigned: bool = False) -> int:
    """Effective bulk-ring depth (0 = off). ``requested`` must be 0 or in [2, ``BULK_RING_MAX``] (the ring refills
    the previous chunk's slot, so one slot cannot work). Only the aligned (16-byte) variants of a bf16 / fp32 pool with
    a tile in ``BULK_TILES`` have one (a tile's rows are one contiguous run of the state); the depth is capped at the
    tile's chunks (tile 64: 8, tile 32: 4) and at the default 48 KB of dynamic shared memory (fp32: 11 chunks).
    ``realigned``: the pool-realigning variant's ring (any slot stride; ``aligned`` is then ignored), which reads the
    next chunk while it updates one, so it needs a depth of at least ``REALIGNED_RING_MIN`` (else 0)."""
    if requested and not 2 <= requested <= BULK_RING_MAX:
        fail("bulk_ring", f"0 or an integer in [2, {BULK_RING_MAX}]", requested)
    if not requested or tile_v not in BULK_TILES or not (aligned or realigned) or state_bytes not in (2, 4):
        return 0
    chunk_bytes = BULK_CHUNK_ROWS * HEAD_DIM * state_bytes
    depth = min(requested, tile_v // BULK_CHUNK_ROWS, (SMEM_MAX_BYTES - 1024) // chunk_bytes)
    return 0 if realigned and depth < REALIGNED_RING_MIN else depth


# --------------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------------


_LOAD_MODES = {"stream": cute.nvgpu.LoadCacheMode.STREAMING, "global": cute.nvgpu.LoadCacheMode.GLOBAL}
_STORE_MODES = {"stream": cute.nvgpu.StoreCacheMode.STREAMING, "global": cute.nvgpu.StoreCacheMode.WRITE_BACK}


def rows_in_flight_for(tile_v: int, state_bytes: int, requested: int = 0) -> int:
    """Rows each thread keeps in flight: ``requested`` (0 = ``ROW_REGS_IN_FLIGHT`` registers' worth), capped
    at the thread's rows of the tile."""
    rows = tile_v // ROW_GROUPS
    row_regs = CHANNELS_PER_LANE * state_bytes // 4
    return min(rows, requested or max(ROW_REGS_IN_FLIGHT // row_regs, 1))


@cute.jit
def half_warp_sum(x):
    for shift in cutlass.range_constexpr(4):  # xor 8, 4, 2, 1 stays inside the 16-lane half
        x = x + cute.arch.shuffle_sync_bfly(x, offset=8 >> shift)
    return x

class KDADecodeT1:
    """Compile-time configuration of one T=1 decode variant (quack style)."""

    def __init__(
        self,
        *,
        state_dtype,
        gate: GateMode,
        beta_is_logit: bool,
        use_qk_l2norm: bool,
        has_dt_bias: bool,
        tile_v: int,
        aligned: bool,
        rows_in_flight: int = 0,
        cache_hint: str = "stream",
        bulk_ring: int = 0,
        slot_major: bool = False,
        null_policy: NullSlotPolicy = NullSlotPolicy.OUT_OF_RANGE,
        index_dtype=Int32,
        varlen: bool = False,
        realign_pool: bool = False,
    ):
        self.state_dtype = state_dtype
        self.gate = gate
        self.beta_is_logit = beta_is_logit
        self.use_qk_l2norm = use_qk_l2norm
        self.has_dt_bias = has_dt_bias
        self.tile_v = tile_v
        self.aligned = aligned
        # Pool-realigning variant: the pool read in aligned vectors whatever its pointer and slot stride
        # (update_state_realigned); ``aligned`` is then the other tensors' class. The ring and the slot-major grid
        # need an aligned pool.
        self.realign_pool = bool(realign_pool)
        pool_aligned = bool(aligned) and not self.realign_pool
        self.rows = tile_v // ROW_GROUPS
        self.rows_in_flight = rows_in_flight_for(tile_v, state_dtype.width // 8, rows_in_flight)
        self.load_hints = dict(load_cache_mode=_LOAD_MODES[cache_hint])
        self.store_hints = dict(store_cache_mode=_STORE_MODES[cache_hint])
        self.bulk_ring = bulk_ring_for(tile_v, state_dtype.width // 8, pool_aligned, bulk_ring,
                                       realigned=self.realign_pool)
        # bf16 pool-realigning register path: a thread owns a block of consecutive rows (see issue_realigned_row);
        # the realigning ring keeps the interleaved rows of its chunks.
        self.tail_vectors = self.realign_pool and state_dtype.width == 16 and not self.bulk_ring
        self.slot_major = bool(slot_major) and slot_major_compiles(tile_v, pool_aligned)
        self.null_policy = NullSlotPolicy(null_policy)
        self.index64 = index_dtype is Int64  # int64 slot indices: compared with N (and pool rows) in 64 bits
        # Varlen: tokens [1, T, H, K] + cu_seqlens [S + 1], one CTA row per sequence; never slot-major.
        self.varlen = bool(varlen)
        if self.varlen:
            self.slot_major = False

    def idx(self, x):
        """``x`` (a pool-row count or row number, Int32) in the slot indices' width, for comparing with them."""
        return Int64(x) if self.index64 else x

    def live(self, idx, n_slots):
        """Whether pool index ``idx`` is a slot under the null policy (compile-time: one compare each side), i.e. its
        row is active. OUT_OF_RANGE: 0 <= idx < N; NONPOSITIVE: 0 < idx < N (slot 0 is never read or written)."""
        low = idx > 0 if self.null_policy is NullSlotPolicy.NONPOSITIVE else idx >= 0
        return low & (idx < n_slots)

    def null(self, idx, n_slots):
        """``not live(idx, n_slots)``, spelled as the two compares."""
        low = idx <= 0 if self.null_policy is NullSlotPolicy.NONPOSITIVE else idx < 0
        return low | (idx >= n_slots)

    def _copy_bits(self, dtype, n: int) -> int:
        return min(n * dtype.width, 128) if self.aligned else dtype.width

    def _state_copy_bits(self) -> int:
        """Bits per access of a lane's 8 state channels on the row-at-a-time paths (the varlen token loop): the pool
        realigning variant's pool is read element-wise there."""
        if self.realign_pool:
            return self.state_dtype.width
        return self._copy_bits(self.state_dtype, CHANNELS_PER_LANE)

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [B, 1, H, K]
        mK: cute.Tensor,  # [B, 1, H, K]
        mV: cute.Tensor,  # [B, 1, H, V]
        mG: cute.Tensor,  # [B, 1, H, K]
        mBeta: cute.Tensor,  # [B, 1, H]
        mALog,  # [H] fp32, or None (precomputed gate)
        mDtBias,  # [H*K] fp32, or None
        mState: cute.Tensor,  # [N, H, V, K]
        mSlot: cute.Tensor,  # [B] int32 or int64, any stride
        mOut: cute.Tensor,  # [B, 1, H, V]
        scale: Float32,
        lower_bound: Float32,
        stream,
    ):
        self.launch(mQ, mK, mV, mG, mBeta, mALog, mDtBias, mState, mSlot, None, mOut, scale, lower_bound, stream)

    @cute.jit
    def launch(self, mQ, mK, mV, mG, mBeta, mALog, mDtBias, mState, mSlot, mCu, mOut, scale: Float32,
               lower_bound: Float32, stream):
        """The launch of both entries: q, k, v, g, output [rows, 1, H, 128] and beta [rows, 1, H], one row per batch
        row (or, varlen, per token: ``mCu`` [S + 1] then gives each of the S sequences its tokens)."""
        B = cute.size(mQ, mode=[0])
        H = cute.size(mQ, mode=[2])
        occupancy = {}
        if const_expr(self.bulk_ring):
            # The ring is the bytes in flight: take the largest shared-memory carveout so that the resident CTAs
            # (128 threads each, few registers: no row is held in registers) are not capped by it.
            occupancy = dict(preferred_smem_carveout=100)
        # Slot-major: one CTA per pool row and head, then ceil(B / 128) per head that answer for the batch rows whose
        # slot is outside [0, N) (zero output); else one per batch row and head.
        # Varlen: one per sequence and head.
        rows = cute.size(mState, mode=[0]) + (B + THREADS - 1) // THREADS if const_expr(self.slot_major) else B
        if const_expr(self.varlen):
            rows = cute.size(mSlot, mode=[0])
        self.kernel(mQ, mK, mV, mG, mBeta, mALog, mDtBias, mState, mSlot, mCu, mOut, scale, lower_bound).launch(
            grid=[HEAD_DIM // self.tile_v, H, rows], block=[THREADS, 1, 1], stream=stream, **occupancy
        )

    @cute.jit
    def load_lane_vector(self, row: cute.Tensor, lane, dtype):
        """Issue the load of the lane's 8 channels of a [K] row; the registers are read later."""
        frag = cute.make_rmem_tensor((CHANNELS_PER_LANE,), dtype)
        bits = self._copy_bits(dtype, CHANNELS_PER_LANE)
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=bits)
        vec = (bits // dtype.width,)
        src = cute.local_tile(row, (CHANNELS_PER_LANE,), (lane,))
        cute.copy(atom, cute.logical_divide(src, vec), cute.logical_divide(frag, vec))
        return frag

    @cute.jit
    def bulk_ring_step(self, j: cutlass.Constexpr, n_chunks: cutlass.Constexpr, s2r_atom, s_new, s_vec, smem_views,
                       s_slots, g_chunks, full, bulk_load, bulk_store, chunk_bytes: cutlass.Constexpr, tidx):
        """Chunk ``j`` of the bulk ring after the threads computed their rows of it: write S_new back into the slot,
        then :func:`kda_cute._bulk_ring.store_and_refill` (bulk-store the slot, refill the previous chunk's)."""
        cute.copy(s2r_atom, cute.logical_divide(s_new, (s_vec,)), smem_views[j % self.bulk_ring])
        _bulk_ring.store_and_refill(j, self.bulk_ring, n_chunks, full, s_slots, g_chunks, bulk_load, bulk_store,
                                    chunk_bytes, tidx)

    @cute.jit
    def find_row(self, mSlot: cute.Tensor, z, B, tidx, sScan: cute.Tensor):
        """(first, last): the smallest and the largest batch row whose slot is ``z`` (B and -1 when none), the same in
        every thread. Each thread loads ``SCAN_UNROLL`` slots per pass (clamped to row B - 1, so every load is in
        bounds and none waits on a branch), then a warp ``redux`` and a CTA barrier."""
        first = B
        last = Int32(-1)
        for o in cutlass.range((B + THREADS * SCAN_UNROLL - 1) // (THREADS * SCAN_UNROLL)):
            found = [mSlot[cutlass.min(o * THREADS * SCAN_UNROLL + i * THREADS + tidx, B - 1)]
                     for i in range(SCAN_UNROLL)]
            for i in cutlass.range_constexpr(SCAN_UNROLL):
                row = o * THREADS * SCAN_UNROLL + i * THREADS + tidx
                hit = (row < B) & (found[i] == self.idx(z))
                first = cutlass.min(first, cutlass.select_(hit, row, B))
                last = cutlass.max(last, cutlass.select_(hit, row, Int32(-1)))
        first = cute.arch.warp_redux_sync(first, "min")
        last = cute.arch.warp_redux_sync(last, "max")
        warp = tidx // 32
        if tidx % 32 == 0:
            sScan[0, warp] = first
            sScan[1, warp] = last
        cute.arch.sync_threads()
        for w in cutlass.range_constexpr(THREADS // 32):  # this warp's own value among them
            first = cutlass.min(first, sScan[0, w])
            last = cutlass.max(last, sScan[1, w])
        return first, last

    @cute.jit
    def zero_output_row(self, mOut: cute.Tensor, row, h):
        """Output row (``row``, head ``h``) <- 0 by one thread: 16 stores of 16 bytes (aligned variant)."""
        frag = cute.make_rmem_tensor((CHANNELS_PER_LANE,), mOut.element_type)
        frag.fill(0.0)
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), mOut.element_type,
                                   num_bits_per_copy=CHANNELS_PER_LANE * mOut.element_type.width)
        for c in cutlass.range_constexpr(HALF_WARP):
            dst = cute.local_tile(mOut[row, 0, h, None], (CHANNELS_PER_LANE,), (c,))
            cute.copy(atom, cute.logical_divide(frag, (CHANNELS_PER_LANE,)),
                      cute.logical_divide(dst, (CHANNELS_PER_LANE,)))

    @cute.jit
    def answer_other_rows(self, mSlot: cute.Tensor, mOut: cute.Tensor, z, h, n_slots, first, last, tidx):
        """Slot-major grid: the zero outputs that no pool-row CTA writes, one batch row per thread. A pool-row CTA
        whose slot several batch rows name (a caller error) streams the state for the first of them and gives the
        others zero output; the CTAs past the pool rows give zero output to the batch rows whose slot is null (outside
        [0, N), or [1, N) under NONPOSITIVE), 128 rows each. Under NONPOSITIVE the CTA of pool row 0 owns no row."""
        B = cute.size(mOut, mode=[0])
        if self.live(z, n_slots) & (last != first):
            for o in cutlass.range((B + THREADS - 1) // THREADS):
                row = o * THREADS + tidx
                if (row < B) & (row != first):
                    if mSlot[row] == self.idx(z):
                        self.zero_output_row(mOut, row, h)
        if z >= n_slots:
            row = (z - n_slots) * THREADS + tidx
            found = mSlot[cutlass.min(row, B - 1)]
            if (row < B) & self.null(found, self.idx(n_slots)):
                self.zero_output_row(mOut, row, h)

    def allocate_ring(self, smem):
        """(ring [slot, row of the chunk, channel], its mbarriers) in shared memory, or (None, None) without a bulk
        ring. The pool-realigning ring's slots are followed by its stage (:meth:`ring_stage`). Traced inline."""
        if const_expr(not self.bulk_ring):
            return None, None
        chunk_elems = BULK_CHUNK_ROWS * HEAD_DIM
        stage_elems = (2 * ROW_GROUPS + 1) * (128 // self.state_dtype.width) if const_expr(self.realign_pool) else 0
        flat = smem.allocate_tensor(self.state_dtype, cute.make_layout((self.bulk_ring * chunk_elems + stage_elems,)),
                                    byte_alignment=128)
        sRing = cute.make_tensor(flat.iterator, cute.make_layout((self.bulk_ring, BULK_CHUNK_ROWS, HEAD_DIM),
                                                                 stride=(chunk_elems, HEAD_DIM, 1)))
        sFull = smem.allocate_tensor(Int64, cute.make_layout((self.bulk_ring,)), byte_alignment=8)  # mbarriers
        return sRing, sFull

    def ring_stage(self, sRing):
        """(stage, ends): the pool-realigning ring's shared memory after its slots. ``stage``: [2 step parities, 8 row
        groups] 16-byte vectors, where each row's lane 0 leaves its first vector for the row after it; ``ends``: one
        vector, the run's end (:meth:`update_state_realigned_ring`). Traced inline."""
        vec = 128 // self.state_dtype.width
        base = sRing.iterator + self.bulk_ring * BULK_CHUNK_ROWS * HEAD_DIM
        stage = cute.make_tensor(base, cute.make_layout((2, ROW_GROUPS, vec), stride=(ROW_GROUPS * vec, vec, 1)))
        return stage, cute.make_tensor(base + 2 * ROW_GROUPS * vec, cute.make_layout((vec,)))

    def state_row(self, row0, group, j: int):
        """State row of a thread's row ``j`` (row group ``group`` of the tile from ``row0``): ``row0 + group + 8 j``,
        except in the bf16 pool-realigning variant, whose threads own blocks of consecutive rows (``row0 +
        group * rows + j``: see :meth:`update_state_realigned`). Plain Python, traced inline."""
        if const_expr(self.tail_vectors):
            return row0 + group * self.rows + j
        return row0 + group + j * ROW_GROUPS

    def load_token(self, mQ, mK, mV, mG, mBeta, mALog, mDtBias, b, h, lane, rows):
        """Issue the loads of token (batch row) ``b``'s activations for head ``h`` and this lane: k, q, g channels
        [8 lane, 8 lane + 8), v of the state rows ``rows`` (a list), beta, and A_log / dt_bias for the in-kernel
        gate; the registers are read later (:meth:`prepare_token`). Plain Python, traced inline (its loops unroll at
        trace time like ``range_constexpr``)."""
        k_raw = self.load_lane_vector(mK[b, 0, h, None], lane, mK.element_type)
        q_raw = self.load_lane_vector(mQ[b, 0, h, None], lane, mQ.element_type)
        g_raw = self.load_lane_vector(mG[b, 0, h, None], lane, mG.element_type)
        v_raw = cute.make_rmem_tensor((len(rows),), mV.element_type)
        for j in range(len(rows)):
            v_raw[j] = mV[b, 0, h, rows[j]]
        beta_raw = mBeta[b, 0, h]
        a_log = bias_raw = None
        if const_expr(self.gate != GateMode.PRECOMPUTED):
            a_log = mALog[h]
            if const_expr(self.has_dt_bias):
                bias_raw = self.load_lane_vector(cute.local_tile(mDtBias, (HEAD_DIM,), (h,)), lane, Float32)
        return k_raw, q_raw, g_raw, v_raw, beta_raw, a_log, bias_raw

    def prepare_token(self, token, scale, lower_bound, gate=None):
        """(k^, q^, decay, beta, k^.q^) of a :meth:`load_token` result: this lane's channels (docs/design.md §3
        steps 1-5). ``gate``: the token's :meth:`prepare_gate`, when a :meth:`complete_token` already computed it
        (None: computed here). Traced inline."""
        k_raw, q_raw = token[0], token[1]
        kf = self.to_f32(k_raw)
        qf = self.to_f32(q_raw)
        decay, beta = self.prepare_gate(token, lower_bound) if gate is None else gate
        kq = _lane_math.normalize_qk(kf, qf, scale, self.use_qk_l2norm, half_warp_sum)
        return kf, qf, decay, beta, kq

    def prepare_gate(self, token, lower_bound):
        """(decay, beta) of a token: this lane's 8 channel decays and the row's beta (docs/design.md §3 steps 2-3);
        needs only the token's gate, beta and gate parameters. Traced inline."""
        _, _, g_raw, _, beta_raw, a_log, bias_raw = token
        gf = self.to_f32(g_raw)
        beta = beta_raw.to(Float32)
        if const_expr(self.beta_is_logit):
            beta = 1.0 / (1.0 + cute.math.exp(-beta))

        decay = cute.make_rmem_tensor((CHANNELS_PER_LANE,), Float32)
        rate = Float32(0.0)
        if const_expr(self.gate != GateMode.PRECOMPUTED):
            rate = cute.math.exp(a_log)
            if const_expr(self.has_dt_bias):  # added up front: all 8 adds issue before the first exp
                for c in range(CHANNELS_PER_LANE):
                    gf[c] = gf[c] + bias_raw[c]
        _lane_math.gate_decay(decay, gf, gf, rate, lower_bound, self.gate, False)
        return decay, beta

    def row_step(self, sf, decay, kf, qf, beta, v_raw):
        """One delta-rule step of the fp32 state row ``sf`` (this lane's 8 channels), in place: S' = a S; p = S'.k^;
        u = beta (v - p); S_new = S' + u k^. Returns (S'.q^, u): the row's output is S'.q^ + u (k^.q^)."""
        p = Float32(0.0)
        sq = Float32(0.0)
        for c in range(CHANNELS_PER_LANE):
            sf[c] = sf[c] * decay[c]
            p = p + sf[c] * kf[c]
            sq = sq + sf[c] * qf[c]
        p = half_warp_sum(p)
        sq = half_warp_sum(sq)
        u = beta * (v_raw.to(Float32) - p)
        for c in range(CHANNELS_PER_LANE):
            sf[c] = sf[c] + u * kf[c]
        return sq, u

    @cute.jit
    def to_f32(self, frag: cute.Tensor):
        out = cute.make_rmem_tensor((CHANNELS_PER_LANE,), Float32)
        out.store(frag.load().to(Float32))
        return out

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mALog,
        mDtBias,
        mState: cute.Tensor,
        mSlot: cute.Tensor,
        mCu,  # [S + 1] int32 / int64 sequence offsets (varlen), or None
        mOut: cute.Tensor,
        scale: Float32,
        lower_bound: Float32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        v_tile, h, z = cute.arch.block_idx()
        lane = tidx % HALF_WARP
        group = tidx // HALF_WARP
        n_slots = cute.size(mState, mode=[0])
        if const_expr(self.bulk_ring or self.slot_major):
            smem = cutlass.memory.SmemAllocator()
        if const_expr(self.slot_major):
            # CTA z streams pool row z (z < N; not 0 under NONPOSITIVE) for the first batch row naming it; the CTAs past
            # the pool rows have no state (active is False there even if a row names slot z >= N: that row is
            # inactive).
            sScan = smem.allocate_tensor(Int32, cute.make_layout((2, THREADS // 32), stride=(THREADS // 32, 1)),
                                         byte_alignment=16)
            B = cute.size(mQ, mode=[0])
            first, last = self.find_row(mSlot, z, B, tidx, sScan)
            active = (first < B) & self.live(z, n_slots)
            b = cutlass.min(first, B - 1)  # a CTA without a row loads row B - 1's activations and ignores them
            slot = z
        elif const_expr(self.varlen):
            # Sequence z owns tokens [bos, bos + seq_len): the offsets clamped to [0, T] and the end to >= the start,
            # in 64 bits before narrowing (docs/design.md §4, as the generic kernel). The fast path is a sequence of
            # one token (T=1 decode); any other length runs the token loop, and a null one zeroes its outputs.
            T = cute.size(mQ, mode=[0])
            t_total64 = Int64(T)
            bos64 = cutlass.min(cutlass.max(Int64(mCu[z]), Int64(0)), t_total64)
            eos64 = cutlass.min(cutlass.max(Int64(mCu[z + 1]), bos64), t_total64)
            bos = Int32(bos64)
            seq_len = Int32(eos64 - bos64)
            b = cutlass.min(bos, T - 1)  # the token whose activations are loaded early (T >= 1: the host checks)
            slot = mSlot[z]
            live = self.live(slot, self.idx(n_slots))
            active = live & (seq_len == 1)
        else:
            b = z
            slot = mSlot[b]
            active = self.live(slot, self.idx(n_slots))
        row0 = v_tile * self.tile_v
        sRing, sFull = self.allocate_ring(smem if const_expr(self.bulk_ring) else None)

        # ---- issue every activation load before the slot is known: the slot -> state chain is the
        # critical path, and these loads (and the gate math below) hide under it ------------------
        token = self.load_token(mQ, mK, mV, mG, mBeta, mALog, mDtBias, b, h, lane,
                                [self.state_row(row0, group, j) for j in range(self.rows)])

        # Varlen: the edge tokens' zeros (zero_edge_tokens) go before the state stream with a bf16 pool and after it
        # with fp32, each the order measured faster (docs/decode_t1.md, "Varlen form"): kept live across the bf16
        # stream, their bounds cost the pool-realigning build 40 registers (182 against 142); written first, vLLM
        # Kimi-Linear's call took 8-19% less time at B >= 64 with bf16 and 2-8% more with fp32.
        edges_first = const_expr(self.varlen and self.state_dtype.width == 16)
        if const_expr(edges_first):
            self.zero_edge_tokens(mOut, mCu, z, bos, seq_len, T, h, row0, group, lane)
        if active:
            # ---- then the state rows: they are the whole cost of this kernel -------------------------
            self.update_state(mState, slot, h, row0, group, lane, tidx, token, scale, lower_bound, sRing, sFull, mOut,
                              b, None)
        else:
            if const_expr(self.varlen):
                if live & (seq_len > 1):
                    self.token_loop(mQ, mK, mV, mG, mBeta, mALog, mDtBias, mState, mOut, slot, h, bos, seq_len, row0,
                                    group, lane, scale, lower_bound)
                else:  # a null sequence (any length) or an empty one
                    self.zero_tokens(mOut, bos, bos + seq_len, h, row0, group, lane)
            elif const_expr(not self.slot_major):  # slot-major: answer_other_rows gives the zero outputs
                if lane == 0:
                    for j in cutlass.range_constexpr(self.rows):
                        mOut[b, 0, h, row0 + group + j * ROW_GROUPS] = Float32(0.0).to(mOut.element_type)
        if const_expr(self.slot_major):
            self.answer_other_rows(mSlot, mOut, z, h, n_slots, first, last, tidx)
        if const_expr(self.varlen and not edges_first):
            self.zero_edge_tokens(mOut, mCu, z, bos, seq_len, T, h, row0, group, lane)

    @cute.jit
    def zero_edge_tokens(self, mOut: cute.Tensor, mCu: cute.Tensor, z, bos, seq_len, T, h, row0, group, lane):
        """Varlen: tokens before the first sequence's clamped start and from the last one's clamped end get a zero
        output (as the oracle); both ranges lie in [0, T) and outside every sequence's tokens."""
        if z == 0:
            self.zero_tokens(mOut, Int32(0), bos, h, row0, group, lane)
        if z == cute.size(mCu, mode=[0]) - 2:
            self.zero_tokens(mOut, bos + seq_len, T, h, row0, group, lane)

    @cute.jit
    def update_state(self, mState: cute.Tensor, slot, h, row0, group, lane, tidx, token, scale: Float32,
                     lower_bound: Float32, sRing, sFull, mOut, b, ctx):
        """The state stream of an active row: issue this thread's state rows (or fill the bulk ring), finish the
        token (:meth:`complete_token`, under the rows' latency), run its preamble, update each row in place and hand
        each row's output to :meth:`emit_row`. ``sRing`` / ``sFull``: the ring and its mbarriers (None without a
        ring); ``ctx``: what a subclass's :meth:`complete_token` needs (None here). The pool-realigning variant
        streams through :meth:`update_state_realigned` (its ring: :meth:`update_state_realigned_ring`), every other
        one through :meth:`update_state_vectors`."""
        if const_expr(self.realign_pool and self.bulk_ring):
            self.update_state_realigned_ring(mState, slot, h, row0, group, lane, tidx, token, scale, lower_bound,
                                             sRing, sFull, mOut, b, ctx)
        elif const_expr(self.realign_pool):
            self.update_state_realigned(mState, slot, h, row0, group, lane, tidx, token, scale, lower_bound, mOut, b,
                                        ctx)
        else:
            self.update_state_vectors(mState, slot, h, row0, group, lane, tidx, token, scale, lower_bound, sRing,
                                      sFull, mOut, b, ctx)

    @cute.jit
    def update_state_vectors(self, mState: cute.Tensor, slot, h, row0, group, lane, tidx, token, scale: Float32,
                             lower_bound: Float32, sRing, sFull, mOut, b, ctx):
        """:meth:`update_state` of the aligned and the element-wise variants: each lane's 8 channels of a row are one
        (bf16) or two (fp32) 16-byte vectors, or 8 elements."""
        sdt = self.state_dtype
        s_bits = self._copy_bits(sdt, CHANNELS_PER_LANE)
        s_vec = s_bits // sdt.width
        load_atom = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), sdt, num_bits_per_copy=s_bits, **self.load_hints)
        store_atom = cute.make_copy_atom(cute.nvgpu.CopyR2GOp(), sdt, num_bits_per_copy=s_bits,
                                         **self.store_hints)
        # Int64 slot: slot * (H*V*K) overflows 32 bits past ~4.3 GB of pool.
        gState = mState[Int64(slot), h, None, None]  # [V, K]
        row_views = []
        row_regs = []
        for j in cutlass.range_constexpr(self.rows):
            gRow = gState[row0 + group + j * ROW_GROUPS, None]
            row_views.append(cute.logical_divide(cute.local_tile(gRow, (CHANNELS_PER_LANE,), (lane,)), (s_vec,)))
            row_regs.append(cute.make_rmem_tensor((CHANNELS_PER_LANE,), sdt))
        if const_expr(self.bulk_ring):
            # Chunk c = rows [8c, 8c + 8) of the tile, one contiguous run of the state; it lives in ring slot
            # c % ring and is the (c // ring)-th fill of that slot's mbarrier, so every wait parity is static.
            chunk_elems = BULK_CHUNK_ROWS * HEAD_DIM
            chunk_bytes = chunk_elems * sdt.width // 8
            n_chunks = self.tile_v // BULK_CHUNK_ROWS
            bulk_load = cute.make_copy_atom(cute.nvgpu.cpasync.CopyBulkG2SOp(), sdt,
                                            num_bits_per_copy=chunk_elems * sdt.width)
            bulk_store = cute.make_copy_atom(cute.nvgpu.cpasync.CopyBulkS2GOp(), sdt,
                                             num_bits_per_copy=chunk_elems * sdt.width)
            s2r_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), sdt, num_bits_per_copy=s_bits)
            g_chunks = [cute.make_tensor(gState.iterator + (row0 + c * BULK_CHUNK_ROWS) * HEAD_DIM,
                                         cute.make_layout((chunk_elems,))) for c in range(n_chunks)]
            s_slots = [cute.make_tensor(sRing.iterator + r * chunk_elems, cute.make_layout((chunk_elems,)))
                       for r in range(self.bulk_ring)]
            full = [sFull.iterator + r for r in range(self.bulk_ring)]
            smem_views = []  # the thread's 8 channels of its row in every slot
            for r in cutlass.range_constexpr(self.bulk_ring):
                smem_views.append(cute.logical_divide(
                    cute.local_tile(sRing[r, group, None], (CHANNELS_PER_LANE,), (lane,)), (s_vec,)))
            # One thread: the mbarriers (arrival count 1: its own arrive.expect_tx), then the first `ring`
            # chunks. Inactive rows never get here, so they issue no bulk copy.
            if tidx == 0:
                _bulk_ring.fill(self.bulk_ring, n_chunks, full, s_slots, g_chunks, bulk_load, chunk_bytes)
            cute.arch.sync_threads()  # the mbarrier inits are visible before anyone waits on them
        else:
            for j in cutlass.range_constexpr(self.rows_in_flight):
                cute.copy(load_atom, row_views[j], cute.logical_divide(row_regs[j], (s_vec,)))

        # ---- per-lane preamble: decay a[c], k^, q^ for channels [8 lane, 8 lane + 8) --------------
        token, gate = self.complete_token(token, ctx, lower_bound)
        kf, qf, decay, beta, kq = self.prepare_token(token, scale, lower_bound, gate)
        v_raw = token[3]

        # ---- stream the rows: S' = a S; p, S'q^; u; S_new; o -------------------------------
        s_new = cute.make_rmem_tensor((CHANNELS_PER_LANE,), sdt)
        for j in cutlass.range_constexpr(self.rows):
            if const_expr(self.bulk_ring):
                # Row j of this thread is row `group` of chunk j.
                cute.arch.mbarrier_wait(full[j % self.bulk_ring], (j // self.bulk_ring) % 2)
                cute.copy(s2r_atom, smem_views[j % self.bulk_ring], cute.logical_divide(row_regs[j], (s_vec,)))
            elif const_expr(j + self.rows_in_flight < self.rows):
                nxt = j + self.rows_in_flight
                cute.copy(load_atom, row_views[nxt], cute.logical_divide(row_regs[nxt], (s_vec,)))
            sf = cute.make_rmem_tensor((CHANNELS_PER_LANE,), Float32)
            sf.store(row_regs[j].load().to(Float32))
            sq, u = self.row_step(sf, decay, kf, qf, beta, v_raw[j])
            s_new.store(sf.load().to(sdt))
            if const_expr(self.bulk_ring):
                self.bulk_ring_step(j, n_chunks, s2r_atom, s_new, s_vec, smem_views, s_slots, g_chunks, full,
                                    bulk_load, bulk_store, chunk_bytes, tidx)
            else:
                self.store_row(store_atom, s_new, s_vec, row_views[j], ctx)
            self.emit_row(mOut, b, h, row0 + group + j * ROW_GROUPS, sq + u * kq, lane)
        if const_expr(self.bulk_ring):
            _bulk_ring.drain(tidx)

    @cute.jit
    def update_state_realigned(self, mState: cute.Tensor, slot, h, row0, group, lane, tidx, token, scale: Float32,
                               lower_bound: Float32, mOut, b, ctx):
        """:meth:`update_state` on a pool whose slot stride is any number of elements (docs/decode_t1.md, "Pool
        realigning variant"). A (slot, head) state is one contiguous run whose first byte sits ``mis`` bytes past a
        16-byte boundary, the same for every row (a row is 256 / 512 bytes); ``shift = mis / element size``. Lane l of a
        row's half-warp holds the row's channels (8 l + t - shift) mod 128, t < 8: one (bf16) or two (fp32) aligned
        16-byte vectors from the row's aligned floor, as in the aligned variant, except that lane 0's first vector
        straddles the row's start, so its elements t < shift come from the vector straddling the row's end (channels
        128 - shift + t). The per-channel coefficients (decay, k^, q^) are realigned once (:meth:`realign_channels`)
        instead of every row. fp32: lane 0 writes its two straddling vectors in aligned pieces
        (:meth:`store_head_pieces`, :meth:`store_tail_pieces`), never a byte of a neighbouring row. bf16: a thread
        owns a block of consecutive rows, so inside a block lane 0's straddling vector is two rows of its own, read
        once and stored whole; only a block's two ends are pieces. How lane 0 reads them: :meth:`issue_realigned_row`.
        A slot with mis = 0 takes the aligned accesses in every lane."""
        sdt = self.state_dtype
        elem_bytes = sdt.width // 8
        vec = 16 // elem_bytes  # elements of a 16-byte vector
        n_vec = CHANNELS_PER_LANE // vec  # vectors of a lane's 8 channels
        row_bytes = HEAD_DIM * elem_bytes
        store_atom = cute.make_copy_atom(cute.nvgpu.CopyR2GOp(), sdt, num_bits_per_copy=128, **self.store_hints)
        gState = mState[Int64(slot), h, None, None]  # [V, K]; Int64 slot as in update_state_vectors
        start = gState.iterator.toint()  # byte address of row 0 of this (slot, head)
        mis = Int32(start & 15)
        shift = mis // elem_bytes  # uniform in the CTA
        floor0 = start - Int64(mis)  # 16-byte aligned
        straddle = (lane == 0) & (shift > 0)
        lane0_shift = cutlass.select_(lane == 0, shift, Int32(0))  # bf16 merges by word (blend_head): 0 keeps all

        # bf16 (tail_vectors): a thread owns a block of consecutive rows (:meth:`state_row`), so the vector
        # straddling row j's end is lane 0's first vector of row j + 1, already in flight in its registers; only the
        # block's last row reads its end vector into a register of its own (``tail``).
        rows = self.rows

        def row_of(j):
            return self.state_row(row0, group, j)

        row_regs = []
        for _ in cutlass.range_constexpr(rows):
            row_regs.append(cute.make_rmem_tensor((CHANNELS_PER_LANE,), sdt))
        tail = cute.make_rmem_tensor((vec,), sdt) if const_expr(self.tail_vectors) else None

        def tail_of(j):  # the tail register of row j's issue: the block's last row only
            return tail if const_expr(j == rows - 1) else None

        for j in cutlass.range_constexpr(self.rows_in_flight):
            self.issue_realigned_row(mState, floor0, shift, straddle, h, row_of(j), lane, row_regs[j], tail_of(j),
                                     j == 0)

        # ---- per-lane preamble on the natural channels [8 lane, 8 lane + 8), then realigned to the rows' ---------
        kf, qf, decay, beta, kq, v_raw = self.prepare_realigned_token(token, ctx, scale, lower_bound, shift, tidx)

        prev = None  # bf16: the previous row's new values (lane 0 stores them with this row's, see below)
        for j in cutlass.range_constexpr(rows):
            if const_expr(j + self.rows_in_flight < rows):
                nxt = j + self.rows_in_flight
                self.issue_realigned_row(mState, floor0, shift, straddle, h, row_of(nxt), lane, row_regs[nxt],
                                         tail_of(nxt), nxt == 0)
            regs = row_regs[j]
            if const_expr(self.tail_vectors):
                # lane 0: channels 128 - shift + t from the end's vector: row j + 1's first vector as loaded (its
                # own merge comes at the next row), or the block's last row's tail register
                end = row_regs[j + 1] if const_expr(j + 1 < rows) else tail
                self.blend_head(regs, end, regs, lane0_shift)
            sf = cute.make_rmem_tensor((CHANNELS_PER_LANE,), Float32)
            sf.store(regs.load().to(Float32))
            sq, u = self.row_step(sf, decay, kf, qf, beta, v_raw[j])
            s_new = cute.make_rmem_tensor((CHANNELS_PER_LANE,), sdt)  # bf16: kept as ``prev`` for the next row
            s_new.store(sf.load().to(sdt))
            row = row_of(j)
            fr = floor0 + Int64(row * row_bytes)
            own = fr + Int64(lane * (16 * n_vec))
            if const_expr(self.tail_vectors):
                # bf16: lane 0's vector at the row's floor holds the previous row's last channels (t < shift) and
                # this row's first ones, the same thread's inside a block: stored whole, by every lane at once. A
                # block's first row writes only its own part of that vector and its last row the part of the next
                # vector that is its own (aligned pieces: the neighbouring rows are another thread's).
                if const_expr(j == 0):
                    if straddle:
                        self.store_head_pieces(s_new, self._vector_at(fr), shift)
                    else:
                        cute.copy(store_atom, self._reg_vector(s_new, 0), self._global_vector(own, 0))
                else:
                    merged = cute.make_rmem_tensor((CHANNELS_PER_LANE,), sdt)
                    self.blend_head(merged, prev, s_new, lane0_shift)
                    cute.copy(store_atom, self._reg_vector(merged, 0), self._global_vector(own, 0))
                if const_expr(j == rows - 1):
                    if straddle:
                        self.store_tail_pieces(s_new, self._vector_at(fr + Int64(row_bytes)), shift)
                prev = s_new
            elif straddle:
                for i in cutlass.range_constexpr(1, n_vec):
                    cute.copy(store_atom, self._reg_vector(s_new, i), self._global_vector(own, i))
                self.store_head_pieces(s_new, self._vector_at(fr), shift)
                self.store_tail_pieces(s_new, self._vector_at(fr + Int64(row_bytes)), shift)
            else:
                for i in cutlass.range_constexpr(n_vec):
                    cute.copy(store_atom, self._reg_vector(s_new, i), self._global_vector(own, i))
            self.emit_row(mOut, b, h, row, sq + u * kq, lane)

    @cute.jit
    def update_state_realigned_ring(self, mState: cute.Tensor, slot, h, row0, group, lane, tidx, token,
                                    scale: Float32, lower_bound: Float32, sRing, sFull, mOut, b, ctx):
        """:meth:`update_state` of the pool-realigning variant through the bulk ring (docs/decode_t1.md, "Pool
        realigning ring"). The tile's rows are one contiguous run whose first byte sits ``mis`` bytes past a 16-byte
        boundary (``floor0``). The ring streams the aligned grid from there: chunk c is the bytes [floor0 + c * chunk,
        floor0 + (c + 1) * chunk), so lane l of a row holds channels (8 l + t - shift) mod 128 as in
        :meth:`update_state_realigned` (the coefficients realigned once), and lane 0's first vector straddles the row's
        start: its elements t < shift are the previous row's last channels. Every byte a bulk copy moves is the
        tile's: chunk 0 starts one vector late, and the vector straddling the run's start (row 0's head) and the one
        straddling its end (the last row's tail) are read and written in aligned pieces from global memory by the
        lane 0 that owns them.

        Inside the ring no two threads write the same 16 bytes: every lane reads its vectors whole (lane 0 also the
        vector at its row's end, whose elements t < shift are its own; row 7's is the next chunk's first, so that chunk
        is waited for one step early: ``REALIGNED_RING_MIN``); after the update lane 0 leaves its first vector (new
        tail and new head) in the stage (:meth:`ring_stage`), and after one CTA barrier each row's lane 0 writes its
        straddling vector whole: the previous row's new tail from the stage (row 0: the previous chunk's row 7) and its
        own new head. A tile with mis = 0 takes none of this (a CTA-uniform predicate)."""
        sdt = self.state_dtype
        elem_bytes = sdt.width // 8
        vec = 16 // elem_bytes
        n_vec = CHANNELS_PER_LANE // vec
        row_bytes = HEAD_DIM * elem_bytes
        gState = mState[Int64(slot), h, None, None]  # [V, K]; Int64 slot as in update_state_vectors
        start = gState.iterator.toint() + Int64(row0 * row_bytes)  # byte address of the tile's first row
        mis = Int32(start & 15)
        shift = mis // elem_bytes  # uniform in the CTA
        floor0 = start - Int64(mis)  # 16-byte aligned
        straddle = (lane == 0) & (shift > 0)

        chunk_elems = BULK_CHUNK_ROWS * HEAD_DIM
        chunk_bytes = chunk_elems * elem_bytes
        n_chunks = self.tile_v // BULK_CHUNK_ROWS
        ring = self.bulk_ring

        def bulk_atoms(elems):
            return (cute.make_copy_atom(cute.nvgpu.cpasync.CopyBulkG2SOp(), sdt, num_bits_per_copy=elems * sdt.width),
                    cute.make_copy_atom(cute.nvgpu.cpasync.CopyBulkS2GOp(), sdt, num_bits_per_copy=elems * sdt.width))

        bulk_load, bulk_store = bulk_atoms(chunk_elems)
        first_load, first_store = bulk_atoms(chunk_elems - vec)
        g_chunks = [self._vector_at(floor0 + Int64(c * chunk_bytes), chunk_elems) for c in range(n_chunks)]
        s_slots = [cute.make_tensor(sRing.iterator + r * chunk_elems, cute.make_layout((chunk_elems,)))
                   for r in range(ring)]
        first = (cute.make_tensor(sRing.iterator + vec, cute.make_layout((chunk_elems - vec,))),
                 self._vector_at(floor0 + Int64(16), chunk_elems - vec), first_load, first_store,
                 (chunk_elems - vec) * elem_bytes)
        full = [sFull.iterator + r for r in range(ring)]
        s2r_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), sdt, num_bits_per_copy=128)
        ld_atom = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), sdt, num_bits_per_copy=128, **self.load_hints)
        st_atom = cute.make_copy_atom(cute.nvgpu.CopyR2GOp(), sdt, num_bits_per_copy=128, **self.store_hints)

        if tidx == 0:
            _bulk_ring.fill(ring, n_chunks, full, s_slots, g_chunks, bulk_load, chunk_bytes, first=first)
        # The run's two straddling vectors, from global memory by the lane 0 that owns them, issued with the ring:
        # row 0's head (group 0; its elements t < shift are the previous run's) and the last row's tail (group 7;
        # only its elements t < shift are this run's).
        head = cute.make_rmem_tensor((vec,), sdt)
        tail_end = cute.make_rmem_tensor((vec,), sdt)
        head_g = self._vector_at(floor0)
        tail_g = self._vector_at(floor0 + Int64(n_chunks * chunk_bytes))
        if tidx == 0:
            if straddle:
                self.load_head_pieces(head, head_g, shift)
            else:
                cute.copy(ld_atom, cute.logical_divide(head_g, (vec,)), cute.logical_divide(head, (vec,)))
        if (group == ROW_GROUPS - 1) & straddle:
            self.load_tail_pieces(tail_end, tail_g, shift)
        cute.arch.sync_threads()  # the mbarrier inits are visible before anyone waits on them

        # ---- per-lane preamble on the natural channels [8 lane, 8 lane + 8), then realigned to the rows' ---------
        kf, qf, decay, beta, kq, v_raw = self.prepare_realigned_token(token, ctx, scale, lower_bound, shift, tidx)

        # The two end vectors go to shared memory, read later by the thread that loaded them (no registers held
        # across the stream): the head into chunk 0's first vector (which its bulk copies skip), the tail beside
        # the stage.
        stage, ends = self.ring_stage(sRing)
        if tidx == 0:
            cute.copy(s2r_atom, self._reg_vector(head, 0), self._ring_vector(sRing, 0, 0, 0))
        if (group == ROW_GROUPS - 1) & straddle:
            cute.copy(s2r_atom, self._reg_vector(tail_end, 0), self._reg_vector(ends, 0))
        regs = cute.make_rmem_tensor((CHANNELS_PER_LANE,), sdt)
        s_new = cute.make_rmem_tensor((CHANNELS_PER_LANE,), sdt)
        tail = cute.make_rmem_tensor((vec,), sdt)
        for j in cutlass.range_constexpr(n_chunks):
            r = j % ring
            cute.arch.mbarrier_wait(full[r], (j // ring) % 2)
            last_row = group == ROW_GROUPS - 1
            # the run's first row (chunk 0, group 0: its head goes to global memory); a group is never ROW_GROUPS
            head_row = group == (0 if j == 0 else ROW_GROUPS)
            if const_expr(j + 1 < n_chunks):
                if last_row & straddle:  # its end vector is the next chunk's first
                    cute.arch.mbarrier_wait(full[(j + 1) % ring], ((j + 1) // ring) % 2)
            # ---- every lane's vectors whole; lane 0's elements t < shift from the vector at the row's end --------
            for i in cutlass.range_constexpr(n_vec):
                cute.copy(s2r_atom, self._ring_vector(sRing, r, group, lane * n_vec + i), self._reg_vector(regs, i))
            if straddle:
                if const_expr(j + 1 < n_chunks):
                    if last_row:
                        cute.copy(s2r_atom, self._ring_vector(sRing, (j + 1) % ring, 0, 0), self._reg_vector(tail, 0))
                    else:
                        cute.copy(s2r_atom, self._ring_vector(sRing, r, group + 1, 0), self._reg_vector(tail, 0))
                else:
                    if last_row:
                        cute.copy(s2r_atom, self._reg_vector(ends, 0), self._reg_vector(tail, 0))
                    else:
                        cute.copy(s2r_atom, self._ring_vector(sRing, r, group + 1, 0), self._reg_vector(tail, 0))
                self.blend_head(regs, tail, regs, shift)

            sf = cute.make_rmem_tensor((CHANNELS_PER_LANE,), Float32)
            sf.store(regs.load().to(Float32))
            sq, u = self.row_step(sf, decay, kf, qf, beta, v_raw[j])
            s_new.store(sf.load().to(sdt))

            # ---- write back: whole vectors; a straddling one through the stage (below) ------------------------
            for i in cutlass.range_constexpr(1, n_vec):
                cute.copy(s2r_atom, self._reg_vector(s_new, i), self._ring_vector(sRing, r, group, lane * n_vec + i))
            if lane != 0:
                cute.copy(s2r_atom, self._reg_vector(s_new, 0), self._ring_vector(sRing, r, group, lane * n_vec))
            elif straddle:
                # lane 0's first vector holds this row's new tail (t < shift: the next row's vector's) and new head
                cute.copy(s2r_atom, self._reg_vector(s_new, 0), self._reg_vector(stage[j % 2, group, None], 0))
                if head_row:
                    self.store_head_pieces(s_new, head_g, shift)
            elif head_row:
                cute.copy(st_atom, self._reg_vector(s_new, 0), cute.logical_divide(head_g, (vec,)))
            else:
                cute.copy(s2r_atom, self._reg_vector(s_new, 0), self._ring_vector(sRing, r, group, 0))
            if const_expr(j + 1 == n_chunks):
                if last_row & straddle:
                    self.store_tail_pieces(s_new, tail_g, shift)
            if shift > 0:  # CTA-uniform
                # Every row's straddling vector, merged by the lane 0 whose head it holds: the previous row's new tail
                # (the stage, written by another half-warp: one CTA barrier; row 0's is the last chunk's row 7)
                # and its own new head, one whole store. Chunk 0's row 0 went to global memory.
                cute.arch.sync_threads()
                if straddle & (group != (0 if j == 0 else ROW_GROUPS)):
                    prev = stage[cutlass.select_(group == 0, (j + 1) % 2, j % 2), (group + ROW_GROUPS - 1) % ROW_GROUPS,
                                 None]
                    cute.copy(s2r_atom, self._reg_vector(prev, 0), self._reg_vector(tail, 0))
                    self.blend_head(tail, tail, s_new, shift)
                    cute.copy(s2r_atom, self._reg_vector(tail, 0), self._ring_vector(sRing, r, group, 0))
            _bulk_ring.store_and_refill(j, ring, n_chunks, full, s_slots, g_chunks, bulk_load, bulk_store,
                                        chunk_bytes, tidx, first=first)
            self.emit_row(mOut, b, h, row0 + group + j * ROW_GROUPS, sq + u * kq, lane)
        _bulk_ring.drain(tidx)

    @cute.jit
    def blend_head(self, out: cute.Tensor, low: cute.Tensor, high: cute.Tensor, shift):
        """The first 16-byte vector of ``out`` <- elements t < ``shift`` of ``low``, the others of ``high`` (``out`` may
        be either). bf16: by 32-bit word, one mask of two halves each, so the two elements of a word are never split
        into 16-bit registers; a select per element held the realigning ring's bf16 build at 92-93 registers, the words
        at 72, the aligned ring's count (sm_90a, tile 128), and the register path's at 138 against 128 (tile 128, 8
        rows in flight). fp32: a select per element (a word each)."""
        if const_expr(self.state_dtype.width == 16):
            out_w, low_w, high_w = (cute.recast_tensor(x, cutlass.Uint32) for x in (out, low, high))
            for w in cutlass.range_constexpr(4):
                mask = (cutlass.select_(2 * w < shift, cutlass.Uint32(0x0000FFFF), cutlass.Uint32(0))
                        | cutlass.select_(2 * w + 1 < shift, cutlass.Uint32(0xFFFF0000), cutlass.Uint32(0)))
                out_w[w] = (low_w[w] & mask) | (high_w[w] & ~mask)
        else:
            for t in cutlass.range_constexpr(128 // self.state_dtype.width):
                out[t] = cutlass.select_(t < shift, low[t], high[t])

    def load_head_pieces(self, regs: cute.Tensor, head: cute.Tensor, shift):
        """Elements [shift, vec) of the aligned global vector ``head`` into the same elements of ``regs``
        (:meth:`head_pieces`): no byte before the row's start is read. Traced inline."""
        for pos, take, w, places in self.head_pieces(shift):
            self.load_piece(regs, head, pos, take, w, places)

    def load_tail_pieces(self, regs: cute.Tensor, tail: cute.Tensor, shift):
        """Elements [0, shift) of the aligned global vector ``tail`` into the same elements of ``regs``
        (:meth:`tail_pieces`): no byte past the row's end is read. Traced inline."""
        for pos, take, w, places in self.tail_pieces(shift):
            self.load_piece(regs, tail, pos, take, w, places)

    @cute.jit
    def load_piece(self, regs: cute.Tensor, src: cute.Tensor, pos, take, w: cutlass.Constexpr,
                   places: cutlass.Constexpr):
        """If ``take``: elements [pos, pos + w) of the aligned vector ``src`` into the same elements of ``regs``,
        where ``pos`` is one of ``places`` (multiples of w: one naturally aligned access; the registers are picked
        by selects, as :meth:`store_piece` picks them)."""
        sdt = self.state_dtype
        piece = cute.make_rmem_tensor((w,), sdt)
        piece.fill(0.0)
        if take:
            elem_bytes = sdt.width // 8
            addr = src.iterator.toint()
            at = cute.make_tensor(cute.make_ptr(sdt, addr + type(addr)(pos * elem_bytes), src.iterator.memspace,
                                                assumed_align=w * elem_bytes), cute.make_layout((w,)))
            atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), sdt, num_bits_per_copy=w * sdt.width)
            cute.copy(atom, cute.logical_divide(at, (w,)), cute.logical_divide(piece, (w,)))
        for c in cutlass.range_constexpr(len(places)):
            hit = take & (pos == places[c])
            for i in cutlass.range_constexpr(w):
                regs[places[c] + i] = cutlass.select_(hit, piece[i], regs[places[c] + i])

    def _ring_vector(self, sRing, r, g, i):
        """Aligned 16-byte vector ``i`` of row ``g`` of ring slot ``r``, divided for a copy atom. Traced inline."""
        return self._reg_vector(sRing[r, g, None], i)

    def prepare_realigned_token(self, token, ctx, scale, lower_bound, shift, tidx):
        """The pool-realigning variants' preamble: :meth:`complete_token` and :meth:`prepare_token` on the natural
        channels [8 lane, 8 lane + 8), then the per-channel coefficients realigned to the rows' channels
        (:meth:`realign_channels`). Returns (k^, q^, decay, beta, k^.q^, the rows' v). Traced inline."""
        token, gate = self.complete_token(token, ctx, lower_bound)
        kf, qf, decay, beta, kq = self.prepare_token(token, scale, lower_bound, gate)
        for x in (kf, qf, decay):
            self.realign_channels(x, shift, tidx)
        return kf, qf, decay, beta, kq, token[3]

    def _global_vector(self, addr, i: int):
        """The aligned 16-byte global vector ``i`` from byte address ``addr``, divided for a copy atom. Traced
        inline."""
        vec = 128 // self.state_dtype.width
        g = cute.make_tensor(cute.make_ptr(self.state_dtype, addr + Int64(i * 16), cutlass.AddressSpace.gmem,
                                           assumed_align=16), cute.make_layout((vec,)))
        return cute.logical_divide(g, (vec,))

    def _reg_vector(self, regs, i: int):
        """Vector ``i`` (16 bytes) of a register fragment, divided for a copy atom. Traced inline."""
        vec = 128 // self.state_dtype.width
        return cute.logical_divide(cute.local_tile(regs, (vec,), (i,)), (vec,))

    @cute.jit
    def issue_realigned_row(self, mState: cute.Tensor, floor0, shift, straddle, h, row, lane, regs: cute.Tensor,
                            tail, first: cutlass.Constexpr):  # tail: None for fp32
        """Issue the loads of state row ``row`` for this lane (:meth:`update_state_realigned`): its vectors from the
        row's aligned floor. bf16 (``tail_vectors``): :meth:`issue_row_bf16` (``first``: the row is a block's first;
        ``tail``: a register for the row's end vector on a block's last row, else None). fp32: lane 0 reads the 4
        elements of its first vector one by one from where they are (t >= shift: the row's start, t < shift: its
        end), so no extra registers are held: the large-batch schedule keeps 16 fp32 rows in flight, which leaves no
        room for a tail vector per row."""
        sdt = self.state_dtype
        vec = 128 // sdt.width
        n_vec = CHANNELS_PER_LANE // vec
        row_bytes = HEAD_DIM * sdt.width // 8
        load_atom = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), sdt, num_bits_per_copy=128, **self.load_hints)
        fr = floor0 + Int64(row * row_bytes)
        own = fr + Int64(lane * (16 * n_vec))
        if const_expr(self.tail_vectors):
            self.issue_row_bf16(mState, fr, own, shift, straddle, h, row, regs, tail, first, load_atom)
        elif straddle:
            for i in cutlass.range_constexpr(1, n_vec):
                cute.copy(load_atom, self._global_vector(own, i), self._reg_vector(regs, i))
            pair = cute.make_tensor(cute.make_ptr(sdt, fr, cutlass.AddressSpace.gmem, assumed_align=16),
                                    cute.make_layout((2 * HEAD_DIM,)))
            for t in cutlass.range_constexpr(vec):  # (shift > 0: element 0 is always the row's end's)
                regs[t] = pair[cutlass.select_(t >= shift, Int32(t), Int32(HEAD_DIM + t))]
        else:
            for i in cutlass.range_constexpr(n_vec):
                cute.copy(load_atom, self._global_vector(own, i), self._reg_vector(regs, i))

    @cute.jit
    def issue_row_bf16(self, mState: cute.Tensor, fr, own, shift, straddle, h, row, regs: cute.Tensor, tail, first:
                       cutlass.Constexpr, load_atom):
        """:meth:`issue_realigned_row` for a bf16 pool: every lane's vector at ``own`` (lane 0's straddles the row's
        start; its elements t < shift, the previous row's, are read and replaced later), the same load in every lane
        but on the slot run's first row (``first`` rows of a block only), where lane 0 reads only this row's
        elements; and, on a block's last row (``tail`` not None), lane 0's vector straddling the row's end into
        ``tail``, whole where all its bytes are inside the slot's run, else only this row's elements of it."""
        sdt = self.state_dtype
        vec = 128 // sdt.width
        pair = cute.make_tensor(cute.make_ptr(sdt, fr, cutlass.AddressSpace.gmem, assumed_align=16),
                                cute.make_layout((2 * HEAD_DIM,)))
        run_row = h * HEAD_DIM + row  # the row within the slot's run
        if const_expr(first):
            if straddle & (run_row == 0):  # the bytes before the run are not the pool's to read
                for t in cutlass.range_constexpr(vec):
                    if t >= shift:
                        regs[t] = pair[t]
            else:
                cute.copy(load_atom, self._global_vector(own, 0), self._reg_vector(regs, 0))
        else:
            cute.copy(load_atom, self._global_vector(own, 0), self._reg_vector(regs, 0))
        if const_expr(tail is not None):  # a block's last row (the others' end vectors are the next row's start)
            if straddle:
                if run_row < cute.size(mState, mode=[1]) * HEAD_DIM - 1:  # the end's vector: the next row's
                    cute.copy(load_atom, self._global_vector(fr, HEAD_DIM * sdt.width // 128),
                              cute.logical_divide(tail, (vec,)))
                else:
                    for t in cutlass.range_constexpr(vec - 1):
                        if t < shift:
                            tail[t] = pair[HEAD_DIM + t]

    @cute.jit
    def realign_channels(self, x: cute.Tensor, shift, tidx):
        """``x`` (this lane's fp32 values of channels [8 lane, 8 lane + 8)) <- the half-warp's values of channels
        (8 lane + t - shift) mod 128, t < 8: rotate by ``shift`` within the lane (a barrel of selects on its bits),
        then the elements t < shift come from the previous lane of the half-warp (lane 15 for lane 0)."""
        vec = 128 // self.state_dtype.width  # shift < vec
        widths = [w for w in (1, 2, 4) if w < vec]
        for k in cutlass.range_constexpr(len(widths)):
            w = widths[k]
            old = [x[t] for t in range(CHANNELS_PER_LANE)]
            take = (shift & w) != 0
            for t in cutlass.range_constexpr(CHANNELS_PER_LANE):
                x[t] = cutlass.select_(take, old[(t - w) % CHANNELS_PER_LANE], old[t])
        warp_lane = tidx % 32
        src = (warp_lane & HALF_WARP) | ((warp_lane + HALF_WARP - 1) % HALF_WARP)
        for t in cutlass.range_constexpr(vec - 1):
            prev = cute.arch.shuffle_sync(x[t], offset=src)
            x[t] = cutlass.select_(t < shift, prev, x[t])

    def _vector_at(self, addr, elems: int = 0):
        """``elems`` state elements (0: one 16-byte vector) of global memory from the 16-byte aligned byte address
        ``addr``, as a 1-D tensor (the pieces' vector, the ring's chunks). Traced inline."""
        return cute.make_tensor(cute.make_ptr(self.state_dtype, addr, cutlass.AddressSpace.gmem, assumed_align=16),
                                cute.make_layout((elems or 128 // self.state_dtype.width,)))

    def head_pieces(self, shift):
        """The naturally aligned pieces of 1, 2, 4 elements that cover elements [shift, vec) of a 16-byte vector (0 <
        shift < vec, elements per 16 bytes), as (pos, take, w, places): w elements at ``pos`` when ``take``, ``pos``
        being one of ``places``. Upward: w at lo when lo is w past a multiple of 2w. A generator, so that each
        piece's access is traced before the next position is computed. Plain Python, traced inline."""
        vec = 128 // self.state_dtype.width
        lo = shift
        for w in [w for w in (1, 2, 4) if w < vec]:
            yield lo, (lo & w) != 0, w, tuple(range(w, vec, 2 * w))
            lo = lo + (lo & w)

    def tail_pieces(self, shift):
        """:meth:`head_pieces` for elements [0, shift): from the largest piece, w at the higher bits of shift."""
        vec = 128 // self.state_dtype.width
        pos = Int32(0)
        for w in [w for w in (4, 2, 1) if w < vec]:
            yield pos, (shift & w) != 0, w, tuple(range(0, vec - w, 2 * w))
            pos = pos + (shift & w)

    def store_head_pieces(self, s_new: cute.Tensor, head: cute.Tensor, shift):
        """Elements [shift, vec) of lane 0's ``s_new`` to the aligned vector ``head`` (the one straddling the row's
        start; same positions) in :meth:`head_pieces`, so that no byte of the previous row is written. Traced
        inline."""
        for pos, take, w, places in self.head_pieces(shift):
            self.store_piece(s_new, head, pos, take, w, places)

    def store_tail_pieces(self, s_new: cute.Tensor, tail: cute.Tensor, shift):
        """Elements [0, shift) of lane 0's ``s_new`` to the aligned vector ``tail`` (the one straddling the row's end;
        same positions) in :meth:`tail_pieces`, so that no byte of the next row is written. Traced inline."""
        for pos, take, w, places in self.tail_pieces(shift):
            self.store_piece(s_new, tail, pos, take, w, places)

    @cute.jit
    def store_piece(self, s_new: cute.Tensor, dst: cute.Tensor, pos, take, w: cutlass.Constexpr,
                    places: cutlass.Constexpr):
        """If ``take``: elements [pos, pos + w) of ``s_new`` to the same elements of the aligned vector ``dst``, where
        ``pos`` is one of ``places`` (multiples of w, so the store is w elements naturally aligned)."""
        sdt = self.state_dtype
        piece = cute.make_rmem_tensor((w,), sdt)
        for i in cutlass.range_constexpr(w):
            value = s_new[places[0] + i]
            for c in cutlass.range_constexpr(1, len(places)):
                value = cutlass.select_(pos == places[c], s_new[places[c] + i], value)
            piece[i] = value
        if take:
            elem_bytes = sdt.width // 8
            space = dst.iterator.memspace
            addr = dst.iterator.toint()
            at = cute.make_tensor(cute.make_ptr(sdt, addr + type(addr)(pos * elem_bytes), space,
                                                assumed_align=w * elem_bytes), cute.make_layout((w,)))
            atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), sdt, num_bits_per_copy=w * sdt.width)
            cute.copy(atom, cute.logical_divide(piece, (w,)), cute.logical_divide(at, (w,)))

    def complete_token(self, token, ctx, lower_bound):
        """Hook run once the state rows are issued and before the preamble: returns (token, gate). The T=1 kernel's
        token is already complete (every activation was loaded up front) and its gate is computed in the preamble
        (None); a subclass whose q, k, v are computed in the kernel (the fused layer) produces them here, and may
        compute the gate (:meth:`prepare_gate`) while its own loads are in flight. Traced inline."""
        return token, None

    def store_row(self, atom, s_new: cute.Tensor, s_vec, row_view, ctx):
        """Hook: state row ``s_new`` (this lane's channels) to its place in the pool, ``row_view``; the register
        path's row stream calls it for every row. Here at once; a subclass may keep the row and store it later
        (the fused layer's cluster variant). Traced inline."""
        cute.copy(atom, cute.logical_divide(s_new, (s_vec,)), row_view)

    @cute.jit
    def emit_row(self, mOut: cute.Tensor, b, h, row, value: Float32, lane):
        """Output of state row ``row`` (already summed over the half-warp): lane 0 stores it."""
        if lane == 0:
            mOut[b, 0, h, row] = value.to(mOut.element_type)

    @cute.jit
    def zero_tokens(self, mOut: cute.Tensor, t0, t1, h, row0, group, lane):
        """Output <- 0 on this thread's rows of head ``h`` for tokens [t0, t1)."""
        if lane == 0:
            for t in cutlass.range(t0, t1, unroll=1):
                for j in cutlass.range_constexpr(self.rows):
                    mOut[t, 0, h, row0 + group + j * ROW_GROUPS] = Float32(0.0).to(mOut.element_type)

    @cute.jit
    def token_loop(self, mQ, mK, mV, mG, mBeta, mALog, mDtBias, mState: cute.Tensor, mOut: cute.Tensor, slot, h, bos,
                   seq_len, row0, group, lane, scale: Float32, lower_bound: Float32):
        """Varlen, a sequence of ``seq_len`` != 1 tokens from ``bos`` at a live slot: each of this thread's rows is
        read once, run through the tokens in fp32 registers and stored once (rounded once, as the oracle). Every
        token's preamble is recomputed for each row: the exact fallback of the T=1 kernel, not a fast path (the
        generic kernel is the one for multi-token sequences). The rows run unrolled unless ``TOKEN_LOOP_ROLLED`` names
        this gate, pool dtype and tile: this loop sets the varlen build's register count."""
        gState = mState[Int64(slot), h, None, None]  # [V, K]
        # Two literal loops: the DSL's preprocessor takes a loop's kind (range / range_constexpr) from its source.
        if const_expr((self.gate, self.state_dtype.width, self.tile_v) in TOKEN_LOOP_ROLLED):
            for j in cutlass.range(self.rows, unroll=1):
                self.token_loop_row(mQ, mK, mV, mG, mBeta, mALog, mDtBias, gState, mOut, self.state_row(row0, group, j),
                                    h, bos, seq_len, lane, scale, lower_bound)
        else:
            for j in cutlass.range_constexpr(self.rows):
                self.token_loop_row(mQ, mK, mV, mG, mBeta, mALog, mDtBias, gState, mOut, self.state_row(row0, group, j),
                                    h, bos, seq_len, lane, scale, lower_bound)

    @cute.jit
    def token_loop_row(self, mQ, mK, mV, mG, mBeta, mALog, mDtBias, gState: cute.Tensor, mOut: cute.Tensor, row, h, bos,
                       seq_len, lane, scale: Float32, lower_bound: Float32):
        """:meth:`token_loop` on one state row ``row`` of the (slot, head) state ``gState`` [V, K]."""
        sdt = self.state_dtype
        s_bits = self._state_copy_bits()
        s_vec = s_bits // sdt.width
        load_atom = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), sdt, num_bits_per_copy=s_bits, **self.load_hints)
        store_atom = cute.make_copy_atom(cute.nvgpu.CopyR2GOp(), sdt, num_bits_per_copy=s_bits, **self.store_hints)
        view = cute.logical_divide(cute.local_tile(gState[row, None], (CHANNELS_PER_LANE,), (lane,)), (s_vec,))
        raw = cute.make_rmem_tensor((CHANNELS_PER_LANE,), sdt)
        cute.copy(load_atom, view, cute.logical_divide(raw, (s_vec,)))
        sf = cute.make_rmem_tensor((CHANNELS_PER_LANE,), Float32)
        sf.store(raw.load().to(Float32))
        for t in cutlass.range(bos, bos + seq_len, unroll=1):
            token = self.load_token(mQ, mK, mV, mG, mBeta, mALog, mDtBias, t, h, lane, [row])
            kf, qf, decay, beta, kq = self.prepare_token(token, scale, lower_bound)
            sq, u = self.row_step(sf, decay, kf, qf, beta, token[3][0])
            if lane == 0:
                mOut[t, 0, h, row] = (sq + u * kq).to(mOut.element_type)
        raw.store(sf.load().to(sdt))
        cute.copy(store_atom, cute.logical_divide(raw, (s_vec,)), view)


class KDADecodeT1Packed(KDADecodeT1):
    """The packed entry's host wrapper: the same kernel, launched on the rows of one GEMM output.

    The compiled function takes ``mixed_qkv`` [B, 3*H*128], ``raw_gate`` [B, H*128] and ``raw_beta`` [B, H] as they
    are and builds the kernel's q, k, v, g [B, 1, H, 128] and beta [B, 1, H] views in the traced host code: q, k and
    v start H*128 elements apart in a mixed row, the row stride (a runtime value) is their batch stride. This keeps
    five torch views (~1 us each on the host) and two tensor conversions per call off the host path. Alignment: H*128
    elements is a multiple of 128, so k and v are as aligned as mixed_qkv's pointer (the DSL carries the offset's
    divisibility into the pointer type); the aligned variant is only chosen after kda-core classified the pointers
    and row strides.
    """

    @cute.jit
    def __call__(
        self,
        mMixed: cute.Tensor,  # [B, 3*H*K]: [q heads | k heads | v heads]
        mGate: cute.Tensor,  # [B, H*K]
        mRawBeta: cute.Tensor,  # [B, H]
        mALog,  # [H] fp32, or None (precomputed gate)
        mDtBias,  # [H*K] fp32, or None
        mState: cute.Tensor,  # [N, H, V, K]
        mSlot: cute.Tensor,  # [B] int32
        mOut: cute.Tensor,  # [B, 1, H, V]
        scale: Float32,
        lower_bound: Float32,
        stream,
    ):
        B = cute.size(mMixed, mode=[0])
        H = cute.size(mRawBeta, mode=[1])
        mG = cute.make_tensor(mGate.iterator, cute.make_layout((B, 1, H, HEAD_DIM), stride=(mGate.stride[0], 0,
                                                                                            HEAD_DIM, 1)))
        mBeta = cute.make_tensor(mRawBeta.iterator, cute.make_layout((B, 1, H), stride=(mRawBeta.stride[0], 0,
                                                                                        mRawBeta.stride[1])))
        self.launch_mixed(mMixed, mG, mBeta, mALog, mDtBias, mState, mSlot, mOut, B, H, scale, lower_bound, stream)

    @cute.jit
    def launch_mixed(self, mMixed, mG, mBeta, mALog, mDtBias, mState, mSlot, mOut, B, H, scale: Float32,
                     lower_bound: Float32, stream):
        """q, k, v [B, 1, H, 128] views of the mixed rows, then :meth:`launch`."""
        heads = H * HEAD_DIM  # elements of one operand's heads in a mixed row
        # (B, T=1, H, K): the batch stride is the row stride; the single token's stride is never stepped over.
        qkv = cute.make_layout((B, 1, H, HEAD_DIM), stride=(mMixed.stride[0], 0, HEAD_DIM, 1))
        mQ = cute.make_tensor(mMixed.iterator, qkv)
        mK = cute.make_tensor(mMixed.iterator + heads, qkv)
        mV = cute.make_tensor(mMixed.iterator + 2 * heads, qkv)
        self.launch(mQ, mK, mV, mG, mBeta, mALog, mDtBias, mState, mSlot, None, mOut, scale, lower_bound, stream)


class KDADecodeT1PackedTokens(KDADecodeT1Packed):
    """The packed entry's host wrapper in the token form (vLLM Kimi K3's call): ``mixed_qkv`` [B, 3*H*128] as
    :class:`KDADecodeT1Packed`'s, ``raw_gate`` [1, B, H, 128] (each token's [H, 128] compact), ``raw_beta`` [1, B, H]
    and the output [1, B, H, 128], taken as they are: the traced host code views them as the kernel's [B, 1, H, ...]
    rows (dim 1's stride as the row stride), so no torch view is made per call. The kernel reads the same elements
    as on the [B, H*128], [B, H] and [B, 1, H, 128] views of :class:`KDADecodeT1Packed`."""

    @cute.jit
    def __call__(
        self,
        mMixed: cute.Tensor,  # [B, 3*H*K]: [q heads | k heads | v heads]
        mGate: cute.Tensor,  # [1, B, H, K]
        mRawBeta: cute.Tensor,  # [1, B, H]
        mALog,  # [H] fp32, or None (precomputed gate)
        mDtBias,  # [H*K] fp32, or None
        mState: cute.Tensor,  # [N, H, V, K]
        mSlot: cute.Tensor,  # [B] int32 or int64, any stride
        mOut: cute.Tensor,  # [1, B, H, V]
        scale: Float32,
        lower_bound: Float32,
        stream,
    ):
        B = cute.size(mMixed, mode=[0])
        H = cute.size(mRawBeta, mode=[2])
        mG = cute.make_tensor(mGate.iterator, cute.make_layout((B, 1, H, HEAD_DIM), stride=(mGate.stride[1], 0,
                                                                                            HEAD_DIM, 1)))
        mBeta = cute.make_tensor(mRawBeta.iterator, cute.make_layout((B, 1, H), stride=(mRawBeta.stride[1], 0,
                                                                                        mRawBeta.stride[2])))
        mOutRows = cute.make_tensor(mOut.iterator, cute.make_layout((B, 1, H, HEAD_DIM), stride=(mOut.stride[1], 0,
                                                                                                 mOut.stride[2], 1)))
        self.launch_mixed(mMixed, mG, mBeta, mALog, mDtBias, mState, mSlot, mOutRows, B, H, scale, lower_bound,
                          stream)


class KDADecodeT1Varlen(KDADecodeT1):
    """The varlen entry's host wrapper: tokens [1, T, H, 128] + cu_seqlens [S + 1] (FLA's packed-sequence form, as
    FlashInfer and SGLang call decode), the same kernel with one CTA row per sequence. The traced host code views the
    tokens as [T, 1, H, 128] rows (the token stride as the row stride) so the kernel indexes a token as it does a
    batch row."""

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [1, T, H, K]
        mK: cute.Tensor,  # [1, T, H, K]
        mV: cute.Tensor,  # [1, T, H, V]
        mG: cute.Tensor,  # [1, T, H, K]
        mBeta: cute.Tensor,  # [1, T, H]
        mALog,  # [H] fp32, or None (precomputed gate)
        mDtBias,  # [H*K] fp32, or None
        mState: cute.Tensor,  # [N, H, V, K]
        mSlot: cute.Tensor,  # [S] int32 or int64, any stride
        mCu: cute.Tensor,  # [S + 1] int32 or int64
        mOut: cute.Tensor,  # [1, T, H, V]
        scale: Float32,
        lower_bound: Float32,
        stream,
    ):
        T = cute.size(mQ, mode=[1])
        H = cute.size(mQ, mode=[2])

        def rows(t):  # [1, T, H, D] -> [T, 1, H, D]; the single row's stride is never stepped over
            return cute.make_tensor(t.iterator, cute.make_layout((T, 1, H, HEAD_DIM), stride=(t.stride[1], 0,
                                                                                           t.stride[2], 1)))

        mBetaRows = cute.make_tensor(mBeta.iterator, cute.make_layout((T, 1, H), stride=(mBeta.stride[1], 0,
                                                                                        mBeta.stride[2])))
        self.launch(rows(mQ), rows(mK), rows(mV), rows(mG), mBetaRows, mALog, mDtBias, mState, mSlot, mCu, rows(mOut),
                    scale, lower_bound, stream)


# --------------------------------------------------------------------------------------------------
# Host side: validation (metadata only), compile cache, the two entry points
# --------------------------------------------------------------------------------------------------


def _compile(key, arch):
    (state_dt, g_dt, beta_dt, gate, beta_is_logit, l2norm, has_dt_bias, tile_v, aligned, rows_in_flight, cache_hint,
     bulk_ring, slot_major, packed, null_policy, index_dtype, cu_dtype, realign_pool) = key
    cdt = _launch.cutlass_dtype
    align = _launch.VECTOR_BYTES if aligned else 1
    B, N, H = _launch.sym_size(), _launch.sym_size(), _launch.sym_size()
    head_elems = HEAD_DIM * HEAD_DIM
    varlen = cu_dtype is not None
    tokens = packed == PACKED_TOKENS
    if varlen and packed:
        raise ValueError("decode_t1: the varlen form has no packed entry")

    def activation(dtype):
        if varlen:  # [1, T, H, D]: B symbolic tokens
            return _launch.fake_tensor(cdt(dtype), (1, B, H, HEAD_DIM), (None, None, None, 1), align_bytes=align)
        return _launch.fake_tensor(cdt(dtype), (B, 1, H, HEAD_DIM), (None, None, None, 1), align_bytes=align)

    if tokens:  # GEMM rows [B, width]; the gate, beta (and output) as [1, B, ...] tokens, vLLM's form
        size_one = cute.sym_int64()  # dim 0's stride (size 1: never stepped over, any value)
        inputs = [
            _launch.fake_tensor(cutlass.BFloat16, (B, _launch.sym_size()), (None, 1), align_bytes=align),  # mixed_qkv
            _launch.fake_tensor(cdt(g_dt), (1, B, H, HEAD_DIM), (size_one, None, HEAD_DIM, 1),
                                align_bytes=align),  # raw_gate
            _launch.fake_tensor(cdt(beta_dt), (1, B, H), (size_one, None, None), align_bytes=1),  # raw_beta
        ]
    elif packed:  # GEMM rows [B, width] with a padded row stride; the widths are checked by kda-core
        inputs = [
            _launch.fake_tensor(cutlass.BFloat16, (B, _launch.sym_size()), (None, 1), align_bytes=align),  # mixed_qkv
            _launch.fake_tensor(cdt(g_dt), (B, _launch.sym_size()), (None, 1), align_bytes=align),  # raw_gate
            _launch.fake_tensor(cdt(beta_dt), (B, H), (None, None), align_bytes=1),  # raw_beta
        ]
    else:
        inputs = [
            activation(torch.bfloat16),  # q
            activation(torch.bfloat16),  # k
            activation(torch.bfloat16),  # v
            activation(g_dt),  # g
            _launch.fake_tensor(cdt(beta_dt), (1, B, H) if varlen else (B, 1, H), (None, None, None), align_bytes=1),
        ]
    gate_params = [None, None]
    if gate != GateMode.PRECOMPUTED:
        gate_params[0] = _launch.fake_tensor(cutlass.Float32, (H,), (None,), align_bytes=1)
        if has_dt_bias:
            gate_params[1] = _launch.fake_tensor(cutlass.Float32, (cute.sym_int(),), (1,), align_bytes=align)
    fake_args = [
        *inputs,
        *gate_params,
        _launch.fake_tensor(cdt(state_dt), (N, H, HEAD_DIM, HEAD_DIM), (None, head_elems, HEAD_DIM, 1),
                            align_bytes=state_dt.itemsize if realign_pool else align),  # realigned: any stride
        # slot indices, any stride; varlen: one per sequence, then the S + 1 offsets
        _launch.fake_tensor(cdt(index_dtype), (_launch.sym_size() if varlen else B,), (None,), align_bytes=1),
        *([_launch.fake_tensor(cdt(cu_dtype), (_launch.sym_size(),), (None,), align_bytes=1)] if varlen else []),
        (_launch.fake_tensor(cutlass.BFloat16, (1, B, H, HEAD_DIM), (cute.sym_int64(), None, None, 1),
                             align_bytes=align) if tokens else activation(torch.bfloat16)),  # output
        cutlass.Float32(1.0),
        cutlass.Float32(-1.0),
        _launch.fake_stream(),
    ]
    kernel = (KDADecodeT1Varlen if varlen else KDADecodeT1PackedTokens if tokens else KDADecodeT1Packed if packed
              else KDADecodeT1)(
        state_dtype=cdt(state_dt),
        gate=gate,
        beta_is_logit=beta_is_logit,
        use_qk_l2norm=l2norm,
        has_dt_bias=has_dt_bias,
        tile_v=tile_v,
        aligned=aligned,
        rows_in_flight=rows_in_flight,
        cache_hint=cache_hint,
        bulk_ring=bulk_ring,
        slot_major=slot_major,
        null_policy=null_policy,
        index_dtype=cdt(index_dtype),
        varlen=varlen,
        realign_pool=realign_pool,
    )
    return cute.compile(kernel, *fake_args, options=_launch.compile_options(arch, _EXTRA_OPTIONS))


_EXTRA_OPTIONS = ""  # tests set "--keep-ptx --dump-dir D" through compile_variant()

PACKED_TOKENS = "tokens"
"""The ``packed`` value of a variant key whose compiled function takes the token form (:class:`KDADecodeT1PackedTokens`,
:func:`kda_decode_t1_packed_tokens`)."""


def variant_key(*, state_dtype, g_dtype, beta_dtype, gate, beta_is_logit, use_qk_l2norm, has_dt_bias, tile_v, aligned,
                rows_in_flight=0, cache_hint="stream", bulk_ring=0, slot_major=False, packed=False,
                null_policy=NullSlotPolicy.OUT_OF_RANGE, index_dtype=torch.int32, cu_dtype=None, realign_pool=False):
    """Every code-generation parameter of one variant, in the order ``_compile`` reads them (the signature's).

    ``packed``: the compiled function takes the packed GEMM rows (:class:`KDADecodeT1Packed`) instead of five views;
    :data:`PACKED_TOKENS`: the rows with the gate, beta and output in the token form (:class:`KDADecodeT1PackedTokens`).
    ``rows_in_flight``: normalised to the effective count (:func:`rows_in_flight_for`).
    ``bulk_ring``: normalised by :func:`bulk_ring_for`; a ring replaces rows in flight and the cache hint (normalised
    away). ``slot_major``: normalised to its static conditions (tile 128, aligned). ``null_policy``: which slot
    indices are null (:class:`kda_core.contracts.NullSlotPolicy`, docs/design.md §4). ``index_dtype``: the slot
    indices' dtype, torch.int32 or torch.int64 (read as they are and compared in their width). ``cu_dtype``: None,
    or the varlen form's cu_seqlens dtype (torch.int32 / torch.int64; :class:`KDADecodeT1Varlen`, never slot-major,
    not packed). ``realign_pool``: the pool-realigning variant (:meth:`KDADecodeT1.update_state_realigned`: the
    pool's pointer and slot stride anything, its rows read in aligned vectors); ``aligned`` is then the class of the
    other tensors (activations, dt_bias, output: vectors or element-wise). Its ring is
    :meth:`KDADecodeT1.update_state_realigned_ring` (from ``REALIGNED_RING_MIN`` chunks deep, else normalised away);
    it has no slot-major grid (normalised away).
    """
    null_policy = NullSlotPolicy(null_policy)  # an enum member, or its value
    realign_pool = bool(realign_pool)
    if realign_pool:
        slot_major = False
    if index_dtype not in (torch.int32, torch.int64):
        fail("slot_indices", "dtype int32 or int64", index_dtype)
    if cu_dtype is not None:
        if cu_dtype not in (torch.int32, torch.int64):
            fail("cu_seqlens", "dtype int32 or int64", cu_dtype)
        if packed:
            fail("cu_seqlens", "the unpacked entry (the varlen form has no packed one)", "packed=True")
        slot_major = False
    if gate == GateMode.PRECOMPUTED:
        has_dt_bias = False
    if cache_hint not in CACHE_HINTS:
        fail("cache_hint", f"one of {CACHE_HINTS}", cache_hint)
    rows_in_flight = rows_in_flight_for(tile_v, state_dtype.itemsize, rows_in_flight)
    bulk_ring = bulk_ring_for(tile_v, state_dtype.itemsize, aligned, bulk_ring, realigned=realign_pool)
    if bulk_ring:
        rows_in_flight, cache_hint = 0, "stream"
    slot_major = bool(slot_major) and slot_major_compiles(tile_v, aligned)
    return (state_dtype, g_dtype, beta_dtype, gate, bool(beta_is_logit), bool(use_qk_l2norm), bool(has_dt_bias),
            int(tile_v), bool(aligned), int(rows_in_flight), str(cache_hint), int(bulk_ring), slot_major,
            PACKED_TOKENS if packed == PACKED_TOKENS else bool(packed),
            null_policy, index_dtype, cu_dtype, realign_pool)


def compile_variant(key, arch: str, extra_options: str = ""):
    """Compile one variant outside the cache (CI compile checks, PTX dumps)."""
    global _EXTRA_OPTIONS
    saved, _EXTRA_OPTIONS = _EXTRA_OPTIONS, extra_options
    try:
        return _compile(key, arch)
    finally:
        _EXTRA_OPTIONS = saved


def kda_decode_t1(
    q,
    k,
    v,
    g,
    beta,
    state_pool,
    slot_indices,
    *,
    A_log=None,
    dt_bias=None,
    lower_bound=None,
    use_gate_in_kernel=True,
    beta_is_logit=True,
    use_qk_l2norm_in_kernel=True,
    scale=None,
    output=None,
    null_policy=NullSlotPolicy.OUT_OF_RANGE,
    config=None,
):
    """One T=1 KDA decode step, updating ``state_pool`` in place. Returns ``output``.

    Args (B sequences, H heads, K = V = 128):
        q, k, v: [B, 1, H, 128] bf16, last dim contiguous (other strides free: views of a fused QKV output).
        g: [B, 1, H, 128] bf16 (or fp32): the raw gate (``use_gate_in_kernel=True``) or the log-space decay.
        beta: [B, 1, H] bf16 or fp32: a logit (``beta_is_logit=True``) or already sigmoided.
        state_pool: [N, H, 128, 128] bf16 or fp32, K contiguous, dim-0 stride any number of elements >= the row
            (one that is not a 16-byte multiple takes the unaligned variant).
        slot_indices: [B] int32 or int64, any stride. A null slot makes its row inactive: zero output, pool
            neither read nor written.
        A_log: [H] fp32 (in-kernel gate). dt_bias: [H*128] or [H, 128] fp32, optional.
        lower_bound: float < 0 for the Kimi K3 gate ``lb * sigmoid(exp(A_log) * x)``; None for the softplus gate.
        use_gate_in_kernel: False means ``g`` is already log-space (A_log, dt_bias, lower_bound are ignored).
        scale: query scale, default 128 ** -0.5. output: [B, 1, H, 128] bf16, allocated when None.
        null_policy: which slots are null (docs/design.md §4): ``NullSlotPolicy.OUT_OF_RANGE`` (kda, SGLang:
            idx < 0 or idx >= N) or ``NullSlotPolicy.NONPOSITIVE`` (vLLM: idx <= 0 or idx >= N; slot 0 is never read
            or written). A compile-time constant of the kernel.
        config: a :class:`DecodeT1Config` to run instead of the schedule's (:func:`select_config`; None = that);
            fitted to the call by :func:`effective_config`. For sweeps and tests; serving leaves it None.

    Duplicate active slots in one call are a caller error (on the batch-major grid two CTAs race on one state; on
    the slot-major grid, see :class:`DecodeT1Config`, the first row naming a slot updates it and the others get zero
    output).
    No host sync, no allocation when ``output`` is given; safe under CUDA-graph capture.

    Example::

        out = kda_decode_t1(q, k, v, g, beta, pool, slots, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0)
    """
    call = revalidate_decode_t1(q, k, v, g, beta, state_pool, slot_indices, A_log, dt_bias, lower_bound,
                                use_gate_in_kernel, beta_is_logit, scale, output)
    if debug_checks_enabled():  # KDA_DEBUG_VALIDATE (off: one knob lookup): duplicate active slots
        _debug_check_slots(slot_indices, call.N, null_policy)
    try:
        return _run(call, q, k, v, g, beta, state_pool, slot_indices, A_log, dt_bias, use_qk_l2norm_in_kernel, output,
                    null_policy, config)
    except WRAPPER_REJECTED:  # the compiled wrapper refused an argument, nothing launched (kda-core's contract):
        # the full validator names it
        validate_decode_t1(q, k, v, g, beta, state_pool, slot_indices, A_log=A_log, dt_bias=dt_bias,
                           lower_bound=lower_bound, use_gate_in_kernel=use_gate_in_kernel,
                           beta_is_logit=beta_is_logit, scale=scale, output=output)
        raise


def kda_decode_t1_packed(
    mixed_qkv,
    raw_gate,
    raw_beta,
    state_pool,
    slot_indices,
    *,
    num_heads,
    A_log=None,
    dt_bias=None,
    lower_bound=None,
    use_gate_in_kernel=True,
    beta_is_logit=True,
    use_qk_l2norm_in_kernel=True,
    scale=None,
    output=None,
    null_policy=NullSlotPolicy.OUT_OF_RANGE,
    config=None,
):
    """:func:`kda_decode_t1` on the packed rows of one GEMM output (the same kernel; no torch views are made).

    mixed_qkv [B, 3*H*128] laid out [q heads | k heads | v heads]; raw_gate [B, H*128]; raw_beta [B, H]; row
    strides may exceed the row. Other arguments as :func:`kda_decode_t1`; returns output [B, 1, H, 128].
    """
    call = revalidate_packed_decode_t1(mixed_qkv, raw_gate, raw_beta, state_pool, slot_indices, num_heads, A_log,
                                       dt_bias, lower_bound, use_gate_in_kernel, beta_is_logit, scale, output)
    if debug_checks_enabled():  # as in kda_decode_t1
        _debug_check_slots(slot_indices, call.N, null_policy)
    try:
        return _run_packed(call, mixed_qkv, raw_gate, raw_beta, state_pool, slot_indices, A_log, dt_bias,
                           use_qk_l2norm_in_kernel, output, null_policy, config)
    except WRAPPER_REJECTED:  # as in kda_decode_t1
        validate_packed_decode_t1(
            mixed_qkv, raw_gate, raw_beta, state_pool, slot_indices, num_heads=num_heads, A_log=A_log,
            dt_bias=dt_bias, lower_bound=lower_bound, use_gate_in_kernel=use_gate_in_kernel,
            beta_is_logit=beta_is_logit, scale=scale, output=output,
        )
        raise


def kda_decode_t1_packed_tokens(
    mixed_qkv,
    raw_gate,
    raw_beta,
    state_pool,
    slot_indices,
    *,
    A_log=None,
    dt_bias=None,
    lower_bound=None,
    use_gate_in_kernel=True,
    beta_is_logit=True,
    use_qk_l2norm_in_kernel=True,
    scale=None,
    output=None,
    null_policy=NullSlotPolicy.OUT_OF_RANGE,
    config=None,
):
    """:func:`kda_decode_t1_packed` in the token form, vLLM Kimi K3's plain-decode tensors as that engine passes them:
    mixed_qkv [B, 3*H*128]; raw_gate [1, B, H, 128] with each token's [H, 128] compact (token stride free); raw_beta
    [1, B, H] (any strides); output None (allocated) or bf16 [1, B, H, 128] (token and head strides free). H is
    raw_gate's dim 2. The compiled function takes these tensors as they are (no torch view per call); the kernel
    reads the same elements as :func:`kda_decode_t1_packed` on their [B, H*128], [B, H] and [B, 1, H, 128] views.
    Other arguments as :func:`kda_decode_t1`; returns output [1, B, H, 128].
    """
    call = revalidate_packed_tokens_decode_t1(mixed_qkv, raw_gate, raw_beta, state_pool, slot_indices, A_log,
                                              dt_bias, lower_bound, use_gate_in_kernel, beta_is_logit, scale, output)
    if debug_checks_enabled():  # as in kda_decode_t1
        _debug_check_slots(slot_indices, call.N, null_policy)
    try:
        return _run_packed_tokens(call, mixed_qkv, raw_gate, raw_beta, state_pool, slot_indices, A_log, dt_bias,
                                  use_qk_l2norm_in_kernel, output, null_policy, config)
    except WRAPPER_REJECTED:  # as in kda_decode_t1
        validate_packed_tokens_decode_t1(
            mixed_qkv, raw_gate, raw_beta, state_pool, slot_indices, A_log=A_log, dt_bias=dt_bias,
            lower_bound=lower_bound, use_gate_in_kernel=use_gate_in_kernel, beta_is_logit=beta_is_logit, scale=scale,
            output=output,
        )
        raise


def _debug_check_slots(slot_indices, N, null_policy):
    """kda-core's duplicate check (debug mode only: it syncs) on the slots that are live under ``null_policy``
    (under NONPOSITIVE slot 0 is null: any number of rows may name it)."""
    debug_check_slots(slot_indices, N, null_policy=null_policy)


# Per-call launch memo. Key: (id of the validated call description, packed, l2norm, device index, the parsed
# KDA_DECODE_TILE_V, whether dt_bias is absent, the null policy, the requested config or None). A description
# (kda-core's DecodeT1Call or RecurrentCall) is immutable and remembered by every fact a variant and the schedule
# depend on (B, H, pool rows, pool dtype, g / beta dtypes, gate mode, lower bound, beta logit, scale, alignment
# class), so its identity stands for all of them; the entry holds the description itself, so its id cannot be reused
# by another object while the entry lives. Value: (description, compiled function (or its batch-split wrapper) or
# None when B == 0, scale, lower bound as the kernel's float, gate in kernel, B, H, owner of the compiled module).
_LAUNCH_MEMO: dict[tuple, tuple] = {}
_LAUNCH_MEMO_MAX = 1024


def _configure(memo_key, call, packed, l2norm, x, g_dtype, beta_dtype, has_dt_bias,
               null_policy=NullSlotPolicy.OUT_OF_RANGE, config=None, index_dtype=torch.int32, cu_dtype=None,
               rows=None):
    """Schedule (``config`` fitted to the call, or the policy's) + compiled variant of one validated call; stores its
    launch memo entry under ``memo_key`` (built by the caller, ``_run`` / ``_run_packed``, from the facts listed at
    ``_LAUNCH_MEMO``). ``index_dtype``: the slot indices' (also a fact of kda-core's description). ``cu_dtype``: the
    varlen form's offsets (:func:`_run_varlen`); ``rows``: the CTA rows of the grid, ``call.B`` when None (the
    varlen form passes its number of sequences).
    """
    gated = call.gate_mode is not GateMode.PRECOMPUTED
    fn = compiled = None
    B = call.B if rows is None else rows
    if B > 0:  # (H, on grid y, is one of kda-core's HEAD_COUNTS: at least 8, far below the grid's limit)
        if not isinstance(null_policy, NullSlotPolicy):
            fail("null_policy", "a NullSlotPolicy", repr(null_policy))
        varlen = cu_dtype is not None
        if varlen and B > GRID_Z_MAX:  # one CTA row per sequence on gridDim.z, not split (the edge zeros)
            fail("cu_seqlens", f"at most {GRID_Z_MAX} sequences per call (grid z limit)", B)
        # The schedule and the config are fitted to the call's class (call.aligned: a ring and a slot-major grid need
        # every tensor aligned). A call that is not takes the pool-realigning variant (the pool in vectors whatever
        # its slot stride; a slot that happens to be aligned reads as in the aligned variant), with the other tensors
        # in vectors when they are aligned (call.others_aligned), else element-wise.
        realign_pool = not call.aligned
        if config is None:  # (varlen: pool rows not given, so the policy never picks the slot-major grid)
            cfg = select_config(B, call.H, call.state_dtype, call.aligned, None if varlen else call.N, realign_pool)
        elif isinstance(config, DecodeT1Config):
            cfg = effective_config(config, B, call.state_dtype, call.aligned, call.N, realign_pool)
        else:
            fail("config", "a DecodeT1Config or None", type(config).__name__)
        # dt_bias is optional with the gate in the kernel (absent = zeros), ignored without it.
        key = variant_key(state_dtype=call.state_dtype, g_dtype=g_dtype, beta_dtype=beta_dtype, gate=call.gate_mode,
                          beta_is_logit=call.beta_is_logit, use_qk_l2norm=l2norm, has_dt_bias=gated and has_dt_bias,
                          tile_v=cfg.tile_v, aligned=call.others_aligned if realign_pool else call.aligned,
                          rows_in_flight=cfg.rows_in_flight,
                          cache_hint=cfg.cache_hint, bulk_ring=cfg.bulk_ring, slot_major=cfg.slot_major, packed=packed,
                          null_policy=null_policy, index_dtype=index_dtype, cu_dtype=cu_dtype,
                          realign_pool=realign_pool)
        compiled = _launch.get_or_compile(key, lambda arch: _compile(key, arch), _launch.arch_for(x.device))
        # The positional tvm_ffi.Function under the DSL's kwargs wrapper (same arguments, a few us less per call);
        # the compiled object rides along so that the module outlives any cache clearing.
        raw = getattr(compiled, "__tvm_ffi_object__", None)
        fn = (raw() if raw is not None else None) or compiled
        if not cfg.slot_major and not varlen and B > GRID_Z_MAX:
            if packed == PACKED_TOKENS:
                fn = _batch_split(fn, B, _TOKENS_BATCH_ARGS, _TOKENS_TOKEN_ARGS)
            else:
                fn = _batch_split(fn, B, _PACKED_BATCH_ARGS if packed else _BATCH_ARGS)
    lower_bound = call.lower_bound
    entry = (call, fn, call.scale, -1.0 if lower_bound is None else float(lower_bound), gated, B, call.H, compiled)
    if len(_LAUNCH_MEMO) >= _LAUNCH_MEMO_MAX:  # many distinct call shapes: start over rather than grow
        _LAUNCH_MEMO.clear()
    _LAUNCH_MEMO[memo_key] = entry
    return entry


_BATCH_ARGS = (0, 1, 2, 3, 4, 8, 9)  # q, k, v, g, beta, slot_indices, output of the unpacked function
_PACKED_BATCH_ARGS = (0, 1, 2, 6, 7)  # mixed_qkv, raw_gate, raw_beta, slot_indices, output of the packed one
_TOKENS_BATCH_ARGS = (0, 6)  # mixed_qkv, slot_indices of the token form
_TOKENS_TOKEN_ARGS = (1, 2, 7)  # raw_gate, raw_beta, output of the token form: rows on dim 1


def _batch_split(fn, B: int, batch_args: tuple, token_args: tuple = ()):
    """The batch-major grid puts B on gridDim.z (at most ``GRID_Z_MAX``): a larger batch runs as several launches
    of at most ``GRID_Z_MAX`` rows each, on views of the batch-indexed arguments (rows are independent; a view's
    pointer moves by whole row strides, so the alignment class is kept). ``token_args``: arguments whose rows are
    on dim 1 (the token form's [1, B, ...] tensors)."""

    def launch_in_parts(*args):
        for b0 in range(0, B, GRID_Z_MAX):
            part = list(args)
            for i in batch_args:
                part[i] = args[i][b0 : b0 + GRID_Z_MAX]
            for i in token_args:
                part[i] = args[i][:, b0 : b0 + GRID_Z_MAX]
            fn(*part)

    return launch_in_parts


def _launch_args(entry, x, A_log, dt_bias, output):
    """(function or None when B == 0, output (allocated when None), A_log, dt_bias as the kernel takes them, scale,
    lower bound) from a launch memo entry; shared by both entries."""
    _, fn, scale, lower_bound, gated, B, H, _ = entry
    if output is None:
        output = torch.empty((B, 1, H, HEAD_DIM), dtype=torch.bfloat16, device=x.device)
    if not gated:
        A_log = dt_bias = None
    elif dt_bias is not None and dt_bias.dim() != 1:
        dt_bias = dt_bias.view(-1)
    return fn, output, A_log, dt_bias, scale, lower_bound


def _run(call, q, k, v, g, beta, state_pool, slot_indices, A_log, dt_bias, l2norm, output,
         null_policy=NullSlotPolicy.OUT_OF_RANGE, config=None):
    """Launch a validated unpacked call: ``call`` is kda-core's description of exactly these arguments
    (``validate_decode_t1``, or ``validate_recurrent`` for the facade, which calls this directly). ``null_policy``
    and ``config``: as :func:`kda_decode_t1`'s.

    Per call: one memo lookup (the knob read is a dict lookup, see ``kda_core.knobs``) and the FFI call.
    """
    key = (id(call), False, l2norm, q.get_device(), knobs.get("KDA_DECODE_TILE_V"), dt_bias is None, null_policy,
           config)  # the _LAUNCH_MEMO key, spelled out: hot path
    entry = _LAUNCH_MEMO.get(key) or _configure(key, call, False, l2norm, q, g.dtype, beta.dtype, dt_bias is not None,
                                                null_policy, config, slot_indices.dtype)
    fn, output, A_log, dt_bias, scale, lower_bound = _launch_args(entry, q, A_log, dt_bias, output)
    if fn is None:  # B == 0
        return output
    fn(q, k, v, g, beta, A_log, dt_bias, state_pool, slot_indices, output, scale, lower_bound)
    return output


def _run_packed(call, mixed_qkv, raw_gate, raw_beta, state_pool, slot_indices, A_log, dt_bias, l2norm, output,
                null_policy=NullSlotPolicy.OUT_OF_RANGE, config=None):
    """:func:`_run` for a validated packed call: the GEMM rows go to the compiled function as they are."""
    key = (id(call), True, l2norm, mixed_qkv.get_device(), knobs.get("KDA_DECODE_TILE_V"), dt_bias is None,
           null_policy, config)  # as in _run
    entry = _LAUNCH_MEMO.get(key) or _configure(key, call, True, l2norm, mixed_qkv, raw_gate.dtype, raw_beta.dtype,
                                                dt_bias is not None, null_policy, config, slot_indices.dtype)
    fn, output, A_log, dt_bias, scale, lower_bound = _launch_args(entry, mixed_qkv, A_log, dt_bias, output)
    if fn is None:  # B == 0
        return output
    fn(mixed_qkv, raw_gate, raw_beta, A_log, dt_bias, state_pool, slot_indices, output, scale, lower_bound)
    return output


def _run_packed_tokens(call, mixed_qkv, raw_gate, raw_beta, state_pool, slot_indices, A_log, dt_bias, l2norm,
                       output, null_policy=NullSlotPolicy.OUT_OF_RANGE, config=None):
    """:func:`_run_packed` for a validated call in the token form (:func:`kda_decode_t1_packed_tokens`): raw_gate
    [1, B, H, 128], raw_beta [1, B, H] and output [1, B, H, 128] (allocated when None) go to the compiled function
    as they are."""
    key = (id(call), PACKED_TOKENS, l2norm, mixed_qkv.get_device(), knobs.get("KDA_DECODE_TILE_V"), dt_bias is None,
           null_policy, config)  # as in _run
    entry = _LAUNCH_MEMO.get(key) or _configure(key, call, PACKED_TOKENS, l2norm, mixed_qkv, raw_gate.dtype,
                                                raw_beta.dtype, dt_bias is not None, null_policy, config,
                                                slot_indices.dtype)
    if output is None:
        output = torch.empty((1, call.B, call.H, HEAD_DIM), dtype=torch.bfloat16, device=mixed_qkv.device)
    fn, output, A_log, dt_bias, scale, lower_bound = _launch_args(entry, mixed_qkv, A_log, dt_bias, output)
    if fn is None:  # B == 0
        return output
    fn(mixed_qkv, raw_gate, raw_beta, A_log, dt_bias, state_pool, slot_indices, output, scale, lower_bound)
    return output


def _run_varlen(call, q, k, v, g, beta, state_pool, slot_indices, cu_seqlens, A_log, dt_bias, l2norm, output,
                null_policy=NullSlotPolicy.OUT_OF_RANGE, config=None):
    """Launch a validated varlen decode call (:class:`KDADecodeT1Varlen`): q, k, v, g [1, T, H, 128], beta [1, T, H],
    slot_indices [S], cu_seqlens [S + 1] int32 / int64, output [1, T, H, 128] (allocated when None). Returns output.

    ``call`` is kda-core's description of exactly these arguments: ``validate_recurrent``'s of the facade's call ``[1,
    T, H, 128]`` + ``cu_seqlens`` in pool mode (the facade's ``Path.T1_VARLEN``; dtypes, gate, scale, pool rows, the
    alignment class of every pointer, token and slot stride), or a T=1 description of the same tokens (tests); the
    sequence count S is ``slot_indices``' length, never ``call.B``. The offsets are device data, read and bounded in the
    kernel (docs/design.md §4): sequence n owns tokens [clamp(cu[n], 0, T), clamp(cu[n + 1], that, T)); tokens before
    the first and from the end of the last get zero output. A one-token sequence takes the T=1 path; any other length
    the kernel's token loop (exact; for serving calls that are decode by construction); an empty one leaves its slot
    untouched; a null slot zeroes its tokens.
    ``config`` (the slot-major grid never runs here) and ``null_policy`` as :func:`kda_decode_t1`'s.
    """
    S = slot_indices.shape[0]
    if cu_seqlens.shape[0] != S + 1:  # the kernel reads offsets 0..S
        fail("cu_seqlens", f"shape [{S + 1}] (one more than slot_indices)", tuple(cu_seqlens.shape))
    T = q.shape[1]
    if output is None:
        output = torch.empty((1, T, call.H, HEAD_DIM), dtype=torch.bfloat16, device=q.device)
    key = ("varlen", id(call), S, l2norm, q.get_device(), knobs.get("KDA_DECODE_TILE_V"), dt_bias is None,
           null_policy, config, slot_indices.dtype, cu_seqlens.dtype)  # as in _run, marked; S and both index dtypes
    entry = _LAUNCH_MEMO.get(key) or _configure(key, call, False, l2norm, q, g.dtype, beta.dtype, dt_bias is not None,
                                                null_policy, config, slot_indices.dtype, cu_seqlens.dtype, rows=S)
    fn, output, A_log, dt_bias, scale, lower_bound = _launch_args(entry, q, A_log, dt_bias, output)
    if fn is None or T == 0:  # no sequence, or no token (every sequence empty: nothing to read or write)
        return output
    fn(q, k, v, g, beta, A_log, dt_bias, state_pool, slot_indices, cu_seqlens, output, scale, lower_bound)
    return output
