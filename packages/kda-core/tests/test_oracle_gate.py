"""Gate formulas of docs/design.md §3 step 2 against values computed by hand with the math module."""

from __future__ import annotations

import math

import pytest
import torch

from kda_core.oracle import kda_gate_ref, recurrent_kda_ref

A_LOG = [0.3, -0.7]  # per query head
DT = [[0.5, -1.0, 2.0], [0.0, 0.25, -0.5]]  # [H, K]
G = [[1.0, 0.5, -3.0], [2.0, -1.0, 4.0]]  # [HV, K] with HV == H


def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def _softplus(x):
    return x if x > 20 else math.log1p(math.exp(x))


def _tensors():
    return (torch.tensor(G, dtype=torch.float64), torch.tensor(A_LOG, dtype=torch.float64),
            torch.tensor(DT, dtype=torch.float64).reshape(-1))


def test_lower_bound_gate_is_lb_times_sigmoid_of_rate_times_biased_input():
    g, A_log, dt = _tensors()
    out = kda_gate_ref(g, A_log, dt, lower_bound=-5.0, dtype=torch.float64)
    for h in range(2):
        for c in range(3):
            want = -5.0 * _sigmoid(math.exp(A_LOG[h]) * (G[h][c] + DT[h][c]))
            assert out[h, c].item() == pytest.approx(want, rel=1e-14)


def test_softplus_gate_is_minus_rate_times_softplus_of_biased_input():
    g, A_log, dt = _tensors()
    out = kda_gate_ref(g, A_log, dt, lower_bound=None, dtype=torch.float64)
    for h in range(2):
        for c in range(3):
            want = -math.exp(A_LOG[h]) * _softplus(G[h][c] + DT[h][c])
            assert out[h, c].item() == pytest.approx(want, rel=1e-14)


@pytest.mark.parametrize("x", [20.5, 25.0, 80.0, 1000.0])
def test_softplus_gate_is_linear_above_20(x):
    g = torch.full((1, 1), x, dtype=torch.float64)
    out = kda_gate_ref(g, torch.zeros(1, dtype=torch.float64), None, lower_bound=None, dtype=torch.float64)
    assert out.item() == -x  # exp(0) * x exactly: no overflow, no log1p rounding


def test_softplus_gate_is_finite_for_very_negative_inputs():
    g = torch.full((1, 2), -1000.0, dtype=torch.float64)
    out = kda_gate_ref(g, torch.zeros(1, dtype=torch.float64), None, dtype=torch.float64)
    assert torch.all(out <= 0) and torch.all(torch.isfinite(out))


def test_precomputed_gate_is_the_input_upcast():
    g = torch.tensor([[-0.125, -3.0]], dtype=torch.bfloat16)
    out = kda_gate_ref(g, use_gate_in_kernel=False, dtype=torch.float64)
    assert out.dtype == torch.float64 and out.tolist() == [[-0.125, -3.0]]


def test_gate_parameters_are_per_query_head_under_gqa():
    # HV = 4 value heads over H = 2 query heads: value head hv uses A_log[hv // 2] and dt_bias[hv // 2].
    A_log = torch.tensor([0.1, -0.4], dtype=torch.float64)
    dt = torch.tensor([[0.3, -0.2], [1.0, 0.5]], dtype=torch.float64)
    g = torch.tensor([[0.1, 0.2], [0.3, 0.4], [0.5, 0.6], [0.7, 0.8]], dtype=torch.float64)
    out = kda_gate_ref(g, A_log, dt.reshape(-1), lower_bound=-2.0, dtype=torch.float64)
    for hv in range(4):
        h = hv // 2
        for c in range(2):
            want = -2.0 * _sigmoid(math.exp(A_log[h].item()) * (g[hv, c].item() + dt[h, c].item()))
            assert out[hv, c].item() == pytest.approx(want, rel=1e-14)


def test_one_step_from_zero_state_matches_the_hand_formula():
    # S = 0: p = 0, u = b v, S_new = u k^T, o = u (k^ . q^); the decay cannot show, beta and the norms do.
    K = 4
    q = torch.tensor([1.0, 2.0, 0.0, -1.0], dtype=torch.float64)
    k = torch.tensor([0.5, 0.0, 1.0, 1.0], dtype=torch.float64)
    v = torch.tensor([2.0, -1.0, 0.5, 3.0], dtype=torch.float64)
    beta_logit = 0.3
    beta = torch.full((1, 1, 1), beta_logit, dtype=torch.float64)
    kw = dict(g=torch.zeros(1, 1, 1, K), beta=beta, beta_is_logit=True, output_final_state=True, dtype=torch.float64,
              out_dtype=None)
    o, S = recurrent_kda_ref(q.view(1, 1, 1, K), k.view(1, 1, 1, K), v.view(1, 1, 1, K), **kw)
    b = _sigmoid(beta_logit)
    kn = k / math.sqrt(float((k * k).sum()) + 1e-6)
    qn = q / math.sqrt(float((q * q).sum()) + 1e-6) * K**-0.5
    torch.testing.assert_close(S[0, 0], b * v[:, None] * kn[None, :], rtol=1e-14, atol=0)
    torch.testing.assert_close(o[0, 0, 0], b * v * float(kn @ qn), rtol=1e-14, atol=0)


def test_decay_multiplies_state_columns_before_the_update():
    # With k = 0 the step is S' = a * S (per key channel c, i.e. per column) and o = S' q^.
    K = 3
    S0 = torch.arange(1.0, 10.0, dtype=torch.float64).reshape(1, 1, K, K)
    g_log = torch.tensor([-0.5, -1.0, -2.0], dtype=torch.float64)
    q = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64).view(1, 1, 1, K)
    _, S = recurrent_kda_ref(
        q, torch.zeros(1, 1, 1, K), torch.zeros(1, 1, 1, K), g_log.view(1, 1, 1, K), torch.ones(1, 1, 1),
        initial_state=S0, output_final_state=True, use_qk_l2norm_in_kernel=False, dtype=torch.float64,
        out_dtype=None,
    )
    torch.testing.assert_close(S[0, 0], S0[0, 0] * torch.exp(g_log)[None, :], rtol=1e-15, atol=0)
