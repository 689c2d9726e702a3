"""Where a ``recurrent_kda`` call runs (:class:`Path`) and why (:class:`Route`): shared by the facade's routing and
the spec-decode entries (:mod:`kda_recurrent.spec`)."""

from __future__ import annotations

import enum
from typing import NamedTuple

__all__ = ["Path", "Route"]


class Path(str, enum.Enum):
    """Where a call runs."""

    T1 = "t1_decode"  # kda_cute.decode_t1: the fast T=1 pool-update kernel
    T1_VARLEN = "t1_decode_varlen"  # the same kernel on [1, T, H, 128] tokens + cu_seqlens (decode_t1._run_varlen)
    GENERIC = "generic"  # kda_cute.generic: every other shape of call
    FROZEN_TC = "frozen_verify_tc"  # kda_cute.ucache.frozen_verify: a frozen verify on the tensor-core kernel
    ORACLE = "oracle"  # kda_core.oracle.recurrent_kda_ref: CPU tensors, or CUDA without kda-cute


class Route(NamedTuple):
    path: Path
    reason: str
