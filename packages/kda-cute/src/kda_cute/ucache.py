"""ReplaySSM "ucache" verify+flush kernel for KDA speculative decode (DESIGN §5, issue 5).

One CTA per (V tile, head, request). Four threads share one state row: each owns 32 of its 128 key channels, in
four interleaved chunks of 8 (16-byte pool accesses; the 4 owners' shared-memory reads hit distinct banks). In the
default MMA variant a thread holds two rows (a warp covers 16) and the chunks double as MMA fragments (see
``docs/ucache.md``). Per (request, head) the CTA first builds, in shared memory:

- the gate of the T draft tokens (g_log), its running sum ``cum`` (the decay restarts at 0 after the
  checkpoint), the L2-normalised k^ and scale * q^;
- the replay vectors ``wk_j = exp(G_{P-1} - G_j) * k^_j`` of the live ring rows j < P (rows j >= P are
  *selected* to zero, never multiplied: stale rows may hold inf) and ``bdec = exp(G_{P-1})``;
- the decayed draft vectors ``kx_s = exp(cum_s) * k^_s`` and ``qx_s = exp(cum_s) * q^_s``;
- the T x T triangles ``A[s, r] = sum_c exp(cum_s - cum_r) k^_r k^_s`` (r < s) and
  ``Aq[s, r] = sum_c exp(cum_s - cum_r) k^_r q^_s`` (r <= s), with exp(cum_s - cum_r) the running product of the
  per-token decays: never a ratio of exponentials, so strong decay (cum down to -40 and beyond) cannot overflow.

Then every state row v is rebuilt in fp32 registers, ``S_commit[v] = S0[v] * bdec + sum_{j<P} u_j[v] wk_j``
(R1), stored once (bf16, round to nearest even) on a flush row, and the T drafts follow from 2T dot products
(warp MMA on bf16 hi/lo splits, fp32 accumulate) and the small triangular recurrence (the chunked WY form of
DESIGN §3):

    u_s = beta_s (v_s - S_commit kx_s - sum_{r<s} A[s, r] u_r),    o_s = S_commit qx_s + sum_{r<=s} Aq[s, r] u_r

The post-draft state is never needed (the ring keeps its ingredients), so no rank-1 updates run.
Appends: u_s rows of this CTA's V tile; k^_s and G (cum_s, plus G_{P-1} on a verify row) once per
(request, head) by the CTA of V tile 0. All appends land at (base + P + s) & 31, past the live window every
CTA of the same (request, head) reads, so no CTA overwrites a row another still needs.

Rows whose slot is outside [0, pool) are inactive: their output is zero and nothing else is read or written.
The cursors (hist_len, cache_base) are only read here; the caller's commit is applied by the wrapper in
kda-recurrent.
"""

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T as ir_types

from kda_core.contracts import HEAD_DIM, RING_SLOTS, max_hist_len

from . import _launch

__all__ = [
    "UcacheVerifyFlush",
    "UcacheRestartCursors",
    "ucache_verify_flush",
    "restart_cursors",
    "build_ucache_kernel",
    "build_restart_kernel",
    "default_tile_v",
]

ROW_THREADS = 4
"""Threads sharing one state row; each owns HEAD_DIM // ROW_THREADS = 32 key channels."""
CHUNK = 8
"""Contiguous bf16 channels per 16-byte pool access."""
CHUNKS_PER_THREAD = HEAD_DIM // (ROW_THREADS * CHUNK)  # 4
L2NORM_EPS = 1e-6
MMA_K = 16
"""K extent of one m16n8k16 MMA; HEAD_DIM // MMA_K = 8 steps cover a state row."""


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


# Resident CTAs per SM asked of ptxas (``min_blocks_per_mp``: it caps the registers to fit), per MMA tile. Without
# it the 256-thread tile-128 CTA takes 102 registers and 52.6 KB of shared memory: 2 CTAs per SM, 25% occupancy,
# and ncu shows the kernel issue-bound (IPC 1.6, most warps waiting). Measured on the H200, 2026-11-29, T=8 w16
# H=12, CUDA-graph replay (benchmarks/results/min_blocks_sweep_h200.json): tile 128 at 3 CTAs (80 registers, an
# 8-byte spill) B=512 278 -> 236 us (0% folds), 342 -> 290 (100%), B=64 36.4 -> 31.1; tile 64 at 5 CTAs B=512
# 347 -> 314 (6 CTAs: 316).
MIN_CTAS_PER_SM = {64: 5, 128: 3}
# Benchmarks' sweep hook: overrides the table when non-zero. Not in the compile key: a sweep clears the compile
# cache between values.
_FORCE_MIN_BLOCKS = 0

DEFAULT_MMA = True
"""Dot products on warp MMA by default; the CUDA-core variant is kept for comparison (``mma=False``)."""


