"""Fused KDA decode layer, T=1: conv update + SiLU, the KDA step, gated RMSNorm in one kernel (docs/design.md §8).

One step of a whole KDA layer between the projection GEMM and ``o_proj``, with FlashInfer's ``fused_kda_decode``
arguments. Per row b (slot s = state_indices[b]) and head h:

1. conv (width 4, depthwise) over ``[conv_state[s] | x[b]]`` for the head's 3 x 128 channels (its q, k and v parts),
   SiLU, rounded to bf16; ``conv_state[s]`` <- the window's last 3 columns;
2. the KDA step of docs/design.md §3 (L2 norms, the lower-bound or softplus gate from raw_gate + dt_bias,
   beta = sigmoid(raw_beta)) on the state ``state[s, h]``, o rounded to bf16;
3. ``y = o * rsqrt(mean(o^2) + norm_eps) * norm_weight * sigmoid(output_gate)``, output [1, B, H, 128] bf16.

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

Null rows (``NullSlotPolicy``, default NONPOSITIVE as FlashInfer's op; a slot >= N is null under both): zero
output, neither the conv cache nor the state read or written. Slot offsets are 64-bit (``Int64(slot) * stride``),
int64 indices are compared in 64 bits. Variants (compile-time): pool dtype x gate x dt_bias / conv bias present x
alignment class x rows in flight x cache hint x bulk ring x null policy x index dtype; B, H, the pool's slots and
both caches' strides are runtime values, and so are ``lower_bound`` and ``norm_eps``.
"""

import dataclasses
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32, Int64, const_expr

from kda_core.contracts import HEAD_DIM, GateMode, NullSlotPolicy
from kda_core.errors import fail
from kda_core.validation import WRAPPER_REJECTED, debug_check_slots, debug_checks_enabled
from kda_core.validation_fused import CONV_HISTORY, CONV_WIDTH, validate_fused_decode

from . import _launch
from .decode_t1 import (
    CACHE_HINTS,
    HALF_WARP,
    ROW_GROUPS,
    THREADS,
    KDADecodeT1,
    bulk_ring_for,
    rows_in_flight_for,
)

__all__ = ["FusedDecodeConfig", "select_config", "effective_config", "fused_kda_decode", "KDAFusedDecode",
           "variant_key", "compile_variant"]

PARTS = 3  # q | k | v
WARPS = THREADS // 32


@dataclass(frozen=True)
class FusedDecodeConfig:
    """Schedule of one fused launch (the tile is always 128: a CTA owns its head). ``rows_in_flight``,
    ``cache_hint`` and ``bulk_ring`` mean what they mean in :class:`kda_cute.decode_t1.DecodeT1Config`; a ring the
    call cannot take (unaligned) is dropped by :func:`effective_config`."""

    rows_in_flight: int = 0
    cache_hint: str = "stream"
    bulk_ring: int = 0

    def __post_init__(self):
        if not isinstance(self.rows_in_flight, int) or self.rows_in_flight < 0:
            fail("config.rows_in_flight", "an integer >= 0", self.rows_in_flight)
        if self.cache_hint not in CACHE_HINTS:
            fail("config.cache_hint", f"one of {CACHE_HINTS}", self.cache_hint)
        bulk_ring_for(HEAD_DIM, 2, True, self.bulk_ring)  # raises on an illegal depth


# Per pool dtype, rows (max B*H states, config), the last unbounded: the register path while latency decides, the
# bulk ring once bandwidth does. The thresholds are the T=1 table's tile-128 rows (decode_t1._SCHEDULE, measured on
# the H200), not a sweep of this kernel: benchmarks/bench_fused_decode.py --bulk-ring measures both paths.
_SCHEDULE = {
    torch.bfloat16: ((384, FusedDecodeConfig()), (1 << 62, FusedDecodeConfig(bulk_ring=8))),
    torch.float32: ((287, FusedDecodeConfig()), (1 << 62, FusedDecodeConfig(bulk_ring=8))),
}


