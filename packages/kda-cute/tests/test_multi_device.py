"""kda-cute's kernels on a device that is not the current one (docs/multi_gpu.md).

CPU tests: the arch is read per device index (no device guard, once per index), ``CUTE_DSL_ARCH`` wins, and devices
of one architecture share each compiled function while another architecture gets its own.

GPU tests (marker ``multi_gpu``: they skip below two GPUs) on the T=1 entries (``kda_decode_t1``, ``_packed``,
``_packed_tokens``) and ``fused_kda_decode``, with the tensors on ``cuda:1`` while ``cuda:0`` is current and the
reverse: results match kda-core's oracle and equal bit for bit the call made with the tensors' device current; the
launch is on the tensors' device's current stream (a busy side stream there holds it back); a CUDA graph captured on
the tensors' device replays from the other; and a hot call (its facts described before, so only the compiled
wrapper checks devices) with one tensor on the other device is refused with the KDAError naming it, nothing written.
The facade, ucache, RecoverSSM and frozen verify entries are covered by kda-recurrent's tests/test_multi_device.py.
"""

from __future__ import annotations

import pytest
import torch

from kda_core.errors import KDAError

HEAD_DIM = 128
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def two_gpus(test):
    for mark in (pytest.mark.gpu, pytest.mark.multi_gpu, pytest.mark.skipif(GPUS < 2, reason="needs two CUDA GPUs")):
        test = mark(test)
    return test

SENTINEL = 7.0


# ---------------------------------------------------------------------------------------------------------------
# CPU: the arch and the compile cache


@pytest.fixture
def launch(monkeypatch):
    """kda_cute._launch with no CUTE_DSL_ARCH, an empty arch table and compile cache, and fake device capabilities
    (``launch.capability[index] = (major, minor)``; ``launch.asked`` lists the indices queried)."""
    from kda_cute import _launch

    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    monkeypatch.setattr(_launch, "_ARCH_BY_DEVICE", {})
    monkeypatch.setattr(_launch, "_CACHE", {})
    capability = {0: (9, 0), 1: (9, 0)}
    asked = []

    def get_device_capability(index):
        asked.append(index)
        return capability[index]

    def no_guard(*_):
        raise AssertionError("arch_for switched the current device")

    monkeypatch.setattr(torch.cuda, "get_device_capability", get_device_capability)
    monkeypatch.setattr(torch.cuda, "device", no_guard)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    _launch.capability, _launch.asked = capability, asked
    return _launch


def test_the_arch_is_read_per_device_index_once_and_without_a_device_guard(launch):
    launch.capability[1] = (10, 0)
    assert launch.arch_for(torch.device("cuda", 1)) == "sm_100a"
    assert launch.arch_for(torch.device("cuda", 0)) == "sm_90a"
    assert launch.arch_for(torch.device("cuda", 1)) == "sm_100a"
    assert launch.target_arch() == "sm_90a"  # the current device's (0 here)
    assert launch.arch_for(torch.device("cuda")) == "sm_90a"
    assert launch.asked == [1, 0]


