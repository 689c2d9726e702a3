"""Run vLLM's KDA decode on kda: ``enable()`` replaces vLLM's vendored functions by kda's adapters.

    from kda_recurrent.integrations import vllm as kda_vllm
    kda_vllm.enable()    # in every process that runs the model, before its first forward; returns what it replaced

or, in every vLLM process at once, through vLLM's plugin entry points (group ``vllm.general_plugins``, which vLLM
loads in each process it starts): with kda-recurrent installed, ``KDA_ENGINE_PATCH=1 vllm serve ...`` makes
:func:`register` call :func:`enable`. Without the knob the entry point does nothing.

Replaced (each where the module imports; see :mod:`kda_recurrent.integrations` for how, and docs/serving.md):

- Kimi K3, ``vllm/models/kimi_k3/nvidia/ops/third_party/kda/fused_recurrent.py``
  @ 03c20345bb2534b98224519afacb78a4baa6ccfa: ``fused_recurrent_kda_packed_decode`` (plain decode) and
  ``fused_recurrent_kda`` (speculative decode) by :mod:`kda_recurrent.compat.vllm.kimi_k3`; also in the package
  ``...third_party/kda/__init__.py`` @ 3f9a13d44d92a4535c34d186dce79edcb1e41b2f that re-exports them, which is where
  the layer (``vllm/models/kimi_k3/nvidia/kda.py`` @ 3a1f05ba17aa4715f4020a4d304d57cfc1e37ebb) imports them from
  at call time.
- Kimi-Linear (the shared KDA layer), ``vllm/third_party/flash_linear_attention/ops/kda.py``
  @ 933876c388fb129ad82590660e6506614559cb86: ``fused_recurrent_kda`` by
  :mod:`kda_recurrent.compat.vllm.kimi_linear`; also the name the layer module
  ``vllm/model_executor/layers/mamba/gdn/kda_linear_attn.py`` @ eda8c32aa92dc346443a4b9890f9dc71633af9c4 binds by
  ``from ... import fused_recurrent_kda`` at import.

- Kimi K3 RecoverSSM (``--use-replayssm``), ``vllm/models/kimi_k3/nvidia/ops/recoverssm.py``
  @ 055e47c28003156421365af985d676fc921cb075: ``kda_recoverssm_verify`` and ``KDARecoverSSMCommitContext`` (its
  ``create`` and ``commit`` signatures compared) by :mod:`kda_recurrent.compat.vllm.kimi_k3`; the layer and the
  metadata builder import both from that module at call time. kda's commit takes the prefix-cache align mode too
  (the kernel and plan of that file @ 7752ecb8ac83fc27b687de672711efc5b8d94d32 read for its rule).
- Kimi K3's native fused decode (conv, the recurrence and the gated RMSNorm in one call), ``vllm/_custom_ops.py``'s
  ``fused_kda_decode``, the Python function over ``torch.ops._C.fused_kda_decode``
  (``csrc/libtorch_stable/kimi_k3/fused_kda_decode_kernel.cu`` @ 75162ed0be3505bbdaa9f24849afbb03dd7d2568), by
  :func:`kda_recurrent.compat.vllm.kimi_k3.fused_kda_decode`. The layer (``kda.py`` @
  3a1f05ba17aa4715f4020a4d304d57cfc1e37ebb) binds ``from vllm import _custom_ops as ops`` at import and reads
  ``ops.fused_kda_decode`` at each call, so the module attribute is what it runs. The layer takes this backend
  only where vLLM's build has the op (``hasattr(torch.ops._C, "fused_kda_decode")``, SM90 or the SM10x / SM12x
  families, fp32 state); elsewhere it takes the packed-decode call replaced above. ``torch.ops._C`` itself is not
  touched.

- Kimi K3's choice of that backend: ``is_fused_kda_decode_supported`` in the layer module (``kda.py`` @
  3a1f05ba17aa4715f4020a4d304d57cfc1e37ebb), which ``resolve_kda_decode_backend`` reads when each layer is built,
  by :func:`kda_recurrent.compat.vllm.kimi_k3.is_fused_kda_decode_supported`. vLLM's own test takes only an fp32
  state and its compiled op; kda's also takes a bf16 state (and H in 8-96), on devices of capability 9.0 and 10.0,
  once the op above is kda's. A bf16 pool on Hopper then runs one fused launch per decode step instead of vLLM's
  Triton conv, recurrence and norm. The layer module is imported by ``enable()`` for this (so ``enable()`` must run
  before the model is built, as the plugin entry point does). It is replaced only where the op above is kda's;
  vLLM trees whose test has another signature keep theirs.

- Kimi K3's fused spec-decode backend: ``flashinfer_packed_fused_kda_decode`` of ``vllm/utils/flashinfer.py`` (a lazy
  wrapper of FlashInfer's ``packed_fused_kda_decode``, bound by the layer module at import) by
  :func:`kda_recurrent.compat.vllm.kimi_k3.flashinfer_packed_fused_kda_decode` (on Hopper kda's fused multi-token
  layer, same call; elsewhere vLLM's wrapper), and the layer's ``is_flashinfer_fused_kda_spec_decode_supported`` by
  one giving kda's answer on Hopper (no FlashInfer needed, fp32 or bf16 state, Kimi K3's bounded gate, RecoverSSM
  off, the SD conv layout) and vLLM's elsewhere, only where the first is kda's. A pure spec-decode batch on Hopper
  then runs one fused launch; SM100 keeps FlashInfer's (:func:`kda_recurrent.integrations.original` gives the
  adapters vLLM's functions).

Not replaced: FlashInfer's other ops (its T=1 ``fused_kda_decode``, which vLLM prefers below the native backend,
and prefill). Every replacement treats slot ``<= 0`` as null (vLLM's
``NULL_BLOCK_ID``); vLLM's native op has no null test at all (its padding rows compute into block 0), kda's
adapter leaves block 0 untouched and writes zeros for those rows.
"""

