"""Fused KDA decode layer, T=1: conv update + SiLU, the KDA step, gated RMSNorm in one kernel (docs/design.md §8).

One step of a whole KDA layer between the projection GEMM and ``o_proj``, with FlashInfer's ``fused_kda_decode``
arguments. Per row b (slot s = state_indices[b]) and head h:

1. conv (width 4, depthwise) over ``[conv_state[s] | x[b]]`` for the head's 3 x 128 channels (its q, k and v parts),
   SiLU, rounded to bf16; ``conv_state[s]`` <- the window's last 3 columns;
2. the KDA step of docs/design.md §3 (L2 norms, the lower-bound or softplus gate from raw_gate + dt_bias,
   beta = sigmoid(raw_beta)) on the state ``state[s, h]``, o rounded to bf16;
3. ``y = o * rsqrt(mean(o^2) + norm_eps) * norm_weight * sigmoid(output_gate)``, output [1, B, H, 128] bf16; without
   ``output_gate`` / ``norm_weight`` (the no-norm variant, vLLM's native op called without them) ``y = o``.

Work split: one CTA of 128 threads per (row, head), grid (B, H, 1) (B on grid x: any batch, no split). The CTA owns
every conv channel of its head, so the conv cache of a slot is read and rewritten by the H CTAs of its row, each on
its own channels: no cross-CTA hazard. The kernel is :class:`kda_cute.decode_t1.KDADecodeT1` at tile 128 (a CTA owns
all 128 state rows of its head) with three hooks of that class overridden:

- phase 0, before the slot is known: thread t loads channel t of each part of ``x`` (coalesced: 128 consecutive
  bf16 per part), its 4 taps per part, the conv bias, output_gate / norm_weight of channel t, and the T=1 kernel's
  raw gate / beta / A_log / dt_bias lane vectors;
- the state rows are issued (:meth:`KDADecodeT1.update_state`: register rows in flight, or the bulk ring), then
  :meth:`KDAFusedDecode.complete_token` runs the conv under their latency: thread t reads the 3 history columns of
  its 3 channels (the SD layout is channel-contiguous per column: a warp reads 64 contiguous bytes), writes the new
  history, puts its 3 bf16 conv outputs into shared memory; one CTA barrier; each lane then takes its 8 q and k
  channels and its 16 rows' v from shared memory and the T=1 row stream runs unchanged;
- :meth:`KDAFusedDecode.emit_row` puts each row's o (rounded to bf16) into shared memory; a barrier; the sum of
  squares is a warp butterfly plus a 4-entry shared array; thread t writes y[t] (coalesced).

Small B*H (the schedule's first rows): a cluster of C = 2, 4 or 8 CTAs per (row, head) instead, grid (B * C, H, 1),
each CTA streaming 128 / C state rows as the T=1 kernel does at that tile; the q / k conv is computed by every CTA
of the cluster, the RMSNorm's sum of squares exchanged through distributed shared memory by ``st.async`` onto each
CTA's mbarrier (:class:`KDAFusedDecode`, packages/kda-cute/docs/fused_decode.md). There the chain from the slot to
the output is the kernel's time, so the gate is computed under the history loads, and the exchange takes no release
arrive (whose ``MEMBAR`` waited for every store before it).

Null rows (``NullSlotPolicy``, default NONPOSITIVE as FlashInfer's op; a slot >= N is null under both): zero
output, neither the conv cache nor the state read or written. Slot offsets are 64-bit (``Int64(slot) * stride``),
int64 indices are compared in 64 bits. Variants (compile-time): pool dtype x gate x dt_bias / conv bias present x
norm present x conv layout (SD: channel stride 1; DS: column stride 1, each thread reading its channel's 3 contiguous
columns) x alignment class x rows in flight x cache hint x bulk ring x null policy x index dtype x cluster size; B, H,
the pool's slots and both caches' remaining strides are runtime values, and so are ``lower_bound`` and ``norm_eps``.
"""

import dataclasses
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, const_expr

from kda_core.contracts import HEAD_DIM, GateMode, NullSlotPolicy
from kda_core.errors import fail
from kda_core.validation import WRAPPER_REJECTED, debug_check_slots, debug_checks_enabled
from kda_core.validation_fused import CONV_HISTORY, CONV_LAYOUTS, CONV_SD, CONV_WIDTH, validate_fused_decode

from . import _launch
from .decode_t1 import (
    CACHE_HINTS,
    CHANNELS_PER_LANE,
    HALF_WARP,
    THREADS,
    KDADecodeT1,
    bulk_ring_for,
    rows_in_flight_for,
)

__all__ = ["FusedDecodeConfig", "select_config", "effective_config", "fused_kda_decode", "KDAFusedDecode",
           "variant_key", "compile_variant"]

PARTS = 3  # q | k | v
WARPS = THREADS // 32
CLUSTER_SIZES = (1, 2, 4, 8)  # CTAs per (row, head); 8 is the portable cluster size limit
GRID_X_MAX = 2**31 - 1  # CUDA's limit on gridDim.x (B * cluster CTAs)


