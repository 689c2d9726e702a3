"""ReplaySSM "ucache" verify+flush kernel for KDA speculative decode (docs/design.md §5).

One CTA per (V tile, head, request). Two threads per state row: a quad of four threads shares a state row pair (a
warp covers 16 rows; a thread holds 32 of the 128 key channels of two rows, in four interleaved 16-byte chunks). Per
(request, head) the CTA first builds, in shared memory:

- the gate of the T draft tokens, the per-token decays a_t and, in registers, their running sum ``cum`` (the decay
  restarts at 0 after the checkpoint); raw k and q (normalised only in the solve);
- the decayed draft vectors ``x_s = [exp(cum_s) k_s; exp(cum_s) q_s]`` as bf16 hi/lo MMA operands, once as is and
  once times ``bdec = exp(G_{P-1})``;
- the replay vectors ``wk_j = exp(G_{P-1} - G_j) * k^_j`` of the live ring rows j < P (rows j >= P are *selected*
  to zero, never multiplied: stale rows may hold inf) and ``M[j, s] = wk_j . x_s`` (warp MMA);
- the T x T triangles ``A[s, r] = sum_c exp(cum_s - cum_r) k_r k_s`` (r < s) and ``Aq[s, r]`` (k_r q_s, r <= s) on
  raw k, q, with exp(cum_s - cum_r) the running product of the per-token decays: never a ratio of exponentials,
  so strong decay (cum down to -40 and beyond) cannot overflow; the diagonal gives the norms of k_s and q_s.

Then every state row v gets its 2T dot products without building the committed state (docs/design.md §5, R2):
``S_commit[v] x_s = S0[v] (bdec x_s) + sum_{j<P} u_j[v] M[j, s]`` (the bf16 checkpoint is an exact MMA operand),
and the T drafts follow from the small triangular recurrence (the chunked WY form of docs/design.md §3), one row per
thread:

    u_s = beta_s (v_s - S_commit kx^_s - sum_{r<s} A^[s, r] u_r),    o_s = S_commit qx^_s + sum_{r<=s} Aq^[s, r] u_r

A flush row also builds ``S_commit[v] = S0[v] * bdec + sum_{j<P} u_j[v] wk_j`` (R1, fp32, warp MMA) and stores it
once (bf16, round to nearest even). The post-draft state is never needed (the ring keeps its ingredients), so no
rank-1 updates run. Appends: u_s rows of this CTA's V tile; k^_s and G (cum_s, plus G_{P-1} on a verify row) once
per (request, head) by the CTA of V tile 0. All appends land at (base + P + s) & 31, past the live window every
CTA of the same (request, head) reads, so no CTA overwrites a row another still needs.

Rows whose slot is null (outside [0, pool), or 0 too under the NONPOSITIVE policy: docs/design.md §4) are inactive:
their output is zero and nothing else is read or written.
The cursors (hist_len, cache_base) are only read here; the caller's commit is applied by the wrapper in
kda-recurrent.

The same kernel with no ring (``UcacheVerifyFlush(..., ring=False)``, launcher :func:`frozen_verify`) is spec
decode's frozen verify: P = 0 at compile time, so it reads the checkpoint, writes the outputs and, optionally, vLLM
RecoverSSM's per-token records; it also takes varlen rows and fp32 checkpoints (docs/ucache.md, "The frozen verify").
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T as ir_types

from kda_core.contracts import HEAD_DIM, RING_SLOTS, NullSlotPolicy, max_hist_len
from kda_core.errors import fail
from kda_core.validation import debug_check_slots, debug_checks_enabled

from . import _launch

__all__ = [
    "UcacheVerifyFlush",
    "UcacheRestartCursors",
    "ucache_verify_flush",
    "frozen_verify",
    "build_frozen_kernel",
    "FROZEN_STATE_DTYPES",
    "restart_cursors",
    "build_ucache_kernel",
    "build_restart_kernel",
    "UcacheConfig",
    "select_config",
]

GRID_Z_MAX = 65535  # CUDA's limit on gridDim.z (the requests)
GRID_Y_MAX = 65535  # and on gridDim.y (the heads)
ROW_THREADS = 4
"""Quad positions sharing a state row pair (lane % 4); each owns HEAD_DIM // ROW_THREADS = 32 key channels."""
CHUNK = 8
"""Contiguous bf16 channels per 16-byte pool access."""
CHUNKS_PER_THREAD = HEAD_DIM // (ROW_THREADS * CHUNK)  # 4
L2NORM_EPS = 1e-6
MMA_K = 16
"""K extent of one m16n8k16 MMA; HEAD_DIM // MMA_K = 8 steps cover a state row."""
KQ_PAD = 4
"""Words past each row of the raw k, q and gate tiles in shared memory in the vector-activation build
(:meth:`UcacheVerifyFlush.kq_row`): rows 4 apart (the gate phase's two token groups at T=8) start 16 banks apart."""


