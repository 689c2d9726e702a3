"""The spec-decode entries of kda-recurrent: the facade's spec keywords, vLLM's RecoverSSM verify + commit context,
SGLang's tree verify, and :func:`kda_recurrent.recoverssm_commit` / :class:`kda_recurrent.RecoverSSMCommit`.

The references are independent readings of each contract built from kda-core's plain recurrence
(``recurrent_kda_ref`` on dense states): a verify -> commit chain must reach the state the recurrence reaches over
the accepted tokens; a tree token's output and stored state are the recurrence's over its root-to-token path.
Inputs follow the engines' tests (docs/serving.md §3-§4): vLLM's RecoverSSM test (2 layers, 2 sequences x 8 tokens,
slots [1, 2], accepted [2, 8], optionally through request indices [1, 3] into [0, 2, 0, 8], a conv state
[blocks, 12, 3 + 8 - 1]) and SGLang's target-verify test (N requests x T tokens, ``cu_seqlens`` every T tokens,
cache slots 0..N-1, EAGLE-tree parents). CPU cases run the oracle path; ``gpu`` cases the kernels.
"""

from __future__ import annotations

import types

import pytest
import torch

from kda_core.errors import KDAError
from kda_core.oracle import recurrent_kda_ref
from kda_recurrent import RecoverSSMCommit, explain, recoverssm_commit, recurrent_kda
from kda_recurrent.compat import sglang
from kda_recurrent.compat.vllm import kimi_k3
from kda_recurrent.routes import Path

D = 128
BF16 = torch.bfloat16
LB = -5.0
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                 reason="needs a CUDA GPU")])]


def rnd(g, *shape, dtype=BF16, scale=1.0, device="cpu"):
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def gate(g, H, device):
    return dict(A_log=rnd(g, H, dtype=torch.float32, scale=0.5, device=device),
                dt_bias=rnd(g, H * D, dtype=torch.float32, scale=0.1, device=device))


def plain(q, k, v, graw, beta, A_log, dt_bias, state, lower_bound=LB):
    """The recurrence over one sequence's tokens q [T, H, K] ... from a dense fp32 state [H, V, K]: (o, final)."""
    o, final = recurrent_kda_ref(q[None], k[None], v[None], graw[None], beta[None], A_log=A_log, dt_bias=dt_bias,
                                 initial_state=state[None].float(), output_final_state=True, use_gate_in_kernel=True,
                                 lower_bound=lower_bound, beta_is_logit=True)
    return o[0], final[0]


