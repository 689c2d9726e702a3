"""The spec-decode references (docs/design.md §9): source pool, frozen verify, RecoverSSM records and commit, tree
verify.

Each mode is checked against an independent statement of its rule: the plain token-loop oracle
(:func:`kda_core.oracle.recurrent_kda_ref`, pinned down by the WY and hand-formula tests) run on a rearranged pool
or token by token along a path, or the step formula of docs/design.md §3 written out by hand. Runs over different
batch subsets may differ in the last fp32 bit (vectorised reductions), so those comparisons carry a tight
tolerance; "untouched" checks are bitwise.
"""

from __future__ import annotations

import pytest
import torch

from kda_core.call_args import RecurrentArgs, SpecArgs
from kda_core.contracts import NullSlotPolicy
from kda_core.errors import KDAError
from kda_core.oracle import kda_gate_ref, recurrent_kda_ref, recurrent_kda_ref_args
from kda_core.oracle_spec import recoverssm_commit_layers_ref, recoverssm_commit_ref, spec_verify_ref

F32 = dict(dtype=torch.float32, out_dtype=None)
OOR, NONPOS = NullSlotPolicy.OUT_OF_RANGE, NullSlotPolicy.NONPOSITIVE
POLICIES = [OOR, NONPOS]
I32, I64 = torch.int32, torch.int64
INT_MIN = -(2**31)
BF16_ULP = 2.0**-8  # relative spacing of bf16 values: one rounding is at most half of it


def _args(kda, B=3, T=4, H=2, HV=None, K=16, seed=0, gate="lower_bound", **kw):
    return RecurrentArgs(**kda.make_inputs(B=B, T=T, H=H, HV=HV, K=K, seed=seed, gate=gate), **kw)


def _varlen(args):
    """The same tokens packed as one [1, B*T] row (pair with cu_seqlens)."""
    return args._replace(**{f: x.reshape(1, -1, *x.shape[2:]) for f, x in args._asdict().items()
                            if isinstance(x, torch.Tensor) and x.dim() >= 3})


def _close(a, b, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol)


def _tokens(args, b, toks):
    """Keyword arguments of a dense one-sequence call over tokens ``toks`` (a list) of row b."""
    sel = torch.tensor(toks, dtype=torch.long)
    out = {}
    for f, x in args._asdict().items():
        if f in ("initial_state", "ssm_state_indices", "num_accepted_tokens", "cu_seqlens", "output",
                 "output_final_state"):
            continue
        out[f] = x[b:b + 1, sel] if isinstance(x, torch.Tensor) and x.dim() >= 3 else x
    return out


def _run(args, b, toks, S0, round_to=None):
    """Run row b's tokens ``toks`` one after another from S0 [HV, V, K] with the plain oracle (dense, fp32), the
    state rounded to ``round_to`` after every token when given. Returns (outputs [len, HV, V], states after each
    token [len, HV, V, K])."""
    S = S0.float()[None]
    outs, states = [], []
    for t in toks:
        o, S = recurrent_kda_ref(**_tokens(args, b, [t]), initial_state=S, output_final_state=True, **F32)
        if round_to is not None:
            S = S.to(round_to).float()
        outs.append(o[0, 0])
        states.append(S[0])
    return outs, states


def _subset(args, rows):
    """The call restricted to batch rows ``rows``."""
    return args._replace(**{f: x[rows] for f, x in args._asdict().items()
                            if isinstance(x, torch.Tensor) and x.dim() >= 3})


def _untouched(kda, after, before, touched):
    """Every row of ``after`` outside ``touched`` (a collection of row indices) is bitwise ``before``'s."""
    rows = [i for i in range(after.shape[0]) if i not in set(touched)]
    assert kda.same_bits(after[rows], before[rows])


# ---------------------------------------------------------------------------------------------------------------
# SpecArgs() is the plain call


@pytest.mark.parametrize("mode", ["dense", "dense_none", "pool1d", "pool2d", "pool2d_nat", "varlen2d"])
@pytest.mark.parametrize("policy", POLICIES)
def test_default_spec_args_equal_the_plain_reference_bitwise(kda, mode, policy):
    B, T, H, HV, K, P = 3, 4, 2, 4, 16, 9
    args = _args(kda, B=B, T=T, H=H, HV=HV, K=K, seed=3)
    idx2 = torch.tensor([[1, 2, 3, 4], [5, -1, 6, 7], [0, 8, P, 3]])
    extra = {}
    if mode == "dense":
        extra = dict(initial_state=kda.make_pool(B, HV, K, seed=4), output_final_state=True)
    elif mode == "dense_none":
        extra = dict(output_final_state=True)
    elif mode == "pool1d":
        extra = dict(ssm_state_indices=torch.tensor([4, -1, 1]))
    elif mode == "pool2d":
        extra = dict(ssm_state_indices=idx2)
    elif mode == "pool2d_nat":
        extra = dict(ssm_state_indices=idx2, num_accepted_tokens=torch.tensor([2, 0, 9], dtype=I32))
    elif mode == "varlen2d":
        args = _varlen(args)
        extra = dict(ssm_state_indices=idx2, cu_seqlens=torch.tensor([0, 4, 6, 12]),
                     num_accepted_tokens=torch.tensor([3, 1, 4]))
    pool_a = kda.make_pool(P, HV, K, seed=5)
    pool_b = pool_a.clone()
    args_a, args_b = args._replace(**extra), args._replace(**extra)
    if "ssm_state_indices" in extra:
        args_a, args_b = args_a._replace(initial_state=pool_a), args_b._replace(initial_state=pool_b)
    o_a, s_a = recurrent_kda_ref_args(args_a, null_policy=policy, **F32)
    o_b, s_b = spec_verify_ref(args_b, SpecArgs(), null_policy=policy, **F32)
    assert kda.same_bits(o_a, o_b)
    assert (s_a is None) == (s_b is None)
    if s_a is not None:
        assert kda.same_bits(s_a, s_b)
    assert kda.same_bits(pool_a, pool_b)


