"""Simulated serving loops: each engine adapter driven the way its engine drives it, step after step.

One loop per engine call form (docs/serving.md §1, §2, §4):

- vLLM Kimi K3 packed decode (``compat.vllm.kimi_k3.fused_recurrent_kda_packed_decode``): null slot 0, block 0
  reserved, ``mixed_qkv`` rows of a ``[B, 3HD + 1]`` buffer, the slot indices a stride-8 column of a block table;
- vLLM Kimi-Linear (``compat.vllm.kimi_linear.fused_recurrent_kda``): ``[1, N, H, K]`` + ``cu_seqlens``, fp32 log
  decay and sigmoided beta precomputed, null slot 0, trailing padding rows sometimes zero-length;
- SGLang packed decode (``compat.sglang.fused_recurrent_kda_packed_decode``): null -1, slot 0 live;
- vLLM Kimi K3 spec decode (``compat.vllm.kimi_k3.fused_recurrent_kda``): 2-D index rows ``[n, 1 + S]`` of a
  stride-8 block table, ``num_accepted_tokens`` including 0 and ``1 + S + 1`` (both null the row under vLLM's policy),
  zero-length padding rows, ``out`` a view of a NaN-filled buffer.

A persistent batch (B rows) over a pool whose slot stride is the row plus 17 elements (vLLM's test layout: an
unaligned stride). Between steps requests leave (their slots go back to the free list) and join (a free slot, its
state set to random values); rows no request holds carry the engine's null. Inputs are refreshed by ``copy_`` into
static buffers; on a GPU the call is captured once in a CUDA graph and replayed every step.

Every step checks, against a snapshot of the pool's whole storage taken before the step: every element outside the
slots live requests own (other slots, block 0 under vLLM, the 17 padding elements after each slot) is bitwise
unchanged; each live request's output and state match kda-core's oracle run on a copy of the pre-step pool (bf16
tolerances as in test_facade.py); rows and tokens no live request owns have exactly zero output.

The CPU tests run the same loops with a small H through the adapters' CPU path (the oracle) and no graph, so CI
exercises the bookkeeping; ``test_cpu_loop_catches_*`` show the checks fail when an adapter misbehaves.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kda_core.contracts import NullSlotPolicy
from kda_core.oracle import recurrent_kda_ref, unpack_packed

BF16 = torch.bfloat16
F32 = torch.float32
HAS_CUDA = torch.cuda.is_available()
K = 128  # head dim (K = V)
SLOT_PAD = 17  # elements after each pool slot: vLLM's test pool [slots, H*D*D + 17]
INDEX_STRIDE = 8  # vLLM's index tensors: columns of a [rows, 8] block table
LOWER_BOUND = -5.0


def tol(dtype):
    return dict(rtol=2e-2, atol=2e-2) if dtype == BF16 else dict(rtol=1e-3, atol=1e-3)


def bits(t: torch.Tensor) -> torch.Tensor:
    view = {F32: torch.int32, BF16: torch.int16}[t.dtype]
    return t.contiguous().view(view)


def i32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


class Pool:
    """A state pool [n_slots, H, V, K] over a flat storage whose slot stride is the row plus SLOT_PAD elements."""

    def __init__(self, n_slots, H, dtype, device, gen):
        self.n_slots, self.row = n_slots, H * K * K
        self.stride = self.row + SLOT_PAD
        self.flat = (torch.randn(n_slots * self.stride, generator=gen, device=device) * 0.1).to(dtype)
        self.view = self.flat.as_strided((n_slots, H, K, K), (self.stride, K * K, K, 1))
        self.slot0 = self.flat[: self.row].clone()

    def fill(self, slot, gen):
        self.view[slot].copy_(torch.randn(self.view.shape[1:], generator=gen, device=self.flat.device) * 0.1)

    def assert_only_owned_changed(self, snapshot, owned, what):
        """Every storage element outside the rows of ``owned`` slots is bitwise equal to ``snapshot``."""
        changed = bits(self.flat) != bits(snapshot)
        for slot in owned:
            changed[slot * self.stride : slot * self.stride + self.row] = False
        if bool(changed.any()):
            where = sorted({int(i) // self.stride for i in changed.nonzero()[:, 0].tolist()[:4096]})
            raise AssertionError(f"{what}: storage of slots {where} changed (owned: {sorted(owned)})")


class Requests:
    """The persistent batch: ``rows[r]`` is the list of slots request r holds, or None (a padding row)."""

    def __init__(self, B, slots, per_request, rng):
        self.rows = [None] * B
        self.free = list(slots)
        self.per_request = per_request
        self.rng = rng

    def churn(self, pool, gen, p_leave=0.25, p_join=0.5, compact=False):
        rng = self.rng
        for r, held in enumerate(self.rows):
            if held is not None and rng.random() < p_leave:
                self.free.extend(held)
                self.rows[r] = None
        for r, held in enumerate(self.rows):
            if held is None and rng.random() < p_join and len(self.free) >= self.per_request:
                taken = [self.free.pop(rng.randrange(len(self.free))) for _ in range(self.per_request)]
                for slot in taken:
                    pool.fill(slot, gen)
                self.rows[r] = taken
        if compact:  # vLLM condenses its batch: live requests first, padding rows last
            live = [h for h in self.rows if h is not None]
            self.rows = live + [None] * (len(self.rows) - len(live))


# ---------------------------------------------------------------------------------------------------------------
# engines: static buffers, the engine's call, the oracle's answer, the output checks


class _Engine:
    null = 0
    policy = NullSlotPolicy.NONPOSITIVE
    first_slot = 1  # vLLM: block 0 is reserved
    per_request = 1
    compact = False

    def __init__(self, B, H, pool, device, gen):
        self.B, self.H, self.pool, self.device, self.gen = B, H, pool, device, gen

    def randn(self, *shape, scale=1.0):
        return torch.randn(*shape, generator=self.gen, device=self.device) * scale

    def owned(self, requests):
        return {s for held in requests.rows if held is not None for s in held}

    def index_block_table(self, column0):
        """A [B, 8] block table whose column 0 holds the slots; the other columns hold live slots too (the kernels
        must read column 0 only)."""
        table = torch.randint(self.first_slot, self.pool.n_slots, (self.B, INDEX_STRIDE), generator=self.gen,
                              device=self.device, dtype=torch.int32)
        table[:, 0] = i32(column0, self.device)
        return table


class VllmK3Packed(_Engine):
    """vLLM Kimi K3 T=1 decode: ``fused_recurrent_kda_packed_decode`` (docs/serving.md §1, §3)."""

    name = "vllm-k3-packed"

    def __init__(self, B, H, pool, device, gen):
        super().__init__(B, H, pool, device, gen)
        HK = H * K
        self.mixed_buf = torch.zeros(B, 3 * HK + 1, dtype=BF16, device=device)  # odd row stride
        self.mixed_qkv = self.mixed_buf[:, : 3 * HK]
        self.raw_g = torch.zeros(1, B, H, K, dtype=BF16, device=device)
        self.raw_beta = torch.zeros(1, B, H, dtype=BF16, device=device)
        self.A_log = self.randn(H, scale=0.5)
        self.dt_bias = self.randn(H, K, scale=0.1)
        self.table = torch.zeros(B, INDEX_STRIDE, dtype=torch.int32, device=device)
        self.indices = self.table[:, 0]  # stride 8
        self.out = torch.full((1, B, H, K), float("nan"), dtype=BF16, device=device)

    def refresh(self, requests):
        self.mixed_buf.copy_(self.randn(*self.mixed_buf.shape).to(BF16))
        self.raw_g.copy_(self.randn(*self.raw_g.shape).to(BF16))
        self.raw_beta.copy_(self.randn(*self.raw_beta.shape).to(BF16))
        self.table.copy_(self.index_block_table([h[0] if h else self.null for h in requests.rows]))

    def call(self):
        from kda_recurrent.compat.vllm import kimi_k3

        o, state = kimi_k3.fused_recurrent_kda_packed_decode(self.mixed_qkv, self.raw_g, self.raw_beta, self.A_log,
                                                             self.dt_bias, LOWER_BOUND, self.pool.view,
                                                             self.indices, out=self.out)
        assert o is self.out and state is self.pool.view
        return o

    def oracle(self, pool_copy):
        B, H = self.B, self.H
        q, k, v, g, beta = unpack_packed(self.mixed_qkv, self.raw_g.view(B, H * K), self.raw_beta.view(B, H), H, K)
        o, pool_ref = recurrent_kda_ref(q, k, v, g, beta, A_log=self.A_log, dt_bias=self.dt_bias.reshape(-1),
                                        initial_state=pool_copy, use_qk_l2norm_in_kernel=True,
                                        use_gate_in_kernel=True, lower_bound=LOWER_BOUND, beta_is_logit=True,
                                        ssm_state_indices=self.indices, null_policy=self.policy)
        return o.view(1, B, H, K), pool_ref

    def zero_tokens(self, requests):
        return [r for r, held in enumerate(requests.rows) if held is None]


class SglangPacked(VllmK3Packed):
    """SGLang T=1 decode: ``fused_recurrent_kda_packed_decode`` with a ``[B, 1, HV, V]`` out (docs/serving.md §4)."""

    name = "sglang-packed"
    null = -1
    policy = NullSlotPolicy.OUT_OF_RANGE
    first_slot = 0  # slot 0 is live

    def __init__(self, B, H, pool, device, gen):
        _Engine.__init__(self, B, H, pool, device, gen)
        HK = H * K
        self.mixed_buf = torch.zeros(B, 3 * HK + 16, dtype=BF16, device=device)
        self.mixed_qkv = self.mixed_buf[:, : 3 * HK]
        self.a = torch.zeros(B, HK, dtype=BF16, device=device)
        self.b = torch.zeros(B, H, dtype=BF16, device=device)
        self.raw_g, self.raw_beta = self.a.view(1, B, H, K), self.b.view(1, B, H)  # what refresh writes
        self.A_log = self.randn(H, scale=0.5)
        self.dt_bias = self.randn(HK, scale=0.1)
        self.indices = torch.zeros(B, dtype=torch.int32, device=device)
        self.out = torch.full((B, 1, H, K), float("nan"), dtype=BF16, device=device)

    def refresh(self, requests):
        self.mixed_buf.copy_(self.randn(*self.mixed_buf.shape).to(BF16))
        self.a.copy_(self.randn(*self.a.shape).to(BF16))
        self.b.copy_(self.randn(*self.b.shape).to(BF16))
        self.indices.copy_(i32([h[0] if h else self.null for h in requests.rows], self.device))

    def call(self):
        from kda_recurrent.compat import sglang

        o, state = sglang.fused_recurrent_kda_packed_decode(self.mixed_qkv, self.a, self.b, self.A_log, self.dt_bias,
                                                            K ** -0.5, self.pool.view, self.out, self.indices,
                                                            use_qk_l2norm_in_kernel=True, lower_bound=None)
        assert o is self.out and state is self.pool.view
        return o.view(1, self.B, self.H, K)

    def oracle(self, pool_copy):
        q, k, v, g, beta = unpack_packed(self.mixed_qkv, self.a, self.b, self.H, K)
        o, pool_ref = recurrent_kda_ref(q, k, v, g, beta, A_log=self.A_log, dt_bias=self.dt_bias, scale=K ** -0.5,
                                        initial_state=pool_copy, use_qk_l2norm_in_kernel=True,
                                        use_gate_in_kernel=True, lower_bound=None, beta_is_logit=True,
                                        ssm_state_indices=self.indices, null_policy=self.policy)
        return o.view(1, self.B, self.H, K), pool_ref


class VllmKimiLinear(_Engine):
    """vLLM Kimi-Linear decode: ``fused_recurrent_kda`` on ``[1, N, H, K]`` + ``cu_seqlens`` (docs/serving.md §2)."""

    name = "vllm-kimi-linear"

    def __init__(self, B, H, pool, device, gen):
        super().__init__(B, H, pool, device, gen)
        self.q, self.k, self.v = (torch.zeros(1, B, H, K, dtype=BF16, device=device) for _ in range(3))
        self.g = torch.zeros(1, B, H, K, dtype=F32, device=device)
        self.beta = torch.zeros(1, B, H, dtype=F32, device=device)
        self.cu = torch.arange(B + 1, dtype=torch.int32, device=device)
        self.table = torch.zeros(B, INDEX_STRIDE, dtype=torch.int32, device=device)
        self.indices = self.table[:, 0]
        self.lengths = [1] * B

    def refresh(self, requests):
        for t in (self.q, self.k, self.v):
            t.copy_(self.randn(*t.shape).to(BF16))
        self.g.copy_(F.logsigmoid(self.randn(*self.g.shape) + 2.0))  # fp32 log decay, as fused_kda_gate makes it
        self.beta.copy_(torch.rand(self.beta.shape, generator=self.gen, device=self.device))  # sigmoided
        # Padding rows: length 1 in the middle of the batch; some trailing ones zero-length (the offsets repeat).
        lengths = [1] * self.B
        tail = requests.rng.choice([0, 1, 3])
        for r in range(self.B - 1, -1, -1):
            if tail == 0 or requests.rows[r] is not None:
                break
            lengths[r], tail = 0, tail - 1
        self.lengths = lengths
        self.cu.copy_(i32([0] + torch.tensor(lengths).cumsum(0).tolist(), self.device))
        self.table.copy_(self.index_block_table([h[0] if h else self.null for h in requests.rows]))

    def call(self):
        from kda_recurrent.compat.vllm import kimi_linear

        o, state = kimi_linear.fused_recurrent_kda(self.q, self.k, self.v, self.g, self.beta,
                                                   initial_state=self.pool.view, inplace_final_state=True,
                                                   use_qk_l2norm_in_kernel=True, cu_seqlens=self.cu,
                                                   ssm_state_indices=self.indices)
        assert state is self.pool.view
        return o

    def oracle(self, pool_copy):
        return recurrent_kda_ref(self.q, self.k, self.v, self.g, self.beta, initial_state=pool_copy,
                                 use_qk_l2norm_in_kernel=True, use_gate_in_kernel=False, beta_is_logit=False,
                                 cu_seqlens=self.cu, ssm_state_indices=self.indices, null_policy=self.policy)

    def zero_tokens(self, requests):
        """Tokens of padding rows, and tokens past the last sequence's end."""
        starts = [0] + torch.tensor(self.lengths).cumsum(0).tolist()
        zero = [starts[r] for r, held in enumerate(requests.rows) if held is None and self.lengths[r]]
        return zero + list(range(starts[-1], self.B))


