"""Generic recurrent kernel (kda_cute.generic) against kda-core's oracle on the GPU, one behaviour per test.

Every expected value comes from ``kda_core.oracle.recurrent_kda_ref`` run on clones of the same inputs.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

DEV = "cuda"


def _gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


def make_inputs(B, T, H=4, HV=None, K=128, *, gate="lower_bound", act_dtype=torch.bfloat16, g_dtype=None,
                beta_dtype=None, l2norm=True, seed=0, unaligned=False):
    """Random q, k, v, g, beta [B, T, ...] plus gate parameters, as keyword arguments of the facade.

    ``unaligned``: every activation is a view one element into a larger buffer (pointers and row strides not
    16-byte aligned), so the kernel must take its unaligned variant.
    """
    HV = HV or H
    gen = _gen(seed)
    pad = 1 if unaligned else 0

    def act(heads, dtype, scale=1.0, shift=0.0):
        base = torch.randn(B, T, heads, K + pad, generator=gen, device=DEV) * scale + shift
        return base.to(dtype)[..., pad:]

    k_scale = 1.0 if l2norm else K**-0.5  # unnormalised keys must keep |k|^2 * beta < 2 for a stable recurrence
    precomputed = gate == "precomputed"
    g_dtype = g_dtype or act_dtype
    beta_dtype = beta_dtype or act_dtype
    kw = dict(
        q=act(H, act_dtype), k=act(H, act_dtype, k_scale), v=act(HV, act_dtype),
        g=act(HV, g_dtype, 0.3, -0.2) if precomputed else act(HV, g_dtype),
        beta=(torch.rand(B, T, HV, generator=gen, device=DEV) if precomputed
              else torch.randn(B, T, HV, generator=gen, device=DEV)).to(beta_dtype),
        use_qk_l2norm_in_kernel=l2norm, use_gate_in_kernel=not precomputed, beta_is_logit=not precomputed,
    )
    if not precomputed:
        kw["A_log"] = torch.log(torch.rand(H, generator=gen, device=DEV) * 15 + 1)
        kw["dt_bias"] = torch.randn(H * K, generator=gen, device=DEV) * 0.5
        kw["lower_bound"] = -5.0 if gate == "lower_bound" else None
    return kw


def make_pool(N, HV, K=128, dtype=torch.bfloat16, *, seed=1, row_pad=0):
    """A pool [N, HV, K, K] (K contiguous) whose dim-0 stride is padded by ``row_pad`` elements."""
    gen = _gen(seed)
    storage = (torch.randn(N, HV * K * K + row_pad, generator=gen, device=DEV) * 0.1).to(dtype)
    return storage.as_strided((N, HV, K, K), (HV * K * K + row_pad, K * K, K, 1))


def run_both(inputs, config=None, **state_kw):
    """(kernel (o, final), oracle (o, final)); pools are cloned so that each side updates its own copy.
    ``config``: the kernel's schedule (None: its schedule policy's)."""
    from kda_core.oracle import recurrent_kda_ref
    from kda_cute.generic import kda_recurrent_fwd

    def args(clone):
        kw = dict(state_kw)
        init = kw.get("initial_state")
        if init is not None and clone:
            kw["initial_state"] = init.clone()
        return kw

    ref = recurrent_kda_ref(**inputs, **args(clone=True))
    out = kda_recurrent_fwd(**inputs, **args(clone=False), config=config)
    torch.cuda.synchronize()
    return out, ref


def assert_output_close(o, ref_o):
    """Outputs within bf16 rounding (plus fp32 summation order) of the oracle's."""
    assert o.dtype == torch.bfloat16 and o.shape == ref_o.shape
    scale = ref_o.float().abs().max().item() + 1e-6
    torch.testing.assert_close(o.float(), ref_o.float(), atol=2e-2 * scale, rtol=2e-2)


def assert_state_close(state, ref_state):
    if state.dtype == torch.bfloat16:
        tol = dict(atol=2e-3, rtol=1.6e-2)  # one bf16 rounding of the stored state
    else:
        tol = dict(atol=5e-5, rtol=5e-4)
    torch.testing.assert_close(state.float(), ref_state.float(), **tol)


# --------------------------------------------------------------------------------------------------
# tokens per sequence, gates, dtypes
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [1, 2, 3, 4, 8, 16, 64])
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_pool_call_with_T_tokens_matches_oracle(T, pool_dtype):
    B, H, N = 5, 4, 9
    inputs = make_inputs(B, T, H, seed=T)
    pool = make_pool(N, H, dtype=pool_dtype)
    slots = torch.tensor([7, 0, 3, 8, 5], dtype=torch.int32, device=DEV)
    (o, pool_out), (ref_o, ref_pool) = run_both(inputs, initial_state=pool, ssm_state_indices=slots)
    assert pool_out is pool
    assert_output_close(o, ref_o)
    assert_state_close(pool, ref_pool)


@pytest.mark.parametrize("gate", ["lower_bound", "softplus", "precomputed"])
@pytest.mark.parametrize("l2norm", [True, False], ids=["l2norm", "no_l2norm"])
def test_every_gate_form_with_and_without_l2norm_matches_oracle(gate, l2norm):
    inputs = make_inputs(3, 6, 4, gate=gate, l2norm=l2norm, seed=11)
    pool = make_pool(4, 4)
    slots = torch.tensor([2, 0, 3], dtype=torch.int32, device=DEV)
    (o, _), (ref_o, ref_pool) = run_both(inputs, initial_state=pool, ssm_state_indices=slots)
    assert_output_close(o, ref_o)
    assert_state_close(pool, ref_pool)


