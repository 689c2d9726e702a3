"""``torch.compile(fullgraph=True)`` of a KDA decode layer, and CUDA-graph capture of the compiled layer.

The facade runs as the ``kda::recurrent_kda`` custom op inside compiled graphs (pool and output declared mutated,
a fake implementation for tracing). On the CPU the graphs are built with the ``aot_eager`` backend (functionalisation
and the fake implementation are exercised without a C++ toolchain); on the GPU with inductor, then captured.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kda_core.contracts import GateMode, NullSlotPolicy
from kda_core.oracle import recurrent_kda_ref, recurrent_kda_ref_args
from kda_recurrent import facade
from kda_recurrent.facade import Path, recurrent_kda

BF16 = torch.bfloat16
HAS_CUDA = torch.cuda.is_available()


class DecodeLayer(torch.nn.Module):
    """A Kimi K3-shaped KDA layer at decode: fused q/k/v/gate/beta projection, recurrent_kda on a pool, o_proj."""

    def __init__(self, hidden=256, H=8, K=128, lower_bound=-5.0):
        super().__init__()
        self.H, self.K, self.lower_bound = H, K, lower_bound
        self.in_proj = torch.nn.Linear(hidden, 4 * H * K + H, bias=False, dtype=BF16)
        self.o_proj = torch.nn.Linear(H * K, hidden, bias=False, dtype=BF16)
        self.A_log = torch.nn.Parameter(torch.randn(H) * 0.5, requires_grad=False)
        self.dt_bias = torch.nn.Parameter(torch.randn(H * K), requires_grad=False)

    def forward(self, hidden, pool, slots, output=None):
        B, T, _ = hidden.shape
        H, K = self.H, self.K
        proj = self.in_proj(hidden)
        q, k, v, g = (proj[..., i * H * K : (i + 1) * H * K].view(B, T, H, K) for i in range(4))
        beta = proj[..., 4 * H * K :]
        o, _ = recurrent_kda(q, k, v, g, beta, A_log=self.A_log, dt_bias=self.dt_bias, initial_state=pool,
                             use_gate_in_kernel=True, lower_bound=self.lower_bound, beta_is_logit=True,
                             ssm_state_indices=slots, output=output)
        return self.o_proj(o.reshape(B, T, H * K))


def make_layer(device, seed=0):
    torch.manual_seed(seed)
    layer = DecodeLayer().to(device)
    layer.in_proj.weight.data.mul_(0.2)
    return layer


def pool_and_slots(device, B=4, N=12, H=8, K=128, T=1):
    pool = (torch.randn(N, H, K, K) * 0.1).to(device=device, dtype=BF16)
    if T == 1:
        slots = torch.tensor([(5 * b + 2) % N for b in range(B)], dtype=torch.int32, device=device)
        slots[-1] = -1  # a padding row
    else:
        slots = torch.arange(B * T, dtype=torch.int32, device=device).reshape(B, T) % N
    return pool, slots


@pytest.mark.parametrize("T", [1, 2])
def test_fullgraph_compile_matches_eager_on_cpu(T):
    layer = make_layer("cpu")
    pool, slots = pool_and_slots("cpu", T=T)
    hidden = torch.randn(4, T, 256, dtype=BF16)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    pool_c, pool_e = pool.clone(), pool.clone()
    y_c = compiled(hidden, pool_c, slots)
    y_e = layer(hidden, pool_e, slots)
    torch.testing.assert_close(y_c, y_e, rtol=0, atol=0)
    torch.testing.assert_close(pool_c, pool_e, rtol=0, atol=0)
    assert not torch.equal(pool_c, pool)  # the mutation reached the caller's pool


def test_compiled_dense_call_returns_the_final_state_on_cpu():
    gen = torch.Generator().manual_seed(3)
    q, k, v, g = (torch.randn(2, 3, 4, 64, generator=gen).to(BF16) for _ in range(4))
    beta = torch.rand(2, 3, 4, generator=gen)
    h0 = torch.randn(2, 4, 64, 64, generator=gen)

    def step(q, k, v, g, beta, h0):
        o, final = recurrent_kda(q, k, v, -g.float().abs(), beta, initial_state=h0, output_final_state=True)
        return o, final * 2

    o_c, s_c = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, g, beta, h0)
    o_r, s_r = recurrent_kda_ref(q, k, v, -g.float().abs(), beta, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o_c, o_r, rtol=0, atol=0)
    torch.testing.assert_close(s_c, s_r * 2, rtol=0, atol=0)


def test_routing_runs_when_the_compiled_graph_runs_not_when_it_is_traced(monkeypatch):
    """A compiled layer keeps obeying KDA_T1_FAST_PATH: the op body routes at run time."""
    paths = []
    real_validate = facade._validate

    def as_if_cuda(args):
        call = real_validate(args)
        eligible = call.t1_eligible or "tensors not on a CUDA device" in call.t1_reason
        return dataclasses.replace(call, on_cuda=True, t1_eligible=eligible)

    def t1(call, q, k, v, g, beta, pool, slots, A_log, dt_bias, l2norm, out, null_policy):
        paths.append((Path.T1, null_policy))
        out.copy_(recurrent_kda_ref(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=pool,
                                    use_gate_in_kernel=call.gate_mode is not GateMode.PRECOMPUTED,
                                    lower_bound=call.lower_bound,
                                    beta_is_logit=call.beta_is_logit, ssm_state_indices=slots,
                                    null_policy=null_policy)[0])
        return out

    def generic(call, args, *, null_policy):
        paths.append((Path.GENERIC, null_policy))
        return recurrent_kda_ref_args(args, null_policy=null_policy)

    monkeypatch.setattr(facade, "_validate", as_if_cuda)
    monkeypatch.setattr(facade, "_t1_kernel", t1)
    monkeypatch.setattr(facade, "_generic_kernel", generic)
    monkeypatch.delenv("KDA_T1_FAST_PATH", raising=False)
    layer = make_layer("cpu")
    pool, slots = pool_and_slots("cpu")
    hidden = torch.randn(4, 1, 256, dtype=BF16)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    compiled(hidden, pool, slots)
    monkeypatch.setenv("KDA_T1_FAST_PATH", "0")
    compiled(hidden, pool, slots)
    default = NullSlotPolicy.OUT_OF_RANGE
    assert paths == [(Path.T1, default), (Path.GENERIC, default)]


def test_the_null_policy_goes_through_the_op_as_its_string(monkeypatch):
    """The op's schema has no enum: the traced call passes the policy's string value and the body converts it."""
    seen = []
    real = facade.recurrent_kda

    def spy(*args, **kw):
        seen.append(kw.get("null_policy"))
        return real(*args, **kw)

    monkeypatch.setattr(facade, "recurrent_kda", spy)
    B, H, K, N = 3, 8, 128, 4
    q, k, v, g = (torch.randn(B, 1, H, K, dtype=BF16) for _ in range(4))
    beta = torch.rand(B, 1, H, dtype=BF16)
    pool = torch.randn(N, H, K, K, dtype=BF16) * 0.1
    slots = torch.tensor([0, 2, -1], dtype=torch.int32)

    def layer(q, k, v, g, beta, pool, slots):
        return recurrent_kda(q, k, v, -g.float().abs(), beta.float(), initial_state=pool, ssm_state_indices=slots,
                             null_policy=NullSlotPolicy.NONPOSITIVE)[0]

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    ref_pool = pool.clone()
    o = compiled(q, k, v, g, beta, pool, slots)
    o_ref, _ = recurrent_kda_ref(q, k, v, -g.float().abs(), beta.float(), initial_state=ref_pool,
                                 ssm_state_indices=slots, null_policy="nonpositive")
    assert seen == ["nonpositive"]
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(pool, ref_pool, rtol=0, atol=0)
    assert bool(o[0].eq(0).all())  # slot 0 is null


# ---------------------------------------------------------------------------------------------------------------
# GPU: inductor, then CUDA-graph capture of the compiled layer.


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("T", [1, 4])
def test_gpu_compiled_layer_captures_into_a_cuda_graph_and_replays_like_eager(T):
    layer = make_layer("cuda")
    B = 4
    pool, slots = pool_and_slots("cuda", B=B, T=T, N=24)
    compiled = torch.compile(layer, fullgraph=True)

    static_hidden = torch.zeros(B, T, 256, dtype=BF16, device="cuda")
    static_out = torch.empty(B, T, 8, 128, dtype=BF16, device="cuda")
    graph_pool = pool.clone()
    warm_pool = pool.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile, load modules, settle the allocator before capture
            compiled(static_hidden, warm_pool, slots, static_out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = compiled(static_hidden, graph_pool, slots, static_out)

    eager_pool = pool.clone()
    gen = torch.Generator(device="cuda").manual_seed(7)
    for _ in range(3):  # three decode steps: the pool carries state between replays
        hidden = torch.randn(B, T, 256, generator=gen, device="cuda").to(BF16)
        static_hidden.copy_(hidden)
        graph.replay()
        y_eager = layer(hidden, eager_pool, slots)
        torch.testing.assert_close(static_y, y_eager, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(graph_pool.float(), eager_pool.float(), rtol=2e-2, atol=2e-2)
    assert not torch.equal(graph_pool, pool)


def test_the_gathered_states_of_1d_indices_come_out_of_the_compiled_graph():
    B, H, K, N = 3, 8, 128, 5
    q, k, v, g = (torch.randn(B, 1, H, K, dtype=BF16) for _ in range(4))
    beta = torch.rand(B, 1, H, dtype=BF16)
    pool = torch.randn(N, H, K, K, dtype=BF16) * 0.1
    pool[-1] = 7.0
    slots = torch.tensor([-1, 2, 0], dtype=torch.int32)

    def layer(q, k, v, g, beta, pool, slots):
        return recurrent_kda(q, k, v, -g.float().abs(), beta.float(), initial_state=pool, ssm_state_indices=slots,
                             output_final_state=True)

    eager_pool = pool.clone()
    o_e, s_e = layer(q, k, v, g, beta, eager_pool, slots)
    o_c, s_c = torch.compile(layer, fullgraph=True, backend="aot_eager")(q, k, v, g, beta, pool, slots)
    torch.testing.assert_close(o_c, o_e, rtol=0, atol=0)
    torch.testing.assert_close(s_c, s_e, rtol=0, atol=0)
    torch.testing.assert_close(pool, eager_pool, rtol=0, atol=0)
    assert s_c.shape == (B, H, K, K) and s_c.dtype == BF16 and bool(s_c[0].eq(0).all())
