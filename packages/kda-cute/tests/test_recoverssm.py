"""RecoverSSM commit kernel (kda_cute.recoverssm) against kda-core's oracle on the GPU, one behaviour per test.

Every expected value comes from ``kda_core.oracle_spec.recoverssm_commit_ref`` (or ``recoverssm_commit_layers_ref``)
run on clones of the same inputs. "Untouched" checks are bitwise. fp32 checkpoints: the committed state's max
error relative to the reference's largest magnitude is at most 1e-5; bf16: one rounding of the same fp32 value, so
every element is within one bf16 ulp of the reference.
"""

from __future__ import annotations

import pytest
import torch

from kda_core.contracts import NullSlotPolicy
from kda_core.oracle_spec import recoverssm_commit_layers_ref, recoverssm_commit_ref

pytestmark = pytest.mark.gpu

DEV = "cuda"
INT32_MIN = -(2**31)


def _gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


def make_records(P, HV, H, K=128, T_max=4, *, state_dtype=torch.bfloat16, kg_dtype=torch.bfloat16,
                 gate="lower_bound", seed=0, slot_pad=0, pages=False):
    """(checkpoint, correction_cache, kg_cache, gate kwargs, storages) of random records.

    ``slot_pad``: the checkpoint's slot stride is HV*K*K + slot_pad elements. ``pages``: both caches are views into
    page buffers with arbitrary slot, head and position strides (vLLM interleaves them in its pages), last dim
    contiguous; the kg strides stay 16-byte multiples, so the aligned build runs on them.
    """
    gen = _gen(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device=DEV) * scale

    ck_storage = randn(P, HV * K * K + slot_pad, scale=0.1).to(state_dtype)
    checkpoint = ck_storage.as_strided((P, HV, K, K), (HV * K * K + slot_pad, K * K, K, 1))
    if pages:
        # correction: slot stride 3 heads' worth + 5, head stride (T_max + 1) * (K + 3), pos stride K + 3 (fp32 scalars)
        cc_pos, cc_head = K + 3, (T_max + 1) * (K + 3)
        cc_slot = HV * cc_head + 5
        cc_storage = torch.full((P * cc_slot + cc_head,), float("nan"), device=DEV)
        corr = cc_storage.as_strided((P, HV, T_max, K), (cc_slot, cc_head, cc_pos, 1))
        # kg: multiples of 8 elements (16 bytes) with gaps: pos 2K + 8, head (T_max + 2) * pos, slot HV * head + 24
        kg_pos = 2 * K + 8
        kg_head = (T_max + 2) * kg_pos
        kg_slot = HV * kg_head + 24
        kg_storage = torch.full((P * kg_slot + kg_head,), float("nan"), device=DEV).to(kg_dtype)
        kg = kg_storage.as_strided((P, HV, T_max, 2 * K), (kg_slot, kg_head, kg_pos, 1))
        corr.copy_(randn(P, HV, T_max, K, scale=0.2))
        kg_values = torch.cat([randn(P, HV, T_max, K), randn(P, HV, T_max, K)], -1)
    else:
        cc_storage = kg_storage = None
        corr = randn(P, HV, T_max, K, scale=0.2)
        kg_values = torch.cat([randn(P, HV, T_max, K), randn(P, HV, T_max, K)], -1)
        kg = torch.empty(P, HV, T_max, 2 * K, device=DEV, dtype=kg_dtype)
    if gate == "precomputed":  # raw g is the log decay itself: keep it negative
        kg_values[..., K:] = -kg_values[..., K:].abs() * 0.3
    kg.copy_(kg_values.to(kg_dtype))
    gate_kw = dict(A_log=None, dt_bias=None, lower_bound=None)
    if gate != "precomputed":
        gate_kw = dict(A_log=torch.log(torch.rand(H, generator=gen, device=DEV) * 15 + 1),
                       dt_bias=randn(H * K, scale=0.5), lower_bound=-5.0 if gate == "lower_bound" else None)
    return checkpoint, corr, kg, gate_kw, (ck_storage, cc_storage, kg_storage)