def test_cute_dsl_arch_wins_over_every_device(launch, monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    assert launch.arch_for(torch.device("cuda", 1)) == "sm_100a" and launch.target_arch() == "sm_100a"
    assert launch.asked == []


def test_devices_of_one_arch_share_a_compiled_function_and_another_arch_gets_its_own(launch):
    built = []

    def build(arch):
        built.append(arch)
        return object()

    key = ("a variant",)
    f0 = launch.get_or_compile(key, build, launch.arch_for(torch.device("cuda", 0)))
    f1 = launch.get_or_compile(key, build, launch.arch_for(torch.device("cuda", 1)))
    assert f0 is f1 and built == ["sm_90a"]
    launch.capability[2] = (10, 0)
    f2 = launch.get_or_compile(key, build, launch.arch_for(torch.device("cuda", 2)))
    assert f2 is not f0 and built == ["sm_90a", "sm_100a"] and launch.cache_size() == 2
    assert launch.get_or_compile(key, build) is f0  # no arch: the current device's (0)


# ---------------------------------------------------------------------------------------------------------------
# GPU cases: (inputs on the CPU, prepare(inputs) -> a thunk running the entry once, names of the inputs it writes,
# oracle(CPU inputs) -> the expected results: the entry's return value, then the written inputs)


def _decode_inputs(form, seed=0, B=4, H=8):
    from kda_core.oracle import unpack_packed

    g = torch.Generator().manual_seed(seed)
    K = HEAD_DIM
    mixed = torch.randn(B, 3 * H * K + 8, generator=g).to(torch.bfloat16)[:, : 3 * H * K]
    raw_gate = torch.randn(B, H * K, generator=g).to(torch.bfloat16)
    raw_beta = torch.randn(B, H, generator=g).to(torch.bfloat16)
    gate = dict(A_log=torch.log(torch.rand(H, generator=g) * 15 + 1), dt_bias=torch.randn(H * K, generator=g) * 0.5)
    pool = (torch.randn(2 * B + 3, H, K, K, generator=g) * 0.1).to(torch.bfloat16)
    slots = torch.tensor([5, -1, 0, 9][:B], dtype=torch.int32)
    a = dict(state_pool=pool, slot_indices=slots, **gate)
    if form == "unpacked":
        q, k, v, gg, beta = unpack_packed(mixed, raw_gate, raw_beta, H, K)
        a.update(q=q, k=k, v=v, g=gg, beta=beta, output=torch.full((B, 1, H, K), SENTINEL, dtype=torch.bfloat16))
    elif form == "packed":
        a.update(mixed_qkv=mixed, raw_gate=raw_gate, raw_beta=raw_beta,
                 output=torch.full((B, 1, H, K), SENTINEL, dtype=torch.bfloat16))
    else:
        a.update(mixed_qkv=mixed, raw_gate=raw_gate.view(1, B, H, K), raw_beta=raw_beta.view(1, B, H),
                 output=torch.full((1, B, H, K), SENTINEL, dtype=torch.bfloat16))
    return a, H


def _decode_case(form):
    def case():
        from kda_core.oracle import recurrent_kda_ref, unpack_packed
        from kda_cute import decode_t1

        a, H = _decode_inputs(form)
        entry = {"unpacked": decode_t1.kda_decode_t1, "packed": decode_t1.kda_decode_t1_packed,
                 "tokens": decode_t1.kda_decode_t1_packed_tokens}[form]
        extra = dict(num_heads=H) if form == "packed" else {}

        def prepare(x):
            return lambda: entry(**x, lower_bound=-5.0, **extra)

        def oracle(x):
            if form == "unpacked":
                q, k, v, g, beta = x["q"], x["k"], x["v"], x["g"], x["beta"]
            else:
                B = x["mixed_qkv"].shape[0]
                q, k, v, g, beta = unpack_packed(x["mixed_qkv"], x["raw_gate"].reshape(B, -1),
                                                 x["raw_beta"].reshape(B, -1), H, HEAD_DIM)
            pool = x["state_pool"].clone()
            o, pool = recurrent_kda_ref(q, k, v, g, beta, A_log=x["A_log"], dt_bias=x["dt_bias"],
                                        initial_state=pool, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                        lower_bound=-5.0, beta_is_logit=True,
                                        ssm_state_indices=x["slot_indices"].long())
            o = o.to(torch.bfloat16).reshape(x["output"].shape)
            return [o, pool, o]

        return a, prepare, ("state_pool", "output"), oracle

    return case


def _fused_case():
    from kda_core.oracle_fused import fused_kda_decode_ref
    from kda_cute.fused_decode import fused_kda_decode

    g = torch.Generator().manual_seed(6)
    B, H, slots = 3, 8, 5
    D = HEAD_DIM
    C = 3 * H * D

    def rnd(*shape, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    conv = torch.empty_strided((slots, C, 3), (3 * C + 8, 1, C), dtype=torch.bfloat16)
    conv.copy_(rnd(slots, C, 3, scale=0.5))
    a = dict(x=rnd(B, C + 16)[:, :C], weight=rnd(3, 4, H * D, dtype=torch.float32, scale=0.3), conv_state=conv,
             raw_gate=rnd(1, B, H, D), raw_beta=rnd(1, B, H), A_log=rnd(H, dtype=torch.float32, scale=0.5),
             dt_bias=rnd(H * D, dtype=torch.float32, scale=0.1), state_indices=torch.tensor([3, 0, 1],
                                                                                            dtype=torch.int32),
             state=rnd(slots, H, D, D, dtype=torch.float32, scale=0.05), output_gate=rnd(B, H, D),
             norm_weight=rnd(D, dtype=torch.float32), output=torch.full((1, B, H, D), SENTINEL, dtype=torch.bfloat16))

    def oracle(x):
        x = {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in x.items()}
        out = fused_kda_decode_ref(**{n: t for n, t in x.items() if n != "output"})
        return [out, x["conv_state"], x["state"], out]

    return a, lambda x: (lambda: fused_kda_decode(**x)), ("conv_state", "state", "output"), oracle


CASES = {"decode_t1": _decode_case("unpacked"), "decode_t1_packed": _decode_case("packed"),
         "decode_t1_packed_tokens": _decode_case("tokens"), "fused_kda_decode": _fused_case}
DIRECTIONS = [pytest.param(1, 0, id="tensors_on_1_current_0"), pytest.param(0, 1, id="tensors_on_0_current_1")]
_TWO = [pytest.mark.multi_gpu, pytest.mark.skipif(GPUS < 2, reason="needs two CUDA GPUs")]
STREAM_DEVICES = [pytest.param(0, 0, id="one_gpu"), pytest.param(1, 0, id="tensors_on_1_current_0", marks=_TWO),
                  pytest.param(0, 1, id="tensors_on_0_current_1", marks=_TWO)]


def _on(inputs, device):
    return {n: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device).copy_(t)
            if isinstance(t, torch.Tensor) else t for n, t in inputs.items()}


def _results(value, inputs, written):
    return [value.cpu()] + [inputs[n].cpu() for n in written]


def _run(name, device, current):
    inputs, prepare, written, _ = CASES[name]()
    on = _on(inputs, device)
    with torch.cuda.device(current):
        value = prepare(on)()
        assert torch.cuda.current_device() == current
    torch.cuda.synchronize(device)
    return _results(value, on, written)


@two_gpus
@pytest.mark.parametrize("device, current", DIRECTIONS)
@pytest.mark.parametrize("name", list(CASES))
def test_a_kernel_on_another_device_matches_the_oracle_and_its_own_device(name, device, current):
    inputs, _, _, oracle = CASES[name]()
    want = oracle(_on(inputs, "cpu"))
    got = _run(name, device, current)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2, msg=f"result {i}")
    for a, b in zip(got, _run(name, device, device), strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("device, current", STREAM_DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_a_kernel_launches_on_the_current_stream_of_the_tensors_device(name, device, current):
    expected = _run(name, device, device)
    inputs, prepare, written, _ = CASES[name]()
    on = _on(inputs, device)
    before = [on[n].clone() for n in written]
    thunk = prepare(on)
    torch.cuda.synchronize(device)
    start = torch.cuda.current_device()
    side = torch.cuda.Stream(device=device)
    torch.cuda.set_stream(side)  # the tensors' device's current stream (this also makes that device current) ...
    torch.cuda.set_device(current)  # ... and the caller back on its device
    try:
        assert torch.cuda.current_stream(device) == side
        with torch.cuda.stream(side):
            torch.cuda._sleep(1 << 31)  # ~1 s of GPU cycles: whatever follows on `side` waits
        value = thunk()
        default = torch.cuda.default_stream(device)
        with torch.cuda.stream(default):
            seen = [on[n].clone() for n in written]
        default.synchronize()
        assert not side.query(), "the side stream finished too early for the check to mean anything"
        for n, a, b in zip(written, seen, before):
            assert torch.equal(a, b), f"{n} was written before the tensors' device's current stream ran"
        side.synchronize()
    finally:
        torch.cuda.set_stream(torch.cuda.default_stream(device))
        torch.cuda.set_device(start)  # the test leaves the process's device as it found it
    got = _results(value, on, written)
    assert any(not torch.equal(on[n].cpu(), b.cpu()) for n, b in zip(written, before))
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


@two_gpus
@pytest.mark.parametrize("device, current", DIRECTIONS)
@pytest.mark.parametrize("name", list(CASES))
def test_a_cuda_graph_captured_on_the_tensors_device_replays_from_the_other(name, device, current):
    expected = _run(name, device, device)  # eager, and compiles the kernel before the capture
    inputs, prepare, written, _ = CASES[name]()
    on = _on(inputs, device)
    thunk = prepare(on)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.device(current):
        with torch.cuda.graph(graph, stream=torch.cuda.Stream(device=device)):
            value = thunk()
        graph.replay()
    torch.cuda.synchronize(device)
    for a, b in zip(_results(value, on, written), expected, strict=True):
        assert torch.equal(a, b)


@two_gpus
@pytest.mark.parametrize("odd", ["slot_indices", "state_pool", "q", "output", "dt_bias"])
def test_a_hot_call_with_one_tensor_on_the_other_device_is_refused_naming_it(odd):
    """The T=1 hot path leaves the device check to the compiled wrapper (kda_core.validation's re-validation
    contract): its rejection, before launch, must still become the KDAError naming the argument."""
    from kda_cute.decode_t1 import kda_decode_t1

    a, _ = _decode_inputs("unpacked", seed=3)
    on = _on(a, 1)
    with torch.cuda.device(0):
        kda_decode_t1(**on, lower_bound=-5.0)  # described and compiled: the next call with these facts is hot
        torch.cuda.synchronize(1)
        pool = on["state_pool"].clone()
        broken = dict(on, **{odd: on[odd].to(0)})
        with pytest.raises(KDAError) as info:
            kda_decode_t1(**broken, lower_bound=-5.0)
    torch.cuda.synchronize(1)
    msg = str(info.value)
    assert msg.startswith(f"{odd}: expected ") or "expected a tensor on cuda:0" in msg, msg
    assert torch.equal(on["state_pool"], pool)



_CONTEXT_PROBE = """
import importlib.util, sys, torch
from cuda.bindings import driver
spec = importlib.util.spec_from_file_location("probe", sys.argv[1])
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
from kda_cute.decode_t1 import kda_decode_t1


def states():
    out = []
    for index in range(torch.cuda.device_count()):
        _, dev = driver.cuDeviceGet(index)
        _, _, active = driver.cuDevicePrimaryCtxGetState(dev)
        out.append(int(active))
    return out


torch.cuda.set_device(1)
a, _ = m._decode_inputs("unpacked", seed=4)
on = m._on(a, 1)
torch.cuda.synchronize(1)
print("TORCH", *states())
kda_decode_t1(**on, lower_bound=-5.0)
torch.cuda.synchronize(1)
print("KDA", *states())
"""


def _states(text, tag):
    line = next(line for line in text.splitlines() if line.startswith(tag + " "))
    return [int(x) for x in line.split()[1:]]


@two_gpus
def test_a_process_launching_on_one_device_creates_no_context_on_the_others():
    """What a tensor-parallel rank pays: the compiled module prepares its kernels for every visible device on the
    first call (``cudaKernelSetAttributeForDevice`` per device, docs/multi_gpu.md); that must not create a CUDA
    context (hundreds of MiB of device memory each) on devices the process never uses. Torch's own contexts (after
    it allocated on cuda:1) are the baseline; the kda call must add none."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _CONTEXT_PROBE, __file__], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    torch_only, after = _states(run.stdout, "TORCH"), _states(run.stdout, "KDA")
    assert torch_only[1] == 1 and after[1] == 1, (torch_only, after)
    others = [i for i in range(len(after)) if i != 1]
    # per device, active primary contexts: after torch alone allocated on cuda:1, then after kda compiled and ran
    # there; kda must add none on another device
    assert [after[i] for i in others] == [torch_only[i] for i in others], f"torch: {torch_only}, after kda: {after}"