@pytest.mark.parametrize("beta_is_logit", [True, False])
def test_beta_as_logit_or_probability_matches_oracle(beta_is_logit):
    inputs = make_inputs(2, 5, 4, seed=12)
    inputs["beta_is_logit"] = beta_is_logit
    if not beta_is_logit:
        inputs["beta"] = torch.rand_like(inputs["beta"].float()).to(inputs["beta"].dtype)
    (o, final), (ref_o, ref_final) = run_both(inputs, output_final_state=True)
    assert_output_close(o, ref_o)
    assert_state_close(final, ref_final)


def test_custom_scale_matches_oracle():
    inputs = make_inputs(2, 4, 4, seed=13)
    (o, _), (ref_o, _) = run_both(inputs, scale=0.37)
    assert_output_close(o, ref_o)


@pytest.mark.parametrize("act_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_fp32_and_fp16_activations_with_fp32_gate_and_beta_match_oracle(act_dtype):
    inputs = make_inputs(3, 4, 4, act_dtype=act_dtype, g_dtype=torch.float32, beta_dtype=torch.float32, seed=14)
    pool = make_pool(3, 4, dtype=torch.float32)
    slots = torch.tensor([1, 2, 0], dtype=torch.int32, device=DEV)
    (o, _), (ref_o, ref_pool) = run_both(inputs, initial_state=pool, ssm_state_indices=slots)
    assert_output_close(o, ref_o)
    assert_state_close(pool, ref_pool)


# --------------------------------------------------------------------------------------------------
# geometry: GQA, K = 64, many heads
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("H, HV", [(1, 4), (2, 8), (4, 16), (3, 12)])
def test_gqa_value_heads_share_query_heads_like_the_oracle(H, HV):
    inputs = make_inputs(3, 5, H, HV, seed=HV)
    pool = make_pool(6, HV)
    slots = torch.tensor([5, 1, 2], dtype=torch.int32, device=DEV)
    (o, _), (ref_o, ref_pool) = run_both(inputs, initial_state=pool, ssm_state_indices=slots)
    assert_output_close(o, ref_o)
    assert_state_close(pool, ref_pool)


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("T", [1, 8])
def test_head_dim_64_matches_oracle(pool_dtype, T):
    inputs = make_inputs(4, T, 2, 4, K=64, seed=64 + T)
    pool = make_pool(5, 4, K=64, dtype=pool_dtype)
    slots = torch.tensor([4, 0, 2, 1], dtype=torch.int32, device=DEV)
    (o, _), (ref_o, ref_pool) = run_both(inputs, initial_state=pool, ssm_state_indices=slots)
    assert_output_close(o, ref_o)
    assert_state_close(pool, ref_pool)


@pytest.mark.parametrize("B", [1, 7, 64, 300])
def test_batch_sizes_across_the_schedule_table_match_oracle(B):
    inputs = make_inputs(B, 3, 12, seed=B)
    pool = make_pool(B + 2, 12)
    slots = torch.randperm(B + 2, generator=_gen(B), device=DEV)[:B].to(torch.int32)
    (o, _), (ref_o, ref_pool) = run_both(inputs, initial_state=pool, ssm_state_indices=slots)
    assert_output_close(o, ref_o)
    assert_state_close(pool, ref_pool)


@pytest.mark.parametrize("K, tile_v", [(128, t) for t in (8, 16, 32, 64)] + [(64, t) for t in (16, 32, 64)])
def test_every_tile_matches_oracle_in_spec_decode(K, tile_v):
    from kda_cute import generic

    assert tile_v in generic.tile_v_choices(K)
    B, T, H, N = 3, 4, 4, 16
    inputs = make_inputs(B, T, H, K=K, seed=tile_v + K)
    pool = make_pool(N, H, K=K)
    slots = torch.randperm(N, generator=_gen(tile_v), device=DEV)[: B * T].view(B, T).to(torch.int32)
    accepted = torch.tensor([2, 4, 1], dtype=torch.int32, device=DEV)
    (o, _), (ref_o, ref_pool) = run_both(inputs, generic.GenericConfig(tile_v), initial_state=pool,
                                         ssm_state_indices=slots, num_accepted_tokens=accepted)
    assert_output_close(o, ref_o)
    assert_state_close(pool, ref_pool)


# --------------------------------------------------------------------------------------------------
# dense states (no pool)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("init_dtype", [None, torch.bfloat16, torch.float32], ids=["zeros", "bf16", "fp32"])
def test_dense_states_match_oracle_and_final_state_is_fp32(init_dtype):
    B, H = 3, 4
    inputs = make_inputs(B, 7, H, seed=21)
    init = None if init_dtype is None else (torch.randn(B, H, 128, 128, device=DEV) * 0.1).to(init_dtype)
    init_before = None if init is None else init.clone()
    (o, final), (ref_o, ref_final) = run_both(inputs, initial_state=init, output_final_state=True)
    assert final.dtype == torch.float32 and final.shape == (B, H, 128, 128)
    assert_output_close(o, ref_o)
    assert_state_close(final, ref_final)
    if init is not None:
        assert torch.equal(init, init_before)  # the dense initial state is an input, never written


def test_dense_call_without_final_state_returns_none():
    inputs = make_inputs(2, 3, 4, seed=22)
    (o, final), (ref_o, _) = run_both(inputs)
    assert final is None
    assert_output_close(o, ref_o)


# --------------------------------------------------------------------------------------------------
# varlen
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
def test_varlen_with_zero_length_sequences_matches_oracle_dense(cu_dtype):
    cu = torch.tensor([0, 3, 3, 8, 8, 9, 9], dtype=cu_dtype, device=DEV)  # three empty sequences
    N, H = cu.numel() - 1, 4
    inputs = make_inputs(1, 9, H, seed=31)
    init = torch.randn(N, H, 128, 128, device=DEV) * 0.1
    (o, final), (ref_o, ref_final) = run_both(inputs, initial_state=init, output_final_state=True, cu_seqlens=cu)
    assert_output_close(o, ref_o)
    assert_state_close(final, ref_final)
    assert torch.equal(final[1], init[1]) and torch.equal(final[5], init[5])  # empty sequence: state unchanged


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_varlen_pool_call_matches_oracle(pool_dtype):
    cu = torch.tensor([0, 0, 5, 6, 20], dtype=torch.int32, device=DEV)
    inputs = make_inputs(1, 20, 4, 8, seed=32)
    pool = make_pool(7, 8, dtype=pool_dtype, row_pad=16)
    slots = torch.tensor([6, 2, -1, 0], dtype=torch.int32, device=DEV)
    (o, _), (ref_o, ref_pool) = run_both(inputs, initial_state=pool, ssm_state_indices=slots, cu_seqlens=cu)
    assert_output_close(o, ref_o)
    assert_state_close(pool, ref_pool)


def test_varlen_tokens_outside_every_sequence_get_zero_output():
    cu = torch.tensor([2, 4, 6], dtype=torch.int32, device=DEV)  # tokens 0, 1 and 6.. belong to no sequence
    inputs = make_inputs(1, 9, 4, seed=33)
    from kda_cute.generic import kda_recurrent_fwd

    out = torch.full((1, 9, 4, 128), 7.0, dtype=torch.bfloat16, device=DEV)
    kda_recurrent_fwd(**inputs, cu_seqlens=cu, output=out)
    torch.cuda.synchronize()
    assert torch.count_nonzero(out[:, [0, 1, 6, 7, 8]]) == 0
    from kda_core.oracle import recurrent_kda_ref

    assert_output_close(out, recurrent_kda_ref(**inputs, cu_seqlens=cu)[0])


# --------------------------------------------------------------------------------------------------
# spec decode: 2-D slot indices, one checkpoint per token
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("T", [2, 4, 8])
def test_spec_decode_with_heterogeneous_accepted_tokens_and_padded_rows(pool_dtype, T):
    B, H, N = 6, 4, 60
    inputs = make_inputs(B, T, H, seed=40 + T)
    pool = make_pool(N, H, dtype=pool_dtype)
    before = pool.clone()
    slots = torch.randperm(N - 5, generator=_gen(T), device=DEV)[: B * T].view(B, T).to(torch.int32)
    slots[1, T - 1] = -1  # a padded draft position: skipped, nothing written
    slots[3, :] = -1  # a padded request: inactive row
    slots[4, 0] = N + 3  # read slot of row 4 is past the pool when nat - 1 == 0
    accepted = torch.tensor([T, 1, 0, 2, 1, T - 1], dtype=torch.int32, device=DEV)
    (o, _), (ref_o, ref_pool) = run_both(inputs, initial_state=pool, ssm_state_indices=slots,
                                         num_accepted_tokens=accepted)
    assert_output_close(o, ref_o)
    assert_state_close(pool, ref_pool)
    written = {int(s) for s in slots[[0, 1, 2, 5]].flatten().tolist() if 0 <= s < N}
    untouched = [s for s in range(N) if s not in written]
    assert torch.equal(pool[untouched], before[untouched])
    assert torch.count_nonzero(o[3]) == 0 and torch.count_nonzero(o[4]) == 0


def test_spec_decode_without_num_accepted_reads_column_zero():
    B, T, H, N = 3, 4, 4, 20
    inputs = make_inputs(B, T, H, seed=45)
    pool = make_pool(N, H)
    slots = torch.arange(B * T, dtype=torch.int32, device=DEV).view(B, T)
    (o, _), (ref_o, ref_pool) = run_both(inputs, initial_state=pool, ssm_state_indices=slots)
    assert_output_close(o, ref_o)
    assert_state_close(pool, ref_pool)


def test_spec_decode_skipped_token_does_not_enter_the_state():
    B, T, H, N = 2, 4, 4, 10
    inputs = make_inputs(B, T, H, seed=46)
    pool = make_pool(N, H, dtype=torch.float32)
    slots = torch.tensor([[0, 1, -1, 3], [4, 5, 6, 7]], dtype=torch.int32, device=DEV)
    (o, _), (ref_o, ref_pool) = run_both(inputs, initial_state=pool, ssm_state_indices=slots)
    assert torch.count_nonzero(o[0, 2]) == 0
    assert_output_close(o, ref_o)
    assert_state_close(pool, ref_pool)


def test_spec_decode_varlen_with_fewer_index_columns_than_tokens():
    cu = torch.tensor([0, 3, 3, 5], dtype=torch.int32, device=DEV)
    inputs = make_inputs(1, 5, 4, seed=47)
    pool = make_pool(12, 4)
    slots = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32, device=DEV)  # token 2 of seq 0 has no slot
    (o, _), (ref_o, ref_pool) = run_both(inputs, initial_state=pool, ssm_state_indices=slots, cu_seqlens=cu,
                                         num_accepted_tokens=torch.tensor([2, 1, 1], dtype=torch.int32, device=DEV))
    assert_output_close(o, ref_o)
    assert_state_close(pool, ref_pool)


