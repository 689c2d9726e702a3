"""Run SGLang's KDA decode and speculative verify on kda: ``enable()`` replaces SGLang's vendored functions by kda's.

    from kda_recurrent.integrations import sglang as kda_sglang
    kda_sglang.enable()    # in every process that runs the model, before its first forward

Replaced (where the module imports; see :mod:`kda_recurrent.integrations` for how, and docs/serving.md §4):
``fused_recurrent_kda_packed_decode`` of ``python/sglang/kernels/ops/attention/fla/fused_recurrent.py``
@ 047d31af2516212c09b8ce356fae8298ba8526d7 by :func:`kda_recurrent.compat.sglang.fused_recurrent_kda_packed_decode`,
also the name its caller ``python/sglang/srt/layers/attention/linear/kernels/kda_triton.py``
@ 007d1d93beabe99478bc855e6ccdc4ac0bfcdf7d binds by ``from ... import`` at import. That caller is the Triton KDA
backend's ``packed_decode`` (the T=1 decode).

Also Kimi K3's fused decode, ``python/sglang/kernels/ops/attention/kda_fused_decode.py``
@ 0000e9b46f38dd9055ecad825a42c47a047077e6: ``kda_fused_decode`` (conv + SiLU + the KDA step + gated RMSNorm) by
:func:`kda_recurrent.compat.sglang.kda_fused_decode`, and ``covered`` by
:func:`kda_recurrent.compat.sglang.kda_fused_decode_covered` (only where the first is kda's). SGLang's KDA backend
binds that module at import and reads both attributes per call, ahead of the packed decode, wherever the model has
stashed the fused arguments (Kimi K3 at 12 local heads, TP8): on an SM90 GPU that is the default T=1 decode for that
model. kda's ``covered`` also takes a bf16 pool. On Hopper only: on other GPUs (SGLang runs its kernel on SM100 too,
where kda's kernels have not run) SGLang's ``covered`` answers and SGLang's kernel runs.

Also the Triton KDA backend's speculative verify, the method ``TritonKDAKernel.target_verify`` of that caller's
module, by :func:`kda_recurrent.compat.sglang.triton_kda_target_verify`: replaced in the class, so every kernel
object (and the backend's wrapper kernels, which forward to one) calls kda's. kda's verify runs on Hopper for the
intermediate-states mode; the ReplaySSM ring mode, other GPUs and shapes kda lacks go to SGLang's own method. The
module function that method calls, ``fused_sigmoid_gating_delta_rule_update``, also serves GDN and stays SGLang's.

Not replaced: the ReplaySSM ring variants (decode and verify), SGLang's opt-in fused conv + chain verify
(``SGLANG_OPT_FUSED_KDA_VERIFY``, off by default; with it on, chain verifies skip ``target_verify``), the extend
path, and the CuTe DSL and FlashInfer backends. Slot ``-1`` is null and slot 0 live, as in SGLang.
"""

from __future__ import annotations

from kda_recurrent.integrations import Patcher, Target

__all__ = ["TARGETS", "disable", "enable", "patched"]

_FUSED = "sglang.kernels.ops.attention.kda_fused_decode"
TARGETS = (
    Target("sglang.kernels.ops.attention.fla.fused_recurrent", "fused_recurrent_kda_packed_decode",
           "kda_recurrent.compat.sglang:fused_recurrent_kda_packed_decode"),
    Target(_FUSED, "kda_fused_decode", "kda_recurrent.compat.sglang:kda_fused_decode"),
    Target(_FUSED, "covered", "kda_recurrent.compat.sglang:kda_fused_decode_covered",
           requires=(_FUSED, "kda_fused_decode")),
    Target("sglang.srt.layers.attention.linear.kernels.kda_triton", "TritonKDAKernel.target_verify",
           "kda_recurrent.compat.sglang:triton_kda_target_verify"),
)

_patcher = Patcher("sglang", TARGETS, "SGLang")


def enable(*, require_kernels: bool = True) -> list[str]:
    """Replace SGLang's KDA packed decode, fused decode and Triton verify by kda's; returns the ``module.name``
    attributes replaced by this call. ``require_kernels`` as :func:`kda_recurrent.integrations.vllm.enable`'s."""
    return _patcher.enable(require_kernels)


def disable() -> list[str]:
    """Put SGLang's own function back; returns the ``module.name`` attributes restored."""
    return _patcher.disable()


def patched() -> list[str]:
    """The ``module.name`` attributes that hold a kda adapter now."""
    return _patcher.patched()
