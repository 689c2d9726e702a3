"""Generic KDA recurrence: every call the T=1 fast path does not take.

Math: docs/design.md §3 (one delta-rule step per token, fp32 throughout). Contracts: docs/design.md §2, §4, §5.
The spec of every mode is :func:`kda_core.oracle.recurrent_kda_ref`; this kernel computes the same thing:

- dense [B, T] tokens, or varlen ``cu_seqlens`` [N+1] (B == 1, offsets read in the kernel and clamped there:
  sequence n owns [clamp(cu[n], 0, T), clamp(cu[n+1], that start, T)), so empty sequences are allowed and no
  offset reads or writes outside the tensors);
- state from a pool [P, HV, V, K] (bf16 or fp32, K contiguous, dim-0 stride may be padded) through 1-D slot
  indices [N] (read once, final state written back once), or through 2-D indices [N, T_idx] (spec decode: read
  slot idx[n, max(min(num_accepted_tokens[n], T_idx), 1) - 1], state stored after every token t to idx[n, t];
  a token whose slot is null is skipped: zero output, no write, the state does not absorb it);
  or dense states (initial [N, HV, V, K] of any float dtype, or zeros; final fp32 [N, HV, V, K] on request);
- a null read slot makes the sequence inactive: zero output, pool neither read nor written. Null is a compile-time
  policy (docs/design.md §4): OUT_OF_RANGE (outside [0, P)) or NONPOSITIVE (vLLM: also slot 0, which is then never
  touched; in spec mode a num_accepted_tokens outside [1, T_idx] nulls the whole row). The check is in the kernel
  against the pool's row count (no host sync; CUDA-graph safe);
- GQA (value head hv uses q/k head hv // (HV / H)), K = V in {64, 128}, the three gate forms, beta as a logit
  or not, optional in-kernel q/k L2 norm, any scale.

Work split. A CTA owns (sequence n, value head hv, tile of ``tile_v`` state rows) and 128 threads. A state row
(K channels, contiguous) belongs to ``K / 8`` lanes, 8 channels each (16 lanes for K=128, 8 for K=64), so the
CTA covers ``groups = 128 / (K / 8)`` rows per step and each thread keeps ``tile_v / groups`` rows in fp32
registers for the whole token loop: the state is read once and written once (or once per token in spec mode).
Tokens run in chunks of ``groups``: row group g prepares token g of the chunk once for the whole CTA (loads its
q, k, g, beta and the tile's v values, computes the decay, the L2 norms with sub-warp butterflies, k^.q^ and
beta) into shared memory, then every thread runs the chunk's tokens on its rows from there. Preparing a token
once per CTA instead of once per row group cut the instructions per token about in half (ncu: the per-group
preamble, 8 exps and a division per channel, dominated the old loop). The next chunk's raw inputs are loaded
into registers before the current chunk's rows are updated (latency hidden) and prepared after; two shared
buffers, one barrier per chunk.

Spec verify (docs/design.md §9; the semantics are :func:`kda_core.oracle_spec.spec_verify_ref`'s), four more
compile-time facets, off for a plain call (whose key and code they leave as they were):

- source read: the first state comes from ``initial_state_source[initial_state_indices[n]]`` (its own dtype and
  row count for the null test); the pool is only written, the final state (1-D indices, skipped for a null slot)
  or per-token checkpoints (2-D);
- frozen: no state is written. A frozen call reads one slot per row, so the host launches it as a frozen pool read:
  of the pool at the 1-D indices or at column 0 of the 2-D ones (a strided view), or of the source, which then plays
  the pool;
- records (frozen only): ``correction_cache[r, hv, t, :] = u_t`` (fp32, unrounded; lane 0 of each row group) and
  ``kg_cache[r, hv, t] = raw k | raw g`` (the CTA of V tile 0, from the raw registers the preparing row group
  loaded), r the read slot, t < T_max;
- tree (spec mode): ``parent_indices`` choose each token's start state: R_n (kept in registers, in the read
  tensor's dtype), the registers rounded through the pool dtype (parent t - 1) or the checkpoint this thread
  stored for an earlier parent; a 64-bit mask holds which tokens ran (so T_idx <= 64).

Compile-time variants: head dim, activation / g / beta dtypes, state mode (pool / spec / dense with or without
initial and final state), state dtype, num_accepted_tokens present, varlen, cu_seqlens dtype, gate form, beta
logit, L2 norm, dt_bias present, tile_v, alignment, null-slot policy, and the spec facets (source and its index
dtype, frozen, records, parents dtype). B, T, H, HV, N, the pool, source and cache rows and T_max are runtime
values.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int32, Int64, const_expr

from kda_core.call_args import RecurrentArgs, SpecArgs
from kda_core.contracts import GENERIC_HEAD_DIMS, MAX_TREE_TOKENS, GateMode, NullSlotPolicy, gate_mode
from kda_core.errors import fail
from kda_core.validation import RecurrentCall, debug_check_slots, debug_checks_enabled

from . import _lane_math, _launch
from ._lane_math import CHANNELS_PER_LANE

__all__ = [
    "GenericConfig",
    "StateMode",
    "KDARecurrent",
    "kda_recurrent_fwd",
    "run",
    "select_config",
    "variant_key",
    "compile_variant",
]

THREADS = 128
MAX_SEQUENCES = 65535  # sequences ride on grid z, whose CUDA limit this is
MAX_VALUE_HEADS = 65535  # value heads ride on grid y, the same limit


class StateMode:
    """Where the recurrent state lives (compile-time)."""

    POOL = "pool"  # 1-D slot indices into a pool: read once, final state written back in place
    SPEC = "spec"  # 2-D slot indices: one checkpoint per token (docs/design.md §5, first form)
    DENSE = "dense"  # initial_state [N, HV, V, K] or zeros; final fp32 state on request


def lanes_per_row(head_dim: int) -> int:
    return head_dim // CHANNELS_PER_LANE


def row_groups(head_dim: int) -> int:
    """State rows one CTA touches per step (128 threads, K / 8 lanes per row)."""
    return THREADS // lanes_per_row(head_dim)


MAX_ROWS_PER_THREAD = 8  # 64 fp32 registers of state; 16 rows (tile_v = 128 at K=128) would spill


def tile_v_choices(head_dim: int) -> tuple[int, ...]:
    """Legal tiles: whole row groups per thread, at most ``MAX_ROWS_PER_THREAD`` rows each."""
    groups = row_groups(head_dim)
    return tuple(t for t in (8, 16, 32, 64, 128)
                 if t % groups == 0 and t <= head_dim and t // groups <= MAX_ROWS_PER_THREAD)


@dataclass(frozen=True)
class GenericConfig:
    """Schedule of one launch: ``tile_v`` state rows per CTA (the grid is (V / tile_v, HV, N)); legal tiles are
    :func:`tile_v_choices`. The schedule policy :func:`select_config` returns one; a sweep passes its own."""

    tile_v: int


# The schedule policy: (max N*HV states, tile_v for K=128, tile_v for K=64), first row that holds the call. Small
# calls want many CTAs (each latency-bound: one load round trip per chunk of tokens), large calls more rows per
# thread (each token's prepared vectors, read from shared memory, then serve more rows); tile 8 never won.
# Measured on the H200, 2026-11-29, by the spec-decode tile sweep that benchmarks/bench_recurrent_kda.py --parts spec
# --tile-v 8 16 32 64 now runs (T=4 and 8, H=12, bf16 pool; docs/generic.md has the figures). K=64: not measured.
_SCHEDULE = (
    (48, GenericConfig(16), GenericConfig(16)),
    (96, GenericConfig(32), GenericConfig(32)),
    (1 << 62, GenericConfig(64), GenericConfig(64)),
)


def select_config(n_states: int, head_dim: int) -> GenericConfig:
    """Pure schedule policy: the config for ``n_states`` = N_seq * HV (sequence, value head) pairs."""
    for max_states, k128, k64 in _SCHEDULE:
        if n_states <= max_states:
            return k128 if head_dim == 128 else k64
    raise AssertionError("unreachable: the schedule's last row is unbounded")


# --------------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------------


class KDARecurrent(_lane_math.RowLanes):
    """Compile-time configuration of one generic-recurrence variant (quack style: init / __call__ / kernel)."""

    def __init__(
        self,
        *,
        head_dim: int,
        state_mode: str,
        state_dtype,  # cutlass type of the pool / dense initial state, or None (dense, zeros)
        store_final: bool,  # dense mode: write the fp32 final state
        has_num_accepted: bool,
        varlen: bool,
        gate: GateMode,
        beta_is_logit: bool,
        use_qk_l2norm: bool,
        has_dt_bias: bool,
        tile_v: int,
        aligned: bool,
        null_policy: NullSlotPolicy = NullSlotPolicy.OUT_OF_RANGE,
        slot_dtype=Int32,  # cutlass type of the slot indices (Int32 or Int64; compared in that width)
        nat_dtype=Int32,  # and of num_accepted_tokens
        source_dtype=None,  # spec: cutlass type of initial_state_source (the first state's read tensor), or None
        source_idx_dtype=Int32,  # and of initial_state_indices
        frozen: bool = False,  # spec: disable_state_update (pool mode only: nothing is written to any state)
        records: bool = False,  # spec: RecoverSSM records (correction_cache, kg_cache) of a frozen verify
        parents_dtype=None,  # spec: cutlass type of parent_indices (tree verify, spec mode), or None
    ):
        if head_dim not in GENERIC_HEAD_DIMS:
            raise ValueError(f"head_dim: expected one of {GENERIC_HEAD_DIMS}, got {head_dim}")
        if tile_v not in tile_v_choices(head_dim):
            raise ValueError(f"tile_v: expected one of {tile_v_choices(head_dim)} for K={head_dim}, got {tile_v}")
        # The spec facets the host entry produces (a frozen 2-D or source read is launched as a frozen pool read of
        # column 0 or of the source; see ``_spec_launch``); any other combination is a caller error of this class.
        if source_dtype is not None and (state_mode == StateMode.DENSE or frozen):
            raise ValueError("source_dtype: expected a source only with a written pool (pool or spec mode)")
        if frozen and state_mode != StateMode.POOL:
            raise ValueError(f"frozen: expected pool mode (a frozen read of one slot per row), got {state_mode}")
        if records and not frozen:
            raise ValueError("records: expected RecoverSSM records only with a frozen verify")
        if parents_dtype is not None and state_mode != StateMode.SPEC:
            raise ValueError(f"parents_dtype: expected tree parents only in spec mode, got {state_mode}")
        self.head_dim = head_dim
        self.lanes = lanes_per_row(head_dim)
        self.groups = row_groups(head_dim)
        self.state_mode = state_mode
        self.state_dtype = state_dtype
        self.store_final = store_final
        self.has_num_accepted = has_num_accepted
        self.varlen = varlen
        self.gate = gate
        self.beta_is_logit = beta_is_logit
        self.use_qk_l2norm = use_qk_l2norm
        self.has_dt_bias = has_dt_bias
        self.tile_v = tile_v
        self.aligned = aligned
        self.null_policy = null_policy
        # smallest live slot (docs/design.md §4): 0 under out_of_range, 1 under nonpositive (slot 0 never touched)
        self.first_slot = 1 if null_policy == NullSlotPolicy.NONPOSITIVE else 0
        self.slot_dtype = slot_dtype
        self.nat_dtype = nat_dtype
        self.source_dtype = source_dtype
        self.has_source = source_dtype is not None
        self.source_idx_dtype = source_idx_dtype
        self.frozen = frozen
        self.records = records
        self.parents_dtype = parents_dtype
        self.tree = parents_dtype is not None
        # the first state's tensor (the read tensor of docs/design.md §9) and the dtype of its read slot
        self.read_dtype = source_dtype if self.has_source else state_dtype
        self.read_idx_dtype = source_idx_dtype if self.has_source else slot_dtype
        self.rows = tile_v // self.groups
        self.v_per_lane = (tile_v + self.lanes - 1) // self.lanes  # v values of a token one lane prepares

    # ---- small helpers ------------------------------------------------------------------------

    @cute.jit
    def load_lane_f32(self, row: cute.Tensor, lane, dst: cute.Tensor):
        """dst (8 fp32 registers) <- the lane's 8 channels of the gmem row ``row`` [K]."""
        dtype = row.element_type
        frag = cute.make_rmem_tensor((CHANNELS_PER_LANE,), dtype)
        self.copy_lane(cute.local_tile(row, (CHANNELS_PER_LANE,), (lane,)), frag, dtype)
        dst.store(frag.load().to(Float32))

    # ---- launch ---------------------------------------------------------------------------------

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [B, T, H, K]
        mK: cute.Tensor,  # [B, T, H, K]
        mV: cute.Tensor,  # [B, T, HV, V]
        mG: cute.Tensor,  # [B, T, HV, K]
        mBeta: cute.Tensor,  # [B, T, HV]
        mALog,  # [H] fp32 or None
        mDtBias,  # [H*K] fp32 or None
        mState,  # pool [P, HV, V, K] / dense initial [N, HV, V, K] / None
        mFinal,  # dense final fp32 [N, HV, V, K] or None
        mSlots,  # [N] or [N, T_idx] int32, or None
        mNumAccepted,  # [N] int32 or None
        mCuSeqlens,  # [N + 1] int32/int64 or None
        mOut: cute.Tensor,  # [B, T, HV, V]
        mSource,  # initial_state_source [Ps, HV, V, K] or None
        mSourceIdx,  # initial_state_indices [N] int32/int64 or None
        mCorr,  # correction_cache [Pr, HV, T_max, V] fp32 or None
        mKG,  # kg_cache [Pr, HV, T_max, 2K] (k's dtype) or None
        mParents,  # parent_indices [N, T_p] int32/int64 or None
        scale: Float32,
        lower_bound: Float32,
        stream,
    ):
        HV = cute.size(mV, mode=[2])
        if const_expr(self.varlen):
            n_seq = cute.size(mCuSeqlens, mode=[0]) - 1
        else:
            n_seq = cute.size(mQ, mode=[0])
        self.kernel(
            mQ, mK, mV, mG, mBeta, mALog, mDtBias, mState, mFinal, mSlots, mNumAccepted, mCuSeqlens, mOut, mSource,
            mSourceIdx, mCorr, mKG, mParents, scale, lower_bound,
        ).launch(grid=[self.head_dim // self.tile_v, HV, n_seq], block=[THREADS, 1, 1], stream=stream)

    # ---- kernel ---------------------------------------------------------------------------------

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
        mState,
        mFinal,
        mSlots,
        mNumAccepted,
        mCuSeqlens,
        mOut: cute.Tensor,
        mSource,
        mSourceIdx,
        mCorr,
        mKG,
        mParents,
        scale: Float32,
        lower_bound: Float32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        v_tile, hv, n = cute.arch.block_idx()
        lane = tidx % self.lanes
        group = tidx // self.lanes
        row0 = v_tile * self.tile_v + group  # this thread's rows: row0 + j * groups
        H = cute.size(mQ, mode=[2])
        HV = cute.size(mV, mode=[2])
        h = hv // (HV // H)
        T_total = cute.size(mQ, mode=[1])

        # ---- where the sequence's tokens live -------------------------------------------------
        if const_expr(self.varlen):
            # Sequence n owns tokens [bos, eos): the offsets clamped to [0, T_total] and eos to >= bos, in 64 bits
            # before narrowing (an int64 offset past 2^31 clamps instead of wrapping), so no token index leaves the
            # activations or the output whatever the device data (docs/design.md §4).
            t_total64 = Int64(T_total)
            bos64 = cutlass.min(cutlass.max(Int64(mCuSeqlens[n]), Int64(0)), t_total64)
            eos64 = cutlass.min(cutlass.max(Int64(mCuSeqlens[n + 1]), bos64), t_total64)
            bos = Int32(bos64)
            seq_len = Int32(eos64 - bos64)
            b_in = Int32(0)
        else:
            bos = Int32(0)
            seq_len = T_total
            b_in = n

        # ---- which state it starts from ----------------------------------------------------------
        active = cutlass.Boolean(True)
        read_slot = Int32(0)
        final_ok = cutlass.Boolean(True)  # pool mode with a source: the final state's slot is not null
        final_slot = Int32(0)
        if const_expr(self.state_mode != StateMode.DENSE):
            n_slots = cute.size(mState, mode=[0])
            row_ok = cutlass.Boolean(True)
            if const_expr(self.has_source):
                # docs/design.md §9 (spec §1): the first state is source[initial_state_indices[n]], null under the
                # call's policy against the source's rows; the pool is only written (final state or checkpoints)
                read_slot = mSourceIdx[n]
                n_read = cute.size(mSource, mode=[0])
                if const_expr(self.state_mode == StateMode.POOL):
                    final_slot = mSlots[n]
                    final_ok = ((final_slot >= self.slot_dtype(self.first_slot))
                                & (final_slot < self.slot_dtype(n_slots)))
            else:
                n_read = n_slots
                if const_expr(self.state_mode == StateMode.POOL):
                    read_slot = mSlots[n]
                else:
                    t_idx = cute.size(mSlots, mode=[1])
                    col = Int32(0)
                    if const_expr(self.has_num_accepted):
                        # clamp first, subtract after: INT_MIN, 0 and negatives read column 0, counts past T_idx
                        # the last (an int64 count clamps in 64 bits, then narrows)
                        nat = self.nat_dtype(mNumAccepted[n])
                        col = Int32(cutlass.max(cutlass.min(nat, self.nat_dtype(t_idx)), self.nat_dtype(1)) - 1)
                        if const_expr(self.null_policy == NullSlotPolicy.NONPOSITIVE):
                            # vLLM: a count outside [1, T_idx] nulls the row
                            row_ok = (nat >= self.nat_dtype(1)) & (nat <= self.nat_dtype(t_idx))
                    read_slot = mSlots[n, col]
            # a null slot (policy, docs/design.md §4) makes the sequence inactive; compared in the indices' width, so
            # an int64 slot past 2^32 is null rather than wrapped into the pool
            active = (row_ok & (read_slot >= self.read_idx_dtype(self.first_slot))
                      & (read_slot < self.read_idx_dtype(n_read)))

        state_rows = []
        for _ in cutlass.range_constexpr(self.rows):
            r = cute.make_rmem_tensor((CHANNELS_PER_LANE,), Float32)
            r.fill(0.0)
            state_rows.append(r)
        # tree verify: the first state R_n stays in registers (in the read tensor's dtype, so exact) for every root
        # token, since the read slot may be one this row's checkpoints overwrite
        root_rows = []

        has_initial = const_expr(self.state_mode != StateMode.DENSE or self.state_dtype is not None)
        if const_expr(has_initial):
            if const_expr(self.tree):
                for _ in cutlass.range_constexpr(self.rows):
                    root_rows.append(cute.make_rmem_tensor((CHANNELS_PER_LANE,), self.read_dtype))
            if active:
                if const_expr(self.state_mode == StateMode.DENSE):
                    gState = mState[n, hv, None, None]
                elif const_expr(self.has_source):
                    gState = mSource[Int64(read_slot), hv, None, None]
                else:
                    # Int64 slot: slot * (HV*V*K) overflows 32 bits past ~4.3 GB of pool.
                    gState = mState[Int64(read_slot), hv, None, None]
                for j in cutlass.range_constexpr(self.rows):
                    frag = cute.make_rmem_tensor((CHANNELS_PER_LANE,), self.read_dtype)
                    gRow = cute.local_tile(gState[row0 + j * self.groups, None], (CHANNELS_PER_LANE,), (lane,))
                    self.copy_lane(gRow, frag, self.read_dtype, "load")
                    state_rows[j].store(frag.load().to(Float32))
                    if const_expr(self.tree):
                        root_rows[j].store(frag.load())

        # ---- RecoverSSM records (frozen verify): rows of the read slot, tokens t < T_max ----------------------
        rec_ok = cutlass.Boolean(False)
        t_max = Int32(0)
        if const_expr(self.records):
            # the read slot is bounded by the read tensor; bound it by both caches too (their rows are metadata
            # validation compares, not something this kernel assumes)
            rec_ok = (active & (read_slot < self.read_idx_dtype(cute.size(mCorr, mode=[0])))
                      & (read_slot < self.read_idx_dtype(cute.size(mKG, mode=[0]))))
            t_max = cutlass.min(Int32(cute.size(mCorr, mode=[2])), Int32(cute.size(mKG, mode=[2])))

        # ---- the token loop, in chunks of ``groups`` tokens -------------------------------------------
        # Per chunk, row group g prepares token g once for the whole CTA (decay, norms, k^.q^, beta and the
        # tile's v values, all into shared memory); then every thread runs the chunk's tokens on its rows,
        # reading those vectors back. Two buffers: the next chunk's raw inputs are loaded into registers before
        # the current chunk's rows are updated and prepared after them, so one barrier per chunk suffices.
        C = self.groups
        smem = cutlass.memory.SmemAllocator()
        def chunk_buffers(width):  # [buffer, token of the chunk, width] fp32, row-major
            layout = cute.make_layout((2, C, width), stride=(C * width, width, 1))
            return smem.allocate_tensor(Float32, layout, byte_alignment=16)

        sK, sQ, sD = chunk_buffers(self.head_dim), chunk_buffers(self.head_dim), chunk_buffers(self.head_dim)
        sV = chunk_buffers(self.tile_v)
        sKQ = smem.allocate_tensor(Float32, cute.make_layout((2, C), stride=(C, 1)), byte_alignment=16)
        sBeta = smem.allocate_tensor(Float32, cute.make_layout((2, C), stride=(C, 1)), byte_alignment=16)

        rate = Float32(0.0)
        if const_expr(self.gate != GateMode.PRECOMPUTED):
            rate = cute.math.exp(Float32(mALog[h]))

        # Raw (input dtype) registers of the token this thread's row group prepares next.
        raw_k = cute.make_rmem_tensor((CHANNELS_PER_LANE,), mK.element_type)
        raw_q = cute.make_rmem_tensor((CHANNELS_PER_LANE,), mQ.element_type)
        raw_g = cute.make_rmem_tensor((CHANNELS_PER_LANE,), mG.element_type)
        raw_v = cute.make_rmem_tensor((self.v_per_lane,), mV.element_type)
        raw_beta = cute.make_rmem_tensor((1,), mBeta.element_type)
        v_tile0 = v_tile * self.tile_v

        n_chunks = (seq_len + C - 1) // C
        if seq_len > 0:
            self.load_chunk_token(mQ, mK, mV, mG, mBeta, b_in, bos, seq_len, h, hv, v_tile0, group, lane,
                                  raw_q, raw_k, raw_v, raw_g, raw_beta)
            if const_expr(self.records):
                self.record_kg(mKG, rec_ok, v_tile, read_slot, hv, Int32(0), seq_len, t_max, group, lane, raw_k,
                               raw_g)
            self.prepare_chunk_token(0, seq_len, group, lane, raw_q, raw_k, raw_v, raw_g, raw_beta, mDtBias, h, rate,
                                     scale, lower_bound, sK, sQ, sD, sV, sKQ, sBeta)

        kf = cute.make_rmem_tensor((CHANNELS_PER_LANE,), Float32)
        qf = cute.make_rmem_tensor((CHANNELS_PER_LANE,), Float32)
        decay = cute.make_rmem_tensor((CHANNELS_PER_LANE,), Float32)
        v_rows = cute.make_rmem_tensor((self.rows,), Float32)
        # tree verify: bit t is set once token t ran (alive, checkpoint stored); T_idx <= 64 (host-checked), and a
        # token at or past T_idx has no write slot, so it never runs and no bit past 63 is ever needed
        alive = Int64(0)
        for ch in cutlass.range(n_chunks, unroll=1):
            cute.arch.sync_threads()
            buf = ch % 2
            first = ch * C
            left = seq_len - first  # tokens from this chunk on
            n_here = left
            if n_here > C:
                n_here = Int32(C)
            if left > C:  # load the next chunk's token while this one runs
                self.load_chunk_token(mQ, mK, mV, mG, mBeta, b_in, bos + first + C, left - C, h, hv, v_tile0,
                                      group, lane, raw_q, raw_k, raw_v, raw_g, raw_beta)
                if const_expr(self.records):
                    self.record_kg(mKG, rec_ok, v_tile, read_slot, hv, first + C, left - C, t_max, group, lane,
                                   raw_k, raw_g)
            for t in cutlass.range(n_here, unroll=1):
                tok = bos + first + t
                ti = first + t  # the token's index in its sequence
                step = active
                write_slot = self.slot_dtype(-1)
                if const_expr(self.state_mode == StateMode.SPEC):
                    if ti < cute.size(mSlots, mode=[1]):
                        write_slot = mSlots[n, ti]
                    step = (active & (write_slot >= self.slot_dtype(self.first_slot))
                            & (write_slot < self.slot_dtype(cute.size(mState, mode=[0]))))
                if const_expr(self.tree):
                    if active:
                        step = step & self.tree_start(mState, mSlots, mParents, n, hv, ti, alive, state_rows,
                                                      root_rows, row0, lane)
                rec_t = cutlass.Boolean(False)
                if const_expr(self.records):
                    rec_t = rec_ok & (ti < t_max)
                if step:
                    cute.autovec_copy(cute.local_tile(sK[buf, t, None], (CHANNELS_PER_LANE,), (lane,)), kf)
                    cute.autovec_copy(cute.local_tile(sQ[buf, t, None], (CHANNELS_PER_LANE,), (lane,)), qf)
                    cute.autovec_copy(cute.local_tile(sD[buf, t, None], (CHANNELS_PER_LANE,), (lane,)), decay)
                    cute.autovec_copy(cute.local_tile(sV[buf, t, None], (self.rows,), (group,)), v_rows)
                    beta = sBeta[buf, t]
                    kq = sKQ[buf, t]
                    # rows: S' = a S; p = S'k^; u = b (v - p); S_new = S' + u k^; o = S'q^ + u (k^.q^)
                    for j in cutlass.range_constexpr(self.rows):
                        sf = state_rows[j]
                        p = Float32(0.0)
                        sq = Float32(0.0)
                        for c in cutlass.range_constexpr(CHANNELS_PER_LANE):
                            sf[c] = sf[c] * decay[c]
                            p = p + sf[c] * kf[c]
                            sq = sq + sf[c] * qf[c]
                        p = self.row_sum(p)
                        sq = self.row_sum(sq)
                        u = beta * (v_rows[j] - p)
                        for c in cutlass.range_constexpr(CHANNELS_PER_LANE):
                            sf[c] = sf[c] + u * kf[c]
                        if lane == 0:
                            mOut[b_in, tok, hv, row0 + j * self.groups] = (sq + u * kq).to(mOut.element_type)
                            if const_expr(self.records):
                                if rec_t:  # u_t, fp32 and unrounded (spec §3)
                                    mCorr[Int64(read_slot), hv, ti, row0 + j * self.groups] = u
                    if const_expr(self.state_mode == StateMode.SPEC):
                        self.store_rows(mState[Int64(write_slot), hv, None, None], state_rows, row0, lane)
                    if const_expr(self.tree):
                        alive = alive | (Int64(1) << Int64(ti))
                else:
                    if lane == 0:
                        for j in cutlass.range_constexpr(self.rows):
                            mOut[b_in, tok, hv, row0 + j * self.groups] = Float32(0.0).to(mOut.element_type)
            if left > C:
                self.prepare_chunk_token(1 - buf, left - C, group, lane, raw_q, raw_k, raw_v, raw_g, raw_beta,
                                         mDtBias, h, rate, scale, lower_bound, sK, sQ, sD, sV, sKQ, sBeta)

        # ---- final state ------------------------------------------------------------------------------
        if const_expr(self.state_mode == StateMode.POOL and not self.frozen):
            if const_expr(self.has_source):
                # the final state goes to the pool slot of the row when that slot is not null (outputs regardless)
                if active & final_ok:
                    self.store_rows(mState[Int64(final_slot), hv, None, None], state_rows, row0, lane)
            else:
                if active:
                    self.store_rows(mState[Int64(read_slot), hv, None, None], state_rows, row0, lane)
        if const_expr(self.state_mode == StateMode.DENSE and self.store_final):
            self.store_rows(mFinal[n, hv, None, None], state_rows, row0, lane)

        # ---- varlen: tokens before the first sequence's clamped start and from the last one's clamped end get
        # a zero output (as the reference); both ranges lie in [0, T_total) -----------------------------------
        if const_expr(self.varlen):
            if n == 0:
                for t in cutlass.range(bos, unroll=1):
                    self.zero_out(mOut, t, hv, row0, lane)
            n_seq = cute.size(mCuSeqlens, mode=[0]) - 1
            if n == n_seq - 1:
                for t in cutlass.range(bos + seq_len, T_total, 1, unroll=1):
                    self.zero_out(mOut, t, hv, row0, lane)

    @cute.jit
    def tree_start(self, mState, mSlots, mParents, n, hv, ti, alive, state_rows, root_rows, row0, lane):
        """Tree verify (spec §4): set the thread's rows to token ``ti``'s start state and return whether it has one.

        Parent p = parent_indices[n, ti] (ti < T_p), else ti - 1. A root (p < 0 or p >= ti, malformed values
        included) starts from R_n (the registers kept at the start); otherwise the token starts from the state
        stored for token p, and has none (it is dead) unless token p ran. For p == ti - 1 the registers hold that
        state unrounded: rounded through the pool dtype they equal a re-read bitwise; any other p re-reads the
        checkpoint this same thread stored (same addresses, program order: a plain load, not the read-only path).
        CTA-uniform (depends on n and ti only)."""
        pdt = self.parents_dtype
        p = pdt(ti) - pdt(1)
        if ti < cute.size(mParents, mode=[1]):
            p = pdt(mParents[n, ti])
        ok = cutlass.Boolean(True)
        if (p < pdt(0)) | (p >= pdt(ti)):
            for j in cutlass.range_constexpr(self.rows):
                state_rows[j].store(root_rows[j].load().to(Float32))
        else:
            p32 = Int32(p)  # in [0, ti): narrowing is exact
            ok = p32 < cute.size(mSlots, mode=[1])  # a token at or past T_idx never ran
            if ok:
                ok = ((alive >> Int64(p32)) & Int64(1)) != Int64(0)
            if ok:
                if p32 == ti - 1:
                    if const_expr(self.state_dtype != Float32):
                        for j in cutlass.range_constexpr(self.rows):
                            state_rows[j].store(state_rows[j].load().to(self.state_dtype).to(Float32))
                else:
                    gState = mState[Int64(mSlots[n, p32]), hv, None, None]
                    frag = cute.make_rmem_tensor((CHANNELS_PER_LANE,), self.state_dtype)
                    for j in cutlass.range_constexpr(self.rows):
                        gRow = cute.local_tile(gState[row0 + j * self.groups, None], (CHANNELS_PER_LANE,), (lane,))
                        self.copy_lane(gRow, frag, self.state_dtype)
                        state_rows[j].store(frag.load().to(Float32))
        return ok

    @cute.jit
    def record_kg(self, mKG, rec_ok, v_tile, slot, hv, rel0, n_left, t_max, group, lane, raw_k, raw_g):
        """kg_cache[slot, hv, rel0 + group] <- raw k | raw g of this row group's token (the registers just
        loaded), by the CTA of V tile 0, for a token of the sequence (group < n_left) below T_max."""
        if rec_ok & (v_tile == 0) & (group < n_left) & (rel0 + group < t_max):
            gRow = mKG[Int64(slot), hv, rel0 + group, None]
            dtype = mKG.element_type
            self.copy_lane(raw_k, cute.local_tile(gRow, (CHANNELS_PER_LANE,), (lane,)), dtype, "store")
            self.copy_lane(raw_g, cute.local_tile(gRow, (CHANNELS_PER_LANE,), (self.lanes + lane,)), dtype, "store")

    @cute.jit
    def load_chunk_token(self, mQ, mK, mV, mG, mBeta, b_in, tok0, n_left, h, hv, v_tile0, group, lane, dq, dk, dv,
                         dg, dbeta):
        """Raw registers <- token ``tok0 + group`` (this row group's token of the chunk): the lane's k, q, g
        channels, v of the tile rows ``lane + e * lanes``, beta. Zeros past the sequence's end (the prepare step
        still runs there, so that every lane of a warp reaches its shuffles)."""
        if group < n_left:
            tok = tok0 + group
            self.copy_lane(cute.local_tile(mK[b_in, tok, h, None], (CHANNELS_PER_LANE,), (lane,)), dk,
                           mK.element_type)
            self.copy_lane(cute.local_tile(mQ[b_in, tok, h, None], (CHANNELS_PER_LANE,), (lane,)), dq,
                           mQ.element_type)
            self.copy_lane(cute.local_tile(mG[b_in, tok, hv, None], (CHANNELS_PER_LANE,), (lane,)), dg,
                           mG.element_type)
            for e in cutlass.range_constexpr(self.v_per_lane):
                r = lane + e * self.lanes
                if const_expr(self.tile_v % self.lanes == 0):
                    dv[e] = mV[b_in, tok, hv, v_tile0 + r]
                else:
                    if r < self.tile_v:
                        dv[e] = mV[b_in, tok, hv, v_tile0 + r]
            dbeta[0] = mBeta[b_in, tok, hv]
        else:
            dk.fill(0.0)
            dq.fill(0.0)
            dg.fill(0.0)
            dv.fill(0.0)
            dbeta.fill(0.0)

    @cute.jit
    def prepare_chunk_token(self, buf, n_left, group, lane, rq, rk, rv, rg, rbeta, mDtBias, h, rate, scale,
                            lower_bound, sK, sQ, sD, sV, sKQ, sBeta):
        """Shared memory [buf, group] <- the prepared vectors of this row group's token: decay a = exp(g_log)
        (docs/design.md §3 steps 1-3), k^ and scale * q^ (step 5), k^.q^, beta, and the tile's v values, stored at
        ``group' * rows + j`` for tile row ``group' + j * groups`` (each thread then reads its rows contiguously).
        Runs in every row group, also past the sequence's end (warp-uniform shuffles); only real tokens store."""
        kf = cute.make_rmem_tensor((CHANNELS_PER_LANE,), Float32)
        qf = cute.make_rmem_tensor((CHANNELS_PER_LANE,), Float32)
        decay = cute.make_rmem_tensor((CHANNELS_PER_LANE,), Float32)
        gf = cute.make_rmem_tensor((CHANNELS_PER_LANE,), Float32)
        vf = cute.make_rmem_tensor((self.v_per_lane,), Float32)
        kf.store(rk.load().to(Float32))
        qf.store(rq.load().to(Float32))
        gf.store(rg.load().to(Float32))
        vf.store(rv.load().to(Float32))
        bias = cute.make_rmem_tensor((CHANNELS_PER_LANE,), Float32)
        if const_expr(self.gate != GateMode.PRECOMPUTED and self.has_dt_bias):
            # dt_bias is re-read per chunk (an L1/L2 hit) rather than held in 8 registers across the token loop
            self.load_lane_f32(cute.local_tile(mDtBias, (self.head_dim,), (h,)), lane, bias)
        _lane_math.gate_decay(decay, gf, bias, rate, lower_bound, self.gate, self.has_dt_bias)
        beta = Float32(rbeta[0])
        if const_expr(self.beta_is_logit):
            beta = 1.0 / (1.0 + cute.math.exp(-beta))
        kq = _lane_math.normalize_qk(kf, qf, scale, self.use_qk_l2norm, self.row_sum)
        if group < n_left:
            cute.autovec_copy(kf, cute.local_tile(sK[buf, group, None], (CHANNELS_PER_LANE,), (lane,)))
            cute.autovec_copy(qf, cute.local_tile(sQ[buf, group, None], (CHANNELS_PER_LANE,), (lane,)))
            cute.autovec_copy(decay, cute.local_tile(sD[buf, group, None], (CHANNELS_PER_LANE,), (lane,)))
            for e in cutlass.range_constexpr(self.v_per_lane):
                r = lane + e * self.lanes
                if const_expr(self.tile_v % self.lanes == 0):
                    sV[buf, group, (r % self.groups) * self.rows + r // self.groups] = vf[e]
                else:
                    if r < self.tile_v:
                        sV[buf, group, (r % self.groups) * self.rows + r // self.groups] = vf[e]
            if lane == 0:
                sKQ[buf, group] = kq
                sBeta[buf, group] = beta

    @cute.jit
    def zero_out(self, mOut: cute.Tensor, tok, hv, row0, lane):
        if lane == 0:
            for j in cutlass.range_constexpr(self.rows):
                mOut[0, tok, hv, row0 + j * self.groups] = Float32(0.0).to(mOut.element_type)

    @cute.jit
    def store_rows(self, gState: cute.Tensor, state_rows, row0, lane):
        """Store the thread's fp32 rows into gState [V, K], rounded once to its dtype."""
        dtype = gState.element_type
        frag = cute.make_rmem_tensor((CHANNELS_PER_LANE,), dtype)
        for j in cutlass.range_constexpr(self.rows):
            frag.store(state_rows[j].load().to(dtype))
            gRow = cute.local_tile(gState[row0 + j * self.groups, None], (CHANNELS_PER_LANE,), (lane,))
            self.copy_lane(frag, gRow, dtype, "store")


# --------------------------------------------------------------------------------------------------
# Host side: compile cache and the entry points. ``run(call, args)`` launches a call kda-core validated
# (kda_recurrent's facade: ``validate_recurrent(args)`` gives ``call``); ``kda_recurrent_fwd`` takes the same
# arguments by keyword, unvalidated (tests, benchmarks, the engines' layouts kda-core's validation does not take
# yet), and reads the facts a description would give from the tensors. Both read metadata only and never sync.
# --------------------------------------------------------------------------------------------------


def variant_key(
    *,
    head_dim: int,
    act_dtype: torch.dtype,
    g_dtype: torch.dtype,
    beta_dtype: torch.dtype,
    state_mode: str,
    state_dtype: torch.dtype | None,
    store_final: bool,
    has_num_accepted: bool,
    varlen: bool,
    cu_dtype: torch.dtype | None,
    gate: GateMode,
    beta_is_logit: bool,
    use_qk_l2norm: bool,
    has_dt_bias: bool,
    tile_v: int,
    aligned: bool,
    null_policy: NullSlotPolicy = NullSlotPolicy.OUT_OF_RANGE,
    slot_dtype: torch.dtype | None = torch.int32,
    nat_dtype: torch.dtype | None = torch.int32,
    source_dtype: torch.dtype | None = None,
    source_idx_dtype: torch.dtype | None = None,
    frozen: bool = False,
    records: bool = False,
    parents_dtype: torch.dtype | None = None,
) -> tuple:
    """Every code-generation parameter of one variant, in the order ``_compile`` reads them (arch added by
    ``_launch.get_or_compile``). Facts that cannot change the code are normalised so they share one entry.

    The spec-verify facets (``source_dtype`` / ``source_idx_dtype``: the first state from
    ``initial_state_source``; ``frozen``; ``records``; ``parents_dtype``: tree parents) extend the key only when one
    is on, so a plain call's key is the one it had before they existed."""
    if gate == GateMode.PRECOMPUTED:
        has_dt_bias = False
    if state_mode != StateMode.DENSE:
        store_final = False  # the pool is the final state
    if state_mode != StateMode.SPEC:
        has_num_accepted = False
    if not has_num_accepted:
        nat_dtype = None
    if not varlen:
        cu_dtype = None
    if state_mode == StateMode.DENSE:
        null_policy = NullSlotPolicy.OUT_OF_RANGE  # no slot to be null
        slot_dtype = None
    base = (
        "recurrent", int(head_dim), act_dtype, g_dtype, beta_dtype, state_mode, state_dtype, bool(store_final),
        bool(has_num_accepted), bool(varlen), cu_dtype, gate, bool(beta_is_logit), bool(use_qk_l2norm),
        bool(has_dt_bias), int(tile_v), bool(aligned), NullSlotPolicy(null_policy), slot_dtype, nat_dtype,
    )
    if source_dtype is None:
        source_idx_dtype = None
    elif source_idx_dtype is None:
        source_idx_dtype = torch.int32
    spec = (source_dtype, source_idx_dtype, bool(frozen), bool(records), parents_dtype)
    if spec == (None, None, False, False, None):
        return base
    return (*base, "spec-verify", *spec)


_PLAIN_KEY_LEN = 20


def _compile(key: tuple, arch: str, extra_options: str = ""):
    (_, K, act_dt, g_dt, beta_dt, state_mode, state_dt, store_final, has_nat, varlen, cu_dt, gate, beta_is_logit,
     l2norm, has_dt_bias, tile_v, aligned, null_policy, slot_dt, nat_dt) = key[:_PLAIN_KEY_LEN]
    source_dt, source_idx_dt, frozen, records, parents_dt = (
        key[_PLAIN_KEY_LEN + 1:] if len(key) > _PLAIN_KEY_LEN else (None, None, False, False, None))
    cdt = _launch.cutlass_dtype
    align = _launch.VECTOR_BYTES if aligned else 1
    sym = _launch.sym_size
    B, T, H, HV = sym(), sym(), sym(), sym()
    head_elems = K * K

    def act(dtype, heads):
        return _launch.fake_tensor(cdt(dtype), (B, T, heads, K), (None, None, None, 1), align_bytes=align)

    def states(dtype, rows):
        return _launch.fake_tensor(cdt(dtype), (rows, HV, K, K), (None, head_elems, K, 1), align_bytes=align)

    n_seq = sym()
    m_state = m_final = m_slots = m_nat = m_cu = m_alog = m_dt_bias = None
    if state_mode == StateMode.DENSE:
        if state_dt is not None:
            m_state = states(state_dt, n_seq)
        if store_final:
            m_final = states(torch.float32, n_seq)
    else:
        m_state = states(state_dt, sym())
        # index tensors: any strides (a view of a wider table), int32 or int64
        if state_mode == StateMode.POOL:
            m_slots = _launch.fake_tensor(cdt(slot_dt), (n_seq,), (None,), align_bytes=1)
        else:
            m_slots = _launch.fake_tensor(cdt(slot_dt), (n_seq, sym()), (None, None), align_bytes=1)
            if has_nat:
                m_nat = _launch.fake_tensor(cdt(nat_dt), (n_seq,), (None,), align_bytes=1)
    if varlen:
        m_cu = _launch.fake_tensor(cdt(cu_dt), (sym(),), (None,), align_bytes=1)
    if gate != GateMode.PRECOMPUTED:
        m_alog = _launch.fake_tensor(cutlass.Float32, (H,), (None,), align_bytes=1)
        if has_dt_bias:
            m_dt_bias = _launch.fake_tensor(cutlass.Float32, (sym(),), (1,), align_bytes=align)
    m_source = m_source_idx = m_corr = m_kg = m_parents = None
    if source_dt is not None:
        m_source = states(source_dt, sym())
        m_source_idx = _launch.fake_tensor(cdt(source_idx_dt), (n_seq,), (None,), align_bytes=1)
    if records:
        # last dim contiguous, every other stride free (vLLM interleaves pages); u is stored per element
        m_corr = _launch.fake_tensor(cutlass.Float32, (sym(), HV, sym(), K), (None, None, None, 1), align_bytes=1)
        m_kg = _launch.fake_tensor(cdt(act_dt), (sym(), HV, sym(), 2 * K), (None, None, None, 1), align_bytes=align)
    if parents_dt is not None:
        m_parents = _launch.fake_tensor(cdt(parents_dt), (n_seq, sym()), (None, None), align_bytes=1)
    kernel = KDARecurrent(
        head_dim=K, state_mode=state_mode, state_dtype=None if state_dt is None else cdt(state_dt),
        store_final=store_final, has_num_accepted=has_nat, varlen=varlen, gate=gate, beta_is_logit=beta_is_logit,
        use_qk_l2norm=l2norm, has_dt_bias=has_dt_bias, tile_v=tile_v, aligned=aligned, null_policy=null_policy,
        slot_dtype=Int32 if slot_dt is None else cdt(slot_dt), nat_dtype=Int32 if nat_dt is None else cdt(nat_dt),
        source_dtype=None if source_dt is None else cdt(source_dt),
        source_idx_dtype=Int32 if source_idx_dt is None else cdt(source_idx_dt), frozen=frozen, records=records,
        parents_dtype=None if parents_dt is None else cdt(parents_dt),
    )
    return cute.compile(
        kernel,
        act(act_dt, H), act(act_dt, H), act(act_dt, HV), act(g_dt, HV),
        _launch.fake_tensor(cdt(beta_dt), (B, T, HV), (None, None, None), align_bytes=1),
        m_alog, m_dt_bias, m_state, m_final, m_slots, m_nat, m_cu,
        act(torch.bfloat16, HV), m_source, m_source_idx, m_corr, m_kg, m_parents,
        cutlass.Float32(1.0), cutlass.Float32(-1.0), _launch.fake_stream(),
        options=_launch.compile_options(arch, extra_options),
    )


def compile_variant(key: tuple, arch: str, extra_options: str = ""):
    """Compile one variant outside the cache (CI compile checks, PTX dumps: ``extra_options`` e.g.
    ``"--keep-ptx --dump-dir D"``)."""
    return _compile(key, arch, extra_options)


def _compact_states(t: torch.Tensor) -> torch.Tensor:
    """Dense initial states need compact inner dims [HV, V, K]; copy the rare strided view (not a pool)."""
    _, V, K = t.shape[1:]
    if tuple(t.stride()[1:]) == (V * K, K, 1):
        return t
    return t.contiguous()


def kda_recurrent_fwd(
    q,
    k,
    v,
    g,
    beta,
    *,
    A_log=None,
    dt_bias=None,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=True,
    use_gate_in_kernel=False,
    lower_bound=None,
    beta_is_logit=False,
    cu_seqlens=None,
    ssm_state_indices=None,
    num_accepted_tokens=None,
    output=None,
    initial_state_source=None,
    initial_state_indices=None,
    disable_state_update=False,
    correction_cache=None,
    kg_cache=None,
    parent_indices=None,
    config: GenericConfig | None = None,
    null_policy: NullSlotPolicy = NullSlotPolicy.OUT_OF_RANGE,
):
    """The KDA recurrence over T tokens per sequence on the GPU; same semantics as
    :func:`kda_core.oracle.recurrent_kda_ref` (its docstring is the spec) and, with a spec-verify keyword, as
    :func:`kda_core.oracle_spec.spec_verify_ref`. Arguments are not validated here (the facade validates, then calls
    :func:`run`); the head dim, the grid limits, ``config``, ``null_policy`` and the combinations of the spec
    keywords this kernel takes are.

    Args (B batch, T tokens, H q/k heads, HV value heads, K = V in {64, 128}, N sequences, P pool rows):
        q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K]; beta: [B, T, HV]. bf16/fp16/fp32, last dim
            contiguous, other strides free.
        A_log: [H] fp32, dt_bias: [H*K] or [H, K] fp32 (optional), lower_bound: float < 0 or None; used when
            ``use_gate_in_kernel`` (else g is the log-space decay).
        initial_state: the pool [P, HV, V, K] (bf16/fp32, updated in place; inner dims compact, the slot stride any
            number of elements >= HV*V*K: one that is not a 16-byte multiple takes the unaligned variant) with
            ``ssm_state_indices``; else a dense [N, HV, V, K] initial state or None (zeros).
        ssm_state_indices: [N] (pool) or [N, T] (spec decode, one checkpoint per token), int32 or int64, any
            strides (e.g. a column or a row slice of a wider table); num_accepted_tokens: [N] int32 or int64, any
            stride (spec decode only). Values are read and bounded in the kernel.
        cu_seqlens: [N + 1] int32/int64 with B == 1 (varlen); values are read in the kernel.
        output: [B, T, HV, V] bf16 or None (allocated).
        initial_state_source, initial_state_indices, disable_state_update, correction_cache, kg_cache,
            parent_indices: the spec-verify keywords (:class:`kda_core.call_args.SpecArgs`; docs/generic.md, "Spec
            verify", says what each does here).
        config: the launch schedule (:class:`GenericConfig`); None takes :func:`select_config`'s for the call.
        null_policy: which slot indices are null (docs/design.md §4): ``OUT_OF_RANGE`` (idx < 0 or idx >= P) or
            ``NONPOSITIVE`` (vLLM: idx <= 0 or idx >= P; slot 0 is never read or written, and in spec decode a
            ``num_accepted_tokens`` outside [1, T_idx] makes the whole row null).

    Returns (o [B, T, HV, V] bf16, final_state): the pool in pool/spec modes (``initial_state`` as given, also
    when frozen, so None for a frozen read of a source), the fp32 dense state [N, HV, V, K] when
    ``output_final_state`` in dense mode, else None.

    Duplicate active slots in one call are a caller error (CTAs would race on one state). No host sync; no
    allocation when ``output`` is given (and no final state is requested).

    Example::

        o, pool = kda_recurrent_fwd(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0,
                                    use_gate_in_kernel=True, initial_state=pool, ssm_state_indices=slots2d,
                                    num_accepted_tokens=accepted)
    """
    args = RecurrentArgs(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
                         use_qk_l2norm_in_kernel, use_gate_in_kernel, lower_bound, beta_is_logit, cu_seqlens,
                         ssm_state_indices, num_accepted_tokens, output)
    spec = SpecArgs(initial_state_source, initial_state_indices, disable_state_update, correction_cache, kg_cache,
                    parent_indices)
    K = q.shape[3]
    if K not in GENERIC_HEAD_DIMS:
        fail("q", f"a head dim K in {GENERIC_HEAD_DIMS}", K)
    n_seq = cu_seqlens.shape[0] - 1 if cu_seqlens is not None else q.shape[0]
    if n_seq < 0:
        fail("cu_seqlens", "a 1-D tensor [N_seq + 1] of sequence offsets", tuple(cu_seqlens.shape))
    if ssm_state_indices is None:
        state_mode = StateMode.DENSE
    elif ssm_state_indices.dim() == 1:
        state_mode = StateMode.POOL
    else:
        state_mode = StateMode.SPEC
    gate = gate_mode(use_gate_in_kernel, lower_bound)
    return _launch_call(args, spec, state_mode, n_seq, v.shape[2], K, gate,
                        K**-0.5 if scale is None else float(scale),
                        lower_bound if gate == GateMode.LOWER_BOUND else None, config, null_policy)


def run(call: RecurrentCall, args: RecurrentArgs, spec: SpecArgs | None = None, *,
        config: GenericConfig | None = None, null_policy: NullSlotPolicy = NullSlotPolicy.OUT_OF_RANGE):
    """Launch a validated call: ``call`` is kda-core's description (``validate_recurrent(args)``, or
    ``validate_spec(args, spec)``) of exactly the bundled arguments ``args``
    (:class:`kda_core.call_args.RecurrentArgs`) and ``spec`` (:class:`kda_core.call_args.SpecArgs`; None or
    ``SpecArgs()`` is a plain call). Returns what :func:`kda_recurrent_fwd` returns; ``config`` and ``null_policy``
    as there.

    The sequence and head counts, head dim, gate form, scale and lower bound come from the description; the state
    mode too (``call.mode`` is a :class:`StateMode` value) for a plain call, while a spec call's kernel mode follows
    from the tensors the bundles carry (``_spec_plan``); the tensors come from the bundles.
    """
    return _launch_call(args, spec, call.mode, call.N_seq, call.HV, call.K, call.gate_mode, call.scale,
                        call.lower_bound, config, null_policy)


def _is_plain(spec: SpecArgs | None) -> bool:
    return spec is None or (spec.initial_state_source is None and spec.initial_state_indices is None
                            and not spec.disable_state_update and spec.correction_cache is None
                            and spec.kg_cache is None and spec.parent_indices is None)


@dataclass(frozen=True)
class _Plan:
    """What one spec call launches: the kernel's state mode and facets, and the tensors in the kernel's places."""

    state_mode: str
    pool: torch.Tensor | None  # mState: the pool written (or, frozen, the read tensor)
    slots: torch.Tensor | None  # mSlots
    source: torch.Tensor | None
    source_idx: torch.Tensor | None
    frozen: bool
    corr: torch.Tensor | None
    kg: torch.Tensor | None
    parents: torch.Tensor | None
    written: tuple  # (the slot indices whose slots are written, their argument's name): the duplicate check
    returned: torch.Tensor | None  # the final state returned


def _spec_plan(args: RecurrentArgs, spec: SpecArgs) -> _Plan:
    """Map a spec call (docs/design.md §9; the team's spec-decode contracts §1-§4) onto the kernel's facets, and
    refuse, naming the argument, the combinations it does not take (the facade's ``validate_spec`` refuses them
    first, with the same rules).

    A frozen verify writes no state, so its read is a frozen pool read of one slot per row: of the source at
    ``initial_state_indices`` when given (the source plays the pool), else of the pool at ``ssm_state_indices``
    (1-D) or its column 0 (2-D, a strided view: no copy). Otherwise the source facet reads the first state from the
    source and the pool is only written: the final state with 1-D indices, per-token checkpoints with 2-D ones."""
    (source, source_idx, frozen, corr, kg, parents) = spec
    pool, slots, nat = args.initial_state, args.ssm_state_indices, args.num_accepted_tokens
    if (corr is None) != (kg is None):
        fail("kg_cache" if kg is None else "correction_cache",
             "correction_cache and kg_cache together (both or neither)", "only one of them")
    if (source is None) != (source_idx is None):
        fail("initial_state_indices" if source_idx is None else "initial_state_source",
             "initial_state_source and initial_state_indices together", "only one of them")
    if source is not None and source_idx.dim() != 1:
        fail("initial_state_indices", "a 1-D tensor [N_seq] of source slots", tuple(source_idx.shape))
    if source is not None and nat is not None:
        fail("num_accepted_tokens", "None with initial_state_source (the source slot is the read slot)",
             "a tensor")
    if frozen:
        if nat is not None:
            fail("num_accepted_tokens", "None with disable_state_update=True", "a tensor")
        if args.output_final_state:
            fail("output_final_state", "False with disable_state_update=True (no state is written)", True)
        if parents is not None:
            fail("parent_indices", "None with disable_state_update=True (tree states are stored per token)",
                 "a tensor")
        if source is not None:
            if pool is not None or slots is not None:
                fail("initial_state" if pool is not None else "ssm_state_indices",
                     "None with disable_state_update=True and initial_state_source (nothing writes the pool)",
                     "a tensor")
            read, read_slots = source, source_idx
        else:
            if pool is None or slots is None:
                fail("initial_state" if pool is None else "ssm_state_indices",
                     "the pool and its slot indices with disable_state_update=True and no initial_state_source",
                     None)
            if slots.dim() == 2 and slots.shape[1] == 0:
                # no column to read: every row is inactive (the oracle's -1); a stride-0 view of one null slot
                read_slots = torch.full((1,), -1, dtype=slots.dtype, device=slots.device).expand(slots.shape[0])
            else:
                read_slots = slots if slots.dim() == 1 else slots[:, 0]
            read = pool
        # only the records are written: their rows are the read slots
        name = "initial_state_indices" if source is not None else "ssm_state_indices"
        return _Plan(StateMode.POOL, read, read_slots, None, None, True, corr, kg, None,
                     (read_slots if corr is not None else None, name), pool)
    if corr is not None:
        fail("correction_cache", "None unless disable_state_update=True (records belong to a frozen verify)",
             "a tensor")
    if pool is None or slots is None:
        fail("initial_state" if pool is None else "ssm_state_indices",
             "the pool and its slot indices (the states written)", None)
    if pool.dim() != 4:
        fail("initial_state", "a pool [P, HV, V, K]", tuple(pool.shape))
    mode = StateMode.POOL if slots.dim() == 1 else StateMode.SPEC
    if parents is not None:
        if mode != StateMode.SPEC:
            fail("ssm_state_indices", "2-D [N_seq, T_idx] indices with parent_indices (one state per token)",
                 tuple(slots.shape))
        if parents.dim() != 2:
            fail("parent_indices", "a 2-D tensor [N_seq, T_p] of parent tokens", tuple(parents.shape))
        if slots.shape[1] > MAX_TREE_TOKENS:
            fail("ssm_state_indices", f"at most {MAX_TREE_TOKENS} columns with parent_indices", slots.shape[1])
    return _Plan(mode, pool, slots, source, source_idx, False, None, None, parents, (slots, "ssm_state_indices"),
                 pool)


def _launch_call(args: RecurrentArgs, spec: SpecArgs | None, state_mode: str, n_seq: int, HV: int, K: int,
                 gate: GateMode, scale: float, lower_bound: float | None, config: GenericConfig | None,
                 null_policy: NullSlotPolicy):
    """The one launch body of both entries: the call's tensors, and the facts of its description (``lower_bound``
    None unless the gate is the lower-bound one)."""
    (q, k, v, g, beta, A_log, dt_bias, _, initial_state, output_final_state, use_qk_l2norm_in_kernel, _, _,
     beta_is_logit, cu_seqlens, ssm_state_indices, num_accepted_tokens, output) = args
    B, T = q.shape[0], q.shape[1]
    varlen = cu_seqlens is not None
    if config is not None and (not isinstance(config, GenericConfig) or config.tile_v not in tile_v_choices(K)):
        fail("config", f"a GenericConfig whose tile_v is one of {tile_v_choices(K)} for K={K}", config)
    if not isinstance(null_policy, NullSlotPolicy):
        fail("null_policy", "a kda_core.contracts.NullSlotPolicy", null_policy)
    if n_seq > MAX_SEQUENCES:
        fail("q" if not varlen else "cu_seqlens", f"at most {MAX_SEQUENCES} sequences per call (grid z limit)", n_seq)
    if HV > MAX_VALUE_HEADS:
        fail("v", f"at most {MAX_VALUE_HEADS} value heads (dim 2) per call (grid y limit)", HV)

    plan = None
    if not _is_plain(spec):
        plan = _spec_plan(args, spec)
        state_mode, initial_state, ssm_state_indices = plan.state_mode, plan.pool, plan.slots
        if plan.kg is not None and not (plan.kg.dtype == k.dtype == g.dtype):
            fail("kg_cache", f"k's dtype with g of that dtype too (raw k | raw g), k {k.dtype} and g {g.dtype}",
                 plan.kg.dtype)

    if output is None:
        output = torch.empty((B, T, HV, K), dtype=torch.bfloat16, device=q.device)

    final_state = None
    if state_mode == StateMode.DENSE:
        if initial_state is not None:
            initial_state = _compact_states(initial_state)
        if output_final_state:
            final_state = torch.empty((n_seq, HV, K, K), dtype=torch.float32, device=q.device)
    else:
        final_state = initial_state if plan is None else plan.returned

    if state_mode != StateMode.DENSE and debug_checks_enabled():
        # the slots this call writes (a frozen verify's records are rows of its read slots; a frozen read without
        # records writes nothing, and repeated read slots, such as padding clamped to one slot, are legal there)
        written, name = (ssm_state_indices, "ssm_state_indices") if plan is None else plan.written
        if written is not None:
            debug_check_slots(written, initial_state.shape[0], argument=name, null_policy=null_policy)

    no_column = state_mode == StateMode.SPEC and ssm_state_indices.shape[1] == 0
    if n_seq == 0 or T == 0 or HV == 0 or no_column:
        # Nothing to launch (a grid dimension would be 0): no token or no head, so no output value and no state
        # change. 2-D indices without a column: no row has a read slot or a token a write slot (the oracle's
        # inactive rows), so the outputs are zero and nothing is written; the kernel never reads that table.
        output.zero_()
        if final_state is not None and state_mode == StateMode.DENSE:
            if initial_state is None:
                final_state.zero_()
            else:
                final_state.copy_(initial_state)
        return output, final_state

    if gate == GateMode.PRECOMPUTED:
        A_log = dt_bias = None
    else:
        A_log = A_log.reshape(-1)
        if dt_bias is not None:
            dt_bias = dt_bias.reshape(-1)
    source = source_idx = corr = kg = parents = None
    frozen = False
    if plan is not None:
        source, source_idx, corr, kg, parents, frozen = (plan.source, plan.source_idx, plan.corr, plan.kg,
                                                         plan.parents, plan.frozen)
    aligned = _launch.alignment_of(q, k, v, g, initial_state, final_state if state_mode == StateMode.DENSE else None,
                                   output, dt_bias, source, kg) == _launch.VECTOR_BYTES
    cfg = select_config(n_seq * HV, K) if config is None else config
    key = variant_key(
        head_dim=K, act_dtype=q.dtype, g_dtype=g.dtype, beta_dtype=beta.dtype, state_mode=state_mode,
        state_dtype=None if initial_state is None else initial_state.dtype, store_final=final_state is not None,
        has_num_accepted=num_accepted_tokens is not None, varlen=varlen,
        cu_dtype=None if cu_seqlens is None else cu_seqlens.dtype, gate=gate, beta_is_logit=beta_is_logit,
        use_qk_l2norm=use_qk_l2norm_in_kernel, has_dt_bias=dt_bias is not None, tile_v=cfg.tile_v, aligned=aligned,
        null_policy=null_policy, slot_dtype=None if ssm_state_indices is None else ssm_state_indices.dtype,
        nat_dtype=None if num_accepted_tokens is None else num_accepted_tokens.dtype,
        source_dtype=None if source is None else source.dtype,
        source_idx_dtype=None if source_idx is None else source_idx.dtype, frozen=frozen, records=corr is not None,
        parents_dtype=None if parents is None else parents.dtype,
    )
    fn = _launch.get_or_compile(key, lambda arch: _compile(key, arch), _launch.arch_for(q.device))
    fn(
        q, k, v, g, beta, A_log, dt_bias, initial_state,
        final_state if state_mode == StateMode.DENSE else None,
        ssm_state_indices, num_accepted_tokens if state_mode == StateMode.SPEC else None, cu_seqlens, output,
        source, source_idx, corr, kg, parents,
        scale, -1.0 if lower_bound is None else float(lower_bound),
    )
    return output, final_state
