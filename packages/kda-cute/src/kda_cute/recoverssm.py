"""RecoverSSM commit: fold the accepted prefix of a frozen verify into the checkpoints, in place.

Spec: docs/design.md §9 (RecoverSSM) and the commit contract its oracle implements,
``kda_core.oracle_spec.recoverssm_commit_ref`` (single layer) and ``recoverssm_commit_layers_ref`` (several layers).
The verify that precedes it (a frozen verify that records, per token t of row r's window, ``u_t`` into
``correction_cache[r, hv, t]`` and ``raw k_t | raw g_t`` into ``kg_cache[r, hv, t]``) is the generic kernel's;
the source it follows is vLLM's RecoverSSM (``vllm/models/kimi_k3/nvidia/ops/recoverssm.py`` at
055e47c28003156421365af985d676fc921cb075), with kda's bounds and null-slot rules.

Per row n (slot s = state_indices[n]) and value head hv (q/k head h = hv // (HV / H) for A_log and dt_bias):

- ``len_n = max(query_start_loc[n+1] - query_start_loc[n], 0)`` when the offsets are given, else T_max;
  ``commit_len = clamp(num_accepted_tokens[n], 0, min(len_n, T_max))``, all in 64 bits before narrowing;
- the row is null (nothing read or written) iff s is null under the compile-time policy (docs/design.md §4, against
  the checkpoint's row count) or commit_len == 0;
- else, in fp32 from S = checkpoint[s, hv]: for t < commit_len, with k = kg[s, hv, t, :K], graw = kg[s, hv, t, K:],
  u = correction_cache[s, hv, t]: k^ = k / sqrt(sum k^2 + 1e-6) (with the in-kernel L2 norm), a = exp(gate(graw))
  (docs/design.md §3 steps 1-3: lower-bound, softplus, or graw itself when A_log is None), S = S * a[None, :] +
  u[:, None] * k^[None, :]; then S is stored once, rounded to the checkpoint dtype.

Work split (docs/recoverssm.md). A CTA owns (V tile of ``tile_v`` state rows, value head x layer, row) and 128
threads; a state row (K channels) belongs to K / 8 lanes, 8 channels each, as in the generic kernel, and each
thread keeps ``tile_v / groups`` rows in fp32 registers: the checkpoint is read once and written once. Tokens run in
chunks of ``groups``: row group g prepares token g of the chunk once for the CTA (k^ with a sub-warp butterfly,
the decay, and the tile's u values, into shared memory; two buffers, one barrier per chunk), then every thread
applies the chunk's tokens to its rows. The update needs no reduction (u is recorded): a token costs each thread two
instructions per state element, or one FMA where the chunk is applied folded (tile 64: S * A + sum_t u_t kk_t).

Bulk ring (``CommitConfig(128, bulk_ring=n)``, K = 128, aligned, T_max <= 8; the fp32 schedule's rows from 1536
states on): a CTA owns a whole (value head x layer, row) checkpoint; thread 0 streams it through a shared-memory ring
of n 8-row chunks by 1-D bulk copies (the T=1 kernel's ring) while the row groups prepare every token once; the
threads keep A and the kk_t of their channels in registers and update each chunk in place before it is stored.

Several layers (vLLM commits every KDA layer in one launch): :class:`RecoverSSMCommitPlan` takes per-layer
tensors of one shape, dtype and strides (base pointers free); the kernel gets layer 0's tensors, an int64 device
table of per-layer element offsets [L, 3] (checkpoint, correction cache, kg cache) and stacked gate parameters
A_log [L, H] / dt_bias [L, H*K]; grid.y = HV * L.

Compile-time variants: head dim (64, 128), checkpoint dtype (bf16, fp32), kg dtype (bf16, fp16, fp32), gate form,
L2 norm, dt_bias present, query_start_loc present and its dtype, slot / count dtypes (int32, int64), single or
layered, tile_v, alignment class, null-slot policy. Rows, pool rows, HV, H, T_max and L are runtime values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, const_expr

from kda_core.contracts import GENERIC_HEAD_DIMS, L2NORM_EPS, GateMode, NullSlotPolicy
from kda_core.errors import fail
from kda_core.validation import debug_check_slots, debug_checks_enabled

from . import _bulk_ring, _lane_math, _launch
from ._lane_math import CHANNELS_PER_LANE

__all__ = [
    "CommitConfig",
    "RecoverSSMCommitKernel",
    "RecoverSSMCommitPlan",
    "compile_variant",
    "recoverssm_commit",
    "select_config",
    "tile_v_choices",
    "variant_key",
]

THREADS = 128
MAX_ROWS_PER_THREAD = 8  # 64 fp32 registers of state per thread, the generic kernel's bound
GRID_Y_MAX = 65535  # value heads x layers ride on gridDim.y, whose CUDA limit this is
GRID_Z_MAX = 65535  # rows ride on gridDim.z: more rows run as several launches
# Resident CTAs per SM asked of ptxas for the single-layer sm_90a builds (``min_blocks_per_mp``: it caps the
# registers), by (head dim, tile_v): tile 32 at K = 128 (4 rows per thread) fits in 96 registers, five CTAs of 128
# threads; without the cap the fp32 build took 98 (four CTAs). Left to ptxas elsewhere: capped, the sm_100a tile-32
# builds spill 80-96 bytes, the layered ones 12, the K = 64 tile-64 one 16 and the bf16 tile-64 one 20 (it reaches
# 128 registers by itself).
MIN_CTAS_PER_SM = {(128, 32): 5}
OFFSET_COLUMNS = 3  # per-layer element offsets: checkpoint, correction cache, kg cache
# Bulk ring (``CommitConfig.bulk_ring``): the whole [V, K] checkpoint of an item streams global -> shared -> global
# in chunks of one row group (8 rows at K = 128: 2 KB bf16 / 4 KB fp32, contiguous) by 1-D cp.async.bulk issued by
# one thread, as the T=1 kernel's ring does; every token of the item is prepared once, so the recorded tokens must
# fit one chunk of tokens (T_max <= the row groups). K = 128, aligned checkpoints and kg caches only.
BULK_RING_MAX = 16  # the chunks of a K = 128 state
BULK_HEAD_DIM = 128


def lanes_per_row(head_dim: int) -> int:
    return head_dim // CHANNELS_PER_LANE


def row_groups(head_dim: int) -> int:
    """State rows one CTA covers per step (128 threads, K / 8 lanes per row)."""
    return THREADS // lanes_per_row(head_dim)


def tile_v_choices(head_dim: int) -> tuple[int, ...]:
    """Legal tiles: whole row groups per thread, at most ``MAX_ROWS_PER_THREAD`` rows each."""
    groups = row_groups(head_dim)
    return tuple(t for t in (8, 16, 32, 64, 128)
                 if t % groups == 0 and t <= head_dim and t // groups <= MAX_ROWS_PER_THREAD)


@dataclass(frozen=True)
class CommitConfig:
    """Schedule of one launch: ``tile_v`` state rows per CTA (grid (V / tile_v, HV * L, rows)); legal tiles are
    :func:`tile_v_choices`."""

    tile_v: int
    bulk_ring: int = 0  # ring depth in chunks (0: the register path); with a ring tile_v is the head dim


def ring_eligible(head_dim: int, aligned: bool, t_max: int) -> bool:
    """Whether a call can take the bulk ring (see ``BULK_RING_MAX``): K = 128, the aligned class, and every recorded
    token in one chunk of tokens."""
    return head_dim == BULK_HEAD_DIM and aligned and t_max <= row_groups(head_dim)


def config_ok(cfg, head_dim: int) -> bool:
    """A legal :class:`CommitConfig` for head dim ``head_dim``: a register-path tile, or a ring over the whole state."""
    if not isinstance(cfg, CommitConfig):
        return False
    if cfg.bulk_ring:
        return head_dim == BULK_HEAD_DIM and cfg.tile_v == head_dim and 2 <= cfg.bulk_ring <= BULK_RING_MAX
    return cfg.tile_v in tile_v_choices(head_dim)


def effective_config(cfg: CommitConfig, head_dim: int, aligned: bool, t_max: int, n_states: int,
                     state_dtype: torch.dtype) -> CommitConfig:
    """``cfg``, or the register path's schedule for the call where ``cfg`` asks for a ring it cannot take."""
    if cfg.bulk_ring and not ring_eligible(head_dim, aligned, t_max):
        return _schedule_row(_REGISTER_SCHEDULE[state_dtype], n_states, head_dim)
    return cfg


