"""The generic kernel's spec-verify facets (kda_cute.generic) against kda-core's spec oracle on the GPU.

Every expected value comes from ``kda_core.oracle_spec.spec_verify_ref`` run on clones of the same inputs (same
null policy). The facets: the first state read from ``initial_state_source``; a frozen verify
(``disable_state_update``) that writes no state; its RecoverSSM records (``correction_cache``, ``kg_cache``); tree
verify (``parent_indices``). Compiles are the cost of this file, so the cases share variants: value heads HV = 4
over H = 2 query heads (GQA) and at most 12 sequences (one schedule tile) unless a case says otherwise.
"""

from __future__ import annotations

import pytest
import torch

from kda_core.contracts import NullSlotPolicy

pytestmark = pytest.mark.gpu

DEV = "cuda"
OOR, NONPOS = NullSlotPolicy.OUT_OF_RANGE, NullSlotPolicy.NONPOSITIVE
H, HV = 2, 4


def _gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


def make_inputs(B, T, K=128, *, seed=0, lengths=None):
    """Random bf16 q, k, v, raw g, beta logits with the lower-bound gate's parameters, as keyword arguments of the
    kernel entry and of ``RecurrentArgs``. ``lengths``: varlen sequences of these lengths ([1, sum, ...] plus
    ``cu_seqlens`` int32)."""
    gen = _gen(seed)
    if lengths is not None:
        B, T = 1, sum(lengths)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device=DEV) * scale

    kw = dict(
        q=randn(B, T, H, K).bfloat16(), k=randn(B, T, H, K).bfloat16(), v=randn(B, T, HV, K).bfloat16(),
        g=randn(B, T, HV, K).bfloat16(), beta=randn(B, T, HV).bfloat16(),
        A_log=torch.log(torch.rand(H, generator=gen, device=DEV) * 15 + 1), dt_bias=randn(H * K, scale=0.5),
        lower_bound=-5.0, use_gate_in_kernel=True, beta_is_logit=True, use_qk_l2norm_in_kernel=True,
    )
    if lengths is not None:
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        kw["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32, device=DEV)
    return kw


def make_states(P, K=128, dtype=torch.bfloat16, *, seed=1, row_pad=0):
    """A pool or source [P, HV, K, K] (K contiguous) whose slot stride is padded by ``row_pad`` elements."""
    storage = (torch.randn(P, HV * K * K + row_pad, generator=_gen(seed), device=DEV) * 0.1).to(dtype)
    return storage.as_strided((P, HV, K, K), (HV * K * K + row_pad, K * K, K, 1))


def make_records(Pr, T_max, K=128, *, interleave=2):
    """correction_cache [Pr, HV, T_max, V] fp32 and kg_cache [Pr, HV, T_max, 2K] bf16, filled with sentinels, as
    views of every ``interleave``-th slot of larger buffers (vLLM interleaves pages: slot strides are free)."""
    corr = torch.full((Pr * interleave, HV, T_max, K), 7.0, device=DEV)[::interleave]
    kg = torch.full((Pr * interleave, HV, T_max, 2 * K), -3.0, device=DEV).bfloat16()[::interleave]
    return corr, kg


def strided(values, dtype=torch.int32, stride=8):
    """A 1-D index tensor [N] as a column of a wider table (stride ``stride``)."""
    table = torch.full((len(values), stride), -5, dtype=dtype, device=DEV)
    table[:, 0] = torch.tensor(values, dtype=dtype, device=DEV)
    return table[:, 0]


def strided_2d(rows, dtype=torch.int32, stride=8):
    """A 2-D index tensor [N, T] whose column stride is ``stride``."""
    N, T = len(rows), len(rows[0])
    table = torch.full((N, T, stride), -5, dtype=dtype, device=DEV)
    table[..., 0] = torch.tensor(rows, dtype=dtype, device=DEV)
    return table[..., 0]


def run_both(inputs, *, null_policy=OOR, **kw):
    """(kernel (o, final), oracle (o, final), the oracle's record caches). Every tensor the call writes is cloned
    for the oracle, so each side updates its own copy."""
    from kda_core.call_args import RecurrentArgs, SpecArgs
    from kda_core.oracle_spec import spec_verify_ref
    from kda_cute.generic import kda_recurrent_fwd

    spec_names = set(SpecArgs._fields)
    written = ("initial_state", "correction_cache", "kg_cache")
    ref_kw = {k: (v.clone() if k in written and v is not None else v) for k, v in kw.items()}
    ref = spec_verify_ref(
        RecurrentArgs(**inputs, **{k: v for k, v in ref_kw.items() if k not in spec_names}),
        SpecArgs(**{k: v for k, v in ref_kw.items() if k in spec_names}), null_policy=null_policy)
    out = kda_recurrent_fwd(**inputs, **kw, null_policy=null_policy)
    torch.cuda.synchronize()
    return out, ref, ref_kw


def assert_output_close(o, ref_o):
    """Outputs within bf16 rounding (plus fp32 summation order) of the oracle's; rows the oracle zeroes (inactive,
    skipped, dead tokens, tokens of no sequence) are exactly zero."""
    assert o.dtype == torch.bfloat16 and o.shape == ref_o.shape
    scale = ref_o.float().abs().max().item() + 1e-6
    torch.testing.assert_close(o.float(), ref_o.float(), atol=2e-2 * scale, rtol=2e-2)
    zero_rows = (ref_o == 0).all(dim=-1)
    assert torch.count_nonzero(o[zero_rows]) == 0


def assert_state_close(state, ref_state):
    if state.dtype == torch.bfloat16:
        tol = dict(atol=2e-3, rtol=1.6e-2)  # one bf16 rounding of the stored state
    else:
        tol = dict(atol=5e-5, rtol=5e-4)
    torch.testing.assert_close(state.float(), ref_state.float(), **tol)


def assert_records_match(corr, kg, ref_corr, ref_kg):
    """u within fp32 summation order of the oracle's (tight enough that a u rounded to bf16 fails); raw k | raw g
    copies exact; every other element (sentinels of other slots and positions) bitwise the oracle's, which writes
    nothing else."""
    written = ref_corr != 7.0
    assert torch.equal(corr[~written], ref_corr[~written])
    scale = ref_corr[written].abs().max().item() + 1e-6 if written.any() else 1.0
    torch.testing.assert_close(corr, ref_corr, atol=2e-4 * scale, rtol=2e-4)
    assert torch.equal(kg, ref_kg)


# --------------------------------------------------------------------------------------------------
# frozen verify: no state written
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pool_dtype, policy, idx_dtype", [
    (torch.bfloat16, OOR, torch.int32), (torch.float32, NONPOS, torch.int64)], ids=["bf16-oor-i32", "fp32-np-i64"])