def test_output_tensor_is_written_and_returned(kda):
    args = _args(kda, B=2, T=3)
    pool = kda.make_pool(4, 2, 16)
    out = torch.full((2, 3, 2, 16), float("nan"), dtype=torch.bfloat16)
    o, _ = spec_verify_ref(args._replace(initial_state=pool, ssm_state_indices=torch.tensor([1, 3]), output=out),
                           SpecArgs(disable_state_update=True))
    assert o is out and not torch.isnan(out).any()


# ---------------------------------------------------------------------------------------------------------------
# Frozen verify


@pytest.mark.parametrize("two_d", [False, True])
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("policy", POLICIES)
def test_frozen_verify_leaves_the_pool_untouched_and_outputs_equal_the_plain_call(kda, two_d, pool_dtype, policy):
    B, T, H, HV, K, P = 4, 4, 2, 4, 16, 6
    args = _args(kda, B=B, T=T, H=H, HV=HV, K=K, seed=7)
    pool = kda.make_pool(P, HV, K, dtype=pool_dtype, seed=8)
    before = pool.clone()
    slots = torch.tensor([2, -1, 5, 0])
    # only column 0 is read; the other columns (null or not) change nothing
    idx = torch.stack([slots, torch.tensor([1, 0, -1, 3]), torch.tensor([3, 3, 4, P]), torch.tensor([-1, 2, 0, 1])],
                      1) if two_d else slots
    o, out = spec_verify_ref(args._replace(initial_state=pool, ssm_state_indices=idx),
                             SpecArgs(disable_state_update=True), null_policy=policy, **F32)
    assert out is pool and kda.same_bits(pool, before)
    o_ref, _ = recurrent_kda_ref_args(args._replace(initial_state=before.clone(), ssm_state_indices=slots),
                                      null_policy=policy, **F32)
    assert kda.same_bits(o, o_ref)
    if policy is NONPOS:
        assert torch.count_nonzero(o[3]) == 0


@pytest.mark.parametrize("varlen", [False, True])
def test_frozen_verify_from_a_source_equals_the_plain_call_on_the_source(kda, varlen):
    B, T, H, HV, K, Ps = 3, 4, 1, 2, 16, 5
    args = _args(kda, B=B, T=T, H=H, HV=HV, K=K, seed=9)
    if varlen:
        args = _varlen(args)._replace(cu_seqlens=torch.tensor([0, 3, 3, 7]))
    src = kda.make_pool(Ps, HV, K, dtype=torch.bfloat16, seed=10, row_pad=17)
    before = src.clone()
    r = torch.tensor([4, 0, 2], dtype=I32)
    o, out = spec_verify_ref(args._replace(), SpecArgs(src, r, disable_state_update=True), **F32)
    assert out is None and kda.same_bits(src, before)
    o_ref, _ = recurrent_kda_ref_args(args._replace(initial_state=before.clone(), ssm_state_indices=r), **F32)
    assert kda.same_bits(o, o_ref)


# ---------------------------------------------------------------------------------------------------------------
# Source pool (initial_state_source) with writes


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("policy", POLICIES)
def test_source_with_1d_indices_equals_copying_the_source_rows_into_the_pool_first(kda, pool_dtype, policy):
    B, T, H, HV, K, Ps, P = 5, 3, 2, 4, 16, 6, 7
    args = _args(kda, B=B, T=T, H=H, HV=HV, K=K, seed=11)
    src = kda.make_pool(Ps, HV, K, dtype=torch.bfloat16, seed=12)  # staged into either pool dtype exactly
    pool = kda.make_pool(P, HV, K, dtype=pool_dtype, seed=13, row_pad=17)
    src_before, before = src.clone(), pool.clone()
    r = torch.tensor([3, 5, -1, 1, 2])  # row 2: null source slot, nothing read or written
    w = torch.tensor([6, 2, 4, -1, 0])  # row 3: null write slot, outputs still computed; row 4: slot 0
    o, out = spec_verify_ref(args._replace(initial_state=pool, ssm_state_indices=w), SpecArgs(src, r),
                             null_policy=policy, **F32)
    assert out is pool and kda.same_bits(src, src_before)
    live_w = [0, 1] + ([] if policy is NONPOS else [4])
    staged = before.clone()
    staged[w[live_w]] = src_before[r[live_w]].to(pool_dtype)
    o_ref, _ = recurrent_kda_ref_args(_subset(args, live_w)._replace(initial_state=staged,
                                                                     ssm_state_indices=w[live_w]),
                                      null_policy=policy, **F32)
    _close(o[live_w], o_ref)
    _close(pool[w[live_w]], staged[w[live_w]])
    _untouched(kda, pool, before, w[live_w].tolist())
    assert torch.count_nonzero(o[2]) == 0
    for b in [3] + ([4] if policy is NONPOS else []):  # a null write slot: the outputs of a run from the source
        outs, _ = _run(args, b, list(range(T)), src_before[r[b]])
        _close(o[b], torch.stack(outs))


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("policy", POLICIES)
def test_source_with_2d_indices_equals_copying_the_source_rows_into_the_pool_first(kda, pool_dtype, policy):
    B, T, H, HV, K, Ps, P = 4, 4, 2, 2, 16, 5, 16
    args = _args(kda, B=B, T=T, H=H, HV=HV, K=K, seed=14)
    src = kda.make_pool(Ps, HV, K, dtype=torch.bfloat16, seed=15)
    pool = kda.make_pool(P, HV, K, dtype=pool_dtype, seed=16)
    src_before, before = src.clone(), pool.clone()
    r = torch.tensor([1, 4, 3, -2])
    w = torch.tensor([[1, 2, 3, 4], [5, -1, 6, 7], [8, 9, 10, P], [11, 12, 13, 14]])
    o, _ = spec_verify_ref(args._replace(initial_state=pool, ssm_state_indices=w), SpecArgs(src, r),
                           null_policy=policy, **F32)
    staged = before.clone()
    staged[w[:3, 0]] = src_before[r[:3]].to(pool_dtype)  # column 0 is the plain call's read slot
    o_ref, _ = recurrent_kda_ref_args(_subset(args, [0, 1, 2])._replace(initial_state=staged, ssm_state_indices=w[:3]),
                                      null_policy=policy, **F32)
    _close(o[:3], o_ref)
    _close(pool[w[:3, 0]], staged[w[:3, 0]])
    written = [s for s in w[:3].flatten().tolist() if 0 <= s < P]
    _close(pool[written], staged[written])
    _untouched(kda, pool, before, written)
    assert torch.count_nonzero(o[3]) == 0
    assert kda.same_bits(src, src_before)