from __future__ import annotations

from kda_core import knobs
from kda_recurrent.integrations import Patcher, Target

__all__ = ["TARGETS", "disable", "enable", "patched", "register"]

_K3 = "vllm.models.kimi_k3.nvidia.ops.third_party.kda.fused_recurrent"
_K3_RS = "vllm.models.kimi_k3.nvidia.ops.recoverssm"
_CUSTOM_OPS = "vllm._custom_ops"
_K3_LAYER = "vllm.models.kimi_k3.nvidia.kda"
_FLASHINFER_UTILS = "vllm.utils.flashinfer"
TARGETS = (
    Target(_K3, "fused_recurrent_kda_packed_decode",
           "kda_recurrent.compat.vllm.kimi_k3:fused_recurrent_kda_packed_decode"),
    Target(_K3, "fused_recurrent_kda", "kda_recurrent.compat.vllm.kimi_k3:fused_recurrent_kda"),
    Target("vllm.third_party.flash_linear_attention.ops.kda", "fused_recurrent_kda",
           "kda_recurrent.compat.vllm.kimi_linear:fused_recurrent_kda"),
    Target(_K3_RS, "kda_recoverssm_verify", "kda_recurrent.compat.vllm.kimi_k3:kda_recoverssm_verify"),
    Target(_K3_RS, "KDARecoverSSMCommitContext", "kda_recurrent.compat.vllm.kimi_k3:KDARecoverSSMCommitContext",
           via=("create", "commit")),
    Target(_CUSTOM_OPS, "fused_kda_decode", "kda_recurrent.compat.vllm.kimi_k3:fused_kda_decode"),
    Target(_K3_LAYER, "is_fused_kda_decode_supported",
           "kda_recurrent.compat.vllm.kimi_k3:is_fused_kda_decode_supported",
           requires=(_CUSTOM_OPS, "fused_kda_decode")),
    Target(_FLASHINFER_UTILS, "flashinfer_packed_fused_kda_decode",
           "kda_recurrent.compat.vllm.kimi_k3:flashinfer_packed_fused_kda_decode"),
    Target(_K3_LAYER, "is_flashinfer_fused_kda_spec_decode_supported",
           "kda_recurrent.compat.vllm.kimi_k3:is_flashinfer_fused_kda_spec_decode_supported",
           requires=(_FLASHINFER_UTILS, "flashinfer_packed_fused_kda_decode")),
)

_patcher = Patcher("vllm", TARGETS, "vLLM")


def enable(*, require_kernels: bool = True) -> list[str]:
    """Replace vLLM's KDA decode functions by kda's; returns the ``module.name`` attributes replaced by this call
    (empty when vLLM's modules do not import, or when everything is replaced already). ``require_kernels``: do
    nothing (with a warning) when kda-cute is not installed, since the adapters would run kda-core's oracle."""
    return _patcher.enable(require_kernels)


def disable() -> list[str]:
    """Put vLLM's own functions back; returns the ``module.name`` attributes restored."""
    return _patcher.disable()


def patched() -> list[str]:
    """The ``module.name`` attributes that hold a kda adapter now."""
    return _patcher.patched()


def register() -> list[str]:
    """vLLM's ``vllm.general_plugins`` entry point (kda-recurrent's pyproject declares it): :func:`enable` when the
    knob ``KDA_ENGINE_PATCH`` is on, else nothing. Returns what was replaced."""
    if not knobs.get("KDA_ENGINE_PATCH"):
        return []
    return enable()