@pytest.mark.parametrize("index_rank", [1, 2])
def test_frozen_verify_matches_oracle_and_leaves_the_pool_bitwise_untouched(pool_dtype, policy, idx_dtype,
                                                                            index_rank):
    B, T, P = 6, 5, 9
    inputs = make_inputs(B, T, seed=1)
    pool = make_states(P, dtype=pool_dtype)
    before = pool.clone()
    read = [4, 0, -1, 8, 9, 2]  # 0 is null under NONPOSITIVE, -1 and 9 under both
    if index_rank == 1:
        slots = strided(read, idx_dtype)
    else:  # 2-D: the read is column 0; the other columns are never read or written
        slots = strided_2d([[r, 1, 3, 5, 6] for r in read], idx_dtype)
    (o, final), (ref_o, _), _ = run_both(inputs, null_policy=policy, initial_state=pool, ssm_state_indices=slots,
                                         disable_state_update=True)
    assert final is pool
    assert_output_close(o, ref_o)
    assert torch.equal(pool, before)
    if policy == NONPOS:
        assert torch.count_nonzero(o[1]) == 0  # the row of slot 0
    assert torch.count_nonzero(o[2]) == 0 and torch.count_nonzero(o[4]) == 0


@pytest.mark.parametrize("source_dtype, policy, idx_dtype", [
    (torch.bfloat16, OOR, torch.int32), (torch.float32, NONPOS, torch.int64)], ids=["bf16-oor-i32", "fp32-np-i64"])