def test_source_with_a_null_first_write_slot_skips_token_zero_and_runs_the_rest_from_the_source(kda):
    T, HV, K = 4, 2, 16
    args = _args(kda, B=1, T=T, H=2, HV=HV, K=K, seed=17)
    src = kda.make_pool(2, HV, K, seed=18)
    pool = kda.make_pool(6, HV, K, seed=19)
    w = torch.tensor([[-1, 2, 3, 4]])
    o, _ = spec_verify_ref(args._replace(initial_state=pool, ssm_state_indices=w),
                           SpecArgs(src, torch.tensor([1])), **F32)
    outs, states = _run(args, 0, [1, 2, 3], src[1])
    assert torch.count_nonzero(o[0, 0]) == 0
    _close(o[0, 1:], torch.stack(outs))
    _close(pool[[2, 3, 4]], torch.stack(states))


# ---------------------------------------------------------------------------------------------------------------
# RecoverSSM records


def _hand_u(args, b, toks, S0):
    """u_t = b (v - (a * S) k^) of row b's tokens run from S0, written out from docs/design.md §3 (fp32)."""
    H = args.q.shape[2]
    HV = args.v.shape[2]
    G = HV // H
    S = S0.float().clone()
    g_log = kda_gate_ref(args.g[b], args.A_log, args.dt_bias, args.lower_bound, args.use_gate_in_kernel)
    us = []
    for t in toks:
        k = args.k[b, t].float().repeat_interleave(G, 0)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        beta = torch.sigmoid(args.beta[b, t].float()) if args.beta_is_logit else args.beta[b, t].float()
        S = S * torch.exp(g_log[t])[:, None, :]
        u = beta[:, None] * (args.v[b, t].float() - torch.einsum("hvk,hk->hv", S, k))
        S = S + u[:, :, None] * k[:, None, :]
        us.append(u)
    return us


@pytest.mark.parametrize("t_max", [2, 4, 6])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("from_source", [False, True])
@pytest.mark.parametrize("varlen", [False, True])
def test_records_land_at_the_read_slot_and_nothing_else_is_written(kda, t_max, policy, from_source, varlen):
    B, T, H, HV, K, Pr = 4, 4, 1, 2, 16, 7
    G = HV // H
    dense = _args(kda, B=B, T=T, H=H, HV=HV, K=K, seed=20)
    lens = [4, 1, 3, 2] if varlen else [T] * B
    read_tensor = kda.make_pool(Pr, HV, K, dtype=torch.bfloat16, seed=21, row_pad=3)
    before = read_tensor.clone()
    r = torch.tensor([5, 0, -1, 2], dtype=I64)  # row 1 reads slot 0 (null under NONPOSITIVE), row 2 is null
    cc = torch.randn(Pr, HV, t_max, K, generator=torch.Generator().manual_seed(22))
    kg = torch.randn(Pr, HV, t_max, 2 * K, generator=torch.Generator().manual_seed(23)).bfloat16()
    cc_before, kg_before = cc.clone(), kg.clone()
    if varlen:
        packed = torch.cat([torch.arange(n) + b * T for b, n in enumerate(lens)])
        args = dense._replace(**{f: x.reshape(1, -1, *x.shape[2:])[:, packed] for f, x in dense._asdict().items()
                                 if isinstance(x, torch.Tensor) and x.dim() >= 3},
                              cu_seqlens=torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]))
    else:
        args = dense
    if from_source:
        spec = SpecArgs(read_tensor, r, True, cc, kg)
    else:
        args = args._replace(initial_state=read_tensor, ssm_state_indices=r)
        spec = SpecArgs(disable_state_update=True, correction_cache=cc, kg_cache=kg)
    spec_verify_ref(args, spec, null_policy=policy, **F32)
    assert kda.same_bits(read_tensor, before)
    live = [0, 3] + ([] if policy is NONPOS else [1])
    cc_mask = torch.zeros(cc.shape[:3], dtype=torch.bool)
    for b in live:
        n = min(lens[b], t_max)
        s = int(r[b])
        cc_mask[s, :, :n] = True
        us = _hand_u(dense, b, range(n), before[s])
        for t in range(n):
            _close(cc[s, :, t], us[t])
            assert kda.same_bits(kg[s, :, t, :K], dense.k[b, t].repeat_interleave(G, 0))
            assert kda.same_bits(kg[s, :, t, K:], dense.g[b, t])
    assert kda.same_bits(cc[~cc_mask], cc_before[~cc_mask])
    assert kda.same_bits(kg[~cc_mask], kg_before[~cc_mask])