# --------------------------------------------------------------------------------------------------
# pool bounds, layout, strides
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_inactive_rows_give_zero_output_and_leave_pool_bitwise_untouched(pool_dtype):
    B, T, H, N = 6, 3, 4, 10
    inputs = make_inputs(B, T, H, seed=51)
    pool = make_pool(N, H, dtype=pool_dtype)
    before = pool.clone()
    slots = torch.tensor([3, -1, 10, 7, -2147483648, 2147483647], dtype=torch.int32, device=DEV)
    from kda_core.oracle import recurrent_kda_ref
    from kda_cute.generic import kda_recurrent_fwd

    ref_o, ref_pool = recurrent_kda_ref(**inputs, initial_state=pool.clone(), ssm_state_indices=slots)
    out = torch.full((B, T, H, 128), 7.0, dtype=torch.bfloat16, device=DEV)
    o, _ = kda_recurrent_fwd(**inputs, initial_state=pool, ssm_state_indices=slots, output=out)
    torch.cuda.synchronize()
    assert o is out
    assert torch.count_nonzero(out[[1, 2, 4, 5]]) == 0
    untouched = [s for s in range(N) if s not in (3, 7)]
    assert torch.equal(pool[untouched], before[untouched])
    assert_output_close(out, ref_o)
    assert_state_close(pool, ref_pool)