def effective_config(config: FusedDecodeConfig, state_dtype: torch.dtype, aligned: bool) -> FusedDecodeConfig:
    """What ``config`` runs as: the ring only where :func:`kda_cute.decode_t1.bulk_ring_for` gives one (it then
    replaces rows in flight and the cache hint), rows in flight normalised to the effective count."""
    ring = bulk_ring_for(HEAD_DIM, state_dtype.itemsize, aligned, config.bulk_ring)
    if ring:
        return FusedDecodeConfig(bulk_ring=ring)
    return dataclasses.replace(config, bulk_ring=0,
                               rows_in_flight=rows_in_flight_for(HEAD_DIM, state_dtype.itemsize,
                                                                 config.rows_in_flight))


def select_config(B: int, H: int, state_dtype: torch.dtype, aligned: bool) -> FusedDecodeConfig:
    """The schedule policy: the ``_SCHEDULE`` row of B*H states, fitted to the call."""
    cfg = next(c for limit, c in _SCHEDULE[state_dtype] if B * H <= limit)
    return effective_config(cfg, state_dtype, aligned)


# --------------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------------


class KDAFusedDecode(KDADecodeT1):
    """Compile-time configuration of one fused decode variant: the T=1 kernel at tile 128 (l2norm on, beta a logit,
    the gate in the kernel) plus the conv and the gated RMSNorm around its row stream."""

    def __init__(self, *, state_dtype, gate: GateMode, has_dt_bias: bool, has_bias: bool, aligned: bool,
                 rows_in_flight: int = 0, cache_hint: str = "stream", bulk_ring: int = 0,
                 null_policy: NullSlotPolicy = NullSlotPolicy.NONPOSITIVE, index_dtype=cutlass.Int32):
        if gate == GateMode.PRECOMPUTED:
            raise ValueError("fused_decode: the layer's gate is computed in the kernel (lower bound or softplus)")
        super().__init__(state_dtype=state_dtype, gate=gate, beta_is_logit=True, use_qk_l2norm=True,
                         has_dt_bias=has_dt_bias, tile_v=HEAD_DIM, aligned=aligned, rows_in_flight=rows_in_flight,
                         cache_hint=cache_hint, bulk_ring=bulk_ring, null_policy=null_policy, index_dtype=index_dtype)
        self.has_bias = bool(has_bias)

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # [B, C] bf16, C = 3*H*128
        mW: cute.Tensor,  # [3, 4, H*128] fp32
        mBias,  # [C] fp32, or None
        mConv: cute.Tensor,  # [slots, C, W >= 3] bf16, channel-contiguous
        mGate: cute.Tensor,  # [1, B, H, 128] bf16
        mBeta: cute.Tensor,  # [1, B, H] bf16
        mALog: cute.Tensor,  # [H] fp32
        mDtBias,  # [H*128] fp32, or None
        mState: cute.Tensor,  # [slots, H, 128, 128]
        mSlot: cute.Tensor,  # [B] int32 / int64
        mOGate: cute.Tensor,  # [B, H, 128] bf16
        mNormW: cute.Tensor,  # [128] fp32
        mOut: cute.Tensor,  # [1, B, H, 128] bf16
        scale: Float32,
        lower_bound: Float32,
        norm_eps: Float32,
        stream,
    ):
        B = cute.size(mX, mode=[0])
        H = cute.size(mALog, mode=[0])
        occupancy = {}
        if const_expr(self.bulk_ring):
            occupancy = dict(preferred_smem_carveout=100)  # as the T=1 kernel's ring
        self.layer_kernel(mX, mW, mBias, mConv, mGate, mBeta, mALog, mDtBias, mState, mSlot, mOGate, mNormW, mOut,
                          scale, lower_bound, norm_eps).launch(grid=[B, H, 1], block=[THREADS, 1, 1], stream=stream,
                                                               **occupancy)

    def complete_token(self, token, ctx):
        """The conv phase, run once the state rows are issued: history columns of this thread's 3 channels, their
        conv + SiLU (fp32, rounded to bf16) into shared memory, the new history written back, one CTA barrier, then
        the T=1 token (k, q lane vectors, v of the thread's rows) read from shared memory. Traced inline."""
        mConv, slot, chan, heads, x_in, taps, cbias, sMixed, tidx, lane, group = ctx
        _, _, g_raw, _, beta_raw, a_log, bias_raw = token
        gConv = mConv[Int64(slot), None, None]  # [C, W]: slot offset in 64 bits
        hist = [[gConv[p * heads + chan, j] for j in range(CONV_HISTORY)] for p in range(PARTS)]  # all 9 loads first
        for p in range(PARTS):
            acc = Float32(0.0)
            if const_expr(self.has_bias):
                acc = cbias[p]
            for j in range(CONV_HISTORY):
                acc = acc + hist[p][j].to(Float32) * taps[p][j]
            acc = acc + x_in[p].to(Float32) * taps[p][CONV_HISTORY]
            sMixed[p, tidx] = (acc / (1.0 + cute.math.exp(-acc))).to(sMixed.element_type)  # SiLU, rounded to bf16
            c = p * heads + chan
            gConv[c, 0] = hist[p][1]
            gConv[c, 1] = hist[p][2]
            gConv[c, 2] = x_in[p]
        cute.arch.sync_threads()  # every conv output is in shared memory
        q_raw = self.load_lane_vector(sMixed[0, None], lane, sMixed.element_type)
        k_raw = self.load_lane_vector(sMixed[1, None], lane, sMixed.element_type)
        v_raw = cute.make_rmem_tensor((self.rows,), sMixed.element_type)
        for j in range(self.rows):
            v_raw[j] = sMixed[2, group + j * ROW_GROUPS]
        return k_raw, q_raw, g_raw, v_raw, beta_raw, a_log, bias_raw

    @cute.jit
    def emit_row(self, mOut: cute.Tensor, b, h, row, value: Float32, lane):
        """Row ``row``'s o, rounded to bf16, into the CTA's shared [128] output row (``mOut`` here)."""
        if lane == 0:
            mOut[row] = value.to(mOut.element_type)

    @cute.kernel
    def layer_kernel(self, mX: cute.Tensor, mW: cute.Tensor, mBias, mConv: cute.Tensor, mGate: cute.Tensor,
                     mBeta: cute.Tensor, mALog: cute.Tensor, mDtBias, mState: cute.Tensor, mSlot: cute.Tensor,
                     mOGate: cute.Tensor, mNormW: cute.Tensor, mOut: cute.Tensor, scale: Float32, lower_bound: Float32,
                     norm_eps: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        b, h, _ = cute.arch.block_idx()
        lane = tidx % HALF_WARP
        group = tidx // HALF_WARP
        heads = cute.size(mALog, mode=[0]) * HEAD_DIM  # channels of one part
        # Both caches have the same slot count (checked on the host); the smaller one bounds the slot all the same.
        n_slots = cutlass.min(cute.size(mState, mode=[0]), cute.size(mConv, mode=[0]))
        smem = cutlass.memory.SmemAllocator()
        sMixed = smem.allocate_tensor(cutlass.BFloat16, cute.make_layout((PARTS, HEAD_DIM), stride=(HEAD_DIM, 1)),
                                      byte_alignment=16)
        sO = smem.allocate_tensor(cutlass.BFloat16, cute.make_layout((HEAD_DIM,)), byte_alignment=16)
        sSum = smem.allocate_tensor(Float32, cute.make_layout((WARPS,)), byte_alignment=16)
        sRing, sFull = self.allocate_ring(smem)

        # ---- phase 0: every activation and parameter of this thread, before the slot is known -------------------
        slot = mSlot[b]
        chan = h * HEAD_DIM + tidx  # this thread's channel within each part
        x_in = [mX[b, p * heads + chan] for p in range(PARTS)]
        taps = [[mW[p, j, chan] for j in range(CONV_WIDTH)] for p in range(PARTS)]
        cbias = None
        if const_expr(self.has_bias):
            cbias = [mBias[p * heads + chan] for p in range(PARTS)]
        og = mOGate[b, h, tidx]
        nw = mNormW[tidx]
        g_raw = self.load_lane_vector(mGate[0, b, h, None], lane, mGate.element_type)
        beta_raw = mBeta[0, b, h]
        a_log = mALog[h]
        bias_raw = None
        if const_expr(self.has_dt_bias):
            bias_raw = self.load_lane_vector(cute.local_tile(mDtBias, (HEAD_DIM,), (h,)), lane, Float32)
        token = (None, None, g_raw, None, beta_raw, a_log, bias_raw)
        ctx = (mConv, slot, chan, heads, x_in, taps, cbias, sMixed, tidx, lane, group)

        if self.live(slot, self.idx(n_slots)):
            # ---- state rows issued, conv under their latency, the T=1 row stream; o (bf16) into sO ------------
            self.update_state(mState, slot, h, 0, group, lane, tidx, token, scale, lower_bound, sRing, sFull, sO, b,
                              ctx)
            cute.arch.sync_threads()  # the whole o row is in shared memory
            o = sO[tidx].to(Float32)
            ss = o * o
            for shift in cutlass.range_constexpr(5):  # xor 16, 8, 4, 2, 1: the warp's sum
                ss = ss + cute.arch.shuffle_sync_bfly(ss, offset=16 >> shift)
            if tidx % 32 == 0:
                sSum[tidx // 32] = ss
            cute.arch.sync_threads()
            total = sSum[0]
            for w in cutlass.range_constexpr(WARPS - 1):
                total = total + sSum[w + 1]
            inv_rms = cute.math.rsqrt(total * (1.0 / HEAD_DIM) + norm_eps)
            gate = 1.0 / (1.0 + cute.math.exp(-og.to(Float32)))
            mOut[0, b, h, tidx] = (o * inv_rms * nw * gate).to(mOut.element_type)
        else:
            mOut[0, b, h, tidx] = Float32(0.0).to(mOut.element_type)  # a null row: no cache is read or written


# --------------------------------------------------------------------------------------------------
# Host side: compile, variant key, the entry
# --------------------------------------------------------------------------------------------------


def variant_key(*, state_dtype, gate, has_dt_bias, has_bias, aligned, rows_in_flight=0, cache_hint="stream",
                bulk_ring=0, null_policy=NullSlotPolicy.NONPOSITIVE, index_dtype=torch.int32):
    """Every code-generation parameter of one fused variant, in the order ``_compile`` reads them (the signature's).
    ``rows_in_flight`` / ``bulk_ring`` are normalised as :func:`effective_config` does; ``gate`` is
    ``GateMode.LOWER_BOUND`` or ``GateMode.SOFTPLUS``."""
    null_policy = NullSlotPolicy(null_policy)
    if gate not in (GateMode.LOWER_BOUND, GateMode.SOFTPLUS):
        fail("gate", "GateMode.LOWER_BOUND or GateMode.SOFTPLUS (the layer's gate is in the kernel)", gate)
    if index_dtype not in (torch.int32, torch.int64):
        fail("state_indices", "dtype int32 or int64", index_dtype)
    if state_dtype not in (torch.bfloat16, torch.float32):
        fail("state", "dtype bfloat16 or float32", state_dtype)
    cfg = effective_config(FusedDecodeConfig(rows_in_flight, cache_hint, bulk_ring), state_dtype, bool(aligned))
    return (state_dtype, gate, bool(has_dt_bias), bool(has_bias), bool(aligned), cfg.rows_in_flight, cfg.cache_hint,
            cfg.bulk_ring, null_policy, index_dtype)


_EXTRA_OPTIONS = ""  # tests set "--keep-ptx --dump-dir D" through compile_variant()


def _compile(key, arch):
    (state_dt, gate, has_dt_bias, has_bias, aligned, rows_in_flight, cache_hint, bulk_ring, null_policy,
     index_dtype) = key
    cdt = _launch.cutlass_dtype
    align = _launch.VECTOR_BYTES if aligned else 1
    B, N, H, C, HK = (_launch.sym_size() for _ in range(5))
    fake = _launch.fake_tensor
    bf16 = cutlass.BFloat16
    args = [
        fake(bf16, (B, C), (None, 1), align_bytes=1),  # x: one element per thread
        fake(cutlass.Float32, (PARTS, CONV_WIDTH, HK), (None, None, 1), align_bytes=1),  # weight
        fake(cutlass.Float32, (C,), (1,), align_bytes=1) if has_bias else None,  # conv bias
        fake(bf16, (N, C, _launch.sym_size()), (None, 1, None), align_bytes=1),  # conv_state (SD layout)
        fake(bf16, (1, B, H, HEAD_DIM), (None, None, None, 1), align_bytes=align),  # raw_gate: lane vectors
        fake(bf16, (1, B, H), (None, None, None), align_bytes=1),  # raw_beta
        fake(cutlass.Float32, (H,), (None,), align_bytes=1),  # A_log
        fake(cutlass.Float32, (_launch.sym_size(),), (1,), align_bytes=align) if has_dt_bias else None,
        fake(cdt(state_dt), (N, H, HEAD_DIM, HEAD_DIM), (None, HEAD_DIM * HEAD_DIM, HEAD_DIM, 1), align_bytes=align),
        fake(cdt(index_dtype), (B,), (None,), align_bytes=1),  # state_indices, any stride
        fake(bf16, (B, H, HEAD_DIM), (None, None, 1), align_bytes=1),  # output_gate
        fake(cutlass.Float32, (HEAD_DIM,), (1,), align_bytes=1),  # norm_weight
        fake(bf16, (1, B, H, HEAD_DIM), (None, None, None, 1), align_bytes=1),  # output
        cutlass.Float32(1.0),
        cutlass.Float32(-1.0),
        cutlass.Float32(1e-5),
        _launch.fake_stream(),
    ]
    kernel = KDAFusedDecode(state_dtype=cdt(state_dt), gate=gate, has_dt_bias=has_dt_bias, has_bias=has_bias,
                            aligned=aligned, rows_in_flight=rows_in_flight, cache_hint=cache_hint,
                            bulk_ring=bulk_ring, null_policy=null_policy, index_dtype=cdt(index_dtype))
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
        vkey = variant_key(state_dtype=call.state_dtype, gate=call.gate_mode, has_dt_bias=call.has_dt_bias,
                           has_bias=call.has_bias, aligned=call.aligned, rows_in_flight=cfg.rows_in_flight,
                           cache_hint=cfg.cache_hint, bulk_ring=cfg.bulk_ring, null_policy=null_policy,
                           index_dtype=call.index_dtype)
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
    fp32; conv_state [slots, C, >= 3] bf16, strides (slot, 1, column) (the SD layout; columns 0..2 are the history,
    oldest first); raw_gate [1, B, H, 128] bf16; raw_beta [1, B, H] bf16 (logits); A_log [H] fp32; dt_bias
    [H*128] fp32 or None; state_indices [B] int32 / int64; state [slots, H, 128, 128] bf16 or fp32 (any slot
    stride); output_gate [B, H, 128] or [1, B, H, 128] bf16; norm_weight [128] fp32; ``lower_bound`` < 0, or None
    for the softplus gate; ``norm_eps`` >= 0; ``output`` [1, B, H, 128] bf16 (allocated when None); ``bias`` [C] fp32,
    the conv bias, optional. The full rules: :mod:`kda_core.validation_fused`.

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
    if output_gate.dim() == 4:
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