@pytest.mark.parametrize("policy", POLICIES)
def test_a_batch_of_null_rows_writes_no_record(kda, policy):
    B, T, HV, K, Pr = 3, 3, 2, 16, 4
    args = _args(kda, B=B, T=T, H=2, HV=HV, K=K, seed=24)
    pool = kda.make_pool(Pr, HV, K, seed=25)
    cc = torch.full((Pr, HV, T, K), float("nan"))
    kg = torch.full((Pr, HV, T, 2 * K), float("nan"), dtype=torch.bfloat16)
    slots = torch.tensor([-1, Pr, 0 if policy is NONPOS else -(2**40)], dtype=I64)
    o, _ = spec_verify_ref(args._replace(initial_state=pool, ssm_state_indices=slots),
                           SpecArgs(disable_state_update=True, correction_cache=cc, kg_cache=kg), null_policy=policy)
    assert torch.count_nonzero(o) == 0 and torch.isnan(cc).all() and torch.isnan(kg).all()


# ---------------------------------------------------------------------------------------------------------------
# Tree verify


def test_tree_with_chain_parents_on_an_fp32_pool_equals_the_chain(kda):
    B, T, H, HV, K, P = 3, 5, 2, 4, 16, 16
    args = _args(kda, B=B, T=T, H=H, HV=HV, K=K, seed=26)
    idx = torch.arange(1, 1 + B * T).reshape(B, T)
    nat = torch.tensor([1, 3, 5])
    pool_a = kda.make_pool(P, HV, K, seed=27)
    pool_b = pool_a.clone()
    chain = args._replace(initial_state=pool_a, ssm_state_indices=idx, num_accepted_tokens=nat)
    o_a, _ = spec_verify_ref(chain, SpecArgs(), **F32)
    for parents in (torch.arange(T).expand(B, T) - 1, torch.empty(B, 0, dtype=I32), torch.tensor([[-5, 0]] * B)):
        pool_b.copy_(kda.make_pool(P, HV, K, seed=27))
        o_b, _ = spec_verify_ref(chain._replace(initial_state=pool_b), SpecArgs(parent_indices=parents), **F32)
        _close(o_b, o_a)
        _close(pool_b, pool_a)


def test_a_skipped_token_kills_its_descendants_but_not_its_siblings(kda):
    T, HV, K, P = 5, 2, 16, 8
    args = _args(kda, B=1, T=T, H=2, HV=HV, K=K, seed=28)
    src = kda.make_pool(1, HV, K, seed=29)
    pool = kda.make_pool(P, HV, K, seed=30)
    before = pool.clone()
    idx = torch.tensor([[1, -1, 3, 4, 5]])  # token 1 is skipped
    parents = torch.tensor([[-1, 0, 1, 0, 2]])  # 2 is a child of the skipped 1 (dead), 3 of 0, 4 of the dead 2
    o, _ = spec_verify_ref(args._replace(initial_state=pool, ssm_state_indices=idx),
                           SpecArgs(src, torch.tensor([0]), parent_indices=parents), **F32)
    outs, states = _run(args, 0, [0, 3], src[0])
    for t in (1, 2, 4):
        assert torch.count_nonzero(o[0, t]) == 0
    _close(o[0, [0, 3]], torch.stack(outs))
    _close(pool[[1, 4]], torch.stack(states))
    _untouched(kda, pool, before, [1, 4])
    # the chain form keeps running past a skipped token (it is not absorbed)
    o_chain, _ = spec_verify_ref(args._replace(initial_state=before.clone(), ssm_state_indices=idx),
                                 SpecArgs(src, torch.tensor([0])), **F32)
    assert torch.count_nonzero(o_chain[0, 2]) > 0


def _path(parents_row, t, T_p):
    """Root-to-token path of token t (the parent rule of docs/design.md §9)."""
    path = [t]
    while True:
        p = parents_row[t] if t < T_p else t - 1
        if not 0 <= p < t:
            return path[::-1]
        path.append(p)
        t = p


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def trees(draw):
    B = draw(st.integers(1, 3))
    T = draw(st.integers(1, 5))
    T_p = draw(st.integers(0, T + 1))
    weird = [-1, -3, INT_MIN, 2**40, T + 2]
    parents = [[draw(st.one_of(st.integers(-1, T), st.sampled_from(weird))) for _ in range(T_p)] for _ in range(B)]
    T_idx = draw(st.integers(max(T - 1, 1), T + 1))
    null_write = [[draw(st.integers(0, 5)) == 0 for _ in range(T_idx)] for _ in range(B)]
    return dict(B=B, T=T, T_p=T_p, parents=parents, T_idx=T_idx, null_write=null_write,
                pool_dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
                policy=draw(st.sampled_from(POLICIES)), from_source=draw(st.booleans()),
                gqa=draw(st.booleans()), seed=draw(st.integers(0, 1000)))


