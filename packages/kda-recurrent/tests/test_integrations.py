"""``kda_recurrent.integrations``: replacing the engines' vendored KDA decode functions, and putting them back.

The engines are not imported: stand-in modules (``tests/standins/``, the engines' dotted names and function
signatures) are inserted into ``sys.modules``, with the binding patterns of the engine files (a package that
re-exports, a caller that imports the name at import, a caller that imports it at call time).
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import types
from pathlib import Path

import pytest
import torch

from kda_recurrent.compat import sglang as sglang_adapters
from kda_recurrent.compat.vllm import kimi_k3, kimi_linear
from kda_recurrent.integrations import sglang as sglang_integration
from kda_recurrent.integrations import signature_mismatch
from kda_recurrent.integrations import vllm as vllm_integration

STANDINS = Path(__file__).parent / "standins"
K3 = "vllm.models.kimi_k3.nvidia.ops.third_party.kda"
FLA_OPS = "vllm.third_party.flash_linear_attention.ops.kda"
LINEAR_LAYER = "vllm.model_executor.layers.mamba.gdn.kda_linear_attn"
SGL = "sglang.kernels.ops.attention.fla.fused_recurrent"
SGL_CALLER = "sglang.srt.layers.attention.linear.kernels.kda_triton"


@pytest.fixture(autouse=True)
def kernels_installed(monkeypatch):
    """``enable()`` does nothing without kda-cute (the adapters would run the oracle); these tests patch stand-ins,
    so kda-cute reads as installed even where it is not (CI installs kda-recurrent once without kda-cute). A test
    that wants it missing patches ``find_spec`` again."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "kda_cute" else real_find_spec(name, *a))


@pytest.fixture
def engine(monkeypatch):
    """``load(dotted_name, standin_file)``: a stand-in module under the engine's name (parents as empty packages);
    both integrations are disabled again before the modules are removed."""

    def load(name: str, filename: str):
        parts = name.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if not isinstance(sys.modules.get(parent), types.ModuleType):
                package = types.ModuleType(parent)
                package.__path__ = []
                monkeypatch.setitem(sys.modules, parent, package)
        spec = importlib.util.spec_from_file_location(name, STANDINS / filename)
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, module)
        spec.loader.exec_module(module)
        return module

    yield load
    vllm_integration.disable()
    sglang_integration.disable()


def load_vllm(load):
    return dict(
        k3=load(f"{K3}.fused_recurrent", "vllm_k3_fused_recurrent.py"),
        k3_package=load(K3, "vllm_k3_kda_package.py"),
        k3_layer=load("vllm.models.kimi_k3.nvidia.kda", "vllm_k3_layer.py"),
        fla=load(FLA_OPS, "vllm_fla_ops_kda.py"),
        linear_layer=load(LINEAR_LAYER, "vllm_kda_linear_attn.py"),
    )


def test_vllm_enable_replaces_every_binding(engine, caplog):
    m = load_vllm(engine)
    originals = (m["k3"].fused_recurrent_kda_packed_decode, m["k3"].fused_recurrent_kda, m["fla"].fused_recurrent_kda)
    with caplog.at_level(logging.INFO, logger="kda_recurrent.integrations"):
        replaced = vllm_integration.enable()
    assert sorted(replaced) == sorted([
        f"{K3}.fused_recurrent.fused_recurrent_kda_packed_decode", f"{K3}.fused_recurrent_kda_packed_decode",
        f"{K3}.fused_recurrent.fused_recurrent_kda", f"{K3}.fused_recurrent_kda",
        f"{FLA_OPS}.fused_recurrent_kda", f"{LINEAR_LAYER}.fused_recurrent_kda",
    ])
    assert len([r for r in caplog.records if " -> " in r.getMessage()]) == len(replaced)  # one line each
    for module in (m["k3"], m["k3_package"]):
        assert module.fused_recurrent_kda_packed_decode is kimi_k3.fused_recurrent_kda_packed_decode
        assert module.fused_recurrent_kda is kimi_k3.fused_recurrent_kda
    assert m["k3_layer"].decode_functions() == (kimi_k3.fused_recurrent_kda_packed_decode,
                                                kimi_k3.fused_recurrent_kda)  # the layer's call-time import
    assert m["fla"].fused_recurrent_kda is kimi_linear.fused_recurrent_kda
    assert m["linear_layer"].fused_recurrent_kda is kimi_linear.fused_recurrent_kda  # bound by name at import
    assert m["k3"].fused_recurrent_kda_fwd(*[None] * 5) == ("vllm-k3", "fused_recurrent_kda_fwd")  # not a target
    assert sorted(vllm_integration.patched()) == sorted(replaced)

    assert vllm_integration.enable() == []  # idempotent: nothing left to replace
    assert sorted(vllm_integration.disable()) == sorted(replaced)
    assert m["k3_layer"].decode_functions() == originals[:2]
    assert m["fla"].fused_recurrent_kda is originals[2] and m["linear_layer"].fused_recurrent_kda is originals[2]
    assert vllm_integration.disable() == [] and vllm_integration.patched() == []
    assert len(vllm_integration.enable()) == len(replaced)  # and again after a disable


