"""Every public entry of kda-recurrent on a device that is not the current one (docs/multi_gpu.md).

Each case is one entry's call: ``recurrent_kda`` on each path (T=1 pool, T=1 varlen, the generic kernel with dense
states, spec decode with accepted counts, a frozen verify), ``fused_kda_decode``, the ucache step, a RecoverSSM verify
then ``recoverssm_commit``, a multi-layer ``RecoverSSMCommit``, and ``packed_fused_kda_decode`` where kda-recurrent
has it. Inputs are made on the CPU from a seed; the oracle is the same entry on those CPU tensors (kda-recurrent's
CPU path is kda-core's oracle). On a host with two GPUs the tests check, with the tensors on ``cuda:1`` while
``cuda:0`` is current and the reverse:

- the results (outputs and every tensor written in place) match the oracle, and equal bit for bit the same call made
  with the tensors' device current;
- the kernels run on the tensors' device's current stream: with a side stream of that device current there and
  held busy, nothing is written until that stream runs;
- a CUDA graph captured on the tensors' device replays, from the other device, to the eager results.

The two-device cases carry the marker ``multi_gpu`` and skip below two GPUs; the stream check also runs on one GPU
(tensors on the current device, a side stream current there). Everything collects anywhere: cases are built inside
the tests.
"""

from __future__ import annotations

import pytest
import torch

from kda_recurrent import (
    RecoverSSMCommit,
    allocate_cursors,
    allocate_ucache,
    fused_kda_decode,
    kda_delta_rule_mtp_ucache_flush,
    recoverssm_commit,
    recurrent_kda,
)
from kda_recurrent.compat.vllm import kimi_k3

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")]
TWO = [pytest.mark.multi_gpu, pytest.mark.skipif(GPUS < 2, reason="needs two CUDA GPUs")]

D = 128
LB = -5.0
BF16, F32, I32 = torch.bfloat16, torch.float32, torch.int32
SENTINEL = 7.0  # what a passed output buffer holds before the call (finite: torch.equal compares it)