def test_frozen_verify_from_a_source_reads_it_and_writes_nothing(source_dtype, policy, idx_dtype):
    B, T = 5, 4
    inputs = make_inputs(B, T, seed=2)
    source = make_states(7, dtype=source_dtype, seed=3)
    before = source.clone()
    src_idx = strided([6, 0, 2, -1, 3], idx_dtype)
    (o, final), (ref_o, ref_final), _ = run_both(inputs, null_policy=policy, initial_state_source=source,
                                                 initial_state_indices=src_idx, disable_state_update=True)
    assert final is None and ref_final is None
    assert_output_close(o, ref_o)
    assert torch.equal(source, before)


def test_frozen_verify_varlen_with_empty_and_short_sequences():
    lengths = [0, 1, 3, 8]
    inputs = make_inputs(0, 0, seed=4, lengths=lengths)
    pool = make_states(6)
    before = pool.clone()
    slots = strided_2d([[5, 0, 0, 0, 0, 0, 0, 0], [1, 2, 2, 2, 2, 2, 2, 2], [0, -1, -1, 4, 4, 4, 4, 4],
                        [3, -1, -1, -1, -1, -1, -1, -1]])
    (o, _), (ref_o, _), _ = run_both(inputs, initial_state=pool, ssm_state_indices=slots, disable_state_update=True)
    assert_output_close(o, ref_o)
    assert torch.equal(pool, before)


def test_frozen_verify_with_an_unaligned_slot_stride_matches_oracle():
    # a slot stride of the row + 17 elements (FlashInfer's tests): the unaligned variant
    B, T = 4, 6
    inputs = make_inputs(B, T, seed=5)
    pool = make_states(5, row_pad=17)
    before = pool.clone()
    corr, kg = make_records(5, T)
    (o, _), (ref_o, _), ref = run_both(inputs, initial_state=pool, ssm_state_indices=strided([3, 1, 4, 0]),
                                       disable_state_update=True, correction_cache=corr, kg_cache=kg)
    assert_output_close(o, ref_o)
    assert torch.equal(pool, before)
    assert_records_match(corr, kg, ref["correction_cache"], ref["kg_cache"])


# --------------------------------------------------------------------------------------------------
# RecoverSSM records
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("K", [128, 64])
@pytest.mark.parametrize("T_max", [8, 5], ids=["Tmax=T", "Tmax<T"])
def test_records_hold_u_and_raw_k_g_of_the_read_slots(K, T_max):
    B, T, P = 6, 8, 10
    inputs = make_inputs(B, T, K, seed=6 + K + T_max)
    pool = make_states(P, K)
    before = pool.clone()
    corr, kg = make_records(P, T_max, K)
    slots = strided([7, -1, 2, 9, 11, 0])  # rows 1 and 4 inactive: they write no record
    (o, _), (ref_o, _), ref = run_both(inputs, initial_state=pool, ssm_state_indices=slots,
                                       disable_state_update=True, correction_cache=corr, kg_cache=kg)
    assert_output_close(o, ref_o)
    assert torch.equal(pool, before)
    assert_records_match(corr, kg, ref["correction_cache"], ref["kg_cache"])
    untouched = [s for s in range(P) if s not in (7, 2, 9, 0)]
    assert (corr[untouched] == 7.0).all() and (kg[untouched] == -3.0).all()


def test_records_of_a_varlen_frozen_verify_from_a_source():
    lengths = [3, 0, 8, 1]
    inputs = make_inputs(0, 0, seed=7, lengths=lengths)
    source = make_states(6, dtype=torch.float32, seed=8)
    corr, kg = make_records(6, 4)
    (o, _), (ref_o, _), ref = run_both(inputs, initial_state_source=source,
                                       initial_state_indices=strided([5, 1, 0, 3], torch.int64),
                                       disable_state_update=True, correction_cache=corr, kg_cache=kg,
                                       null_policy=NONPOS)
    assert_output_close(o, ref_o)
    assert_records_match(corr, kg, ref["correction_cache"], ref["kg_cache"])
    assert (corr[0] == 7.0).all() and (kg[0] == -3.0).all()  # slot 0: null under NONPOSITIVE