def test_vllm_module_imported_after_enable_is_restored_too(engine):
    fla = engine(FLA_OPS, "vllm_fla_ops_kda.py")
    original = fla.fused_recurrent_kda
    assert vllm_integration.enable() == [f"{FLA_OPS}.fused_recurrent_kda"]  # K3 absent: skipped quietly
    layer = engine(LINEAR_LAYER, "vllm_kda_linear_attn.py")
    assert layer.fused_recurrent_kda is kimi_linear.fused_recurrent_kda
    restored = vllm_integration.disable()
    assert sorted(restored) == sorted([f"{FLA_OPS}.fused_recurrent_kda", f"{LINEAR_LAYER}.fused_recurrent_kda"])
    assert layer.fused_recurrent_kda is original


def test_vllm_changed_signature_is_left_alone(engine, caplog):
    fla = engine(FLA_OPS, "vllm_fla_ops_kda.py")

    def fused_recurrent_kda(q, k, v, g, beta, new_first_option, scale=None):  # an engine whose call changed
        return "vllm-fla", "changed"

    fla.fused_recurrent_kda = fused_recurrent_kda
    with caplog.at_level(logging.WARNING, logger="kda_recurrent.integrations"):
        assert vllm_integration.enable() == []
    assert fla.fused_recurrent_kda is fused_recurrent_kda
    assert any("kept" in r.getMessage() for r in caplog.records)


def test_enable_without_the_engine_or_the_kernels(engine, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # vLLM not importable
    monkeypatch.setitem(sys.modules, "sglang", None)
    assert vllm_integration.enable() == [] and sglang_integration.enable() == []
    assert vllm_integration.disable() == []
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "kda_cute" else real_find_spec(name, *a))
    monkeypatch.delitem(sys.modules, "vllm")
    fla = engine(FLA_OPS, "vllm_fla_ops_kda.py")
    assert vllm_integration.enable() == []  # kda-cute missing: the engine keeps its own function
    assert fla.fused_recurrent_kda is not kimi_linear.fused_recurrent_kda
    assert vllm_integration.enable(require_kernels=False) == [f"{FLA_OPS}.fused_recurrent_kda"]


def test_sglang_enable_and_disable(engine, caplog):
    defining = engine(SGL, "sglang_fused_recurrent.py")
    caller = engine(SGL_CALLER, "sglang_kda_triton.py")
    original = defining.fused_recurrent_kda_packed_decode
    with caplog.at_level(logging.INFO, logger="kda_recurrent.integrations"):
        replaced = sglang_integration.enable()
    assert sorted(replaced) == sorted([f"{SGL}.fused_recurrent_kda_packed_decode",
                                       f"{SGL_CALLER}.fused_recurrent_kda_packed_decode",
                                       f"{SGL_CALLER}.TritonKDAKernel.target_verify"])
    assert len([r for r in caplog.records if " -> " in r.getMessage()]) == 3
    adapter = sglang_adapters.fused_recurrent_kda_packed_decode
    assert defining.fused_recurrent_kda_packed_decode is adapter and caller.fused_recurrent_kda_packed_decode is adapter
    assert sglang_integration.enable() == []
    assert sorted(sglang_integration.disable()) == sorted(replaced)
    assert defining.fused_recurrent_kda_packed_decode is original
    assert caller.fused_recurrent_kda_packed_decode is original