@given(trees())
def test_every_tree_token_equals_the_chain_over_its_root_to_token_path(kda, case):
    B, T, T_p, T_idx = case["B"], case["T"], case["T_p"], case["T_idx"]
    H, K = 1, 8
    HV = 2 if case["gqa"] else 1
    policy, pool_dtype = case["policy"], case["pool_dtype"]
    args = _args(kda, B=B, T=T, H=H, HV=HV, K=K, seed=case["seed"])
    P = 1 + B * T_idx + 1
    pool = kda.make_pool(P, HV, K, dtype=pool_dtype, seed=case["seed"] + 1)
    before = pool.clone()
    idx = (1 + torch.arange(B * T_idx)).reshape(B, T_idx)  # slot 0 stays unused (null under NONPOSITIVE)
    idx[torch.tensor(case["null_write"])] = -1
    parents = torch.tensor(case["parents"], dtype=I64).reshape(B, T_p)
    if case["from_source"]:
        src = kda.make_pool(3, HV, K, dtype=torch.bfloat16, seed=case["seed"] + 2)
        r = torch.tensor([1 + b % 2 for b in range(B)], dtype=I32)  # slot 0 is null under NONPOSITIVE
        spec = SpecArgs(src, r, parent_indices=parents)
        roots = [src[1 + b % 2] for b in range(B)]
    else:
        spec = SpecArgs(parent_indices=parents)
        roots = [before[idx[b, 0]] if idx[b, 0] > 0 else None for b in range(B)]
    o, _ = spec_verify_ref(args._replace(initial_state=pool, ssm_state_indices=idx), spec, null_policy=policy, **F32)
    written = []
    for b in range(B):
        prow = case["parents"][b]
        for t in range(T):
            path = _path(prow, t, T_p)
            alive = roots[b] is not None and all(s < T_idx and idx[b, s] > 0 for s in path)
            if not alive:
                assert torch.count_nonzero(o[b, t]) == 0
                continue
            outs, states = _run(args, b, path, roots[b], round_to=pool_dtype)
            _close(o[b, t], outs[-1])
            _close(pool[idx[b, t]], states[-1].to(pool_dtype))
            written.append(int(idx[b, t]))
    _untouched(kda, pool, before, written)


def test_malformed_parents_start_from_the_first_state(kda):
    B, T, HV, K = 2, 4, 2, 8
    args = _args(kda, B=B, T=T, H=2, HV=HV, K=K, seed=31)
    idx = torch.arange(1, 1 + B * T).reshape(B, T)
    bad = torch.tensor([[INT_MIN, 2**31 + 1, 2, 2**40], [-(2**40), 1, 5, 3]], dtype=I64)
    good = torch.full((B, T), -1, dtype=I64)  # every bad parent is outside [0, t): each token is a root
    pools = []
    outs = []
    for parents in (bad, good):
        pool = kda.make_pool(B * T + 1, HV, K, seed=32)
        o, _ = spec_verify_ref(args._replace(initial_state=pool, ssm_state_indices=idx),
                               SpecArgs(parent_indices=parents), **F32)
        pools.append(pool)
        outs.append(o)
    assert kda.same_bits(outs[0], outs[1]) and kda.same_bits(pools[0], pools[1])


# ---------------------------------------------------------------------------------------------------------------
# The chained test: verify (records) -> commit, 20 steps, equals the plain recurrence over the accepted stream

CHAIN_CASES = [("dense", "lower_bound"), ("varlen", "lower_bound"), ("varlen", "softplus"), ("dense", "precomputed")]


@pytest.mark.parametrize("layout, gate", CHAIN_CASES)
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("policy", POLICIES)
def test_chained_verify_commit_equals_the_plain_recurrence_over_the_accepted_stream(kda, layout, gate, pool_dtype,
                                                                                   policy):
    B, T, H, HV, K, steps = 4, 4, 2, 4, 16, 20
    P = B + 2
    gen = torch.Generator().manual_seed(33)
    home = torch.tensor([1, 4, 2, 5])
    null_value = 0 if policy is NONPOS else -1
    ckpt = kda.make_pool(P, HV, K, dtype=pool_dtype, seed=34, row_pad=17)
    ref = ckpt.clone()
    cc = torch.zeros(P, HV, T, K)
    kg = torch.zeros(P, HV, T, 2 * K, dtype=torch.bfloat16)
    for step in range(steps):
        dense = _args(kda, B=B, T=T, H=H, HV=HV, K=K, seed=100 + step, gate=gate)
        slots = home.clone()
        slots[torch.rand(B, generator=gen) < 0.2] = null_value
        lens = torch.randint(0 if layout == "varlen" else T, T + 1, (B,), generator=gen)
        if layout == "varlen":
            packed = torch.cat([torch.arange(int(n)) + b * T for b, n in enumerate(lens)])
            qsl = torch.cat([torch.zeros(1, dtype=I64), lens.cumsum(0)]).to(I32)
            args = dense._replace(**{f: x.reshape(1, -1, *x.shape[2:])[:, packed]
                                     for f, x in dense._asdict().items()
                                     if isinstance(x, torch.Tensor) and x.dim() >= 3}, cu_seqlens=qsl)
        else:
            qsl = None
            args = dense
        before = ckpt.clone()
        o, _ = spec_verify_ref(args._replace(initial_state=ckpt, ssm_state_indices=slots),
                               SpecArgs(disable_state_update=True, correction_cache=cc, kg_cache=kg),
                               null_policy=policy, **F32)
        assert kda.same_bits(ckpt, before)
        nat = torch.randint(1, T + 1, (B,), generator=gen)
        recoverssm_commit_ref(ckpt, cc, kg, slots, nat, args.A_log, args.dt_bias, args.lower_bound,
                              query_start_loc=qsl, null_policy=policy)
        for b in range(B):
            n = min(int(nat[b]), int(lens[b]))
            if int(slots[b]) == null_value or n == 0:
                continue
            recurrent_kda_ref(**_tokens(dense, b, list(range(n))), initial_state=ref,
                              ssm_state_indices=slots[b:b + 1], **F32)
        if pool_dtype is torch.bfloat16:  # one rounding per step: compare, then continue from the same state
            _close(ckpt, ref, rtol=BF16_ULP, atol=1e-6)
            ref.copy_(ckpt)
    if pool_dtype is torch.float32:
        err = ((ckpt - ref).abs().max() / ref.abs().max()).item()
        assert err <= 1e-5, err
    _untouched(kda, ckpt, kda.make_pool(P, HV, K, dtype=pool_dtype, seed=34, row_pad=17), home.tolist())