def commit_both(checkpoint, corr, kg, slots, nat, gate_kw, **kw):
    """(kernel's checkpoint, oracle's checkpoint, the checkpoint before) on clones of the same inputs."""
    from kda_cute.recoverssm import recoverssm_commit

    before = checkpoint.clone()
    ref = checkpoint.clone()
    oracle_kw = {k: v for k, v in kw.items() if k != "config"}
    recoverssm_commit_ref(ref, corr, kg, slots, nat, gate_kw["A_log"], gate_kw["dt_bias"], gate_kw["lower_bound"],
                          **oracle_kw)
    corr_before, kg_before = corr.clone(), kg.clone()
    out = recoverssm_commit(checkpoint, corr, kg, slots, nat, gate_kw["A_log"], gate_kw["dt_bias"],
                            gate_kw["lower_bound"], **kw)
    torch.cuda.synchronize()
    assert out is checkpoint
    # the records are only read
    assert torch.equal(corr.nan_to_num(), corr_before.nan_to_num()) and torch.equal(kg, kg_before)
    return checkpoint, ref, before


def assert_committed(got, ref):
    """fp32: max |got - ref| / max |ref| <= 1e-5; bf16: every element within one bf16 ulp of the reference, or, where
    the fold cancels to a value near zero, within the fp32 sums' own error (1e-5 of the largest state value: the
    kernel and the oracle add the same terms in different orders, and one bf16 ulp of a cancelled value is smaller
    than that; measured on the H200: 9.5e-7 on a state of magnitude 0.3)."""
    if got.dtype == torch.float32:
        err = (got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)
        assert err <= 1e-5, f"max relative error {float(err):.3g}"
    else:
        g, r = got.float(), ref.float()
        tol = r.abs() * 2**-7 + 1e-5 * r.abs().max()
        assert bool(((g - r).abs() <= tol).all()), f"max diff {float((g - r).abs().max()):.3g}"
        assert (g == r).float().mean() > 0.99


def assert_untouched(got, before, untouched_slots):
    for s in untouched_slots:
        assert torch.equal(got[s], before[s]), f"slot {s} changed"


# ---- numerics: both dtypes, every gate form, GQA -------------------------------------------------------------


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gate", ["lower_bound", "softplus", "precomputed"])
def test_commit_matches_the_oracle(state_dtype, gate):
    from kda_cute.recoverssm import CommitConfig

    P, HV, H, T_max = 12, 4, 2, 4  # GQA: value head hv reads gate parameters of q/k head hv // 2
    ck, corr, kg, gate_kw, _ = make_records(P, HV, H, T_max=T_max, state_dtype=state_dtype, gate=gate, seed=1)
    slots = torch.tensor([3, 7, 1, 10, 5, 8, 2, 11], dtype=torch.int32, device=DEV)
    #                 partial, all, past T, negative, INT_MIN, zero, one, past len
    nat = torch.tensor([2, 4, 9, -1, INT32_MIN, 0, 1, 4], dtype=torch.int32, device=DEV)
    qsl = torch.tensor([0, 4, 8, 12, 16, 20, 24, 28, 31], dtype=torch.int32, device=DEV)  # last row: length 3
    # tile 64: the schedule's tile for large grids (8 rows per thread); the small calls below take its tile 16
    got, ref, before = commit_both(ck, corr, kg, slots, nat, gate_kw, query_start_loc=qsl, config=CommitConfig(64))
    assert_committed(got, ref)
    # rows with nothing to commit and slots no row names are bitwise untouched
    assert_untouched(got, before, [10, 5, 8, 0, 4, 6, 9])
    for s in (3, 7, 1, 2, 11):
        assert not torch.equal(got[s], before[s])