def test_only_inactive_rows_is_a_bitwise_no_op_on_the_pool():
    inputs = make_inputs(3, 4, 4, seed=52)
    pool = make_pool(5, 4)
    before = pool.clone()
    slots = torch.tensor([-1, 5, 99], dtype=torch.int32, device=DEV)
    from kda_cute.generic import kda_recurrent_fwd

    o, _ = kda_recurrent_fwd(**inputs, initial_state=pool, ssm_state_indices=slots)
    torch.cuda.synchronize()
    assert torch.equal(pool, before)
    assert torch.count_nonzero(o) == 0


def test_misaligned_strided_inputs_take_the_unaligned_variant_and_match_oracle():
    inputs = make_inputs(3, 4, 4, seed=61, unaligned=True)
    from kda_cute import _launch

    assert _launch.alignment_of(inputs["q"]) < _launch.VECTOR_BYTES
    pool = make_pool(5, 4, row_pad=8)
    slots = torch.tensor([4, 1, 0], dtype=torch.int32, device=DEV)
    (o, _), (ref_o, ref_pool) = run_both(inputs, initial_state=pool, ssm_state_indices=slots)
    assert_output_close(o, ref_o)
    assert_state_close(pool, ref_pool)


def test_views_of_a_fused_qkv_output_match_oracle():
    """q, k, v, g as strided views of packed GEMM rows [B*T, (2H+HV)*K] (aligned row stride, not contiguous)."""
    B, T, H, K = 3, 4, 4, 128
    gen = _gen(62)
    mixed = torch.randn(B, T, 3 * H * K + 64, generator=gen, device=DEV).bfloat16()
    q, k, v = (mixed[..., i * H * K:(i + 1) * H * K].view(B, T, H, K) for i in range(3))
    inputs = make_inputs(B, T, H, seed=62)
    inputs.update(q=q, k=k, v=v)
    (o, final), (ref_o, ref_final) = run_both(inputs, output_final_state=True)
    assert_output_close(o, ref_o)
    assert_state_close(final, ref_final)


def test_slot_offsets_past_4gb_use_64_bit_math():
    HV, K = 12, 128
    slot_bytes = HV * K * K * 2
    N = (4 << 30) // slot_bytes + 64  # the last slots start past 4 GiB
    try:
        pool = torch.empty(N, HV, K, K, dtype=torch.bfloat16, device=DEV)
    except torch.cuda.OutOfMemoryError:
        pytest.skip("not enough GPU memory for a 4 GiB pool")
    last = N - 1
    pool[last] = (torch.randn(HV, K, K, generator=_gen(70), device=DEV) * 0.1).bfloat16()
    pool[:128].zero_()
    inputs = make_inputs(1, 3, HV, seed=70)
    from kda_core.oracle import recurrent_kda_ref
    from kda_cute.generic import kda_recurrent_fwd

    small = pool[last:last + 1].clone()
    ref_o, _ = recurrent_kda_ref(**inputs, initial_state=small, ssm_state_indices=torch.zeros(1, dtype=torch.int32,
                                                                                               device=DEV))
    o, _ = kda_recurrent_fwd(**inputs, initial_state=pool, ssm_state_indices=torch.tensor([last], dtype=torch.int32,
                                                                                          device=DEV))
    torch.cuda.synchronize()
    assert_output_close(o, ref_o)
    assert_state_close(pool[last:last + 1], small)
    assert torch.count_nonzero(pool[:128]) == 0  # a 32-bit wrap of the offset would land in a low slot
    del pool


# --------------------------------------------------------------------------------------------------
# launch behaviour: compile cache, streams, CUDA graphs
# --------------------------------------------------------------------------------------------------


def test_batch_and_token_counts_do_not_recompile():
    from kda_cute import _launch
    from kda_cute.generic import kda_recurrent_fwd

    for B, T in ((2, 3), (3, 5)):  # both within the schedule table's first row: one tile, one variant
        inputs = make_inputs(B, T, 4, seed=B)
        kda_recurrent_fwd(**inputs, output_final_state=True)
        if (B, T) == (2, 3):
            size = _launch.cache_size()
    assert _launch.cache_size() == size


def test_spec_decode_replays_in_a_cuda_graph_bit_for_bit():
    from kda_cute.generic import kda_recurrent_fwd

    B, T, H, N = 8, 4, 4, 40
    inputs = make_inputs(B, T, H, seed=80)
    slots = torch.arange(B * T, dtype=torch.int32, device=DEV).view(B, T)
    accepted = torch.tensor([1, 2, 3, 4, 4, 3, 2, 1], dtype=torch.int32, device=DEV)
    pool_eager, pool_graph = make_pool(N, H), make_pool(N, H)
    out_eager = torch.empty(B, T, H, 128, dtype=torch.bfloat16, device=DEV)
    out_graph = torch.empty_like(out_eager)
    kw = dict(ssm_state_indices=slots, num_accepted_tokens=accepted)
    kda_recurrent_fwd(**inputs, initial_state=pool_eager, output=out_eager, **kw)
    warm = make_pool(N, H)
    kda_recurrent_fwd(**inputs, initial_state=warm, output=out_graph, **kw)  # module load before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kda_recurrent_fwd(**inputs, initial_state=pool_graph, output=out_graph, **kw)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out_graph, out_eager)
    assert torch.equal(pool_graph, pool_eager)


