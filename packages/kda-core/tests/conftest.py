"""Shared pieces of the kda-core tests.

The tests run with ``--import-mode=importlib`` (a test file cannot import a sibling module), so the input builders
live here as a session fixture, ``kda``, returning a small namespace of plain functions (safe inside hypothesis
tests, which reject function-scoped fixtures).

GPU tests carry ``@pytest.mark.gpu`` and are skipped where CUDA is missing. Hypothesis runs a bounded number of
examples (profile ``kda-ci``) so the suite stays within its CI budget on two cores; ``HYPOTHESIS_PROFILE=kda-deep``
runs more.
"""

from __future__ import annotations

import os
import types

import pytest
import torch

try:
    from hypothesis import HealthCheck, settings

    settings.register_profile(
        "kda-ci", max_examples=25, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    settings.register_profile("kda-deep", max_examples=300, deadline=None)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "kda-ci"))
except ImportError:  # hypothesis is a test extra; the property tests skip themselves without it
    pass

GPU_MARKER = "gpu: needs a CUDA GPU; skips cleanly without one"


def pytest_configure(config):
    config.addinivalue_line("markers", GPU_MARKER)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ----------------------------------------------------------------------------------------------------------------
# Input builders


def make_inputs(B=2, T=3, H=2, HV=None, K=32, *, seed=0, gate="lower_bound", dtype=torch.bfloat16, device="cpu",
                beta_is_logit=True):
    """Random recurrence inputs [B, T, ...] and the gate arguments for one gate form.

    gate: "lower_bound" (lb = -5, raw bf16 gate), "softplus" (raw gate), "precomputed" (g is a log-decay in
    [-2, 0), beta sigmoided). Returns a dict of recurrent_kda_ref keyword arguments.
    """
    HV = H if HV is None else HV
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    args = dict(
        q=rnd(B, T, H, K),
        k=rnd(B, T, H, K),
        v=rnd(B, T, HV, K),
        beta=rnd(B, T, HV) if beta_is_logit else torch.rand(B, T, HV, generator=gen).to(device=device, dtype=dtype),
        beta_is_logit=beta_is_logit,
    )
    if gate == "precomputed":
        args["g"] = (-2.0 * torch.rand(B, T, HV, K, generator=gen)).to(device=device, dtype=dtype)
        args["use_gate_in_kernel"] = False
    else:
        args["g"] = rnd(B, T, HV, K)
        args["use_gate_in_kernel"] = True
        args["A_log"] = (torch.rand(H, generator=gen) - 0.5).to(device)
        args["dt_bias"] = (torch.randn(H * K, generator=gen) * 0.5).to(device)
        args["lower_bound"] = -5.0 if gate == "lower_bound" else None
    return args


def make_pool(N, HV, K, *, seed=1, dtype=torch.float32, device="cpu", row_pad=0):
    """A random state pool [N, HV, V, K] (V = K), optionally with a padded row stride (row_pad elements)."""
    gen = torch.Generator().manual_seed(seed)
    row = HV * K * K
    flat = (torch.randn(N * (row + row_pad), generator=gen) * 0.5).to(device=device, dtype=dtype)
    return flat.as_strided((N, HV, K, K), (row + row_pad, K * K, K, 1))


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a tensor (NaN-safe bitwise comparisons)."""
    view = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
            torch.float16: torch.int16}.get(t.dtype)
    return t.contiguous().view(view) if view is not None else t.contiguous()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


@pytest.fixture(scope="session")
def kda():
    return types.SimpleNamespace(make_inputs=make_inputs, make_pool=make_pool, bits=bits, same_bits=same_bits)