# --------------------------------------------------------------------------------------------------
# source read, pool written
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("source_dtype, pool_dtype, policy, idx_dtype", [
    (torch.bfloat16, torch.float32, OOR, torch.int32), (torch.float32, torch.bfloat16, NONPOS, torch.int64)],
    ids=["bf16-to-fp32-oor-i32", "fp32-to-bf16-np-i64"])
def test_source_read_with_the_final_state_to_the_pool(source_dtype, pool_dtype, policy, idx_dtype):
    B, T = 6, 5
    inputs = make_inputs(B, T, seed=9)
    source = make_states(8, dtype=source_dtype, seed=10)
    source_before = source.clone()
    pool = make_states(7, dtype=pool_dtype, seed=11)
    src_idx = strided([3, 7, -1, 0, 5, 1], idx_dtype)
    slots = strided([2, -1, 4, 6, 0, 5], idx_dtype)  # row 1: null write slot, outputs still computed
    (o, final), (ref_o, ref_pool), _ = run_both(inputs, null_policy=policy, initial_state=pool,
                                                ssm_state_indices=slots, initial_state_source=source,
                                                initial_state_indices=src_idx)
    assert final is pool
    assert_output_close(o, ref_o)
    assert_state_close(pool, ref_pool)
    assert torch.equal(source, source_before)
    assert torch.count_nonzero(o[1]) > 0


@pytest.mark.parametrize("K", [128, 64])
def test_source_read_with_per_token_checkpoints_varlen(K):
    lengths = [8, 0, 3, 1]
    inputs = make_inputs(0, 0, K, seed=12 + K, lengths=lengths)
    source = make_states(5, K, seed=13, row_pad=17 if K == 128 else 0)  # K=128: the unaligned variant
    pool = make_states(40, K, seed=14)
    slots = torch.arange(32, dtype=torch.int32, device=DEV).view(4, 8) + 1
    slots[0, 2] = -1  # a null write slot skips the token: zero output, not absorbed
    slots[2, 1] = 99
    (o, _), (ref_o, ref_pool), _ = run_both(inputs, initial_state=pool, ssm_state_indices=slots,
                                            initial_state_source=source,
                                            initial_state_indices=strided([4, 2, -1, 0]))
    assert_output_close(o, ref_o)
    assert_state_close(pool, ref_pool)


# --------------------------------------------------------------------------------------------------
# tree verify
# --------------------------------------------------------------------------------------------------