def _split_bf16x2(lo: Float32, hi: Float32):
    """(hi part, lo part) of two fp32 values as packed bf16 pairs: x = bf16(x) + bf16(x - bf16(x)) to ~2^-16.

    Three bf16 MMAs (hi*hi + lo*hi + hi*lo) then give the dot products to about fp32 accuracy; a single bf16
    pass was measured (torch emulation of this kernel) to miss the 8e-3 output tolerance by 5x, because the
    triangular recurrence amplifies the error of S_commit . kx_s.
    """
    res = llvm.inline_asm(
        llvm.StructType.get_literal([ir_types.i32(), ir_types.i32()]),
        [lo.ir_value(), hi.ir_value()],
        "{ .reg .b32 h, t0, t1; .reg .f32 f0, f1;"
        " cvt.rn.bf16x2.f32 h, $3, $2;"
        " shl.b32 t0, h, 16; and.b32 t1, h, 0xffff0000;"
        " mov.b32 f0, t0; mov.b32 f1, t1;"
        " sub.f32 f0, $2, f0; sub.f32 f1, $3, f1;"
        " cvt.rn.bf16x2.f32 $1, f1, f0; mov.b32 $0, h; }",
        "=r,=r,f,f",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return (
        Int32(llvm.extractvalue(ir_types.i32(), res, [0])),
        Int32(llvm.extractvalue(ir_types.i32(), res, [1])),
    )


def _pack_bf16x2(lo: Float32, hi: Float32) -> Int32:
    """Two fp32 values as one packed bf16 pair (lo in the low half: the lower MMA k / n index)."""
    return Int32(
        llvm.inline_asm(
            ir_types.i32(),
            [hi.ir_value(), lo.ir_value()],
            "cvt.rn.bf16x2.f32 $0, $1, $2;",
            "=r,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


def _prmt(a: Int32, b: Int32, selector: int) -> Int32:
    """Bytes of (a, b) picked by ``selector`` (PTX prmt: bytes 0-3 from a, 4-7 from b, one nibble per result byte)."""
    return Int32(
        llvm.inline_asm(
            ir_types.i32(),
            [a.ir_value(), b.ir_value()],
            f"prmt.b32 $0, $1, $2, {selector:#x};",
            "=r,r,r",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


def _ld_volatile(ptr, dtype):
    """One 32-bit global load (``Int32`` or ``Float32``; ``Int64``: 64-bit) issued where it is written
    (``ld.volatile``). ptxas sinks an ordinary load below the first branch whose other side does not use it: the
    cursors, loaded with the slot, were issued only after the branch on the slot, one DRAM round trip later (SASS,
    H200 ncu). A volatile load is also never merged with an earlier load of the same address (a reload that keeps a
    value out of the registers in between)."""
    fp = dtype is Float32
    if dtype is Int64:
        res = llvm.inline_asm(ir_types.i64(), [ptr.toint().ir_value()], "ld.volatile.global.b64 $0, [$1];", "=l,l",
                              has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
        return Int64(res)
    res = llvm.inline_asm(
        ir_types.f32() if fp else ir_types.i32(),
        [ptr.toint().ir_value()],
        f"ld.volatile.global.{'f32' if fp else 'b32'} $0, [$1];",
        "=f,l" if fp else "=r,l",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return dtype(res)


def _row_chunks(tensor: cute.Tensor, row, width: int) -> cute.Tensor:
    """Row ``row`` of a 2-D tensor as (width, n) chunks: ``[None, i]`` is the i-th run of ``width`` elements, whose
    alignment the copy can see (16-byte accesses when the tensor allows them)."""
    return cute.zipped_divide(tensor[row, None], (width,))


def _pair_sum(kept: Float32, sent: Float32) -> Float32:
    """Level 0 of :func:`_lane_sums` for one pair of values (2j, 2j + 1) that the lane computed in (kept, sent)
    order already (even lanes keep value 2j, odd lanes value 2j + 1): one shuffle and one add, no selects."""
    return kept + cute.arch.shuffle_sync_bfly(sent, offset=1)


def _lane_sums(vals, bits, first_level: int = 0):
    """Totals over the 32 lanes of a warp of up to 32 per-lane partial sums, transposed: lane i < len(vals) ends
    with the total of value i (lanes past the list end with copies or padding: never store them).

    ``bits[l]``: lane bit l is set. Butterfly level l (offset 2^l) pairs the entries (2j, 2j + 1) of the current
    list: lanes with bit l set keep entry 2j + 1 and send entry 2j to their partner, the others the reverse, so each
    level halves the list at one shuffle, one add and two selects per pair instead of reducing every value over all
    5 levels (5 shuffles and 5 adds each). After level l a lane's entry j stands for value j 2^(l+1) + (lane mod
    2^(l+1)). An unpaired last entry is summed whole (its missing partner would stand for values >= V only); once the
    list is one entry the remaining levels are plain butterflies. ``first_level``: the levels below it ran already
    (``vals`` is then that level's list, e.g. of :func:`_pair_sum` results for first_level=1).
    """
    cur = list(vals)
    for lvl in range(first_level, 5):
        off = 1 << lvl
        nxt = []
        for j in range(0, len(cur), 2):
            a = cur[j]
            if j + 1 == len(cur):
                nxt.append(a + cute.arch.shuffle_sync_bfly(a, offset=off))
            else:
                b = cur[j + 1]
                send = Float32(cutlass.select_(bits[lvl], a, b))
                keep = Float32(cutlass.select_(bits[lvl], b, a))
                nxt.append(keep + cute.arch.shuffle_sync_bfly(send, offset=off))
        cur = nxt
    return cur[0]


PAIR_ROW = HEAD_DIM + 4
"""Words per row of a bf16-pair operand packed along channels (64 pairs x (hi, lo), + 4): the 16-byte fragment
reads of a quarter warp (rows r, r + 1 at 4 quad positions 8 words apart) then hit 32 banks."""


def _pair_group(step, quad_pos):
    """16-byte group of channel pairs (2i, 2i + 1) standing for k-pairs (q, q + 4) of k-step ``step`` in the
    channel-packed MMA operands: the channels 32 (step // 2) + 8q + 4 (step % 2) + 0..3 of the checkpoint chunk
    that quad position q holds (see the state-row phase), so the checkpoint's bf16 words are B operands as is."""
    return ((step // 2) * ROW_THREADS + quad_pos) * 2 + step % 2


def _wk_slot(channel, pair, kpad: int):
    """Where ring-row pair ``pair`` sits in ``channel``'s column of the fold's wk operand.

    The m16n8k16 B fragment of k-step ks for quad position q is the pairs ks*8 + q and ks*8 + q + 4 (ring rows
    2q, 2q+1 and 2q+8, 2q+9 of the step): they get slots 2i and 2i + 1 of one 16-byte group (hi, hi, lo, lo: each
    MMA operand is a register pair), so one read gives both. With two k-steps (32 ring rows) odd channels swap
    the steps' halves, so that the reads of channels c and c + 1 by one quarter warp hit different banks.
    """
    step = pair // 8
    if kpad == 2 * MMA_K:
        step = step ^ (channel % 2)
    return step * 8 + 2 * (pair % 4) + (pair // 4) % 2


def _fold_group(channel, step, quad_pos, kpad: int):
    """16-byte group of ``channel``'s column of the fold's wk operand holding k-step ``step``'s B fragment for quad
    position ``quad_pos``: (hi, hi, lo, lo) of ring-row pairs step*8 + q and step*8 + q + 4, each MMA operand a
    register pair.

    Swizzled so that both access patterns spread over the banks: a quarter warp reads channels c, c + 1 (c even) at
    4 quad positions (the column stride, 16 words, or the flipped step bit with 32 ring rows, puts c and c + 1 in
    different bank halves), and the producer writes 8 consecutive channel quads at one (step, q) (the XOR with
    (c // 4) % 4 spreads them over 4 groups: 2-way at most).
    """
    group = (4 * step + quad_pos) ^ ((channel // 4) % 4)
    if kpad == 2 * MMA_K:
        group = group ^ (4 * (channel % 2))
    return group


def _mma_bf16_m16n8k16(a, b, c):
    """D = A B + C, one warp-wide SM80-style MMA (bf16 in, fp32 accumulate; sm_80 and later, incl. sm_90a and
    sm_100a). a: 4 packed i32, b: 2 packed i32, c: 4 fp32 (row g: c0 c1, row g + 8: c2 c3)."""
    res = llvm.inline_asm(
        llvm.StructType.get_literal([ir_types.f32()] * 4),
        [x.ir_value() for x in (*a, *b, *c)],
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return [Float32(llvm.extractvalue(ir_types.f32(), res, [i])) for i in range(4)]


# Resident CTAs per SM asked of ptxas by default (``min_blocks_per_mp``: it caps the registers to fit), per tile,
# always capped at what shared memory lets reside (UcacheVerifyFlush.ctas_by_smem: a floor above it only takes
# registers away; tile 64 T=8 w16 fits 4, T=8 w32 fits 2 at either tile; the cap is not measured on hardware).
# Without a floor the 256-thread tile-128 CTA takes 102 registers: 2 CTAs per SM, and ncu shows it issue-bound
# (IPC 1.6). Tile 128 asks for 4 (64 registers: its shared memory fits 4 CTAs at T=8 w16), tile 64 for 5.
MIN_CTAS_PER_SM = {64: 5, 128: 4}
SM_SMEM_BYTES = 228 * 1024
"""Shared memory of one SM with the largest carveout on sm_90a and sm_100a (H100/H200, B200)."""
CTA_SMEM_RESERVED = 1024
"""Shared memory the driver reserves per resident CTA (sm_80 and later); allocations come in 128-byte granules."""
TILES = (64, 128)


@dataclass(frozen=True)
class UcacheConfig:
    """Schedule of one launch: ``tile_v`` state rows per CTA (64 or 128; the grid is (128 / tile_v, H, B)) and
    ``min_ctas``, the resident CTAs per SM asked of ptxas (it caps the registers; capped in turn at what shared
    memory allows; 0 = ``MIN_CTAS_PER_SM[tile_v]``). The schedule policy :func:`select_config` returns one; a sweep
    passes its own."""

    tile_v: int
    min_ctas: int = 0

    @property
    def floor(self) -> int:
        """The resident-CTA floor asked (before the shared-memory cap)."""
        return self.min_ctas or MIN_CTAS_PER_SM[self.tile_v]


# The schedule policy: (max B*H (request, head) pairs, config), first row that holds the call. Every CTA repeats the
# per-(request, head) preamble, about as many instructions as its share of the state rows: tile 128 runs it once
# per pair, tile 64 twice but gives small grids twice the CTAs. Tile-128 grids under 1536 pairs ask for 3 CTAs
# (80 registers), which beat 4 below B=128 at H=12 at both fold rates; from there 4 win the verify-only steps.
# H200, 2026-11-29 (tiles) and 2026-12-01 (floors): benchmarks/bench_kda_ucache_flush.py --t 8 --w-ring 16
# --fold-pct 0 100 --no-fla with --tile-v 64 128 and --min-blocks 3 4 (docs/ucache.md has the figures).
_SCHEDULE = (
    (95, UcacheConfig(64)),
    (1535, UcacheConfig(128, min_ctas=3)),
    (1 << 62, UcacheConfig(128)),
)


def select_config(batch: int, heads: int) -> UcacheConfig:
    """Pure schedule policy: the config for ``batch`` requests of ``heads`` heads."""
    states = batch * heads
    for max_states, config in _SCHEDULE:
        if states <= max_states:
            return config
    raise AssertionError("unreachable: the schedule's last row is unbounded")


class UcacheVerifyFlush:
    """Compile-time configuration of one ucache verify+flush kernel.

    heads: H == HV; t_draft: T in {4, 8}; w_ring: 16 or 32 (bounds the live rows kept in shared memory);
    tile_v: state rows per CTA; softplus_gate: Kimi-Linear gate (lower_bound None) instead of the lower bound;
    aligned: the pool and rings allow 16-byte accesses (else the same code with element-wide accesses);
    min_ctas: the resident-CTA floor asked of ptxas (0 = ``MIN_CTAS_PER_SM[tile_v]``), capped by shared memory;
    null_policy: which slots make a row inactive (docs/design.md §4; NONPOSITIVE never touches slot 0);
    slot_int64: the slot indices are int64 (compared in 64 bits); slots_strided: their stride is a runtime value
    (a column of a wider table) instead of 1.

    ring=False builds the frozen verify (:func:`frozen_verify`): the history is statically empty (P = 0), so there
    are no cursors, ring loads, replay vectors, M or U M products, flush or appends; the kernel reads the checkpoint
    ``state_pool[slot]`` and writes the outputs, and (``records``) the RecoverSSM records: u_s of the CTA's rows to
    the correction cache (fp32), raw k_s | raw g_s to the kg cache (V tile 0). ``varlen``: the activations are
    [1, tokens, H, 128] with the rows' tokens given by cu_seqlens (``cu_int64``: int64 offsets); a row runs
    min(length, T) tokens, the missing ones masked to contribute nothing. ``pool_fp32``: an fp32 checkpoint, split
    into bf16 hi + lo MMA operands as it is loaded. ``w_ring`` is ignored there.

    The shared memory is sized for 4 tile-128 CTAs per SM at T=8 w16: the 2T dot products stay in registers across
    the ring correction, so ``sXY`` is only written after it and shares the bytes of the dead x operands (sXb, sXu);
    the flush fold runs one 8-channel chunk at a time (16 accumulators live instead of 64).
    """

    def __init__(
        self,
        heads: int,
        t_draft: int,
        w_ring: int,
        tile_v: int,
        softplus_gate: bool,
        aligned: bool,
        min_ctas: int = 0,
        has_dt_bias: bool = True,
        null_policy: NullSlotPolicy = NullSlotPolicy.OUT_OF_RANGE,
        slot_int64: bool = False,
        slots_strided: bool = False,
        ring: bool = True,
        records: bool = False,
        varlen: bool = False,
        cu_int64: bool = False,
        pool_fp32: bool = False,
    ):
        if not ring:
            w_ring = 0  # no ring: its width generates nothing (one build per frozen configuration)
        if ring and (records or varlen or pool_fp32):
            raise ValueError("records, varlen and pool_fp32 are frozen-verify (ring=False) options")
        self.pool_fp32 = pool_fp32
        self.ring = ring
        self.records = records
        self.varlen = varlen
        self.cu_int64 = cu_int64 and varlen
        self.heads = heads
        self.slot_int64 = slot_int64
        self.slots_strided = slots_strided
        self.first_slot = 1 if null_policy == NullSlotPolicy.NONPOSITIVE else 0  # smallest live slot
        self.has_dt_bias = has_dt_bias  # False: dt_bias absent (zeros), not read
        self.min_ctas = min_ctas  # resident-CTA floor; 0 = MIN_CTAS_PER_SM[tile_v]
        self.aligned = aligned
        self.t_draft = t_draft
        self.w_ring = w_ring
        self.max_rows = max_hist_len(t_draft, w_ring) if ring else 0
        self.tile_v = tile_v
        # ring rows as the K extent of the fold MMA (no ring: 0, the ring tiles are not allocated)
        self.kpad = MMA_K * ((self.max_rows + MMA_K - 1) // MMA_K)
        # row strides (words) of sM and sXY, padded for bank-conflict-free fragment / 16-byte row reads
        self.m_row = self.kpad if self.kpad == 16 else self.kpad + 16
        self.xy_stride = 2 * t_draft + 4
        # one warp per 16 rows (2 rows x 32 channels per thread)
        self.threads = 2 * tile_v
        self.softplus_gate = softplus_gate
        if tile_v not in TILES:
            raise ValueError(f"tile_v: expected one of {TILES}, got {tile_v}")
        # The gate phase gives each key channel NT / 128 threads, each a run of T / (NT / 128) draft tokens.
        assert self.threads % HEAD_DIM == 0 and t_draft % (self.threads // HEAD_DIM) == 0, (self.threads, t_draft)
        assert self.kpad in ((MMA_K, 2 * MMA_K) if ring else (0,)), self.kpad

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mALog: cute.Tensor,
        mDtBias,  # [H*K] fp32, or None (dt_bias absent)
        mPool: cute.Tensor,
        mSlot: cute.Tensor,
        mKCache: cute.Tensor,
        mUCache: cute.Tensor,
        mGCache: cute.Tensor,
        mHist: cute.Tensor,
        mBase: cute.Tensor,
        mOut: cute.Tensor,
        mCorr,  # frozen verify with records: correction cache [N, H, T_max, 128] fp32, else None
        mKG,  # and the kg cache [N, H, T_max, 256] (k's dtype), else None
        mCu,  # varlen frozen verify: cu_seqlens [B + 1] int32 / int64, else None
        scale: Float32,
        lower_bound: Float32,
        flush_min: cutlass.Int32,
        stream,
    ):
        self.kernel(
            mQ,
            mK,
            mV,
            mG,
            mBeta,
            mALog,
            mDtBias,
            mPool,
            mSlot,
            mKCache,
            mUCache,
            mGCache,
            mHist,
            mBase,
            mOut,
            mCorr,
            mKG,
            mCu,
            scale,
            lower_bound,
            flush_min,
        ).launch(
            # the requests: one per slot (the varlen activations' batch dimension is 1)
            grid=[HEAD_DIM // self.tile_v, self.heads, mQ.shape[0] if self.ring else mSlot.shape[0]],
            block=[self.threads, 1, 1],
            stream=stream,
            **self.occupancy(),
        )

    def smem_bytes(self) -> int:
        """Dynamic shared memory of one CTA: the kernel's allocations, in its order (each a multiple of 16 bytes).
        test_ucache_compile checks it against the size the compiled launch asks for."""
        return self._smem_bytes(self.kq_row())

    def _smem_bytes(self, KQ_ROW: int) -> int:
        T, TV, KPAD = self.t_draft, self.tile_v, self.kpad
        K = HEAD_DIM
        ring = int(self.ring)  # the frozen verify allocates no ring tile (sXu stays: sXY needs its bytes)
        words = (
            (2 * T - 1) * KQ_ROW + K,  # sKQ (the last row's padding is not allocated)
            (T - 1) * KQ_ROW + K,  # sDec
            16 * PAIR_ROW,  # sXb
            16 * PAIR_ROW,  # sXu
            ring * ((KPAD // 2 - 1) * (TV + 8) + TV),  # sUp
            K * KPAD,  # sWK
            KPAD * PAIR_ROW,  # sWKc
            ring * (15 * self.m_row + KPAD),  # sM
            T * TV // 2,  # sVin (bf16)
            ring * K,  # sBdec
            2 * T,  # sInv
            T,  # sBeta
            2 * T * T,  # sTri
            int(self.records) * T * K,  # sKGraw (bf16 [T, 2K])
            int(self.varlen) * 4,  # sRow
        )
        return sum(-(-4 * w // 16) * 16 for w in words)

    def ctas_by_smem(self) -> int:
        """CTAs per SM that shared memory allows (largest carveout, the per-CTA reserve, 128-byte granules)."""
        # Every build is counted with padded rows: the residency decides which build pads, not the reverse. Where a
        # build does not pad this overcounts by 384 bytes, which changes no residency of the tested configurations.
        per_cta = -(-(self._smem_bytes(HEAD_DIM + KQ_PAD) + CTA_SMEM_RESERVED) // 128) * 128
        return SM_SMEM_BYTES // per_cta

    def resident_ctas(self) -> int:
        """The resident-CTA floor asked of ptxas: the configured one, at most what shared memory allows."""
        return min(self.min_ctas or MIN_CTAS_PER_SM[self.tile_v], self.ctas_by_smem())

    def occupancy(self) -> dict:
        """Launch attributes: the resident-CTA floor (:meth:`resident_ctas`) and the largest shared-memory
        carveout."""
        ctas = self.resident_ctas()
        return dict(min_blocks_per_mp=ctas, preferred_smem_carveout=100) if ctas else {}

    def vector_activations(self) -> bool:
        """Park the draft inputs and the v tile with 16-byte loads (8-channel runs, a CTA barrier after them) instead
        of each gate thread's 2-byte scalars: fewer instructions before the slot branch (kda-core's aligned class
        covers the activations). Only the build it was measured on and does not spill in: aligned, T=8, tile 128, 4
        resident CTAs (64 registers). H200, 2026-11 (raw results under benchmarks/results/ at b4da44d; T=8 w16 H=12,
        us at 0 / 100% folds, two alternations, scalar / vector in every aligned build): B=512 114.1-114.7 /
        109.7-109.8 and 180.6-180.9 / 175.6-176.1; B=128 31.06-31.10 / 30.72-30.77 and 47.42 / 48.29-48.32; B=64
        (3 CTAs, 80 registers, where ptxas spilled 12 bytes with it) 16.10-16.19 / 16.86-16.93 and 23.33-23.39 /
        24.74-24.80."""
        floor = self.occupancy().get("min_blocks_per_mp", 0)
        return self.aligned and self.t_draft == 8 and self.tile_v == 128 and floor >= 4

    def vector_v(self) -> bool:
        """The 80-register build (aligned, T=8, tile 128, 3 resident CTAs: the schedule's grids under 1536 pairs)
        keeps the draft inputs' scalar loads but reads the v tile as 16-byte runs. H200
        (raw results under benchmarks/results/ at b4da44d; T=8 w16 H=12, two alternations, us at 0 / 100% folds,
        scalar / 16-byte v): B=64 16.22-16.35 / 16.06-16.16 and 23.50-23.55 / 23.36-23.45, B=96 23.81-23.90 /
        23.39-23.42 and 35.66 / 35.49-35.58, B=8 and B=32 within 0.6%. The tile-64 build (B=1) read 4.26 / 4.32
        and 4.86 / 4.99 with it, so it keeps the scalars."""
        floor = self.occupancy().get("min_blocks_per_mp", 0)
        return self.aligned and self.t_draft == 8 and self.tile_v == 128 and floor == 3

    def kq_row(self) -> int:
        """Row stride (words) of sK, sQ, sDec: padded by KQ_PAD in the vector-activation build. H200
        (raw results under benchmarks/results/ at b4da44d; us at 0% folds, two alternations, 128 / 132): B=128
        30.08-30.14 / 29.68-29.82, B=512 109.84-110.05 / 108.11-108.26. The 80-register build keeps 128: 4 words made
        ptxas spill 8 bytes there, and 12 (no spill) was slower."""
        return HEAD_DIM + (KQ_PAD if self.vector_activations() else 0)

    @cute.jit
    def load_v_runs(self, gV: cute.Tensor, tile, tidx, sVin=None, n_tok=None):
        """The v tile as 16-byte runs of 8 rows, on the threads from NT/2 on (the threads below carry the draft
        inputs' runs in the vector-activation build). With ``sVin`` each run is stored right after its load;
        without, the loads are only issued and :meth:`park_v_runs` stores them later. ``n_tok`` (varlen): the
        rows of tokens from n_tok on are zeros (:meth:`masked_row`: loaded at a row the view has, then zeroed)."""
        TV, NT = self.tile_v, self.threads
        v_runs = self.t_draft * (TV // CHUNK)
        frags = [cute.make_rmem_tensor((CHUNK,), gV.element_type) for _ in range((v_runs + NT - 1) // NT)]
        for it in cutlass.range_constexpr(len(frags)):
            task = (tidx + NT // 2) % NT + it * NT
            if task < v_runs:
                run = tile * (TV // CHUNK) + task % (TV // CHUNK)
                if const_expr(n_tok is not None):
                    row, keep = self.masked_row(task // (TV // CHUNK), n_tok)
                    cute.autovec_copy(_row_chunks(gV, row, CHUNK)[None, run], frags[it])
                    for e in cutlass.range_constexpr(CHUNK):
                        kept = Float32(cutlass.select_(keep, frags[it][e].to(Float32), Float32(0.0)))
                        frags[it][e] = kept.to(gV.element_type)
                else:
                    cute.autovec_copy(_row_chunks(gV, task // (TV // CHUNK), CHUNK)[None, run], frags[it])
                if const_expr(sVin is not None):
                    self.park_v_run(frags[it], sVin, task)
        return frags

    @cute.jit
    def masked_row(self, t, n_tok):
        """(row to load, keep) for draft token ``t`` of a varlen row of ``n_tok`` tokens: a token past the row loads
        the row's last token (or token 0 of an empty row, at the activations' token 0: the launcher runs no empty
        activations) and ``keep`` is false, so its value is replaced by zero with a select. A branch around each
        load instead kept ptxas from issuing the loads ahead of the stores of the runs before them (H200, B = 64,
        bf16, with records: the varlen verify 18.13 -> 16.64 us; an experiment with every entry mask folded away
        read 15.7)."""
        return cutlass.min(t, cutlass.max(n_tok - 1, Int32(0))), t < n_tok

    def unmasked_full_rows(self) -> bool:
        """Varlen builds at fewer than 4 resident CTAs (80 registers) solve a row that runs all T tokens (and records
        all of them) in a copy of phase 3 whose stores carry no predicate: ptxas then overlaps them with the solve.
        The 64-register builds spilled with the second copy (12-128 bytes), so they keep the masked one only."""
        return self.varlen and not self.ring and self.resident_ctas() < 4

    @cute.jit
    def solve_and_store(self, masked: cutlass.Constexpr, xy, w_u, sA, sAq, sBeta, sInv, sVin, tidx, v, gO, n_tok, gUR,
                        ring_row0, gCorr, n_rec):
        """Phase 3's solve for one state row ``v`` (thread ``tidx`` < TV): u_s, the outputs, and the u ring rows
        (ring builds) or the correction records (``records``). ``masked`` False: the row runs all T tokens and
        records all of them, so no store is predicated (:meth:`unmasked_full_rows`)."""
        T = self.t_draft
        for s in cutlass.range_constexpr(T):
            p = xy[s]
            for r in cutlass.range_constexpr(s):
                p = p + sA[s, r] * w_u[r]
            u_s = sBeta[s] * (sVin[s, tidx].to(Float32) - sInv[s] * p)
            w_u[s] = sInv[s] * u_s
            if const_expr(self.ring):
                gUR[(ring_row0 + s) & (RING_SLOTS - 1), v] = u_s.to(gUR.element_type)
            if const_expr(self.records):
                if const_expr(masked):
                    if s < n_rec:
                        gCorr[s, v] = u_s  # the correction record: u_s in fp32, unrounded
                else:
                    gCorr[s, v] = u_s
        for s in cutlass.range_constexpr(T):
            o = xy[T + s]
            for r in cutlass.range_constexpr(s + 1):
                o = o + sAq[s, r] * w_u[r]
            if const_expr(self.varlen and masked):
                if s < n_tok:
                    gO[s, v] = (sInv[T + s] * o).to(gO.element_type)
            else:
                gO[s, v] = (sInv[T + s] * o).to(gO.element_type)

    @cute.jit
    def park_v_run(self, frag, sVin: cute.Tensor, task):
        """sVin <- run ``task`` of :meth:`load_v_runs`."""
        TV = self.tile_v
        v_dst = cute.zipped_divide(sVin[task // (TV // CHUNK), None], (CHUNK,))
        cute.autovec_copy(frag, v_dst[None, task % (TV // CHUNK)])

    @cute.jit
    def park_v_runs(self, frags, sVin: cute.Tensor, tidx):
        """sVin <- the runs :meth:`load_v_runs` issued without ``sVin`` (each thread its own)."""
        TV, NT = self.tile_v, self.threads
        v_runs = self.t_draft * (TV // CHUNK)
        for it in cutlass.range_constexpr(len(frags)):
            task = (tidx + NT // 2) % NT + it * NT
            if task < v_runs:
                self.park_v_run(frags[it], sVin, task)

    @cute.jit
    def row_tokens(self, mCu: cute.Tensor, bi, tokens):
        """(first token, tokens run) of varlen row ``bi``: it owns tokens [bos, eos), the offsets clamped to
        [0, tokens] and eos to >= bos in 64 bits before anything narrows (common rule 1), and runs the first
        min(eos - bos, T). The offsets are volatile loads, issued where written (:func:`_ld_volatile`)."""
        cu_type = Int64 if const_expr(self.cu_int64) else Int32
        t_total64 = Int64(tokens)
        cu_at = lambda n: _ld_volatile(cute.domain_offset((n,), mCu).iterator, cu_type)  # noqa: E731 (any stride)
        bos64 = cutlass.min(cutlass.max(Int64(cu_at(bi)), Int64(0)), t_total64)
        eos64 = cutlass.min(cutlass.max(Int64(cu_at(bi + 1)), bos64), t_total64)
        return Int32(bos64), Int32(cutlass.min(eos64 - bos64, Int64(self.t_draft)))

    @cute.jit
    def store_dots(self, sXY: cute.Tensor, acc: cute.Tensor, warp, q4, g4):
        """sXY[v, s] <- the warp's 2T dot products of phase 2c/2d, from the m16n8 accumulator fragment of its 16 rows
        (n-tile nt: rows warp*16 + nt*8 + ..; at T=4 only the first 8 columns exist)."""
        for nt in cutlass.range_constexpr(2):
            for i in cutlass.range_constexpr(4 if 2 * self.t_draft > 8 else 2):
                sXY[warp * 16 + nt * 8 + 2 * q4 + i % 2, g4 + 8 * (i // 2)] = acc[4 * nt + i]

    # ------------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mALog: cute.Tensor,
        mDtBias,  # [H*K] fp32, or None (dt_bias absent)
        mPool: cute.Tensor,
        mSlot: cute.Tensor,
        mKCache: cute.Tensor,
        mUCache: cute.Tensor,
        mGCache: cute.Tensor,
        mHist: cute.Tensor,
        mBase: cute.Tensor,
        mOut: cute.Tensor,
        mCorr,
        mKG,
        mCu,
        scale: Float32,
        lower_bound: Float32,
        flush_min: cutlass.Int32,
    ):

        T = self.t_draft
        K = HEAD_DIM
        TV = self.tile_v
        NT = self.threads
        NW = NT // 32
        MAXR = self.max_rows
        KPAD = self.kpad
        NG = NT // K  # token groups of the gate phase (threads per key channel)
        TPT = T // NG  # draft tokens per gate thread
        LG = 32 // NG  # lanes of one token group within a warp
        RING = RING_SLOTS - 1

        tidx, _, _ = cute.arch.thread_idx()
        tile, h, bi = cute.arch.block_idx()
        lane = tidx % 32
        warp = tidx // 32
        v0 = tile * TV

        smem = cutlass.memory.SmemAllocator()
        row_major = lambda rows, cols: cute.make_layout((rows, cols), stride=(cols, 1))  # noqa: E731
        # rows of sK, sQ, sDec: KQ_ROW words (padded in the vector-activation build, see KQ_PAD)
        KQ_ROW = self.kq_row()
        quads = lambda rows: cute.make_layout((rows, K // 4, 4), stride=(KQ_ROW, 4, 1))  # noqa: E731
        # raw k (plane 0, normalised in the solve) and raw q (plane 1) as one block: a lane can pick its plane
        sKQ = smem.allocate_tensor(
            Float32, cute.make_layout((2, T, K), stride=(T * KQ_ROW, KQ_ROW, 1)), byte_alignment=16
        )
        sK = sKQ[0, None, None]
        sQ = sKQ[1, None, None]
        sDec = smem.allocate_tensor(  # per-token decay exp(g_log)
            Float32, cute.make_layout((T, K), stride=(KQ_ROW, 1)), byte_alignment=16
        )
        sKQ4 = cute.make_tensor(
            sKQ.iterator, cute.make_layout((2, T, K // 4, 4), stride=(T * KQ_ROW, KQ_ROW, 4, 1))
        )
        sK4 = cute.make_tensor(sK.iterator, quads(T))
        sQ4 = cute.make_tensor(sQ.iterator, quads(T))
        sDec4 = cute.make_tensor(sDec.iterator, quads(T))
        # Decayed raw draft vectors x_s = [kx_0..kx_{T-1}, qx_0..qx_{T-1}, zeros up to 16] as the m16 A operand
        # of the products with the checkpoint and with wk: [hi / lo][s % 8][channel-pair group] 4 words
        # (x_s pair 2i, x_s+8 pair 2i, x_s pair 2i+1, x_s+8 pair 2i+1), one 16-byte read per fragment.
        # sXb: times bdec (S0 (bdec x)), sXu: as is (M = wk x).
        x_layout = cute.make_layout((2, 8, PAIR_ROW // 4, 4), stride=(8 * PAIR_ROW, PAIR_ROW, 4, 1))
        sXb = smem.allocate_tensor(Int32, x_layout, byte_alignment=16)
        sXu = smem.allocate_tensor(Int32, x_layout, byte_alignment=16)
        # Ring operands as packed bf16 pairs along the ring-row axis (the MMA k index); rows j >= P hold zeros
        # written by a select. u: row stride padded (+8 words) so the fragment reads hit 32 banks. wk: once
        # packed along ring rows (the fold's B operand, flush rows only; one column of KPAD words per channel,
        # see _fold_group) and once along channels (M's B operand: rows of PAIR_ROW words, (hi, hi, lo, lo)).
        if const_expr(self.ring):
            sUp = smem.allocate_tensor(Int32, cute.make_layout((KPAD // 2, TV), stride=(TV + 8, 1)),
                                       byte_alignment=16)
            quads_of = lambda rows, words: cute.make_layout((rows, words // 4, 4), stride=(words, 4, 1))  # noqa: E731
            sWK = smem.allocate_tensor(Int32, quads_of(K, KPAD), byte_alignment=16)
            sWKc = smem.allocate_tensor(Int32, quads_of(KPAD, PAIR_ROW), byte_alignment=16)
            # M[j, s] = wk_j . x_s as the A operand of the ring correction: [hi / lo][s % 8][k-step, q] 4 words
            # (s pair jp, s + 8 pair jp, s pair jp + 4, s + 8 pair jp + 4), jp = 8 step + q; rows padded to 16
            # words mod 32 so the quarter-warp reads hit 32 banks.
            m_row = self.m_row
            sM = smem.allocate_tensor(
                Int32, cute.make_layout((2, 8, KPAD // 4, 4), stride=(8 * m_row, m_row, 4, 1)), byte_alignment=16
            )
        XYS = self.xy_stride  # sXY row stride: 16-byte rows, and the 16-byte row reads of the solve hit 32 banks
        xy_layout = cute.make_layout((TV, 2 * T), stride=(XYS, 1))
        # written only after the sync that ends the last read of sXb / sXu (phase 2c), contiguous and larger
        assert (TV - 1) * XYS + 2 * T <= 2 * cute.cosize(x_layout), (TV, XYS)
        sXY = cute.make_tensor(cute.recast_ptr(sXb.iterator, dtype=Float32), xy_layout)
        sVin = smem.allocate_tensor(mV.element_type, row_major(T, TV), byte_alignment=16)  # v tile as given (bf16)
        if const_expr(self.ring):
            sBdec = smem.allocate_tensor(Float32, cute.make_layout(K), byte_alignment=16)
        sInv = smem.allocate_tensor(Float32, cute.make_layout(2 * T), byte_alignment=16)  # 1/|k_s|, scale/|q_s|
        sBeta = smem.allocate_tensor(Float32, cute.make_layout(T), byte_alignment=16)
        # the triangles A[s, r] (decayed k_r . k_s) and Aq[s, r] (decayed k_r . q_s) as one block: a reduction lane
        # stores either with one computed index
        sTri = smem.allocate_tensor(Float32, cute.make_layout(2 * T * T), byte_alignment=16)
        sA = cute.make_tensor(sTri.iterator, row_major(T, T))
        sAq = cute.make_tensor(sTri.iterator + T * T, row_major(T, T))
        if const_expr(self.varlen):
            # the row's (first token, tokens run), for phase 3 to read again instead of holding two registers
            # through the kernel (the 64-register build spilled with them)
            sRow = smem.allocate_tensor(Int32, cute.make_layout(4), byte_alignment=16)
        if const_expr(self.records):
            # raw k_t | raw g_t as given (bf16), parked at entry for the kg records of phase 3: no activation pointer
            # stays live through the kernel (the 64-register build spilled with them)
            sKGraw = smem.allocate_tensor(mK.element_type, row_major(T, 2 * K), byte_alignment=16)

        slot = mSlot[bi]
        pool_rows = mPool.shape[0]
        # else null (the policy): an inactive row; an int64 slot is compared in 64 bits (never wrapped into the pool)
        if const_expr(self.slot_int64):
            active = (slot >= Int64(self.first_slot)) & (slot < Int64(pool_rows))
        else:
            active = (slot >= self.first_slot) & (slot < pool_rows)
        # Loads that do not depend on the slot are issued with it, before the branch on it (every index is in
        # bounds for an inactive row too), so that their latency overlaps the slot's instead of following it: the
        # cursors, the gate phase's draft inputs and constants, the v tile and beta. ptxas sinks a load below that
        # branch when only the active side uses it, so each one is either volatile (the cursors, A_log, dt_bias: kept
        # in registers) or stored to shared memory right here (k, q, the raw gate in sDec's slots, v, beta): the
        # stores wait for the loads, which arrive with the slot.
        n_tok = T  # draft tokens this row runs (varlen: its length, at most T; the others are masked to zero)
        if const_expr(self.ring):
            hist_in = _ld_volatile(mHist.iterator + bi, Int32)
            base_in = _ld_volatile(mBase.iterator + bi, Int32)
        if const_expr(self.varlen):
            tok0, n_tok = self.row_tokens(mCu, bi, mQ.shape[1])
            if tidx == 0:
                sRow[0] = tok0
                sRow[1] = n_tok
            # the row's token t is row tok0 + t of every [tokens, 128] activation view (an empty row's views start
            # at token 0, where its masked loads land: masked_row)
            tok_at = Int32(cutlass.select_(n_tok > 0, tok0, Int32(0)))
            gQ = cute.domain_offset((tok_at, 0), mQ[0, None, h, None])
            gK = cute.domain_offset((tok_at, 0), mK[0, None, h, None])
            gGate = cute.domain_offset((tok_at, 0), mG[0, None, h, None])
            gV = cute.domain_offset((tok_at, 0), mV[0, None, h, None])
            gBeta = cute.domain_offset((tok_at,), mBeta[0, None, h])
        else:
            gQ = mQ[bi, None, h, None]
            gK = mK[bi, None, h, None]
            gGate = mG[bi, None, h, None]
            gV = mV[bi, None, h, None]
        grp = 0
        c = tidx
        if const_expr(NG > 1):
            grp = lane // LG
            c = warp * LG + lane % LG
        a_log_in = _ld_volatile(mALog.iterator + h, Float32)
        dt_in = Float32(0.0)
        if const_expr(self.has_dt_bias):
            dt_in = _ld_volatile(mDtBias.iterator + h * K + c, Float32)
        beta_in = Float32(0.0)
        if const_expr(self.vector_activations()):
            if const_expr(self.varlen):
                if tidx < T:
                    row, keep = self.masked_row(tidx, n_tok)
                    beta_in = Float32(cutlass.select_(keep, gBeta[row].to(Float32), Float32(0.0)))
            else:
                if tidx < T:
                    beta_in = mBeta[bi, tidx, h].to(Float32)
            # 16-byte loads of 8-channel runs: k, q, g run (t, c8) on thread (t, c8) (T * 16 of them), the v tile's
            # runs on the threads from NT/2 on, each stored right after its load (k, q and the raw gate as fp32).
            runs = T * (K // CHUNK)
            for it in cutlass.range_constexpr((runs + NT - 1) // NT):
                task = tidx + it * NT
                if task < runs:
                    trio = [cute.make_rmem_tensor((CHUNK,), mK.element_type) for _ in range(3)]
                    keep = None
                    if const_expr(self.varlen):
                        # a missing token: zero k, q and raw gate (its log-decay is zeroed later); masked_row
                        row, keep = self.masked_row(task // (K // CHUNK), n_tok)
                        for gX, frag in zip((gK, gQ, gGate), trio):
                            cute.autovec_copy(_row_chunks(gX, row, CHUNK)[None, task % (K // CHUNK)], frag)
                    else:
                        for gX, frag in zip((gK, gQ, gGate), trio):
                            cute.autovec_copy(_row_chunks(gX, task // (K // CHUNK), CHUNK)[None, task % (K // CHUNK)],
                                              frag)
                    for dst, frag in zip((sK, sQ, sDec), trio):
                        wide = cute.make_rmem_tensor((CHUNK,), Float32)
                        wide.store(frag.load().to(Float32))
                        if const_expr(keep is not None):
                            for e in cutlass.range_constexpr(CHUNK):
                                wide[e] = Float32(cutlass.select_(keep, wide[e], Float32(0.0)))
                        dst_runs = cute.zipped_divide(dst[task // (K // CHUNK), None], (CHUNK,))
                        cute.autovec_copy(wide, dst_runs[None, task % (K // CHUNK)])
                    if const_expr(self.records):
                        raw_runs = cute.zipped_divide(sKGraw[task // (K // CHUNK), None], (CHUNK,))
                        cute.autovec_copy(trio[0], raw_runs[None, task % (K // CHUNK)])
                        cute.autovec_copy(trio[2], raw_runs[None, K // CHUNK + task % (K // CHUNK)])
            self.load_v_runs(gV, tile, tidx, sVin, n_tok=n_tok if self.varlen else None)
            # phase 1a's threads read other threads' runs
            cute.arch.sync_threads()
            t = grp * TPT  # (the scalar path leaves `t` defined here; the DSL wants it typed before the branch)
        else:
            k_raw = cute.make_rmem_tensor((TPT,), Float32)
            q_raw = cute.make_rmem_tensor((TPT,), Float32)
            gate_in = cute.make_rmem_tensor((TPT,), Float32)
            for i in cutlass.range_constexpr(TPT):
                t = grp * TPT + i
                if const_expr(self.varlen):
                    row, keep = self.masked_row(t, n_tok)  # a missing token: zero k, q and raw gate
                    k_raw[i] = Float32(cutlass.select_(keep, gK[row, c].to(Float32), Float32(0.0)))
                    q_raw[i] = Float32(cutlass.select_(keep, gQ[row, c].to(Float32), Float32(0.0)))
                    gate_in[i] = Float32(cutlass.select_(keep, gGate[row, c].to(Float32), Float32(0.0)))
                else:
                    k_raw[i] = gK[t, c].to(Float32)
                    q_raw[i] = gQ[t, c].to(Float32)
                    gate_in[i] = gGate[t, c].to(Float32)
            vector_v = const_expr(self.vector_v())
            if const_expr(vector_v):
                # the v tile as 16-byte runs, as in the vector-activation build (the draft inputs stay scalar here:
                # they spilled at 80 registers, see vector_activations); stored after the scalars below
                v_frags = self.load_v_runs(gV, tile, tidx, n_tok=n_tok if self.varlen else None)
            else:
                v_in = cute.make_rmem_tensor((T * TV // NT,), mV.element_type)
                for it in cutlass.range_constexpr(T * TV // NT):
                    task = tidx + it * NT
                    if const_expr(self.varlen):
                        row, keep = self.masked_row(task // TV, n_tok)
                        v_in[it] = Float32(cutlass.select_(keep, gV[row, v0 + task % TV].to(Float32),
                                                           Float32(0.0))).to(mV.element_type)
                    else:
                        v_in[it] = gV[task // TV, v0 + task % TV]
            if const_expr(self.varlen):
                if tidx < T:
                    row, keep = self.masked_row(tidx, n_tok)
                    beta_in = Float32(cutlass.select_(keep, gBeta[row].to(Float32), Float32(0.0)))
            else:
                if tidx < T:
                    beta_in = mBeta[bi, tidx, h].to(Float32)
            for i in cutlass.range_constexpr(TPT):
                t = grp * TPT + i
                sK[t, c] = k_raw[i]
                sQ[t, c] = q_raw[i]
                sDec[t, c] = gate_in[i]  # the raw gate; phase 1a reads it back and writes the decay in its place
                if const_expr(self.records):
                    sKGraw[t, c] = k_raw[i].to(mK.element_type)  # bf16 -> fp32 -> bf16: exact
                    sKGraw[t, K + c] = gate_in[i].to(mK.element_type)
            if const_expr(vector_v):
                self.park_v_runs(v_frags, sVin, tidx)
                task = tidx  # (the other paths leave `task` defined here; the DSL wants it typed before the branch)
            else:
                for it in cutlass.range_constexpr(T * TV // NT):
                    task = tidx + it * NT
                    sVin[task // TV, task % TV] = v_in[it]
        if tidx < T:
            sBeta[tidx] = Float32(1.0) / (Float32(1.0) + cute.math.exp(-beta_in, fastmath=True))
            if const_expr(self.varlen):
                if tidx >= n_tok:
                    sBeta[tidx] = Float32(0.0)  # a missing token writes nothing into the solve (u_s = 0)
        if active:
            slot64 = Int64(slot)
            if const_expr(self.ring):
                # Clamp the cursors: a malformed hist_len / cache_base must never index past the shared-memory
                # tiles or the 32-slot ring (legal values are checked by the caller, under KDA_DEBUG_VALIDATE).
                P = hist_in
                if P < 0:
                    P = cutlass.Int32(0)
                if P > MAXR:
                    P = cutlass.Int32(MAXR)
                base = base_in & RING
                is_flush = P >= flush_min
                # This (request, head)'s pool slot and rings, offset once in 64 bits; every index below is 32-bit.
                gPool = mPool[slot64, h, None, None]
                gKR = mKCache[slot64, h, None, None]
                gUR = mUCache[slot64, h, None, None]
                gGR = mGCache[slot64, h, None, None]
                last_row = (base + P - 1) & RING
            else:
                gPool = mPool[slot64, h, None, None]  # the frozen verify: the checkpoint's slot

            # The checkpoint rows are loaded just before phase 2c (load_checkpoint_rows), not first: issued first, at
            # 64 registers ptxas spilled the 32 prefetched words right after their loads (the spill store waits for
            # DRAM) or the preamble around them (140 bytes); the fourth resident CTA is what hides their latency.
            g4 = lane // 4
            q4 = lane % 4
            rows = (warp * 16 + g4, warp * 16 + g4 + 8)
            s0_raw = cute.make_rmem_tensor((2 * CHUNKS_PER_THREAD * CHUNK,), mPool.element_type)
            s0_chunks = cute.zipped_divide(s0_raw, (CHUNK,))

            def load_checkpoint_rows():
                for rho in cutlass.range_constexpr(2):
                    row_chunks = cute.zipped_divide(gPool[v0 + rows[rho], None], (CHUNK,))
                    for m in cutlass.range_constexpr(CHUNKS_PER_THREAD):
                        cute.autovec_copy(
                            row_chunks[None, m * ROW_THREADS + q4], s0_chunks[None, rho * CHUNKS_PER_THREAD + m]
                        )

            # Phase 1b's global loads: u ring rows (tasks = (row pair, 8 consecutive state rows)), and for the replay
            # vectors wk_j = exp(G_{P-1} - G_j) * k^_j the last G row and rows G_j, k^_j. A wk task is 4 channels
            # (lanes run over them: whole ring rows per warp) of a set of ring rows 16 ks + 2q + {0, 1, 8, 9} (the
            # pairs ks*8 + q and ks*8 + q + 4 of one fold B fragment). The wk tasks start at thread NT/2, so that
            # they do not pile onto the threads that load u.
            u_chunk0 = tile * (TV // CHUNK)  # this tile's first 8-row chunk of a ring row
            u_tasks = (KPAD // 2) * (TV // CHUNK)
            n_rows = 4
            wk_tasks = KPAD // n_rows * (K // 4)

            def wk_task(it):
                return (tidx + NT // 2) % NT + it * NT

            def issue_ring_loads():
                u_loaded = []
                for it in cutlass.range_constexpr((u_tasks + NT - 1) // NT):
                    task = tidx + it * NT
                    halves = [cute.make_rmem_tensor((CHUNK // 2,), Int32) for _ in range(2)]
                    if task < u_tasks:
                        jp = task // (TV // CHUNK)
                        r8 = task % (TV // CHUNK)
                        for odd in cutlass.range_constexpr(2):
                            for e in cutlass.range_constexpr(CHUNK // 2):
                                halves[odd][e] = Int32(0)
                            if 2 * jp + odd < P:
                                cute.autovec_copy(
                                    _row_chunks(gUR, (base + 2 * jp + odd) & RING, CHUNK)[None, u_chunk0 + r8],
                                    cute.recast_tensor(halves[odd], mUCache.element_type),
                                )
                    u_loaded.append(halves)
                wk_loaded = []
                for it in cutlass.range_constexpr((wk_tasks + NT - 1) // NT):
                    task = wk_task(it)
                    last4 = cute.make_rmem_tensor((4,), Float32)
                    gjs = [cute.make_rmem_tensor((4,), Float32) for _ in range(n_rows)]
                    kjs = [cute.make_rmem_tensor((4,), mKCache.element_type) for _ in range(n_rows)]
                    if task < wk_tasks:
                        c4 = task % (K // 4)
                        row_set = task // (K // 4)
                        for e in cutlass.range_constexpr(4):
                            last4[e] = Float32(0.0)
                        if P > 0:
                            cute.autovec_copy(_row_chunks(gGR, last_row, 4)[None, c4], last4)
                        js = [16 * (row_set // 4) + 2 * (row_set % 4) + d for d in (0, 1, 8, 9)]
                        for rr in cutlass.range_constexpr(n_rows):
                            if js[rr] < P:
                                phys = (base + js[rr]) & RING
                                cute.autovec_copy(_row_chunks(gGR, phys, 4)[None, c4], gjs[rr])
                                cute.autovec_copy(_row_chunks(gKR, phys, 4)[None, c4], kjs[rr])
                    wk_loaded.append((last4, gjs, kjs))
                return u_loaded, wk_loaded

            # issued before phase 1a, so that their latency hides under the gate math
            if const_expr(self.ring):
                ring = issue_ring_loads()

            # ---- phase 1a: gate, raw k/q, decays and decayed draft vectors --------------------------
            # Thread (token group grp, channel c) owns TPT consecutive draft tokens of one key channel, so the
            # running sum cum_t of the gate stays in registers (one shuffle passes it between token groups).
            # k and q stay raw: their norms come out of the triangle phase and are applied in the solve.
            rate = cute.math.exp(a_log_in, fastmath=True)
            g_last = Float32(0.0)
            if const_expr(self.ring):
                if P > 0:
                    g_last = gGR[last_row, c]
            g_logs = cute.make_rmem_tensor((TPT,), Float32)
            part = Float32(0.0)
            for i in cutlass.range_constexpr(TPT):
                t = grp * TPT + i
                x = sDec[t, c] + dt_in
                g_log = Float32(0.0)
                if const_expr(self.softplus_gate):
                    sp = x
                    if x <= Float32(20.0):
                        sp = cute.math.log1p(cute.math.exp(x, fastmath=True), fastmath=True)
                    g_log = -rate * sp
                else:
                    # lower_bound * sigmoid(rate * x); 1 + exp(..) >= 1, so the approximate reciprocal is exact
                    # to an ulp and an overflowed exp gives 0, as a division would.
                    g_log = lower_bound * cute.arch.rcp_approx(Float32(1.0) + cute.math.exp(-rate * x, fastmath=True))
                if const_expr(self.varlen):
                    g_log = Float32(cutlass.select_(t < n_tok, g_log, Float32(0.0)))  # a missing token: no decay
                sDec[t, c] = cute.math.exp(g_log, fastmath=True)
                g_logs[i] = g_log
                part = part + g_log
            cum = Float32(0.0)  # the decay restarts at the checkpoint: cum before this thread's first token
            if const_expr(NG == 2):
                cum = Float32(cutlass.select_(grp == 1, cute.arch.shuffle_sync_bfly(part, offset=16), Float32(0.0)))
            if const_expr(NG == 4):
                prev = Float32(cutlass.select_(grp >= 1, cute.arch.shuffle_sync_up(part, offset=8), Float32(0.0)))
                prev2 = cute.arch.shuffle_sync_up(prev + part, offset=16)
                cum = prev + Float32(cutlass.select_(grp >= 2, prev2, Float32(0.0)))
            even = (lane % 2) == 0  # c and c ^ 1 are lanes lane and lane ^ 1
            if const_expr(self.ring):
                bdec = Float32(1.0)
                if P > 0:
                    bdec = cute.math.exp(g_last, fastmath=True)
                # bdec of the two channels of this lane's packed pair (low half, high half)
                bdec_partner = cute.arch.shuffle_sync_bfly(bdec, offset=1)
                bdec_lo = Float32(cutlass.select_(even, bdec, bdec_partner))
                bdec_hi = Float32(cutlass.select_(even, bdec_partner, bdec))
            for i in cutlass.range_constexpr(TPT):
                t = grp * TPT + i
                cum = cum + g_logs[i]
                if const_expr(self.ring):
                    if tile == 0:
                        g_new = cum  # a flush row restarts the decay at the new checkpoint
                        if P < flush_min:
                            g_new = g_new + g_last
                        gGR[(base + P + t) & RING, c] = g_new
                decay = cute.math.exp(cum, fastmath=True)
                kx = decay * sK[t, c]
                qx = decay * sQ[t, c]
                # Even lanes pack (kx_c, kx_c+1) into column t, odd lanes (qx_c-1, qx_c) into column T + t:
                # one shuffle gives each lane its partner's half.
                recv = cute.arch.shuffle_sync_bfly(Float32(cutlass.select_(even, qx, kx)), offset=1)
                x_lo = Float32(cutlass.select_(even, kx, recv))
                x_hi = Float32(cutlass.select_(even, recv, qx))
                s_x = t + Int32(cutlass.select_(even, Int32(0), Int32(T)))  # row of x: kx_t or qx_t
                pos = s_x // 8 + 2 * (c // 2 % 2)
                if const_expr(self.ring):
                    sXu[0, s_x % 8, c // 4, pos], sXu[1, s_x % 8, c // 4, pos] = _split_bf16x2(x_lo, x_hi)
                    sXb[0, s_x % 8, c // 4, pos], sXb[1, s_x % 8, c // 4, pos] = _split_bf16x2(
                        bdec_lo * x_lo, bdec_hi * x_hi
                    )
                else:
                    # P = 0: bdec = 1 and no M, so x as is is the only operand
                    sXb[0, s_x % 8, c // 4, pos], sXb[1, s_x % 8, c // 4, pos] = _split_bf16x2(x_lo, x_hi)
            if const_expr(self.ring):
                if grp == 0:
                    sBdec[c] = bdec
            if const_expr(2 * T < 16):
                # rows 2T..15 of the m16 operand x are zeros (a 16-byte read of rows s and s + 8 takes them along)
                for it in cutlass.range_constexpr(2 * 8 * (K // 4) // NT):
                    task = tidx + it * NT  # (hi / lo, s % 8, channel-pair group)
                    for odd in cutlass.range_constexpr(2):
                        if const_expr(self.ring):
                            sXu[task // (8 * (K // 4)), task // (K // 4) % 8, task % (K // 4), 2 * odd + 1] = Int32(0)
                        sXb[task // (8 * (K // 4)), task // (K // 4) % 8, task % (K // 4), 2 * odd + 1] = Int32(0)

            # ---- phase 1b: ring rows (u, replay vectors wk); the v tile and beta were parked at entry ------
            # Only the live rows j < P were loaded (issue_ring_loads): stale rows never enter an arithmetic op.
            if const_expr(self.ring):
                u_loaded, wk_loaded = ring
                for it in cutlass.range_constexpr(len(u_loaded)):
                    task = tidx + it * NT
                    if task < u_tasks:
                        jp = task // (TV // CHUNK)
                        r8 = task % (TV // CHUNK)
                        halves = u_loaded[it]
                        packed = cute.make_rmem_tensor((CHUNK,), Int32)
                        for e in cutlass.range_constexpr(CHUNK // 2):
                            # (u_2jp[v], u_2jp+1[v]) bf16 pairs: bit moves only, the ring holds bf16
                            packed[2 * e] = _prmt(halves[0][e], halves[1][e], 0x5410)
                            packed[2 * e + 1] = _prmt(halves[0][e], halves[1][e], 0x7632)
                        cute.autovec_copy(packed, cute.zipped_divide(sUp[jp, None], (CHUNK,))[None, r8])
                for it in cutlass.range_constexpr(len(wk_loaded)):
                    task = wk_task(it)
                    if task < wk_tasks:
                        c4 = task % (K // 4)
                        row_set = task // (K // 4)
                        last4, gjs, kjs = wk_loaded[it]
                        wk = [cute.make_rmem_tensor((4,), Float32) for _ in range(n_rows)]
                        js = [16 * (row_set // 4) + 2 * (row_set % 4) + d for d in (0, 1, 8, 9)]
                        for rr in cutlass.range_constexpr(n_rows):
                            for e in cutlass.range_constexpr(4):
                                wk[rr][e] = Float32(0.0)
                            if js[rr] < P:
                                for e in cutlass.range_constexpr(4):
                                    wk[rr][e] = cute.math.exp(last4[e] - gjs[rr][e], fastmath=True) * kjs[rr][e].to(
                                        Float32
                                    )
                        quad = cute.make_rmem_tensor((4,), Int32)
                        for rr in cutlass.range_constexpr(n_rows):
                            # along channels: (hi, hi, lo, lo) of channel pairs 2 c4, 2 c4 + 1 of ring row j
                            quad[0], quad[2] = _split_bf16x2(wk[rr][0], wk[rr][1])
                            quad[1], quad[3] = _split_bf16x2(wk[rr][2], wk[rr][3])
                            cute.autovec_copy(quad, sWKc[js[rr], c4, None])
                        if is_flush:
                            for e in cutlass.range_constexpr(4):
                                # along ring rows: (hi, hi, lo, lo) of pairs (rows 0, 1) and (rows 8, 9) of the set
                                quad[0], quad[2] = _split_bf16x2(wk[0][e], wk[1][e])
                                quad[1], quad[3] = _split_bf16x2(wk[2][e], wk[3][e])
                                ch = 4 * c4 + e
                                cute.autovec_copy(quad, sWK[ch, _fold_group(ch, row_set // 4, row_set % 4, KPAD), None])
            cute.arch.sync_threads()
            # Start the checkpoint rows' DRAM reads now, into L2: the triangle warps (0 .. T/2 - 1) load their rows
            # only after the triangles, the others after phase 2b, so the rows' latency hides under that work
            # without holding registers (a register prefetch here spills: 48 bytes at 80 registers, 208 at 64).
            # Quad position q asks for the 128-byte line q % 2 of the warp row pair's row q // 2. H200
            # (raw results under benchmarks/results/ at b4da44d; T=8 w16 H=12, us at 0 / 100% folds, none /
            # triangle warps / every warp): B=64 17.4 / 17.4 / 17.5 and 24.7 / 24.8 / 24.9; B=128 33.6 / 32.5 /
            # 32.0 and 51.2 / 50.0 / 48.8; B=512 122.2 / 117.2 / 115.4-115.7 and 194.1 / 185.3 / 181.2-181.5.
            row_line = gPool[v0 + warp * 16 + g4 + 8 * (q4 // 2), None]
            if const_expr(self.pool_fp32):
                # fp32 rows are 4 lines: quad position q asks for lines 2 (q % 2) and 2 (q % 2) + 1 of its row
                for j in cutlass.range_constexpr(2):
                    cute.arch.prefetch((row_line.iterator + 32 * (2 * (q4 % 2) + j)).llvm_ptr, cache_level="L2")
            else:
                cute.arch.prefetch((row_line.iterator + 64 * (q4 % 2)).llvm_ptr, cache_level="L2")

            # ---- phase 2a: the T x T triangles and the norms (warps 0 .. T/2 - 1) -------------------------
            # Column r of both triangles is one warp's job (columns r and T-1-r share a warp: equal work); a lane
            # owns 4 consecutive channels (16-byte reads). Down the column, exp(cum_s - cum_r) is the running
            # product of the per-token decays a_t = exp(g_log_t), t = r+1..s: one multiply per entry instead of an
            # exp, and no overflow whatever the gate: every g_log <= 0, so cum_s - cum_r <= 0 for s >= r and every
            # factor (and the product) is <= 1 (a ratio exp(cum_s) / exp(cum_r) would overflow for strong decay).
            # The diagonal also gives the norms of k_r and q_r. Entries stay raw (un-normalised k, q): the solve
            # applies 1/|k| and scale/|q|. A warp's partial sums (both columns' entries and diagonals) are reduced by
            # one transposing butterfly (_lane_sums: value i lands on lane i, which stores it), not value by value.
            # H200, T=8 w16 H=12, us at 0 / 100% folds, two alternations each, one column per pass with
            # one butterfly per column / both columns in one pass; raw results under benchmarks/results/ at
            # b4da44d): B=64 17.47-17.52 / 16.93-16.99 and 24.83-24.86 / 24.29-24.32; B=128 31.77-31.81 / 31.62-31.82
            # and 48.62-48.77 / 49.23-49.25; B=512 115.39-115.52 / 114.56-114.72 and 180.89-181.46 / 181.69-181.77.
            for wt in cutlass.range_constexpr(T // 2):
                if warp == wt:
                    # This warp's two columns r1 = wt (T-1-wt entries below the diagonal) and r2 = T-1-wt (wt
                    # entries) are computed together: rows s past both share their loads, the two running products
                    # are independent chains, and all T-1 entries plus the two diagonals' six values (|k_r|^2,
                    # |q_r|^2, k_r . q_r) go through one transposing butterfly.
                    bits = [(lane & (1 << b)) != 0 for b in range(5)]
                    odd = lane % 2
                    cols = (wt, T - 1 - wt)
                    ws = []
                    diag = []
                    for r in cols:
                        w = cute.make_rmem_tensor((4,), Float32)
                        q_r = cute.make_rmem_tensor((4,), Float32)
                        cute.autovec_copy(sK4[r, lane, None], w)
                        cute.autovec_copy(sQ4[r, lane, None], q_r)
                        kk = w[0] * w[0]
                        qq = q_r[0] * q_r[0]
                        kq = w[0] * q_r[0]
                        for e in cutlass.range_constexpr(1, 4):
                            kk = kk + w[e] * w[e]
                            qq = qq + q_r[e] * q_r[e]
                            kq = kq + w[e] * q_r[e]
                        ws.append(w)
                        diag.extend([kk, qq, kq])
                    # Entries (s, r), s > r: each lane computes the pair (A, Aq) of an entry as (kept, sent) for
                    # the first butterfly level (odd lanes read k_s and q_s from swapped planes).
                    entry = {}
                    for s in cutlass.range_constexpr(cols[0] + 1, T):
                        dec = cute.make_rmem_tensor((4,), Float32)
                        x_kept = cute.make_rmem_tensor((4,), Float32)
                        x_sent = cute.make_rmem_tensor((4,), Float32)
                        cute.autovec_copy(sDec4[s, lane, None], dec)
                        cute.autovec_copy(sKQ4[odd, s, lane, None], x_kept)
                        cute.autovec_copy(sKQ4[1 - odd, s, lane, None], x_sent)
                        for ci in cutlass.range_constexpr(2):
                            if const_expr(s > cols[ci]):
                                w = ws[ci]
                                for e in cutlass.range_constexpr(4):
                                    w[e] = w[e] * dec[e]
                                kept = w[0] * x_kept[0]
                                sent = w[0] * x_sent[0]
                                for e in cutlass.range_constexpr(1, 4):
                                    kept = kept + w[e] * x_kept[e]
                                    sent = sent + w[e] * x_sent[e]
                                entry[(ci, s)] = _pair_sum(kept, sent)
                    # entries of column r1 (s = r1+1 .. T-1), then of column r2, then the diagonals as pairs
                    # (|k_r1|^2, |q_r1|^2), (k_r1 . q_r1, |k_r2|^2), (|q_r2|^2, k_r2 . q_r2) at level 0
                    vals = [entry[(ci, s)] for ci in range(2) for s in range(cols[ci] + 1, T)]
                    for j in cutlass.range_constexpr(3):
                        a, b = diag[2 * j], diag[2 * j + 1]
                        kept = Float32(cutlass.select_(bits[0], b, a))
                        sent = Float32(cutlass.select_(bits[0], a, b))
                        vals.append(_pair_sum(kept, sent))
                    # lane 2i + p ends with entry i's A (p = 0) or Aq (p = 1); lanes 2(T-1) .. 2(T-1)+5 with the
                    # diagonal values in the order above
                    tot = _lane_sums(vals, bits, first_level=1)
                    n1 = T - 1 - wt
                    ent = lane // 2
                    if lane < 2 * (T - 1):
                        in1 = ent < n1
                        s_row = Int32(cutlass.select_(in1, wt + 1 + ent, ent + 1))
                        r_col = Int32(cutlass.select_(in1, Int32(wt), Int32(T - 1 - wt)))
                        sTri[odd * (T * T) + s_row * T + r_col] = tot
                    if lane >= 2 * (T - 1) and lane < 2 * (T - 1) + 6:
                        d = lane - 2 * (T - 1)
                        r_col = Int32(cutlass.select_(d >= 3, Int32(T - 1 - wt), Int32(wt)))
                        kind = d % 3
                        inv = cute.math.rsqrt(tot + Float32(L2NORM_EPS), fastmath=True)
                        if kind == 0:
                            sInv[r_col] = inv
                        if kind == 1:
                            sInv[T + r_col] = inv * scale
                        if kind == 2:
                            sAq[r_col, r_col] = tot

            # ---- phase 2b: M = wk x (MMA; one 8-ring-row tile per warp, on warps past the triangles' ones) -------
            # A verify row never needs S_commit: S_commit x_s = S0 (bdec * x_s) + sum_j u_j (wk_j . x_s) (docs/design.md
            # §5, R2). M[j, s] = wk_j . x_s is per (request, head), so it is computed once here (m16 = the 2T
            # draft vectors, n8 = 8 ring rows, k = channels, hi/lo splits: 3 MMAs per k-step); every state row then
            # adds U M (one MMA per 16 ring rows) to S0 (bdec x), whose A operand is the bf16 checkpoint itself.
            if const_expr(self.ring):
                for jt in cutlass.range_constexpr(KPAD // 8):
                    if warp == (T // 2 + jt) % NW:
                        # one n8 tile of ring rows: A = x (m16), B = wk packed along channels, hi/lo of both
                        m_acc = [Float32(0.0)] * 4
                        for ks in cutlass.range_constexpr(K // MMA_K):
                            grp_k = _pair_group(ks, q4)
                            xop_hi = cute.make_rmem_tensor((4,), Int32)
                            xop_lo = cute.make_rmem_tensor((4,), Int32)
                            wb = cute.make_rmem_tensor((4,), Int32)
                            cute.autovec_copy(sXu[0, g4, grp_k, None], xop_hi)
                            cute.autovec_copy(sXu[1, g4, grp_k, None], xop_lo)
                            cute.autovec_copy(sWKc[8 * jt + g4, grp_k, None], wb)
                            a_hi = [xop_hi[i] for i in range(4)]
                            a_lo = [xop_lo[i] for i in range(4)]
                            m_acc = _mma_bf16_m16n8k16(a_hi, (wb[0], wb[1]), m_acc)
                            m_acc = _mma_bf16_m16n8k16(a_lo, (wb[0], wb[1]), m_acc)
                            m_acc = _mma_bf16_m16n8k16(a_hi, (wb[2], wb[3]), m_acc)
                        # (c0, c1) = M[ring rows 8 jt + 2q, +1][s = g], (c2, c3) the same for s = g + 8: ring-row
                        # pair jp = 4 jt + q, which is k-pair jp % 4 (+ 4 if (jp // 4) odd) of k-step jp // 8
                        jp = 4 * jt + q4
                        pos_k = 2 * ((jp // 4) % 2)
                        grp_m = jp // 8 * 4 + jp % 4
                        for half in cutlass.range_constexpr(2):
                            m_hi, m_lo = _split_bf16x2(m_acc[2 * half], m_acc[2 * half + 1])
                            sM[0, g4, grp_m, half + pos_k] = m_hi
                            sM[1, g4, grp_m, half + pos_k] = m_lo

            # ---- phase 2c: state rows: S0 (bdec x) dot products, the flush (every warp) ------------------------
            # Warp w owns local rows 16w + g and 16w + g + 8 (g = lane // 4); thread quad position q = lane % 4
            # owns channels 32m + 8q + e (m < 4, e < 8) of both rows: 16-byte pool accesses, and, read as
            # the K dimension of the MMA in the order (m, e), exactly the A-fragment columns {2q, 2q + 1,
            # 2q + 8, 2q + 9} of k-step 2m + e // 4 (any permutation of K is fine when B uses the same one).
            # x^T[s, v] = sum_c x_s[c] S0[v, c] bdec[c]: m16 = the 2T draft vectors (A, from shared memory), n8 =
            # 8 of the warp's rows (B: rows 16w + 8 nt + g), k = channels. k-pairs (q, q + 4) of step ks are the
            # channel pairs of _pair_group(ks, q): two consecutive bf16 words of the thread's checkpoint chunk,
            # an exact B operand as loaded (no conversion, no split; bdec rides on x).
            if const_expr(self.pool_fp32):
                # An fp32 checkpoint (frozen verify): the same products with S0 split into bf16 hi + lo as it is
                # loaded, one 8-channel chunk m (k-steps 2m, 2m + 1) of both rows at a time (16 words live, not
                # 64): x_hi S_hi + x_lo S_hi + x_hi S_lo per step, to about fp32 accuracy (_split_bf16x2).
                acc = cute.make_rmem_tensor((8,), Float32)
                for i in cutlass.range_constexpr(8):
                    acc[i] = Float32(0.0)
                for m in cutlass.range_constexpr(CHUNKS_PER_THREAD):
                    s0_f = cute.make_rmem_tensor((2 * CHUNK,), Float32)  # [row nt][channel e]
                    s0_f_chunks = cute.zipped_divide(s0_f, (CHUNK,))
                    for rho in cutlass.range_constexpr(2):
                        s0_row = cute.zipped_divide(gPool[v0 + rows[rho], None], (CHUNK,))
                        cute.autovec_copy(s0_row[None, m * ROW_THREADS + q4], s0_f_chunks[None, rho])
                    s_hi = cute.make_rmem_tensor((2 * CHUNK // 2,), Int32)  # [row nt][channel pair]
                    s_lo = cute.make_rmem_tensor((2 * CHUNK // 2,), Int32)
                    for z in cutlass.range_constexpr(CHUNK):
                        s_hi[z], s_lo[z] = _split_bf16x2(s0_f[2 * z], s0_f[2 * z + 1])
                    for half in cutlass.range_constexpr(2):
                        grp_k = _pair_group(2 * m + half, q4)
                        xop_hi = cute.make_rmem_tensor((4,), Int32)
                        xop_lo = cute.make_rmem_tensor((4,), Int32)
                        cute.autovec_copy(sXb[0, g4, grp_k, None], xop_hi)
                        cute.autovec_copy(sXb[1, g4, grp_k, None], xop_lo)
                        a_hi = [xop_hi[i] for i in range(4)]
                        for nt in cutlass.range_constexpr(2):
                            w0 = nt * (CHUNK // 2) + 2 * half
                            b_hi = (s_hi[w0], s_hi[w0 + 1])
                            d = _mma_bf16_m16n8k16(a_hi, b_hi, [acc[4 * nt + i] for i in range(4)])
                            d = _mma_bf16_m16n8k16([xop_lo[i] for i in range(4)], b_hi, d)
                            d = _mma_bf16_m16n8k16(a_hi, (s_lo[w0], s_lo[w0 + 1]), d)
                            for i in cutlass.range_constexpr(4):
                                acc[4 * nt + i] = d[i]
            else:
                load_checkpoint_rows()
                s0_words = cute.recast_tensor(s0_raw, Int32)  # [row nt][chunk m][4 channel pairs]
                acc = cute.make_rmem_tensor((8,), Float32)  # n-tile nt: (s = g, v = 2q, 2q + 1), (s = g + 8, same)
                for i in cutlass.range_constexpr(8):
                    acc[i] = Float32(0.0)
                for ks in cutlass.range_constexpr(K // MMA_K):
                    grp_k = _pair_group(ks, q4)
                    xop_hi = cute.make_rmem_tensor((4,), Int32)
                    xop_lo = cute.make_rmem_tensor((4,), Int32)
                    cute.autovec_copy(sXb[0, g4, grp_k, None], xop_hi)
                    cute.autovec_copy(sXb[1, g4, grp_k, None], xop_lo)
                    for nt in cutlass.range_constexpr(2):
                        w0 = nt * 16 + (ks // 2) * 4 + 2 * (ks % 2)
                        b_s0 = (s0_words[w0], s0_words[w0 + 1])
                        d = _mma_bf16_m16n8k16([xop_hi[i] for i in range(4)], b_s0, [acc[4 * nt + i] for i in range(4)])
                        d = _mma_bf16_m16n8k16([xop_lo[i] for i in range(4)], b_s0, d)
                        for i in cutlass.range_constexpr(4):
                            acc[4 * nt + i] = d[i]
            if const_expr(self.ring):
                if is_flush:
                    # S_commit = S0 * bdec + U^T WK in fp32 registers, one rounding to bf16. Fold on MMA: M = the
                    # warp's 16 rows, K = ring rows, N = channels. n-tile nt, column n stands for channel
                    # (4 (nt // 4) + n // 2) * 8 + 2 (nt % 4) + n % 2, so the accumulator fragment is exactly this
                    # thread's state registers. u is bf16 in the ring (exact as an operand); wk is split hi + lo.
                    # One 8-channel chunk m (n-tiles 4m .. 4m + 3) at a time: 16 accumulators live instead of 64
                    # (S0 * bdec, then the k-steps in order).
                    raw = cute.make_rmem_tensor((CHUNK,), mPool.element_type)
                    for m in cutlass.range_constexpr(CHUNKS_PER_THREAD):
                        fold_acc = cute.make_rmem_tensor((2 * CHUNK,), Float32)  # [rho][e]
                        for rho in cutlass.range_constexpr(2):
                            for e in cutlass.range_constexpr(CHUNK):
                                ch = (m * ROW_THREADS + q4) * CHUNK + e
                                fold_acc[rho * CHUNK + e] = s0_raw[rho * 32 + m * CHUNK + e].to(Float32) * sBdec[ch]
                        for ks in cutlass.range_constexpr(KPAD // MMA_K):
                            if P > ks * MMA_K:
                                jp0 = ks * (MMA_K // 2) + q4
                                a_u = (sUp[jp0, rows[0]], sUp[jp0, rows[1]])
                                a_u = (*a_u, sUp[jp0 + 4, rows[0]], sUp[jp0 + 4, rows[1]])
                                for nt in cutlass.range_constexpr(4 * m, 4 * m + 4):
                                    e0 = 2 * (nt % 4)
                                    col = (m * ROW_THREADS + g4 // 2) * CHUNK + e0 + g4 % 2
                                    b = cute.make_rmem_tensor((4,), Int32)
                                    cute.autovec_copy(sWK[col, _fold_group(col, ks, q4, KPAD), None], b)
                                    ids = (e0, e0 + 1, CHUNK + e0, CHUNK + e0 + 1)
                                    d = _mma_bf16_m16n8k16(a_u, (b[0], b[1]), [fold_acc[z] for z in ids])
                                    d = _mma_bf16_m16n8k16(a_u, (b[2], b[3]), d)
                                    for z in cutlass.range_constexpr(4):
                                        fold_acc[ids[z]] = d[z]
                        for rho in cutlass.range_constexpr(2):
                            row_chunks = cute.zipped_divide(gPool[v0 + rows[rho], None], (CHUNK,))
                            for e in cutlass.range_constexpr(CHUNK):
                                raw[e] = fold_acc[rho * CHUNK + e].to(mPool.element_type)
                            cute.autovec_copy(raw, row_chunks[None, m * ROW_THREADS + q4])
            cute.arch.sync_threads()

            # ---- phase 2d: ring correction x_s += sum_j u_j M[j, s] (MMA: M = 16 rows, K = ring rows) -----------
            if const_expr(self.ring):
                if P > 0:
                    # x^T += M^T U: m16 = draft vectors (A: sM), n8 = 8 state rows (B: u pairs), k = ring rows; acc
                    # still holds phase 2c's products
                    for ks in cutlass.range_constexpr(KPAD // MMA_K):
                        if P > ks * MMA_K:
                            m_hi = cute.make_rmem_tensor((4,), Int32)
                            m_lo = cute.make_rmem_tensor((4,), Int32)
                            cute.autovec_copy(sM[0, g4, ks * 4 + q4, None], m_hi)
                            cute.autovec_copy(sM[1, g4, ks * 4 + q4, None], m_lo)
                            jp0 = ks * (MMA_K // 2) + q4
                            for nt in cutlass.range_constexpr(2):
                                v_loc = warp * 16 + nt * 8 + g4
                                b_u = (sUp[jp0, v_loc], sUp[jp0 + 4, v_loc])
                                c_in = [acc[4 * nt + i] for i in range(4)]
                                d = _mma_bf16_m16n8k16([m_hi[i] for i in range(4)], b_u, c_in)
                                d = _mma_bf16_m16n8k16([m_lo[i] for i in range(4)], b_u, d)
                                for i in cutlass.range_constexpr(4):
                                    acc[4 * nt + i] = d[i]
            # sXY shares sXb / sXu, whose last reads (phases 2b, 2c) ended at the sync above
            self.store_dots(sXY, acc, warp, q4, g4)
            cute.arch.sync_threads()

            # ---- phase 3: k^ appends (V tile 0, threads past the tile), the triangular solve (one row each) -
            if const_expr(self.ring):
                if tile == 0:
                    if tidx >= TV:
                        helpers = NT - TV
                        ka_tasks = T * (K // CHUNK)
                        for it in cutlass.range_constexpr((ka_tasks + helpers - 1) // helpers):
                            task = (tidx - TV) + it * helpers
                            if task < ka_tasks:
                                t = task // (K // CHUNK)
                                c8 = task % (K // CHUNK)
                                k8 = cute.make_rmem_tensor((CHUNK,), Float32)
                                cute.autovec_copy(cute.zipped_divide(sK[t, None], (CHUNK,))[None, c8], k8)
                                inv_k = sInv[t]
                                k_hat = cute.make_rmem_tensor((CHUNK,), mKCache.element_type)
                                for e in cutlass.range_constexpr(CHUNK):
                                    k_hat[e] = (k8[e] * inv_k).to(mKCache.element_type)
                                cute.autovec_copy(k_hat, _row_chunks(gKR, (base + P + t) & RING, CHUNK)[None, c8])
            if const_expr(self.varlen):
                tok0 = sRow[0]  # read again (see sRow)
                n_tok = sRow[1]
            if const_expr(self.records):
                # This (request, head)'s records, at the slot read again (volatile: a new load, so the first value
                # is not held through phase 2c, where the 64-register build spilled with it).
                slot_again = Int64(_ld_volatile(cute.domain_offset((bi,), mSlot).iterator,
                                                Int64 if const_expr(self.slot_int64) else Int32))
                gCorr = mCorr[slot_again, h, None, None]  # [T_max, 128] fp32
                gKG = mKG[slot_again, h, None, None]  # [T_max, 256]
                n_rec = cutlass.min(Int32(mCorr.shape[2]), Int32(n_tok))  # tokens with a record
                # the kg records raw k_s | raw g_s (parked in sKGraw at entry) for s < n_rec, once per (request, head)
                # by V tile 0's threads past the tile, as 16-byte runs
                if tile == 0:
                    if tidx >= TV:
                        helpers = NT - TV
                        kg_tasks = T * (2 * K // CHUNK)
                        for it in cutlass.range_constexpr((kg_tasks + helpers - 1) // helpers):
                            task = (tidx - TV) + it * helpers
                            if task < kg_tasks:
                                t = task // (2 * K // CHUNK)
                                c8 = task % (2 * K // CHUNK)
                                if t < n_rec:
                                    run = cute.make_rmem_tensor((CHUNK,), mKG.element_type)
                                    cute.autovec_copy(cute.zipped_divide(sKGraw[t, None], (CHUNK,))[None, c8], run)
                                    cute.autovec_copy(run, _row_chunks(gKG, t, CHUNK)[None, c8])
            if tidx < TV:
                # u_s = beta_s (v_s - S_commit kx_s - sum_{r<s} A[s, r] u_r), o_s = S_commit qx_s + sum_{r<=s}
                # Aq[s, r] u_r, on raw k / q: with n_s = 1/|k_s|, x~ = S_commit (exp(cum) k_raw) and
                # w_r = n_r u_r, u_s = beta_s (v_s - n_s (x~_s + sum A~[s, r] w_r)), o_s = (scale/|q_s|)(y~_s +
                # sum Aq~[s, r] w_r).
                v = v0 + tidx
                xy = cute.make_rmem_tensor((2 * T,), Float32)
                cute.autovec_copy(sXY[tidx, None], xy)
                w_u = cute.make_rmem_tensor((T,), Float32)
                if const_expr(self.varlen):
                    gO = cute.domain_offset((tok0, 0), mOut[0, None, h, None])  # (offset here: fewer live registers)
                else:
                    gO = mOut[bi, None, h, None]

                solve_args = (xy, w_u, sA, sAq, sBeta, sInv, sVin, tidx, v, gO, n_tok,
                              *((gUR, base + P) if const_expr(self.ring) else (None, None)),
                              *((gCorr, n_rec) if const_expr(self.records) else (None, None)))
                if const_expr(self.unmasked_full_rows()):
                    # a CTA-uniform branch: full rows (the common case) store without predicates
                    n_run = n_tok
                    if const_expr(self.records):
                        n_run = n_rec
                    if n_run == T:
                        self.solve_and_store(False, *solve_args)
                    else:
                        self.solve_and_store(True, *solve_args)
                else:
                    self.solve_and_store(True, *solve_args)
        else:
            for i in cutlass.range(tidx, T * TV, NT):
                t = i // TV
                r = i % TV
                if const_expr(self.varlen):
                    if t < n_tok:
                        mOut[0, tok0 + t, h, v0 + r] = Float32(0.0).to(mOut.element_type)
                else:
                    mOut[bi, t, h, v0 + r] = Float32(0.0).to(mOut.element_type)
        if const_expr(self.varlen):
            # Tokens no row owns are zero (common rule 1: outputs are exact outside [bos_0, eos_last) for
            # non-decreasing offsets): the first row's CTAs zero those before its start, the last row's those past its
            # end, each its head and V tile. (Tokens past T inside a row are not written.)
            if bi == 0:
                head = sRow[0]
                for i in cutlass.range(tidx, head * TV, NT):
                    mOut[0, i // TV, h, v0 + i % TV] = Float32(0.0).to(mOut.element_type)
            if bi == mSlot.shape[0] - 1:
                tokens = mQ.shape[1]
                cu_type = Int64 if const_expr(self.cu_int64) else Int32
                end64 = Int64(_ld_volatile(cute.domain_offset((bi + 1,), mCu).iterator, cu_type))
                tail0 = Int32(cutlass.min(cutlass.max(end64, Int64(sRow[0])), Int64(tokens)))  # eos_last, clamped
                for i in cutlass.range(tidx, (tokens - tail0) * TV, NT):
                    mOut[0, tail0 + i // TV, h, v0 + i % TV] = Float32(0.0).to(mOut.element_type)


def _fakes(cfg: UcacheVerifyFlush):

    bf16, f32, i32 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32
    B = _launch.sym_size()
    N = _launch.sym_size()
    H, T, K = cfg.heads, cfg.t_draft, HEAD_DIM
    align = lambda dt: 16 if cfg.aligned else dt.width // 8  # noqa: E731
    # kda-core's aligned class covers q, k, v, g and the output too; only the build that reads 8-channel runs of them
    # (UcacheVerifyFlush.vector_activations) declares it
    act_align = lambda dt: 16 if cfg.vector_activations() else dt.width // 8  # noqa: E731
    act = lambda dt: _launch.fake_tensor(dt, (B, T, H, K), (None, None, None, 1), align_bytes=act_align(dt))  # noqa: E731
    act_v = lambda dt: _launch.fake_tensor(  # noqa: E731
        dt, (B, T, H, K), (None, None, None, 1), align_bytes=16 if cfg.vector_v() else act_align(dt)
    )
    ring = lambda dt: _launch.fake_tensor(  # noqa: E731
        dt, (N, H, RING_SLOTS, K), (None, RING_SLOTS * K, K, 1), align_bytes=align(dt)
    )
    vec = lambda dt, n: _launch.fake_tensor(dt, (n,), (1,), align_bytes=4)  # noqa: E731
    return (
        act(bf16),  # q
        act(bf16),  # k
        act_v(bf16),  # v
        act(bf16),  # g
        _launch.fake_tensor(bf16, (B, T, H), (None, None, None), align_bytes=2),  # beta logits
        vec(f32, H),  # A_log
        vec(f32, H * K) if cfg.has_dt_bias else None,  # dt_bias
        _launch.fake_tensor(bf16, (N, H, K, K), (None, K * K, K, 1), align_bytes=align(bf16)),  # pool
        _launch.fake_tensor(cutlass.Int64 if cfg.slot_int64 else i32, (B,), (None,) if cfg.slots_strided else (1,),
                            align_bytes=8 if cfg.slot_int64 else 4),  # slot indices
        ring(bf16),  # k_cache
        ring(bf16),  # u_cache
        ring(f32),  # g_cache
        vec(i32, B),  # hist_len
        vec(i32, B),  # cache_base
        act(bf16),  # output
        None,  # correction cache (frozen verify only)
        None,  # kg cache
        None,  # cu_seqlens
    )


def _frozen_fakes(cfg: UcacheVerifyFlush):
    """The frozen verify's arguments, in the kernel's order (the ring tensors and cursors absent)."""
    bf16, f32, i32 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32
    B = _launch.sym_size()  # rows (slots)
    N = _launch.sym_size()  # pool rows, also the records' rows
    H, T, K = cfg.heads, cfg.t_draft, HEAD_DIM
    # varlen: the activations are [1, tokens, H, K]; else [B, T, H, K] (the batch dims are the slots' count)
    BA, TA = (_launch.sym_size(), _launch.sym_size()) if cfg.varlen else (B, T)
    align = lambda dt: 16 if cfg.aligned else dt.width // 8  # noqa: E731
    act_align = lambda dt: 16 if cfg.vector_activations() else dt.width // 8  # noqa: E731
    act = lambda dt: _launch.fake_tensor(dt, (BA, TA, H, K), (None, None, None, 1), align_bytes=act_align(dt))  # noqa: E731
    act_v = lambda dt: _launch.fake_tensor(  # noqa: E731
        dt, (BA, TA, H, K), (None, None, None, 1), align_bytes=16 if cfg.vector_v() else act_align(dt)
    )
    vec = lambda dt, n: _launch.fake_tensor(dt, (n,), (1,), align_bytes=4)  # noqa: E731
    T_max = _launch.sym_size()
    pool_type = f32 if cfg.pool_fp32 else bf16
    records = (None, None)
    if cfg.records:
        records = (
            _launch.fake_tensor(f32, (N, H, T_max, K), (None, None, None, 1), align_bytes=4),  # correction cache
            _launch.fake_tensor(bf16, (N, H, T_max, 2 * K), (None, None, None, 1), align_bytes=align(bf16)),  # kg
        )
    cu = None
    if cfg.varlen:
        cu_type = cutlass.Int64 if cfg.cu_int64 else i32
        cu = _launch.fake_tensor(cu_type, (_launch.sym_size(),), (None,), align_bytes=cu_type.width // 8)
    return (
        act(bf16),  # q
        act(bf16),  # k
        act_v(bf16),  # v
        act(bf16),  # g
        _launch.fake_tensor(bf16, (BA, TA, H), (None, None, None), align_bytes=2),  # beta logits
        vec(f32, H),  # A_log
        vec(f32, H * K) if cfg.has_dt_bias else None,  # dt_bias
        _launch.fake_tensor(pool_type, (N, H, K, K), (None, K * K, K, 1), align_bytes=align(pool_type)),  # pool
        _launch.fake_tensor(cutlass.Int64 if cfg.slot_int64 else i32, (B,), (None,) if cfg.slots_strided else (1,),
                            align_bytes=8 if cfg.slot_int64 else 4),  # slot indices
        None,  # k_cache
        None,  # u_cache
        None,  # g_cache
        None,  # hist_len
        None,  # cache_base
        act(bf16),  # output
        *records,
        cu,
    )


def build_ucache_kernel(
    heads: int,
    t_draft: int,
    w_ring: int,
    tile_v: int,
    softplus_gate: bool,
    aligned: bool,
    arch: str,
    extra_options: str = "",
    min_ctas: int = 0,
    has_dt_bias: bool = True,
    null_policy: NullSlotPolicy = NullSlotPolicy.OUT_OF_RANGE,
    slot_int64: bool = False,
    slots_strided: bool = False,
):
    """Compile one configuration against fake tensors (no GPU needed when CUTE_DSL_ARCH is set)."""
    cfg = UcacheVerifyFlush(heads, t_draft, w_ring, tile_v, softplus_gate, aligned, min_ctas, has_dt_bias, null_policy,
                            slot_int64, slots_strided)
    return cute.compile(
        cfg,
        *_fakes(cfg),
        cutlass.Float32(1.0),
        cutlass.Float32(-5.0),
        cutlass.Int32(9),
        _launch.fake_stream(),
        options=_launch.compile_options(arch, extra_options),
    )


def build_frozen_kernel(
    heads: int,
    t_draft: int,
    tile_v: int,
    softplus_gate: bool,
    aligned: bool,
    arch: str,
    extra_options: str = "",
    min_ctas: int = 0,
    has_dt_bias: bool = True,
    null_policy: NullSlotPolicy = NullSlotPolicy.OUT_OF_RANGE,
    slot_int64: bool = False,
    slots_strided: bool = False,
    records: bool = False,
    varlen: bool = False,
    cu_int64: bool = False,
    pool_fp32: bool = False,
):
    """Compile one frozen-verify configuration (the ucache kernel with ``ring=False``) against fake tensors."""
    cfg = UcacheVerifyFlush(heads, t_draft, 0, tile_v, softplus_gate, aligned, min_ctas, has_dt_bias, null_policy,
                            slot_int64, slots_strided, ring=False, records=records, varlen=varlen, cu_int64=cu_int64,
                            pool_fp32=pool_fp32)
    return cute.compile(
        cfg,
        *_frozen_fakes(cfg),
        cutlass.Float32(1.0),
        cutlass.Float32(-5.0),
        cutlass.Int32(0),
        _launch.fake_stream(),
        options=_launch.compile_options(arch, extra_options),
    )


class UcacheRestartCursors:
    """The flush part of the caller's commit, on device: for every active row whose clamped history
    P = clamp(hist_len, 0, max_hist_len) reaches flush_min, cache_base = (cache_base + P) & 31 and hist_len = 0:
    the P the verify kernel read and folded, so a malformed hist_len moves the ring by the rows actually folded
    (docs/design.md §5). One thread per row; no host sync, so it captures into CUDA graphs. It runs after the
    verify kernel (same stream): inside that kernel every CTA of a request reads the cursors, so none of them may
    rewrite them. ``null_policy``: which slots make a row inactive, as in the verify kernel.
    """

    threads = 128

    def __init__(self, null_policy: NullSlotPolicy = NullSlotPolicy.OUT_OF_RANGE, slot_int64: bool = False):
        self.first_slot = 1 if null_policy == NullSlotPolicy.NONPOSITIVE else 0
        self.slot_int64 = slot_int64

    @cute.jit
    def __call__(
        self,
        mSlot: cute.Tensor,
        mHist: cute.Tensor,
        mBase: cute.Tensor,
        pool_rows: cutlass.Int32,
        flush_min: cutlass.Int32,
        max_hist: cutlass.Int32,
        stream,
    ):
        batch = mSlot.shape[0]
        self.kernel(mSlot, mHist, mBase, pool_rows, flush_min, max_hist).launch(
            grid=[(batch + self.threads - 1) // self.threads, 1, 1], block=[self.threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mSlot: cute.Tensor,
        mHist: cute.Tensor,
        mBase: cute.Tensor,
        pool_rows: cutlass.Int32,
        flush_min: cutlass.Int32,
        max_hist: cutlass.Int32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * self.threads + tidx
        if i < mSlot.shape[0]:
            slot = Int64(mSlot[i])  # any index width, compared in 64 bits
            if (slot >= Int64(self.first_slot)) & (slot < Int64(pool_rows)):
                P = cutlass.min(cutlass.max(mHist[i], cutlass.Int32(0)), max_hist)  # as the verify kernel clamps
                if P >= flush_min:
                    mBase[i] = (mBase[i] + P) & (RING_SLOTS - 1)
                    mHist[i] = cutlass.Int32(0)


def build_restart_kernel(arch: str, null_policy: NullSlotPolicy = NullSlotPolicy.OUT_OF_RANGE,
                         slot_int64: bool = False):
    i32 = cutlass.Int32
    B = _launch.sym_size()
    vec = lambda: _launch.fake_tensor(i32, (B,), (1,), align_bytes=4)  # noqa: E731
    return cute.compile(
        UcacheRestartCursors(null_policy, slot_int64),
        # slot indices: int32 or int64, any stride
        _launch.fake_tensor(cutlass.Int64 if slot_int64 else i32, (B,), (None,), align_bytes=8 if slot_int64 else 4),
        vec(),
        vec(),
        i32(1),
        i32(9),
        i32(16),
        _launch.fake_stream(),
        options=_launch.compile_options(arch),
    )


def restart_cursors(slot_indices, hist_len, cache_base, pool_rows: int, flush_min: int, t_draft: int,
                    w_ring: int, *, null_policy: NullSlotPolicy = NullSlotPolicy.OUT_OF_RANGE) -> None:
    """Apply the flush part of the commit in place (see :class:`UcacheRestartCursors`); B == 0 launches nothing."""
    if slot_indices.shape[0] == 0:
        return
    slot_int64 = slot_indices.dtype == torch.int64
    fn = _launch.get_or_compile(("kda_ucache_restart_cursors", null_policy, slot_int64),
                                lambda arch: build_restart_kernel(arch, null_policy, slot_int64),
                                _launch.arch_for(slot_indices.device))
    fn(slot_indices, hist_len, cache_base, int(pool_rows), int(flush_min), max_hist_len(t_draft, w_ring))


_BATCH_ARGS = (0, 1, 2, 3, 4, 8, 12, 13, 14)  # q, k, v, g, b, slot_indices, hist_len, cache_base, output


def ucache_verify_flush(
    A_log: torch.Tensor,
    g: torch.Tensor,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    b: torch.Tensor,
    state_pool: torch.Tensor,
    slot_indices: torch.Tensor,
    k_cache: torch.Tensor,
    u_cache: torch.Tensor,
    g_cache: torch.Tensor,
    hist_len: torch.Tensor,
    cache_base: torch.Tensor,
    flush_min: int,
    w_ring: int,
    scale: float,
    output: torch.Tensor,
    restart_hist_on_flush: bool = False,
    aligned: bool = True,
    *,
    config: UcacheConfig | None = None,
    null_policy: NullSlotPolicy = NullSlotPolicy.OUT_OF_RANGE,
) -> torch.Tensor:
    """Launch the kernel on the current stream. Arguments are already validated (kda-recurrent does it).

    A_log [H] fp32, dt_bias [H*128] fp32 (contiguous) or None (zeros); q, k, v, g [B, T, H, 128] bf16 (last dim
    contiguous); b [B, T, H] bf16 logits; state_pool [N, H, 128, 128] bf16 (inner dims contiguous, dim-0 stride a
    multiple of 8 on the aligned variant, any number of elements >= the row on the unaligned one); k_cache, u_cache
    [N, H, 32, 128] bf16 and g_cache fp32 (same rule); slot_indices [B] int32 or int64, any stride (a column of a
    wider table); hist_len, cache_base [B] int32 contiguous; output [B, T, H, 128] bf16. ``aligned``: every pointer
    and row stride of the activations, the pool and the rings is a multiple of 16 bytes (kda_core's validation says
    so). The kernel only reads the cursors;
    ``restart_hist_on_flush`` then applies the flush part of the commit with a second, one-thread-per-row kernel.
    ``config``: the launch schedule (:class:`UcacheConfig`); None takes :func:`select_config`'s for (B, H).
    ``null_policy``: which slots make a row inactive (docs/design.md §4): ``OUT_OF_RANGE`` (slot < 0 or >= N) or
    ``NONPOSITIVE`` (vLLM: slot <= 0 or >= N; slot 0's pool row, rings and cursors are never touched).
    """
    B, T, H, _ = q.shape
    if H > GRID_Y_MAX:
        fail("q", f"at most {GRID_Y_MAX} heads (dim 2) per call (grid y limit)", H)
    if config is not None and (not isinstance(config, UcacheConfig) or config.tile_v not in TILES
                               or not 0 <= config.min_ctas <= 32):
        fail("config", f"a UcacheConfig with tile_v in {TILES} and min_ctas in [0, 32]", config)
    if not isinstance(null_policy, NullSlotPolicy):
        fail("null_policy", "a kda_core.contracts.NullSlotPolicy", null_policy)
    if debug_checks_enabled():  # KDA_DEBUG_VALIDATE: duplicate active slots
        flat = slot_indices.reshape(-1)
        if null_policy == NullSlotPolicy.NONPOSITIVE:
            flat = flat[flat != 0]  # slot 0 is null there: padding rows may repeat it
        debug_check_slots(flat, state_pool.shape[0], argument="slot_indices")
    if B == 0 or H == 0:  # nothing to launch (a grid dimension would be 0), no cursor to restart
        return output
    cfg = select_config(B, H) if config is None else config
    softplus_gate = lower_bound is None
    has_dt_bias = dt_bias is not None
    slot_int64 = slot_indices.dtype == torch.int64
    slots_strided = B > 1 and slot_indices.stride(0) != 1
    key = ("kda_ucache_verify_flush", H, T, w_ring, cfg.tile_v, cfg.floor, softplus_gate, bool(aligned), has_dt_bias,
           null_policy, slot_int64, slots_strided)  # fmt: skip
    fn = _launch.get_or_compile(
        key,
        lambda arch: build_ucache_kernel(H, T, w_ring, cfg.tile_v, softplus_gate, bool(aligned), arch,
                                         min_ctas=cfg.floor, has_dt_bias=has_dt_bias, null_policy=null_policy,
                                         slot_int64=slot_int64, slots_strided=slots_strided),  # fmt: skip
        _launch.arch_for(q.device),
    )
    args = [q, k, v, g, b, A_log, dt_bias, state_pool, slot_indices, k_cache, u_cache, g_cache, hist_len, cache_base,
            output, None, None, None, float(scale), float(-5.0 if lower_bound is None else lower_bound), int(flush_min)]
    if B <= GRID_Z_MAX:
        fn(*args)
    else:
        # The grid puts B on gridDim.z: a larger batch runs as several launches on row views of the batch-indexed
        # arguments (requests are independent; a view moves the pointers by whole row strides, so the alignment
        # class is kept).
        for b0 in range(0, B, GRID_Z_MAX):
            fn(*[a[b0 : b0 + GRID_Z_MAX] if i in _BATCH_ARGS else a for i, a in enumerate(args)])
    if restart_hist_on_flush:
        restart_cursors(slot_indices, hist_len, cache_base, state_pool.shape[0], flush_min, T, w_ring,
                        null_policy=null_policy)
    return output


FROZEN_T_DRAFT = (4, 8)
FROZEN_STATE_DTYPES = (torch.bfloat16, torch.float32)
"""The checkpoint dtypes :func:`frozen_verify` reads (fp32 as bf16 hi + lo MMA operands)."""
_FROZEN_BATCH_ARGS = (0, 1, 2, 3, 4, 8, 14)  # q, k, v, g, b, slot_indices, output (dense activations)


def frozen_verify(
    A_log: torch.Tensor,
    g: torch.Tensor,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    b: torch.Tensor,
    state_pool: torch.Tensor,
    slot_indices: torch.Tensor,
    scale: float,
    output: torch.Tensor,
    *,
    correction_cache: torch.Tensor | None = None,
    kg_cache: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    t_draft: int | None = None,
    aligned: bool = True,
    config: UcacheConfig | None = None,
    null_policy: NullSlotPolicy = NullSlotPolicy.OUT_OF_RANGE,
) -> torch.Tensor:
    """Frozen verify on the tensor cores: T draft tokens from the checkpoint ``state_pool[slot_indices[b]]``, outputs
    only, no state written (the ucache kernel with no ring, ``UcacheVerifyFlush(ring=False)``; docs/ucache.md).
    Arguments are already validated (kda-recurrent does it); launched on the current stream, CUDA-graph safe.

    A_log [H] fp32, dt_bias [H*128] fp32 (contiguous) or None (zeros), lower_bound (None: the softplus gate);
    q, k, v, g [B, T, H, 128] bf16 (last dim contiguous), T in {4, 8}, H == HV; b [B, T, H] bf16 beta logits;
    state_pool [N, H, 128, 128] bf16 or fp32 (inner dims contiguous, slot stride any number of elements >= the
    row; an fp32 checkpoint enters the MMAs as bf16 hi + lo, to about fp32 accuracy);
    slot_indices [B] int32 or int64, any stride; output [B, T, H, 128] bf16. A null slot under ``null_policy``
    (docs/design.md §4) makes the row inactive: zero output, nothing read or written (no records).

    RecoverSSM records (spec §3; both or neither): ``correction_cache`` [N, H, T_max, 128] fp32 gets u_s
    (``correction_cache[slot, h, s, :] = u_s``, fp32, unrounded) and ``kg_cache`` [N, H, T_max, 256] bf16 the raw
    k_s | raw g_s, for s < min(T_max, tokens of the row); other rows and positions are untouched. Strides free
    except the last dim (contiguous); dim 0 is the pool's rows.

    Varlen (``cu_seqlens`` [B + 1] int32 / int64, vLLM's query_start_loc): q, k, v, g, output [1, tokens, H, 128],
    b [1, tokens, H]; ``t_draft`` (4 or 8) is then required. Row b owns tokens [bos_b, eos_b) (clamped per the
    common rule: ``bos = clamp(cu[b], 0, tokens)``, ``eos = clamp(cu[b + 1], bos, tokens)``) and runs its first
    min(eos - bos, T) of them: a shorter row masks the missing tokens (no output or record for them); the output of
    a token past T in its row is not written (left as it was), and tokens no row owns (before the first row's start,
    past the last row's end) are zeroed, as common rule 1 has it. At most 65535 rows (one launch: grid z).

    ``aligned``: every pointer and non-unit stride of q, k, v, g, output, state_pool and kg_cache is a multiple of
    16 bytes (``kda_core.validation.tensor_alignment`` == 16 on each); else the same code with element-wide
    accesses. ``config``: the launch schedule (:class:`UcacheConfig`); None takes :func:`select_config`'s for
    (B, H).
    """
    varlen = cu_seqlens is not None
    B = slot_indices.shape[0]
    H = q.shape[2]
    T = q.shape[1] if not varlen else t_draft
    if varlen and t_draft not in FROZEN_T_DRAFT:
        fail("t_draft", f"one of {FROZEN_T_DRAFT} with cu_seqlens (the tokens each row runs at most)", t_draft)
    if not varlen and t_draft is not None and t_draft != q.shape[1]:
        fail("t_draft", f"None or q's token count {q.shape[1]} without cu_seqlens", t_draft)
    if not varlen and T not in FROZEN_T_DRAFT:
        fail("q", f"a token count (dim 1) in {FROZEN_T_DRAFT}", T)
    if varlen and (cu_seqlens.dim() != 1 or cu_seqlens.shape[0] != B + 1 or q.shape[0] != 1):
        fail("cu_seqlens", f"[B + 1] = [{B + 1}] offsets with [1, tokens, H, 128] activations",
             f"{tuple(cu_seqlens.shape)} with q {tuple(q.shape)}")
    if not varlen and q.shape[0] != B:  # the grid runs one request per slot
        fail("slot_indices", f"one slot per request of q ([{q.shape[0]}])", tuple(slot_indices.shape))
    if H > GRID_Y_MAX:
        fail("q", f"at most {GRID_Y_MAX} heads (dim 2) per call (grid y limit)", H)
    if config is not None and (not isinstance(config, UcacheConfig) or config.tile_v not in TILES
                               or not 0 <= config.min_ctas <= 32):
        fail("config", f"a UcacheConfig with tile_v in {TILES} and min_ctas in [0, 32]", config)
    if not isinstance(null_policy, NullSlotPolicy):
        fail("null_policy", "a kda_core.contracts.NullSlotPolicy", null_policy)
    records = correction_cache is not None
    if records != (kg_cache is not None):
        fail("kg_cache", "given exactly when correction_cache is (the RecoverSSM records come as a pair)",
             "a tensor" if kg_cache is not None else None)
    if records:
        # the kernel bounds the row's slot by the pool's rows: the records must have the same rows (and heads)
        N = state_pool.shape[0]
        if tuple(correction_cache.shape[:2]) != (N, H) or correction_cache.shape[3] != HEAD_DIM:
            fail("correction_cache", f"[{N}, {H}, T_max, {HEAD_DIM}]", tuple(correction_cache.shape))
        if tuple(kg_cache.shape) != (N, H, correction_cache.shape[2], 2 * HEAD_DIM):
            fail("kg_cache", f"[{N}, {H}, {correction_cache.shape[2]}, {2 * HEAD_DIM}]", tuple(kg_cache.shape))
    if records and debug_checks_enabled():
        # KDA_DEBUG_VALIDATE: duplicate active slots race on their record rows (without records nothing is written,
        # and a read-only slot may repeat, as kda_core.validation_spec.debug_check_spec_slots has it)
        flat = slot_indices.reshape(-1)
        if null_policy == NullSlotPolicy.NONPOSITIVE:
            flat = flat[flat != 0]  # slot 0 is null there: padding rows may repeat it
        debug_check_slots(flat, state_pool.shape[0], argument="slot_indices")
    if varlen and B > GRID_Z_MAX:  # one launch: its first and last rows zero the tokens no row owns
        fail("cu_seqlens", f"at most {GRID_Z_MAX} rows ({GRID_Z_MAX + 1} offsets; grid z limit)", cu_seqlens.shape[0])
    if B == 0 or H == 0:  # nothing to launch (a grid dimension would be 0)
        return output
    if varlen and q.shape[1] == 0:  # every row is empty: no output, no record (and no token for a masked load)
        return output
    cfg = select_config(B, H) if config is None else config
    softplus_gate = lower_bound is None
    has_dt_bias = dt_bias is not None
    slot_int64 = slot_indices.dtype == torch.int64
    slots_strided = B > 1 and slot_indices.stride(0) != 1
    cu_int64 = varlen and cu_seqlens.dtype == torch.int64
    pool_fp32 = state_pool.dtype == torch.float32
    key = ("kda_frozen_verify", H, T, cfg.tile_v, cfg.floor, softplus_gate, bool(aligned), has_dt_bias, null_policy,
           slot_int64, slots_strided, records, varlen, cu_int64, pool_fp32)  # fmt: skip
    fn = _launch.get_or_compile(
        key,
        lambda arch: build_frozen_kernel(H, T, cfg.tile_v, softplus_gate, bool(aligned), arch, min_ctas=cfg.floor,
                                         has_dt_bias=has_dt_bias, null_policy=null_policy, slot_int64=slot_int64,
                                         slots_strided=slots_strided, records=records, varlen=varlen,
                                         cu_int64=cu_int64, pool_fp32=pool_fp32),  # fmt: skip
        _launch.arch_for(q.device),
    )
    args = [q, k, v, g, b, A_log, dt_bias, state_pool, slot_indices, None, None, None, None, None, output,
            correction_cache, kg_cache, cu_seqlens, float(scale), float(-5.0 if lower_bound is None else lower_bound),
            0]  # fmt: skip
    if B <= GRID_Z_MAX:
        fn(*args)
    else:
        # The grid puts the rows on gridDim.z: a larger dense batch runs as several launches on row views of every
        # batch-indexed argument (rows are independent; varlen calls are refused above).
        for b0 in range(0, B, GRID_Z_MAX):
            fn(*[a[b0 : b0 + GRID_Z_MAX] if i in _FROZEN_BATCH_ARGS else a for i, a in enumerate(args)])
    return output
