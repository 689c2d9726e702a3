"""FlashInfer's padded-slot regression inputs through ``kda_recurrent.recurrent_kda`` (docs/serving.md §5).

FlashInfer's ``tests/kda/test_recurrent_kda_dense_padded_ssi.py`` (flashinfer-ai/flashinfer; two stored versions
read: @ aaea00240397d7718f9a5b8332abb0fc132b7051, the one docs/serving.md cites, and
@ 3f257633153f9f08457fee61aec38085486ce9ea, which adds the D = 128 softplus case and expects the pool back as the
final state) guards against its dense T=1 path wrapping a -1 slot index to the last pool slot
(flashinfer-ai/flashinfer#5042). Its inputs, rebuilt here (no code taken from it):

- dense T=1, H = 32, D = 64, bf16 activations and a bf16 pool of 5 slots (8 in the CUDA-graph case), all zero but
  for the last slot, filled with the sentinel 7.0, and the active slots, 0.01 * randn;
- slot indices [-1, 3] (B = 2) or [-1, 1, -1, 3] (B = 4), int32, 1-D;
- q, k, v uniform in [0, 1); a precomputed gate ``logsigmoid(randn)``; beta already sigmoided (``sigmoid(rand)``);
  scale D^-0.5; in-kernel L2 norm;
- a second case at D = 128 with the in-kernel softplus gate (A_log = log U(1, 16), dt_bias randn, raw gate randn),
  B = 2, indices [-1, 3];
- ``backend`` in {"cute-dsl", "auto"} (kda runs its own kernels for both; here also the call without it).

What is checked (kda's null policy: -1 is null and never wraps): the last slot and every slot no row names (slot 0
included) are bitwise unchanged, the active slots changed and match kda-core's oracle, the -1 rows' outputs are
zero; with ``output_final_state=True`` the returned state is the pool or per-row states whose -1 rows are zero.
On a GPU the same under CUDA-graph capture and replay. On the CPU the facade runs the oracle (the plumbing).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kda_core.oracle import recurrent_kda_ref
from kda_recurrent import recurrent_kda

BF16 = torch.bfloat16
HAS_CUDA = torch.cuda.is_available()
H = 32
SENTINEL = 7.0
CASES = {  # name: (B, D, pool slots, slot indices, gate)
    "grouped-B2-H32": (2, 64, 5, [-1, 3], "precomputed"),
    "onewarp-B4-H32": (4, 64, 5, [-1, 1, -1, 3], "precomputed"),
    "softplus-B2-D128": (2, 128, 5, [-1, 3], "softplus"),
}
BACKENDS = [None, "cute-dsl", "auto"]  # None: the call without the keyword


def make_call(device, B, D, n_slots, slots, gate, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def put(t, dtype=BF16):
        return t.to(device=device, dtype=dtype)

    pool = torch.zeros(n_slots, H, D, D, dtype=BF16)
    pool[-1] = SENTINEL
    active = sorted({s for s in slots if s >= 0})
    for s in active:
        pool[s] = torch.randn(H, D, D, generator=gen) * 0.01
    kw = dict(
        q=put(torch.rand(B, 1, H, D, generator=gen)),
        k=put(torch.rand(B, 1, H, D, generator=gen)),
        v=put(torch.rand(B, 1, H, D, generator=gen)),
        beta=put(torch.rand(B, 1, H, generator=gen).sigmoid()),
        scale=D ** -0.5,
        initial_state=put(pool),
        use_qk_l2norm_in_kernel=True,
        ssm_state_indices=torch.tensor(slots, dtype=torch.int32, device=device),
    )
    if gate == "precomputed":
        kw.update(g=put(F.logsigmoid(torch.randn(B, 1, H, D, generator=gen))), use_gate_in_kernel=False)
    else:
        kw.update(g=put(torch.randn(B, 1, H, D, generator=gen)), use_gate_in_kernel=True, lower_bound=None,
                  A_log=put(torch.log(torch.empty(H).uniform_(1, 16, generator=gen)), torch.float32),
                  dt_bias=put(torch.randn(H * D, generator=gen), torch.float32))
    return kw, active


def oracle(kw):
    ref = dict(kw, initial_state=kw["initial_state"].clone())
    return recurrent_kda_ref(**ref)


def check_pool(pool, before, ref_pool, active, what):
    for s in range(pool.shape[0]):
        if s in active:
            assert (pool[s].float() - before[s].float()).abs().max().item() > 0, f"{what}: active slot {s} unchanged"
        else:
            assert torch.equal(pool[s].view(torch.int16), before[s].view(torch.int16)), f"{what}: slot {s} written"
    assert bool((pool[-1] == SENTINEL).all()), f"{what}: the sentinel slot changed"
    idx = torch.tensor(active, device=pool.device)
    torch.testing.assert_close(pool[idx].float(), ref_pool[idx].float(), rtol=2e-2, atol=2e-2)


def check_call(kw, active, backend, output_final_state=False, exact=False):
    before = kw["initial_state"].clone()
    o_ref, ref_pool = oracle(kw)
    extra = {} if backend is None else {"backend": backend}
    o, final = recurrent_kda(**kw, output_final_state=output_final_state, **extra)
    pool = kw["initial_state"]
    check_pool(pool, before, ref_pool, active, f"backend={backend}")
    t = dict(rtol=0, atol=0) if exact else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(o, o_ref, **t)
    null_rows = [r for r, s in enumerate(kw["ssm_state_indices"].tolist()) if s < 0]
    assert int(torch.count_nonzero(o[null_rows])) == 0
    return final, null_rows


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: str(b))
@pytest.mark.parametrize("case", sorted(CASES))
def test_cpu_flashinfer_padded_slot_inputs(case, backend):
    kw, active = make_call("cpu", *CASES[case])
    final, _ = check_call(kw, active, backend, exact=True)
    assert final is kw["initial_state"]


def _check_final_state(final, kw, null_rows):
    """FlashInfer returns the pool or (its open fix aside) the per-row states; either way a -1 row is no slot."""
    pool = kw["initial_state"]
    if final is pool:
        return
    B = kw["q"].shape[0]
    assert tuple(final.shape) == (B, *pool.shape[1:]), tuple(final.shape)
    assert int(torch.count_nonzero(final[null_rows])) == 0, "a -1 row's final state is not zero (a wrapped slot?)"
    for r, s in enumerate(kw["ssm_state_indices"].tolist()):
        if s >= 0:
            torch.testing.assert_close(final[r].float(), pool[s].float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("case", sorted(CASES))
def test_cpu_flashinfer_padded_slot_inputs_with_output_final_state(case):
    kw, active = make_call("cpu", *CASES[case])
    final, null_rows = check_call(kw, active, None, output_final_state=True, exact=True)
    _check_final_state(final, kw, null_rows)


# ---------------------------------------------------------------------------------------------------------------
# GPU: the kernels, eager and under CUDA-graph replay


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: str(b))
@pytest.mark.parametrize("case", sorted(CASES))
def test_gpu_flashinfer_padded_slot_inputs(case, backend):
    kw, active = make_call("cuda", *CASES[case])
    final, null_rows = check_call(kw, active, backend)
    assert final is kw["initial_state"]
    kw, active = make_call("cuda", *CASES[case], seed=1)
    final, null_rows = check_call(kw, active, backend, output_final_state=True)
    _check_final_state(final, kw, null_rows)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: str(b))
@pytest.mark.parametrize("case", ["graph-B4-H32-8slots", "softplus-B2-D128"])
def test_gpu_flashinfer_padded_slot_inputs_under_cuda_graph_replay(case, backend):
    spec = (4, 64, 8, [-1, 1, -1, 3], "precomputed") if case.startswith("graph") else CASES[case]
    kw, active = make_call("cuda", *spec, seed=1)
    out = torch.empty_like(kw["v"])
    extra = {} if backend is None else {"backend": backend}

    def run():  # with output_final_state=True, as FlashInfer's graph case calls it
        recurrent_kda(**kw, output=out, output_final_state=True, **extra)

    run()  # eager first (compiles the kernel), as FlashInfer's test does
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    pool = kw["initial_state"]
    for step in range(3):
        before = pool.clone()
        o_ref, ref_pool = oracle(kw)
        graph.replay()
        torch.cuda.synchronize()
        check_pool(pool, before, ref_pool, active, f"replay {step}")
        torch.testing.assert_close(out, o_ref, rtol=2e-2, atol=2e-2)
        assert int(torch.count_nonzero(out[[r for r, s in enumerate(spec[3]) if s < 0]])) == 0