def _rnd(g, *shape, dtype=BF16, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _gate(g, H):
    return dict(A_log=_rnd(g, H, dtype=F32, scale=0.5), dt_bias=_rnd(g, H * D, dtype=F32, scale=0.1))


def _activations(g, B, T, H):
    return dict(q=_rnd(g, B, T, H, D), k=_rnd(g, B, T, H, D), v=_rnd(g, B, T, H, D), g=_rnd(g, B, T, H, D),
                beta=_rnd(g, B, T, H))


_RECURRENT = dict(use_gate_in_kernel=True, lower_bound=LB, beta_is_logit=True, use_qk_l2norm_in_kernel=True)


def _recurrent(a, **kw):
    return lambda: recurrent_kda(**a, **_RECURRENT, **kw)[0]


# A case: (inputs: name -> CPU tensor, prepare(inputs) -> a thunk running the entry once, written: the names of the
# inputs the call writes). The results compared are the thunk's return value and the written inputs.


def case_t1_pool():
    g = torch.Generator().manual_seed(1)
    B, H, N = 4, 8, 7
    a = {**_activations(g, B, 1, H), **_gate(g, H), "initial_state": _rnd(g, N, H, D, D, scale=0.1),
         "ssm_state_indices": torch.tensor([5, -1, 0, 2], dtype=I32), "output": torch.full((B, 1, H, D), SENTINEL,
                                                                                           dtype=BF16)}
    return a, _recurrent, ("initial_state", "output")


def case_t1_varlen():
    g = torch.Generator().manual_seed(2)
    H, N = 8, 7
    a = {**_activations(g, 1, 3, H), **_gate(g, H), "initial_state": _rnd(g, N, H, D, D, scale=0.1),
         "ssm_state_indices": torch.tensor([4, 1, 6], dtype=I32), "cu_seqlens": torch.tensor([0, 1, 2, 3], dtype=I32),
         "output": torch.full((1, 3, H, D), SENTINEL, dtype=BF16)}
    return a, _recurrent, ("initial_state", "output")


def case_generic_dense():
    g = torch.Generator().manual_seed(3)
    B, T, H = 2, 3, 8
    a = {**_activations(g, B, T, H), **_gate(g, H), "initial_state": _rnd(g, B, H, D, D, dtype=F32, scale=0.1),
         "output": torch.full((B, T, H, D), SENTINEL, dtype=BF16)}
    return a, lambda a: (lambda: recurrent_kda(**a, **_RECURRENT, output_final_state=True)), ("output",)


def case_spec():
    g = torch.Generator().manual_seed(4)
    B, T, H, N = 2, 3, 8, 8
    a = {**_activations(g, B, T, H), **_gate(g, H), "initial_state": _rnd(g, N, H, D, D, dtype=F32, scale=0.1),
         "ssm_state_indices": torch.arange(1, B * T + 1, dtype=I32).view(B, T),
         "num_accepted_tokens": torch.tensor([2, 3], dtype=I32), "output": torch.full((B, T, H, D), SENTINEL,
                                                                                        dtype=BF16)}
    return a, _recurrent, ("initial_state", "output")


def case_frozen_verify():
    g = torch.Generator().manual_seed(5)
    B, T, H, N = 3, 4, 8, 5
    a = {**_activations(g, B, T, H), **_gate(g, H), "initial_state": _rnd(g, N, H, D, D, scale=0.1),
         "ssm_state_indices": torch.tensor([4, -1, 1], dtype=I32),
         "output": torch.full((B, T, H, D), SENTINEL, dtype=BF16)}
    return a, lambda a: _recurrent(a, disable_state_update=True), ("initial_state", "output")


def case_fused_decode():
    g = torch.Generator().manual_seed(6)
    B, H, slots = 3, 8, 5
    C = 3 * H * D
    conv = torch.empty_strided((slots, C, 3), (3 * C + 8, 1, C), dtype=BF16)
    conv.copy_(_rnd(g, slots, C, 3, scale=0.5))
    a = dict(x=_rnd(g, B, C + 16)[:, :C], weight=_rnd(g, 3, 4, H * D, dtype=F32, scale=0.3), conv_state=conv,
             raw_gate=_rnd(g, 1, B, H, D), raw_beta=_rnd(g, 1, B, H), **_gate(g, H),
             state_indices=torch.tensor([3, 0, 1], dtype=I32), state=_rnd(g, slots, H, D, D, dtype=F32, scale=0.05),
             output_gate=_rnd(g, B, H, D), norm_weight=_rnd(g, D, dtype=F32),
             output=torch.full((1, B, H, D), SENTINEL, dtype=BF16))
    return a, lambda a: (lambda: fused_kda_decode(**a, lower_bound=LB)), ("conv_state", "state", "output")


def case_ucache():
    g = torch.Generator().manual_seed(7)
    B, T, H, N = 2, 4, 8, 4
    k_cache, u_cache, g_cache = allocate_ucache(N, H, "cpu")
    hist_len, cache_base = allocate_cursors(B, "cpu")
    hist_len.fill_(3)
    cache_base.fill_(30)
    kk = torch.randn(N, H, 32, D, generator=g)
    k_cache.copy_((kk / kk.norm(dim=-1, keepdim=True)).to(BF16))
    u_cache.copy_(_rnd(g, N, H, 32, D))
    g_cache.copy_((-0.3 * torch.rand(N, H, 32, D, generator=g)).cumsum(2))
    a = dict(A_log=torch.log(torch.rand(H, generator=g) * 15 + 1), g=_rnd(g, B, T, H, D),
             dt_bias=_rnd(g, H * D, dtype=F32, scale=0.5), q=_rnd(g, B, T, H, D), k=_rnd(g, B, T, H, D),
             v=_rnd(g, B, T, H, D), b=_rnd(g, B, T, H), initial_state_source=_rnd(g, N, H, D, D, scale=0.1),
             initial_state_indices=torch.tensor([2, 0], dtype=I32), k_cache=k_cache, u_cache=u_cache,
             g_cache=g_cache, hist_len=hist_len, cache_base=cache_base,
             output=torch.full((B, T, H, D), SENTINEL, dtype=BF16))

    def prepare(a):
        x = dict(a)
        return lambda: kda_delta_rule_mtp_ucache_flush(x.pop("A_log"), x.pop("g"), x.pop("dt_bias"), LB, **x)

    return a, prepare, ("initial_state_source", "k_cache", "u_cache", "g_cache", "hist_len", "cache_base", "output")


def case_recoverssm_verify_commit():
    g = torch.Generator().manual_seed(8)
    H, T, blocks = 8, 4, 5
    n = 2
    a = {**{name: t.view(1, n * T, *t.shape[2:]) for name, t in _activations(g, n, T, H).items()}, **_gate(g, H),
         "pool": _rnd(g, blocks, H, D, D, dtype=F32, scale=0.1), "corr": torch.zeros(blocks, H, T, D),
         "kg": torch.zeros(blocks, H, T, 2 * D, dtype=BF16), "qsl": torch.tensor([0, T, 2 * T], dtype=I32),
         "slots": torch.tensor([3, 1], dtype=I32), "nat": torch.tensor([2, 4], dtype=I32),
         "out": torch.full((1, n * T, H, D), SENTINEL, dtype=BF16)}

    def prepare(a):
        def step():
            kimi_k3.kda_recoverssm_verify(a["q"], a["k"], a["v"], a["g"], a["beta"], a["A_log"], a["dt_bias"], LB,
                                          a["pool"], a["corr"], a["kg"], a["qsl"], a["slots"], T, out=a["out"])
            recoverssm_commit(a["pool"], a["corr"], a["kg"], a["slots"], a["nat"], a["A_log"], a["dt_bias"], LB,
                              query_start_loc=a["qsl"], null_policy="nonpositive")
            return a["out"]

        return step

    return a, prepare, ("pool", "corr", "kg", "out")


def case_recoverssm_layers():
    g = torch.Generator().manual_seed(9)
    H, T, blocks, L = 4, 4, 4, 2
    a = {"slots": torch.tensor([2, -1, 1], dtype=I32), "nat": torch.tensor([3, 4, 9], dtype=I32)}
    for i in range(L):
        a.update({f"pool{i}": _rnd(g, blocks, H, D, D, dtype=F32, scale=0.1),
                  f"corr{i}": _rnd(g, blocks, H, T, D, dtype=F32, scale=0.1),
                  f"kg{i}": _rnd(g, blocks, H, T, 2 * D), f"A_log{i}": _rnd(g, H, dtype=F32, scale=0.5),
                  f"dt_bias{i}": _rnd(g, H * D, dtype=F32, scale=0.1)})

    def prepare(a):  # the plan (stacked gate parameters, per-layer offsets) is built outside any capture
        ctx = RecoverSSMCommit(*([a[f"{name}{i}"] for i in range(L)] for name in ("pool", "corr", "kg", "A_log",
                                                                                   "dt_bias")), LB)

        def step():
            ctx.commit(a["slots"], a["nat"])
            return a["pool0"]

        return step

    return a, prepare, tuple(f"pool{i}" for i in range(L))


def case_packed_fused_decode():  # the multi-token fused layer, where kda-recurrent has it
    import kda_recurrent

    g = torch.Generator().manual_seed(10)
    H, T, lengths = 8, 4, [2, 1, 3]
    rows, n_tok, HK = len(lengths), sum(lengths), H * D
    C, width, n_slots = 3 * HK, T + 2, len(lengths) * T + 2
    page = C * width + 24
    conv = torch.empty(n_slots * page, dtype=BF16).as_strided((n_slots, C, width), (page, 1, C))
    conv.copy_(_rnd(g, n_slots, C, width, scale=0.5))
    a = dict(x=_rnd(g, n_tok, C + 17)[:, :C], weight=_rnd(g, 3, 4, HK, dtype=F32, scale=0.3), conv_state=conv,
             raw_gate=_rnd(g, 1, n_tok, H, D), raw_beta=_rnd(g, 1, n_tok, H + 1)[:, :, :H], **_gate(g, H),
             state_indices=(torch.randperm(n_slots - 1, generator=g)[: rows * T] + 1).view(rows, T).to(I32),
             state=_rnd(g, n_slots, H, D, D, dtype=F32, scale=0.05), output_gate=_rnd(g, n_tok, H, D),
             norm_weight=_rnd(g, D, dtype=F32), query_start_loc=torch.tensor([0, 2, 3, 6], dtype=I32),
             num_accepted_tokens=torch.tensor([2, 1, 3], dtype=I32))
    return a, lambda a: (lambda: kda_recurrent.packed_fused_kda_decode(**a)), ("conv_state", "state")


if not hasattr(__import__("kda_recurrent"), "packed_fused_kda_decode"):
    del case_packed_fused_decode

CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}
DIRECTIONS = [pytest.param(1, 0, id="tensors_on_1_current_0", marks=TWO),
              pytest.param(0, 1, id="tensors_on_0_current_1", marks=TWO)]
