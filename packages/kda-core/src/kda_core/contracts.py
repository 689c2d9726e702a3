"""Geometry and conventions shared by every kda operation (docs/design.md §2-§5)."""

from __future__ import annotations

import enum

HEAD_DIM = 128
"""K = V of the fast kernels."""
GENERIC_HEAD_DIMS = (64, 128)
"""Head dims the generic recurrent path accepts."""
T1_HEAD_COUNTS = (8, 12, 16, 24, 32, 48, 64, 96)
"""H == HV values the T=1 kernel and the ucache kernel are built and tested for (Kimi K3: 12 at TP=8, 24 at TP=4)."""
L2NORM_EPS = 1e-6
RING_SLOTS = 32
"""Physical slots of each ucache ring (the logical row j lives at (base + j) & 31)."""
UCACHE_T = (4, 8)
MAX_TREE_TOKENS = 64
"""Tree verify (``parent_indices``): at most this many tokens per row (the generic kernel keeps each token's alive bit
in one 64-bit mask), i.e. ``ssm_state_indices`` columns."""
UCACHE_WRING = (16, 32)


class GateMode(enum.Enum):
    """How the raw gate input g becomes the log-space decay (docs/design.md §3 step 2)."""

    LOWER_BOUND = "lower_bound"  # Kimi K3: lb * sigmoid(exp(A_log) * (g + dt_bias)), lb < 0
    SOFTPLUS = "softplus"  # Kimi-Linear: -exp(A_log) * softplus(g + dt_bias)
    PRECOMPUTED = "precomputed"  # g is already the log-space decay


class NullSlotPolicy(enum.Enum):
    """Which slot indices make a row inactive (docs/design.md §4): zero output, pool and caches untouched.

    A compile-time constant of every kernel, chosen by the entry point; kda's own API uses ``OUT_OF_RANGE``.
    """

    OUT_OF_RANGE = "out_of_range"  # kda, SGLang, FlashInfer: null iff idx < 0 or idx >= N
    NONPOSITIVE = "nonpositive"  # vLLM (NULL_BLOCK_ID = 0): null iff idx <= 0 or idx >= N; slot 0 never touched


def null_policy_of(value) -> NullSlotPolicy:
    """``value`` as a :class:`NullSlotPolicy`: the enum member itself or its string value ("out_of_range",
    "nonpositive"); anything else raises :class:`kda_core.errors.KDAError` naming ``null_policy``."""
    if type(value) is NullSlotPolicy:
        return value
    if type(value) is str:
        for policy in NullSlotPolicy:
            if policy.value == value:
                return policy
    from kda_core.errors import fail

    fail("null_policy", f"a kda_core.contracts.NullSlotPolicy or one of {[p.value for p in NullSlotPolicy]}",
         repr(value))


def first_live_slot(policy: NullSlotPolicy) -> int:
    """The smallest slot index that is not null under ``policy`` (1 under NONPOSITIVE, whose slot 0 is null)."""
    return 1 if policy is NullSlotPolicy.NONPOSITIVE else 0


def gate_mode(use_gate_in_kernel: bool, lower_bound: float | None) -> GateMode:
    if not use_gate_in_kernel:
        return GateMode.PRECOMPUTED
    return GateMode.SOFTPLUS if lower_bound is None else GateMode.LOWER_BOUND


def max_flush_min(T: int, w_ring: int) -> int:
    """Largest legal flush_min: the T appended rows must fit the window and must not wrap onto live rows."""
    return min(w_ring - T + 1, 33 - 2 * T)


def default_flush_min(T: int, w_ring: int) -> int:
    """Lazy flush: fold as late as the ring allows (9 for T=8 and 13 for T=4 with w_ring 16)."""
    return max_flush_min(T, w_ring)


def max_hist_len(T: int, w_ring: int) -> int:
    return min(w_ring, RING_SLOTS - T)
