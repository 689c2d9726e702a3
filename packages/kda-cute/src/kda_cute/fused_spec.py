"""Fused KDA decode layer, multi-token (spec decode): the conv over a T + 2 window, SiLU, the KDA recurrence with a
checkpoint per token, gated RMSNorm per token, in one kernel (docs/design.md §8, the multi-token form).

FlashInfer's ``packed_fused_kda_decode`` arguments: the 14 of ``fused_kda_decode`` with ``state_indices`` [N, T],
then ``query_start_loc`` [N + 1] and ``num_accepted_tokens`` [N]. The semantics are
:func:`kda_core.oracle_fused.packed_fused_kda_decode_ref`'s. Per row n (request) and head h:

- row n owns tokens [bos, eos) with ``bos = clamp(qsl[n], 0, Ntok)``, ``eos = clamp(qsl[n + 1], bos, Ntok)`` (64-bit,
  before any narrowing); the first ``L = min(eos - bos, T)`` run, the rest get zero output;
- ``col = max(min(nat[n], T), 1) - 1``; the conv slot is ``state_indices[n, 0]``, the read slot
  ``state_indices[n, col]``; a null one of them (the policy's test against the pool's slot count), or under
  NONPOSITIVE nat outside [1, T], makes the row null: zero output, neither cache read nor written;
- conv: the history is conv-cache columns ``col .. col + 2``; token t's window is the history followed by tokens
  0..t; the cache becomes ``[history[1], history[2], x_0, .., x_{L-1}]`` (columns past L + 1 untouched);
- recurrence: from the read slot's state, token t's state is stored to ``state_indices[n, t]``; a token whose slot is
  null is skipped (zero output, no store, the state does not absorb it).

Work split: one CTA of 128 threads per (row, head), grid (N, H, 1) (N on grid x: any batch). The CTA owns every conv
channel of its head (no other CTA reads or writes them) and all 128 state rows, so the whole row's token chain is
inside one CTA and nothing crosses CTAs. Four phases:

1. conv: thread c owns channel c of each of q, k, v. It loads the 3 history columns and the L tokens' inputs of its
   channels (clamped token rows: every load is in bounds, none waits on a branch), computes the L conv outputs
   (fp32, SiLU, rounded to bf16) into shared memory and writes the new history columns. The first state rows of
   the thread are already in flight (issued as soon as the read slot is known).
2. token preparation, once per CTA: row group g (16 lanes, 8 channels each) prepares tokens g, g + 8: L2 norms of q
   and k, the decay from raw_gate + dt_bias, beta, k^.q^, into shared memory (fp32).
3. row stream: each thread owns 16 state rows (rows g + 8 j); ``rows_per_pass`` of them at a time are loaded once
   (the next pass's rows are in flight meanwhile), run through the L tokens in fp32 registers, and stored after every
   token to that token's checkpoint slot; the per-token vectors are read from shared memory once per pass, so a
   larger pass reads them fewer times. The state is read once and written L times: the kernel's whole cost at
   serving sizes.
4. gated RMSNorm per token: each row's o (rounded to bf16) is in shared memory; thread c computes y for channel c of
   every token (warp butterflies and a [T, 4] shared array for the sums of squares).

Why this split and not the generic kernel's (a CTA per (row, head, tile of V rows), state rows held in registers
across tokens): with several CTAs per head, each would recompute the q / k conv, and the conv cache's q / k history
columns would be read by one CTA while another rewrites them (the read columns ``col .. col + 2`` and the written
ones overlap); ordering that needs a cluster. One CTA per head needs none, and streaming rows through the token
chain (rows outer, tokens inner) keeps only ``2 * rows_per_pass`` rows in registers, so the tile can be the whole
head without spilling.

Variants (compile-time): pool dtype x gate x dt_bias / conv bias present x alignment class x null policy x the three
index dtypes (state_indices, query_start_loc, num_accepted_tokens) x the token bucket (T rounded up to 1, 2, 4, 8 or
16: the shared-memory arrays) x rows per pass x cache hint x resident-CTA floor. Ntok, N, H, T, the slots and every
stride are runtime values, and so are ``lower_bound`` and ``norm_eps``.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, const_expr

from kda_core.contracts import HEAD_DIM, GateMode, NullSlotPolicy
from kda_core.errors import fail
from kda_core.validation import WRAPPER_REJECTED, debug_check_slots, debug_checks_enabled
from kda_core.validation_fused import CONV_HISTORY, CONV_WIDTH, MAX_FUSED_SPEC_TOKENS, validate_packed_fused_decode

from . import _launch
from .decode_t1 import CACHE_HINTS, CHANNELS_PER_LANE, HALF_WARP, ROW_GROUPS, THREADS, KDADecodeT1

__all__ = ["FusedSpecConfig", "KDAFusedSpec", "TOKEN_BUCKETS", "token_bucket", "select_config",
           "packed_fused_kda_decode", "variant_key", "compile_variant"]

PARTS = 3  # q | k | v
WARPS = THREADS // 32
TOKEN_BUCKETS = (1, 2, 4, 8, 16)  # compile-time token capacities (shared-memory arrays sized [bucket, ...])
ROWS_PER_PASS = (1, 2, 4)
MIN_CTAS = (0, 2, 3, 4, 5, 6, 8)  # resident CTAs per SM asked of ptxas (0: its own register count)
ROWS_PER_THREAD = HEAD_DIM // ROW_GROUPS  # 16: the CTA owns the head's 128 state rows
assert TOKEN_BUCKETS[-1] == MAX_FUSED_SPEC_TOKENS


def token_bucket(T: int) -> int:
    """The smallest bucket that holds ``T`` tokens per row."""
    for b in TOKEN_BUCKETS:
        if T <= b:
            return b
    fail("state_indices", f"at most {TOKEN_BUCKETS[-1]} columns", T)


@dataclass(frozen=True)
class FusedSpecConfig:
    """Schedule of one multi-token fused launch: ``rows_per_pass`` state rows run through the token chain together
    (one of ``ROWS_PER_PASS``; the per-token vectors are read from shared memory once per pass), the state's
    cache hint (``CACHE_HINTS``, as :class:`kda_cute.decode_t1.DecodeT1Config`), and ``min_ctas`` (one of
    ``MIN_CTAS``): the resident CTAs per SM asked of ptxas (``min_blocks_per_mp``: it caps the registers to fit;
    0 leaves the count to ptxas)."""

    rows_per_pass: int = 4
    cache_hint: str = "stream"
    min_ctas: int = 0

    def __post_init__(self):
        if self.rows_per_pass not in ROWS_PER_PASS:
            fail("config.rows_per_pass", f"one of {ROWS_PER_PASS}", self.rows_per_pass)
        if self.cache_hint not in CACHE_HINTS:
            fail("config.cache_hint", f"one of {CACHE_HINTS}", self.cache_hint)
        if self.min_ctas not in MIN_CTAS:
            fail("config.min_ctas", f"one of {MIN_CTAS}", self.min_ctas)


def select_config(rows: int, H: int, T: int, state_dtype: torch.dtype) -> FusedSpecConfig:
    """The schedule policy: one config for every call, four rows per pass, no resident-CTA floor. Measured: H200,
    2026-12-02, CUDA-graph replay, CUPTI, H = 12 (docs/fused_spec.md, "Measured"): at T = 4, B = 64 four rows per
    pass beat one and two under every floor (0, 5, 6 CTAs per SM) for both pool dtypes; over B in {8, 64, 256} x T in
    {2, 4, 8} x both dtypes, four against two is 1-21% faster, or level (within 1%) at B = 256, T = 2."""
    return FusedSpecConfig()


# --------------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------------


class KDAFusedSpec(KDADecodeT1):
    """Compile-time configuration of one multi-token fused variant. Reuses :class:`KDADecodeT1`'s lane machinery
    (the 16-lane row layout, ``prepare_token``, ``row_step``, the null test) at tile 128; the token chain, the conv
    and the RMSNorm are this class's."""

    def __init__(self, *, state_dtype, gate: GateMode, has_dt_bias: bool, has_bias: bool, aligned: bool,
                 max_tokens: int, rows_per_pass: int = 4, cache_hint: str = "stream",
                 null_policy: NullSlotPolicy = NullSlotPolicy.NONPOSITIVE, index_dtype=Int32, qsl_dtype=Int32,
                 nat_dtype=Int32, min_ctas: int = 0):
        if gate == GateMode.PRECOMPUTED:
            raise ValueError("fused_spec: the layer's gate is computed in the kernel (lower bound or softplus)")
        if max_tokens not in TOKEN_BUCKETS:
            raise ValueError(f"fused_spec: max_tokens must be one of {TOKEN_BUCKETS}, got {max_tokens}")
        if rows_per_pass not in ROWS_PER_PASS:
            raise ValueError(f"fused_spec: rows_per_pass must be one of {ROWS_PER_PASS}, got {rows_per_pass}")
        if min_ctas not in MIN_CTAS:
            raise ValueError(f"fused_spec: min_ctas must be one of {MIN_CTAS}, got {min_ctas}")
        super().__init__(state_dtype=state_dtype, gate=gate, beta_is_logit=True, use_qk_l2norm=True,
                         has_dt_bias=has_dt_bias, tile_v=HEAD_DIM, aligned=aligned, rows_in_flight=0,
                         cache_hint=cache_hint, bulk_ring=0, null_policy=null_policy, index_dtype=index_dtype)
        self.has_bias = bool(has_bias)
        self.max_tokens = max_tokens
        self.rows_per_pass = rows_per_pass
        self.qsl_dtype = qsl_dtype
        self.nat_dtype = nat_dtype
        self.min_ctas = min_ctas

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # [Ntok, C] bf16, C = 3*H*128
        mW: cute.Tensor,  # [3, 4, H*128] fp32
        mBias,  # [C] fp32, or None
        mConv: cute.Tensor,  # [slots, C, W >= T + 2] bf16, channel-contiguous
        mGate: cute.Tensor,  # [1, Ntok, H, 128] bf16
        mBeta: cute.Tensor,  # [1, Ntok, H] bf16
        mALog: cute.Tensor,  # [H] fp32
        mDtBias,  # [H*128] fp32, or None
        mState: cute.Tensor,  # [slots, H, 128, 128]
        mSlot: cute.Tensor,  # [N, T] int32 / int64
        mQsl: cute.Tensor,  # [N + 1] int32 / int64
        mNat: cute.Tensor,  # [N] int32 / int64
        mOGate: cute.Tensor,  # [Ntok, H, 128] bf16
        mNormW: cute.Tensor,  # [128] fp32
        mOut: cute.Tensor,  # [1, Ntok, H, 128] bf16
        scale: Float32,
        lower_bound: Float32,
        norm_eps: Float32,
        stream,
    ):
        rows = cute.size(mSlot, mode=[0])
        H = cute.size(mALog, mode=[0])
        extra = {}
        if const_expr(self.min_ctas):  # ptxas caps the registers so that this many CTAs reside per SM
            extra = dict(min_blocks_per_mp=self.min_ctas, preferred_smem_carveout=100)
        self.spec_kernel(mX, mW, mBias, mConv, mGate, mBeta, mALog, mDtBias, mState, mSlot, mQsl, mNat, mOGate,
                         mNormW, mOut, scale, lower_bound, norm_eps).launch(grid=[rows, H, 1],
                                                                             block=[THREADS, 1, 1], stream=stream,
                                                                             **extra)

    @cute.jit
    def smem_lane_f32(self, s_row: cute.Tensor, lane):
        """The lane's 8 fp32 channels of a shared [128] row: two 16-byte loads (shared arrays are 16-byte aligned)."""
        frag = cute.make_rmem_tensor((CHANNELS_PER_LANE,), Float32)
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
        src = cute.local_tile(s_row, (CHANNELS_PER_LANE,), (lane,))
        cute.copy(atom, cute.logical_divide(src, (4,)), cute.logical_divide(frag, (4,)))
        return frag

    def lane_view(self, gHead: cute.Tensor, row, lane, s_vec: int):
        """The lane's 8 channels of state row ``row`` of a [V, K] head, split into copy vectors. Traced inline."""
        return cute.logical_divide(cute.local_tile(gHead[row, None], (CHANNELS_PER_LANE,), (lane,)), (s_vec,))

    @cute.jit
    def zero_tokens_head(self, mOut: cute.Tensor, t0, t1, h, tidx):
        """Output of head ``h`` <- 0 for tokens [t0, t1), channel ``tidx`` by this thread."""
        for t in cutlass.range(t0, t1, unroll=1):
            mOut[0, t, h, tidx] = Float32(0.0).to(mOut.element_type)

    @cute.kernel
    def spec_kernel(self, mX: cute.Tensor, mW: cute.Tensor, mBias, mConv: cute.Tensor, mGate: cute.Tensor,
                    mBeta: cute.Tensor, mALog: cute.Tensor, mDtBias, mState: cute.Tensor, mSlot: cute.Tensor,
                    mQsl: cute.Tensor, mNat: cute.Tensor, mOGate: cute.Tensor, mNormW: cute.Tensor,
                    mOut: cute.Tensor, scale: Float32, lower_bound: Float32, norm_eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        n, h, _ = cute.arch.block_idx()
        lane = tidx % HALF_WARP
        group = tidx // HALF_WARP
        MT = self.max_tokens
        n_rows = cute.size(mSlot, mode=[0])
        T = cute.size(mSlot, mode=[1])
        n_tok = cute.size(mX, mode=[0])
        heads = cute.size(mALog, mode=[0]) * HEAD_DIM  # channels of one part
        # Both caches have the same slot count (checked on the host); the smaller one bounds the slot all the same.
        n_slots = cutlass.min(cute.size(mState, mode=[0]), cute.size(mConv, mode=[0]))

        smem = cutlass.memory.SmemAllocator()
        sMixed = smem.allocate_tensor(cutlass.BFloat16, cute.make_layout((MT, PARTS, HEAD_DIM),
                                                                         stride=(PARTS * HEAD_DIM, HEAD_DIM, 1)),
                                      byte_alignment=16)
        vec_layout = cute.make_layout((MT, HEAD_DIM), stride=(HEAD_DIM, 1))
        sK = smem.allocate_tensor(Float32, vec_layout, byte_alignment=16)
        sQ = smem.allocate_tensor(Float32, vec_layout, byte_alignment=16)
        sA = smem.allocate_tensor(Float32, vec_layout, byte_alignment=16)
        sO = smem.allocate_tensor(cutlass.BFloat16, vec_layout, byte_alignment=16)
        sBeta = smem.allocate_tensor(Float32, cute.make_layout((MT,)), byte_alignment=16)
        sKQ = smem.allocate_tensor(Float32, cute.make_layout((MT,)), byte_alignment=16)
        sDest = smem.allocate_tensor(Int64, cute.make_layout((MT,)), byte_alignment=16)
        sLive = smem.allocate_tensor(Int32, cute.make_layout((MT,)), byte_alignment=16)
        sSum = smem.allocate_tensor(Float32, cute.make_layout((MT, WARPS), stride=(WARPS, 1)), byte_alignment=16)

        # ---- the row's tokens, its read column and its slots (docs/design.md §4: 64-bit clamps) -------------------
        t_total64 = Int64(n_tok)
        bos64 = cutlass.min(cutlass.max(Int64(mQsl[n]), Int64(0)), t_total64)
        eos64 = cutlass.min(cutlass.max(Int64(mQsl[n + 1]), bos64), t_total64)
        bos = Int32(bos64)
        eos = Int32(eos64)
        length = cutlass.min(eos - bos, T)
        nat64 = Int64(mNat[n])
        col = Int32(cutlass.max(cutlass.min(nat64, Int64(T)), Int64(1)) - Int64(1))
        conv_slot = mSlot[n, 0]
        read_slot = mSlot[n, col]
        limit = self.idx(n_slots)
        active = (length > 0) & self.live(conv_slot, limit) & self.live(read_slot, limit)
        if const_expr(self.null_policy is NullSlotPolicy.NONPOSITIVE):
            active = active & (nat64 >= Int64(1)) & (nat64 <= Int64(T))

        zero_from = bos
        if active:
            zero_from = bos + length
            self.run_row(mX, mW, mBias, mConv, mGate, mBeta, mALog, mDtBias, mState, mSlot, mOGate, mNormW, mOut,
                         scale, lower_bound, norm_eps, n, h, tidx, lane, group, bos, length, col, conv_slot, read_slot,
                         limit, n_tok, heads, sMixed, sK, sQ, sA, sO, sBeta, sKQ, sDest, sLive, sSum)
        # Tokens of this row that did not run (past T, or the whole row when it is null) get zero output; so do the
        # tokens before the first row's clamped start and from the last row's clamped end.
        self.zero_tokens_head(mOut, zero_from, eos, h, tidx)
        if n == 0:
            self.zero_tokens_head(mOut, Int32(0), bos, h, tidx)
        if n == n_rows - 1:
            self.zero_tokens_head(mOut, eos, n_tok, h, tidx)

    @cute.jit
    def run_row(self, mX: cute.Tensor, mW: cute.Tensor, mBias, mConv: cute.Tensor, mGate: cute.Tensor,
                mBeta: cute.Tensor, mALog: cute.Tensor, mDtBias, mState: cute.Tensor, mSlot: cute.Tensor,
                mOGate: cute.Tensor, mNormW: cute.Tensor, mOut: cute.Tensor, scale: Float32, lower_bound: Float32,
                norm_eps: Float32, n, h, tidx, lane, group, bos, length, col, conv_slot, read_slot, limit, n_tok,
                heads, sMixed: cute.Tensor, sK: cute.Tensor, sQ: cute.Tensor, sA: cute.Tensor, sO: cute.Tensor,
                sBeta: cute.Tensor, sKQ: cute.Tensor, sDest: cute.Tensor, sLive: cute.Tensor, sSum: cute.Tensor):
        """A live row: the four phases of the module docstring."""
        MT = self.max_tokens
        P = self.rows_per_pass
        sdt = self.state_dtype
        s_bits = self._copy_bits(sdt, CHANNELS_PER_LANE)
        s_vec = s_bits // sdt.width
        load_atom = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), sdt, num_bits_per_copy=s_bits, **self.load_hints)
        store_atom = cute.make_copy_atom(cute.nvgpu.CopyR2GOp(), sdt, num_bits_per_copy=s_bits,
                                         **self.store_hints)
        T = cute.size(mSlot, mode=[1])

        # ---- the first pass's state rows in flight (slot offset in 64 bits) ----------------------------------------
        gRead = mState[Int64(read_slot), h, None, None]  # [V, K]
        n_pass = ROWS_PER_THREAD // P

        raw = [cute.make_rmem_tensor((CHANNELS_PER_LANE,), sdt) for _ in range(ROWS_PER_THREAD)]
        for j in cutlass.range_constexpr(P):
            src = self.lane_view(gRead, group + j * ROW_GROUPS, lane, s_vec)
            cute.copy(load_atom, src, cute.logical_divide(raw[j], (s_vec,)))

        # ---- phase 0: this thread's loads: its channels' taps, history and token inputs; the gate lane vectors of
        # the tokens its row group prepares; the checkpoint slot of token tidx --------------------------------------
        last = n_tok - 1
        gConv = mConv[Int64(conv_slot), None, None]  # [C, W]
        chan = h * HEAD_DIM + tidx
        taps = [[mW[p, j, chan] for j in range(CONV_WIDTH)] for p in range(PARTS)]
        cbias = [None] * PARTS
        if const_expr(self.has_bias):
            cbias = [mBias[p * heads + chan] for p in range(PARTS)]
        hist = [[gConv[p * heads + chan, col + j] for j in range(CONV_HISTORY)] for p in range(PARTS)]
        xs = [[mX[cutlass.min(bos + t, last), p * heads + chan] for t in range(MT)] for p in range(PARTS)]
        n_chunks = (MT + ROW_GROUPS - 1) // ROW_GROUPS
        g_raws = []
        beta_raws = []
        for i in cutlass.range_constexpr(n_chunks):
            tok = cutlass.min(bos + group + i * ROW_GROUPS, last)
            g_raws.append(self.load_lane_vector(mGate[0, tok, h, None], lane, mGate.element_type))
            beta_raws.append(mBeta[0, tok, h])
        a_log = mALog[h]
        bias_raw = None
        if const_expr(self.has_dt_bias):
            bias_raw = self.load_lane_vector(cute.local_tile(mDtBias, (HEAD_DIM,), (h,)), lane, Float32)
        if tidx < MT:
            dest = mSlot[n, cutlass.min(tidx, T - 1)]
            sDest[tidx] = Int64(dest)
            sLive[tidx] = cutlass.select_(self.live(dest, limit) & (tidx < length), Int32(1), Int32(0))

        # ---- phase 1: the conv of this thread's 3 channels over the window, the new history -----------------------
        for p in cutlass.range_constexpr(PARTS):
            c = p * heads + chan
            window = hist[p] + xs[p]  # token t's taps read window[t .. t + 3]
            for t in cutlass.range_constexpr(MT):
                if t < length:
                    acc = Float32(0.0)
                    if const_expr(self.has_bias):
                        acc = cbias[p]
                    for j in cutlass.range_constexpr(CONV_WIDTH):
                        acc = acc + window[t + j].to(Float32) * taps[p][j]
                    sMixed[t, p, tidx] = (acc / (1.0 + cute.math.exp(-acc))).to(cutlass.BFloat16)  # SiLU -> bf16
                    gConv[c, t + CONV_HISTORY - 1] = xs[p][t]
            gConv[c, 0] = hist[p][1]
            gConv[c, 1] = hist[p][2]
        cute.arch.sync_threads()  # every conv output, checkpoint slot and liveness flag is in shared memory

        # ---- phase 2: token preparation, row group g prepares tokens g, g + 8 -------------------------------------
        for i in cutlass.range_constexpr(n_chunks):
            t = group + i * ROW_GROUPS
            # Every row group prepares, also past the row's length: prepare_token's L2 norms are shuffles over the
            # whole warp, which holds two row groups (tokens t and t + 1), so both must reach them. Only the row's
            # tokens store (a token past it reads a clamped shared row whose values are discarded).
            tt = cutlass.min(t, Int32(MT - 1))
            q_raw = self.load_lane_vector(sMixed[tt, 0, None], lane, sMixed.element_type)
            k_raw = self.load_lane_vector(sMixed[tt, 1, None], lane, sMixed.element_type)
            token = (k_raw, q_raw, g_raws[i], None, beta_raws[i], a_log, bias_raw)
            kf, qf, decay, beta, kq = self.prepare_token(token, scale, lower_bound)
            if t < length:
                for c in cutlass.range_constexpr(CHANNELS_PER_LANE):
                    sK[t, lane * CHANNELS_PER_LANE + c] = kf[c]
                    sQ[t, lane * CHANNELS_PER_LANE + c] = qf[c]
                    sA[t, lane * CHANNELS_PER_LANE + c] = decay[c]
                if lane == 0:
                    sBeta[t] = beta
                    sKQ[t] = kq
        cute.arch.sync_threads()  # the prepared tokens are in shared memory

        # ---- phase 3: the row stream, P rows per pass through the token chain -------------------------------------
        s_new = cute.make_rmem_tensor((CHANNELS_PER_LANE,), sdt)
        for i in cutlass.range_constexpr(n_pass):
            if const_expr(i + 1 < n_pass):  # the next pass's rows in flight under this one
                for r in cutlass.range_constexpr(P):
                    j = (i + 1) * P + r
                    src = self.lane_view(gRead, group + j * ROW_GROUPS, lane, s_vec)
                    cute.copy(load_atom, src, cute.logical_divide(raw[j], (s_vec,)))
            sfs = []
            for r in cutlass.range_constexpr(P):
                sf = cute.make_rmem_tensor((CHANNELS_PER_LANE,), Float32)
                sf.store(raw[i * P + r].load().to(Float32))
                sfs.append(sf)
            for t in cutlass.range(length, unroll=1):
                if sLive[t] != 0:
                    decay = self.smem_lane_f32(sA[t, None], lane)
                    kf = self.smem_lane_f32(sK[t, None], lane)
                    qf = self.smem_lane_f32(sQ[t, None], lane)
                    beta = sBeta[t]
                    kq = sKQ[t]
                    gDest = mState[sDest[t], h, None, None]
                    for r in cutlass.range_constexpr(P):
                        row = group + (i * P + r) * ROW_GROUPS
                        sq, u = self.row_step(sfs[r], decay, kf, qf, beta, sMixed[t, 2, row])
                        s_new.store(sfs[r].load().to(sdt))
                        dst = self.lane_view(gDest, row, lane, s_vec)
                        cute.copy(store_atom, cute.logical_divide(s_new, (s_vec,)), dst)
                        if lane == 0:
                            sO[t, row] = (sq + u * kq).to(sO.element_type)
        og = [mOGate[cutlass.min(bos + t, n_tok - 1), h, tidx] for t in range(MT)]  # issued before the barrier
        nw = mNormW[tidx]
        cute.arch.sync_threads()  # every row's o is in shared memory

        # ---- phase 4: gated RMSNorm of every token, channel tidx ---------------------------------------------------
        for t in cutlass.range_constexpr(MT):
            if t < length:
                o = sO[t, tidx].to(Float32)
                ss = o * o
                for shift in cutlass.range_constexpr(5):  # xor 16, 8, 4, 2, 1: the warp's sum
                    ss = ss + cute.arch.shuffle_sync_bfly(ss, offset=16 >> shift)
                if tidx % 32 == 0:
                    sSum[t, tidx // 32] = ss
        cute.arch.sync_threads()
        for t in cutlass.range_constexpr(MT):
            if t < length:
                total = sSum[t, 0]
                for w in cutlass.range_constexpr(WARPS - 1):
                    total = total + sSum[t, w + 1]
                o = sO[t, tidx].to(Float32)
                inv_rms = cute.math.rsqrt(total * (1.0 / HEAD_DIM) + norm_eps)
                gate = 1.0 / (1.0 + cute.math.exp(-og[t].to(Float32)))
                y = Float32(cutlass.select_(sLive[t] != 0, o * inv_rms * nw * gate, Float32(0.0)))
                mOut[0, bos + t, h, tidx] = y.to(mOut.element_type)


# --------------------------------------------------------------------------------------------------
# Host side: compile, variant key, the entry
# --------------------------------------------------------------------------------------------------

_INDEX_DTYPES = (torch.int32, torch.int64)


def variant_key(*, state_dtype, gate, has_dt_bias, has_bias, aligned, max_tokens, rows_per_pass=4,
                cache_hint="stream", null_policy=NullSlotPolicy.NONPOSITIVE, index_dtype=torch.int32,
                qsl_dtype=torch.int32, nat_dtype=torch.int32, min_ctas=0):
    """Every code-generation parameter of one multi-token fused variant, in the order ``_compile`` reads them.
    ``max_tokens`` is a token bucket (``TOKEN_BUCKETS``; :func:`token_bucket` of T)."""
    null_policy = NullSlotPolicy(null_policy)
    if gate not in (GateMode.LOWER_BOUND, GateMode.SOFTPLUS):
        fail("gate", "GateMode.LOWER_BOUND or GateMode.SOFTPLUS (the layer's gate is in the kernel)", gate)
    for name, dt in (("state_indices", index_dtype), ("query_start_loc", qsl_dtype),
                     ("num_accepted_tokens", nat_dtype)):
        if dt not in _INDEX_DTYPES:
            fail(name, "dtype int32 or int64", dt)
    if state_dtype not in (torch.bfloat16, torch.float32):
        fail("state", "dtype bfloat16 or float32", state_dtype)
    if max_tokens not in TOKEN_BUCKETS:
        fail("max_tokens", f"one of {TOKEN_BUCKETS}", max_tokens)
    cfg = FusedSpecConfig(rows_per_pass, cache_hint, min_ctas)
    return (state_dtype, gate, bool(has_dt_bias), bool(has_bias), bool(aligned), max_tokens, cfg.rows_per_pass,
            cfg.cache_hint, null_policy, index_dtype, qsl_dtype, nat_dtype, cfg.min_ctas)


_EXTRA_OPTIONS = ""  # tests set "--keep-ptx --dump-dir D" through compile_variant()


def _compile(key, arch):
    (state_dt, gate, has_dt_bias, has_bias, aligned, max_tokens, rows_per_pass, cache_hint, null_policy,
     index_dtype, qsl_dtype, nat_dtype, min_ctas) = key
    cdt = _launch.cutlass_dtype
    align = _launch.VECTOR_BYTES if aligned else 1
    tok, N, H, C, HK, R = (_launch.sym_size() for _ in range(6))
    fake = _launch.fake_tensor
    bf16 = cutlass.BFloat16
    args = [
        fake(bf16, (tok, C), (None, 1), align_bytes=1),  # x: one element per thread
        fake(cutlass.Float32, (PARTS, CONV_WIDTH, HK), (None, None, 1), align_bytes=1),  # weight
        fake(cutlass.Float32, (C,), (1,), align_bytes=1) if has_bias else None,  # conv bias
        fake(bf16, (N, C, _launch.sym_size()), (None, 1, None), align_bytes=1),  # conv_state (SD layout)
        fake(bf16, (1, tok, H, HEAD_DIM), (None, None, None, 1), align_bytes=align),  # raw_gate: lane vectors
        fake(bf16, (1, tok, H), (None, None, None), align_bytes=1),  # raw_beta
        fake(cutlass.Float32, (H,), (None,), align_bytes=1),  # A_log
        fake(cutlass.Float32, (_launch.sym_size(),), (1,), align_bytes=align) if has_dt_bias else None,
        fake(cdt(state_dt), (N, H, HEAD_DIM, HEAD_DIM), (None, HEAD_DIM * HEAD_DIM, HEAD_DIM, 1), align_bytes=align),
        fake(cdt(index_dtype), (R, _launch.sym_size()), (None, None), align_bytes=1),  # state_indices [N, T]
        fake(cdt(qsl_dtype), (_launch.sym_size(),), (None,), align_bytes=1),  # query_start_loc [N + 1]
        fake(cdt(nat_dtype), (R,), (None,), align_bytes=1),  # num_accepted_tokens [N]
        fake(bf16, (tok, H, HEAD_DIM), (None, None, 1), align_bytes=1),  # output_gate
        fake(cutlass.Float32, (HEAD_DIM,), (1,), align_bytes=1),  # norm_weight
        fake(bf16, (1, tok, H, HEAD_DIM), (None, None, None, 1), align_bytes=1),  # output
        cutlass.Float32(1.0),
        cutlass.Float32(-1.0),
        cutlass.Float32(1e-5),
        _launch.fake_stream(),
    ]
    kernel = KDAFusedSpec(state_dtype=cdt(state_dt), gate=gate, has_dt_bias=has_dt_bias, has_bias=has_bias,
                          aligned=aligned, max_tokens=max_tokens, rows_per_pass=rows_per_pass, cache_hint=cache_hint,
                          null_policy=null_policy, index_dtype=cdt(index_dtype), qsl_dtype=cdt(qsl_dtype),
                          nat_dtype=cdt(nat_dtype), min_ctas=min_ctas)
    return cute.compile(kernel, *args, options=_launch.compile_options(arch, _EXTRA_OPTIONS))


def compile_variant(key, arch: str, extra_options: str = ""):
    """Compile one variant outside the cache (CI compile checks, PTX dumps)."""
    global _EXTRA_OPTIONS
    saved, _EXTRA_OPTIONS = _EXTRA_OPTIONS, extra_options
    try:
        return _compile(key, arch)
    finally:
        _EXTRA_OPTIONS = saved


# Launch memo: (id of the validated description, null policy, requested config, device index) -> (description,
# positional function). The description (kda-core's PackedFusedDecodeCall) is immutable and remembered by every
# fact the variant depends on; the entry holds it, so its id is not reused while the entry lives.
_LAUNCH_MEMO: dict[tuple, tuple] = {}
_LAUNCH_MEMO_MAX = 1024


def _function(call, null_policy, config, device):
    key = (id(call), null_policy, config, device.index)
    entry = _LAUNCH_MEMO.get(key)
    if entry is None:
        if not isinstance(null_policy, NullSlotPolicy):
            fail("null_policy", "a NullSlotPolicy", repr(null_policy))
        if config is None:
            cfg = select_config(call.rows, call.H, call.T, call.state_dtype)
        elif isinstance(config, FusedSpecConfig):
            cfg = config
        else:
            fail("config", "a FusedSpecConfig or None", type(config).__name__)
        vkey = variant_key(state_dtype=call.state_dtype, gate=call.gate_mode, has_dt_bias=call.has_dt_bias,
                           has_bias=call.has_bias, aligned=call.aligned, max_tokens=token_bucket(call.T),
                           rows_per_pass=cfg.rows_per_pass, cache_hint=cfg.cache_hint, null_policy=null_policy,
                           index_dtype=call.index_dtype, qsl_dtype=call.qsl_dtype, nat_dtype=call.nat_dtype,
                           min_ctas=cfg.min_ctas)
        compiled = _launch.get_or_compile(("fused_spec", *vkey), lambda arch: _compile(vkey, arch),
                                          _launch.arch_for(device))
        raw = getattr(compiled, "__tvm_ffi_object__", None)
        fn = (raw() if raw is not None else None) or compiled
        if len(_LAUNCH_MEMO) >= _LAUNCH_MEMO_MAX:
            _LAUNCH_MEMO.clear()
        entry = _LAUNCH_MEMO[key] = (call, fn, compiled)
    return entry[1]


def _debug_check(state_indices, N, null_policy):
    """KDA_DEBUG_VALIDATE: every checkpoint slot of every row (2-D indices flattened) names a distinct live slot."""
    debug_check_slots(state_indices, N, argument="state_indices", null_policy=null_policy)


def packed_fused_kda_decode(
    x,
    weight,
    conv_state,
    raw_gate,
    raw_beta,
    A_log,
    dt_bias,
    state_indices,
    state,
    output_gate,
    norm_weight,
    lower_bound=-5.0,
    norm_eps=1e-5,
    output=None,
    *,
    query_start_loc,
    num_accepted_tokens,
    t1_state_indices=None,
    bias=None,
    null_policy=NullSlotPolicy.NONPOSITIVE,
    config=None,
):
    """The multi-token fused KDA layer step (FlashInfer's ``packed_fused_kda_decode``); updates ``conv_state`` and
    ``state`` in place and returns ``output`` [1, Ntok, H, 128] bf16.

    Args (Ntok packed tokens, N rows, T = state_indices.shape[1] <= 16, H heads in ``T1_HEAD_COUNTS``,
    C = 3*H*128): x [Ntok, C] bf16 (row stride free); weight [3, 4, H*128] fp32; conv_state [slots, C, >= T + 2]
    bf16, strides (slot, 1, column) (the SD layout); raw_gate [1, Ntok, H, 128] bf16; raw_beta [1, Ntok, H] bf16
    (logits); A_log [H] fp32; dt_bias [H*128] fp32 or None; state_indices [N, T] int32 / int64 (column 0 the conv
    slot, column t token t's checkpoint; any strides); state [slots, H, 128, 128] bf16 or fp32 (any slot stride);
    output_gate [Ntok, H, 128] or [1, Ntok, H, 128] bf16; norm_weight [128] fp32; ``lower_bound`` < 0, or None for
    the softplus gate; ``norm_eps`` >= 0; ``output`` [1, Ntok, H, 128] bf16 (allocated when None);
    ``query_start_loc`` [N + 1] and ``num_accepted_tokens`` [N] int32 / int64 (device data, bounded in the kernel);
    ``bias`` [C] fp32, the conv bias, optional. The full rules: :func:`kda_core.validation_fused.
    validate_packed_fused_decode`; the semantics: :func:`kda_core.oracle_fused.packed_fused_kda_decode_ref`.

    ``t1_state_indices``: FlashInfer's pre-resolved T = 1 rows: with T = 1 it is a [Ntok] slot per token and the call
    is :func:`kda_cute.fused_decode.fused_kda_decode` on it (``query_start_loc`` / ``num_accepted_tokens`` unused);
    with T > 1 it is refused. ``null_policy`` (docs/design.md §4), NONPOSITIVE by default as FlashInfer's op.
    ``config``: a :class:`FusedSpecConfig` instead of :func:`select_config`'s.

    No host sync, no allocation when ``output`` is given; safe under CUDA-graph capture. Duplicate live slots are a
    caller error (detected with ``KDA_DEBUG_VALIDATE=1``).
    """
    if t1_state_indices is not None:
        if not isinstance(state_indices, torch.Tensor) or state_indices.dim() != 2 or state_indices.shape[1] != 1:
            fail("t1_state_indices", "None unless state_indices is [N, 1] (pre-resolved rows are for T = 1 only)",
                 "a tensor" if not isinstance(state_indices, torch.Tensor)
                 else f"state_indices of shape {tuple(state_indices.shape)}")
        from .fused_decode import fused_kda_decode

        return fused_kda_decode(x, weight, conv_state, raw_gate, raw_beta, A_log, dt_bias, t1_state_indices, state,
                                output_gate, norm_weight, lower_bound, norm_eps, output, bias=bias,
                                null_policy=null_policy)
    call = validate_packed_fused_decode(x, weight, conv_state, raw_gate, raw_beta, A_log, dt_bias, state_indices,
                                        state, output_gate, norm_weight, lower_bound, norm_eps, output,
                                        query_start_loc=query_start_loc, num_accepted_tokens=num_accepted_tokens,
                                        bias=bias)
    if debug_checks_enabled():  # KDA_DEBUG_VALIDATE (off: one knob lookup): duplicate live slots
        _debug_check(state_indices, call.N, null_policy)
    if output is None:
        output = torch.empty((1, call.tokens, call.H, HEAD_DIM), dtype=torch.bfloat16, device=x.device)
    if call.tokens == 0:
        return output
    if call.rows == 0:  # no row owns a token: every output is zero (no kernel of ours runs)
        return output.zero_()
    fn = _function(call, null_policy, config, x.device)
    if output_gate.dim() == 4:
        output_gate = output_gate[0]
    lb = -1.0 if call.lower_bound is None else call.lower_bound
    if dt_bias is not None and dt_bias.dim() != 1:
        dt_bias = dt_bias.view(-1)
    try:
        fn(x, weight, bias, conv_state, raw_gate, raw_beta, A_log, dt_bias, state, state_indices, query_start_loc,
           num_accepted_tokens, output_gate, norm_weight, output, HEAD_DIM**-0.5, lb, call.norm_eps)
    except WRAPPER_REJECTED as err:  # the compiled wrapper refused an argument kda-core passed: nothing launched
        raise RuntimeError(f"packed_fused_kda_decode: the compiled kernel rejected a validated call ({err})") from err
    return output
