"""Run SGLang's KDA T=1 decode on kda: ``enable()`` replaces SGLang's vendored function by kda's adapter.

    from kda_recurrent.integrations import sglang as kda_sglang
    kda_sglang.enable()    # in every process that runs the model, before its first forward

Replaced (where the module imports; see :mod:`kda_recurrent.integrations` for how, and docs/serving.md §4):
``fused_recurrent_kda_packed_decode`` of ``python/sglang/kernels/ops/attention/fla/fused_recurrent.py``
@ 047d31af2516212c09b8ce356fae8298ba8526d7 by :func:`kda_recurrent.compat.sglang.fused_recurrent_kda_packed_decode`,
also the name its caller ``python/sglang/srt/layers/attention/linear/kernels/kda_triton.py``
@ 007d1d93beabe99478bc855e6ccdc4ac0bfcdf7d binds by ``from ... import`` at import. That caller is the Triton KDA
backend's ``packed_decode`` (the T=1 decode); its ReplaySSM ring variant, the target-verify and extend paths, and the
CuTe DSL and FlashInfer backends are not replaced. Slot ``-1`` is null and slot 0 live, as in SGLang.
"""

from __future__ import annotations

from kda_recurrent.integrations import Patcher, Target

__all__ = ["TARGETS", "disable", "enable", "patched"]

TARGETS = (
    Target("sglang.kernels.ops.attention.fla.fused_recurrent", "fused_recurrent_kda_packed_decode",
           "kda_recurrent.compat.sglang:fused_recurrent_kda_packed_decode"),
)

_patcher = Patcher("sglang", TARGETS, "SGLang")


def enable(*, require_kernels: bool = True) -> list[str]:
    """Replace SGLang's KDA packed decode by kda's; returns the ``module.name`` attributes replaced by this call.
    ``require_kernels`` as :func:`kda_recurrent.integrations.vllm.enable`'s."""
    return _patcher.enable(require_kernels)


def disable() -> list[str]:
    """Put SGLang's own function back; returns the ``module.name`` attributes restored."""
    return _patcher.disable()


def patched() -> list[str]:
    """The ``module.name`` attributes that hold a kda adapter now."""
    return _patcher.patched()