def verify_call(N=2, T=3, H=2, S=4, dtype=torch.bfloat16, seed=5):
    """SGLang's ``target_verify`` arguments (positional and keyword) for N requests of T draft tokens, H heads of
    128: the committed pool's slots 1..N (0 belongs to nobody), an intermediate buffer of S steps per slot."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, dt=dtype, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dt)

    n_tok, D = N * T, 128
    args = (rnd(H, dt=torch.float32, scale=0.5), rnd(H * D, dt=torch.float32, scale=0.1),
            rnd(1, n_tok, H, D), rnd(1, n_tok, H, D), rnd(1, n_tok, H, D), rnd(n_tok, H * D), rnd(n_tok, H))
    kwargs = dict(ssm_states=rnd(N + 1, H, D, D, dt=torch.float32, scale=0.1),
                  cache_indices=torch.arange(1, N + 1, dtype=torch.int32),
                  query_start_loc=torch.arange(0, n_tok + 1, T, dtype=torch.int32),
                  intermediate_states_buffer=torch.zeros(N, S, H, D, D),
                  intermediate_state_indices=torch.arange(N, dtype=torch.int32), cache_steps=T,
                  retrieve_parent_token=None, lower_bound=-5.0)
    return args, kwargs


def test_sglang_triton_verify_is_replaced_in_the_class(engine, monkeypatch):
    """SGLang's KDA backend calls ``target_verify`` on its kernel object (or on a wrapper kernel that forwards to a
    Triton one): the method is replaced in the class, so both get kda's verify, which gives what
    ``kda_target_verify`` gives; a subclass with its own method keeps it; disabling puts SGLang's back."""
    engine(SGL, "sglang_fused_recurrent.py")
    caller = engine(SGL_CALLER, "sglang_kda_triton.py")
    own = caller.TritonKDAKernel.target_verify

    class Overriding(caller.TritonKDAKernel):
        def target_verify(self, *args, **kwargs):
            return "subclass"

    assert f"{SGL_CALLER}.TritonKDAKernel.target_verify" in sglang_integration.enable()
    assert caller.TritonKDAKernel.target_verify is sglang_adapters.triton_kda_target_verify
    assert f"{SGL_CALLER}.TritonKDAKernel.target_verify" in sglang_integration.patched()
    assert sglang_integration.enable() == []
    monkeypatch.setattr(sglang_adapters, "_KERNEL_DEVICE_MIN", -1)  # CPU tensors stand for a Hopper GPU
    args, kwargs = verify_call()
    expected_buffer = kwargs["intermediate_states_buffer"].clone()
    expected = sglang_adapters.kda_target_verify(*args, **{**kwargs, "intermediate_states_buffer": expected_buffer})
    for kernel in (caller.TritonKDAKernel(), caller.WrappedKDAKernel()):
        kwargs["intermediate_states_buffer"].zero_()
        out = kernel.target_verify(*args, **kwargs)
        assert torch.equal(out, expected)
        assert torch.equal(kwargs["intermediate_states_buffer"], expected_buffer)
    assert Overriding().target_verify(*args, **kwargs) == "subclass"
    assert f"{SGL_CALLER}.TritonKDAKernel.target_verify" in sglang_integration.disable()
    assert caller.TritonKDAKernel.target_verify is own
    assert caller.TritonKDAKernel().target_verify(*args, **kwargs)[:2] == ("sglang", "target_verify")