# ---------------------------------------------------------------------------------------------------------------
# RecoverSSM commit: direct rules


def _commit_case(kda, P=6, HV=2, K=8, T_max=4, seed=40, ck_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    ckpt = kda.make_pool(P, HV, K, dtype=ck_dtype, seed=seed + 1, row_pad=5)
    cc = torch.randn(P, HV, T_max, K, generator=gen) * 0.3
    kg = torch.randn(P, HV, T_max, 2 * K, generator=gen).bfloat16()
    return ckpt, cc, kg, torch.rand(HV, generator=gen) - 0.5, torch.randn(HV * K, generator=gen) * 0.5


@pytest.mark.parametrize("gate", ["lower_bound", "softplus", "precomputed"])
@pytest.mark.parametrize("l2norm", [True, False])
def test_commit_is_the_hand_formula(kda, gate, l2norm):
    P, HV, K, T_max = 6, 2, 8, 4
    ckpt, cc, kg, A, dt = _commit_case(kda, P, HV, K, T_max)
    if gate == "precomputed":
        kg[..., K:] = -kg[..., K:].abs()
        A = dt = None
    lb = -5.0 if gate == "lower_bound" else None
    before = ckpt.clone()
    slots, nat = torch.tensor([3, 1]), torch.tensor([2, 4])
    recoverssm_commit_ref(ckpt, cc, kg, slots, nat, A, dt, lb, use_qk_l2norm_in_kernel=l2norm)
    for s, n in zip(slots.tolist(), nat.tolist()):
        S = before[s].clone()
        for t in range(n):
            k = kg[s, :, t, :K].float()
            if l2norm:
                k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
            graw = kg[s, :, t, K:].float()
            if gate == "precomputed":
                g_log = graw
            else:
                x = graw + dt.reshape(HV, K)
                rate = torch.exp(A)[:, None]
                g_log = lb * torch.sigmoid(rate * x) if lb is not None else -rate * torch.nn.functional.softplus(x)
            S = S * torch.exp(g_log)[:, None, :] + cc[s, :, t][:, :, None] * k[:, None, :]
        _close(ckpt[s], S)
    _untouched(kda, ckpt, before, slots.tolist())


@pytest.mark.parametrize("policy", POLICIES)
def test_commit_lengths_and_null_rows_under_malformed_device_data(kda, policy):
    P, HV, K, T_max = 8, 2, 8, 4
    ckpt, cc, kg, A, dt = _commit_case(kda, P, HV, K, T_max, seed=41)
    before = ckpt.clone()
    slots = torch.tensor([1, 2, 3, 4, 5, 6, 0, -1, P, INT_MIN, 2**33], dtype=I64)
    nat = torch.tensor([INT_MIN, 2**33 + 1, -1, 0, 3, T_max + 5, 2, 2, 2, 2, 2], dtype=I64)
    qsl = torch.tensor([0, 4, 8, 12, 16, 18, 2**40, 2**40 + 3, 0, 0, 0, 0], dtype=I64)
    # lens: 4, 4, 4, 4, 2, 2**40 - 18 (-> T_max), 3, 0 (negative), 0, 0, 0
    recoverssm_commit_ref(ckpt, cc, kg, slots, nat, A, dt, -5.0, query_start_loc=qsl, null_policy=policy)
    expect = before.clone()
    commit_len = {2: 4, 5: 2, 6: T_max}  # slot -> length: INT_MIN, -1, 0 -> 0; 2**33+1 -> 4; 3 -> 2; big -> T_max
    if policy is OOR:
        commit_len[0] = 2
    for s, n in commit_len.items():
        row = torch.tensor([s])
        recoverssm_commit_ref(expect, cc, kg, row, torch.tensor([n]), A, dt, -5.0, null_policy=policy)
    # The committed slots agree with their one-row commits to rounding (torch's CPU kernels may round a batched
    # exp / sum one ulp apart from a one-row one, by the host's vector width); a wrong length is off by ~0.1.
    for s in commit_len:
        torch.testing.assert_close(ckpt[s], expect[s], rtol=1e-6, atol=1e-6)
        assert not kda.same_bits(ckpt[s], before[s])
    _untouched(kda, ckpt, before, commit_len)


@pytest.mark.parametrize("policy", POLICIES)
def test_commit_into_destination_slots_reads_the_source_and_leaves_it(kda, policy):
    """destination_indices: row n folds slot s_n (checkpoint and records) into slot d_n; d_n null makes the row
    null; the source is left as it was unless it is its own destination."""
    P, HV, K, T_max = 8, 2, 8, 4
    ckpt, cc, kg, A, dt = _commit_case(kda, P, HV, K, T_max, seed=43)
    before = ckpt.clone()
    slots = torch.tensor([1, 2, 3, 4, 6], dtype=I64)
    dst = torch.tensor([5, 2, -1, P, 7], dtype=I64)  # moves, in place, null, past the pool, moves
    nat = torch.tensor([3, 2, 4, 4, 1], dtype=I64)
    recoverssm_commit_ref(ckpt, cc, kg, slots, nat, A, dt, -5.0, null_policy=policy, destination_indices=dst)
    in_place = before.clone()
    recoverssm_commit_ref(in_place, cc, kg, slots, nat, A, dt, -5.0, null_policy=policy)
    for s, d in ((1, 5), (2, 2), (6, 7)):  # to rounding: the batches differ (see the malformed-data test)
        torch.testing.assert_close(ckpt[d], in_place[s], rtol=1e-6, atol=1e-6)
        assert not kda.same_bits(ckpt[d], before[d])
    _untouched(kda, ckpt, before, [5, 2, 7])


def test_commit_rounds_once_to_a_bf16_checkpoint(kda):
    P, HV, K, T_max = 4, 2, 8, 4
    ck32, cc, kg, A, dt = _commit_case(kda, P, HV, K, T_max, seed=42)
    ck16 = ck32.to(torch.bfloat16)
    ck32 = ck16.float()
    slots, nat = torch.tensor([2]), torch.tensor([4])
    recoverssm_commit_ref(ck32, cc, kg, slots, nat, A, dt, -5.0)
    recoverssm_commit_ref(ck16, cc, kg, slots, nat, A, dt, -5.0)
    assert kda.same_bits(ck16[2], ck32[2].to(torch.bfloat16))


@pytest.mark.parametrize("policy", POLICIES)
def test_commit_layers_equal_per_layer_commits(kda, policy):
    P, HV, K, T_max, L = 5, 2, 8, 3, 3
    layers = [_commit_case(kda, P, HV, K, T_max, seed=50 + 10 * i) for i in range(L)]
    copies = [c.clone() for c, *_ in layers]
    slots, nat = torch.tensor([0, 3, -1, 4]), torch.tensor([2, 3, 1, 9])
    qsl = torch.tensor([0, 3, 5, 8, 9])
    out = recoverssm_commit_layers_ref([x[0] for x in layers], [x[1] for x in layers], [x[2] for x in layers],
                                       [x[3] for x in layers], [x[4] for x in layers], -5.0, slots, nat,
                                       query_start_loc=qsl, null_policy=policy)
    assert all(a is x[0] for a, x in zip(out, layers))
    for (c, cc, kg, A, dt), c2 in zip(layers, copies):
        recoverssm_commit_ref(c2, cc, kg, slots, nat, A, dt, -5.0, query_start_loc=qsl, null_policy=policy)
        assert kda.same_bits(c, c2)


# ---------------------------------------------------------------------------------------------------------------
# Malformed device data in a verify, and the oracle's own refusals


@pytest.mark.parametrize("policy", POLICIES)
def test_malformed_source_indices_make_rows_inactive_and_touch_no_other_slot(kda, policy):
    B, T, HV, K, Ps, P = 5, 3, 2, 8, 4, 12
    args = _args(kda, B=B, T=T, H=2, HV=HV, K=K, seed=60)
    src = kda.make_pool(Ps, HV, K, seed=61)
    pool = kda.make_pool(P, HV, K, seed=62)
    before = pool.clone()
    r = torch.tensor([INT_MIN, 2**31 + 1, Ps, -1, 2], dtype=I64)
    w = (1 + torch.arange(B * 2)).reshape(B, 2)
    o, _ = spec_verify_ref(args._replace(initial_state=pool, ssm_state_indices=w), SpecArgs(src, r),
                           null_policy=policy)
    assert torch.count_nonzero(o[:4]) == 0 and torch.count_nonzero(o[4, :2]) > 0
    assert torch.count_nonzero(o[4, 2]) == 0  # t >= T_idx: skipped
    _untouched(kda, pool, before, w[4].tolist())


def test_refusals_of_the_oracle(kda):
    args = _args(kda)
    pool = kda.make_pool(4, 2, 16)
    idx2 = torch.zeros(3, 4, dtype=I64)
    idx1 = torch.zeros(3, dtype=I64)
    cases = [
        ("num_accepted_tokens", args._replace(initial_state=pool, ssm_state_indices=idx2,
                                              num_accepted_tokens=torch.ones(3)), SpecArgs(disable_state_update=True)),
        ("output_final_state", args._replace(initial_state=pool, ssm_state_indices=idx1, output_final_state=True),
         SpecArgs(disable_state_update=True)),
        ("initial_state", args._replace(initial_state=pool, ssm_state_indices=idx1),
         SpecArgs(initial_state_source=pool[1:], initial_state_indices=idx1)),
        ("initial_state_indices", args, SpecArgs(initial_state_source=pool)),
        ("kg_cache", args._replace(initial_state=pool, ssm_state_indices=idx1),
         SpecArgs(disable_state_update=True, correction_cache=torch.zeros(4, 2, 4, 16))),
        ("correction_cache", args._replace(initial_state=pool, ssm_state_indices=idx1),
         SpecArgs(correction_cache=torch.zeros(4, 2, 4, 16), kg_cache=torch.zeros(4, 2, 4, 32))),
        ("parent_indices", args._replace(initial_state=pool, ssm_state_indices=idx2),
         SpecArgs(disable_state_update=True, parent_indices=idx2)),
        ("ssm_state_indices", args._replace(initial_state=pool, ssm_state_indices=idx1),
         SpecArgs(parent_indices=idx2)),
        ("initial_state", args, SpecArgs(disable_state_update=True)),
        ("initial_state", args._replace(initial_state=pool, ssm_state_indices=idx1),
         SpecArgs(pool.clone(), idx1, disable_state_update=True)),
    ]
    for name, a, spec in cases:
        with pytest.raises(KDAError, match=f"^{name}:"):
            spec_verify_ref(a, spec)


# ---------------------------------------------------------------------------------------------------------------
# On a GPU: the references run on CUDA tensors (the kernels' tests call them there) and agree with the CPU


@pytest.mark.gpu
@pytest.mark.parametrize("policy", POLICIES)
def test_the_references_on_cuda_agree_with_the_cpu(kda, policy):
    from kda_core.validation_spec import validate_recoverssm_commit, validate_spec

    B, T, H, HV, K, P = 3, 4, 2, 4, 64, 6
    results = []
    for device in ("cpu", "cuda"):
        args = RecurrentArgs(**kda.make_inputs(B=B, T=T, H=H, HV=HV, K=K, seed=70, device=device))
        pool = kda.make_pool(P, HV, K, seed=71, device=device)
        cc = torch.zeros(P, HV, T, K, device=device)
        kg = torch.zeros(P, HV, T, 2 * K, dtype=torch.bfloat16, device=device)
        slots = torch.tensor([1, -1, 4], device=device)
        a = args._replace(initial_state=pool, ssm_state_indices=slots)
        s = SpecArgs(disable_state_update=True, correction_cache=cc, kg_cache=kg)
        if device == "cuda":
            validate_spec(a, s, policy)
        o, _ = spec_verify_ref(a, s, null_policy=policy, **F32)
        nat = torch.tensor([2, 3, 4], device=device)
        if device == "cuda":
            validate_recoverssm_commit(pool, cc, kg, slots, nat, args.A_log, args.dt_bias, args.lower_bound,
                                       null_policy=policy)
        recoverssm_commit_ref(pool, cc, kg, slots, nat, args.A_log, args.dt_bias, args.lower_bound,
                              null_policy=policy)
        tree = args._replace(initial_state=kda.make_pool(16, HV, K, seed=72, device=device),
                             ssm_state_indices=torch.arange(1, 1 + B * T, device=device).reshape(B, T))
        parents = torch.tensor([[-1, 0, 0, 1]] * B, device=device)
        o_tree, tree_pool = spec_verify_ref(tree, SpecArgs(pool, slots, parent_indices=parents), null_policy=policy,
                                            **F32)
        results.append([x.cpu() for x in (o, cc, kg, pool, o_tree, tree_pool)])
    for cpu, gpu in zip(*results):
        _close(gpu, cpu, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Every call validation accepts has an answer here, and what it refuses by combination the oracle refuses alike

BAD_SLOTS = [-1, INT_MIN, 2**31 + 5, 2**40, -(2**40)]


@st.composite
def spec_calls(draw):
    B = draw(st.integers(1, 3))
    T = draw(st.integers(1, 4))
    H = 1
    HV = draw(st.sampled_from([1, 2]))
    varlen = draw(st.booleans())
    frozen = draw(st.booleans())
    source = draw(st.booleans())
    records = draw(st.booleans())
    tree = draw(st.booleans())
    idx_form = draw(st.sampled_from([None, 1, 2]))
    nat = draw(st.booleans())
    i64 = draw(st.booleans())

    def slots(n, rows):
        dt = I64 if i64 else I32
        vals = [draw(st.one_of(st.integers(-1, rows), st.sampled_from(BAD_SLOTS if i64 else [-1, INT_MIN])))
                for _ in range(n)]
        return torch.tensor(vals, dtype=I64).to(dt)

    return dict(B=B, T=T, H=H, HV=HV, varlen=varlen, frozen=frozen, source=source, records=records, tree=tree,
                idx_form=idx_form, nat=nat, slots=slots, policy=draw(st.sampled_from(POLICIES)),
                pool_dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])), seed=draw(st.integers(0, 99)),
                t_max=draw(st.integers(1, 5)), t_p=draw(st.integers(0, 5)))