STREAM_DEVICES = [pytest.param(0, 0, id="one_gpu"), pytest.param(1, 0, id="tensors_on_1_current_0", marks=TWO),
                  pytest.param(0, 1, id="tensors_on_0_current_1", marks=TWO)]


def _clone(x, device):
    if not isinstance(x, torch.Tensor):
        return x
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device).copy_(x)


def _on(inputs, device):
    return {name: _clone(t, device) for name, t in inputs.items()}


def _results(value, inputs, written):
    """The thunk's return value (tensors, flattened) and the written inputs, on the CPU."""
    out = value if isinstance(value, tuple) else (value,)
    return [t.detach().cpu() for t in out if isinstance(t, torch.Tensor)] + [inputs[n].cpu() for n in written]


def _assert_close(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape and a.dtype == b.dtype, i
        if a.is_floating_point():
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2, msg=f"result {i}")
        else:
            assert torch.equal(a, b), i


def _run(name, device, current):
    inputs, prepare, written = CASES[name]()
    on = _on(inputs, device)
    with torch.cuda.device(current):
        value = prepare(on)()
        assert torch.cuda.current_device() == current  # nothing left the caller's device switched
    torch.cuda.synchronize(device)
    return _results(value, on, written)


@pytest.mark.parametrize("device, current", DIRECTIONS)
@pytest.mark.parametrize("name", list(CASES))
def test_an_entry_on_another_device_matches_the_oracle_and_its_own_device(name, device, current):
    inputs, prepare, written = CASES[name]()
    cpu = _on(inputs, "cpu")
    want = _results(prepare(cpu)(), cpu, written)
    got = _run(name, device, current)
    _assert_close(got, want)
    same_device = _run(name, device, device)
    assert len(got) == len(same_device)
    for a, b in zip(got, same_device):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device, current", STREAM_DEVICES)