# ---------------------------------------------------------------------------------------------------------------
# the facade


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", [4, 3])
def test_frozen_verify_writes_nothing_and_matches_the_recurrence(device, T):
    g = torch.Generator().manual_seed(T)
    B, H = 3, 12
    q, k, v, graw = (rnd(g, B, T, H, D, device=device) for _ in range(4))
    beta = rnd(g, B, T, H, device=device)
    par = gate(g, H, device)
    pool = rnd(g, 5, H, D, D, scale=0.1, device=device)
    before = pool.clone()
    slots = torch.tensor([4, -1, 1], dtype=torch.int32, device=device)
    o, _ = recurrent_kda(q, k, v, graw, beta, **par, initial_state=pool, ssm_state_indices=slots,
                         use_gate_in_kernel=True, lower_bound=LB, beta_is_logit=True, disable_state_update=True)
    assert torch.equal(pool, before)
    for n, s in enumerate(slots.tolist()):
        if s < 0:
            assert bool((o[n] == 0).all())
            continue
        o_ref, _ = plain(q[n], k[n], v[n], graw[n], beta[n], par["A_log"], par["dt_bias"], pool[s])
        torch.testing.assert_close(o[n].float(), o_ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_source_pool_is_read_and_checkpoints_go_to_the_scratch_pool(device):
    g = torch.Generator().manual_seed(5)
    B, T, H = 2, 3, 4
    q, k, v, graw = (rnd(g, B, T, H, D, device=device) for _ in range(4))
    beta = rnd(g, B, T, H, device=device)
    par = gate(g, H, device)
    source = rnd(g, 3, H, D, D, dtype=torch.float32, scale=0.1, device=device)
    source_before = source.clone()
    scratch = torch.zeros(B * T, H, D, D, device=device)
    idx = torch.arange(B * T, dtype=torch.int32, device=device).view(B, T)
    src_idx = torch.tensor([2, 0], dtype=torch.int32, device=device)
    o, _ = recurrent_kda(q, k, v, graw, beta, **par, initial_state=scratch, ssm_state_indices=idx,
                         use_gate_in_kernel=True, lower_bound=LB, beta_is_logit=True, initial_state_source=source,
                         initial_state_indices=src_idx)
    assert torch.equal(source, source_before)
    for n in range(B):
        for t in range(T):
            o_ref, s_ref = plain(q[n, : t + 1], k[n, : t + 1], v[n, : t + 1], graw[n, : t + 1], beta[n, : t + 1],
                                 par["A_log"], par["dt_bias"], source[int(src_idx[n])])
            torch.testing.assert_close(o[n, t].float(), o_ref[t].float(), rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(scratch[n * T + t], s_ref, rtol=1e-4, atol=1e-4)


def test_spec_keywords_are_refused_by_name_before_anything_runs():
    g = torch.Generator().manual_seed(0)
    q, k, v, graw = (rnd(g, 1, 4, 4, D) for _ in range(4))
    beta = rnd(g, 1, 4, 4)
    pool = torch.zeros(2, 4, D, D)
    slots = torch.tensor([1], dtype=torch.int32)
    with pytest.raises(KDAError, match="kg_cache"):  # the records come in pairs
        recurrent_kda(q, k, v, graw, beta, initial_state=pool, ssm_state_indices=slots, disable_state_update=True,
                      correction_cache=torch.zeros(2, 4, 4, D))
    with pytest.raises(KDAError, match="num_accepted_tokens"):  # a frozen verify reads no accepted column
        recurrent_kda(q, k, v, graw, beta, initial_state=pool, ssm_state_indices=slots[:, None].expand(1, 4),
                      num_accepted_tokens=slots, disable_state_update=True)


def test_explain_names_the_spec_route():
    g = torch.Generator().manual_seed(0)
    q, k, v, graw = (rnd(g, 2, 4, 12, D) for _ in range(4))
    beta = rnd(g, 2, 4, 12)
    pool = torch.zeros(3, 12, D, D, dtype=BF16)
    route = explain(q, k, v, graw, beta, initial_state=pool, ssm_state_indices=torch.tensor([1, 2]),
                    disable_state_update=True)
    assert route.path is Path.ORACLE and "cpu" in route.reason


# ---------------------------------------------------------------------------------------------------------------
# vLLM RecoverSSM


def recoverssm_layers(g, *, layers, blocks, H, T, conv_dim, history, pool_dtype, device):
    made = []
    for _ in range(layers):
        made.append(types.SimpleNamespace(
            kv_cache=(rnd(g, blocks, conv_dim, history + T - 1, device=device),
                      rnd(g, blocks, H, D, D, scale=0.1, device=device, dtype=pool_dtype),
                      torch.zeros(blocks, H, T, D, device=device), torch.zeros(blocks, H, T, 2 * D, device=device,
                                                                               dtype=BF16)),
            local_num_heads=H, head_dim=D, gate_lower_bound=LB, **gate(g, H, device)))
    return made


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("request_indices", [False, True])
def test_vllm_recoverssm_verify_then_commit_context(device, request_indices):
    g = torch.Generator().manual_seed(11)
    H, T, N, blocks = 4, 8, 2, 4
    layers = recoverssm_layers(g, layers=2, blocks=blocks, H=H, T=T, conv_dim=12, history=3,
                               pool_dtype=torch.float32, device=device)
    slots = torch.tensor([1, 2], dtype=torch.int32, device=device)
    qsl = torch.arange(0, N * T + 1, T, dtype=torch.int32, device=device)
    accepted = [2, 8]
    initial = [(layer.kv_cache[0].clone(), layer.kv_cache[1].clone()) for layer in layers]
    inputs = []
    for layer in layers:
        q, k, v, graw = (rnd(g, 1, N * T, H, D, device=device) for _ in range(4))
        beta = rnd(g, 1, N * T, H, device=device)
        out = kimi_k3.kda_recoverssm_verify(q, k, v, graw, beta, layer.A_log, layer.dt_bias, LB, layer.kv_cache[1],
                                            layer.kv_cache[2], layer.kv_cache[3], qsl, slots, T)
        inputs.append((q, k, v, graw, beta, out))
    for (_, pool0), layer in zip(initial, layers):
        assert torch.equal(layer.kv_cache[1], pool0)  # the verify is read only
    ctx = kimi_k3.KDARecoverSSMCommitContext.create(layers, spec_query_len=T, max_num_reqs=4, conv_dim_first=True)
    if request_indices:
        counts = torch.tensor([0, 2, 0, 8], dtype=torch.int32, device=device)
        ctx.commit(counts, slots, qsl, request_indices=torch.tensor([1, 3], dtype=torch.int32, device=device))
    else:
        ctx.commit(torch.tensor(accepted, dtype=torch.int32, device=device), slots, qsl)
    for (conv0, pool0), layer, (q, k, v, graw, beta, out) in zip(initial, layers, inputs):
        for n, s in enumerate(slots.tolist()):
            rows = slice(n * T, (n + 1) * T)
            o_ref, _ = plain(q[0, rows], k[0, rows], v[0, rows], graw[0, rows], beta[0, rows], layer.A_log,
                             layer.dt_bias, pool0[s])
            torch.testing.assert_close(out[0, rows].float(), o_ref.float(), rtol=3e-2, atol=3e-2)
            a = accepted[n]
            _, s_ref = plain(q[0, rows][:a], k[0, rows][:a], v[0, rows][:a], graw[0, rows][:a], beta[0, rows][:a],
                             layer.A_log, layer.dt_bias, pool0[s])
            torch.testing.assert_close(layer.kv_cache[1][s], s_ref, rtol=1e-4, atol=1e-5)
            assert torch.equal(layer.kv_cache[0][s, :, :3], conv0[s, :, a - 1 : a + 2])  # the conv window moved
        untouched = [b for b in range(blocks) if b not in slots.tolist()]
        assert torch.equal(layer.kv_cache[1][untouched], pool0[untouched])
        assert torch.equal(layer.kv_cache[0][untouched], conv0[untouched])


@pytest.mark.parametrize("device", DEVICES)
def test_vllm_commit_context_request_past_the_counts_commits_nothing(device):
    """request_indices is device data: a request past num_accepted_tokens (or negative) makes its row commit nothing,
    with no read outside the counts (on the CPU such an index raises); the other rows commit as usual."""
    g = torch.Generator().manual_seed(14)
    H, T, blocks = 4, 4, 4
    layers = recoverssm_layers(g, layers=1, blocks=blocks, H=H, T=T, conv_dim=12, history=3,
                               pool_dtype=torch.float32, device=device)
    slots = torch.tensor([1, 2, 3], dtype=torch.int32, device=device)
    qsl = torch.arange(0, 3 * T + 1, T, dtype=torch.int32, device=device)
    layer = layers[0]
    q, k, v, graw = (rnd(g, 1, 3 * T, H, D, device=device) for _ in range(4))
    beta = rnd(g, 1, 3 * T, H, device=device)
    pool0 = layer.kv_cache[1].clone()
    kimi_k3.kda_recoverssm_verify(q, k, v, graw, beta, layer.A_log, layer.dt_bias, LB, layer.kv_cache[1],
                                  layer.kv_cache[2], layer.kv_cache[3], qsl, slots, T)
    ctx = kimi_k3.KDARecoverSSMCommitContext.create(layers, spec_query_len=T, max_num_reqs=3, conv_dim_first=True)
    counts = torch.tensor([0, 2], dtype=torch.int32, device=device)
    ctx.commit(counts, slots, qsl, request_indices=torch.tensor([1, 9, -1], dtype=torch.int32, device=device))
    _, s_ref = plain(q[0, :2], k[0, :2], v[0, :2], graw[0, :2], beta[0, :2], layer.A_log, layer.dt_bias, pool0[1])
    torch.testing.assert_close(layer.kv_cache[1][1], s_ref, rtol=1e-4, atol=1e-5)
    assert torch.equal(layer.kv_cache[1][[0, 2, 3]], pool0[[0, 2, 3]])


def test_vllm_commit_context_align_mode_arguments_come_together_and_a_block_covers_a_window():
    g = torch.Generator().manual_seed(1)
    layers = recoverssm_layers(g, layers=1, blocks=3, H=4, T=4, conv_dim=12, history=3, pool_dtype=torch.float32,
                               device="cpu")
    ctx = kimi_k3.KDARecoverSSMCommitContext.create(layers, spec_query_len=4, max_num_reqs=2, conv_dim_first=True)
    one = torch.ones(1, dtype=torch.int32)
    qsl = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(KDAError, match="num_computed_tokens"):
        ctx.commit(one, one, qsl, block_table=one[:, None], mamba_block_size=8)
    with pytest.raises(KDAError, match="mamba_block_size"):
        ctx.commit(one, one, qsl, block_table=one[:, None], num_computed_tokens=one, mamba_block_size=2)
    with pytest.raises(KDAError, match="block_table"):
        ctx.commit(one, one, qsl, block_table=one, num_computed_tokens=one, mamba_block_size=8)
    with pytest.raises(KDAError, match="query_start_loc"):
        ctx.commit(one, one, qsl[:1], block_table=one[:, None], num_computed_tokens=one, mamba_block_size=8)


@pytest.mark.parametrize("device", DEVICES)
def test_vllm_commit_context_align_mode_keeps_malformed_metadata_in_bounds(device):
    """Requests past the tables, block ids past the pool or negative, a negative computed count, counts out of
    range: every row is null, nothing is read or written outside the tensors (an index out of range raises on the
    CPU), and every block keeps its bytes."""
    g = torch.Generator().manual_seed(13)
    T, blocks = 4, 6
    layers = recoverssm_layers(g, layers=2, blocks=blocks, H=4, T=T, conv_dim=12, history=3,
                               pool_dtype=torch.float32, device=device)
    before = [tuple(c.clone() for c in layer.kv_cache) for layer in layers]
    ctx = kimi_k3.KDARecoverSSMCommitContext.create(layers, spec_query_len=T, max_num_reqs=5, conv_dim_first=True)

    def i32(*values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    table = i32(99, -3, 99, 2, 2, 2, -7, 6, 1_000_000).view(3, 3)
    ctx.commit(i32(100, 2, 3), i32(1, 2, 3, 4, 5), i32(0, 4, 8, 12, 16, 20), request_indices=i32(7, -2, 0, 1, 2),
               block_table=table, num_computed_tokens=i32(10**6, -1, 2**30), mamba_block_size=8)
    for layer, old in zip(layers, before):
        assert all(torch.equal(c, o) for c, o in zip(layer.kv_cache, old))


# Align-mode cases: T, block size, pool blocks, rows (source slot, the request's blocks, tokens before the window,
# accepted), the request of each row with request_indices (None: row n is request n), and the blocks written
# (block, source slot, row, tokens folded).
ALIGN_CASES = {
    # 0 stays in its block (2 + 3 < 8): the source slot is the final block; 1 crosses 8 (6 + 4): the boundary state
    # (2 tokens) to block 4, its source, the final state to block 5; 2 is a padding row (slot 0); 3's final block is
    # 0 in the table (vLLM's null block), so nothing moves
    "crossing_into_the_source": (4, 8, 10, [(1, [1, 2, 3], 2, 3), (4, [4, 5, 6], 6, 4), (0, [8, 8, 8], 0, 4),
                                            (7, [7, 0, 9], 5, 4)], [2, 0, 3, 1],
                                 [(1, 1, 0, 3), (4, 4, 1, 2), (5, 4, 1, 4)]),
    # vLLM's own test inputs (tests/models/kimi_k3/test_kda.py): slots [5, 6], block table [[1, 5], [2, 6]], 4
    # computed tokens, block size 8, accepted [2, 8] (through request_indices [1, 3]): row 0's state moves to block 1,
    # row 1 stays in block 6 and leaves the boundary state (4 tokens) in block 2
    "vllm_test_inputs": (8, 8, 8, [(5, [1, 5], 4, 2), (6, [2, 6], 4, 8)], [1, 3],
                         [(1, 5, 0, 2), (6, 6, 1, 8), (2, 6, 1, 4)]),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("request_indices", [False, True])
@pytest.mark.parametrize("case", list(ALIGN_CASES))
def test_vllm_commit_context_align_mode_writes_the_final_and_boundary_blocks(device, request_indices, case):
    """vLLM's prefix-cache align mode: the folded state goes to the block of the new position, and the state at a
    crossed block boundary to that boundary's block, both from the source slot's checkpoint and records."""
    T, size, blocks, spec, order, written = ALIGN_CASES[case]
    g = torch.Generator().manual_seed(12)
    H, N = 4, len(spec)
    layers = recoverssm_layers(g, layers=2, blocks=blocks, H=H, T=T, conv_dim=12, history=3,
                               pool_dtype=torch.float32, device=device)
    order = order if request_indices else list(range(N))  # spec row n is request order[n]
    R = max(order) + 1
    table = torch.zeros(R, len(spec[0][1]), dtype=torch.int32)
    done, nat = torch.zeros(R, dtype=torch.int32), torch.zeros(R, dtype=torch.int32)
    for n, (_, row, c, a) in enumerate(spec):
        table[order[n]] = torch.tensor(row)
        done[order[n]], nat[order[n]] = c, a
    slots = torch.tensor([s for s, *_ in spec], dtype=torch.int32, device=device)
    qsl = torch.arange(0, N * T + 1, T, dtype=torch.int32, device=device)
    initial = [(layer.kv_cache[0].clone(), layer.kv_cache[1].clone()) for layer in layers]
    inputs = []
    for layer in layers:
        q, k, v, graw = (rnd(g, 1, N * T, H, D, device=device) for _ in range(4))
        beta = rnd(g, 1, N * T, H, device=device)
        kimi_k3.kda_recoverssm_verify(q, k, v, graw, beta, layer.A_log, layer.dt_bias, LB, layer.kv_cache[1],
                                      layer.kv_cache[2], layer.kv_cache[3], qsl, slots, T)
        inputs.append((q, k, v, graw, beta))
    ctx = kimi_k3.KDARecoverSSMCommitContext.create(layers, spec_query_len=T, max_num_reqs=N, conv_dim_first=True)
    ctx.commit(nat.to(device), slots, qsl,
               request_indices=torch.tensor(order, dtype=torch.int32, device=device) if request_indices else None,
               block_table=table.to(device), num_computed_tokens=done.to(device), mamba_block_size=size)
    for (conv0, pool0), layer, (q, k, v, graw, beta) in zip(initial, layers, inputs):
        for block, s, n, a in written:
            rows = slice(n * T, n * T + a)
            _, s_ref = plain(q[0, rows], k[0, rows], v[0, rows], graw[0, rows], beta[0, rows], layer.A_log,
                             layer.dt_bias, pool0[s])
            torch.testing.assert_close(layer.kv_cache[1][block], s_ref, rtol=1e-4, atol=1e-5)
            assert torch.equal(layer.kv_cache[0][block, :, :3], conv0[s, :, a - 1 : a + 2])
        untouched = [b for b in range(blocks) if b not in [w[0] for w in written]]  # block 0 among them
        assert torch.equal(layer.kv_cache[1][untouched], pool0[untouched])
        assert torch.equal(layer.kv_cache[0][untouched], conv0[untouched])


@pytest.mark.parametrize("device", DEVICES)
def test_align_mode_chain_keeps_the_recurrence_in_the_block_of_every_position_and_boundary(device):
    """vLLM's prefix-cache align mode over a stream of 12 steps: each request verifies from the block of its
    position c (``block_table[r, c // size]``) and commits with ``num_computed_tokens`` = c; the block of the position
    reached then holds the recurrence over the accepted stream, and the block of every boundary crossed the state at
    that boundary (accepted counts random in [1, T], so some steps end exactly on a boundary). A padding request
    (block 0 in every column) leaves block 0 untouched."""
    g = torch.Generator().manual_seed(21)
    H, T, size, cols, R, steps = 4, 4, 8, 7, 3, 12
    blocks = 1 + R * cols
    layers = recoverssm_layers(g, layers=1, blocks=blocks, H=H, T=T, conv_dim=8, history=3,
                               pool_dtype=torch.float32, device=device)
    layer = layers[0]
    pool, corr, kg = layer.kv_cache[1:]
    block0 = pool[0].clone()
    table = torch.cat([1 + torch.arange(R * cols, dtype=torch.int32).view(R, cols),
                       torch.zeros(1, cols, dtype=torch.int32)])  # request R pads: block 0 everywhere
    N = R + 1
    done = torch.zeros(N, dtype=torch.int32)
    ref = [pool[int(table[r, 0])].float().clone() for r in range(R)]
    expect = {}  # block -> the state it must hold at the end
    ctx = kimi_k3.KDARecoverSSMCommitContext.create(layers, spec_query_len=T, max_num_reqs=N, conv_dim_first=True)
    qsl = torch.arange(0, N * T + 1, T, dtype=torch.int32, device=device)
    crossed = 0
    for _ in range(steps):
        slots = torch.tensor([int(table[r, int(done[r]) // size]) for r in range(N)], dtype=torch.int32)
        q, k, v, graw = (rnd(g, 1, N * T, H, D, device=device) for _ in range(4))
        beta = rnd(g, 1, N * T, H, device=device)
        kimi_k3.kda_recoverssm_verify(q, k, v, graw, beta, layer.A_log, layer.dt_bias, LB, pool, corr, kg, qsl,
                                      slots.to(device), T)
        nat = torch.randint(1, T + 1, (N,), generator=g, dtype=torch.int32)
        ctx.commit(nat.to(device), slots.to(device), qsl, block_table=table.to(device),
                   num_computed_tokens=done.to(device), mamba_block_size=size)
        for r in range(R):
            c, a = int(done[r]), int(nat[r])
            b = (c // size + 1) * size
            x = [t[0, r * T : r * T + a] for t in (q, k, v, graw, beta)]
            if c + a >= b:  # the state after the window's first b - c tokens, to the boundary's block
                crossed += 1
                _, expect[int(table[r, b // size - 1])] = plain(*(t[: b - c] for t in x), layer.A_log,
                                                                 layer.dt_bias, ref[r])
            _, ref[r] = plain(*x, layer.A_log, layer.dt_bias, ref[r])
            expect[int(table[r, (c + a) // size])] = ref[r]
            done[r] = c + a
    assert crossed >= R  # every request crossed a boundary at least once
    for block, want in expect.items():
        assert (pool[block] - want).abs().max() <= 1e-5 * want.abs().max(), block
    assert torch.equal(pool[0], block0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pool_dtype", [torch.float32, BF16])
def test_verify_commit_chain_over_20_steps_equals_the_recurrence_over_the_accepted_stream(device, pool_dtype):
    g = torch.Generator().manual_seed(20)
    H, T, blocks = 12, 4, 5
    slots = torch.tensor([3, 0, 1, 4], dtype=torch.int32, device=device)  # slot 0: vLLM's null block (a padding row)
    N = slots.numel()
    par = gate(g, H, device)
    pool = rnd(g, blocks, H, D, D, scale=0.1, device=device, dtype=pool_dtype)
    start = pool.clone()
    corr = torch.zeros(blocks, H, T, D, device=device)
    kg = torch.zeros(blocks, H, T, 2 * D, device=device, dtype=BF16)
    qsl = torch.arange(0, N * T + 1, T, dtype=torch.int32, device=device)
    ref = {n: pool[s].float().clone() for n, s in enumerate(slots.tolist()) if s > 0}
    for _step in range(20):
        q, k, v, graw = (rnd(g, 1, N * T, H, D, device=device) for _ in range(4))
        beta = rnd(g, 1, N * T, H, device=device)
        kimi_k3.kda_recoverssm_verify(q, k, v, graw, beta, par["A_log"], par["dt_bias"], LB, pool, corr, kg, qsl,
                                      slots, T)
        nat = torch.randint(1, T + 1, (N,), generator=g)
        recoverssm_commit(pool, corr, kg, slots, nat.to(device=device, dtype=torch.int32), par["A_log"],
                          par["dt_bias"], LB, query_start_loc=qsl, null_policy="nonpositive")
        for n in ref:
            rows = slice(n * T, n * T + int(nat[n]))
            _, ref[n] = plain(q[0, rows], k[0, rows], v[0, rows], graw[0, rows], beta[0, rows], par["A_log"],
                              par["dt_bias"], ref[n])
            ref[n] = ref[n].to(pool_dtype).float()  # the checkpoint is stored once per step
    assert torch.equal(pool[0], start[0])  # the null block, never touched
    assert torch.equal(pool[2], start[2])  # a slot no row owns
    for n, s in enumerate(slots.tolist()):
        if s > 0:
            got, want = pool[s].float(), ref[n]
            if pool_dtype == torch.float32:
                assert (got - want).abs().max() <= 1e-5 * want.abs().max()
            else:
                torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_multi_layer_commit_equals_one_commit_per_layer(device):
    g = torch.Generator().manual_seed(3)
    H, T, blocks, L = 4, 4, 4, 3
    made = [recoverssm_layers(g, layers=1, blocks=blocks, H=H, T=T, conv_dim=4, history=3, pool_dtype=torch.float32,
                              device=device)[0] for _ in range(L)]
    for layer in made:
        layer.kv_cache[2].normal_(generator=None).mul_(0.1)
        layer.kv_cache[3].copy_(rnd(g, *layer.kv_cache[3].shape, device=device))
    slots = torch.tensor([2, -1, 1], dtype=torch.int32, device=device)
    nat = torch.tensor([3, 4, 9], dtype=torch.int32, device=device)
    expect = [layer.kv_cache[1].clone() for layer in made]
    for e, layer in zip(expect, made):
        recoverssm_commit(e, layer.kv_cache[2], layer.kv_cache[3], slots, nat, layer.A_log, layer.dt_bias, LB)
    ctx = RecoverSSMCommit([m.kv_cache[1] for m in made], [m.kv_cache[2] for m in made],
                           [m.kv_cache[3] for m in made], [m.A_log for m in made], [m.dt_bias for m in made], LB)
    ctx.commit(slots, nat)
    for e, layer in zip(expect, made):
        torch.testing.assert_close(layer.kv_cache[1], e, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_commit_into_destination_slots_one_layer_and_every_layer(device):
    """``destination_indices``: the folded state lands in another slot, the source keeps its checkpoint; one layer
    through recoverssm_commit and every layer through RecoverSSMCommit agree with the in-place fold moved."""
    g = torch.Generator().manual_seed(4)
    H, T, blocks, L = 4, 4, 6, 2
    made = recoverssm_layers(g, layers=L, blocks=blocks, H=H, T=T, conv_dim=4, history=3, pool_dtype=torch.float32,
                             device=device)
    for layer in made:
        layer.kv_cache[2].copy_(rnd(g, *layer.kv_cache[2].shape, dtype=torch.float32, scale=0.1, device=device))
        layer.kv_cache[3].copy_(rnd(g, *layer.kv_cache[3].shape, device=device))
    slots = torch.tensor([2, 1, 3], dtype=torch.int32, device=device)
    dst = torch.tensor([5, 0, 3], dtype=torch.int32, device=device)  # moves, null (vLLM's policy), in place
    nat = torch.tensor([3, 4, 2], dtype=torch.int32, device=device)
    before = [layer.kv_cache[1].clone() for layer in made]
    moved = [b.clone() for b in before]
    for m, layer in zip(moved, made):  # the in-place fold of the live rows, moved by hand
        folded = m.clone()
        recoverssm_commit(folded, layer.kv_cache[2], layer.kv_cache[3], slots[[0, 2]], nat[[0, 2]], layer.A_log,
                          layer.dt_bias, LB)
        m[5], m[3] = folded[2], folded[3]
    one = made[0].kv_cache[1].clone()
    recoverssm_commit(one, made[0].kv_cache[2], made[0].kv_cache[3], slots, nat, made[0].A_log, made[0].dt_bias, LB,
                      null_policy="nonpositive", destination_indices=dst)
    torch.testing.assert_close(one, moved[0], rtol=1e-6, atol=1e-6)
    ctx = RecoverSSMCommit([m.kv_cache[1] for m in made], [m.kv_cache[2] for m in made],
                           [m.kv_cache[3] for m in made], [m.A_log for m in made], [m.dt_bias for m in made], LB,
                           null_policy="nonpositive")
    ctx.commit(slots, nat, destination_indices=dst)
    for m, b, layer in zip(moved, before, made):
        torch.testing.assert_close(layer.kv_cache[1], m, rtol=1e-6, atol=1e-6)
        assert torch.equal(layer.kv_cache[1][[0, 1, 2, 4]], b[[0, 1, 2, 4]])  # sources and unnamed slots
    with pytest.raises(KDAError, match="destination_indices: expected state_indices' dtype"):
        ctx.commit(slots, nat, destination_indices=dst.long())
    with pytest.raises(KDAError, match="destination_indices: expected shape"):
        recoverssm_commit(one, made[0].kv_cache[2], made[0].kv_cache[3], slots, nat, made[0].A_log, made[0].dt_bias,
                          LB, destination_indices=dst[:2])


# ---------------------------------------------------------------------------------------------------------------
# SGLang tree verify

TREE = [-1, 0, 0, 1, 1, 2, 5, 3]  # token t's parent; -1 the root (EAGLE topk > 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("parents", [None, TREE], ids=["chain", "tree"])
def test_sglang_target_verify_runs_each_token_on_its_root_to_token_path(device, parents):
    g = torch.Generator().manual_seed(7)
    N, T, H = 2, len(TREE), 4
    q, k, v, graw = (rnd(g, 1, N * T, H, D, device=device) for _ in range(4))
    a = graw.reshape(1, N * T, H * D)
    b = rnd(g, 1, N * T, H, device=device)
    A_log = rnd(g, H, dtype=torch.float32, scale=0.5, device=device)
    dt_bias = rnd(g, H * D, dtype=torch.float32, scale=0.1, device=device)
    pool = rnd(g, N + 1, H, D, D, dtype=torch.float32, scale=0.1, device=device)
    pool_before = pool.clone()
    cache = torch.arange(N, dtype=torch.int32, device=device)
    inter = torch.zeros(N, T, H, D, D, device=device)
    parent = None if parents is None else torch.tensor([parents] * N, dtype=torch.int32, device=device)
    qsl = torch.arange(0, N * T + 1, T, dtype=torch.int32, device=device)
    o = sglang.kda_target_verify(A_log, dt_bias, q, k, v, a, b, ssm_states=pool, cache_indices=cache + 1,
                                 query_start_loc=qsl, intermediate_states_buffer=inter,
                                 intermediate_state_indices=cache, cache_steps=T, retrieve_parent_token=parent,
                                 lower_bound=None)
    assert torch.equal(pool, pool_before)  # the committed pool is read only
    for n in range(N):
        for t in range(T):
            path = [t]
            while parents is not None and parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            path = list(range(t + 1)) if parents is None else path[::-1]
            rows = [n * T + j for j in path]
            o_ref, s_ref = plain(q[0, rows], k[0, rows], v[0, rows], graw[0, rows], b[0, rows], A_log, dt_bias,
                                 pool[n + 1], lower_bound=None)
            torch.testing.assert_close(o[0, n * T + t].float(), o_ref[-1].float(), rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(inter[n, t], s_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_sglang_target_verify_adaptive_steps_keep_each_request_in_its_buffer_slot(device):
    """SGLang's adaptive speculation runs fewer draft steps (``cache_steps``) than its intermediate buffer holds per
    slot (S = shape[1]): request n's token t still lands in ``buffer[slot_n, t]`` (the stride is S, as SGLang's
    later kernel derives it), the steps past the window and every other slot stay untouched; a ``cache_steps``
    over S is refused by name."""
    g = torch.Generator().manual_seed(9)
    N, T, S, H = 3, 3, 5, 4
    q, k, v, graw = (rnd(g, 1, N * T, H, D, device=device) for _ in range(4))
    b = rnd(g, 1, N * T, H, device=device)
    A_log = rnd(g, H, dtype=torch.float32, scale=0.5, device=device)
    dt_bias = rnd(g, H * D, dtype=torch.float32, scale=0.1, device=device)
    pool = rnd(g, N + 1, H, D, D, dtype=torch.float32, scale=0.1, device=device)
    inter = torch.full((N + 2, S, H, D, D), 7.0, device=device)
    slots = torch.tensor([3, 0, 2], dtype=torch.int32, device=device)  # buffer slots 1 and 4 belong to nobody
    qsl = torch.arange(0, N * T + 1, T, dtype=torch.int32, device=device)
    call = dict(ssm_states=pool, cache_indices=torch.arange(1, N + 1, dtype=torch.int32, device=device),
                query_start_loc=qsl, intermediate_states_buffer=inter, intermediate_state_indices=slots,
                retrieve_parent_token=None, lower_bound=-5.0)
    o = sglang.kda_target_verify(A_log, dt_bias, q, k, v, graw.reshape(1, N * T, H * D), b, cache_steps=T, **call)
    for n, slot in enumerate(slots.tolist()):
        rows = list(range(n * T, (n + 1) * T))
        for t in range(T):
            o_ref, s_ref = plain(q[0, rows[:t + 1]], k[0, rows[:t + 1]], v[0, rows[:t + 1]], graw[0, rows[:t + 1]],
                                 b[0, rows[:t + 1]], A_log, dt_bias, pool[n + 1], lower_bound=-5.0)
            torch.testing.assert_close(o[0, rows[t]].float(), o_ref[-1].float(), rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(inter[slot, t], s_ref, rtol=1e-4, atol=1e-4)
        assert bool((inter[slot, T:] == 7.0).all()), slot  # the steps past this call's window
    assert bool((inter[[1, 4]] == 7.0).all())  # the slots no request names
    with pytest.raises(KDAError, match=r"^cache_steps: expected at most the buffer's steps per slot"):
        sglang.kda_target_verify(A_log, dt_bias, q, k, v, graw.reshape(1, N * T, H * D), b, cache_steps=S + 1,
                                 **call)


@pytest.mark.parametrize("device", DEVICES)
def test_sglang_target_verify_ragged_layout_covers_each_row_and_no_more(device):
    """SGLang's ragged verify layout: rows of fewer draft tokens than ``cache_steps`` (here 2, 3 and 1 of 3), and a
    ``query_start_loc`` capped below the tokens passed (SGLang's tier leftovers: the last token is in no row, and
    SGLang zeroes its output afterwards). Each row's tokens get the recurrence of their row; its states land in its
    buffer slot at steps 0..len-1, the steps past its length stay untouched, and so does every other slot."""
    g = torch.Generator().manual_seed(11)
    lengths, S, H = [2, 3, 1], 3, 4
    n_tok = sum(lengths) + 1  # one token past the last row
    q, k, v, graw = (rnd(g, 1, n_tok, H, D, device=device) for _ in range(4))
    b = rnd(g, n_tok, H, device=device)
    A_log = rnd(g, H, dtype=torch.float32, scale=0.5, device=device)
    dt_bias = rnd(g, H * D, dtype=torch.float32, scale=0.1, device=device)
    N = len(lengths)
    pool = rnd(g, N + 1, H, D, D, dtype=torch.float32, scale=0.1, device=device)
    inter = torch.full((N + 1, S, H, D, D), 7.0, device=device)
    slots = torch.tensor([2, 0, 1], dtype=torch.int32, device=device)  # buffer slot 3 belongs to nobody
    starts = [0, 2, 5, 6]
    o = sglang.kda_target_verify(A_log, dt_bias, q, k, v, graw.reshape(n_tok, H * D), b, ssm_states=pool,
                                 cache_indices=torch.arange(1, N + 1, dtype=torch.int32, device=device),
                                 query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
                                 intermediate_states_buffer=inter, intermediate_state_indices=slots, cache_steps=S,
                                 retrieve_parent_token=None, lower_bound=-5.0)
    for n, slot in enumerate(slots.tolist()):
        rows = list(range(starts[n], starts[n + 1]))
        for t in range(len(rows)):
            o_ref, s_ref = plain(q[0, rows[:t + 1]], k[0, rows[:t + 1]], v[0, rows[:t + 1]], graw[0, rows[:t + 1]],
                                 b[rows[:t + 1]], A_log, dt_bias, pool[n + 1], lower_bound=-5.0)
            torch.testing.assert_close(o[0, rows[t]].float(), o_ref[-1].float(), rtol=2e-2, atol=2e-2)
            torch.testing.assert_close(inter[slot, t], s_ref, rtol=1e-4, atol=1e-4)
        assert bool((inter[slot, len(rows):] == 7.0).all()), slot
    assert bool((inter[3] == 7.0).all())


@pytest.mark.parametrize("device", DEVICES)
def test_sglang_target_verify_malformed_buffer_slots_are_null_and_never_wrap(device):
    """``intermediate_state_indices`` are device data: a negative slot and one whose row (slot * S + t) is past the
    32-bit range (2^30 * 4 = 2^32 wraps to row 0 in int32 arithmetic) store nothing, so buffer slot 0, which no
    request names, stays bitwise untouched; the well-formed request's states land in its slot."""
    g = torch.Generator().manual_seed(12)
    N, T, S, H = 3, 2, 4, 4
    q, k, v, graw = (rnd(g, 1, N * T, H, D, device=device) for _ in range(4))
    b = rnd(g, N * T, H, device=device)
    A_log = rnd(g, H, dtype=torch.float32, scale=0.5, device=device)
    dt_bias = rnd(g, H * D, dtype=torch.float32, scale=0.1, device=device)
    pool = rnd(g, N + 1, H, D, D, dtype=torch.float32, scale=0.1, device=device)
    inter = torch.full((3, S, H, D, D), 7.0, device=device)
    slots = torch.tensor([2**30, -1, 2], dtype=torch.int32, device=device)
    sglang.kda_target_verify(A_log, dt_bias, q, k, v, graw.reshape(N * T, H * D), b, ssm_states=pool,
                             cache_indices=torch.arange(1, N + 1, dtype=torch.int32, device=device),
                             query_start_loc=torch.arange(0, N * T + 1, T, dtype=torch.int32, device=device),
                             intermediate_states_buffer=inter, intermediate_state_indices=slots, cache_steps=T,
                             retrieve_parent_token=None, lower_bound=-5.0)
    assert bool((inter[:2] == 7.0).all())  # slots 0 and 1: no request's
    rows = list(range(2 * T, 3 * T))
    for t in range(T):
        _, s_ref = plain(q[0, rows[:t + 1]], k[0, rows[:t + 1]], v[0, rows[:t + 1]], graw[0, rows[:t + 1]],
                         b[rows[:t + 1]], A_log, dt_bias, pool[3], lower_bound=-5.0)
        torch.testing.assert_close(inter[2, t], s_ref, rtol=1e-4, atol=1e-4)
    assert bool((inter[2, T:] == 7.0).all())


def test_adapter_constants_are_made_once_with_their_values():
    from kda_recurrent.compat import constant

    steps = constant(5, torch.int64, "cpu")
    assert steps is constant(5, torch.int64, torch.device("cpu")) and steps.tolist() == [0, 1, 2, 3, 4]
    assert constant(5, torch.int32, "cpu").dtype is torch.int32
    assert constant(3, torch.float32, "cpu", 1.0).tolist() == [1.0, 1.0, 1.0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sglang_target_verify_captured_first_then_eager_keeps_correct_steps():
    """The verify's step constant is made inside a CUDA graph capture when the graph is the first call of that step
    count: that one is not kept (its fill has not run), so an eager call right after capture, before any replay,
    still stores each state in its own row; the replay agrees with the eager call bit for bit."""
    from kda_recurrent.compat import _CONSTANTS

    g = torch.Generator().manual_seed(13)
    N, T, S, H, dev = 2, 7, 7, 4, "cuda"  # 7 steps: a count no other test here uses
    for key in [key for key in _CONSTANTS if key[0] == T]:
        del _CONSTANTS[key]
    q, k, v, graw = (rnd(g, 1, N * T, H, D, device=dev) for _ in range(4))
    b = rnd(g, N * T, H, device=dev)
    A_log = rnd(g, H, dtype=torch.float32, scale=0.5, device=dev)
    dt_bias = rnd(g, H * D, dtype=torch.float32, scale=0.1, device=dev)
    pool = rnd(g, N + 1, H, D, D, dtype=torch.float32, scale=0.1, device=dev)
    call = dict(ssm_states=pool, cache_indices=torch.arange(1, N + 1, dtype=torch.int32, device=dev),
                query_start_loc=torch.arange(0, N * T + 1, T, dtype=torch.int32, device=dev),
                intermediate_state_indices=torch.tensor([1, 0], dtype=torch.int32, device=dev), cache_steps=T,
                retrieve_parent_token=None, lower_bound=-5.0)
    a = graw.reshape(N * T, H * D)
    captured = torch.zeros(N, S, H, D, D, device=dev)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        sglang.kda_target_verify(A_log, dt_bias, q, k, v, a, b, intermediate_states_buffer=captured, **call)  # compile
    torch.cuda.current_stream().wait_stream(side)
    for key in [key for key in _CONSTANTS if key[0] == T]:
        del _CONSTANTS[key]
    with torch.cuda.graph(graph):
        o_graph = sglang.kda_target_verify(A_log, dt_bias, q, k, v, a, b, intermediate_states_buffer=captured,
                                           **call)
    assert not any(key[0] == T for key in _CONSTANTS)  # the one made during capture was not kept
    eager = torch.zeros_like(captured)
    o_eager = sglang.kda_target_verify(A_log, dt_bias, q, k, v, a, b, intermediate_states_buffer=eager, **call)
    for n, slot in enumerate([1, 0]):
        rows = list(range(n * T, (n + 1) * T))
        for t in range(T):
            _, s_ref = plain(q[0, rows[:t + 1]], k[0, rows[:t + 1]], v[0, rows[:t + 1]], graw[0, rows[:t + 1]],
                             b[rows[:t + 1]], A_log, dt_bias, pool[n + 1], lower_bound=-5.0)
            torch.testing.assert_close(eager[slot, t], s_ref, rtol=1e-4, atol=1e-4)
    captured.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager) and torch.equal(o_graph, o_eager)


def test_sglang_target_verify_refuses_the_replayssm_ring_mode_it_does_not_write():
    """SGLang's ring mode (``cache_ring=True``: the draft tokens' records go to its ReplaySSM rings, no intermediate
    states) is refused by name before anything runs, not answered with outputs and stale rings."""
    g = torch.Generator().manual_seed(8)
    N, T, H = 2, 3, 4
    q, k, v, graw = (rnd(g, 1, N * T, H, D) for _ in range(4))
    pool = rnd(g, N + 1, H, D, D, dtype=torch.float32, scale=0.1)
    rings = {"replayssm_rawv": torch.zeros(N + 1, H, T, D, dtype=BF16),
             "replayssm_rawk": torch.zeros(N + 1, H, T, D, dtype=BF16),
             "replayssm_g": torch.zeros(N + 1, H, T), "replayssm_beta": torch.zeros(N + 1, H, T)}
    before = {name: t.clone() for name, t in rings.items()}
    qsl = torch.arange(0, N * T + 1, T, dtype=torch.int32)
    with pytest.raises(KDAError, match="cache_ring"):
        sglang.kda_target_verify(rnd(g, H, dtype=torch.float32), rnd(g, H * D, dtype=torch.float32), q, k, v,
                                 graw.reshape(1, N * T, H * D), rnd(g, 1, N * T, H), ssm_states=pool,
                                 cache_indices=torch.arange(1, N + 1, dtype=torch.int32), query_start_loc=qsl,
                                 intermediate_states_buffer=None, intermediate_state_indices=None, cache_steps=T,
                                 retrieve_parent_token=None, lower_bound=-5.0, cache_ring=True, **rings)
    assert all(torch.equal(rings[name], before[name]) for name in rings)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("align", [False, True], ids=["plain", "align"])
@pytest.mark.parametrize("pool_dtype", [torch.float32, BF16])
def test_vllm_verify_and_commit_context_replay_in_a_cuda_graph_bit_for_bit(pool_dtype, align):
    """One spec step as vLLM runs it under FULL CUDA graphs: the verify of every layer, then the commit context (in
    the align mode too: rows 0 and 2 cross a block boundary, their final states move to blocks 3 and 1); five
    replays against five eager steps on copies of every cache."""
    g = torch.Generator().manual_seed(9)
    H, T, N, blocks, L = 12, 4, 3, 5, 2
    dev = "cuda"
    layers = recoverssm_layers(g, layers=L, blocks=blocks, H=H, T=T, conv_dim=16, history=3, pool_dtype=pool_dtype,
                               device=dev)
    twins = [types.SimpleNamespace(**{**vars(m), "kv_cache": tuple(c.clone() for c in m.kv_cache)}) for m in layers]
    slots = torch.tensor([2, 0, 4], dtype=torch.int32, device=dev)  # a padding row (block 0)
    qsl = torch.arange(0, N * T + 1, T, dtype=torch.int32, device=dev)
    acts = [[rnd(g, 1, N * T, H, D, device=dev) for _ in range(4)] + [rnd(g, 1, N * T, H, device=dev)]
            for _ in range(L)]
    nat = torch.tensor([3, 1, 4], dtype=torch.int32, device=dev)
    extra = {}
    if align:
        extra = dict(block_table=torch.tensor([[2, 3], [0, 0], [4, 1]], dtype=torch.int32, device=dev),
                     num_computed_tokens=torch.tensor([6, 0, 7], dtype=torch.int32, device=dev), mamba_block_size=8)
    outs = [torch.empty(1, N * T, H, D, dtype=BF16, device=dev) for _ in range(L)]
    twin_outs = [o.clone() for o in outs]

    def step(ls, os_):
        for layer, (q, k, v, graw, beta), out in zip(ls, acts, os_):
            kimi_k3.kda_recoverssm_verify(q, k, v, graw, beta, layer.A_log, layer.dt_bias, LB, layer.kv_cache[1],
                                          layer.kv_cache[2], layer.kv_cache[3], qsl, slots, T, out=out)
        return ls

    ctx = kimi_k3.KDARecoverSSMCommitContext.create(layers, spec_query_len=T, max_num_reqs=N, conv_dim_first=True)
    twin_ctx = kimi_k3.KDARecoverSSMCommitContext.create(twins, spec_query_len=T, max_num_reqs=N,
                                                         conv_dim_first=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles) on copies, outside the capture
        warm = [types.SimpleNamespace(**{**vars(m), "kv_cache": tuple(c.clone() for c in m.kv_cache)})
                for m in layers]
        step(warm, [o.clone() for o in outs])
        kimi_k3.KDARecoverSSMCommitContext.create(warm, spec_query_len=T, max_num_reqs=N,
                                                  conv_dim_first=True).commit(nat, slots, qsl, **extra)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(layers, outs)
        ctx.commit(nat, slots, qsl, **extra)
    for _ in range(5):
        graph.replay()
        step(twins, twin_outs)
        twin_ctx.commit(nat, slots, qsl, **extra)
        torch.cuda.synchronize()
        for a, b in zip(layers, twins):
            for x, y in zip(a.kv_cache, b.kv_cache):
                assert torch.equal(x, y)
        for o, p in zip(outs, twin_outs):
            assert torch.equal(o, p)
