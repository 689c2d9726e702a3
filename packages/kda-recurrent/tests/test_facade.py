"""``recurrent_kda`` against the kda-core oracle, in every state mode, on whatever device the machine has.

On the CPU every call runs the oracle (the plumbing is under test: what is returned, what is written in place, what
is left alone). On a GPU (``@pytest.mark.gpu``) the same cases run the kernels and are held to bf16 tolerances.
"""

from __future__ import annotations

import doctest

import pytest
import torch

from kda_core.oracle import recurrent_kda_ref
from kda_recurrent import facade
from kda_recurrent.facade import Path, explain, recurrent_kda

BF16 = torch.bfloat16
HAS_CUDA = torch.cuda.is_available()


def make_call(device, *, B=4, T=1, H=12, HV=None, K=128, mode="pool", N=16, pool_dtype=BF16, seed=0,
              lower_bound=-5.0, pad_pool_stride=False):
    """Keyword arguments of one Kimi K3-style call (in-kernel lower-bound gate, beta logits).

    mode: "pool" (1-D slots with a padding row), "spec" (2-D slots, heterogeneous accepted counts, one padded
    token), "varlen" (cu_seqlens with a zero-length sequence), "dense" (dense initial states, final state out).
    """
    HV = HV or H
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, dtype=BF16, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

    def i32(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    Bq, Tq = (1, 3 * T + 1) if mode == "varlen" else (B, T)
    kw = dict(
        q=rnd(Bq, Tq, H, K), k=rnd(Bq, Tq, H, K), v=rnd(Bq, Tq, HV, K), g=rnd(Bq, Tq, HV, K),
        beta=rnd(Bq, Tq, HV), A_log=rnd(H, dtype=torch.float32, scale=0.5), dt_bias=rnd(H * K, dtype=torch.float32),
        use_gate_in_kernel=True, lower_bound=lower_bound, beta_is_logit=True,
    )
    if mode == "dense":
        kw.update(initial_state=rnd(B, HV, K, K, dtype=torch.float32, scale=0.1), output_final_state=True)
        return kw
    rows = N + 3 if pad_pool_stride else N
    storage = rnd(rows * HV * K * K, dtype=pool_dtype, scale=0.1)
    row_stride = HV * K * K + (24 if pad_pool_stride else 0)
    kw["initial_state"] = storage.as_strided((N, HV, K, K), (row_stride, K * K, K, 1))
    if mode == "pool":
        slots = [(3 * b + 1) % N for b in range(B)]
        slots[B // 2] = -1  # a CUDA-graph padding row
        kw["ssm_state_indices"] = i32(slots)
    elif mode == "spec":
        idx = torch.arange(B * T).reshape(B, T) % N
        idx[B - 1, T - 1] = N + 5  # a padded token slot past the pool: skipped
        kw["ssm_state_indices"] = idx.to(device=device, dtype=torch.int32)
        kw["num_accepted_tokens"] = i32([1 + (b * 3) % T for b in range(B)])
    elif mode == "varlen":
        kw["cu_seqlens"] = i32([0, T, T, 3 * T, 3 * T + 1])  # a zero-length second sequence
        kw["ssm_state_indices"] = i32([2, 5, 9, 11])
    return kw


def flat_storage(state):
    """Every element of the state's storage, padding between pool rows included."""
    return state.as_strided((state.untyped_storage().nbytes() // state.element_size(),), (1,), 0)


_READ_ONLY = ("ssm_state_indices", "num_accepted_tokens", "cu_seqlens")


def copy_call(kw):
    """A deep copy of the call; the pool keeps its strides (and its padding) in a storage of its own, and the index
    tensors (never written) are shared as they are, strided views included."""
    out = {n: (t.clone() if isinstance(t, torch.Tensor) and n not in _READ_ONLY else t) for n, t in kw.items()}
    s = kw.get("initial_state")
    if s is not None:
        out["initial_state"] = flat_storage(s).clone().as_strided(s.shape, s.stride(), s.storage_offset())
    return out


def padding_of(state):
    """The storage elements no pool row covers (a padded dim-0 stride)."""
    covered = torch.zeros(flat_storage(state).numel(), dtype=torch.bool, device=state.device)
    covered.as_strided(state.shape, state.stride(), state.storage_offset()).fill_(True)
    return flat_storage(state)[~covered]


def tol(dtype):
    return dict(rtol=2e-2, atol=2e-2) if dtype == BF16 else dict(rtol=1e-3, atol=1e-3)


def check_against_oracle(kw, exact, *, ran=None, **policy):
    """Run the facade and the oracle on copies of ``kw`` and compare; ``ran``: a dict that receives the facade's
    copy of the call."""
    mine, ref = copy_call(kw), copy_call(kw)
    if ran is not None:
        ran.update(mine)
    o, final = recurrent_kda(**mine, **policy)
    o_ref, final_ref = recurrent_kda_ref(**ref, **policy)
    t = dict(rtol=0, atol=0) if exact else tol(BF16)
    torch.testing.assert_close(o, o_ref, **t)
    if "ssm_state_indices" in kw:
        pool = mine["initial_state"]
        assert final is pool
        torch.testing.assert_close(pool.float(), ref["initial_state"].float(), **(t if exact else tol(pool.dtype)))
        assert torch.equal(padding_of(pool), padding_of(kw["initial_state"]))
    else:
        torch.testing.assert_close(final, final_ref, **(t if exact else tol(torch.float32)))
    return o


CASES = [
    dict(mode="pool"),
    dict(mode="pool", pool_dtype=torch.float32),
    dict(mode="pool", pad_pool_stride=True),
    dict(mode="pool", lower_bound=None),
    dict(mode="spec", T=4),
    dict(mode="varlen", T=2),
    dict(mode="dense", T=3),
    dict(mode="pool", T=2, H=4, HV=8),
    dict(mode="pool", T=2, K=64),
]
IDS = ["pool", "fp32-pool", "padded-pool", "softplus-gate", "spec-T4", "varlen", "dense-T3", "gqa", "K64"]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_cpu_facade_returns_the_oracle_result_and_updates_the_pool_in_place(case):
    check_against_oracle(make_call("cpu", **case), exact=True)


def test_inactive_rows_have_zero_output_and_leave_the_pool_alone():
    kw = make_call("cpu")
    before = kw["initial_state"].clone()
    o, pool = recurrent_kda(**kw)
    pad = kw["ssm_state_indices"].tolist().index(-1)
    assert o[pad].eq(0).all()
    used = set(kw["ssm_state_indices"].tolist()) - {-1}
    untouched = [s for s in range(pool.shape[0]) if s not in used]
    assert torch.equal(pool[untouched], before[untouched])


def test_dense_call_without_final_state_returns_none():
    kw = make_call("cpu", mode="dense", T=2)
    kw["output_final_state"] = False
    _, final = recurrent_kda(**kw)
    assert final is None


def test_docstring_example_runs():
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in finder.find(facade.recurrent_kda, "recurrent_kda", globs={}):
        runner.run(test)
    assert runner.failures == 0 and runner.tries > 5


# ---------------------------------------------------------------------------------------------------------------
# GPU: the same cases through the kernels, and the two kernels against each other on T=1 calls.


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gpu_facade_matches_the_oracle(case):
    check_against_oracle(make_call("cuda", **case), exact=False)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("pool_dtype", [BF16, torch.float32])
@pytest.mark.parametrize("B", [1, 5, 64])
def test_gpu_fast_path_and_generic_path_agree_on_t1_calls(monkeypatch, pool_dtype, B):
    kw = make_call("cuda", B=B, N=2 * B + 3, pool_dtype=pool_dtype)
    monkeypatch.delenv("KDA_T1_FAST_PATH", raising=False)
    assert explain(**kw).path is Path.T1
    fast, generic = copy_call(kw), copy_call(kw)
    o_fast, pool_fast = recurrent_kda(**fast)
    monkeypatch.setenv("KDA_T1_FAST_PATH", "0")
    assert explain(**kw).path is Path.GENERIC
    o_gen, pool_gen = recurrent_kda(**generic)
    torch.testing.assert_close(o_fast, o_gen, **tol(BF16))
    torch.testing.assert_close(pool_fast.float(), pool_gen.float(), **tol(pool_dtype))
    # both also agree with the oracle, and neither touched a slot no row addressed
    check_against_oracle(kw, exact=False)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_t1_call_with_a_given_output_allocates_nothing():
    kw = make_call("cuda", B=8, N=32)
    out = torch.full(kw["v"].shape, 3.0, dtype=BF16, device="cuda")
    mine, ref = copy_call(kw), copy_call(kw)
    recurrent_kda(**copy_call(kw), output=out)  # warm-up: compile and module load
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    o, _ = recurrent_kda(**mine, output=out)
    after = torch.cuda.memory_stats()["allocation.all.allocated"]
    assert o is out and after == before
    o_ref, _ = recurrent_kda_ref(**ref)
    torch.testing.assert_close(out, o_ref, **tol(BF16))


# The facade's hot path: a T=1 call whose facts kda-core described before is re-validated from what the T=1 kernel's
# compiled wrapper cannot check, and the wrapper checks the rest before launch. A broken argument the wrapper owns
# still gets the full validator's KDAError (nothing written); a legal call the wrapper refuses takes its full route.
FACADE_WRAPPER_CHECKED = [
    ("k", lambda kw: kw["k"].float()),
    ("v", lambda kw: kw["v"][:2]),
    ("beta", lambda kw: kw["beta"][..., :4]),
    ("A_log", lambda kw: kw["A_log"].half()),
    ("ssm_state_indices", lambda kw: kw["ssm_state_indices"].short()),
    ("initial_state", lambda kw: kw["initial_state"].transpose(2, 3)),
    ("output", lambda kw: torch.zeros(kw["v"].shape, device="cuda")),
]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("argument, bad", FACADE_WRAPPER_CHECKED, ids=[a for a, _ in FACADE_WRAPPER_CHECKED])
def test_gpu_wrapper_checked_argument_after_a_good_call_raises_kdaerror_and_writes_nothing(argument, bad):
    from kda_core.errors import KDAError

    kw = make_call("cuda", B=4, N=16)
    kw["output"] = torch.empty(kw["v"].shape, dtype=BF16, device="cuda")
    recurrent_kda(**kw)  # described: the next call with these facts takes the hot path
    torch.cuda.synchronize()
    pool_before, out_before = kw["initial_state"].clone(), kw["output"].clone()
    with pytest.raises(KDAError, match=rf"^{argument}: expected"):
        recurrent_kda(**{**kw, argument: bad(kw)})
    torch.cuda.synchronize()
    assert torch.equal(kw["initial_state"], pool_before) and torch.equal(kw["output"], out_before)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_a_legal_call_the_t1_wrapper_refuses_takes_its_full_route():
    kw = make_call("cuda", B=4, N=16)
    recurrent_kda(**copy_call(kw))  # described as a T=1 pool call
    spec = {**kw, "ssm_state_indices": kw["ssm_state_indices"].view(4, 1)}  # 2-D slots, T=1: spec decode
    assert explain(**spec).path is Path.GENERIC
    check_against_oracle(spec, exact=False)


# ---------------------------------------------------------------------------------------------------------------
# GPU: both null-slot policies and the serving layouts (odd pool slot strides, strided int64 index views), on the
# T=1 kernel and the generic kernel, and the varlen decode form on the T=1 kernel's varlen entry.


def serving_layout(kw, pool_pad=17):
    """The same call with the pool in storage whose slot stride is ``pool_pad`` elements longer than the row (not a
    16-byte multiple for odd pads: the unaligned variant) and int64 slot indices / accepted counts as strided views
    of wider tables."""
    out = dict(kw)
    pool = kw["initial_state"]
    row = pool[0].numel()
    storage = torch.zeros(pool.shape[0] * (row + pool_pad), dtype=pool.dtype, device=pool.device)
    out["initial_state"] = storage.as_strided(pool.shape, (row + pool_pad, *pool.stride()[1:]))
    out["initial_state"].copy_(pool)
    idx = kw["ssm_state_indices"]
    if idx.dim() == 1:
        wide = torch.full((idx.shape[0], 3), -7, dtype=torch.int64, device=idx.device)
        out["ssm_state_indices"] = wide[:, 1]
    else:
        wide = torch.full((idx.shape[0], 2 * idx.shape[1] + 1), -7, dtype=torch.int64, device=idx.device)
        out["ssm_state_indices"] = wide[:, 1::2]
    out["ssm_state_indices"].copy_(idx)
    if kw.get("num_accepted_tokens") is not None:
        nat = kw["num_accepted_tokens"]
        out["num_accepted_tokens"] = torch.zeros(nat.shape[0], 2, dtype=torch.int64, device=nat.device)[:, 0]
        out["num_accepted_tokens"].copy_(nat)
    return out


def with_slot_zero(kw):
    """Point the first live row (or token) at slot 0: live under OUT_OF_RANGE, null under NONPOSITIVE."""
    kw = dict(kw)
    idx = kw["ssm_state_indices"].clone()
    idx.view(-1)[0] = 0
    kw["ssm_state_indices"] = idx
    return kw


POLICY_PATHS = {
    "t1": (dict(mode="pool"), Path.T1),
    "generic-pool-T2": (dict(mode="pool", T=2), Path.GENERIC),
    "generic-spec-T4": (dict(mode="spec", T=4), Path.GENERIC),
}


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", ["compact", "serving"])
@pytest.mark.parametrize("pool_dtype", [BF16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("policy", ["out_of_range", "nonpositive"])
@pytest.mark.parametrize("case", list(POLICY_PATHS))
def test_gpu_null_policy_and_serving_layouts_match_the_oracle(case, policy, pool_dtype, layout):
    shape, path = POLICY_PATHS[case]
    kw = with_slot_zero(make_call("cuda", pool_dtype=pool_dtype, seed=11, **shape))
    if layout == "serving":
        kw = serving_layout(kw)
    assert explain(**kw, null_policy=policy).path is path
    ran = {}
    o = check_against_oracle(kw, exact=False, ran=ran, null_policy=policy)
    # row 0 reads slot 0 (1-D), or reads and writes it at token 0 (2-D, accepted count 1): null under NONPOSITIVE
    assert torch.equal(ran["initial_state"][0], kw["initial_state"][0]) is (policy == "nonpositive")
    assert bool(o[0].eq(0).all()) is (policy == "nonpositive")


def varlen_decode(device, lens, cu_dtype, seed=0, pool_dtype=BF16):
    """[1, T, 12, 128] tokens of sequences of the given lengths + cu_seqlens, pool mode; slot 0 on sequence 1."""
    T = sum(lens)
    kw = make_call(device, B=1, T=T, seed=seed, pool_dtype=pool_dtype)
    n = len(lens)
    kw["cu_seqlens"] = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=cu_dtype, device=device)
    slots = [(2 * i + 3) % 16 for i in range(n)]
    slots[1] = 0
    if n > 3:
        slots[3] = -1  # a padding sequence
    kw["ssm_state_indices"] = torch.tensor(slots, dtype=torch.int32, device=device)
    return kw


VARLEN_LENS = {"decode": [1, 1, 1, 1, 1, 1], "mixed": [0, 1, 3, 1, 0, 3]}


@pytest.mark.parametrize("lens", list(VARLEN_LENS))
@pytest.mark.parametrize("policy", ["out_of_range", "nonpositive"])
def test_cpu_varlen_decode_matches_the_oracle(lens, policy):
    check_against_oracle(varlen_decode("cpu", VARLEN_LENS[lens], torch.int32), exact=True, null_policy=policy)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("pool_dtype", [BF16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64], ids=["cu32", "cu64"])
@pytest.mark.parametrize("policy", ["out_of_range", "nonpositive"])
@pytest.mark.parametrize("lens", list(VARLEN_LENS))
def test_gpu_varlen_decode_takes_the_t1_kernel_and_matches_the_oracle(lens, policy, cu_dtype, pool_dtype):
    kw = varlen_decode("cuda", VARLEN_LENS[lens], cu_dtype, seed=5, pool_dtype=pool_dtype)
    route = explain(**kw, null_policy=policy)
    assert route.path is Path.T1_VARLEN, route
    o = check_against_oracle(kw, exact=False, null_policy=policy)
    cu = kw["cu_seqlens"].tolist()
    seq1 = o[:, cu[1]:cu[2]]  # the sequence at slot 0
    if seq1.numel():
        assert bool(seq1.eq(0).all()) is (policy == "nonpositive")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("with_output", [False, True], ids=["allocated", "output"])
def test_gpu_a_repeated_varlen_call_takes_the_hot_path_and_matches_the_oracle(with_output, monkeypatch):
    kw = varlen_decode("cuda", VARLEN_LENS["mixed"], torch.int32, seed=8)
    if with_output:
        kw["output"] = torch.full(kw["v"].shape, float("nan"), dtype=BF16, device="cuda")
    validations = []
    full = facade._validate
    monkeypatch.setattr(facade, "_validate", lambda args: validations.append(1) or full(args))
    # The first call is described by the full validator, unless an earlier test described the same facts (the
    # descriptions are remembered per process); every later call is re-validated on the hot path.
    check_against_oracle(kw, exact=False, null_policy="nonpositive")
    described = len(validations)
    assert described <= 1
    for _ in range(2):
        check_against_oracle(kw, exact=False, null_policy="nonpositive")
    assert len(validations) == described


# Broken after a good call of the same facts: arguments only the varlen wrapper checks on the hot path, and rules
# kda-core's varlen re-validator reads. Each gets the full validator's KDAError, with nothing written.
VARLEN_HOT_BAD = [
    ("k", lambda kw: kw["k"].float()),
    ("A_log", lambda kw: kw["A_log"].half()),
    ("cu_seqlens", lambda kw: kw["cu_seqlens"].view(-1, 1)),
    ("cu_seqlens", lambda kw: kw["cu_seqlens"].float()),
    ("ssm_state_indices", lambda kw: kw["ssm_state_indices"][:3]),
    ("initial_state", lambda kw: kw["initial_state"].transpose(2, 3)),
    ("output", lambda kw: torch.zeros(kw["v"].shape, device="cuda")),
    ("output", lambda kw: kw["q"]),
]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("argument, bad", VARLEN_HOT_BAD, ids=[f"{a}-{i}" for i, (a, _) in enumerate(VARLEN_HOT_BAD)])
def test_gpu_a_bad_varlen_call_after_a_good_one_raises_kdaerror_and_writes_nothing(argument, bad):
    from kda_core.errors import KDAError

    kw = varlen_decode("cuda", VARLEN_LENS["decode"], torch.int32, seed=9)
    kw["output"] = torch.empty(kw["v"].shape, dtype=BF16, device="cuda")
    recurrent_kda(**kw)  # described: the next call with these facts takes the hot path
    torch.cuda.synchronize()
    pool_before, out_before = kw["initial_state"].clone(), kw["output"].clone()
    with pytest.raises(KDAError, match=rf"^{argument}: expected"):
        recurrent_kda(**{**kw, argument: bad(kw)})
    torch.cuda.synchronize()
    assert torch.equal(kw["initial_state"], pool_before) and torch.equal(kw["output"], out_before)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_varlen_decode_with_serving_layouts_matches_the_oracle():
    kw = serving_layout(varlen_decode("cuda", VARLEN_LENS["mixed"], torch.int64, seed=6))
    assert explain(**kw).path is Path.T1_VARLEN
    check_against_oracle(kw, exact=False)
    check_against_oracle(kw, exact=False, null_policy="nonpositive")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["cute-dsl", "auto"])
@pytest.mark.parametrize("H, K, path", [(12, 128, Path.T1), (32, 64, Path.GENERIC)], ids=["t1", "generic-K64"])
def test_gpu_flashinfer_form_never_wraps_minus_one_and_returns_the_gathered_states(H, K, path, backend):
    """FlashInfer's regression form (docs/serving.md §5): a bf16 pool of 5 slots whose last slot holds 7.0, indices
    [-1, 3]: the last slot and slot 0 stay, slot 3 changes, and the gathered states are [zeros, pool[3]]."""
    kw = make_call("cuda", B=2, H=H, K=K, N=5, seed=21)
    kw["initial_state"][-1] = 7.0
    kw["ssm_state_indices"] = torch.tensor([-1, 3], dtype=torch.int32, device="cuda")
    kw["output_final_state"] = True
    assert explain(**kw, backend=backend).path is path
    before = kw["initial_state"].clone()
    o, states = recurrent_kda(**kw, backend=backend)
    pool = kw["initial_state"]
    assert torch.equal(pool[-1], before[-1]) and torch.equal(pool[0], before[0])
    assert not torch.equal(pool[3], before[3])
    assert bool(states[0].eq(0).all()) and torch.equal(states[1], pool[3]) and bool(o[0].eq(0).all())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("form", ["t1", "t1-varlen"])
def test_gpu_t1_kernel_without_dt_bias_matches_the_oracle_with_zeros(form):
    """An absent dt_bias reaches the T=1 entries as None (their variant without it), on the hot path too."""
    kw = make_call("cuda", seed=31) if form == "t1" else varlen_decode("cuda", [1, 0, 3, 1], torch.int32, seed=31)
    kw["dt_bias"] = None
    assert explain(**kw).path is (Path.T1 if form == "t1" else Path.T1_VARLEN)
    for _ in range(2):  # the second call of the same facts takes the hot path (T=1)
        mine = copy_call(kw)
        o, _ = recurrent_kda(**mine)
        ref = copy_call(kw)
        ref["dt_bias"] = torch.zeros(12 * 128, device="cuda")
        o_ref, pool_ref = recurrent_kda_ref(**ref)
        torch.testing.assert_close(o, o_ref, **tol(BF16))
        torch.testing.assert_close(mine["initial_state"].float(), pool_ref.float(), **tol(BF16))