class VllmK3Spec(_Engine):
    """vLLM Kimi K3 spec decode with per-token checkpoints: ``fused_recurrent_kda`` (docs/serving.md §1, §3).

    Each request holds ``T = 1 + S`` slots (columns of its block-table row); a step reads column ``nat - 1`` and
    writes the state after token t to column t. ``nat`` is 0 or ``T + 1`` for some live requests: under vLLM's
    policy the whole row is then null (its slots untouched, zero outputs).
    """

    name = "vllm-k3-spec"
    compact = True

    def __init__(self, B, H, pool, device, gen, T=4, fuse_gate=None):
        super().__init__(B, H, pool, device, gen)
        self.T, self.per_request, self.fuse_gate = T, T, fuse_gate
        n_tok, HK = B * T, H * K
        self.row_buf = torch.zeros(1, n_tok, 3 * HK + 7, dtype=BF16, device=device)
        self.q, self.k, self.v = (self.row_buf[..., i * HK : (i + 1) * HK].unflatten(-1, (H, K)) for i in range(3))
        self.g_buf = torch.zeros(1, n_tok, HK + 5, dtype=BF16, device=device)
        self.raw_g = self.g_buf[..., :HK].unflatten(-1, (H, K))
        self.beta_buf = torch.zeros(1, n_tok, H + 1, dtype=BF16, device=device)
        self.raw_beta = self.beta_buf[..., :H]
        self.A_log = self.randn(H, scale=0.5)
        self.dt_bias = self.randn(H, K, scale=0.1)
        self.cu = torch.zeros(B + 1, dtype=torch.int32, device=device)
        self.table = torch.zeros(B, INDEX_STRIDE, dtype=torch.int32, device=device)
        self.indices = self.table[:, :T]
        self.nat = torch.ones(B, dtype=torch.int32, device=device)
        self.out_buf = torch.full((1, n_tok, HK + 11), float("nan"), dtype=BF16, device=device)
        self.out = self.out_buf[..., :HK].unflatten(-1, (H, K))
        self.accepted = [1] * B

    def refresh(self, requests):
        T, rng = self.T, requests.rng
        for buf in (self.row_buf, self.g_buf, self.beta_buf):
            buf.copy_(self.randn(*buf.shape).to(BF16))
        table = torch.randint(1, self.pool.n_slots, (self.B, INDEX_STRIDE), generator=self.gen, device=self.device,
                              dtype=torch.int32)  # columns past T: other live slots, never to be read
        accepted, lengths = [], []
        for r, held in enumerate(requests.rows):
            if held is None:  # FULL-graph padding: an all-null row, count 1, zero tokens
                table[r, :T] = 0
                accepted.append(1)
                lengths.append(0)
                continue
            table[r, :T] = i32(held, self.device)
            u = rng.random()
            accepted.append(0 if u < 0.2 else T + 1 if u < 0.3 else rng.randint(1, T))
            lengths.append(T)
        self.accepted = accepted
        self.table.copy_(table)
        self.nat.copy_(i32(accepted, self.device))
        self.cu.copy_(i32([0] + torch.tensor(lengths).cumsum(0).tolist(), self.device))

    def owned(self, requests):
        return {s for held, nat in zip(requests.rows, self.accepted) if held is not None and 1 <= nat <= self.T
                for s in held}

    def call(self):
        from kda_recurrent.compat.vllm import kimi_k3

        o, state = kimi_k3.fused_recurrent_kda(self.q, self.k, self.v, self.raw_g, self.raw_beta, self.A_log,
                                               self.dt_bias, LOWER_BOUND, self.pool.view, self.cu, self.indices,
                                               num_accepted_tokens=self.nat, out=self.out, fuse_gate=self.fuse_gate)
        assert o is self.out and state is self.pool.view
        return o

    def oracle(self, pool_copy):
        return recurrent_kda_ref(self.q, self.k, self.v, self.raw_g, self.raw_beta, A_log=self.A_log,
                                 dt_bias=self.dt_bias.reshape(-1), initial_state=pool_copy,
                                 use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=LOWER_BOUND,
                                 beta_is_logit=True, cu_seqlens=self.cu, ssm_state_indices=self.indices,
                                 num_accepted_tokens=self.nat, null_policy=self.policy)

    def zero_tokens(self, requests):
        """Tokens of live rows nulled by their accepted count, and every token past the live rows."""
        T = self.T
        live = [r for r, held in enumerate(requests.rows) if held is not None]
        zero = [r * T + t for r in live if not 1 <= self.accepted[r] <= T for t in range(T)]
        return zero + list(range(len(live) * T, self.B * T))

    def check_extra(self):
        assert bool(self.out_buf[..., self.H * K :].isnan().all()), "the NaN padding after each out row was written"