@pytest.mark.parametrize("K,tile_v", [(64, 16), (64, 64), (128, 16)])
def test_head_dims(K, tile_v):
    from kda_cute.recoverssm import CommitConfig

    # K=64: 8 lanes per row, 16 row groups (16 tokens per chunk), 1 or 4 rows per thread
    ck, corr, kg, gate_kw, _ = make_records(9, 2, 2, K=K, T_max=8, seed=2, state_dtype=torch.float32)
    slots = torch.tensor([4, 0, 8], dtype=torch.int32, device=DEV)
    nat = torch.tensor([8, 5, 3], dtype=torch.int32, device=DEV)
    got, ref, _ = commit_both(ck, corr, kg, slots, nat, gate_kw, config=CommitConfig(tile_v))
    assert_committed(got, ref)


@pytest.mark.parametrize("flags", ["no-l2norm", "no-dt-bias", "kg-fp32", "tile32", "tile8"])
def test_variant_flags(flags):
    from kda_cute.recoverssm import CommitConfig

    kw = {}
    kg_dtype = torch.float32 if flags == "kg-fp32" else torch.bfloat16
    ck, corr, kg, gate_kw, _ = make_records(8, 4, 4, T_max=4, kg_dtype=kg_dtype, seed=3, state_dtype=torch.float32)
    if flags == "no-l2norm":
        kg[..., :128] *= 128**-0.5  # unnormalised keys of a stable size
        kw["use_qk_l2norm_in_kernel"] = False
    if flags == "no-dt-bias":
        gate_kw["dt_bias"] = None
    if flags.startswith("tile"):  # tile 8 at K=128: fewer u values than lanes, one row per thread
        kw["config"] = CommitConfig(int(flags[4:]))
    slots = torch.tensor([1, 6, 3], dtype=torch.int32, device=DEV)
    nat = torch.tensor([4, 2, 3], dtype=torch.int32, device=DEV)
    got, ref, _ = commit_both(ck, corr, kg, slots, nat, gate_kw, **kw)
    assert_committed(got, ref)


def test_more_tokens_than_one_chunk():
    # K=128 prepares 8 tokens per chunk: T_max 19 runs three chunks, the last one partial
    ck, corr, kg, gate_kw, _ = make_records(5, 2, 1, T_max=19, seed=4, state_dtype=torch.float32)
    slots = torch.tensor([2, 4, 0], dtype=torch.int32, device=DEV)
    nat = torch.tensor([19, 9, 16], dtype=torch.int32, device=DEV)
    got, ref, _ = commit_both(ck, corr, kg, slots, nat, gate_kw)
    assert_committed(got, ref)