def default_tile_v(batch: int, heads: int, mma: bool = DEFAULT_MMA) -> int:
    """State rows per CTA.

    Every CTA repeats the per-(request, head) preamble (gate, norms, replay vectors, triangles), which costs about
    as many instructions as its share of the state rows: 128-row tiles (256 threads) run it once per (request,
    head), 64-row tiles twice but give small batches twice the CTAs. Crossover guessed at ~4 CTAs of 128 rows per
    SM of an H200 (132 SMs); to be replaced by the measured one (bench_kda_ucache_flush.py --tile-v).
    """
    if not mma:
        return 32
    return 128 if batch * heads >= 4 * 132 else 64


class UcacheVerifyFlush:
    """Compile-time configuration of one ucache verify+flush kernel.

    heads: H == HV; t_draft: T in {4, 8}; w_ring: 16 or 32 (bounds the live rows kept in shared memory);
    tile_v: state rows per CTA; softplus_gate: Kimi-Linear gate (lower_bound None) instead of the lower bound;
    aligned: the pool and rings allow 16-byte accesses (else the same code with element-wide accesses);
    mma: the 2T dot products of every state row on warp MMA (else on CUDA cores).
    """

    def __init__(
        self, heads: int, t_draft: int, w_ring: int, tile_v: int, softplus_gate: bool, aligned: bool, mma: bool
    ):
        self.heads = heads
        self.aligned = aligned
        self.t_draft = t_draft
        self.w_ring = w_ring
        self.max_rows = max_hist_len(t_draft, w_ring)
        self.tile_v = tile_v
        self.mma = mma
        # MMA: one warp per 16 rows (2 rows x 32 channels per thread); CUDA cores: 4 threads per row.
        self.threads = (2 if mma else ROW_THREADS) * tile_v
        self.softplus_gate = softplus_gate
        if tile_v not in ((64, 128) if mma else (32, 64, 128)):
            raise ValueError(f"tile_v: expected {'64 or 128' if mma else '32, 64 or 128'}, got {tile_v}")
        # The preamble loops are unrolled at compile time (their global loads overlap); they need exact trip counts.
        for extent in (t_draft * HEAD_DIM, t_draft * tile_v, self.max_rows * tile_v, self.max_rows * HEAD_DIM):
            assert extent % self.threads == 0, (extent, self.threads)

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mG: cute.Tensor,
        mBeta: cute.Tensor,
        mALog: cute.Tensor,
        mDtBias: cute.Tensor,
        mPool: cute.Tensor,
        mSlot: cute.Tensor,
        mKCache: cute.Tensor,
        mUCache: cute.Tensor,
        mGCache: cute.Tensor,
        mHist: cute.Tensor,
        mBase: cute.Tensor,
        mOut: cute.Tensor,
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
            scale,
            lower_bound,
            flush_min,
        ).launch(grid=[HEAD_DIM // self.tile_v, self.heads, mQ.shape[0]], block=[self.threads, 1, 1], stream=stream,
                 **self.occupancy())

    def occupancy(self) -> dict:
        """Launch attributes: the resident-CTA floor (MMA variant) and the largest shared-memory carveout."""
        ctas = _FORCE_MIN_BLOCKS or (MIN_CTAS_PER_SM.get(self.tile_v, 0) if self.mma else 0)
        return dict(min_blocks_per_mp=ctas, preferred_smem_carveout=100) if ctas else {}

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
        mDtBias: cute.Tensor,
        mPool: cute.Tensor,
        mSlot: cute.Tensor,
        mKCache: cute.Tensor,
        mUCache: cute.Tensor,
        mGCache: cute.Tensor,
        mHist: cute.Tensor,
        mBase: cute.Tensor,
        mOut: cute.Tensor,
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

        tidx, _, _ = cute.arch.thread_idx()
        tile, h, bi = cute.arch.block_idx()
        lane = tidx % 32
        warp = tidx // 32
        v0 = tile * TV

        smem = cutlass.memory.SmemAllocator()
        row_major = lambda rows, cols: cute.make_layout((rows, cols), stride=(cols, 1))  # noqa: E731
        sKh = smem.allocate_tensor(Float32, row_major(T, K), byte_alignment=16)  # raw k, then k^
        sQh = smem.allocate_tensor(Float32, row_major(T, K), byte_alignment=16)  # raw q, then scale*q^
        sCum = smem.allocate_tensor(Float32, row_major(T, K), byte_alignment=16)  # g_log, then cum
        sDec = smem.allocate_tensor(Float32, row_major(T, K), byte_alignment=16)  # per-token decay exp(g_log)
        XCOLS = 2 * T + 2  # [channel pair, column] with 2 words of padding: the B-fragment reads hit 32 banks
        if const_expr(self.mma):
            # decayed draft vectors [kx_0..kx_{T-1}, qx_0..qx_{T-1}] as packed bf16 (hi, lo) channel pairs
            sXh = smem.allocate_tensor(Int32, row_major(K // 2, XCOLS), byte_alignment=16)
            sXl = smem.allocate_tensor(Int32, row_major(K // 2, XCOLS), byte_alignment=16)
            sXY = smem.allocate_tensor(Float32, row_major(TV, 2 * T + 1), byte_alignment=16)
        else:
            sKx = smem.allocate_tensor(Float32, row_major(T, K), byte_alignment=16)
            sQx = smem.allocate_tensor(Float32, row_major(T, K), byte_alignment=16)
        KPAD = MMA_K * ((MAXR + MMA_K - 1) // MMA_K)  # ring rows as the K extent of the fold MMA
        if const_expr(self.mma):
            # Fold operands as packed bf16 pairs along the ring-row axis (the MMA k index); rows j >= P hold
            # zeros written by a select. Row strides padded (+8, +2 words) so the fragment reads hit 32 banks.
            sUp = smem.allocate_tensor(Int32, cute.make_layout((KPAD // 2, TV), stride=(TV + 8, 1)), byte_alignment=16)
            sWKh = smem.allocate_tensor(Int32, cute.make_layout((KPAD // 2, K), stride=(K + 2, 1)), byte_alignment=16)
            sWKl = smem.allocate_tensor(Int32, cute.make_layout((KPAD // 2, K), stride=(K + 2, 1)), byte_alignment=16)
        else:
            sWK = smem.allocate_tensor(Float32, row_major(MAXR, K), byte_alignment=16)
            sU = smem.allocate_tensor(Float32, row_major(MAXR, TV), byte_alignment=16)
        sVin = smem.allocate_tensor(Float32, row_major(T, TV), byte_alignment=16)
        sGlast = smem.allocate_tensor(Float32, cute.make_layout(K), byte_alignment=16)
        sBdec = smem.allocate_tensor(Float32, cute.make_layout(K), byte_alignment=16)
        sInv = smem.allocate_tensor(Float32, cute.make_layout(2 * T), byte_alignment=16)
        sBeta = smem.allocate_tensor(Float32, cute.make_layout(T), byte_alignment=16)
        sA = smem.allocate_tensor(Float32, row_major(T, T), byte_alignment=16)
        sAq = smem.allocate_tensor(Float32, row_major(T, T), byte_alignment=16)

        slot = mSlot[bi]
        pool_rows = mPool.shape[0]
        active = (slot >= 0) & (slot < pool_rows)
        if active:
            # Clamp the cursors: a malformed hist_len / cache_base must never index past the shared-memory
            # tiles or the 32-slot ring (legal values are checked by the caller, under KDA_DEBUG_VALIDATE).
            P = mHist[bi]
            if P < 0:
                P = cutlass.Int32(0)
            if P > MAXR:
                P = cutlass.Int32(MAXR)
            base = mBase[bi] & (RING_SLOTS - 1)
            is_flush = P >= flush_min
            slot64 = Int64(slot)

            if const_expr(self.mma):
                # Issue the checkpoint rows' loads first: their DRAM latency overlaps the whole preamble.
                g4 = lane // 4
                q4 = lane % 4
                rows = (warp * 16 + g4, warp * 16 + g4 + 8)
                s0_raw = cute.make_rmem_tensor((2 * CHUNKS_PER_THREAD * CHUNK,), mPool.element_type)
                s0_chunks = cute.zipped_divide(s0_raw, (CHUNK,))
                for rho in cutlass.range_constexpr(2):
                    row_chunks = cute.zipped_divide(mPool[slot64, h, v0 + rows[rho], None], (CHUNK,))
                    for m in cutlass.range_constexpr(CHUNKS_PER_THREAD):
                        cute.autovec_copy(
                            row_chunks[None, m * ROW_THREADS + q4], s0_chunks[None, rho * CHUNKS_PER_THREAD + m]
                        )

            # ---- phase 1: raw draft inputs, gate, ring tail, u and v tiles --------------------------
            rate = cute.math.exp(mALog[h].to(Float32), fastmath=True)
            for it in cutlass.range_constexpr(T * K // NT):
                i = tidx + it * NT
                t = i // K
                c = i % K
                sKh[t, c] = mK[bi, t, h, c].to(Float32)
                sQh[t, c] = mQ[bi, t, h, c].to(Float32)
                x = mG[bi, t, h, c].to(Float32) + mDtBias[h * K + c].to(Float32)
                g_log = Float32(0.0)
                if const_expr(self.softplus_gate):
                    sp = x
                    if x <= Float32(20.0):
                        sp = cute.math.log1p(cute.math.exp(x, fastmath=True), fastmath=True)
                    g_log = -rate * sp
                else:
                    g_log = lower_bound / (Float32(1.0) + cute.math.exp(-rate * x, fastmath=True))
                sCum[t, c] = g_log
                sDec[t, c] = cute.math.exp(g_log, fastmath=True)
            if tidx < K:
                g_last = Float32(0.0)
                if P > 0:
                    g_last = mGCache[slot64, h, (base + P - 1) & (RING_SLOTS - 1), tidx]
                sGlast[tidx] = g_last
            # Only the live rows j < P are loaded: stale rows never enter an arithmetic op.
            if const_expr(self.mma):
                for it in cutlass.range_constexpr((KPAD // 2) * TV // NT):
                    i = tidx + it * NT
                    jp = i // TV
                    r = i % TV
                    u_even = Float32(0.0)
                    u_odd = Float32(0.0)
                    if 2 * jp < P:
                        u_even = mUCache[slot64, h, (base + 2 * jp) & (RING_SLOTS - 1), v0 + r].to(Float32)
                    if 2 * jp + 1 < P:
                        u_odd = mUCache[slot64, h, (base + 2 * jp + 1) & (RING_SLOTS - 1), v0 + r].to(Float32)
                    sUp[jp, r] = _pack_bf16x2(u_even, u_odd)  # exact: the ring holds bf16
            else:
                for it in cutlass.range_constexpr(MAXR * TV // NT):
                    i = tidx + it * NT
                    j = i // TV
                    r = i % TV
                    if j < P:
                        sU[j, r] = mUCache[slot64, h, (base + j) & (RING_SLOTS - 1), v0 + r].to(Float32)
            for it in cutlass.range_constexpr(T * TV // NT):
                i = tidx + it * NT
                t = i // TV
                r = i % TV
                sVin[t, r] = mV[bi, t, h, v0 + r].to(Float32)
            if tidx < T:
                sBeta[tidx] = Float32(1.0) / (
                    Float32(1.0) + cute.math.exp(-mBeta[bi, tidx, h].to(Float32), fastmath=True)
                )
            cute.arch.sync_threads()

            # ---- phase 2: norms, cumulative decay, replay vectors -----------------------------------
            for n in cutlass.range(warp, 2 * T, NW):
                acc = Float32(0.0)
                for m in cutlass.range_constexpr(K // 32):
                    val = Float32(0.0)
                    if n < T:
                        val = sKh[n, lane + 32 * m]
                    else:
                        val = sQh[n - T, lane + 32 * m]
                    acc = acc + val * val
                for sh in cutlass.range_constexpr(5):
                    acc = acc + cute.arch.shuffle_sync_bfly(acc, offset=1 << sh)
                if lane == 0:
                    sInv[n] = cute.math.rsqrt(acc + Float32(L2NORM_EPS), fastmath=True)
            if tidx < K:
                run = Float32(0.0)
                for t in cutlass.range_constexpr(T):
                    run = run + sCum[t, tidx]
                    sCum[t, tidx] = run
                bdec = Float32(1.0)
                if P > 0:
                    bdec = cute.math.exp(sGlast[tidx], fastmath=True)
                sBdec[tidx] = bdec
            if const_expr(self.mma):
                for it in cutlass.range_constexpr((KPAD // 2) * K // NT):
                    i = tidx + it * NT
                    jp = i // K
                    c = i % K
                    wk = [Float32(0.0), Float32(0.0)]
                    for odd in cutlass.range_constexpr(2):
                        if 2 * jp + odd < P:
                            phys = (base + 2 * jp + odd) & (RING_SLOTS - 1)
                            decay = cute.math.exp(sGlast[c] - mGCache[slot64, h, phys, c], fastmath=True)
                            wk[odd] = decay * mKCache[slot64, h, phys, c].to(Float32)
                    sWKh[jp, c], sWKl[jp, c] = _split_bf16x2(wk[0], wk[1])
            else:
                for it in cutlass.range_constexpr(MAXR * K // NT):
                    i = tidx + it * NT
                    j = i // K
                    c = i % K
                    if j < P:
                        phys = (base + j) & (RING_SLOTS - 1)
                        decay = cute.math.exp(sGlast[c] - mGCache[slot64, h, phys, c], fastmath=True)
                        sWK[j, c] = decay * mKCache[slot64, h, phys, c].to(Float32)
            cute.arch.sync_threads()

            # ---- phase 3: normalised and decayed draft vectors --------------------------------------
            if const_expr(self.mma):
                for it in cutlass.range_constexpr(T * (K // 2) // NT):
                    i = tidx + it * NT
                    t = i // (K // 2)
                    cp = i % (K // 2)
                    kh0 = sKh[t, 2 * cp] * sInv[t]
                    kh1 = sKh[t, 2 * cp + 1] * sInv[t]
                    qh0 = sQh[t, 2 * cp] * sInv[T + t] * scale
                    qh1 = sQh[t, 2 * cp + 1] * sInv[T + t] * scale
                    d0 = cute.math.exp(sCum[t, 2 * cp], fastmath=True)
                    d1 = cute.math.exp(sCum[t, 2 * cp + 1], fastmath=True)
                    sKh[t, 2 * cp] = kh0
                    sKh[t, 2 * cp + 1] = kh1
                    sQh[t, 2 * cp] = qh0
                    sQh[t, 2 * cp + 1] = qh1
                    khi, klo = _split_bf16x2(d0 * kh0, d1 * kh1)
                    qhi, qlo = _split_bf16x2(d0 * qh0, d1 * qh1)
                    sXh[cp, t] = khi
                    sXl[cp, t] = klo
                    sXh[cp, T + t] = qhi
                    sXl[cp, T + t] = qlo
            else:
                for it in cutlass.range_constexpr(T * K // NT):
                    i = tidx + it * NT
                    t = i // K
                    c = i % K
                    kh = sKh[t, c] * sInv[t]
                    qh = sQh[t, c] * sInv[T + t] * scale
                    decay = cute.math.exp(sCum[t, c], fastmath=True)
                    sKh[t, c] = kh
                    sQh[t, c] = qh
                    sKx[t, c] = decay * kh
                    sQx[t, c] = decay * qh
            cute.arch.sync_threads()

            # ---- phase 4: the T x T triangles; k^ and G appends (V tile 0 only) ---------------------
            # Column r of both triangles is one warp's job (columns r and T-1-r share a warp: equal work). Down
            # the column, exp(cum_s - cum_r) is the running product of the per-token decays a_t (t = r+1..s): one
            # multiply per entry instead of an exp, and no overflow whatever the gate (every factor is <= 1).
            for r in cutlass.range_constexpr(T):
                if warp == min(r, T - 1 - r) % NW:
                    k_r = [sKh[r, lane + 32 * m] for m in range(K // 32)]
                    for s in cutlass.range_constexpr(r, T):
                        if const_expr(s > r):
                            for m in cutlass.range_constexpr(K // 32):
                                k_r[m] = k_r[m] * sDec[s, lane + 32 * m]
                        a_kk = Float32(0.0)
                        a_qk = Float32(0.0)
                        for m in cutlass.range_constexpr(K // 32):
                            a_kk = a_kk + k_r[m] * sKh[s, lane + 32 * m]
                            a_qk = a_qk + k_r[m] * sQh[s, lane + 32 * m]
                        for sh in cutlass.range_constexpr(5):
                            a_kk = a_kk + cute.arch.shuffle_sync_bfly(a_kk, offset=1 << sh)
                            a_qk = a_qk + cute.arch.shuffle_sync_bfly(a_qk, offset=1 << sh)
                        if lane == 0:
                            sA[s, r] = a_kk
                            sAq[s, r] = a_qk
            if tile == 0:
                for it in cutlass.range_constexpr(T * K // NT):
                    i = tidx + it * NT
                    t = i // K
                    c = i % K
                    phys = (base + P + t) & (RING_SLOTS - 1)
                    g_new = sCum[t, c]  # a flush row restarts the decay at the new checkpoint
                    if P < flush_min:
                        g_new = g_new + sGlast[c]
                    mKCache[slot64, h, phys, c] = sKh[t, c].to(mKCache.element_type)
                    mGCache[slot64, h, phys, c] = g_new
            cute.arch.sync_threads()

            # ---- phase 5: state rows ------------------------------------------------------------------
            if const_expr(self.mma):
                # Warp w owns local rows 16w + g and 16w + g + 8 (g = lane // 4); thread quad position q = lane % 4
                # owns channels 32m + 8q + e (m < 4, e < 8) of both rows: 16-byte pool accesses, and, read as
                # the K dimension of the MMA in the order (m, e), exactly the A-fragment columns {2q, 2q + 1,
                # 2q + 8, 2q + 9} of k-step 2m + e // 4 (any permutation of K is fine when B uses the same one).
                state = cute.make_rmem_tensor((2 * CHUNK * CHUNKS_PER_THREAD,), Float32)
                raw = cute.make_rmem_tensor((CHUNK,), mPool.element_type)
                for rho in cutlass.range_constexpr(2):
                    for m in cutlass.range_constexpr(CHUNKS_PER_THREAD):
                        for e in cutlass.range_constexpr(CHUNK):
                            c = (m * ROW_THREADS + q4) * CHUNK + e
                            idx = rho * 32 + m * CHUNK + e
                            state[idx] = s0_raw[idx].to(Float32) * sBdec[c]
                # Fold on MMA: S_commit[v, c] += sum_j u_j[v] wk_j[c]; M = the warp's 16 rows, K = ring rows,
                # N = channels. n-tile nt, column n stands for channel (4 (nt // 4) + n // 2) * 8 + 2 (nt % 4)
                # + n % 2, so the accumulator fragment is exactly this thread's state registers. u is bf16 in
                # the ring (exact as an operand); wk is split hi + lo: two MMAs, fp32 accumulation.
                for ks in cutlass.range_constexpr(KPAD // MMA_K):
                    if P > ks * MMA_K:
                        jp0 = ks * (MMA_K // 2) + q4
                        a_u = (sUp[jp0, rows[0]], sUp[jp0, rows[1]], sUp[jp0 + 4, rows[0]], sUp[jp0 + 4, rows[1]])
                        for nt in cutlass.range_constexpr(K // 8):
                            e0 = 2 * (nt % 4)
                            col = ((nt // 4) * ROW_THREADS + g4 // 2) * CHUNK + e0 + g4 % 2
                            b_hi = (sWKh[jp0, col], sWKh[jp0 + 4, col])
                            b_lo = (sWKl[jp0, col], sWKl[jp0 + 4, col])
                            at = (nt // 4) * CHUNK + e0
                            ids = (at, at + 1, 32 + at, 32 + at + 1)
                            d = _mma_bf16_m16n8k16(a_u, b_hi, [state[z] for z in ids])
                            d = _mma_bf16_m16n8k16(a_u, b_lo, d)
                            for z in cutlass.range_constexpr(4):
                                state[ids[z]] = d[z]
                if is_flush:
                    for rho in cutlass.range_constexpr(2):
                        row_chunks = cute.zipped_divide(mPool[slot64, h, v0 + rows[rho], None], (CHUNK,))
                        for m in cutlass.range_constexpr(CHUNKS_PER_THREAD):
                            for e in cutlass.range_constexpr(CHUNK):
                                raw[e] = state[rho * 32 + m * CHUNK + e].to(mPool.element_type)
                            cute.autovec_copy(raw, row_chunks[None, m * ROW_THREADS + q4])

                n_tiles = 2 * T // 8
                acc = cute.make_rmem_tensor((4 * n_tiles,), Float32)
                for i in cutlass.range_constexpr(4 * n_tiles):
                    acc[i] = Float32(0.0)
                for ks in cutlass.range_constexpr(K // MMA_K):
                    base_e = (ks // 2) * CHUNK + 4 * (ks % 2)
                    a_hi = [None] * 4
                    a_lo = [None] * 4
                    # A registers: (row g, k 2q..2q+1), (row g+8, same), (row g, k 2q+8..), (row g+8, k 2q+8..)
                    for reg in cutlass.range_constexpr(4):
                        idx = (reg % 2) * 32 + base_e + 2 * (reg // 2)
                        a_hi[reg], a_lo[reg] = _split_bf16x2(state[idx], state[idx + 1])
                    pair = ((ks // 2) * ROW_THREADS + q4) * (CHUNK // 2) + 2 * (ks % 2)
                    for nt in cutlass.range_constexpr(n_tiles):
                        col = nt * 8 + g4
                        b_hi = (sXh[pair, col], sXh[pair + 1, col])
                        b_lo = (sXl[pair, col], sXl[pair + 1, col])
                        c_in = [acc[4 * nt + i] for i in range(4)]
                        d = _mma_bf16_m16n8k16(a_hi, b_hi, c_in)
                        d = _mma_bf16_m16n8k16(a_lo, b_hi, d)
                        d = _mma_bf16_m16n8k16(a_hi, b_lo, d)
                        for i in cutlass.range_constexpr(4):
                            acc[4 * nt + i] = d[i]
                for nt in cutlass.range_constexpr(n_tiles):
                    for i in cutlass.range_constexpr(4):
                        sXY[rows[i // 2], nt * 8 + 2 * q4 + i % 2] = acc[4 * nt + i]
                cute.arch.sync_warp()
                if lane < 16:
                    r_loc = warp * 16 + lane
                    v = v0 + r_loc
                    us = cute.make_rmem_tensor((T,), Float32)
                    for s in cutlass.range_constexpr(T):
                        p = sXY[r_loc, s]
                        for r in cutlass.range_constexpr(s):
                            p = p + sA[s, r] * us[r]
                        us[s] = sBeta[s] * (sVin[s, r_loc] - p)
                    for s in cutlass.range_constexpr(T):
                        o = sXY[r_loc, T + s]
                        for r in cutlass.range_constexpr(s + 1):
                            o = o + sAq[s, r] * us[r]
                        mOut[bi, s, h, v] = o.to(mOut.element_type)
                        phys = (base + P + s) & (RING_SLOTS - 1)
                        mUCache[slot64, h, phys, v] = us[s].to(mUCache.element_type)
            else:
                r_loc = tidx // ROW_THREADS
                seg = tidx % ROW_THREADS
                v = v0 + r_loc
                state = cute.make_rmem_tensor((CHUNK * CHUNKS_PER_THREAD,), Float32)
                row = mPool[slot64, h, v, None]
                row_chunks = cute.zipped_divide(row, (CHUNK,))  # ((8), (16))
                raw = cute.make_rmem_tensor((CHUNK,), mPool.element_type)
                for m in cutlass.range_constexpr(CHUNKS_PER_THREAD):
                    cute.autovec_copy(row_chunks[None, m * ROW_THREADS + seg], raw)
                    for e in cutlass.range_constexpr(CHUNK):
                        c = (m * ROW_THREADS + seg) * CHUNK + e
                        state[m * CHUNK + e] = raw[e].to(Float32) * sBdec[c]
                for j in cutlass.range(P, unroll=1):
                    u_j = sU[j, r_loc]
                    for m in cutlass.range_constexpr(CHUNKS_PER_THREAD):
                        for e in cutlass.range_constexpr(CHUNK):
                            c = (m * ROW_THREADS + seg) * CHUNK + e
                            state[m * CHUNK + e] = state[m * CHUNK + e] + u_j * sWK[j, c]
                if is_flush:
                    for m in cutlass.range_constexpr(CHUNKS_PER_THREAD):
                        for e in cutlass.range_constexpr(CHUNK):
                            raw[e] = state[m * CHUNK + e].to(mPool.element_type)
                        cute.autovec_copy(raw, row_chunks[None, m * ROW_THREADS + seg])

                xs = cute.make_rmem_tensor((T,), Float32)
                ys = cute.make_rmem_tensor((T,), Float32)
                for s in cutlass.range_constexpr(T):
                    x = Float32(0.0)
                    y = Float32(0.0)
                    for m in cutlass.range_constexpr(CHUNKS_PER_THREAD):
                        for e in cutlass.range_constexpr(CHUNK):
                            c = (m * ROW_THREADS + seg) * CHUNK + e
                            x = x + state[m * CHUNK + e] * sKx[s, c]
                            y = y + state[m * CHUNK + e] * sQx[s, c]
                    for sh in cutlass.range_constexpr(2):
                        x = x + cute.arch.shuffle_sync_bfly(x, offset=1 << sh)
                        y = y + cute.arch.shuffle_sync_bfly(y, offset=1 << sh)
                    xs[s] = x
                    ys[s] = y

                us = cute.make_rmem_tensor((T,), Float32)
                for s in cutlass.range_constexpr(T):
                    p = xs[s]
                    for r in cutlass.range_constexpr(s):
                        p = p + sA[s, r] * us[r]
                    us[s] = sBeta[s] * (sVin[s, r_loc] - p)
                for s in cutlass.range_constexpr(T):
                    o = ys[s]
                    for r in cutlass.range_constexpr(s + 1):
                        o = o + sAq[s, r] * us[r]
                    if seg == s % ROW_THREADS:
                        mOut[bi, s, h, v] = o.to(mOut.element_type)
                        phys = (base + P + s) & (RING_SLOTS - 1)
                        mUCache[slot64, h, phys, v] = us[s].to(mUCache.element_type)
        else:
            for i in cutlass.range(tidx, T * TV, NT):
                t = i // TV
                r = i % TV
                mOut[bi, t, h, v0 + r] = Float32(0.0).to(mOut.element_type)


def _fakes(cfg: UcacheVerifyFlush):

    bf16, f32, i32 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32
    B = _launch.sym_size()
    N = _launch.sym_size()
    H, T, K = cfg.heads, cfg.t_draft, HEAD_DIM
    act = lambda dt: _launch.fake_tensor(dt, (B, T, H, K), (None, None, None, 1), align_bytes=dt.width // 8)  # noqa: E731
    align = lambda dt: 16 if cfg.aligned else dt.width // 8  # noqa: E731
    ring = lambda dt: _launch.fake_tensor(  # noqa: E731
        dt, (N, H, RING_SLOTS, K), (None, RING_SLOTS * K, K, 1), align_bytes=align(dt)
    )
    vec = lambda dt, n: _launch.fake_tensor(dt, (n,), (1,), align_bytes=4)  # noqa: E731
    return (
        act(bf16),  # q
        act(bf16),  # k
        act(bf16),  # v
        act(bf16),  # g
        _launch.fake_tensor(bf16, (B, T, H), (None, None, None), align_bytes=2),  # beta logits
        vec(f32, H),  # A_log
        vec(f32, H * K),  # dt_bias
        _launch.fake_tensor(bf16, (N, H, K, K), (None, K * K, K, 1), align_bytes=align(bf16)),  # pool
        vec(i32, B),  # slot indices
        ring(bf16),  # k_cache
        ring(bf16),  # u_cache
        ring(f32),  # g_cache
        vec(i32, B),  # hist_len
        vec(i32, B),  # cache_base
        act(bf16),  # output
    )


def build_ucache_kernel(
    heads: int,
    t_draft: int,
    w_ring: int,
    tile_v: int,
    softplus_gate: bool,
    aligned: bool,
    mma: bool,
    arch: str,
    extra_options: str = "",
):
    """Compile one configuration against fake tensors (no GPU needed when CUTE_DSL_ARCH is set)."""
    cfg = UcacheVerifyFlush(heads, t_draft, w_ring, tile_v, softplus_gate, aligned, mma)
    return cute.compile(
        cfg,
        *_fakes(cfg),
        cutlass.Float32(1.0),
        cutlass.Float32(-5.0),
        cutlass.Int32(9),
        _launch.fake_stream(),
        options=_launch.compile_options(arch, extra_options),
    )


class UcacheRestartCursors:
    """The flush part of the caller's commit, on device: for every active row with hist_len >= flush_min,
    cache_base = (cache_base + hist_len) & 31 and hist_len = 0. One thread per row; no host sync, so it
    captures into CUDA graphs. It runs after the verify kernel (same stream): inside that kernel every CTA of a
    request reads the cursors, so none of them may rewrite them.
    """

    threads = 128

    @cute.jit
    def __call__(
        self,
        mSlot: cute.Tensor,
        mHist: cute.Tensor,
        mBase: cute.Tensor,
        pool_rows: cutlass.Int32,
        flush_min: cutlass.Int32,
        stream,
    ):
        batch = mSlot.shape[0]
        self.kernel(mSlot, mHist, mBase, pool_rows, flush_min).launch(
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
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * self.threads + tidx
        if i < mSlot.shape[0]:
            slot = mSlot[i]
            if (slot >= 0) & (slot < pool_rows):
                P = mHist[i]
                if P >= flush_min:
                    mBase[i] = (mBase[i] + P) & (RING_SLOTS - 1)
                    mHist[i] = cutlass.Int32(0)


def build_restart_kernel(arch: str):
    i32 = cutlass.Int32
    B = _launch.sym_size()
    vec = lambda: _launch.fake_tensor(i32, (B,), (1,), align_bytes=4)  # noqa: E731
    return cute.compile(
        UcacheRestartCursors(),
        vec(),
        vec(),
        vec(),
        i32(1),
        i32(9),
        _launch.fake_stream(),
        options=_launch.compile_options(arch),
    )


def restart_cursors(slot_indices, hist_len, cache_base, pool_rows: int, flush_min: int) -> None:
    """Apply the flush part of the commit in place (see :class:`UcacheRestartCursors`)."""
    fn = _launch.get_or_compile(("kda_ucache_restart_cursors",), build_restart_kernel)
    fn(slot_indices, hist_len, cache_base, int(pool_rows), int(flush_min))


def ucache_verify_flush(
    A_log: torch.Tensor,
    g: torch.Tensor,
    dt_bias: torch.Tensor,
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
    tile_v: int | None = None,
    mma: bool | None = None,
) -> torch.Tensor:
    """Launch the kernel on the current stream. Arguments are already validated (kda-recurrent does it).

    A_log [H] fp32, dt_bias [H*128] fp32 (contiguous); q, k, v, g [B, T, H, 128] bf16 (last dim contiguous);
    b [B, T, H] bf16 logits; state_pool [N, H, 128, 128] bf16 (inner dims contiguous, dim-0 stride a multiple
    of 8); k_cache, u_cache [N, H, 32, 128] bf16 and g_cache fp32 (same rule); slot_indices, hist_len,
    cache_base [B] int32 contiguous; output [B, T, H, 128] bf16. ``aligned``: every pool/ring pointer and row
    stride is a multiple of 16 bytes (kda_core's validation says so). The kernel only reads the cursors;
    ``restart_hist_on_flush`` then applies the flush part of the commit with a second, one-thread-per-row kernel.
    """
    B, T, H, _ = q.shape
    if mma is None:
        mma = DEFAULT_MMA
    tile_v = tile_v or default_tile_v(B, H, mma)
    softplus_gate = lower_bound is None
    key = ("kda_ucache_verify_flush", H, T, w_ring, tile_v, softplus_gate, bool(aligned), bool(mma))
    fn = _launch.get_or_compile(
        key, lambda arch: build_ucache_kernel(H, T, w_ring, tile_v, softplus_gate, bool(aligned), bool(mma), arch)
    )
    fn(
        q,
        k,
        v,
        g,
        b,
        A_log,
        dt_bias,
        state_pool,
        slot_indices,
        k_cache,
        u_cache,
        g_cache,
        hist_len,
        cache_base,
        output,
        float(scale),
        float(-5.0 if lower_bound is None else lower_bound),
        int(flush_min),
    )
    if restart_hist_on_flush:
        restart_cursors(slot_indices, hist_len, cache_base, state_pool.shape[0], flush_min)
    return output