@dataclass(frozen=True)
class FusedDecodeConfig:
    """Schedule of one fused launch. ``rows_in_flight``, ``cache_hint`` and ``bulk_ring`` mean what they mean in
    :class:`kda_cute.decode_t1.DecodeT1Config`; a ring the call cannot take (unaligned) is dropped by
    :func:`effective_config`. ``cluster`` (one of ``CLUSTER_SIZES``): 1 = one CTA owns its (row, head) (tile 128);
    C > 1 = a cluster of C CTAs shares it, each streaming 128 / C state rows (the small-batch variant: more CTAs per
    head, see :class:`KDAFusedDecode`); the register path only (the ring is dropped)."""

    rows_in_flight: int = 0
    cache_hint: str = "stream"
    bulk_ring: int = 0
    cluster: int = 1

    def __post_init__(self):
        if not isinstance(self.rows_in_flight, int) or self.rows_in_flight < 0:
            fail("config.rows_in_flight", "an integer >= 0", self.rows_in_flight)
        if self.cache_hint not in CACHE_HINTS:
            fail("config.cache_hint", f"one of {CACHE_HINTS}", self.cache_hint)
        bulk_ring_for(HEAD_DIM, 2, True, self.bulk_ring)  # raises on an illegal depth
        if self.cluster not in CLUSTER_SIZES:
            fail("config.cluster", f"one of {CLUSTER_SIZES}", self.cluster)


# Per pool dtype, rows (max B*H states, config), the last unbounded: clusters of C CTAs per (row, head) at small
# B*H, then one CTA per (row, head) on the register path while latency decides, the bulk ring once bandwidth does.
# Cluster rows: benchmarks/bench_fused_decode.py --batch-size 1 2 4 8 16 --heads 12 24 --cluster 1 2 4 8 --no-fla
# (H200, 2026-12-04, the cluster variant exchanging its RMSNorm partials by st.async onto an mbarrier, CUDA-graph
# replay, two runs), each cluster size at B*H states, us:
#   bf16  12: C=4 2.85-2.91 (C=8 2.91-2.98, C=1 3.71)   24: C=4 3.04-3.07 (C=2 3.33-3.36)
#         48: C=2 3.46-3.52 (C=1 3.84-3.94)   96: C=1 4.10-4.16 (C=2 4.45-4.48)   192: C=1 5.34-5.44, C=2 level
#   fp32  12: C=8 3.33-3.39 (C=4 3.42)   24: C=8 3.94 (C=4 3.97-4.19)   48: C=2 4.32-4.38 (C=8 4.64-4.83)
#         96: C=1 and C=2 level in the sweep (5.73-5.89), C=2 5.89 / 6.05 in two full benchmark runs (B=8, H=12),
#         so C=1   192: C=2 7.58-7.78 (C=1 7.97-8.06)   384: C=1 14.08-14.11 (C=2 14.24+)
# Clusters were measured on aligned calls only, so an unaligned call keeps one CTA per (row, head). bf16 from 1537 to
# 3072 states: the register path, --bulk-ring 0 4 6 8 at B = 256 and 512, H = 12 (same run): at 3072 states 59.50 us
# against 61.14 (ring 8), 62.24 (4), 61.26 (6); at 6144 the ring wins (117.15 against 122.25); 1536 and below not
# swept (the ring there reads 88-103% of the copy). The other tile-128 thresholds are the T=1 table's tile-128 rows
# (decode_t1._SCHEDULE, measured on the H200), not a sweep of this kernel: benchmarks/bench_fused_decode.py
# --bulk-ring measures both paths (H200, 2026-12-01: 88-93% of the copy roofline of the layer's bytes at B >= 256).
_SCHEDULE = {
    torch.bfloat16: ((24, FusedDecodeConfig(cluster=4)), (48, FusedDecodeConfig(cluster=2)), (384, FusedDecodeConfig()),
                     (1536, FusedDecodeConfig(bulk_ring=8)), (3072, FusedDecodeConfig()),
                     (1 << 62, FusedDecodeConfig(bulk_ring=8))),
    torch.float32: ((24, FusedDecodeConfig(cluster=8)), (48, FusedDecodeConfig(cluster=2)), (96, FusedDecodeConfig()),
                    (192, FusedDecodeConfig(cluster=2)), (287, FusedDecodeConfig()),
                    (1 << 62, FusedDecodeConfig(bulk_ring=8))),
}


def effective_config(config: FusedDecodeConfig, state_dtype: torch.dtype, aligned: bool) -> FusedDecodeConfig:
    """What ``config`` runs as: a cluster (C > 1) on the register path only; otherwise the ring only where
    :func:`kda_cute.decode_t1.bulk_ring_for` gives one (it then replaces rows in flight and the cache hint); rows in
    flight normalised to the effective count at the tile 128 / C."""
    ring = 0 if config.cluster > 1 else bulk_ring_for(HEAD_DIM, state_dtype.itemsize, aligned, config.bulk_ring)
    if ring:
        return FusedDecodeConfig(bulk_ring=ring)
    return dataclasses.replace(config, bulk_ring=0,
                               rows_in_flight=rows_in_flight_for(HEAD_DIM // config.cluster, state_dtype.itemsize,
                                                                 config.rows_in_flight))


def select_config(B: int, H: int, state_dtype: torch.dtype, aligned: bool) -> FusedDecodeConfig:
    """The schedule policy: the ``_SCHEDULE`` row of B*H states, fitted to the call (a cluster row only for an
    aligned call: the class it was measured in)."""
    cfg = next(c for limit, c in _SCHEDULE[state_dtype] if B * H <= limit)
    if cfg.cluster > 1 and not aligned:
        cfg = FusedDecodeConfig()
    return effective_config(cfg, state_dtype, aligned)