def _tree_parents(N, T, T_p, seed, dtype):
    """Random parents [N, T_p]: mostly a valid earlier token, some roots mid-window (-1), some malformed (>= t,
    very negative), as device data."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(N):
        row = []
        for t in range(T_p):
            r = torch.rand((), generator=gen).item()
            if t == 0 or r < 0.15:
                row.append(-1)
            elif r < 0.22:
                row.append(t + int(torch.randint(0, 3, (), generator=gen)))  # p >= t: a root
            elif r < 0.27:
                row.append(-(2**31) if dtype == torch.int32 else -(2**40))
            else:
                row.append(int(torch.randint(0, t, (), generator=gen)))
        rows.append(row)
    return strided_2d(rows, dtype)


@pytest.mark.parametrize("pool_dtype, policy, parents_dtype", [
    (torch.bfloat16, OOR, torch.int32), (torch.float32, NONPOS, torch.int64)], ids=["bf16-oor-i32", "fp32-np-i64"])
@pytest.mark.parametrize("with_source", [False, True], ids=["pool-read", "source-read"])
def test_tree_verify_matches_oracle(pool_dtype, policy, parents_dtype, with_source):
    B, T, T_p = 5, 8, 6  # tokens 6 and 7 have parent t - 1
    inputs = make_inputs(B, T, seed=15)
    pool = make_states(48, dtype=pool_dtype, seed=16)
    slots = torch.randperm(47, generator=_gen(17), device=DEV)[: B * T].view(B, T).to(torch.int32) + 1
    slots[1, 3] = -1  # skipped: its descendants are dead
    slots[3, 0] = 0 if policy == NONPOS else -1
    kw = dict(initial_state=pool, ssm_state_indices=slots, parent_indices=_tree_parents(B, T, T_p, 18, parents_dtype))
    if with_source:
        kw.update(initial_state_source=make_states(4, dtype=torch.float32, seed=19),
                  initial_state_indices=strided([3, 0, 1, 2, -1]))
    (o, _), (ref_o, ref_pool), _ = run_both(inputs, null_policy=policy, **kw)
    assert_output_close(o, ref_o)
    assert_state_close(pool, ref_pool)


def test_tree_verify_chains_match_oracle_with_an_unaligned_pool():
    # parents t - 1 everywhere: the stored-parent form of a chain (its states round-trip through the pool dtype);
    # a slot stride of the row + 17 elements takes the unaligned variant
    B, T = 3, 8
    inputs = make_inputs(B, T, seed=20)
    pool = make_states(30, seed=21, row_pad=17)
    slots = torch.arange(24, dtype=torch.int32, device=DEV).view(B, T)
    parents = torch.arange(-1, T - 1, dtype=torch.int32, device=DEV).expand(B, T)  # stride 0 rows: any stride
    (o, _), (ref_o, ref_pool), _ = run_both(inputs, initial_state=pool, ssm_state_indices=slots,
                                            parent_indices=parents)
    assert_output_close(o, ref_o)
    assert_state_close(pool, ref_pool)


def test_tree_verify_varlen_with_accepted_counts_and_K64():
    lengths = [8, 1, 0, 5]
    inputs = make_inputs(0, 0, 64, seed=22, lengths=lengths)
    pool = make_states(40, 64, seed=23)
    slots = torch.randperm(40, generator=_gen(24), device=DEV)[:32].view(4, 8).to(torch.int32)
    accepted = torch.tensor([3, 1, 2, 9], dtype=torch.int32, device=DEV)  # the read column comes from these
    (o, _), (ref_o, ref_pool), _ = run_both(inputs, initial_state=pool, ssm_state_indices=slots,
                                            num_accepted_tokens=accepted,
                                            parent_indices=_tree_parents(4, 8, 8, 25, torch.int32))
    assert_output_close(o, ref_o)
    assert_state_close(pool, ref_pool)


# --------------------------------------------------------------------------------------------------
# CUDA graphs
# --------------------------------------------------------------------------------------------------


def _replay_equals_eager(call, fresh):
    """``fresh() -> buffers`` (output and every tensor the call writes, in their starting state) and
    ``call(buffers)``: eager on one set, captured on a second set (after a warm-up call: module load), that set
    reset to its starting state, replayed; both sets end bitwise equal."""
    eager = fresh()
    call(eager)
    replayed = fresh()
    call(replayed)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(replayed)
    for buf, start in zip(replayed, fresh()):
        buf.copy_(start)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, replayed):
        assert torch.equal(a, b)


def test_frozen_verify_with_records_and_tree_verify_replay_in_a_cuda_graph_bit_for_bit():
    from kda_cute.generic import kda_recurrent_fwd

    B, T = 6, 8
    inputs = make_inputs(B, T, seed=26)
    pool0 = make_states(50, seed=27)
    slots = torch.arange(B * T, dtype=torch.int32, device=DEV).view(B, T) + 1
    parents = _tree_parents(B, T, T, 28, torch.int32)
    read = strided([4, 0, 9, -1, 2, 7])

    def out():
        return torch.zeros(B, T, HV, 128, dtype=torch.bfloat16, device=DEV)

    def frozen(bufs):
        o, corr, kg = bufs
        kda_recurrent_fwd(**inputs, initial_state=pool0, ssm_state_indices=read, disable_state_update=True,
                          correction_cache=corr, kg_cache=kg, output=o)

    def tree(bufs):
        o, pool = bufs
        kda_recurrent_fwd(**inputs, initial_state=pool, ssm_state_indices=slots, parent_indices=parents, output=o)

    _replay_equals_eager(frozen, lambda: (out(), *make_records(50, 5)))
    _replay_equals_eager(tree, lambda: (out(), pool0.clone()))