def _schedule_row(schedule, n_states: int, head_dim: int) -> CommitConfig:
    """The first row of ``schedule`` that holds ``n_states``; a register tile the head dim lacks becomes its smallest
    legal one."""
    for max_states, cfg in schedule:
        if n_states <= max_states:
            legal = cfg.bulk_ring or cfg.tile_v in tile_v_choices(head_dim)
            return cfg if legal else CommitConfig(tile_v_choices(head_dim)[0])
    raise AssertionError("unreachable: the schedule's last row is unbounded")


# Per checkpoint dtype, (max rows * HV * L states, config): the first row that holds the call. The register path's
# rows, measured: H200, 2026-12-02, CUDA-graph replay, CUPTI, H = 12, T = 8, accepted counts uniform in [1, 8],
# every legal tile at B = 8, 64, 128, 512 (docs/recoverssm.md, "Schedule sweep"). bf16: tile 32 at B = 8 (96
# states), 64 from B = 64 on; fp32: tile 32 from B = 64 on (4-5% ahead of 64), 16 and 32 level at B = 8. The
# 48-state row (B <= 4 at H = 12) is the generic kernel's (small grids want more CTAs), not swept here.
_REGISTER_SCHEDULE = {
    torch.bfloat16: ((48, CommitConfig(16)), (96, CommitConfig(32)), (1 << 62, CommitConfig(64))),
    torch.float32: ((48, CommitConfig(16)), (1 << 62, CommitConfig(32))),
}
# The bulk ring against the register path, same sweep conditions (H200, 2026-12-03, ring depths 4 / 8 / 16 at B = 8,
# 64, 128, 512; docs/recoverssm.md, "Bulk ring"): fp32 from B = 128 on (1536 states), depth 8: against the kept
# tile-32 build in one process, level at B = 128 (58.6 / 58.7 µs) and 5.9% ahead at 512 (213.9 / 227.4); the
# register path below (B = 64: 33.2 against 32.3 for the folded tile 32, which is 1.2 behind the kept one); bf16
# never (B = 64: 21.7-22.3 against 16.5; B = 512: 120.7-134.0 against 122.0). A call the ring cannot take
# (effective_config) runs the register row for its size.
_SCHEDULE = {
    torch.bfloat16: _REGISTER_SCHEDULE[torch.bfloat16],
    torch.float32: ((48, CommitConfig(16)), (1535, CommitConfig(32)), (1 << 62, CommitConfig(128, bulk_ring=8))),
}


def select_config(n_states: int, head_dim: int, state_dtype: torch.dtype) -> CommitConfig:
    """Pure schedule policy: the config for ``n_states`` = rows * HV * L (row, value head, layer) triples of a
    ``state_dtype`` checkpoint pool (bf16 or fp32). A ring row holds at K = 128 only (the register row for the size
    elsewhere); whether the call can take it is :func:`effective_config`'s question."""
    cfg = _schedule_row(_SCHEDULE[state_dtype], n_states, head_dim)
    if cfg.bulk_ring and head_dim != BULK_HEAD_DIM:
        return _schedule_row(_REGISTER_SCHEDULE[state_dtype], n_states, head_dim)
    return cfg


# --------------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------------