@pytest.mark.parametrize("case", ["ring", "off_hopper", "fp16", "head_dim_64", "buffer_fp16"])
def test_sglang_triton_verify_calls_kda_does_not_take_run_sglangs_method(engine, monkeypatch, case):
    """The ReplaySSM ring mode (kda does not write SGLang's rings), another GPU (SGLang's kernel runs on SM100 too,
    where kda's kernels have not), and dtypes or shapes kda's kernels lack go to SGLang's own method with every
    argument it was given, never a KDAError."""
    engine(SGL, "sglang_fused_recurrent.py")
    caller = engine(SGL_CALLER, "sglang_kda_triton.py")
    sglang_integration.enable()
    monkeypatch.setattr(sglang_adapters, "_KERNEL_DEVICE_MIN", -1)
    args, kwargs = verify_call()
    ring = torch.zeros(3, 2, 3, 128)
    if case == "fp16":  # fp16 activations (a and b stay bf16): kda writes bf16 where SGLang returns q's dtype
        args = (*args[:2], *(t.half() for t in args[2:5]), *args[5:])
    elif case == "ring":
        kwargs.update(intermediate_states_buffer=None, cache_ring=True, replayssm_rawv=ring)
    elif case == "off_hopper":
        monkeypatch.setattr(sglang_adapters, "_on_kda_gpu", lambda x: False)
    elif case == "head_dim_64":  # kda's kernels take K = V = 64 too, but not its T=1 and fused ones: SGLang's K3 is 128
        q, k, v = (t[..., :64] for t in args[2:5])
        args = (args[0], args[1][: 2 * 64], q, k, v, args[5][:, : 2 * 64], args[6])
        kwargs.update(ssm_states=kwargs["ssm_states"][..., :64, :64],
                      intermediate_states_buffer=kwargs["intermediate_states_buffer"][..., :64, :64])
    elif case == "buffer_fp16":
        kwargs["intermediate_states_buffer"] = kwargs["intermediate_states_buffer"].half()
    ran, name, given = caller.TritonKDAKernel().target_verify(*args, **kwargs, some_future_keyword=7)
    assert (ran, name) == ("sglang", "target_verify")
    assert given["some_future_keyword"] == 7 and given["cache_steps"] == 3 and given["lower_bound"] == -5.0
    assert given["cache_ring"] is (case == "ring") and (given["replayssm_rawv"] is ring) == (case == "ring")


def test_sglang_triton_verify_with_a_changed_signature_is_left_alone(engine, caplog):
    engine(SGL, "sglang_fused_recurrent.py")
    caller = engine(SGL_CALLER, "sglang_kda_triton.py")

    def target_verify(self, q, k, v, A_log, dt_bias, a, b, **kwargs):  # a SGLang whose call changed
        return "sglang"

    caller.TritonKDAKernel.target_verify = target_verify
    with caplog.at_level(logging.WARNING, logger="kda_recurrent.integrations"):
        assert f"{SGL_CALLER}.TritonKDAKernel.target_verify" not in sglang_integration.enable()
    assert caller.TritonKDAKernel.target_verify is target_verify
    assert any("TritonKDAKernel.target_verify kept" in r.getMessage() for r in caplog.records)


SGL_FUSED = "sglang.kernels.ops.attention.kda_fused_decode"
SGL_BACKEND = "sglang.srt.layers.attention.linear.kda_backend"


def test_sglang_fused_decode_and_its_test_are_replaced_where_the_backend_reads_them(engine, caplog):
    """SGLang's KDA backend reads ``covered`` and ``kda_fused_decode`` off the module it bound at import: both
    become kda's (the test only with the kernel); disabling restores both; a changed kernel signature keeps both."""
    fused = engine(SGL_FUSED, "sglang_kda_fused_decode.py")
    backend = engine(SGL_BACKEND, "sglang_kda_backend.py")
    originals = backend.fused_decode_functions()
    assert sglang_integration.enable() == [f"{SGL_FUSED}.kda_fused_decode", f"{SGL_FUSED}.covered"]
    assert backend.fused_decode_functions() == (sglang_adapters.kda_fused_decode_covered,
                                                sglang_adapters.kda_fused_decode)
    assert sglang_integration.disable() == [f"{SGL_FUSED}.kda_fused_decode", f"{SGL_FUSED}.covered"]
    assert backend.fused_decode_functions() == originals

    def kda_fused_decode(mixed_qkv, a, b, conv_states, fused_weight, conv_bias):  # a SGLang whose call changed
        return "sglang", "changed"

    fused.kda_fused_decode = kda_fused_decode
    with caplog.at_level(logging.WARNING, logger="kda_recurrent.integrations"):
        assert sglang_integration.enable() == []
    assert backend.fused_decode_functions() == (originals[0], kda_fused_decode)
    assert any("covered kept" in r.getMessage() for r in caplog.records)


