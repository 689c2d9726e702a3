"""One step of the KDA recurrence and its gate, in plain PyTorch (docs/design.md §3).

The building blocks of every reference in :mod:`kda_core.oracle` and :mod:`kda_core.oracle_ucache`; both import
this module, which imports neither.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kda_core.contracts import L2NORM_EPS

__all__ = ["kda_gate_ref", "kda_step_ref"]


def kda_gate_ref(g, A_log=None, dt_bias=None, lower_bound=None, use_gate_in_kernel=True, dtype=torch.float32):
    """Log-space decay g_log [..., HV, K] from the gate input g [..., HV, K] (docs/design.md §3 steps 1-2).

    A_log [H] and dt_bias [H*K] (or [H, K]) are per query head; value head hv uses query head hv // (HV // H).
    With ``use_gate_in_kernel=False`` g already is the log-space decay and is returned upcast.
    """
    g = g.to(dtype)
    if not use_gate_in_kernel:
        return g
    HV, K = g.shape[-2], g.shape[-1]
    H = A_log.numel()
    group = HV // H
    rate = torch.exp(A_log.to(dtype).reshape(H)).repeat_interleave(group)[:, None]  # [HV, 1]
    x = g
    if dt_bias is not None:
        x = x + dt_bias.to(dtype).reshape(H, K).repeat_interleave(group, dim=0)
    if lower_bound is None:
        return -rate * F.softplus(x, beta=1.0, threshold=20.0)  # softplus(x) = x for x > 20
    return lower_bound * torch.sigmoid(rate * x)


def _l2norm(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def kda_step_ref(S, q, k, v, g_log, b, scale, use_qk_l2norm_in_kernel=True):
    """One delta-rule step on fp states S [..., V, K] (docs/design.md §3 steps 5-10).

    q, k, g_log: [..., K]; v: [..., V]; b: [...] (already sigmoided). Returns (S_new, o, u, k_hat).
    """
    if use_qk_l2norm_in_kernel:
        k = _l2norm(k)
        q = _l2norm(q)
    q = q * scale
    S = S * torch.exp(g_log).unsqueeze(-2)  # decay first, per key channel (column)
    p = (S * k.unsqueeze(-2)).sum(-1)
    u = b.unsqueeze(-1) * (v - p)
    S = S + u.unsqueeze(-1) * k.unsqueeze(-2)
    o = (S * q.unsqueeze(-2)).sum(-1)
    return S, o, u, k