def test_runs_on_the_callers_current_stream():
    from kda_cute.generic import kda_recurrent_fwd

    inputs = make_inputs(4, 8, 4, seed=81)
    q_new = inputs["q"].clone()
    ref_o = kda_recurrent_fwd(**inputs)[0].clone()
    inputs["q"] = torch.zeros_like(q_new)
    out = torch.zeros_like(ref_o)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # a launch on another stream would run before q is filled below
        inputs["q"].copy_(q_new)
        kda_recurrent_fwd(**inputs, output=out)
    stream.synchronize()
    torch.cuda.synchronize()
    assert torch.equal(out, ref_o)


# --------------------------------------------------------------------------------------------------
# malformed device data: cu_seqlens and num_accepted_tokens are bounded in the kernel (docs/design.md §4)
# --------------------------------------------------------------------------------------------------


def clamped_bounds(cu, T_total):
    """[(bos_n, eos_n)]: bos = clamp(cu[n], 0, T_total), eos = clamp(cu[n + 1], bos, T_total), in Python ints."""
    values = [int(x) for x in cu.tolist()]
    out = []
    for n in range(len(values) - 1):
        bos = min(max(values[n], 0), T_total)
        out.append((bos, min(max(values[n + 1], bos), T_total)))
    return out


GUARD = 5  # output rows of sentinel on each side of the output view


def guarded_output(T, HV, K=128):
    """(buffer [1, T + 2 GUARD, HV, K] of 7.0, the output view [1, T, HV, K] in its middle)."""
    buf = torch.full((1, T + 2 * GUARD, HV, K), 7.0, dtype=torch.bfloat16, device=DEV)
    return buf, buf[:, GUARD : GUARD + T]


@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("offsets", [
    [0, 4, 15],  # the last end past the tokens
    [-3, 4, 10],  # a negative first start
    [12, 14],  # the first start past the tokens: every token is outside every sequence
    [0, 4, -2],  # an end before its start: an empty sequence
    [0, 2**31 - 1],  # 2^31 - 1 tokens claimed
    [0, 3, 2**31 + 4],  # int64 past 2^31 (truncated to int32 it would be negative)
    [0, 3, 2**32 + 5],  # int64 whose low 32 bits are 5
], ids=["end-past", "neg-start", "start-past", "end-before-start", "int32-max", "int64-2^31", "int64-2^32"])
def test_varlen_malformed_offsets_are_clamped_and_nothing_outside_the_output_is_written(offsets, cu_dtype):
    if cu_dtype == torch.int32 and max(offsets) >= 2**31:
        pytest.skip("not representable in int32")
    T, H, N = 10, 4, 9
    cu = torch.tensor(offsets, dtype=cu_dtype, device=DEV)
    bounds = clamped_bounds(cu, T)
    inputs = make_inputs(1, T, H, seed=60)
    pool = make_pool(N, H)
    slots = torch.tensor([2, 7, 5][: len(bounds)], dtype=torch.int32, device=DEV)
    ref_pool = pool.clone()
    buf, out = guarded_output(T, H)
    from kda_core.oracle import recurrent_kda_ref
    from kda_cute.generic import kda_recurrent_fwd

    kda_recurrent_fwd(**inputs, initial_state=pool, ssm_state_indices=slots, cu_seqlens=cu, output=out)
    clamped = torch.tensor([bounds[0][0]] + [e for _, e in bounds], dtype=torch.int64, device=DEV)
    ref_o, ref_pool = recurrent_kda_ref(**inputs, initial_state=ref_pool, ssm_state_indices=slots, cu_seqlens=clamped)
    torch.cuda.synchronize()
    assert torch.all(buf[:, :GUARD] == 7.0) and torch.all(buf[:, GUARD + T :] == 7.0)  # nothing written outside
    assert_output_close(out, ref_o)
    assert_state_close(pool, ref_pool)
    covered = set().union(*(range(b, e) for b, e in bounds))
    outside = [t for t in range(T) if t not in covered]
    assert torch.count_nonzero(out[:, outside]) == 0


def test_varlen_non_monotonic_offsets_keep_every_state_exact():
    # [0, 6, 3, 10]: sequence 0 owns [0, 6), sequence 1 [6, 6) (its end precedes its start), sequence 2 [3, 10).
    # Outputs of the overlap are unspecified (but in the output); every state is the recurrence over its tokens.
    T, H, N = 10, 4, 8
    cu = torch.tensor([0, 6, 3, 10], dtype=torch.int32, device=DEV)
    inputs = make_inputs(1, T, H, seed=61)
    pool = make_pool(N, H, dtype=torch.float32)
    slots = torch.tensor([1, 4, 6], dtype=torch.int32, device=DEV)
    ref_pool = pool.clone()
    buf, out = guarded_output(T, H)
    from kda_core.oracle import recurrent_kda_ref
    from kda_cute.generic import kda_recurrent_fwd

    kda_recurrent_fwd(**inputs, initial_state=pool, ssm_state_indices=slots, cu_seqlens=cu, output=out)
    for n, (bos, eos) in enumerate(clamped_bounds(cu, T)):  # each sequence alone: distinct slots, any order
        _, ref_pool = recurrent_kda_ref(**inputs, initial_state=ref_pool, ssm_state_indices=slots[n : n + 1],
                                        cu_seqlens=torch.tensor([bos, eos], dtype=torch.int64, device=DEV))
    torch.cuda.synchronize()
    assert torch.all(buf[:, :GUARD] == 7.0) and torch.all(buf[:, GUARD + T :] == 7.0)
    assert torch.isfinite(out.float()).all()
    assert_state_close(pool, ref_pool)