def test_sglang_fused_decode_stays_sglangs_off_hopper(engine, monkeypatch):
    """Where kda's fused layer does not stand in (not a Hopper GPU: SGLang runs its own kernel on SM100 too), kda's
    ``covered`` gives SGLang's answer and the kernel call goes to SGLang's, keywords and all."""
    fused = engine(SGL_FUSED, "sglang_kda_fused_decode.py")
    monkeypatch.setattr(fused, "covered", lambda *args: True)  # SGLang finds its kernel covers the call
    sglang_integration.enable()
    monkeypatch.setattr(sglang_adapters, "_on_kda_gpu", lambda x: False)
    x = torch.zeros(1, 3 * 12 * 128, dtype=torch.bfloat16)
    assert fused.covered(x, *[None] * 6) is True  # SGLang's own answer
    assert fused.kda_fused_decode(x, *[None] * 15) == ("sglang", "kda_fused_decode")


def test_sglang_fused_decode_head_counts_kda_lacks_stay_sglangs(engine, monkeypatch):
    """On a device kda's layer takes (CPU tensors stand for Hopper here), a head count kda's kernel is not built for
    (SGLang's JIT takes H = 3 and 6 too) gets SGLang's answer and runs SGLang's kernel, not a KDAError."""
    fused = engine(SGL_FUSED, "sglang_kda_fused_decode.py")
    monkeypatch.setattr(fused, "covered", lambda *args: True)
    sglang_integration.enable()
    monkeypatch.setattr(sglang_adapters, "_KERNEL_DEVICE_MIN", -1)
    H, B, bf16 = 6, 2, torch.bfloat16
    seg = H * 128
    call = (torch.zeros(B, 3 * seg, dtype=bf16), torch.zeros(B, seg, dtype=bf16), torch.zeros(B, H, dtype=bf16),
            torch.zeros(3, 3, 3 * seg, dtype=bf16), torch.zeros(3, H, 128, 128), torch.zeros(B, dtype=torch.int32),
            torch.zeros(B, seg, dtype=bf16))
    assert fused.covered(*call) is True
    mixed, a, b, conv, ssm, idx, gate = call
    assert fused.kda_fused_decode(mixed, a, b, conv, None, None, None, None, None, None, gate, None, ssm, idx,
                                  128 ** -0.5, 1e-6) == ("sglang", "kda_fused_decode")


def test_adapters_take_the_engines_signatures():
    # The engines' signatures (the stand-ins) against the adapters: every positional parameter in place, the
    # keywords present; an adapter that dropped or moved one would be refused.
    spec = importlib.util.spec_from_file_location("k3_signatures", STANDINS / "vllm_k3_fused_recurrent.py")
    k3 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(k3)
    assert signature_mismatch(k3.fused_recurrent_kda_packed_decode, kimi_k3.fused_recurrent_kda_packed_decode) is None
    assert signature_mismatch(k3.fused_recurrent_kda, kimi_k3.fused_recurrent_kda) is None

    def packed_without_out(mixed_qkv, raw_g, raw_beta, A_log, dt_bias, lower_bound, initial_state, state_indices,
                           scale=None):  # the older vLLM form: also taken
        pass

    assert signature_mismatch(packed_without_out, kimi_k3.fused_recurrent_kda_packed_decode) is None
    assert "prefix" in signature_mismatch(kimi_k3.fused_recurrent_kda, kimi_k3.fused_recurrent_kda_packed_decode)

    def takes_kwargs(q, **kwargs):
        pass

    assert "**kwargs" in signature_mismatch(takes_kwargs, lambda q: None)


def test_vllm_plugin_entry_point_enables_only_with_the_knob(engine, monkeypatch):
    from kda_core import knobs

    fla = engine(FLA_OPS, "vllm_fla_ops_kda.py")
    original = fla.fused_recurrent_kda
    monkeypatch.setenv("KDA_ENGINE_PATCH", "0")
    assert vllm_integration.register() == [] and fla.fused_recurrent_kda is original
    monkeypatch.setenv("KDA_ENGINE_PATCH", "1")
    assert knobs.get("KDA_ENGINE_PATCH") is True
    assert vllm_integration.register() == [f"{FLA_OPS}.fused_recurrent_kda"]
    assert fla.fused_recurrent_kda is kimi_linear.fused_recurrent_kda