class RecoverSSMCommitKernel(_lane_math.RowLanes):
    """Compile-time configuration of one commit variant (init / __call__ / kernel)."""

    def __init__(
        self,
        *,
        head_dim: int,
        gate: GateMode,
        use_qk_l2norm: bool,
        has_dt_bias: bool,
        has_qsl: bool,
        layered: bool,
        tile_v: int,
        aligned: bool,
        null_policy: NullSlotPolicy = NullSlotPolicy.OUT_OF_RANGE,
        min_ctas: int = 0,  # resident CTAs per SM asked of ptxas (0: none); _compile sets it from MIN_CTAS_PER_SM
        slot_dtype=Int32,  # cutlass type of state_indices (compared in that width)
        nat_dtype=Int32,  # of num_accepted_tokens
        qsl_dtype=Int32,  # of query_start_loc
        bulk_ring: int = 0,  # ring depth (0: register path); needs K = 128, tile_v = K, aligned
        has_dst: bool = False,  # a destination slot per row (read the checkpoint at one slot, store it at another)
    ):
        if bulk_ring and not (head_dim == BULK_HEAD_DIM and tile_v == head_dim and aligned
                              and 2 <= bulk_ring <= BULK_RING_MAX):
            raise ValueError(f"bulk_ring: needs K = tile_v = {BULK_HEAD_DIM}, the aligned class and a depth in "
                             f"[2, {BULK_RING_MAX}], got K={head_dim}, tile_v={tile_v}, aligned={aligned}, "
                             f"bulk_ring={bulk_ring}")
        if head_dim not in GENERIC_HEAD_DIMS:
            raise ValueError(f"head_dim: expected one of {GENERIC_HEAD_DIMS}, got {head_dim}")
        if tile_v not in tile_v_choices(head_dim) and not bulk_ring:
            raise ValueError(f"tile_v: expected one of {tile_v_choices(head_dim)} for K={head_dim}, got {tile_v}")
        self.head_dim = head_dim
        self.lanes = lanes_per_row(head_dim)
        self.groups = row_groups(head_dim)
        self.gate = gate
        self.use_qk_l2norm = use_qk_l2norm
        self.has_dt_bias = has_dt_bias and gate != GateMode.PRECOMPUTED
        self.has_qsl = has_qsl
        self.layered = layered
        self.tile_v = tile_v
        self.aligned = aligned
        self.null_policy = null_policy
        self.min_ctas = min_ctas
        # smallest live slot (docs/design.md §4): 0 under out_of_range, 1 under nonpositive (slot 0 never touched)
        self.first_slot = 1 if null_policy == NullSlotPolicy.NONPOSITIVE else 0
        self.slot_dtype = slot_dtype
        self.nat_dtype = nat_dtype
        self.qsl_dtype = qsl_dtype
        self.rows = tile_v // self.groups
        self.bulk_ring = bulk_ring
        self.has_dst = has_dst
        self.token_buffers = 1 if bulk_ring else 2  # the ring prepares every token once
        self.u_per_lane = (tile_v + self.lanes - 1) // self.lanes  # u values of a token one lane prepares

    def smem_bytes(self, state_bytes: int = 2) -> int:
        """Shared memory of one CTA: two buffers (one with a ring) of ``groups`` prepared tokens (k^ and decay [K], u
        [tile_v], fp32), then the ring's slots of ``state_bytes`` elements (128-byte aligned) and mbarriers."""
        tokens = self.token_buffers * self.groups * (2 * self.head_dim + self.tile_v) * 4
        if not self.bulk_ring:
            return tokens
        return -(-tokens // 128) * 128 + self.bulk_ring * self.chunk_elems() * state_bytes + 8 * self.bulk_ring

    def chunk_elems(self) -> int:
        return self.groups * self.head_dim

    # ---- small helpers ------------------------------------------------------------------------

    @cute.jit
    def layer_view(self, tensor: cute.Tensor, mOffsets, layer, column: cutlass.Constexpr, vector: cutlass.Constexpr):
        """Layer ``layer``'s tensor: layer 0's layout at layer 0's pointer plus the layer's element offset (a
        host-computed device table, not caller data). With ``vector`` the offset is declared a multiple of a 16-byte
        vector, which the host checked for the aligned variant, so the vector accesses of layer 0 stay legal."""
        if const_expr(not self.layered):
            return tensor
        offset = Int64(mOffsets[layer, column])
        if const_expr(vector and self.aligned):
            offset = cute.assume(offset, divby=max(128 // tensor.element_type.width, 1))
        return cute.make_tensor(tensor.iterator + offset, tensor.layout)

    # ---- launch ---------------------------------------------------------------------------------

    @cute.jit
    def __call__(
        self,
        mState: cute.Tensor,  # [P, HV, V, K] bf16/fp32 (layer 0 when layered)
        mCorr: cute.Tensor,  # [P, HV, T_max, V] fp32
        mKG: cute.Tensor,  # [P, HV, T_max, 2K] bf16/fp16/fp32
        mSlots: cute.Tensor,  # [N] int32/int64
        mNat: cute.Tensor,  # [N] int32/int64
        mQsl,  # [N + 1] int32/int64 or None
        mALog,  # [H] / [L, H] fp32 or None (precomputed gate)
        mDtBias,  # [H*K] / [L, H*K] fp32 or None
        mOffsets,  # [L, 3] int64 element offsets (layered) or None
        mDst,  # [N] destination slots (state_indices' dtype) or None (in place)
        lower_bound: Float32,
        stream,
    ):
        HV = cute.size(mState, mode=[1])
        n_rows = cute.size(mSlots, mode=[0])
        n_layers = 1
        if const_expr(self.layered):
            n_layers = cute.size(mOffsets, mode=[0])
        # (a carveout given, so that the DSL needs no device to ask for its shared memory per SM)
        occupancy = dict(min_blocks_per_mp=self.min_ctas, preferred_smem_carveout=100) if self.min_ctas else {}
        self.kernel(mState, mCorr, mKG, mSlots, mNat, mQsl, mALog, mDtBias, mOffsets, mDst, lower_bound).launch(
            grid=[self.head_dim // self.tile_v, HV * n_layers, n_rows], block=[THREADS, 1, 1], stream=stream,
            **occupancy)

    # ---- kernel ---------------------------------------------------------------------------------

    @cute.kernel
    def kernel(self, mState: cute.Tensor, mCorr: cute.Tensor, mKG: cute.Tensor, mSlots: cute.Tensor,
               mNat: cute.Tensor, mQsl, mALog, mDtBias, mOffsets, mDst, lower_bound: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        lane = tidx % self.lanes
        group = tidx // self.lanes
        state_dtype = mState.element_type
        kg_dtype = mKG.element_type
        tok = self.token_regs(kg_dtype)  # one token's raw k, raw g and u values (the lane's share)
        bias = cute.make_rmem_tensor((CHANNELS_PER_LANE,), Float32)
        smem = cutlass.memory.SmemAllocator()

        def chunk_buffers(width):  # [buffer, token of the chunk, width] fp32, row-major
            layout = cute.make_layout((self.token_buffers, self.groups, width), stride=(self.groups * width, width, 1))
            return smem.allocate_tensor(Float32, layout, byte_alignment=16)

        bufs = (chunk_buffers(self.head_dim), chunk_buffers(self.head_dim), chunk_buffers(self.tile_v))
        v_tile, y, n = cute.arch.block_idx()
        slot, dst, commit_len, active = self.row_meta(n, mState, mCorr, mKG, mSlots, mNat, mQsl, mDst)
        if const_expr(self.bulk_ring):
            sRing = smem.allocate_tensor(
                state_dtype,
                cute.make_layout((self.bulk_ring, self.groups, self.head_dim),
                                 stride=(self.chunk_elems(), self.head_dim, 1)),
                byte_alignment=128,
            )
            sFull = smem.allocate_tensor(Int64, cute.make_layout((self.bulk_ring,)), byte_alignment=8)  # mbarriers
            if active:
                gState, gCorr, gKG = self.item_views(mState, mCorr, mKG, mOffsets, slot, y)
                gOut = self.out_view(mState, mOffsets, dst, y, gState)
                self.commit_ring(gState, gOut, gCorr, gKG, commit_len, tok, bias, mALog, mDtBias, y, lower_bound,
                                 group, lane, tidx, bufs, sRing, sFull, HV=cute.size(mState, mode=[1]))
        else:
            self.commit_registers(mState, mCorr, mKG, mOffsets, mALog, mDtBias, lower_bound, slot, dst, commit_len,
                                  active, tok, bias, bufs, v_tile, y, group, lane)

    @cute.jit
    def commit_registers(self, mState, mCorr, mKG, mOffsets, mALog, mDtBias, lower_bound, slot, dst, commit_len,
                         active, tok, bias, bufs, v_tile, y, group, lane):
        """The register path: the thread's ``tile_v / groups`` rows are loaded, committed and stored from registers."""
        raw = [cute.make_rmem_tensor((CHANNELS_PER_LANE,), mState.element_type) for _ in range(self.rows)]
        rows = [cute.make_rmem_tensor((CHANNELS_PER_LANE,), Float32) for _ in range(self.rows)]
        if active:
            # Every load of the item goes out before any of them is waited for: the checkpoint rows, the gate
            # parameters and chunk 0's records (A_log's exp is taken after the record loads are issued).
            gState, gCorr, gKG = self.item_views(mState, mCorr, mKG, mOffsets, slot, y)
            self.load_rows(raw, gState, v_tile, group, lane)
            a_log = self.load_gate(bias, mALog, mDtBias, y, HV=cute.size(mState, mode=[1]), lane=lane)
            self.load_token(tok, 0, commit_len, gKG, gCorr, group, lane, v_tile)
            self.finish_token(0, tok, 0, commit_len, bias, a_log, lower_bound, group, lane, bufs)
            cute.arch.sync_threads()
            self.to_fp32(rows, raw)
            self.commit_chunks(rows, commit_len, gKG, gCorr, bias, a_log, lower_bound, v_tile, group, lane, bufs)
            self.store_rows(rows, self.out_view(mState, mOffsets, dst, y, gState), v_tile, group, lane)

    # ---- pieces of one item ---------------------------------------------------------------------------

    @cute.jit
    def row_meta(self, n, mState, mCorr, mKG, mSlots, mNat, mQsl, mDst):
        """(slot, destination slot, commit length, active) of row n: the commit length bounded in 64 bits before
        narrowing, the slots compared in the indices' width (an int64 slot past 2^31 is null rather than wrapped into
        the pool); a null destination makes the row inactive as a null slot does."""
        T_max = cute.size(mCorr, mode=[2])
        # the caches are validated to have the checkpoint's rows; bounding by all three keeps an unvalidated call
        # inside every tensor anyway
        n_slots = cutlass.min(cutlass.min(cute.size(mState, mode=[0]), cute.size(mCorr, mode=[0])),
                              cute.size(mKG, mode=[0]))
        limit = Int64(T_max)
        if const_expr(self.has_qsl):
            seq_len = cutlass.max(Int64(mQsl[n + 1]) - Int64(mQsl[n]), Int64(0))
            limit = cutlass.min(seq_len, limit)
        commit_len = Int32(cutlass.min(cutlass.max(Int64(mNat[n]), Int64(0)), limit))
        slot = mSlots[n]
        active = ((slot >= self.slot_dtype(self.first_slot)) & (slot < self.slot_dtype(n_slots))
                  & (commit_len > Int32(0)))
        dst = slot
        if const_expr(self.has_dst):
            dst = mDst[n]
            active = active & (dst >= self.slot_dtype(self.first_slot)) & (dst < self.slot_dtype(n_slots))
        return slot, dst, commit_len, active

    @cute.jit
    def item_views(self, mState, mCorr, mKG, mOffsets, slot, y):
        """(checkpoint [V, K], correction cache [T_max, V], kg cache [T_max, 2K]) of (slot, value head x layer y)."""
        HV = cute.size(mState, mode=[1])
        hv = y % HV
        layer = y // HV
        # Int64 slot: slot * (HV*V*K) overflows 32 bits past ~4.3 GB of checkpoints.
        gState = self.layer_view(mState, mOffsets, layer, 0, True)[Int64(slot), hv, None, None]
        gCorr = self.layer_view(mCorr, mOffsets, layer, 1, False)[Int64(slot), hv, None, None]
        gKG = self.layer_view(mKG, mOffsets, layer, 2, True)[Int64(slot), hv, None, None]
        return gState, gCorr, gKG

    @cute.jit
    def out_view(self, mState, mOffsets, dst, y, gState):
        """The checkpoint [V, K] the item's folded state is stored to: slot ``dst`` of value head x layer ``y``;
        without destinations the source's own view ``gState``, so those variants trace what they always did."""
        out = gState
        if const_expr(self.has_dst):
            HV = cute.size(mState, mode=[1])
            out = self.layer_view(mState, mOffsets, y // HV, 0, True)[Int64(dst), y % HV, None, None]
        return out

    @cute.jit
    def load_rows(self, raw, gState, v_tile, group, lane):
        """Issue the loads of this thread's checkpoint rows of V tile ``v_tile`` into ``raw`` (checkpoint dtype)."""
        row0 = v_tile * self.tile_v + group  # this thread's rows: row0 + j * groups
        for j in cutlass.range_constexpr(self.rows):
            gRow = cute.local_tile(gState[row0 + j * self.groups, None], (CHANNELS_PER_LANE,), (lane,))
            self.copy_lane(gRow, raw[j], gState.element_type, "load")

    @cute.jit
    def to_fp32(self, rows, raw):
        for j in cutlass.range_constexpr(self.rows):
            rows[j].store(raw[j].load().to(Float32))

    @cute.jit
    def store_rows(self, rows, gState, v_tile, group, lane):
        """Store this thread's rows once, rounded to the checkpoint dtype."""
        state_dtype = gState.element_type
        row0 = v_tile * self.tile_v + group
        out = cute.make_rmem_tensor((CHANNELS_PER_LANE,), state_dtype)
        for j in cutlass.range_constexpr(self.rows):
            out.store(rows[j].load().to(state_dtype))
            gRow = cute.local_tile(gState[row0 + j * self.groups, None], (CHANNELS_PER_LANE,), (lane,))
            self.copy_lane(out, gRow, state_dtype, "store")

    @cute.jit
    def load_gate(self, bias, mALog, mDtBias, y, HV, lane):
        """Raw A_log of query head h (of this layer) for value head x layer ``y`` (its exp is taken after the token
        loads are issued, so they do not wait for it), and the lane's dt_bias channels into ``bias``."""
        hv = y % HV
        layer = y // HV
        a_log = Float32(0.0)
        bias.fill(0.0)
        if const_expr(self.gate != GateMode.PRECOMPUTED):
            if const_expr(self.layered):
                H = cute.size(mALog, mode=[1])
                a_log = Float32(mALog[layer, hv // (HV // H)])
            else:
                H = cute.size(mALog, mode=[0])
                a_log = Float32(mALog[hv // (HV // H)])
            if const_expr(self.has_dt_bias):
                gBias = mDtBias
                if const_expr(self.layered):
                    gBias = mDtBias[layer, None]
                gBias = cute.local_tile(gBias, (self.head_dim,), (hv // (HV // H),))
                self.copy_lane(cute.local_tile(gBias, (CHANNELS_PER_LANE,), (lane,)), bias, Float32)
        return a_log

    def token_regs(self, kg_dtype):
        """Registers of one token's loads: (raw k, raw g, u values) of the lane."""
        return (cute.make_rmem_tensor((CHANNELS_PER_LANE,), kg_dtype),
                cute.make_rmem_tensor((CHANNELS_PER_LANE,), kg_dtype),
                cute.make_rmem_tensor((self.u_per_lane,), Float32))

    @cute.jit
    def load_token(self, tok, tok0, commit_len, gKG, gCorr, group, lane, v_tile):
        """Issue the loads of token ``tok0 + group`` (row group g prepares token g of a chunk): the lane's raw k
        and raw g channels (16-byte runs) and its share of the tile's u values; zeros past the commit length (every
        lane of a warp reaches the norm's butterfly), nothing read there."""
        raw_k, raw_g, uf = tok
        kg_dtype = gKG.element_type
        t = tok0 + group
        v_tile0 = v_tile * self.tile_v
        if t < commit_len:
            gRow = gKG[t, None]
            self.copy_lane(cute.local_tile(gRow, (CHANNELS_PER_LANE,), (lane,)), raw_k, kg_dtype, "load")
            self.copy_lane(cute.local_tile(gRow, (CHANNELS_PER_LANE,), (lane + self.lanes,)), raw_g, kg_dtype,
                           "load")
            for e in cutlass.range_constexpr(self.u_per_lane):
                r = lane + e * self.lanes
                if const_expr(self.tile_v % self.lanes == 0):
                    uf[e] = gCorr[t, v_tile0 + r]
                else:
                    if r < self.tile_v:
                        uf[e] = gCorr[t, v_tile0 + r]
        else:
            raw_k.fill(0.0)
            raw_g.fill(0.0)

    @cute.jit
    def finish_token(self, buf, tok, tok0, commit_len, bias, a_log, lower_bound, group, lane, bufs):
        """Shared memory [buf, group] <- the loaded token's prepared vectors: k^ (the lane's channels), the decay
        a = exp(g_log(raw g)) and the tile's u values, stored at ``group' * rows + j`` for tile row
        ``group' + j * groups`` (each thread then reads its rows contiguously); only real tokens store."""
        raw_k, raw_g, uf = tok
        sK, sD, sU = bufs
        kf = cute.make_rmem_tensor((CHANNELS_PER_LANE,), Float32)
        gf = cute.make_rmem_tensor((CHANNELS_PER_LANE,), Float32)
        decay = cute.make_rmem_tensor((CHANNELS_PER_LANE,), Float32)
        rate = cute.math.exp(a_log) if const_expr(self.gate != GateMode.PRECOMPUTED) else Float32(0.0)
        kf.store(raw_k.load().to(Float32))
        gf.store(raw_g.load().to(Float32))
        _lane_math.gate_decay(decay, gf, bias, rate, lower_bound, self.gate, self.has_dt_bias)
        if const_expr(self.use_qk_l2norm):
            k_ss = Float32(0.0)
            for c in cutlass.range_constexpr(CHANNELS_PER_LANE):
                k_ss = k_ss + kf[c] * kf[c]
            k_scale = cute.math.rsqrt(self.row_sum(k_ss) + L2NORM_EPS)
            for c in cutlass.range_constexpr(CHANNELS_PER_LANE):
                kf[c] = kf[c] * k_scale
        if tok0 + group < commit_len:
            cute.autovec_copy(kf, cute.local_tile(sK[buf, group, None], (CHANNELS_PER_LANE,), (lane,)))
            cute.autovec_copy(decay, cute.local_tile(sD[buf, group, None], (CHANNELS_PER_LANE,), (lane,)))
            for e in cutlass.range_constexpr(self.u_per_lane):
                r = lane + e * self.lanes
                if const_expr(self.tile_v % self.lanes == 0):
                    sU[buf, group, (r % self.groups) * self.rows + r // self.groups] = uf[e]
                else:
                    if r < self.tile_v:
                        sU[buf, group, (r % self.groups) * self.rows + r // self.groups] = uf[e]

    def folded(self) -> bool:
        """The register path applies a chunk folded (:meth:`commit_chunks`) at 8 rows per thread (tile 64 at K = 128),
        where it measured faster (H200, 2026-12-03, T = 8, H = 12, same process against the unfolded build: bf16
        tile 64 17.07 -> 16.13 µs at B = 64, 125.5 -> 122.9 at B = 512; the 4-layer plan 74.4 -> 63.6 at B = 64,
        from 129 to 125 registers); the fp32 tile-32 build (4 rows) lost with it (31.0 -> 32.2 at B = 64), so fewer
        rows per thread apply each token as the recurrence has it. The ring always folds."""
        return self.rows >= 8

    @cute.jit
    def fold_tokens(self, run, kf, decay, buf, n_here, group, lane, bufs):
        """The folded form of a prepared chunk of ``n_here`` tokens (see :meth:`commit_chunks`), in one backward pass
        over its decays: row group g turns k^_g into kk_g = k^_g * a_{g+1} ... a_{n-1} in place in shared memory,
        and ``run`` ends as A = a_0 ... a_{n-1} (the lane's channels). Ends with the barrier after which every kk_t
        is visible (uniform: the chunk's length is the CTA's)."""
        sK, sD, _ = bufs
        run.fill(1.0)
        for i in cutlass.range(n_here, unroll=1):
            t = n_here - 1 - i
            if t == group:
                cute.autovec_copy(cute.local_tile(sK[buf, t, None], (CHANNELS_PER_LANE,), (lane,)), kf)
                for c in cutlass.range_constexpr(CHANNELS_PER_LANE):
                    kf[c] = kf[c] * run[c]
                cute.autovec_copy(kf, cute.local_tile(sK[buf, t, None], (CHANNELS_PER_LANE,), (lane,)))
            cute.autovec_copy(cute.local_tile(sD[buf, t, None], (CHANNELS_PER_LANE,), (lane,)), decay)
            for c in cutlass.range_constexpr(CHANNELS_PER_LANE):
                run[c] = run[c] * decay[c]
        cute.arch.sync_threads()

    @cute.jit
    def commit_ring(self, gState, gOut, gCorr, gKG, commit_len, tok, bias, mALog, mDtBias, y, lower_bound, group,
                    lane, tidx, bufs, sRing, sFull, HV):
        """The bulk-ring path (``bulk_ring``): one item is the whole [V, K] checkpoint of (slot, value head x layer).

        Thread 0 fills the ring with the first chunks (chunk c = rows [8c, 8c + 8), one contiguous run, in slot
        c % ring: the (c // ring)-th fill of that slot's mbarrier, so every wait parity is static) while the row
        groups prepare the item's tokens (all of them: T_max <= groups) and fold them (:meth:`fold_tokens`); every
        thread then keeps A and the kk_t of its lane's channels in registers and streams its row of each chunk:
        S = S * A + sum_t u_t kk_t in place in the slot, then thread 0 bulk-stores the chunk and refills the previous
        chunk's slot once its store has read it (the T=1 kernel's ring, ``kda_cute.decode_t1``); with destinations
        the chunks are read from ``gState`` and stored to ``gOut``."""
        sK, _, sU = bufs
        sdt = gState.element_type
        K = self.head_dim
        ring = self.bulk_ring
        chunk_elems = self.chunk_elems()
        chunk_bytes = chunk_elems * sdt.width // 8
        n_chunks = K // self.groups
        s_vec = 128 // sdt.width  # elements per 16-byte vector
        bulk_load = cute.make_copy_atom(cute.nvgpu.cpasync.CopyBulkG2SOp(), sdt,
                                        num_bits_per_copy=chunk_elems * sdt.width)
        bulk_store = cute.make_copy_atom(cute.nvgpu.cpasync.CopyBulkS2GOp(), sdt,
                                         num_bits_per_copy=chunk_elems * sdt.width)
        s2r = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), sdt, num_bits_per_copy=128)
        g_chunks = [cute.make_tensor(gState.iterator + c * chunk_elems, cute.make_layout((chunk_elems,)))
                    for c in range(n_chunks)]
        g_out = None
        if const_expr(self.has_dst):
            g_out = [cute.make_tensor(gOut.iterator + c * chunk_elems, cute.make_layout((chunk_elems,)))
                     for c in range(n_chunks)]
        s_slots = [cute.make_tensor(sRing.iterator + r * chunk_elems, cute.make_layout((chunk_elems,)))
                   for r in range(ring)]
        full = [sFull.iterator + r for r in range(ring)]
        views = [cute.logical_divide(cute.local_tile(sRing[r, group, None], (CHANNELS_PER_LANE,), (lane,)), (s_vec,))
                 for r in range(ring)]  # the thread's 8 channels of its row in every slot
        if tidx == 0:
            _bulk_ring.fill(ring, n_chunks, full, s_slots, g_chunks, bulk_load, chunk_bytes)
        a_log = self.load_gate(bias, mALog, mDtBias, y, HV=HV, lane=lane)
        self.load_token(tok, 0, commit_len, gKG, gCorr, group, lane, 0)
        self.finish_token(0, tok, 0, commit_len, bias, a_log, lower_bound, group, lane, bufs)
        cute.arch.sync_threads()  # the tokens prepared, and the mbarrier inits visible before anyone waits on them
        run = cute.make_rmem_tensor((CHANNELS_PER_LANE,), Float32)
        kf = cute.make_rmem_tensor((CHANNELS_PER_LANE,), Float32)
        decay = cute.make_rmem_tensor((CHANNELS_PER_LANE,), Float32)
        self.fold_tokens(run, kf, decay, 0, commit_len, group, lane, bufs)
        kk = [cute.make_rmem_tensor((CHANNELS_PER_LANE,), Float32) for _ in range(self.groups)]
        for t in cutlass.range_constexpr(self.groups):
            if t < commit_len:
                cute.autovec_copy(cute.local_tile(sK[0, t, None], (CHANNELS_PER_LANE,), (lane,)), kk[t])
        raw = cute.make_rmem_tensor((CHANNELS_PER_LANE,), sdt)
        sf = cute.make_rmem_tensor((CHANNELS_PER_LANE,), Float32)
        for j in cutlass.range_constexpr(n_chunks):
            slot = j % ring
            cute.arch.mbarrier_wait(full[slot], (j // ring) % 2)
            cute.copy(s2r, views[slot], cute.logical_divide(raw, (s_vec,)))
            sf.store(raw.load().to(Float32))
            for c in cutlass.range_constexpr(CHANNELS_PER_LANE):
                sf[c] = sf[c] * run[c]
            for t in cutlass.range_constexpr(self.groups):
                if t < commit_len:  # uniform: the item's
                    u = sU[0, t, group * self.rows + j]  # tile row j * groups + group (finish_token's order)
                    for c in cutlass.range_constexpr(CHANNELS_PER_LANE):
                        sf[c] = sf[c] + u * kk[t][c]
            raw.store(sf.load().to(sdt))
            cute.copy(s2r, cute.logical_divide(raw, (s_vec,)), views[slot])
            _bulk_ring.store_and_refill(j, ring, n_chunks, full, s_slots, g_chunks, bulk_load, bulk_store, chunk_bytes,
                                        tidx, g_out=g_out)
        _bulk_ring.drain(tidx)

    @cute.jit
    def commit_chunks(self, rows, commit_len, gKG, gCorr, bias, a_log, lower_bound, v_tile, group, lane, bufs):
        """Apply the item's tokens to ``rows`` in chunks of ``groups``: chunk 0 from buffer 0 (prepared and visible),
        each later chunk ch prepared here into buffer ch % 2 with a barrier before it is read (the barriers are
        uniform: the item is the CTA's; a buffer is rewritten two chunks after it was read, past the barriers
        between).

        With :meth:`folded`, a chunk of n tokens is applied in its folded form, S <- S * A + sum_t u_t kk_t with
        A = a_0 ... a_{n-1} and kk_t = k^_t * a_{t+1} ... a_{n-1} (the recurrence S = S * a_t + u_t k^_t unrolled
        over the chunk): one FMA per state element and token instead of a multiply and an FMA (:meth:`fold_tokens`
        prepares it, one more barrier per chunk). Else each token is applied as the recurrence has it."""
        sK, sD, sU = bufs
        C = self.groups
        kf = cute.make_rmem_tensor((CHANNELS_PER_LANE,), Float32)
        decay = cute.make_rmem_tensor((CHANNELS_PER_LANE,), Float32)
        run = cute.make_rmem_tensor((CHANNELS_PER_LANE,), Float32)
        u_rows = cute.make_rmem_tensor((self.rows,), Float32)
        tok = self.token_regs(gKG.element_type)
        n_chunks = (commit_len + C - 1) // C
        buf = Int32(0)
        for ch in cutlass.range(n_chunks, unroll=1):
            first = ch * C
            if ch > 0:  # prepare this chunk
                buf = ch % 2
                self.load_token(tok, first, commit_len, gKG, gCorr, group, lane, v_tile)
                self.finish_token(buf, tok, first, commit_len, bias, a_log, lower_bound, group, lane, bufs)
                cute.arch.sync_threads()
            n_here = commit_len - first
            if n_here > C:
                n_here = Int32(C)
            if const_expr(self.folded()):
                self.fold_tokens(run, kf, decay, buf, n_here, group, lane, bufs)
                for j in cutlass.range_constexpr(self.rows):
                    for c in cutlass.range_constexpr(CHANNELS_PER_LANE):
                        rows[j][c] = rows[j][c] * run[c]
            for t in cutlass.range(n_here, unroll=1):
                cute.autovec_copy(cute.local_tile(sK[buf, t, None], (CHANNELS_PER_LANE,), (lane,)), kf)
                if const_expr(not self.folded()):
                    cute.autovec_copy(cute.local_tile(sD[buf, t, None], (CHANNELS_PER_LANE,), (lane,)), decay)
                cute.autovec_copy(cute.local_tile(sU[buf, t, None], (self.rows,), (group,)), u_rows)
                for j in cutlass.range_constexpr(self.rows):
                    sf = rows[j]
                    u = u_rows[j]
                    for c in cutlass.range_constexpr(CHANNELS_PER_LANE):
                        if const_expr(self.folded()):
                            sf[c] = sf[c] + u * kf[c]
                        else:  # S = S * a + u k^ (the recurrence's own update with the recorded u)
                            sf[c] = sf[c] * decay[c] + u * kf[c]


# --------------------------------------------------------------------------------------------------
# Host side: compile cache, the single-layer launcher and the multi-layer plan. Neither validates the call (the
# facade does, through kda_core.validation_spec); both check what the launch itself needs (head dim, grid limits,
# config, policy) and read metadata only: no host sync, no allocation per call, CUDA-graph capturable.
# --------------------------------------------------------------------------------------------------


def commit_gate_mode(A_log, lower_bound) -> GateMode:
    """The commit's gate form: graw is the log decay itself without A_log, else lower-bound or softplus."""
    if A_log is None:
        return GateMode.PRECOMPUTED
    return GateMode.SOFTPLUS if lower_bound is None else GateMode.LOWER_BOUND


def variant_key(
    *,
    head_dim: int,
    state_dtype: torch.dtype,
    kg_dtype: torch.dtype,
    gate: GateMode,
    use_qk_l2norm: bool,
    has_dt_bias: bool,
    qsl_dtype: torch.dtype | None,
    slot_dtype: torch.dtype,
    nat_dtype: torch.dtype,
    layered: bool,
    tile_v: int,
    aligned: bool,
    null_policy: NullSlotPolicy = NullSlotPolicy.OUT_OF_RANGE,
    bulk_ring: int = 0,
    has_dst: bool = False,
) -> tuple:
    """Every code-generation parameter of one variant, in the order ``_compile`` reads them (arch added by
    ``_launch.get_or_compile``). Facts that cannot change the code are normalised so they share one entry."""
    if gate == GateMode.PRECOMPUTED:
        has_dt_bias = False
    return (
        "recoverssm_commit", int(head_dim), state_dtype, kg_dtype, GateMode(gate), bool(use_qk_l2norm),
        bool(has_dt_bias), qsl_dtype, slot_dtype, nat_dtype, bool(layered), int(tile_v), bool(aligned),
        NullSlotPolicy(null_policy), int(bulk_ring), bool(has_dst),
    )


def _compile(key: tuple, arch: str, extra_options: str = ""):
    (_, K, state_dt, kg_dt, gate, l2norm, has_dt_bias, qsl_dt, slot_dt, nat_dt, layered, tile_v, aligned,
     null_policy, bulk_ring, has_dst) = key
    cdt = _launch.cutlass_dtype
    align = _launch.VECTOR_BYTES if aligned else 1
    sym = _launch.sym_size
    HV, T_max, N = sym(), sym(), sym()
    # inner dims of the checkpoint compact, slot stride free; caches: last dim contiguous, every other stride free
    m_state = _launch.fake_tensor(cdt(state_dt), (sym(), HV, K, K), (None, K * K, K, 1), align_bytes=align)
    m_corr = _launch.fake_tensor(cutlass.Float32, (sym(), HV, T_max, K), (None, None, None, 1), align_bytes=1)
    m_kg = _launch.fake_tensor(cdt(kg_dt), (sym(), HV, T_max, 2 * K), (None, None, None, 1), align_bytes=align)
    m_slots = _launch.fake_tensor(cdt(slot_dt), (N,), (None,), align_bytes=1)
    m_nat = _launch.fake_tensor(cdt(nat_dt), (N,), (None,), align_bytes=1)
    m_dst = _launch.fake_tensor(cdt(slot_dt), (N,), (None,), align_bytes=1) if has_dst else None
    m_qsl = None if qsl_dt is None else _launch.fake_tensor(cdt(qsl_dt), (sym(),), (None,), align_bytes=1)
    m_alog = m_dt_bias = m_offsets = None
    H = sym()
    if layered:
        L = sym()
        m_offsets = _launch.fake_tensor(cutlass.Int64, (L, OFFSET_COLUMNS), (OFFSET_COLUMNS, 1), align_bytes=8)
        if gate != GateMode.PRECOMPUTED:
            m_alog = _launch.fake_tensor(cutlass.Float32, (L, H), (None, None), align_bytes=1)
            if has_dt_bias:
                m_dt_bias = _launch.fake_tensor(cutlass.Float32, (L, sym()), (None, 1), align_bytes=align)
    elif gate != GateMode.PRECOMPUTED:
        m_alog = _launch.fake_tensor(cutlass.Float32, (H,), (None,), align_bytes=1)
        if has_dt_bias:
            m_dt_bias = _launch.fake_tensor(cutlass.Float32, (sym(),), (1,), align_bytes=align)
    kernel = RecoverSSMCommitKernel(
        head_dim=K, gate=gate, use_qk_l2norm=l2norm, has_dt_bias=has_dt_bias, has_qsl=qsl_dt is not None,
        layered=layered, tile_v=tile_v, aligned=aligned, null_policy=null_policy, slot_dtype=cdt(slot_dt),
        nat_dtype=cdt(nat_dt), qsl_dtype=Int32 if qsl_dt is None else cdt(qsl_dt),
        min_ctas=0 if layered or bulk_ring or _launch.arch_number(arch) >= 100 else MIN_CTAS_PER_SM.get((K, tile_v), 0),
        bulk_ring=bulk_ring, has_dst=has_dst,
    )
    return cute.compile(
        kernel, m_state, m_corr, m_kg, m_slots, m_nat, m_qsl, m_alog, m_dt_bias, m_offsets, m_dst,
        cutlass.Float32(-1.0), _launch.fake_stream(),
        options=_launch.compile_options(arch, extra_options),
    )


def compile_variant(key: tuple, arch: str, extra_options: str = ""):
    """Compile one variant outside the cache (CI compile checks, PTX dumps: ``extra_options`` e.g.
    ``"--keep-ptx --dump-dir D"``)."""
    return _compile(key, arch, extra_options)


def _check_launch(checkpoint_state, A_log, dt_bias, HV_rows: int, config, null_policy, argument: str) -> int:
    """The facts the launch itself needs (the kernel indexes the gate parameters by head); returns K."""
    if checkpoint_state.dim() != 4:
        fail(argument, "[P, HV, V, K]", tuple(checkpoint_state.shape))
    K = checkpoint_state.shape[-1]
    if K not in GENERIC_HEAD_DIMS or checkpoint_state.shape[-2] != K:
        fail(argument, f"[P, HV, V, K] with K = V in {GENERIC_HEAD_DIMS}", tuple(checkpoint_state.shape))
    HV = checkpoint_state.shape[1]
    if A_log is not None:
        H = A_log.numel()
        if H == 0 or HV % H:
            fail("A_log", f"[H] with H dividing the value heads HV = {HV}", tuple(A_log.shape))
        if dt_bias is not None and dt_bias.numel() != H * K:
            fail("dt_bias", f"[H*K] = [{H * K}] values", tuple(dt_bias.shape))
    if HV_rows > GRID_Y_MAX:
        fail(argument, f"at most {GRID_Y_MAX} value heads x layers per launch (grid y limit)", HV_rows)
    if config is not None and not config_ok(config, K):
        fail("config", f"a CommitConfig whose tile_v is one of {tile_v_choices(K)} for K={K}, or (K = "
             f"{BULK_HEAD_DIM}) tile_v = K with bulk_ring in [2, {BULK_RING_MAX}]", config)
    if not isinstance(null_policy, NullSlotPolicy):
        fail("null_policy", "a kda_core.contracts.NullSlotPolicy", null_policy)
    return K


def _check_rows(state_indices, num_accepted_tokens, query_start_loc, destination_indices=None) -> None:
    """The kernel reads num_accepted_tokens[n], query_start_loc[n], [n + 1] and destination_indices[n] (in
    state_indices' width) for every row n of state_indices."""
    N = state_indices.shape[0]
    if destination_indices is not None and (destination_indices.dim() != 1 or destination_indices.shape[0] != N
                                            or destination_indices.dtype != state_indices.dtype):
        fail("destination_indices", f"[N] = [{N}] slots of state_indices' dtype {state_indices.dtype}",
             f"{tuple(destination_indices.shape)} {destination_indices.dtype}")
    if num_accepted_tokens.dim() != 1 or num_accepted_tokens.shape[0] != N:
        fail("num_accepted_tokens", f"[N] = [{N}] counts (one per row of state_indices)",
             tuple(num_accepted_tokens.shape))
    if query_start_loc is not None and (query_start_loc.dim() != 1 or query_start_loc.shape[0] != N + 1):
        fail("query_start_loc", f"[N + 1] = [{N + 1}] offsets", tuple(query_start_loc.shape))


def _debug_check(state_indices, num_accepted_tokens, query_start_loc, P: int, null_policy,
                 destination_indices=None) -> None:
    """KDA_DEBUG_VALIDATE: two committing rows naming one slot race on its checkpoint (rows that commit nothing are
    null and may repeat); with destinations, two committing rows storing to one slot do."""
    if debug_checks_enabled():
        live = num_accepted_tokens.to(torch.int64) > 0
        if query_start_loc is not None:
            q = query_start_loc.to(torch.int64)
            live &= q[1:] > q[:-1]
        if destination_indices is None:
            debug_check_slots(state_indices[live], P, argument="state_indices", null_policy=null_policy)
        else:
            debug_check_slots(destination_indices[live], P, argument="destination_indices", null_policy=null_policy)


def _launch_rows(fn, fixed_before: tuple, state_indices, num_accepted_tokens, query_start_loc, fixed_after: tuple,
                 destination_indices=None, lower_bound=-1.0):
    """One launch per ``GRID_Z_MAX`` rows (rows are independent; a row view moves index pointers only)."""
    n = state_indices.shape[0]
    for r0 in range(0, n, GRID_Z_MAX):
        r1 = min(r0 + GRID_Z_MAX, n)
        whole = r0 == 0 and r1 == n
        fn(*fixed_before,
           state_indices if whole else state_indices[r0:r1],
           num_accepted_tokens if whole else num_accepted_tokens[r0:r1],
           None if query_start_loc is None else (query_start_loc if whole else query_start_loc[r0 : r1 + 1]),
           *fixed_after,
           None if destination_indices is None else (destination_indices if whole else destination_indices[r0:r1]),
           lower_bound)


def recoverssm_commit(
    checkpoint_state: torch.Tensor,
    correction_cache: torch.Tensor,
    kg_cache: torch.Tensor,
    state_indices: torch.Tensor,
    num_accepted_tokens: torch.Tensor,
    A_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None,
    *,
    query_start_loc: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = True,
    null_policy: NullSlotPolicy = NullSlotPolicy.OUT_OF_RANGE,
    config: CommitConfig | None = None,
    destination_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fold each row's accepted prefix of a RecoverSSM verify into its checkpoint, in place (one layer), or into
    another slot of the same pool (``destination_indices``).

    Same semantics as ``kda_core.oracle_spec.recoverssm_commit_ref`` (its docstring is the spec; summary in this
    module's docstring). Not validated here (``kda_recurrent.recoverssm_commit`` validates through
    ``kda_core.validation_spec.validate_recoverssm_commit``); the head dim, the grid limit, ``config`` and
    ``null_policy`` are checked.

    Args (N rows, P checkpoint rows, HV value heads, H q/k heads, K = V in {64, 128}, T_max recorded tokens):
        checkpoint_state: [P, HV, V, K] bf16/fp32, inner dims compact, slot stride any number of elements >= the row
            (one that is not a 16-byte multiple takes the unaligned variant). Updated in place.
        correction_cache: [P, HV, T_max, V] fp32, the verify's u_t; last dim contiguous, other strides free.
        kg_cache: [P, HV, T_max, 2K] bf16/fp16/fp32, raw k_t | raw g_t; last dim contiguous, other strides free.
        state_indices: [N] int32/int64, any stride; read and bounded in the kernel (null under ``null_policy``).
        num_accepted_tokens: [N] int32/int64, any stride; clamped to [0, min(len_n, T_max)] in the kernel.
        A_log: [H] fp32 (any stride), or None: then raw g is the log-space decay itself (dt_bias, lower_bound unused).
        dt_bias: [H*K] or [H, K] fp32 contiguous, or None (zeros).
        lower_bound: float < 0 (Kimi K3's lower-bound gate) or None (softplus gate).
        query_start_loc: [N + 1] int32/int64 or None; len_n = max(qsl[n+1] - qsl[n], 0), else T_max.
        use_qk_l2norm_in_kernel: normalise raw k as the verify did (eps 1e-6).
        null_policy: ``OUT_OF_RANGE`` (null iff s < 0 or s >= P) or ``NONPOSITIVE`` (vLLM: also s == 0).
        config: the launch schedule (:class:`CommitConfig`); None takes :func:`select_config`'s.
        destination_indices: [N] of state_indices' dtype, any stride, or None: row n reads slot state_indices[n]
            (checkpoint and records) and stores the folded state in slot destination_indices[n] (null under
            ``null_policy``: the row commits nothing); the source slot is left as it was unless the two are equal.

    Returns ``checkpoint_state``. Rows sharing an active slot race (a caller error; ``KDA_DEBUG_VALIDATE=1``
    detects it). No host sync and no allocation: capturable in a CUDA graph.

    Example::

        recoverssm_commit(pool, corr, kg, slots, accepted, A_log, dt_bias, -5.0, query_start_loc=qsl,
                          null_policy=NullSlotPolicy.NONPOSITIVE)
    """
    HV = checkpoint_state.shape[1]
    gate = commit_gate_mode(A_log, lower_bound)
    K = _check_launch(checkpoint_state, A_log, None if gate == GateMode.PRECOMPUTED else dt_bias, HV, config,
                      null_policy, "checkpoint_state")
    _check_rows(state_indices, num_accepted_tokens, query_start_loc, destination_indices)
    _debug_check(state_indices, num_accepted_tokens, query_start_loc, checkpoint_state.shape[0], null_policy,
                 destination_indices)
    n_rows = state_indices.shape[0]
    if n_rows == 0 or HV == 0 or correction_cache.shape[2] == 0:
        return checkpoint_state  # nothing to commit (a grid dimension would be 0)
    if gate == GateMode.PRECOMPUTED:
        A_log = dt_bias = None
    elif dt_bias is not None:
        dt_bias = dt_bias.reshape(-1)
    aligned = _launch.alignment_of(checkpoint_state, kg_cache, dt_bias) == _launch.VECTOR_BYTES
    cfg = effective_config(config or select_config(n_rows * HV, K, checkpoint_state.dtype), K, aligned,
                           correction_cache.shape[2], n_rows * HV, checkpoint_state.dtype)
    key = variant_key(
        head_dim=K, state_dtype=checkpoint_state.dtype, kg_dtype=kg_cache.dtype, gate=gate,
        use_qk_l2norm=use_qk_l2norm_in_kernel, has_dt_bias=dt_bias is not None,
        qsl_dtype=None if query_start_loc is None else query_start_loc.dtype, slot_dtype=state_indices.dtype,
        nat_dtype=num_accepted_tokens.dtype, layered=False, tile_v=cfg.tile_v, aligned=aligned,
        null_policy=null_policy, bulk_ring=cfg.bulk_ring, has_dst=destination_indices is not None,
    )
    fn = _launch.get_or_compile(key, lambda arch: _compile(key, arch), _launch.arch_for(checkpoint_state.device))
    lb = -1.0 if lower_bound is None or gate != GateMode.LOWER_BOUND else float(lower_bound)
    _launch_rows(fn, (checkpoint_state, correction_cache, kg_cache), state_indices, num_accepted_tokens,
                 query_start_loc, (A_log, dt_bias, None), destination_indices, lb)
    return checkpoint_state


def _element_offsets(tensors: Sequence[torch.Tensor], argument: str) -> list[int]:
    """(t.data_ptr() - ref.data_ptr()) // itemsize for each layer's tensor against layer 0's, checked divisible
    and checked to share layer 0's shape, dtype, strides and device."""
    ref = tensors[0]
    out = []
    for i, t in enumerate(tensors):
        if (t.dtype != ref.dtype or tuple(t.shape) != tuple(ref.shape) or t.stride() != ref.stride()
                or t.device != ref.device):
            fail(f"{argument}[{i}]", f"layer 0's shape {tuple(ref.shape)}, dtype {ref.dtype}, strides "
                 f"{ref.stride()} and device {ref.device}",
                 f"{tuple(t.shape)}, {t.dtype}, {t.stride()}, {t.device}")
        delta = t.data_ptr() - ref.data_ptr()
        if delta % t.element_size():
            fail(f"{argument}[{i}]", f"a data pointer a whole number of {ref.dtype} elements from layer 0's",
                 f"{delta} bytes away")
        out.append(delta // t.element_size())
    return out


class RecoverSSMCommitPlan:
    """Commit every layer in one launch: built once from per-layer tensors, then :meth:`commit` per step.

    Args (L layers, each as in :func:`recoverssm_commit`; shapes, dtypes and strides equal across layers, base
    pointers free, e.g. separately allocated or pages of one buffer):
        checkpoint_states, correction_caches, kg_caches: sequences of L tensors.
        A_logs: L tensors [H] fp32, or None (raw g is the log decay in every layer).
        dt_biases: L tensors [H*K] / [H, K] fp32, or None (zeros).
        lower_bound: one float < 0 for every layer, or None (softplus).
        use_qk_l2norm_in_kernel, null_policy, config: as in :func:`recoverssm_commit`.

    The plan holds the layers' tensors (the per-layer element offsets it gives the kernel stay valid while it
    lives) and copies of A_log / dt_bias stacked to [L, H] / [L, H*K] at construction; after the per-layer values
    change in place (weights loaded after the plan was built), :meth:`refresh_gate_parameters` copies them into the
    same stacked buffers, so a graph captured before stays valid. Not validated beyond what the launch needs
    (``kda_recurrent.RecoverSSMCommit`` validates through ``kda_core.validation_spec.validate_recoverssm_layers``).

    Example::

        plan = RecoverSSMCommitPlan(pools, corrs, kgs, A_logs, dt_biases, -5.0, null_policy=NullSlotPolicy.NONPOSITIVE)
        plan.commit(slots, accepted, query_start_loc=qsl)  # every layer, one launch; graph-capturable
    """

    def __init__(
        self,
        checkpoint_states: Sequence[torch.Tensor],
        correction_caches: Sequence[torch.Tensor],
        kg_caches: Sequence[torch.Tensor],
        A_logs: Sequence[torch.Tensor] | None,
        dt_biases: Sequence[torch.Tensor] | None,
        lower_bound: float | None,
        *,
        use_qk_l2norm_in_kernel: bool = True,
        null_policy: NullSlotPolicy = NullSlotPolicy.OUT_OF_RANGE,
        config: CommitConfig | None = None,
    ):
        states, corrs, kgs = list(checkpoint_states), list(correction_caches), list(kg_caches)
        L = len(states)
        if L == 0:
            fail("checkpoint_states", "at least one layer", 0)
        for name, seq in (("correction_caches", corrs), ("kg_caches", kgs)):
            if len(seq) != L:
                fail(name, f"{L} layers (one per checkpoint)", len(seq))
        for name, seq in (("A_logs", A_logs), ("dt_biases", dt_biases)):
            if seq is not None and len(seq) != L:
                fail(name, f"{L} layers (one per checkpoint) or None", len(seq))
        if dt_biases is not None and all(b is None for b in dt_biases):
            dt_biases = None  # the oracle's spelling of "no dt_bias in any layer"
        ref = states[0]
        HV = ref.shape[1]
        self.gate = commit_gate_mode(None if A_logs is None else A_logs[0], lower_bound)
        gated = self.gate != GateMode.PRECOMPUTED
        self.K = _check_launch(ref, A_logs[0] if gated else None, dt_biases[0] if gated and dt_biases else None,
                               HV * L, config, null_policy, "checkpoint_states")
        if gated:
            for name, seq, size in (("A_logs", A_logs, A_logs[0].numel()),
                                    ("dt_biases", dt_biases or [], self.K * A_logs[0].numel())):
                for i, t in enumerate(seq):
                    if t is None or t.numel() != size:
                        fail(f"{name}[{i}]", f"{size} values, as layer 0", None if t is None else tuple(t.shape))
        device = ref.device
        offsets = list(zip(_element_offsets(states, "checkpoint_states"),
                           _element_offsets(corrs, "correction_caches"), _element_offsets(kgs, "kg_caches")))
        self.offsets = torch.tensor(offsets, dtype=torch.int64, device=device)  # [L, 3]
        self.A_log = self.dt_bias = None
        if gated:
            self.A_log = torch.stack([a.reshape(-1).float() for a in A_logs]).to(device)  # [L, H]
            if dt_biases is not None:
                self.dt_bias = torch.stack([b.reshape(-1).float() for b in dt_biases]).to(device)  # [L, H*K]
        self.states, self.corrs, self.kgs = states, corrs, kgs
        self._A_logs = None if self.A_log is None else list(A_logs)
        self._dt_biases = None if self.dt_bias is None else list(dt_biases)
        self.n_layers = L
        self.lower_bound = -1.0 if self.gate != GateMode.LOWER_BOUND else float(lower_bound)
        self.use_qk_l2norm = bool(use_qk_l2norm_in_kernel)
        self.null_policy = null_policy
        self.config = config
        self.aligned = _launch.alignment_of(*states, *kgs, self.dt_bias) == _launch.VECTOR_BYTES
        self.arch = _launch.arch_for(device) if device.type == "cuda" else None

    def refresh_gate_parameters(self) -> None:
        """Copy the per-layer A_log / dt_bias the plan was built from into its stacked buffers, in place."""
        if self.A_log is not None:
            self.A_log.copy_(torch.stack([a.reshape(-1) for a in self._A_logs]))
        if self.dt_bias is not None:
            self.dt_bias.copy_(torch.stack([b.reshape(-1) for b in self._dt_biases]))

    def commit(self, state_indices: torch.Tensor, num_accepted_tokens: torch.Tensor,
               query_start_loc: torch.Tensor | None = None, destination_indices: torch.Tensor | None = None) -> None:
        """Commit rows [N] (``state_indices``, ``num_accepted_tokens``, ``query_start_loc`` [N + 1] or None) in every
        layer, in place or into ``destination_indices`` [N] (as in :func:`recoverssm_commit`), in one launch
        (several past ``GRID_Z_MAX`` rows). No host sync, no allocation."""
        ref = self.states[0]
        HV = ref.shape[1]
        _check_rows(state_indices, num_accepted_tokens, query_start_loc, destination_indices)
        _debug_check(state_indices, num_accepted_tokens, query_start_loc, ref.shape[0], self.null_policy,
                     destination_indices)
        n_rows = state_indices.shape[0]
        if n_rows == 0 or HV == 0 or self.corrs[0].shape[2] == 0:
            return
        n_states = n_rows * HV * self.n_layers
        cfg = effective_config(self.config or select_config(n_states, self.K, ref.dtype), self.K, self.aligned,
                               self.corrs[0].shape[2], n_states, ref.dtype)
        key = variant_key(
            head_dim=self.K, state_dtype=ref.dtype, kg_dtype=self.kgs[0].dtype, gate=self.gate,
            use_qk_l2norm=self.use_qk_l2norm, has_dt_bias=self.dt_bias is not None,
            qsl_dtype=None if query_start_loc is None else query_start_loc.dtype, slot_dtype=state_indices.dtype,
            nat_dtype=num_accepted_tokens.dtype, layered=True, tile_v=cfg.tile_v, aligned=self.aligned,
            null_policy=self.null_policy, bulk_ring=cfg.bulk_ring, has_dst=destination_indices is not None,
        )
        fn = _launch.get_or_compile(key, lambda arch: _compile(key, arch), self.arch or _launch.target_arch())
        _launch_rows(fn, (ref, self.corrs[0], self.kgs[0]), state_indices, num_accepted_tokens, query_start_loc,
                     (self.A_log, self.dt_bias, self.offsets), destination_indices, self.lower_bound)