def test_num_accepted_tokens_is_clamped_before_the_subtraction():
    # col = max(min(nat, T), 1) - 1: INT_MIN, 0 and negatives read column 0, counts past T the last column.
    B, T, H, N = 6, 4, 4, 40
    inputs = make_inputs(B, T, H, seed=62)
    pool = make_pool(N, H)
    slots = torch.randperm(N, generator=_gen(62), device=DEV)[: B * T].view(B, T).to(torch.int32)
    accepted = torch.tensor([-(2**31), 0, -5, T + 3, 2**31 - 1, 2], dtype=torch.int32, device=DEV)
    from kda_core.oracle import recurrent_kda_ref
    from kda_cute.generic import kda_recurrent_fwd

    ref_pool = pool.clone()
    o, _ = kda_recurrent_fwd(**inputs, initial_state=pool, ssm_state_indices=slots, num_accepted_tokens=accepted)
    in_range = torch.tensor([1, 1, 1, T, T, 2], dtype=torch.int32, device=DEV)  # the columns + 1 the rule reads
    ref_o, ref_pool = recurrent_kda_ref(**inputs, initial_state=ref_pool, ssm_state_indices=slots,
                                        num_accepted_tokens=in_range)
    torch.cuda.synchronize()
    assert_output_close(o, ref_o)
    assert_state_close(pool, ref_pool)


@pytest.mark.parametrize("gate", ["lower_bound", "softplus"])
def test_absent_dt_bias_is_zeros(gate):
    B, T, H, N = 3, 4, 4, 9
    inputs = make_inputs(B, T, H, gate=gate, seed=63)
    pool = make_pool(N, H)
    slots = torch.tensor([5, 0, 8], dtype=torch.int32, device=DEV)
    from kda_core.oracle import recurrent_kda_ref
    from kda_cute.generic import kda_recurrent_fwd

    ref_pool = pool.clone()
    o, _ = kda_recurrent_fwd(**{**inputs, "dt_bias": None}, initial_state=pool, ssm_state_indices=slots)
    zeros = torch.zeros(H * 128, device=DEV)
    ref_o, ref_pool = recurrent_kda_ref(**{**inputs, "dt_bias": zeros}, initial_state=ref_pool,
                                        ssm_state_indices=slots)
    torch.cuda.synchronize()
    assert_output_close(o, ref_o)
    assert_state_close(pool, ref_pool)


# --------------------------------------------------------------------------------------------------
# null-slot policies (docs/design.md §4): the oracle knows out_of_range only, so the reference maps every entry that
# is null under the policy to -1 first (and, under nonpositive, the whole index row of a spec-decode sequence whose
# num_accepted_tokens lies outside [1, T_idx])
# --------------------------------------------------------------------------------------------------


def reference_indices(indices, N, policy, num_accepted=None):
    """The indices today's (out_of_range) oracle must see to compute what the kernel computes under ``policy``."""
    from kda_core.contracts import NullSlotPolicy

    ref = indices.clone().long()
    first = 1 if policy == NullSlotPolicy.NONPOSITIVE else 0
    ref[(ref < first) | (ref >= N)] = -1
    if policy == NullSlotPolicy.NONPOSITIVE and ref.dim() == 2 and num_accepted is not None:
        nat = num_accepted.long()
        ref[(nat < 1) | (nat > ref.shape[1])] = -1
    return ref


POLICIES = ["out_of_range", "nonpositive"]


def _policy(name):
    from kda_core.contracts import NullSlotPolicy

    return NullSlotPolicy(name)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_pool_call_under_each_null_policy_matches_oracle(policy, pool_dtype):
    from kda_core.oracle import recurrent_kda_ref
    from kda_cute.generic import kda_recurrent_fwd

    policy = _policy(policy)
    B, T, H, N = 6, 3, 4, 9
    inputs = make_inputs(B, T, H, seed=90)
    pool = make_pool(N, H, dtype=pool_dtype)
    before = pool.clone()
    slots = torch.tensor([0, 3, -1, N, 5, 8], dtype=torch.int32, device=DEV)
    ref_o, ref_pool = recurrent_kda_ref(**inputs, initial_state=pool.clone(),
                                        ssm_state_indices=reference_indices(slots, N, policy))
    out = torch.full((B, T, H, 128), 7.0, dtype=torch.bfloat16, device=DEV)
    kda_recurrent_fwd(**inputs, initial_state=pool, ssm_state_indices=slots, output=out, null_policy=policy)
    torch.cuda.synchronize()
    assert_output_close(out, ref_o)
    assert_state_close(pool, ref_pool)
    null_rows = [0, 2, 3] if policy.value == "nonpositive" else [2, 3]
    assert torch.count_nonzero(out[null_rows]) == 0
    # nonpositive: slot 0 bitwise untouched; out_of_range: row 0 owns it and writes it
    assert torch.equal(pool[0], before[0]) == (policy.value == "nonpositive")
    untouched = [s for s in range(N) if s not in (0, 3, 5, 8)]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("with_nat", [True, False], ids=["nat", "no-nat"])
