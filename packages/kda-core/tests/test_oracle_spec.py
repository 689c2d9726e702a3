"""The spec-decode references (docs/design.md §9): source pool, frozen verify, RecoverSSM records and commit, tree
verify, each checked against the plain token-loop oracle (:func:`kda_core.oracle.recurrent_kda_ref`), which the
WY and hand-formula tests pin down independently. "Untouched" checks are bitwise.
"""

from __future__ import annotations

import pytest
import torch

from kda_core.call_args import RecurrentArgs, SpecArgs
from kda_core.contracts import NullSlotPolicy
from kda_core.errors import KDAError
from kda_core.oracle import recurrent_kda_ref, recurrent_kda_ref_args
from kda_core.oracle_spec import recoverssm_commit_layers_ref, recoverssm_commit_ref, spec_verify_ref

F32 = dict(dtype=torch.float32, out_dtype=None)
POLICIES = [NullSlotPolicy.OUT_OF_RANGE, NullSlotPolicy.NONPOSITIVE]


def _args(kda, B=3, T=4, H=2, HV=None, K=16, seed=0, gate="lower_bound", **kw):
    return RecurrentArgs(**kda.make_inputs(B=B, T=T, H=H, HV=HV, K=K, seed=seed, gate=gate), **kw)


def _close(a, b, rtol=1e-5, atol=1e-6):
    torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------------------------------------------
# SpecArgs() is the plain call


@pytest.mark.parametrize("mode", ["dense", "dense_none", "pool1d", "pool2d", "pool2d_nat", "varlen2d"])
@pytest.mark.parametrize("policy", POLICIES)
def test_default_spec_args_equal_the_plain_reference_bitwise(kda, mode, policy):
    B, T, H, HV, K, P = 3, 4, 2, 4, 16, 9
    base = kda.make_inputs(B=B, T=T, H=H, HV=HV, K=K, seed=3)
    extra = {}
    if mode == "dense":
        extra = dict(initial_state=kda.make_pool(B, HV, K, seed=4), output_final_state=True)
    elif mode == "dense_none":
        extra = dict(output_final_state=True)
    elif mode == "pool1d":
        extra = dict(ssm_state_indices=torch.tensor([4, -1, 1]))
    elif mode == "pool2d":
        extra = dict(ssm_state_indices=torch.tensor([[1, 2, 3, 4], [5, -1, 6, 7], [0, 8, P, 3]]))
    elif mode == "pool2d_nat":
        extra = dict(ssm_state_indices=torch.tensor([[1, 2, 3, 4], [5, -1, 6, 7], [0, 8, P, 3]]),
                     num_accepted_tokens=torch.tensor([2, 0, 9], dtype=torch.int32))
    elif mode == "varlen2d":
        base = {k: (v.reshape(1, B * T, *v.shape[2:]) if isinstance(v, torch.Tensor) and v.dim() >= 3 else v)
                for k, v in base.items()}
        extra = dict(ssm_state_indices=torch.tensor([[1, 2, 3, 4], [5, 6, -1, 7], [8, 0, 3, 2]]),
                     cu_seqlens=torch.tensor([0, 4, 6, 12]), num_accepted_tokens=torch.tensor([3, 1, 4]))
    pool_a = kda.make_pool(P, HV, K, seed=5)
    pool_b = pool_a.clone()
    if "ssm_state_indices" in extra:
        args_a = RecurrentArgs(**base, **extra, initial_state=pool_a)
        args_b = RecurrentArgs(**base, **extra, initial_state=pool_b)
    else:
        args_a = args_b = RecurrentArgs(**base, **extra)
    o_a, s_a = recurrent_kda_ref_args(args_a, null_policy=policy, **F32)
    o_b, s_b = spec_verify_ref(args_b, SpecArgs(), null_policy=policy, **F32)
    assert kda.same_bits(o_a, o_b)
    assert (s_a is None) == (s_b is None)
    if s_a is not None:
        assert kda.same_bits(s_a, s_b)
    assert kda.same_bits(pool_a, pool_b)


# ---------------------------------------------------------------------------------------------------------------
# Frozen verify