# --------------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------------


class KDAFusedDecode(KDADecodeT1):
    """Compile-time configuration of one fused decode variant: the T=1 kernel at tile 128 / ``cluster`` (l2norm on,
    beta a logit, the gate in the kernel) plus the conv and the gated RMSNorm around its row stream.

    ``cluster`` = 1: one CTA per (row, head), grid (B, H, 1). ``cluster`` = C > 1: a cluster of C CTAs per (row,
    head), grid (B * C, H, 1) with cluster dims (C, 1, 1) (B stays on x: any batch); CTA rank r of the cluster owns
    state rows [r * 128 / C, (r + 1) * 128 / C) and the same v channels. Every CTA of the cluster computes the head's
    q and k conv outputs (reading the history is safe) and the v channels of its own rows, whose new history it
    writes; the q / k channels' new history is written by rank 0 only once every CTA of the cluster is past its
    history reads. The RMSNorm: each CTA's sum of squares of its rows' bf16 o goes into element ``rank`` of every
    CTA's shared ``[C]`` array by ``st.async`` (distributed shared memory, after a cluster barrier that makes sure
    every CTA has started and initialised its mbarrier), completing C x 4 bytes on that CTA's mbarrier; each CTA
    waits on its own mbarrier, then sums the C partials in rank order (the same total in every CTA) and normalises its
    own rows. Every partial is computed from its CTA's conv outputs, so rank 0's mbarrier completes after every
    CTA's history reads returned: then it writes the q / k history. A CTA exits only after all C partials have
    landed in its shared memory. Without the norm the exchange is a release / acquire cluster barrier instead. The
    CTAs of a cluster share the row, hence its slot: a null row is null in all of them, and none takes a cluster
    barrier."""

    def __init__(self, *, state_dtype, gate: GateMode, has_dt_bias: bool, has_bias: bool, aligned: bool,
                 rows_in_flight: int = 0, cache_hint: str = "stream", bulk_ring: int = 0,
                 null_policy: NullSlotPolicy = NullSlotPolicy.NONPOSITIVE, index_dtype=cutlass.Int32,
                 cluster: int = 1, has_norm: bool = True, conv_layout: str = CONV_SD):
        if gate == GateMode.PRECOMPUTED:
            raise ValueError("fused_decode: the layer's gate is computed in the kernel (lower bound or softplus)")
        if cluster not in CLUSTER_SIZES:
            raise ValueError(f"fused_decode: cluster must be one of {CLUSTER_SIZES}, got {cluster}")
        if conv_layout not in CONV_LAYOUTS:
            raise ValueError(f"fused_decode: conv_layout must be one of {CONV_LAYOUTS}, got {conv_layout!r}")
        if cluster > 1:
            bulk_ring = 0  # the cluster variant streams its rows through registers
        super().__init__(state_dtype=state_dtype, gate=gate, beta_is_logit=True, use_qk_l2norm=True,
                         has_dt_bias=has_dt_bias, tile_v=HEAD_DIM // cluster, aligned=aligned,
                         rows_in_flight=rows_in_flight, cache_hint=cache_hint, bulk_ring=bulk_ring,
                         null_policy=null_policy, index_dtype=index_dtype)
        self.has_bias = bool(has_bias)
        self.cluster = cluster
        self.has_norm = bool(has_norm)
        self.conv_layout = conv_layout  # the conv cache's strides are in the compiled tensor's layout; kept for repr
        # The cluster variant with the norm exchanges its partial sums by st.async onto each CTA's mbarrier
        # (complete_tx) instead of a release / acquire cluster barrier, whose release arrive waited for every
        # store before it (docs/fused_decode.md, "The cluster variant"); its rows are stored at once.
        self.async_exchange = cluster > 1 and self.has_norm
        # Without the norm the cluster barrier stays, and the new state rows are stored after its release arrive
        # (store_row) where every row of the thread is in registers at once anyway (bf16 at tile 64 and below,
        # fp32 at 32 and below). Measured (H200, fp32, cluster 2: 8 rows a thread, 4 in flight, with the norm and
        # that barrier): keeping all 8 took 5.76 us against 5.06 at B = 4, H = 12.
        self.defer_row_stores = cluster > 1 and not self.has_norm and self.rows <= self.rows_in_flight

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # [B, C] bf16, C = 3*H*128
        mW: cute.Tensor,  # [3, 4, H*128] fp32
        mBias,  # [C] fp32, or None
        mConv: cute.Tensor,  # [slots, C, W >= 3] bf16, SD (channel stride 1) or DS (column stride 1)
        mGate: cute.Tensor,  # [1, B, H, 128] bf16
        mBeta: cute.Tensor,  # [1, B, H] bf16
        mALog: cute.Tensor,  # [H] fp32
        mDtBias,  # [H*128] fp32, or None
        mState: cute.Tensor,  # [slots, H, 128, 128]
        mSlot: cute.Tensor,  # [B] int32 / int64
        mOGate,  # [B, H, 128] bf16, or None (no norm)
        mNormW,  # [128] fp32, or None (no norm)
        mOut: cute.Tensor,  # [1, B, H, 128] bf16
        scale: Float32,
        lower_bound: Float32,
        norm_eps: Float32,
        stream,
    ):
        B = cute.size(mX, mode=[0])
        H = cute.size(mALog, mode=[0])
        extra = {}
        if const_expr(self.bulk_ring):
            extra = dict(preferred_smem_carveout=100)  # as the T=1 kernel's ring
        if const_expr(self.cluster > 1):
            extra = dict(cluster=[self.cluster, 1, 1])
        self.layer_kernel(mX, mW, mBias, mConv, mGate, mBeta, mALog, mDtBias, mState, mSlot, mOGate, mNormW, mOut,
                          scale, lower_bound, norm_eps).launch(grid=[B * self.cluster, H, 1], block=[THREADS, 1, 1],
                                                               stream=stream, **extra)

    def complete_token(self, token, ctx, lower_bound):
        """The conv phase, run once the state rows are issued: history columns of this thread's channels, their
        conv + SiLU (fp32, rounded to bf16) into shared memory, the new history written back, one CTA barrier, then
        the T=1 token (k, q lane vectors, v of the thread's rows) read from shared memory. Traced inline.

        Thread t's channels: channel t of q and k; of v, channel t (cluster 1) or, in a cluster, channel
        ``row0 + t`` (its CTA's rows; threads t >= the tile compute a copy and drop it). In a cluster the q / k
        history is not written here: the new columns go to ``deferred`` for rank 0 to write after the cluster barrier
        (:meth:`layer_kernel`); and the gate (:meth:`prepare_gate`, which needs none of the conv) is computed while
        the history loads are in flight, so that only the conv, the barrier and the L2 norms follow their arrival
        (the cluster variant runs at the smallest batches, where that chain is the kernel's time)."""
        mConv, slot, chans, heads, x_in, taps, cbias, sMixed, tidx, lane, group, row0, deferred, _ = ctx
        _, _, g_raw, _, beta_raw, a_log, bias_raw = token
        gConv = mConv[Int64(slot), None, None]  # [C, W]: slot offset in 64 bits
        split = self.cluster > 1
        parts = 2 if split else PARTS  # the parts every thread computes
        hist = [[gConv[p * heads + chans[p], j] for j in range(CONV_HISTORY)] for p in range(parts)]  # loads first
        gate = None
        if const_expr(split):
            # The v channel of row row0 + (t mod tile) of this CTA: its history loads go with the others (one round
            # trip for all nine).
            c = 2 * heads + chans[2]
            hist_v = [gConv[c, j] for j in range(CONV_HISTORY)]
            gate = self.prepare_gate(token, lower_bound)
        for p in range(parts):
            self.conv_channel(gConv, p * heads + chans[p], hist[p], x_in[p], taps[p],
                              cbias[p] if const_expr(self.has_bias) else None, sMixed, p, tidx, deferred)
        own_v = None
        if const_expr(split):
            # Every thread computes the v channel (the history reads are all before the barrier below), its owner
            # t < tile stores the output and, after the barrier, the history; no other CTA touches the channel.
            own_v = []
            mixed = self.conv_channel(gConv, c, hist_v, x_in[2], taps[2],
                                      cbias[2] if const_expr(self.has_bias) else None, None, 2, None, own_v)
            self.store_if_owner(tidx < self.tile_v, sMixed, chans[3], mixed)
        cute.arch.sync_threads()  # every conv output is in shared memory; every history read of this CTA is done
        if const_expr(split):
            c, h1, h2, xv = own_v[0]
            self.history_if_owner(tidx < self.tile_v, gConv, c, h1, h2, xv)
        q_raw = self.load_lane_vector(sMixed[0, None], lane, sMixed.element_type)
        k_raw = self.load_lane_vector(sMixed[1, None], lane, sMixed.element_type)
        v_raw = cute.make_rmem_tensor((self.rows,), sMixed.element_type)
        for j in range(self.rows):
            v_raw[j] = sMixed[2, self.state_row(row0, group, j)]
        return (k_raw, q_raw, g_raw, v_raw, beta_raw, a_log, bias_raw), gate

    def store_row(self, atom, s_new: cute.Tensor, s_vec, row_view, ctx):
        """The cluster variant without the norm keeps its new state rows in registers (a copy each, into ``ctx``'s
        list) for :meth:`layer_kernel` to store after the release arrive of its cluster barrier: that arrive waits
        until every store before it is performed (a ``MEMBAR`` in the SASS), so rows stored before it would hold
        the barrier for their whole write latency. Only where the thread's rows are all in flight at once
        (``defer_row_stores``); elsewhere (the norm's st.async exchange has no release arrive) and in the one-CTA
        variant, each row is stored at once. Traced inline."""
        if const_expr(self.defer_row_stores):
            kept = cute.make_rmem_tensor((CHANNELS_PER_LANE,), s_new.element_type)
            kept.store(s_new.load())
            ctx[-1].append((atom, cute.logical_divide(kept, (s_vec,)), row_view))
        else:
            super().store_row(atom, s_new, s_vec, row_view, ctx)

    def conv_channel(self, gConv, c, hist, x, taps, cbias, sMixed, p, pos, deferred):
        """Conv + SiLU of channel ``c`` (history ``hist``, input ``x``) into ``sMixed[p, pos]`` (rounded to bf16);
        the new history (columns 1, 2 and x) written at once, or appended to ``deferred`` when it is a list (the
        cluster variant's q / k channels). Traced inline."""
        acc = Float32(0.0)
        if const_expr(self.has_bias):
            acc = cbias
        for j in range(CONV_HISTORY):
            acc = acc + hist[j].to(Float32) * taps[j]
        acc = acc + x.to(Float32) * taps[CONV_HISTORY]
        # SiLU, rounded to bf16; an approximate reciprocal (1 ulp) instead of an IEEE division, whose slow-path
        # branch splits the conv into blocks the loads and the arithmetic of the three parts cannot cross.
        mixed = (acc * cute.arch.rcp_approx(1.0 + cute.math.exp(-acc))).to(cutlass.BFloat16)
        if const_expr(sMixed is not None):
            sMixed[p, pos] = mixed
        if const_expr(deferred is None):
            gConv[c, 0] = hist[1]
            gConv[c, 1] = hist[2]
            gConv[c, 2] = x
        else:
            deferred.append((c, hist[1], hist[2], x))
        return mixed

    @cute.jit
    def store_if_owner(self, pred, sMixed: cute.Tensor, pos, mixed):
        """``sMixed[2, pos] = mixed`` where ``pred`` (the thread owns the v channel)."""
        if pred:
            sMixed[2, pos] = mixed

    @cute.jit
    def history_if_owner(self, pred, gConv: cute.Tensor, c, h1, h2, xv):
        """Channel ``c``'s new history (h1, h2, xv) where ``pred``."""
        if pred:
            gConv[c, 0] = h1
            gConv[c, 1] = h2
            gConv[c, 2] = xv

    @cute.jit
    def emit_row(self, mOut: cute.Tensor, b, h, row, value: Float32, lane):
        """Row ``row``'s o, rounded to bf16, into the CTA's shared [128] output row (``mOut`` here)."""
        if lane == 0:
            mOut[row] = value.to(mOut.element_type)

    @cute.kernel
    def layer_kernel(self, mX: cute.Tensor, mW: cute.Tensor, mBias, mConv: cute.Tensor, mGate: cute.Tensor,
                     mBeta: cute.Tensor, mALog: cute.Tensor, mDtBias, mState: cute.Tensor, mSlot: cute.Tensor,
                     mOGate, mNormW, mOut: cute.Tensor, scale: Float32, lower_bound: Float32, norm_eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        bx, h, _ = cute.arch.block_idx()
        split = self.cluster > 1
        b = bx
        rank = Int32(0)
        if const_expr(split):
            b = bx // self.cluster
            rank = bx % self.cluster  # the CTA's rank in its cluster (cluster dims (C, 1, 1) along grid x)
        row0 = rank * self.tile_v  # this CTA's first state row
        own = tidx % self.tile_v  # this thread's row of the CTA (output, v channel, norm weight): tidx in a cluster
        lane = tidx % HALF_WARP
        group = tidx // HALF_WARP
        heads = cute.size(mALog, mode=[0]) * HEAD_DIM  # channels of one part
        # Both caches have the same slot count (checked on the host); the smaller one bounds the slot all the same.
        n_slots = cutlass.min(cute.size(mState, mode=[0]), cute.size(mConv, mode=[0]))
        smem = cutlass.memory.SmemAllocator()
        sMixed = smem.allocate_tensor(cutlass.BFloat16, cute.make_layout((PARTS, HEAD_DIM), stride=(HEAD_DIM, 1)),
                                      byte_alignment=16)
        sO = smem.allocate_tensor(cutlass.BFloat16, cute.make_layout((HEAD_DIM,)), byte_alignment=16)
        sSum = None  # the warps' sums of squares, where more than one warp holds the CTA's rows
        if const_expr(not split or self.tile_v > 32):
            sSum = smem.allocate_tensor(Float32, cute.make_layout((WARPS,)), byte_alignment=16)
        sPart = sBar = None
        if const_expr(self.async_exchange):
            # The cluster's partial sums of squares, by rank (written by every CTA of the cluster), and the mbarrier
            # they complete (complete_tx, 4 bytes each).
            sPart = smem.allocate_tensor(Float32, cute.make_layout((self.cluster,)), byte_alignment=16)
            sBar = smem.allocate_tensor(Int64, cute.make_layout((1,)), byte_alignment=8)
        sRing, sFull = self.allocate_ring(smem)

        # ---- phase 0: every activation and parameter of this thread, before the slot is known -------------------
        slot = mSlot[b]
        chan = h * HEAD_DIM + tidx  # this thread's q / k channel within its part
        vchan = h * HEAD_DIM + row0 + own  # its v channel (in a cluster, threads past the tile load it unused)
        chans = (chan, chan, vchan, row0 + own)  # q, k, v channels; the v output's place in sMixed
        x_in = [mX[b, p * heads + chans[p]] for p in range(PARTS)]
        taps = [[mW[p, j, chans[p]] for j in range(CONV_WIDTH)] for p in range(PARTS)]
        cbias = None
        if const_expr(self.has_bias):
            cbias = [mBias[p * heads + chans[p]] for p in range(PARTS)]
        og = nw = None
        if const_expr(self.has_norm):
            og = mOGate[b, h, row0 + own]
            nw = mNormW[row0 + own]
        g_raw = self.load_lane_vector(mGate[0, b, h, None], lane, mGate.element_type)
        beta_raw = mBeta[0, b, h]
        a_log = mALog[h]
        bias_raw = None
        if const_expr(self.has_dt_bias):
            bias_raw = self.load_lane_vector(cute.local_tile(mDtBias, (HEAD_DIM,), (h,)), lane, Float32)
        token = (None, None, g_raw, None, beta_raw, a_log, bias_raw)

        if self.live(slot, self.idx(n_slots)):
            if const_expr(self.async_exchange):
                if tidx == 0:  # one arrival (thread 0's, below); the fence makes the init visible cluster-wide
                    cute.arch.mbarrier_init(sBar.iterator, 1)
                    cute.arch.mbarrier_init_fence()
            if const_expr(split):
                cute.arch.cluster_arrive_relaxed()  # "started"; waited for before the first remote store
            deferred = [] if const_expr(split) else None
            kept_rows = []  # the no-norm cluster variant's new state rows, stored after its release arrive (store_row)
            # The hooks' context; store_row appends to its last entry, complete_token unpacks it whole.
            ctx = (mConv, slot, chans, heads, x_in, taps, cbias, sMixed, tidx, lane, group, row0, deferred,
                   kept_rows)
            # ---- state rows issued, conv under their latency, the T=1 row stream; o (bf16) into sO ------------
            self.update_state(mState, slot, h, row0, group, lane, tidx, token, scale, lower_bound, sRing, sFull, sO,
                              b, ctx)
            cute.arch.sync_threads()  # the CTA's o rows are in shared memory
            if const_expr(self.async_exchange):
                if tidx == 0:  # the arrival, expecting the C partials' bytes (a peer's may already have landed)
                    cute.arch.mbarrier_arrive_and_expect_tx(sBar.iterator, self.cluster * 4)
            o = sO[row0 + own].to(Float32)
            total = None
            if const_expr(self.has_norm):
                ss = o * o
                if const_expr(split and self.tile_v < 32):
                    ss = cutlass.select_(tidx < self.tile_v, ss, Float32(0.0))
                for shift in cutlass.range_constexpr(5):  # xor 16, 8, 4, 2, 1: the warp's sum
                    ss = ss + cute.arch.shuffle_sync_bfly(ss, offset=16 >> shift)
                total = ss  # a tile of at most 32 rows: warp 0 holds them all, and its lanes < C store the partial
                if const_expr(not split or self.tile_v > 32):
                    if tidx % 32 == 0:
                        sSum[tidx // 32] = ss
                    cute.arch.sync_threads()
                    n_warps = WARPS if const_expr(not split) else self.tile_v // 32  # the warps holding CTA rows
                    total = sSum[0]
                    for w in cutlass.range_constexpr(n_warps - 1):
                        total = total + sSum[w + 1]
                # y's factors but the rms, ahead of the exchange (sigmoid by an approximate reciprocal, 1 ulp: an
                # IEEE division's slow-path branch would keep it behind the wait)
                scaled = o * nw * cute.arch.rcp_approx(1.0 + cute.math.exp(-og.to(Float32)))
            if const_expr(split):
                cute.arch.cluster_wait()  # every CTA has started (with the norm: and initialised its mbarrier)
                if const_expr(self.async_exchange):
                    if tidx < self.cluster:  # this CTA's partial into slot `rank` of CTA tidx's array, on its mbarrier
                        cute.arch.store_async_dsmem(sPart.iterator + rank, total.bitcast(Int32), sBar.iterator, tidx)
                    cute.arch.mbarrier_wait(sBar.iterator, 0)  # the C partials are here
                    total = sPart[0]
                    for r in cutlass.range_constexpr(self.cluster - 1):
                        total = total + sPart[r + 1]
                else:
                    cute.arch.cluster_arrive()  # release: every CTA is past its history reads
                    for atom, kept, view in kept_rows:  # the state rows, under the barrier's latency (store_row)
                        cute.copy(atom, kept, view)
                    cute.arch.cluster_wait()
            if const_expr(self.has_norm):
                y = (scaled * cute.math.rsqrt(total * (1.0 / HEAD_DIM) + norm_eps)).to(mOut.element_type)
            else:
                y = o.to(mOut.element_type)  # no norm: o itself (already a bf16 value)
            if const_expr(split):
                if tidx < self.tile_v:
                    mOut[0, b, h, row0 + own] = y
                # The q / k channels' new history (after the output: off its path), now that no CTA of the cluster
                # reads it. With the norm: every CTA's partial is computed from its q / k conv outputs, so its
                # history reads returned before its st.async was issued, and rank 0's mbarrier completes after all
                # C of them. Without: the barrier.
                if rank == 0:
                    gConv = mConv[Int64(slot), None, None]
                    for c, h1, h2, xv in deferred:
                        gConv[c, 0] = h1
                        gConv[c, 1] = h2
                        gConv[c, 2] = xv
            else:
                mOut[0, b, h, tidx] = y
        else:  # a null row: no cache is read or written
            if const_expr(split):
                if tidx < self.tile_v:
                    mOut[0, b, h, row0 + own] = Float32(0.0).to(mOut.element_type)
            else:
                mOut[0, b, h, tidx] = Float32(0.0).to(mOut.element_type)


# --------------------------------------------------------------------------------------------------
# Host side: compile, variant key, the entry
# --------------------------------------------------------------------------------------------------


def variant_key(*, state_dtype, gate, has_dt_bias, has_bias, aligned, rows_in_flight=0, cache_hint="stream",
                bulk_ring=0, null_policy=NullSlotPolicy.NONPOSITIVE, index_dtype=torch.int32, cluster=1,
                has_norm=True, conv_layout=CONV_SD):
    """Every code-generation parameter of one fused variant, in the order ``_compile`` reads them (``has_norm`` and
    ``conv_layout`` right after ``has_bias``, the rest in the signature's order). ``rows_in_flight`` / ``bulk_ring``
    are normalised as :func:`effective_config` does (a cluster drops the ring); ``gate`` is ``GateMode.LOWER_BOUND``
    or ``GateMode.SOFTPLUS``; ``cluster`` one of ``CLUSTER_SIZES``; ``has_norm`` False skips the gated RMSNorm (the
    output is o); ``conv_layout`` ``"sd"`` (channel stride 1) or ``"ds"`` (column stride 1)."""
    null_policy = NullSlotPolicy(null_policy)
    if conv_layout not in CONV_LAYOUTS:
        fail("conv_state", f"a layout in {CONV_LAYOUTS}", repr(conv_layout))
    if gate not in (GateMode.LOWER_BOUND, GateMode.SOFTPLUS):
        fail("gate", "GateMode.LOWER_BOUND or GateMode.SOFTPLUS (the layer's gate is in the kernel)", gate)
    if index_dtype not in (torch.int32, torch.int64):
        fail("state_indices", "dtype int32 or int64", index_dtype)
    if state_dtype not in (torch.bfloat16, torch.float32):
        fail("state", "dtype bfloat16 or float32", state_dtype)
    cfg = effective_config(FusedDecodeConfig(rows_in_flight, cache_hint, bulk_ring, cluster), state_dtype,
                           bool(aligned))
    return (state_dtype, gate, bool(has_dt_bias), bool(has_bias), bool(has_norm), conv_layout, bool(aligned),
            cfg.rows_in_flight, cfg.cache_hint, cfg.bulk_ring, null_policy, index_dtype, cfg.cluster)


_EXTRA_OPTIONS = ""  # tests set "--keep-ptx --dump-dir D" through compile_variant()


def _compile(key, arch):
    (state_dt, gate, has_dt_bias, has_bias, has_norm, conv_layout, aligned, rows_in_flight, cache_hint, bulk_ring,
     null_policy, index_dtype, cluster) = key
    cdt = _launch.cutlass_dtype
    align = _launch.VECTOR_BYTES if aligned else 1
    B, N, H, C, HK = (_launch.sym_size() for _ in range(5))
    fake = _launch.fake_tensor
    bf16 = cutlass.BFloat16
    args = [
        fake(bf16, (B, C), (None, 1), align_bytes=1),  # x: one element per thread
        fake(cutlass.Float32, (PARTS, CONV_WIDTH, HK), (None, None, 1), align_bytes=1),  # weight
        fake(cutlass.Float32, (C,), (1,), align_bytes=1) if has_bias else None,  # conv bias
        # conv_state: SD (channel stride 1, column stride free) or DS (column stride 1, channel stride free)
        fake(bf16, (N, C, _launch.sym_size()), (None, 1, None) if conv_layout == CONV_SD else (None, None, 1),
             align_bytes=1),
        fake(bf16, (1, B, H, HEAD_DIM), (None, None, None, 1), align_bytes=align),  # raw_gate: lane vectors
        fake(bf16, (1, B, H), (None, None, None), align_bytes=1),  # raw_beta
        fake(cutlass.Float32, (H,), (None,), align_bytes=1),  # A_log
        fake(cutlass.Float32, (_launch.sym_size(),), (1,), align_bytes=align) if has_dt_bias else None,
        fake(cdt(state_dt), (N, H, HEAD_DIM, HEAD_DIM), (None, HEAD_DIM * HEAD_DIM, HEAD_DIM, 1), align_bytes=align),
        fake(cdt(index_dtype), (B,), (None,), align_bytes=1),  # state_indices, any stride
        fake(bf16, (B, H, HEAD_DIM), (None, None, 1), align_bytes=1) if has_norm else None,  # output_gate
        fake(cutlass.Float32, (HEAD_DIM,), (1,), align_bytes=1) if has_norm else None,  # norm_weight
        fake(bf16, (1, B, H, HEAD_DIM), (None, None, None, 1), align_bytes=1),  # output
        cutlass.Float32(1.0),
        cutlass.Float32(-1.0),
        cutlass.Float32(1e-5),
        _launch.fake_stream(),
    ]
    kernel = KDAFusedDecode(state_dtype=cdt(state_dt), gate=gate, has_dt_bias=has_dt_bias, has_bias=has_bias,
                            aligned=aligned, rows_in_flight=rows_in_flight, cache_hint=cache_hint,
                            bulk_ring=bulk_ring, null_policy=null_policy, index_dtype=cdt(index_dtype),
                            cluster=cluster, has_norm=has_norm, conv_layout=conv_layout)
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
# positional function, compiled object). The description (kda-core's FusedDecodeCall) is immutable and remembered
# by every fact the variant depends on; the entry holds it, so its id is not reused while the entry lives.
_LAUNCH_MEMO: dict[tuple, tuple] = {}
_LAUNCH_MEMO_MAX = 1024


def _function(call, null_policy, config, device):
    key = (id(call), null_policy, config, device.index)
    entry = _LAUNCH_MEMO.get(key)
    if entry is None:
        if not isinstance(null_policy, NullSlotPolicy):
            fail("null_policy", "a NullSlotPolicy", repr(null_policy))
        if config is None:
            cfg = select_config(call.B, call.H, call.state_dtype, call.aligned)
        elif isinstance(config, FusedDecodeConfig):
            cfg = effective_config(config, call.state_dtype, call.aligned)
        else:
            fail("config", "a FusedDecodeConfig or None", type(config).__name__)
        if call.B * cfg.cluster > GRID_X_MAX:  # B * C CTAs on grid x (only a forced cluster on a huge batch)
            fail("config.cluster", f"at most {GRID_X_MAX // cfg.cluster} rows per call with {cfg.cluster} CTAs per "
                 "row (grid x limit)", call.B)
        vkey = variant_key(state_dtype=call.state_dtype, gate=call.gate_mode, has_dt_bias=call.has_dt_bias,
                           has_bias=call.has_bias, aligned=call.aligned, rows_in_flight=cfg.rows_in_flight,
                           cache_hint=cfg.cache_hint, bulk_ring=cfg.bulk_ring, null_policy=null_policy,
                           index_dtype=call.index_dtype, cluster=cfg.cluster, has_norm=call.has_norm,
                           conv_layout=call.conv_layout)
        compiled = _launch.get_or_compile(("fused_decode", *vkey), lambda arch: _compile(vkey, arch),
                                          _launch.arch_for(device))
        raw = getattr(compiled, "__tvm_ffi_object__", None)
        fn = (raw() if raw is not None else None) or compiled
        if len(_LAUNCH_MEMO) >= _LAUNCH_MEMO_MAX:
            _LAUNCH_MEMO.clear()
        entry = _LAUNCH_MEMO[key] = (call, fn, compiled)
    return entry[1]


def fused_kda_decode(
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
    bias=None,
    null_policy=NullSlotPolicy.NONPOSITIVE,
    config=None,
):
    """One T=1 step of the fused KDA layer (FlashInfer's ``fused_kda_decode``); updates ``conv_state`` and
    ``state`` in place and returns ``output`` [1, B, H, 128] bf16.

    Args (B rows, H heads in ``T1_HEAD_COUNTS``, C = 3*H*128): x [B, C] bf16 (row stride free); weight [3, 4, H*128]
    fp32; conv_state [slots, C, >= 3] bf16, strides (slot, 1, column) (the SD layout) or (slot, channel, 1) (the DS
    layout, vLLM's dim-first cache; a compile-time variant); columns 0..2 are the history, oldest first; raw_gate
    [1, B, H, 128] bf16; raw_beta [1, B, H] bf16 (logits); A_log [H] fp32; dt_bias [H*128] fp32 or None;
    state_indices [B] int32 / int64; state [slots, H, 128, 128] bf16 or fp32 (any slot stride); output_gate
    [B, H, 128] or [1, B, H, 128] bf16 and norm_weight [128] fp32, or both None (no gated RMSNorm, a compile-time
    variant: the output is o); ``lower_bound`` < 0, or None for the softplus gate; ``norm_eps`` >= 0; ``output``
    [1, B, H, 128] bf16 (allocated when None); ``bias`` [C] fp32, the conv bias, optional. The full rules:
    :mod:`kda_core.validation_fused`.

    ``null_policy``: which slots are null (docs/design.md §4), NONPOSITIVE by default (FlashInfer's op, vLLM: slot 0
    is reserved); a null row gets zero output and neither cache is read or written. ``config``: a
    :class:`FusedDecodeConfig` instead of :func:`select_config`'s (sweeps, tests).

    No host sync, no allocation when ``output`` is given; safe under CUDA-graph capture. Duplicate live slots are a
    caller error (detected with ``KDA_DEBUG_VALIDATE=1``).
    """
    call = validate_fused_decode(x, weight, conv_state, raw_gate, raw_beta, A_log, dt_bias, state_indices, state,
                                 output_gate, norm_weight, lower_bound, norm_eps, output, bias=bias)
    if debug_checks_enabled():  # KDA_DEBUG_VALIDATE (off: one knob lookup): duplicate live slots
        live = state_indices
        if null_policy is NullSlotPolicy.NONPOSITIVE:  # slot 0 is null: any number of rows may name it
            live = torch.where(state_indices == 0, -1, state_indices)
        debug_check_slots(live, call.N, argument="state_indices")
    if output is None:
        output = torch.empty((1, call.B, call.H, HEAD_DIM), dtype=torch.bfloat16, device=x.device)
    if call.B == 0:
        return output
    fn = _function(call, null_policy, config, x.device)
    if output_gate is not None and output_gate.dim() == 4:
        output_gate = output_gate[0]
    lb = -1.0 if call.lower_bound is None else call.lower_bound
    if dt_bias is not None and dt_bias.dim() != 1:
        dt_bias = dt_bias.view(-1)
    try:
        fn(x, weight, bias, conv_state, raw_gate, raw_beta, A_log, dt_bias, state, state_indices, output_gate,
           norm_weight, output, HEAD_DIM**-0.5, lb, call.norm_eps)
    except WRAPPER_REJECTED as err:  # the compiled wrapper refused an argument kda-core passed: nothing launched
        raise RuntimeError(f"fused_kda_decode: the compiled kernel rejected a validated call ({err})") from err
    return output