@pytest.mark.parametrize("name", list(CASES))
def test_an_entry_launches_on_the_current_stream_of_the_tensors_device(name, device, current):
    expected = _run(name, device, device)
    inputs, prepare, written = CASES[name]()
    on = _on(inputs, device)
    before = [on[n].clone() for n in written]
    thunk = prepare(on)
    torch.cuda.synchronize(device)
    start = torch.cuda.current_device()
    side = torch.cuda.Stream(device=device)
    torch.cuda.set_stream(side)  # the tensors' device's current stream (this also makes that device current) ...
    torch.cuda.set_device(current)  # ... and the caller back on its device; the tensors' device keeps `side`
    try:
        assert torch.cuda.current_stream(device) == side
        with torch.cuda.stream(side):
            torch.cuda._sleep(1 << 31)  # ~1 s of GPU cycles: whatever follows on `side` waits
        torch.cuda.set_device(current)
        value = thunk()
        # On the tensors' device's default stream, while `side` still sleeps: a kernel on any stream but `side`
        # would have written by now; one on `side` has not started.
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
    assert any(not torch.equal(on[n].cpu(), b.cpu()) for n, b in zip(written, before))  # the check saw a write
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device, current", DIRECTIONS)
@pytest.mark.parametrize("name", list(CASES))
def test_a_cuda_graph_captured_on_the_tensors_device_replays_from_the_other(name, device, current):
    expected = _run(name, device, device)  # eager (and compiles every kernel before the capture)
    inputs, prepare, written = CASES[name]()
    on = _on(inputs, device)
    thunk = prepare(on)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.device(current):
        with torch.cuda.graph(graph, stream=torch.cuda.Stream(device=device)):
            value = thunk()
        graph.replay()
    torch.cuda.synchronize(device)
    got = _results(value, on, written)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


@pytest.mark.multi_gpu
@pytest.mark.skipif(GPUS < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("name", list(CASES))
def test_a_call_with_one_tensor_on_the_other_device_is_refused_before_launch(name):
    """After a good call (the hot paths then re-validate only what the compiled wrappers cannot check), each input
    in turn on the other device: a KDAError that names a device, never a wrapper's ValueError or a launch."""
    from kda_core.errors import KDAError

    inputs, prepare, written = CASES[name]()
    prepare(_on(inputs, 1))()  # described and compiled: the next calls with these facts are hot
    torch.cuda.synchronize(1)
    for moved in [n for n, t in inputs.items() if isinstance(t, torch.Tensor)]:
        on = _on(inputs, 1)
        on[moved] = on[moved].to(0)
        with torch.cuda.device(0), pytest.raises(KDAError) as info:
            prepare(on)()
        msg = str(info.value)
        assert ": expected " in msg and "cuda:" in msg, (moved, msg)
    torch.cuda.synchronize(1)