@pytest.mark.parametrize("two_d", [False, True])
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32])
def test_frozen_verify_leaves_the_pool_untouched_and_outputs_equal_the_plain_call(kda, two_d, pool_dtype):
    B, T, H, HV, K, P = 3, 4, 2, 4, 16, 6
    args = _args(kda, B=B, T=T, H=H, HV=HV, K=K, seed=7)
    pool = kda.make_pool(P, HV, K, dtype=pool_dtype, seed=8)
    before = pool.clone()
    slots = torch.tensor([2, -1, 5])
    idx = torch.stack([slots, torch.tensor([1, 0, -1]), torch.tensor([3, 3, 4]), torch.tensor([-1, 2, 0])], 1) \
        if two_d else slots
    o, out = spec_verify_ref(args._replace(initial_state=pool, ssm_state_indices=idx),
                             SpecArgs(disable_state_update=True), **F32)
    assert out is pool and kda.same_bits(pool, before)
    o_ref, _ = recurrent_kda_ref_args(args._replace(initial_state=before.clone(), ssm_state_indices=slots), **F32)
    assert kda.same_bits(o, o_ref)


# ---------------------------------------------------------------------------------------------------------------
# RecoverSSM: the chained verify -> commit equals the plain recurrence over the accepted stream


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_chained_verify_commit_equals_the_plain_recurrence_quick(kda, policy, pool_dtype):
    B, T, H, HV, K, P, steps = 3, 4, 2, 4, 16, 6, 5
    gen = torch.Generator().manual_seed(11)
    slots = torch.tensor([1, 4, 2])
    ckpt = kda.make_pool(P, HV, K, dtype=pool_dtype, seed=12)
    ref_pool = ckpt.clone()
    cc = torch.zeros(P, HV, T, K)
    kg = torch.zeros(P, HV, T, 2 * K, dtype=torch.bfloat16)
    for step in range(steps):
        args = _args(kda, B=B, T=T, H=H, HV=HV, K=K, seed=100 + step)
        before = ckpt.clone()
        o, _ = spec_verify_ref(args._replace(initial_state=ckpt, ssm_state_indices=slots),
                               SpecArgs(disable_state_update=True, correction_cache=cc, kg_cache=kg),
                               null_policy=policy, **F32)
        assert kda.same_bits(ckpt, before)
        nat = torch.randint(1, T + 1, (B,), generator=gen)
        recoverssm_commit_ref(ckpt, cc, kg, slots, nat, args.A_log, args.dt_bias, args.lower_bound,
                              null_policy=policy)
        for b in range(B):
            n = int(nat[b])
            sub = {f: (x[b:b + 1, :n] if isinstance(x, torch.Tensor) and x.dim() >= 3 else x)
                   for f, x in args._asdict().items()}
            sub.update(initial_state=ref_pool, ssm_state_indices=slots[b:b + 1])
            recurrent_kda_ref(**sub, **F32)
    if pool_dtype is torch.float32:
        _close(ckpt, ref_pool)
    else:
        _close(ckpt, ref_pool, rtol=2e-2, atol=1e-2)


def test_commit_layers_equal_per_layer_commits_quick(kda):
    P, HV, K, T = 4, 2, 8, 3
    layers = []
    for i in range(3):
        gen = torch.Generator().manual_seed(i)
        layers.append((kda.make_pool(P, HV, K, seed=20 + i), torch.randn(P, HV, T, K, generator=gen),
                       torch.randn(P, HV, T, 2 * K, generator=gen).bfloat16(), torch.rand(HV) - 0.5,
                       torch.randn(HV * K) * 0.5))
    slots, nat = torch.tensor([0, 3, -1]), torch.tensor([2, 3, 1])
    copies = [c.clone() for c, *_ in layers]
    recoverssm_commit_layers_ref([c for c, *_ in layers], [x[1] for x in layers], [x[2] for x in layers],
                                 [x[3] for x in layers], [x[4] for x in layers], -5.0, slots, nat)
    for (c, cc, kg, A, dt), c2 in zip(layers, copies):
        recoverssm_commit_ref(c2, cc, kg, slots, nat, A, dt, -5.0)
        assert kda.same_bits(c, c2)


def test_refusals_of_the_oracle(kda):
    args = _args(kda)
    pool = kda.make_pool(4, 2, 16)
    with pytest.raises(KDAError, match="num_accepted_tokens"):
        spec_verify_ref(args._replace(initial_state=pool, ssm_state_indices=torch.zeros(3, 4, dtype=torch.long),
                                      num_accepted_tokens=torch.ones(3)), SpecArgs(disable_state_update=True))
    with pytest.raises(KDAError, match="initial_state"):
        spec_verify_ref(args._replace(initial_state=pool, ssm_state_indices=torch.zeros(3, dtype=torch.long)),
                        SpecArgs(initial_state_source=pool[1:], initial_state_indices=torch.zeros(3)))