def test_the_entry_point_is_declared_for_vllm():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    group = meta["project"]["entry-points"]["vllm.general_plugins"]
    module, _, name = group["kda"].partition(":")
    assert module == vllm_integration.__name__ and callable(getattr(vllm_integration, name))


RECOVERSSM = "vllm.models.kimi_k3.nvidia.ops.recoverssm"


def test_vllm_recoverssm_verify_and_commit_context_are_replaced(engine):
    rs = engine(RECOVERSSM, "vllm_k3_recoverssm.py")
    originals = (rs.kda_recoverssm_verify, rs.KDARecoverSSMCommitContext)
    replaced = vllm_integration.enable()
    assert sorted(replaced) == [f"{RECOVERSSM}.KDARecoverSSMCommitContext", f"{RECOVERSSM}.kda_recoverssm_verify"]
    assert rs.kda_recoverssm_verify is kimi_k3.kda_recoverssm_verify
    assert rs.KDARecoverSSMCommitContext is kimi_k3.KDARecoverSSMCommitContext
    vllm_integration.disable()
    assert (rs.kda_recoverssm_verify, rs.KDARecoverSSMCommitContext) == originals


def test_vllm_commit_context_with_a_changed_method_is_left_alone(engine, caplog):
    rs = engine(RECOVERSSM, "vllm_k3_recoverssm.py")

    class KDARecoverSSMCommitContext(rs.KDARecoverSSMCommitContext):  # an engine whose commit grew a positional
        def commit(self, num_accepted_tokens, new_positional, state_indices, query_start_loc):
            pass

    rs.KDARecoverSSMCommitContext = KDARecoverSSMCommitContext
    with caplog.at_level(logging.WARNING, logger="kda_recurrent.integrations"):
        assert vllm_integration.enable() == [f"{RECOVERSSM}.kda_recoverssm_verify"]
    assert rs.KDARecoverSSMCommitContext is KDARecoverSSMCommitContext
    assert any("commit:" in r.getMessage() for r in caplog.records)


CUSTOM_OPS = "vllm._custom_ops"
K3_LAYER = "vllm.models.kimi_k3.nvidia.kda"


def test_vllm_native_fused_op_is_replaced_where_the_layer_reads_it(engine):
    """``vllm._custom_ops.fused_kda_decode`` (the native op's Python function) gets kda's adapter; the layer, which
    bound the module as ``ops`` at import, reads the adapter at call time; other ops of the module stay vLLM's."""
    ops, _, layer = load_k3_fused(engine)
    original = ops.fused_kda_decode
    assert layer.native_decode_function() is original
    assert vllm_integration.enable() == FUSED_NAMES
    assert ops.fused_kda_decode is kimi_k3.fused_kda_decode
    assert layer.native_decode_function() is kimi_k3.fused_kda_decode
    assert ops.rms_norm(None, None, None, 1e-6) == ("vllm-custom-ops", "rms_norm")
    assert vllm_integration.disable() == FUSED_NAMES
    assert layer.native_decode_function() is original


def load_k3_fused(engine):
    """(ops, vllm.utils.flashinfer, the layer module) as stand-ins, in the order vLLM imports them."""
    ops = engine(CUSTOM_OPS, "vllm_custom_ops.py")
    utils = engine(FI_UTILS, "vllm_utils_flashinfer.py")
    return ops, utils, engine(K3_LAYER, "vllm_k3_native_layer.py")


FI_UTILS = "vllm.utils.flashinfer"
FUSED_NAMES = [f"{CUSTOM_OPS}.fused_kda_decode", f"{K3_LAYER}.is_fused_kda_decode_supported",
               f"{FI_UTILS}.flashinfer_packed_fused_kda_decode", f"{K3_LAYER}.flashinfer_packed_fused_kda_decode",
               f"{K3_LAYER}.is_flashinfer_fused_kda_spec_decode_supported"]


@pytest.fixture
def hopper(monkeypatch):
    """The device a layer is built on, as vLLM's backend test sees it: ``hopper(major, minor)`` (default 9.0)."""

    def on(major=9, minor=0):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (major, minor))

    on()
    return on