def test_spec_decode_under_each_null_policy_matches_oracle(policy, with_nat):
    from kda_core.oracle import recurrent_kda_ref
    from kda_cute.generic import kda_recurrent_fwd

    policy = _policy(policy)
    B, T, H, N = 7, 4, 4, 40
    inputs = make_inputs(B, T, H, seed=91)
    pool = make_pool(N, H)
    before = pool.clone()
    slots = (torch.randperm(N - 1, generator=_gen(91), device=DEV)[: B * T] + 1).view(B, T).to(torch.int32)
    slots[1, 2] = 0  # a write slot 0: a skipped token under nonpositive, a checkpoint under out_of_range
    if policy.value == "nonpositive":  # (under out_of_range a second 0 would be a duplicate live slot)
        slots[3, 0] = 0  # the read slot of row 3 (nat 1, or no nat): row 3 is null
    slots[6, 1] = -1  # null under both
    accepted = torch.tensor([0, 2, T + 1, 1, T, -3, 3], dtype=torch.int32, device=DEV)  # rows 0, 2, 5: nonpositive null
    nat = accepted if with_nat else None
    ref_pool = pool.clone()
    ref_o, ref_pool = recurrent_kda_ref(**inputs, initial_state=ref_pool,
                                        ssm_state_indices=reference_indices(slots, N, policy, nat),
                                        num_accepted_tokens=nat)
    o, _ = kda_recurrent_fwd(**inputs, initial_state=pool, ssm_state_indices=slots, num_accepted_tokens=nat,
                             null_policy=policy)
    torch.cuda.synchronize()
    assert_output_close(o, ref_o)
    assert_state_close(pool, ref_pool)
    if policy.value == "nonpositive":
        assert torch.equal(pool[0], before[0])
        null_rows = [0, 2, 3, 5] if with_nat else [3]
        assert torch.count_nonzero(o[null_rows]) == 0
        assert torch.count_nonzero(o[1, 2]) == 0  # the token whose write slot is 0 was skipped
    else:
        assert not torch.equal(pool[0], before[0])


@pytest.mark.parametrize("policy", POLICIES)
def test_varlen_pool_call_under_each_null_policy_matches_oracle(policy):
    from kda_core.oracle import recurrent_kda_ref
    from kda_cute.generic import kda_recurrent_fwd

    policy = _policy(policy)
    cu = torch.tensor([0, 2, 2, 7, 12], dtype=torch.int32, device=DEV)
    N = 6
    inputs = make_inputs(1, 12, 4, 8, seed=92)
    pool = make_pool(N, 8, row_pad=16)
    before = pool.clone()
    slots = torch.tensor([4, 1, 0, 5], dtype=torch.int32, device=DEV)
    ref_o, ref_pool = recurrent_kda_ref(**inputs, initial_state=pool.clone(), cu_seqlens=cu,
                                        ssm_state_indices=reference_indices(slots, N, policy))
    o, _ = kda_recurrent_fwd(**inputs, initial_state=pool, ssm_state_indices=slots, cu_seqlens=cu,
                             null_policy=policy)
    torch.cuda.synchronize()
    assert_output_close(o, ref_o)
    assert_state_close(pool, ref_pool)
    assert torch.equal(pool[0], before[0]) == (policy.value == "nonpositive")


# --------------------------------------------------------------------------------------------------
# layouts the engines pass (docs/serving.md), never rejected by the kernel: any pool slot stride, strided and int64
# index tensors, strided beta and gate views
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pool_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("mode", ["pool", "spec"])
def test_a_pool_slot_stride_of_any_element_count_takes_the_unaligned_variant(pool_dtype, mode):
    from kda_cute import _launch

    B, T, H, N = 3, 4, 4, 16
    inputs = make_inputs(B, T, H, seed=100)
    pool = make_pool(N, H, dtype=pool_dtype, row_pad=17)  # slot stride H*V*K + 17 elements
    assert pool.stride(0) == H * 128 * 128 + 17 and _launch.alignment_of(pool) < _launch.VECTOR_BYTES
    before = pool.clone()
    if mode == "pool":
        kw = dict(ssm_state_indices=torch.tensor([5, 0, 15], dtype=torch.int32, device=DEV))
        written = [5, 0, 15]
    else:
        slots = torch.randperm(N, generator=_gen(100), device=DEV)[: B * T].view(B, T).to(torch.int32)
        kw = dict(ssm_state_indices=slots, num_accepted_tokens=torch.tensor([2, 4, 1], dtype=torch.int32, device=DEV))
        written = slots.flatten().tolist()
    (o, _), (ref_o, ref_pool) = run_both(inputs, initial_state=pool, **kw)
    assert_output_close(o, ref_o)
    assert_state_close(pool, ref_pool)
    untouched = [s for s in range(N) if s not in written]
    assert torch.equal(pool[untouched], before[untouched])


def test_strided_int32_index_views_match_oracle():
    # 1-D: column 0 of a [B, 8] table (stride 8); 2-D: the first T columns of a wider table (free row stride), with
    # num_accepted_tokens a strided view too
    B, T, H, N = 4, 3, 4, 40
    inputs = make_inputs(B, T, H, seed=101)
    table = torch.zeros(B, 8, dtype=torch.int32, device=DEV)
    table[:, 0] = torch.tensor([7, 2, 30, 11], dtype=torch.int32)
    column = table[:, 0]
    assert column.stride() == (8,)
    pool = make_pool(N, H)
    (o, _), (ref_o, ref_pool) = run_both(inputs, initial_state=pool, ssm_state_indices=column)
    assert_output_close(o, ref_o)
    assert_state_close(pool, ref_pool)

    block_table = torch.randperm(N, generator=_gen(101), device=DEV)[: B * (T + 3)].view(B, T + 3).to(torch.int32)
    slots = block_table[:, :T]
    counts = torch.tensor([[1, 0], [3, 0], [2, 0], [1, 0]], dtype=torch.int32, device=DEV)[:, 0]
    assert slots.stride() == (T + 3, 1) and counts.stride() == (2,)
    pool = make_pool(N, H)
    (o, _), (ref_o, ref_pool) = run_both(inputs, initial_state=pool, ssm_state_indices=slots,
                                         num_accepted_tokens=counts)
    assert_output_close(o, ref_o)
    assert_state_close(pool, ref_pool)