@given(spec_calls())
def test_what_validation_accepts_the_oracle_answers(kda, case):
    from kda_core.validation_spec import validate_spec

    B, T, H, HV, K = case["B"], case["T"], case["H"], case["HV"], 64
    slots = case["slots"]
    args = _args(kda, B=B, T=T, H=H, HV=HV, K=K, seed=case["seed"])
    N_seq = B
    if case["varlen"]:
        args = _varlen(args)._replace(cu_seqlens=torch.tensor(sorted(slots(B + 1, B * T).clamp(0, B * T).tolist())))
    P, Ps = 5, 4
    pool = kda.make_pool(P, HV, K, dtype=case["pool_dtype"], seed=1)
    src = kda.make_pool(Ps, HV, K, dtype=torch.bfloat16, seed=2) if case["source"] else None
    idx = None
    if case["idx_form"] == 1:
        idx = slots(N_seq, P)
    elif case["idx_form"] == 2:
        idx = slots(N_seq * T, P).reshape(N_seq, T)
    a = args._replace(initial_state=pool if idx is not None else None, ssm_state_indices=idx,
                      num_accepted_tokens=slots(N_seq, T + 1) if case["nat"] else None)
    Pr = Ps if src is not None else P
    cc = torch.full((Pr, HV, case["t_max"], K), 7.0) if case["records"] else None
    kg = torch.zeros(Pr, HV, case["t_max"], 2 * K, dtype=torch.bfloat16) if case["records"] else None
    s = SpecArgs(src, slots(N_seq, Ps) if src is not None else None, case["frozen"], cc, kg,
                 slots(N_seq * case["t_p"], T).reshape(N_seq, case["t_p"]) if case["tree"] else None)
    try:
        call = validate_spec(a, s, case["policy"], device_kind="any")
    except KDAError as e:
        name = str(e).split(":")[0]
        try:
            spec_verify_ref(a, s, null_policy=case["policy"])
        except KDAError as e2:
            assert str(e2).split(":")[0] == name
        return
    read = (src if src is not None else pool).clone()
    o, _ = spec_verify_ref(a, s, null_policy=case["policy"])
    assert torch.isfinite(o.float()).all()
    if call.frozen:
        assert kda.same_bits(src if src is not None else pool, read)
    if src is not None:
        assert kda.same_bits(src, read)