@pytest.mark.parametrize("ring", [8, 2], ids=["ring8", "ring2"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gate", ["lower_bound", "precomputed"])
def test_bulk_ring_matches_the_oracle(gate, state_dtype, ring):
    # the ring path: the whole state streamed through shared memory, every token (T_max = 8 = one chunk of tokens)
    # folded once; counts 8 (a full chunk), partial, 0, negative, past the row's length; null slots under
    # nonpositive; GQA
    from kda_cute.recoverssm import CommitConfig

    P, HV, H, T_max = 12, 4, 2, 8
    ck, corr, kg, gate_kw, _ = make_records(P, HV, H, T_max=T_max, state_dtype=state_dtype, gate=gate, seed=31)
    slots = torch.tensor([3, 7, 1, 10, 5, 0, 2, 11], dtype=torch.int32, device=DEV)
    nat = torch.tensor([8, 5, 1, -2, 0, 3, 8, 8], dtype=torch.int32, device=DEV)
    qsl = torch.tensor([0, 8, 16, 24, 32, 40, 48, 56, 62], dtype=torch.int32, device=DEV)  # last row: length 6
    got, ref, before = commit_both(ck, corr, kg, slots, nat, gate_kw, query_start_loc=qsl,
                                   null_policy=NullSlotPolicy.NONPOSITIVE, config=CommitConfig(128, bulk_ring=ring))
    assert_committed(got, ref)
    assert_untouched(got, before, [10, 5, 0, 4, 6, 8, 9])
    for s in (3, 7, 1, 2, 11):
        assert not torch.equal(got[s], before[s])


def test_bulk_ring_on_interleaved_pages_and_a_padded_slot_stride():
    # slot stride + 64 elements (16-byte multiple: the ring runs) and caches in page buffers; padding and gaps
    # untouched
    from kda_cute.recoverssm import CommitConfig

    P, HV, K = 7, 2, 128
    ck, corr, kg, gate_kw, (ck_st, cc_st, kg_st) = make_records(P, HV, 1, T_max=5, seed=32, slot_pad=64, pages=True)
    ck_before, cc_before, kg_before = ck_st.clone(), cc_st.clone(), kg_st.clone()
    slots = torch.tensor([6, 2, 4], dtype=torch.int32, device=DEV)
    nat = torch.tensor([5, 3, 0], dtype=torch.int32, device=DEV)
    got, ref, before = commit_both(ck, corr, kg, slots, nat, gate_kw, config=CommitConfig(128, bulk_ring=8))
    assert_committed(got, ref)
    assert torch.equal(ck_st[:, HV * K * K:], ck_before[:, HV * K * K:])
    assert_untouched(got, before, [0, 1, 3, 4, 5])
    assert torch.equal(cc_st.nan_to_num(), cc_before.nan_to_num()) and torch.equal(kg_st.nan_to_num(),
                                                                                     kg_before.nan_to_num())


@pytest.mark.parametrize("case", ["T_max-past-a-chunk", "unaligned"])
def test_a_ring_config_the_call_cannot_take_runs_the_register_path(case):
    # T_max = 12 (two chunks of tokens) or a slot stride of + 17 elements: the ring is not eligible and the
    # register path commits the call instead (same answer)
    from kda_cute.recoverssm import CommitConfig

    T_max, pad = (12, 0) if case == "T_max-past-a-chunk" else (4, 17)
    ck, corr, kg, gate_kw, _ = make_records(5, 2, 1, T_max=T_max, seed=33, slot_pad=pad)
    slots = torch.tensor([2, 4, 1], dtype=torch.int32, device=DEV)
    nat = torch.tensor([T_max, 3, 1], dtype=torch.int32, device=DEV)
    got, ref, _ = commit_both(ck, corr, kg, slots, nat, gate_kw, config=CommitConfig(128, bulk_ring=8))
    assert_committed(got, ref)


# ---- bounds and null rows ------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", list(NullSlotPolicy), ids=lambda p: p.value)
def test_null_policies(policy):
    P = 8
    ck, corr, kg, gate_kw, _ = make_records(P, 2, 2, T_max=4, seed=5)
    slots = torch.tensor([0, 3, -1, P, 5], dtype=torch.int32, device=DEV)
    nat = torch.tensor([3, 2, 4, 4, 4], dtype=torch.int32, device=DEV)
    got, ref, before = commit_both(ck, corr, kg, slots, nat, gate_kw, null_policy=policy)
    assert_committed(got, ref)
    assert_untouched(got, before, [1, 2, 4, 6, 7])
    assert torch.equal(got[0], before[0]) == (policy == NullSlotPolicy.NONPOSITIVE)  # vLLM never touches slot 0


def test_int64_slots_past_2_31_are_null_not_wrapped():
    P = 6
    ck, corr, kg, gate_kw, _ = make_records(P, 2, 2, T_max=4, seed=6)
    # 2^32 + 1 would wrap to slot 1 in 32 bits, 2^31 + 2 to a negative one; both are null in 64 bits
    slots = torch.tensor([2**32 + 1, 2**31 + 2, 3, -(2**40)], dtype=torch.int64, device=DEV)
    nat = torch.tensor([4, 4, 2**40, 4], dtype=torch.int64, device=DEV)  # 2^40 clamps to T_max, not to 0
    got, ref, before = commit_both(ck, corr, kg, slots, nat, gate_kw)
    assert_committed(got, ref)
    assert_untouched(got, before, [0, 1, 2, 4, 5])
    assert not torch.equal(got[3], before[3])


def test_strided_index_views_and_int64_offsets():
    P = 10
    ck, corr, kg, gate_kw, _ = make_records(P, 2, 1, T_max=6, seed=7, state_dtype=torch.float32)
    table = torch.tensor([[9, 4, 7], [9, 1, 7], [9, 8, 7], [9, 6, 7]], dtype=torch.int64, device=DEV)
    slots = table[:, 1]  # a column of a wider table (stride 3)
    nat = torch.tensor([5, -3, 6, -3, 2, -3, 6, -3], dtype=torch.int32, device=DEV)[::2]  # stride 2
    qsl = torch.tensor([0, -1, 6, -1, 8, -1, 14, -1, 14], dtype=torch.int64, device=DEV)[::2]  # lengths 6, 2, 6, 0
    got, ref, before = commit_both(ck, corr, kg, slots, nat, gate_kw, query_start_loc=qsl)
    assert_committed(got, ref)
    assert_untouched(got, before, [6, 0, 2, 3, 5, 7, 9])  # slot 6's row has length 0


@pytest.mark.parametrize("qsl_case", ["decreasing", "none", "int64-past-2-31"])
def test_query_start_loc_bounds_the_commit_length(qsl_case):
    ck, corr, kg, gate_kw, _ = make_records(6, 2, 2, T_max=4, seed=8, state_dtype=torch.float32)
    slots = torch.tensor([1, 2, 3], dtype=torch.int32, device=DEV)
    nat = torch.tensor([4, 4, 4], dtype=torch.int32, device=DEV)
    qsl = {"decreasing": torch.tensor([5, 3, 4, 6], dtype=torch.int32, device=DEV),  # lengths 0 (negative), 1, 2
           "none": None,
           "int64-past-2-31": torch.tensor([2**33, 2**33 + 3, 2**34, 2**34 + 1], dtype=torch.int64, device=DEV),
           }[qsl_case]
    got, ref, before = commit_both(ck, corr, kg, slots, nat, gate_kw, query_start_loc=qsl)
    assert_committed(got, ref)
    if qsl_case == "decreasing":
        assert_untouched(got, before, [1])


@pytest.mark.parametrize("slot_pad", [17, 64], ids=["pad17-unaligned", "pad64-aligned"])
def test_padded_slot_stride_and_interleaved_pages(slot_pad):
    # slot stride + 17 elements (a bf16 checkpoint then takes the unaligned build) or + 64 (aligned), and caches in
    # page buffers with arbitrary strides; the padding and every gap of the pages stay bitwise untouched
    P, HV, K = 7, 2, 128
    ck, corr, kg, gate_kw, (ck_st, cc_st, kg_st) = make_records(P, HV, 1, T_max=5, seed=9, slot_pad=slot_pad,
                                                                pages=True)
    ck_before, cc_before, kg_before = ck_st.clone(), cc_st.clone(), kg_st.clone()
    slots = torch.tensor([6, 2, 4], dtype=torch.int32, device=DEV)
    nat = torch.tensor([5, 3, 0], dtype=torch.int32, device=DEV)
    got, ref, before = commit_both(ck, corr, kg, slots, nat, gate_kw)
    assert_committed(got, ref)
    assert torch.equal(ck_st[:, HV * K * K:], ck_before[:, HV * K * K:])  # the padding elements of each slot
    assert_untouched(got, before, [0, 1, 3, 4, 5])
    assert torch.equal(cc_st.nan_to_num(), cc_before.nan_to_num()) and torch.equal(kg_st.nan_to_num(),
                                                                                     kg_before.nan_to_num())


def test_more_rows_than_grid_z():
    from kda_cute.recoverssm import GRID_Z_MAX

    P, N = 6, GRID_Z_MAX + 3
    ck, corr, kg, gate_kw, _ = make_records(P, 1, 1, T_max=2, seed=10, state_dtype=torch.float32)
    slots = torch.full((N,), -1, dtype=torch.int32, device=DEV)
    nat = torch.zeros(N, dtype=torch.int32, device=DEV)
    slots[[0, GRID_Z_MAX - 1, GRID_Z_MAX + 1]] = torch.tensor([1, 2, 4], dtype=torch.int32, device=DEV)
    nat[[0, GRID_Z_MAX - 1, GRID_Z_MAX + 1]] = torch.tensor([2, 1, 2], dtype=torch.int32, device=DEV)
    got, ref, before = commit_both(ck, corr, kg, slots, nat, gate_kw)
    assert_committed(got, ref)
    assert_untouched(got, before, [0, 3, 5])
    assert not torch.equal(got[4], before[4])  # the second launch's row


# ---- several layers in one launch ------------------------------------------------------------------------------


def _layers(L, state_dtype, *, pages):
    """L layers of one shape: separately allocated, or (pages) pages of one buffer per tensor kind with the layers
    interleaved inside each slot's page."""
    P, HV, H, K, T_max = 9, 2, 1, 128, 4
    layers = [make_records(P, HV, H, K=K, T_max=T_max, state_dtype=state_dtype, seed=20 + i) for i in range(L)]
    cks, corrs, kgs = [x[0] for x in layers], [x[1] for x in layers], [x[2] for x in layers]
    if pages:
        ck_buf = torch.empty(P, L, HV, K, K, dtype=state_dtype, device=DEV)
        cc_buf = torch.empty(P, L, HV, T_max, K, device=DEV)
        kg_buf = torch.empty(P, HV, L, T_max, 2 * K, dtype=torch.bfloat16, device=DEV)
        for i in range(L):
            ck_buf[:, i].copy_(cks[i])
            cc_buf[:, i].copy_(corrs[i])
            kg_buf[:, :, i].copy_(kgs[i])
        cks, corrs, kgs = [ck_buf[:, i] for i in range(L)], [cc_buf[:, i] for i in range(L)], \
            [kg_buf[:, :, i] for i in range(L)]
    return cks, corrs, kgs, [x[3]["A_log"] for x in layers], [x[3]["dt_bias"] for x in layers]


@pytest.mark.parametrize("L,pages", [(1, False), (3, False), (3, True)], ids=["L1", "L3-separate", "L3-pages"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_plan_commits_every_layer_like_the_layered_oracle(L, pages, state_dtype, config=None):
    from kda_cute.recoverssm import RecoverSSMCommitPlan

    cks, corrs, kgs, A_logs, dt_biases = _layers(L, state_dtype, pages=pages)
    refs = [c.clone() for c in cks]
    befores = [c.clone() for c in cks]
    slots = torch.tensor([5, 0, 8, 3], dtype=torch.int64, device=DEV)
    nat = torch.tensor([4, 3, 0, 2], dtype=torch.int64, device=DEV)
    qsl = torch.tensor([0, 4, 8, 12, 13], dtype=torch.int32, device=DEV)  # the last row's length 1 bounds it
    policy = NullSlotPolicy.NONPOSITIVE
    recoverssm_commit_layers_ref(refs, corrs, kgs, A_logs, dt_biases, -5.0, slots, nat, query_start_loc=qsl,
                                 null_policy=policy)
    plan = RecoverSSMCommitPlan(cks, corrs, kgs, A_logs, dt_biases, -5.0, null_policy=policy, config=config)
    plan.commit(slots, nat, query_start_loc=qsl)
    torch.cuda.synchronize()
    for i in range(L):
        assert_committed(cks[i], refs[i])
        assert_untouched(cks[i], befores[i], [0, 1, 2, 4, 6, 7, 8])


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_plan_on_the_bulk_ring(state_dtype):
    from kda_cute.recoverssm import CommitConfig

    test_plan_commits_every_layer_like_the_layered_oracle(3, True, state_dtype,
                                                          config=CommitConfig(128, bulk_ring=8))


# ---- destinations: read one slot, store another -----------------------------------------------------------------


DESTINATION_CONFIGS = {"tile64": (64, 0), "tile16": (16, 0), "ring8": (128, 8)}


@pytest.mark.parametrize("config", list(DESTINATION_CONFIGS))
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_commit_into_destination_slots_leaves_the_sources(state_dtype, config):
    """Row n folds slot slots[n]'s checkpoint and records into slot dst[n]: the oracle's result there, the source
    untouched (unless it is its own destination), and a null or out-of-range destination makes the row commit
    nothing (vLLM's policy: 0 is null)."""
    from kda_cute.recoverssm import CommitConfig

    P, HV, H, T_max = 14, 4, 2, 4
    ck, corr, kg, gate_kw, _ = make_records(P, HV, H, T_max=T_max, state_dtype=state_dtype, seed=41)
    slots = torch.tensor([3, 7, 1, 10, 5, 6], dtype=torch.int32, device=DEV)
    dst = torch.tensor([9, 7, 12, 0, 14, 2], dtype=torch.int32, device=DEV)
    #                    move, itself, move, null, past P, move
    nat = torch.tensor([2, 4, 3, 4, 4, 1], dtype=torch.int32, device=DEV)
    tile, ring = DESTINATION_CONFIGS[config]
    got, ref, before = commit_both(ck, corr, kg, slots, nat, gate_kw, null_policy=NullSlotPolicy.NONPOSITIVE,
                                   destination_indices=dst, config=CommitConfig(tile, bulk_ring=ring))
    assert_committed(got, ref)
    assert_untouched(got, before, [0, 1, 3, 4, 5, 6, 8, 10, 11, 13])  # sources, the null row's, and unnamed slots
    for s in (9, 7, 12, 2):
        assert not torch.equal(got[s], before[s])
    # the moved states are the in-place fold of their sources
    in_place = before.clone()
    recoverssm_commit_ref(in_place, corr, kg, slots[[0, 2, 5]], nat[[0, 2, 5]], gate_kw["A_log"],
                          gate_kw["dt_bias"], gate_kw["lower_bound"])
    for s, d in ((3, 9), (1, 12), (6, 2)):  # to rounding: a batched fold may round one ulp off a smaller batch's
        assert_committed(ref[d], in_place[s])


@pytest.mark.parametrize("config", [None, (128, 8)], ids=["schedule", "ring8"])
def test_plan_commits_into_destination_slots_in_every_layer(config):
    from kda_cute.recoverssm import CommitConfig, RecoverSSMCommitPlan

    cks, corrs, kgs, A_logs, dt_biases = _layers(3, torch.bfloat16, pages=True)
    refs = [c.clone() for c in cks]
    befores = [c.clone() for c in cks]
    slots = torch.tensor([5, 0, 8, 3], dtype=torch.int64, device=DEV)
    dst = torch.tensor([1, 6, 8, 7], dtype=torch.int64, device=DEV)  # moves, a null source, in place, moves
    nat = torch.tensor([4, 3, 2, 2], dtype=torch.int64, device=DEV)
    qsl = torch.tensor([0, 4, 8, 12, 13], dtype=torch.int32, device=DEV)  # the last row's length 1 bounds it
    policy = NullSlotPolicy.NONPOSITIVE
    recoverssm_commit_layers_ref(refs, corrs, kgs, A_logs, dt_biases, -5.0, slots, nat, query_start_loc=qsl,
                                 null_policy=policy, destination_indices=dst)
    plan = RecoverSSMCommitPlan(cks, corrs, kgs, A_logs, dt_biases, -5.0, null_policy=policy,
                                config=None if config is None else CommitConfig(*config[:1], bulk_ring=config[1]))
    plan.commit(slots, nat, query_start_loc=qsl, destination_indices=dst)
    torch.cuda.synchronize()
    for i in range(3):
        assert_committed(cks[i], refs[i])
        assert_untouched(cks[i], befores[i], [0, 2, 3, 4, 5, 6])  # the sources, the null row's target, the rest
        for s in (1, 8, 7):
            assert not torch.equal(cks[i][s], befores[i][s])


# ---- CUDA graphs ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", ["single", "plan"])
def test_graph_replay_equals_eager_bit_for_bit(entry):
    from kda_cute.recoverssm import RecoverSSMCommitPlan, recoverssm_commit

    ck, corr, kg, gate_kw, _ = make_records(8, 4, 2, T_max=4, seed=30)
    slots = torch.tensor([2, 6, 5], dtype=torch.int32, device=DEV)
    nat = torch.tensor([3, 4, 1], dtype=torch.int32, device=DEV)
    eager, graphed, warm = ck.clone(), ck.clone(), ck.clone()
    args = (gate_kw["A_log"], gate_kw["dt_bias"], gate_kw["lower_bound"])
    if entry == "single":
        def run(target):
            recoverssm_commit(target, corr, kg, slots, nat, *args)
    else:
        plans = {id(t): RecoverSSMCommitPlan([t], [corr], [kg], [args[0]], [args[1]], args[2])
                 for t in (eager, graphed, warm)}

        def run(target):
            plans[id(target)].commit(slots, nat)
    run(warm)  # compile and load the module before capture
    run(eager)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(graphed)
    assert torch.equal(graphed, ck)  # capture launched nothing
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graphed, eager)


# ---- end to end with the oracle's verify ------------------------------------------------------------------------


def test_verify_records_then_commit_equal_the_plain_recurrence_over_the_accepted_prefix():
    # Records from the oracle's frozen verify, committed by the kernel, against the plain recurrence run on the
    # accepted tokens only (fp32 checkpoints: equal to rounding).
    from kda_core.call_args import RecurrentArgs, SpecArgs
    from kda_core.oracle import recurrent_kda_ref
    from kda_core.oracle_spec import spec_verify_ref
    from kda_cute.recoverssm import recoverssm_commit

    B, T, H, HV, K, P = 3, 4, 2, 4, 128, 7
    gen = _gen(40)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device=DEV) * scale

    inputs = dict(q=randn(B, T, H, K).bfloat16(), k=randn(B, T, H, K).bfloat16(), v=randn(B, T, HV, K).bfloat16(),
                  g=randn(B, T, HV, K).bfloat16(), beta=randn(B, T, HV).bfloat16(),
                  A_log=torch.log(torch.rand(H, generator=gen, device=DEV) * 15 + 1), dt_bias=randn(H * K, scale=0.5),
                  lower_bound=-5.0, use_gate_in_kernel=True, beta_is_logit=True, use_qk_l2norm_in_kernel=True)
    ck = randn(P, HV, K, K, scale=0.1)
    slots = torch.tensor([4, 1, 6], device=DEV)
    corr = torch.zeros(P, HV, T, K, device=DEV)
    kg = torch.zeros(P, HV, T, 2 * K, dtype=torch.bfloat16, device=DEV)
    spec_verify_ref(RecurrentArgs(**inputs, initial_state=ck, ssm_state_indices=slots),
                    SpecArgs(disable_state_update=True, correction_cache=corr, kg_cache=kg), dtype=torch.float32)
    expected = ck.clone()
    nat = torch.tensor([3, 4, 1], dtype=torch.int32, device=DEV)
    for b in range(B):
        n = int(nat[b])
        sub = {f: (x[b:b + 1, :n] if isinstance(x, torch.Tensor) and x.dim() >= 3 else x) for f, x in inputs.items()}
        recurrent_kda_ref(**sub, initial_state=expected, ssm_state_indices=slots[b:b + 1], dtype=torch.float32)
    recoverssm_commit(ck, corr, kg, slots.int(), nat, inputs["A_log"], inputs["dt_bias"], -5.0)
    torch.cuda.synchronize()
    assert_committed(ck, expected)
