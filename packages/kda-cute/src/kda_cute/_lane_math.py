"""Per-lane math shared by the T=1 decode kernel and the generic recurrent kernel (docs/design.md §3 steps 1-5).

Each lane holds ``len(kf)`` consecutive key channels of one token; the lanes that share a state row reduce with the
caller's butterfly (``row_sum``: 16 lanes in the T=1 kernel, 8 or 16 in the generic one). Traced inline into the
calling kernel.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from kda_core.contracts import L2NORM_EPS, GateMode


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