ENGINES = {e.name: e for e in (VllmK3Packed, VllmKimiLinear, SglangPacked)}


# ---------------------------------------------------------------------------------------------------------------
# the loop


def replayer(engine, graph):
    """The per-step call: eager, or one CUDA-graph capture replayed (static buffers, output captured once)."""
    if not graph:
        return engine.call
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compile and load the kernels outside the capture (every row null: a no-op)
            engine.call()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = engine.call()

    def replay():
        g.replay()
        return static_out

    return replay


def run_loop(make_engine, *, device, steps, B, H, n_slots, pool_dtype, graph, seed=0, sabotage=None):
    """Drive one engine for ``steps`` steps with every check of the module docstring; returns what it counted.

    ``sabotage(engine, requests)`` (tests of the checks) runs after each call, as part of it.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    rng = random.Random(seed)
    pool = Pool(n_slots, H, pool_dtype, device, gen)
    engine = make_engine(B, H, pool, device, gen)
    requests = Requests(B, range(engine.first_slot, n_slots), engine.per_request, rng)
    engine.refresh(requests)  # every row padding: the warm-up and capture calls must leave the pool alone
    before = pool.flat.clone()
    step = replayer(engine, graph)
    pool.assert_only_owned_changed(before, set(), "warm-up with every row null")
    counts = dict(steps=0, live_rows=0, padding_rows=0, joins=0, nulled_rows=0)
    for i in range(steps):
        held_before = {id(h) for h in requests.rows if h is not None}
        if i:  # step 0 runs a batch of padding rows only: a bitwise no-op on the pool
            requests.churn(pool, gen, compact=engine.compact)
        counts["joins"] += sum(1 for h in requests.rows if h is not None and id(h) not in held_before)
        engine.refresh(requests)
        owned = engine.owned(requests)
        snapshot = pool.flat.clone()
        o_ref, pool_ref = engine.oracle(pool.view.clone())
        out = step()
        if sabotage is not None:
            sabotage(engine, requests, out)
        if device == "cuda":
            torch.cuda.synchronize()
        what = f"{engine.name} step {i}"
        pool.assert_only_owned_changed(snapshot, owned, what)
        assert torch.equal(pool.flat[: pool.row], pool.slot0) or engine.first_slot == 0, f"{what}: block 0 written"
        if owned:
            live = torch.tensor(sorted(owned), device=device)
            torch.testing.assert_close(pool.view[live].float(), pool_ref[live].float(), **tol(pool_dtype),
                                       msg=lambda m, what=what: f"{what}: states of the live slots: {m}")
        torch.testing.assert_close(out.float(), o_ref.float().view(out.shape), **tol(BF16),
                                   msg=lambda m, what=what: f"{what}: outputs: {m}")
        zero = engine.zero_tokens(requests)
        if zero:
            assert int(torch.count_nonzero(out[0, zero])) == 0, f"{what}: a padding row or token has nonzero output"
        if hasattr(engine, "check_extra"):
            engine.check_extra()
        live_rows = sum(1 for h in requests.rows if h is not None)
        counts["steps"] += 1
        counts["live_rows"] += live_rows
        counts["padding_rows"] += B - live_rows
        counts["nulled_rows"] += live_rows - len({tuple(h) for h in requests.rows if h is not None and set(h) & owned})
    return counts


def assert_loop_exercised(counts, steps):
    """The loop did what it is for: steps ran, requests joined, live and padding rows both occurred."""
    assert counts["steps"] == steps and counts["joins"] > 0
    assert counts["live_rows"] > 0 and counts["padding_rows"] > 0


# ---------------------------------------------------------------------------------------------------------------
# CPU: the adapters' oracle path, small H, no graph


@pytest.mark.parametrize("pool_dtype", [BF16, F32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_cpu_serving_loop(engine, pool_dtype):
    counts = run_loop(ENGINES[engine], device="cpu", steps=6, B=6, H=2, n_slots=12, pool_dtype=pool_dtype,
                      graph=False, seed=3)
    assert_loop_exercised(counts, 6)


@pytest.mark.parametrize("fuse_gate", [None, False])
def test_cpu_spec_decode_loop(fuse_gate):
    def make(B, H, pool, device, gen):
        return VllmK3Spec(B, H, pool, device, gen, T=3, fuse_gate=fuse_gate)

    counts = run_loop(make, device="cpu", steps=5, B=4, H=2, n_slots=16, pool_dtype=F32, graph=False, seed=5)
    assert_loop_exercised(counts, 5)
    assert counts["nulled_rows"] > 0  # live requests whose accepted count nulled their row


def _write_a_free_slot(engine, requests, out):
    engine.pool.view[requests.free[0]].add_(1.0)


def _write_block_zero(engine, requests, out):
    engine.pool.view[0].add_(1.0)


def _write_a_slot_pad(engine, requests, out):
    engine.pool.flat[engine.pool.row + 3] += 1.0  # the padding after slot 0's row


def _write_a_padding_row_output(engine, requests, out):
    pad = [r for r, held in enumerate(requests.rows) if held is None]
    if pad:
        out[0, pad[0]] = 1.0


@pytest.mark.parametrize("sabotage", [_write_a_free_slot, _write_block_zero, _write_a_slot_pad,
                                      _write_a_padding_row_output], ids=lambda f: f.__name__.strip("_"))
def test_cpu_loop_catches_a_misbehaving_adapter(sabotage):
    with pytest.raises(AssertionError):
        run_loop(VllmK3Packed, device="cpu", steps=3, B=4, H=1, n_slots=8, pool_dtype=BF16, graph=False, seed=1,
                 sabotage=sabotage)


# ---------------------------------------------------------------------------------------------------------------
# GPU: H = 12 (one case at H = 24), CUDA-graph capture once, 50 replays


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("pool_dtype", [BF16, F32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_gpu_serving_loop_under_cuda_graph_replay(engine, pool_dtype):
    counts = run_loop(ENGINES[engine], device="cuda", steps=50, B=16, H=12, n_slots=40, pool_dtype=pool_dtype,
                      graph=True, seed=11)
    assert_loop_exercised(counts, 50)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_serving_loop_h24_vllm_k3_fp32_pool():
    counts = run_loop(VllmK3Packed, device="cuda", steps=50, B=16, H=24, n_slots=40, pool_dtype=F32, graph=True,
                      seed=12)
    assert_loop_exercised(counts, 50)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize(("pool_dtype", "fuse_gate"), [(BF16, None), (F32, None), (F32, False)],
                         ids=["bf16", "fp32", "fp32-unfused-gate"])
def test_gpu_spec_decode_loop_under_cuda_graph_replay(pool_dtype, fuse_gate):
    def make(B, H, pool, device, gen):
        return VllmK3Spec(B, H, pool, device, gen, T=4, fuse_gate=fuse_gate)

    counts = run_loop(make, device="cuda", steps=10, B=8, H=12, n_slots=40, pool_dtype=pool_dtype, graph=True,
                      seed=13)
    assert_loop_exercised(counts, 10)