def test_vllm_native_backend_takes_a_bf16_pool_once_the_op_is_kdas(engine, hopper):
    """vLLM's backend test takes an fp32 state only; with kda enabled a layer built on Hopper (or SM100) with a bf16
    pool takes the native backend too, whose op is then kda's fused layer; disabling restores vLLM's answer."""
    _, _, layer = load_k3_fused(engine)
    assert (layer.decode_backend(torch.bfloat16), layer.decode_backend(torch.float32)) == ("triton", "native")
    vllm_integration.enable()
    assert layer.is_fused_kda_decode_supported is kimi_k3.is_fused_kda_decode_supported
    assert (layer.decode_backend(torch.bfloat16), layer.decode_backend(torch.float32)) == ("native", "native")
    assert layer.decode_backend(torch.bfloat16, num_heads=16) == "native"  # a head count vLLM's op lacks
    assert layer.decode_backend(torch.float16) == "triton"
    assert layer.decode_backend(torch.bfloat16, num_heads=20) == "triton"
    hopper(10, 0)
    assert layer.decode_backend(torch.bfloat16) == "native"
    hopper(8, 0)  # a device kda's fused kernel is not built for: vLLM's own answer
    assert (layer.decode_backend(torch.bfloat16), layer.decode_backend(torch.float32)) == ("triton", "native")
    vllm_integration.disable()
    hopper()
    assert (layer.decode_backend(torch.bfloat16), layer.decode_backend(torch.float32)) == ("triton", "native")


def test_kda_backend_test_needs_kdas_op(engine, hopper, caplog):
    """Where vLLM's op was kept (its signature changed), vLLM's backend test is kept too: the native backend would
    call vLLM's op, which takes no bf16 pool. And the installed test answers False once the op is not kda's."""
    ops, _, layer = load_k3_fused(engine)

    def fused_kda_decode(x, weight, new_first_option, bias=None):  # a vLLM whose op changed
        return "vllm-custom-ops", "changed"

    ops.fused_kda_decode = fused_kda_decode
    original = layer.is_fused_kda_decode_supported
    with caplog.at_level(logging.WARNING, logger="kda_recurrent.integrations"):
        assert vllm_integration.enable() == FUSED_NAMES[2:]  # the spec-decode pair does not depend on the op
    assert layer.is_fused_kda_decode_supported is original
    assert any("is_fused_kda_decode_supported kept" in r.getMessage() for r in caplog.records)
    assert kimi_k3.is_fused_kda_decode_supported(12, 128, 4, 0, torch.bfloat16, torch.bfloat16, torch.float32) is False


def test_vllm_spec_decode_backend_takes_kdas_fused_multi_token_layer(engine, hopper):
    """vLLM's fused spec-decode backend needs FlashInfer on SM100; with kda enabled a layer built on Hopper takes it
    (an fp32 or a bf16 pool), its call being kda's ``packed_fused_kda_decode``; where kda's kernel does not take the
    layer (RecoverSSM on, no bounded gate, the DS conv layout, too many drafts, another device) it keeps vLLM's
    unfused spec path; disabling restores vLLM's own answer and wrapper."""
    _, utils, layer = load_k3_fused(engine)
    wrapper = utils.flashinfer_packed_fused_kda_decode
    assert layer.spec_decode_function()(x=None) == ("vllm-utils-flashinfer", "packed_fused_kda_decode")
    assert layer.spec_decode_backend(torch.bfloat16) == "native"
    vllm_integration.enable()
    assert layer.spec_decode_function() is kimi_k3.flashinfer_packed_fused_kda_decode
    assert utils.flashinfer_fused_kda_decode(x=None) == ("vllm-utils-flashinfer", "fused_kda_decode")  # not a target
    for dtype in (torch.bfloat16, torch.float32):
        assert layer.spec_decode_backend(dtype) == "flashinfer"
    assert layer.spec_decode_backend(torch.bfloat16, num_spec=15) == "flashinfer"  # T = 16, kda's limit
    for refused in (dict(num_spec=16), dict(num_spec=0), dict(lower_bound=None), dict(lower_bound=0.5),
                    dict(use_recoverssm=True), dict(num_heads=20)):
        assert layer.spec_decode_backend(torch.bfloat16, **refused) == "native", refused
    layer.DIM_FIRST[0] = True  # vLLM's DS conv layout: kda's multi-token kernel takes the SD layout only
    assert layer.spec_decode_backend(torch.bfloat16) == "native"
    layer.DIM_FIRST[0] = False
    hopper(8, 9)
    assert layer.spec_decode_backend(torch.bfloat16) == "native"
    hopper()
    vllm_integration.disable()
    assert layer.spec_decode_function() is wrapper
    assert layer.spec_decode_backend(torch.bfloat16) == "native"