@pytest.mark.parametrize("mode", ["pool", "spec"])
def test_int64_indices_match_oracle_and_a_slot_past_2_32_is_null(mode):
    B, T, H, N = 4, 3, 4, 30
    inputs = make_inputs(B, T, H, seed=102)
    pool = make_pool(N, H)
    before = pool.clone()
    if mode == "pool":
        slots = torch.tensor([2**32 + 1, 4, 9, -(2**40)], dtype=torch.int64, device=DEV)  # low 32 bits of row 0: 1
        kw = dict(ssm_state_indices=slots)
        ref_kw = dict(ssm_state_indices=torch.where((slots >= 0) & (slots < N), slots, -1))
    else:
        slots = torch.randperm(N - 2, generator=_gen(102), device=DEV)[: B * T].view(B, T).to(torch.int64) + 2
        slots[1, 1] = 2**32 + 1  # a write slot whose low 32 bits name slot 1: skipped
        nat = torch.tensor([1, 3, 2**33 + 2, -(2**33)], dtype=torch.int64, device=DEV)  # 64-bit clamps
        kw = dict(ssm_state_indices=slots, num_accepted_tokens=nat)
        ref_kw = dict(ssm_state_indices=torch.where(slots < N, slots, -1),
                      num_accepted_tokens=torch.tensor([1, 3, T, 1], dtype=torch.int64, device=DEV))
    from kda_core.oracle import recurrent_kda_ref
    from kda_cute.generic import kda_recurrent_fwd

    ref_o, ref_pool = recurrent_kda_ref(**inputs, initial_state=pool.clone(), **ref_kw)
    o, _ = kda_recurrent_fwd(**inputs, initial_state=pool, **kw)
    torch.cuda.synchronize()
    assert_output_close(o, ref_o)
    assert_state_close(pool, ref_pool)
    assert torch.equal(pool[:2], before[:2])  # never touched through a wrapped index


def test_strided_beta_and_gate_views_match_oracle():
    B, T, H, K = 3, 4, 4, 128
    inputs = make_inputs(B, T, H, seed=103)
    gen = _gen(103)
    wide_beta = torch.randn(B, T, 2 * H + 1, generator=gen, device=DEV).bfloat16()
    inputs["beta"] = wide_beta[..., 1 : 2 * H + 1 : 2]  # head stride 2, token stride 2H + 1
    wide_g = torch.randn(B, T, H, K + 8, generator=gen, device=DEV).bfloat16()
    inputs["g"] = wide_g[..., :K]  # channels contiguous, head stride K + 8
    assert not inputs["beta"].is_contiguous() and not inputs["g"].is_contiguous()
    pool = make_pool(5, H)
    slots = torch.tensor([4, 1, 2], dtype=torch.int32, device=DEV)
    (o, _), (ref_o, ref_pool) = run_both(inputs, initial_state=pool, ssm_state_indices=slots)
    assert_output_close(o, ref_o)
    assert_state_close(pool, ref_pool)


def test_a_vllm_style_spec_decode_call_matches_oracle():
    # docs/serving.md: flattened tokens with cu_seqlens, q, k, v views of one packed row, the indices a row slice of
    # a block table (int32, free row stride), num_accepted_tokens, block 0 reserved (nonpositive), padding rows
    # with all-null index rows and zero-length segments, a pool whose slot stride is not a 16-byte multiple.
    from kda_core.contracts import NullSlotPolicy
    from kda_core.oracle import recurrent_kda_ref
    from kda_cute.generic import kda_recurrent_fwd

    S, H, K, N = 3, 4, 128, 48  # 1 + S tokens per request
    lens = [4, 4, 2, 0, 0]  # two full requests, a short one, two padding rows
    n = len(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    ntok = int(cu[-1])
    gen = _gen(104)
    packed = torch.randn(1, ntok, 3 * H * K + 8, generator=gen, device=DEV).bfloat16()
    q, k, v = (packed[..., i * H * K : (i + 1) * H * K].view(1, ntok, H, K) for i in range(3))
    inputs = make_inputs(1, ntok, H, seed=104)
    inputs.update(q=q, k=k, v=v)
    table = torch.zeros(n, 1 + S + 4, dtype=torch.int32, device=DEV)
    table[:3, : 1 + S] = (torch.randperm(N - 1, generator=gen, device=DEV)[: 3 * (1 + S)] + 1).view(3, 1 + S)
    table[2, 2:] = 0  # the short request's unused columns
    slots = table[:, : 1 + S]
    nat = torch.tensor([2, 0, 1, 1, 1], dtype=torch.int32, device=DEV)  # request 1: nat 0, a null row
    pool = make_pool(N, H, dtype=torch.float32, row_pad=17)
    before = pool.clone()
    ref = reference_indices(slots, N, NullSlotPolicy.NONPOSITIVE, nat)
    ref_o, ref_pool = recurrent_kda_ref(**inputs, initial_state=pool.clone(), ssm_state_indices=ref, cu_seqlens=cu,
                                        num_accepted_tokens=nat)
    o, _ = kda_recurrent_fwd(**inputs, initial_state=pool, ssm_state_indices=slots, cu_seqlens=cu,
                             num_accepted_tokens=nat, null_policy=NullSlotPolicy.NONPOSITIVE)
    torch.cuda.synchronize()
    assert_output_close(o, ref_o)
    assert_state_close(pool, ref_pool)
    assert torch.equal(pool[0], before[0])
    assert torch.count_nonzero(o[:, 4:8]) == 0
    untouched = [x for x in range(N) if x not in set(slots[[0, 2]].flatten().tolist())]
    assert torch.equal(pool[untouched], before[untouched])  # slot 0 and request 1's slots included
