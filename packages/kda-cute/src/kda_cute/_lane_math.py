"""Per-lane math shared by the T=1 decode kernel, the generic recurrent kernel and the RecoverSSM commit
(docs/design.md §3 steps 1-5), and the row-lane helpers (``RowLanes``) of the last two.

Each lane holds ``len(kf)`` consecutive key channels of one token; the lanes that share a state row reduce with the
caller's butterfly (``row_sum``: 16 lanes in the T=1 kernel, 8 or 16 in the generic one). Traced inline into the
calling kernel.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from kda_core.contracts import L2NORM_EPS, GateMode

CHANNELS_PER_LANE = 8  # one 16-byte vector of a bf16 row per lane
LOAD_STREAM = dict(load_cache_mode=cute.nvgpu.LoadCacheMode.STREAMING)
STORE_STREAM = dict(store_cache_mode=cute.nvgpu.StoreCacheMode.STREAMING)


class RowLanes:
    """Lane helpers of a kernel whose state rows are each held by ``self.lanes`` lanes of ``CHANNELS_PER_LANE``
    channels (the generic recurrent kernel, the RecoverSSM commit). The kernel class sets ``self.lanes`` and
    ``self.aligned`` (16-byte vectors, else element-wise accesses). Traced inline."""

    def _copy_bits(self, dtype) -> int:
        return min(CHANNELS_PER_LANE * dtype.width, 128) if self.aligned else dtype.width

    @cute.jit
    def row_sum(self, x):
        """Sum over the ``lanes`` lanes that share one state row (an xor butterfly inside the group)."""
        for i in cutlass.range_constexpr(self.lanes.bit_length() - 1):
            x = x + cute.arch.shuffle_sync_bfly(x, offset=(self.lanes >> 1) >> i)
        return x

    @cute.jit
    def copy_lane(self, src: cute.Tensor, dst: cute.Tensor, dtype, hints: cutlass.Constexpr = None):
        """Copy the lane's 8 contiguous elements between gmem and registers (vector width by alignment)."""
        bits = self._copy_bits(dtype)
        vec = bits // dtype.width
        if const_expr(hints == "load"):
            atom = cute.make_copy_atom(cute.nvgpu.CopyG2ROp(), dtype, num_bits_per_copy=bits, **LOAD_STREAM)
        elif const_expr(hints == "store"):
            atom = cute.make_copy_atom(cute.nvgpu.CopyR2GOp(), dtype, num_bits_per_copy=bits, **STORE_STREAM)
        else:
            atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=bits)
        cute.copy(atom, cute.logical_divide(src, (vec,)), cute.logical_divide(dst, (vec,)))


@cute.jit
def gate_decay(decay: cute.Tensor, gf: cute.Tensor, bias: cute.Tensor, rate: Float32, lower_bound: Float32,
               gate: cutlass.Constexpr, has_dt_bias: cutlass.Constexpr):
    """decay[c] = exp(g_log[c]): g itself (precomputed gate), ``lower_bound * sigmoid(rate * (g + dt_bias))`` or
    ``-rate * softplus(g + dt_bias)``, with ``rate = exp(A_log)``. ``bias`` is read only with ``has_dt_bias``."""
    for c in cutlass.range_constexpr(cute.size(decay)):
        x = gf[c]
        if const_expr(gate == GateMode.PRECOMPUTED):
            decay[c] = cute.math.exp(x)
        else:
            if const_expr(has_dt_bias):
                x = x + bias[c]
            if const_expr(gate == GateMode.LOWER_BOUND):
                decay[c] = cute.math.exp(lower_bound / (1.0 + cute.math.exp(-(rate * x))))
            else:
                # softplus(x) = max(x, 0) + log1p(exp(-|x|)): no overflow, and equal to x in fp32 beyond 20 (the
                # reference's threshold).
                softplus = cute.math.max(x, Float32(0.0)) + cute.math.log1p(cute.math.exp(-cute.math.abs(x)))
                decay[c] = cute.math.exp(-rate * softplus)


@cute.jit
def normalize_qk(kf: cute.Tensor, qf: cute.Tensor, scale: Float32, use_qk_l2norm: cutlass.Constexpr,
                 row_sum: cutlass.Constexpr) -> Float32:
    """In place: k <- k^ (L2-normalised with ``use_qk_l2norm``, eps ``L2NORM_EPS``), q <- scale * q^. Returns
    k^.q^ summed over the row's lanes."""
    q_scale = scale
    k_scale = Float32(1.0)
    if const_expr(use_qk_l2norm):
        k_ss = Float32(0.0)
        q_ss = Float32(0.0)
        for c in cutlass.range_constexpr(cute.size(kf)):
            k_ss = k_ss + kf[c] * kf[c]
            q_ss = q_ss + qf[c] * qf[c]
        k_scale = cute.math.rsqrt(row_sum(k_ss) + L2NORM_EPS)
        q_scale = scale * cute.math.rsqrt(row_sum(q_ss) + L2NORM_EPS)
    kq = Float32(0.0)
    for c in cutlass.range_constexpr(cute.size(kf)):
        kf[c] = kf[c] * k_scale
        qf[c] = qf[c] * q_scale
        kq = kq + kf[c] * qf[c]
    return row_sum(kq)