def test_vllm_spec_decode_stays_flashinfers_off_hopper(engine, hopper, monkeypatch):
    """On SM100, where vLLM takes FlashInfer's fused spec decode and kda's kernels have not run, vLLM's own test
    answers and the wrapper hands the call to vLLM's (FlashInfer's); on Hopper a tensor call runs kda's layer."""
    from kda_recurrent import fused

    monkeypatch.setattr(fused, "packed_fused_kda_decode", lambda *a, **kw: "kda")
    _, _, layer = load_k3_fused(engine)
    vllm_integration.enable()
    hopper(10, 0)
    for present in (False, True):
        layer.FLASHINFER[0] = present
        assert layer.spec_decode_backend(torch.bfloat16) == ("flashinfer" if present else "native")
    x = torch.zeros(2, 3 * 12 * 128, dtype=torch.bfloat16)
    assert layer.spec_decode_function()(x=x) == ("vllm-utils-flashinfer", "packed_fused_kda_decode")
    monkeypatch.setattr(kimi_k3, "_spec_on_kda", lambda x: True)  # a CUDA tensor on a Hopper GPU
    assert layer.spec_decode_function()(x=x) == "kda"
    vllm_integration.disable()
    layer.FLASHINFER[0] = False


def test_vllm_spec_decode_wrapper_runs_kdas_layer_with_vllms_call(engine, monkeypatch):
    """The replaced wrapper forwards vLLM's keyword call, unchanged, to ``kda_recurrent.packed_fused_kda_decode``."""
    from kda_recurrent import fused

    seen = {}
    monkeypatch.setattr(fused, "packed_fused_kda_decode", lambda *a, **kw: seen.update(args=a, kwargs=kw) or "out")
    _, _, layer = load_k3_fused(engine)
    vllm_integration.enable()
    call = dict(x=1, weight=2, conv_state=3, raw_gate=4, raw_beta=5, A_log=6, dt_bias=7, state_indices=8,
                query_start_loc=9, num_accepted_tokens=10, state=11, output_gate=12, norm_weight=13, lower_bound=-5.0,
                norm_eps=1e-5, output=14)
    assert layer.spec_decode_function()(**call) == "out"
    assert seen == dict(args=(), kwargs=call)


def test_engine_module_failing_at_import_is_left_alone(engine, monkeypatch, caplog):
    """An engine module that raises something other than ImportError when imported (a model module touching the
    device, say) costs its own targets only: the rest are installed and ``enable()`` does not raise."""
    fla = engine(FLA_OPS, "vllm_fla_ops_kda.py")
    real_import = importlib.import_module

    def import_module(name, *args):
        if name == K3_LAYER:
            raise RuntimeError("no device")
        return real_import(name, *args)

    monkeypatch.setattr(importlib, "import_module", import_module)
    with caplog.at_level(logging.WARNING, logger="kda_recurrent.integrations"):
        assert vllm_integration.enable() == [f"{FLA_OPS}.fused_recurrent_kda"]
    assert fla.fused_recurrent_kda is kimi_linear.fused_recurrent_kda
    assert any(f"importing {K3_LAYER} failed (RuntimeError: no device)" in r.getMessage() for r in caplog.records)


def test_native_fused_adapter_takes_the_engines_signature():
    spec = importlib.util.spec_from_file_location("custom_ops_signatures", STANDINS / "vllm_custom_ops.py")
    ops = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ops)
    assert signature_mismatch(ops.fused_kda_decode, kimi_k3.fused_kda_decode) is None

    def keyword_only(*, x, weight, bias, conv_state, raw_g, raw_beta, A_log, dt_bias, state_indices, state,
                     out=None, lower_bound=None, output_gate=None, norm_weight=None, norm_eps=1e-5):
        pass  # a wrapper that took everything by keyword: the adapter takes that call too

    assert signature_mismatch(keyword_only, kimi_k3.fused_kda_decode) is None
