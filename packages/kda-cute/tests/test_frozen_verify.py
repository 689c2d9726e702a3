"""GPU tests of the frozen verify (the ucache kernel's no-ring build, ``kda_cute.ucache.frozen_verify``) against
kda-core's spec-decode oracle (``kda_core.oracle_spec.spec_verify_ref`` with ``disable_state_update=True``).

Each test builds random bf16 inputs, runs the kernel and the oracle on separate copies of the records, and compares
outputs (fp32 oracle vs bf16 kernel: atol = rtol = 8e-3, the ucache tests' tolerance), the correction records (fp32
u, the same tolerance), the kg records (raw copies: bitwise) and the pool (bitwise untouched). Record rows the oracle
does not write hold a sentinel that must survive bitwise; so must the outputs of varlen tokens past the first T of
their row (tokens no row owns must be zero, as the oracle has them).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kda_core.contracts import NullSlotPolicy

K = 128
OUT_TOL = dict(atol=8e-3, rtol=8e-3)
CORR_SENTINEL = 7.0
KG_SENTINEL = -3.0
OUT_SENTINEL = 5.0

pytestmark = pytest.mark.gpu


@dataclass
class Case:
    A_log: torch.Tensor
    dt_bias: torch.Tensor | None
    lower_bound: float | None
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    b: torch.Tensor
    pool: torch.Tensor
    slots: torch.Tensor
    cu: torch.Tensor | None
    T: int
    T_max: int | None  # None: no records

    def records(self):
        """Fresh sentinel-filled (correction_cache, kg_cache), or (None, None)."""
        if self.T_max is None:
            return None, None
        N, H = self.pool.shape[0], self.q.shape[2]
        cc = torch.full((N, H, self.T_max, K), CORR_SENTINEL, dtype=torch.float32, device=self.q.device)
        kg = torch.full((N, H, self.T_max, 2 * K), KG_SENTINEL, dtype=torch.bfloat16, device=self.q.device)
        return cc, kg


def make_case(B, T, H, *, seed=0, n_slots=None, slots=None, pool_row_pad=0, lengths=None, tail=0,
              T_max="T", gate="lower_bound", dt_bias=True, cu_dtype=torch.int32, pool_dtype=torch.bfloat16,
              device="cuda") -> Case:
    """Random inputs. ``lengths``: varlen rows of these token counts (activations [1, sum + tail, H, K], offsets
    cumulative; ``tail`` tokens past the last row belong to no row). ``pool_row_pad``: elements added to the pool's
    slot stride. ``T_max``: the records' positions ("T" = T; None = no records)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    n_slots = n_slots or 2 * B + 3
    if slots is None:
        slots = torch.randperm(n_slots, generator=gen)[:B]
    slots = torch.as_tensor(slots, dtype=torch.int32).to(device)
    storage = randn(n_slots * (H * K * K + pool_row_pad), scale=0.1).to(pool_dtype).to(device)
    pool = storage.as_strided((n_slots, H, K, K), (H * K * K + pool_row_pad, K * K, K, 1))
    cu = None
    if lengths is None:
        Ba, Ta = B, T
    else:
        assert len(lengths) == B
        Ba, Ta = 1, sum(lengths) + tail
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=cu_dtype, device=device)
    act = lambda: randn(Ba, Ta, H, K).to(torch.bfloat16).to(device)  # noqa: E731
    return Case(
        A_log=torch.log(torch.rand(H, generator=gen) * 15 + 1).to(device),
        dt_bias=randn(H * K, scale=0.5).to(device) if dt_bias else None,
        lower_bound=-5.0 if gate == "lower_bound" else None,
        q=act(), k=act(), v=act(), g=act(), b=randn(Ba, Ta, H).to(torch.bfloat16).to(device),
        pool=pool, slots=slots, cu=cu, T=T, T_max=T if T_max == "T" else T_max,
    )  # fmt: skip


def run_kernel(case: Case, slots=None, output=None, records=None, **kw):
    """(output, correction_cache, kg_cache) of the kernel; the output starts as the sentinel."""
    from kda_cute.ucache import frozen_verify

    out = output if output is not None else torch.full_like(case.q, OUT_SENTINEL)
    cc, kg = records if records is not None else case.records()
    frozen_verify(
        case.A_log, case.g, case.dt_bias, case.lower_bound, case.q, case.k, case.v, case.b, case.pool,
        case.slots if slots is None else slots, K**-0.5, out, correction_cache=cc, kg_cache=kg, cu_seqlens=case.cu,
        t_draft=case.T if case.cu is not None else None, **kw,
    )  # fmt: skip
    return out, cc, kg


def run_oracle(case: Case, slots=None, null_policy=NullSlotPolicy.OUT_OF_RANGE):
    """(fp32 output, correction_cache, kg_cache, the oracle's pool copy) of the spec-decode oracle."""
    from kda_core.call_args import RecurrentArgs, SpecArgs
    from kda_core.oracle_spec import spec_verify_ref

    cc, kg = case.records()
    pool = case.pool.clone()
    args = RecurrentArgs(
        case.q, case.k, case.v, case.g, case.b, A_log=case.A_log, dt_bias=case.dt_bias, scale=K**-0.5,
        initial_state=pool, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=case.lower_bound,
        beta_is_logit=True, cu_seqlens=case.cu, ssm_state_indices=(case.slots if slots is None else slots).long(),
    )  # fmt: skip
    o, _ = spec_verify_ref(args, SpecArgs(disable_state_update=True, correction_cache=cc, kg_cache=kg),
                           null_policy=null_policy, out_dtype=None)  # fmt: skip
    return o, cc, kg, pool


def owned_tokens(case: Case) -> torch.Tensor:
    """bool [Ba, Ta]: the output positions the kernel writes (every token of a dense call; varlen: every token but
    those past the first T of their row, which are left as they were; tokens no row owns are zeroed)."""
    Ba, Ta = case.q.shape[:2]
    mask = torch.ones(Ba, Ta, dtype=torch.bool, device=case.q.device)
    if case.cu is None:
        return mask
    cu = case.cu.long().clamp(0, Ta).tolist()
    for n in range(len(cu) - 1):
        bos = cu[n]
        eos = max(cu[n + 1], bos)
        mask[0, min(eos, bos + case.T) : eos] = False
    return mask


def check(case: Case, slots=None, null_policy=NullSlotPolicy.OUT_OF_RANGE, **kw):
    """Kernel against the oracle: outputs, records, untouched pool. Returns (out, cc, kg)."""
    pool_before = case.pool.clone()
    out, cc, kg = run_kernel(case, slots=slots, null_policy=null_policy, **kw)
    ref_o, ref_cc, ref_kg, ref_pool = run_oracle(case, slots=slots, null_policy=null_policy)
    torch.cuda.synchronize()
    assert torch.equal(case.pool, pool_before), "the frozen verify wrote the pool"
    assert torch.equal(ref_pool, pool_before)
    owned = owned_tokens(case)
    assert torch.isfinite(out[owned].float()).all()
    torch.testing.assert_close(out[owned].float(), ref_o[owned], **OUT_TOL)
    assert bool((out[~owned] == OUT_SENTINEL).all()), "an output past the first T tokens of its row was written"
    if cc is not None:
        written = ref_cc != CORR_SENTINEL  # what the oracle wrote (a u exactly equal to 7.0 has probability 0)
        assert bool((cc[~written] == CORR_SENTINEL).all()), "a correction record outside the rows' tokens changed"
        torch.testing.assert_close(cc[written], ref_cc[written], **OUT_TOL)
        assert torch.equal(kg, ref_kg), "kg records differ from the raw k | g (or touched other entries)"
    return out, cc, kg


@pytest.mark.parametrize("T", [4, 8])
@pytest.mark.parametrize("B,H", [(1, 12), (3, 12), (64, 12), (64, 32)])
def test_matches_oracle_with_records(T, B, H):
    # B=1, 3 (tile 64), B=64 H=12 (tile 128, 3 CTAs), B=64 H=32 (tile 128, 4 CTAs: the 16-byte activation loads)
    check(make_case(B, T, H, seed=B + T + H))


@pytest.mark.parametrize("T", [4, 8])
def test_record_positions_fewer_than_the_tokens(T):
    # T_max = T - 1: the last token runs (its output is compared) but writes no record
    case = make_case(3, T, 12, seed=11, T_max=T - 1)
    _, cc, _ = check(case)
    assert cc.shape[2] == T - 1


def test_without_records_matches_oracle():
    check(make_case(8, 8, 12, seed=12, T_max=None))


@pytest.mark.parametrize("B,varlen", [(3, False), (6, True), (64, True)], ids=["B3", "varlen-B6", "varlen-B64"])
def test_fp32_checkpoint_matches_oracle(B, varlen):
    # vLLM's default checkpoint dtype: split into bf16 hi + lo MMA operands, the same output tolerance; the tile-64
    # builds (B=3, 6) and the 4-CTA build (B=64 varlen at H=24: 1536 pairs)
    H = 24 if (varlen and B == 64) else 12
    lengths = ([8, 3, 0, 8, 11, 1] * 11)[:B] if varlen else None
    check(make_case(B, 8, H, seed=30 + B, lengths=lengths, pool_dtype=torch.float32))


def test_softplus_gate_without_dt_bias_matches_oracle():
    check(make_case(3, 8, 12, seed=13, gate="softplus", dt_bias=False))


@pytest.mark.parametrize("policy", [NullSlotPolicy.OUT_OF_RANGE, NullSlotPolicy.NONPOSITIVE])
def test_null_rows_write_nothing(policy):
    # slots -1 and the pool's size are null under both policies, 0 only under NONPOSITIVE (where slot 0's records
    # and pool row must stay untouched)
    n_slots = 13
    slots = torch.tensor([3, -1, 0, 7, n_slots, 5, 1, 12], dtype=torch.int32, device="cuda")
    case = make_case(8, 8, 12, seed=14, n_slots=n_slots, slots=slots)
    out, cc, kg = check(case, null_policy=policy)
    nulls = [1, 4] + ([2] if policy is NullSlotPolicy.NONPOSITIVE else [])
    assert bool((out[nulls] == 0).all())
    if policy is NullSlotPolicy.NONPOSITIVE:
        assert bool((cc[0] == CORR_SENTINEL).all()) and bool((kg[0] == KG_SENTINEL).all())


def test_int64_strided_slots_and_one_past_2_to_32_is_null():
    # the slots as a column of a wider int64 table; 2^32 + 2 would wrap into the pool as an int32
    B = 6
    table = torch.zeros(B, 3, dtype=torch.int64, device="cuda")
    table[:, 1] = torch.tensor([4, 2**32 + 2, 9, 0, 11, 6])
    slots = table[:, 1]
    assert slots.stride(0) == 3
    case = make_case(B, 8, 12, seed=15, n_slots=15, slots=torch.zeros(B, dtype=torch.int32))
    out, _, _ = check(case, slots=slots)
    assert bool((out[1] == 0).all())


def test_unaligned_pool_stride_takes_the_element_wide_variant():
    # a slot stride of row + 17 elements: not a multiple of 16 bytes
    case = make_case(3, 8, 12, seed=16, pool_row_pad=17)
    check(case, aligned=False)


@pytest.mark.parametrize("T,cu_dtype", [(4, torch.int32), (8, torch.int32), (8, torch.int64)],
                         ids=["T4-cu32", "T8-cu32", "T8-cu64"])  # fmt: skip
def test_varlen_rows_of_0_1_T_and_more_tokens(T, cu_dtype):
    # lengths 0, 1, T, T + 3 (only the first T run; the rest of the row's outputs are not written), 2, T, 3, and 5
    # tail tokens no row owns; with T_max = T - 1 a row of T tokens also leaves its last record unwritten. Row 4 is
    # null (zero outputs over its tokens, no records). The offsets are a strided view (a column of a wider table).
    lengths = [0, 1, T, T + 3, 2, T, 3]
    case = make_case(len(lengths), T, 12, seed=17 + T, lengths=lengths, tail=5, T_max=T - 1, cu_dtype=cu_dtype,
                     slots=[3, 9, 0, 14, -1, 7, 2])  # fmt: skip
    table = torch.zeros(len(lengths) + 1, 2, dtype=cu_dtype, device="cuda")
    table[:, 0] = case.cu
    case.cu = table[:, 0]
    out, _, _ = check(case)
    bos = int(case.cu[4])
    assert bool((out[0, bos : bos + 2] == 0).all())


@pytest.mark.parametrize("T_max,pool_dtype", [("T", torch.bfloat16), ("T", torch.float32), (7, torch.bfloat16),
                                               (None, torch.bfloat16)],
                         ids=["records-bf16", "records-fp32", "T_max7", "no-records"])  # fmt: skip
def test_varlen_full_and_short_rows_in_the_three_cta_build(T_max, pool_dtype):
    # B=64 at H=12 (768 pairs) takes the tile-128 3-CTA build (vLLM's RecoverSSM verify at B=64), which solves a row
    # of T tokens (all recorded) in the unpredicated copy of phase 3 and the others in the masked one: full rows
    # beside rows of 0, 1, 3 and 11 tokens in one launch; with T_max = 7 no row is full (every row takes the masked
    # copy); without records a row of T tokens is full
    from kda_cute.ucache import UcacheVerifyFlush, select_config

    cfg = select_config(64, 12)
    assert UcacheVerifyFlush(12, 8, 0, cfg.tile_v, False, True, cfg.floor, ring=False, varlen=True).unmasked_full_rows()
    lengths = ([8, 3, 8, 0, 8, 11, 1, 8] * 8)[:64]
    check(make_case(64, 8, 12, seed=40, lengths=lengths, tail=3, T_max=T_max, pool_dtype=pool_dtype))


def test_varlen_offsets_are_clamped_to_the_tokens():
    # a last offset past the tokens clamps to them (and tokens 0, 1 before the first row are zeroed), a decreasing
    # one makes an empty row
    lengths = [3, 8, 2]
    case = make_case(3, 8, 12, seed=19, lengths=lengths, tail=0)
    case.cu = torch.tensor([2, 3, 11, 1 << 20], dtype=torch.int32, device="cuda")
    out, _, _ = check(case)
    assert bool((out[0, :2] == 0).all())
    case.cu = torch.tensor([0, 3, 2, 13], dtype=torch.int32, device="cuda")  # row 1 empty; row 2 [2, 13) as 8
    # (row 2 overlaps row 0's tokens: outputs are unspecified there, so compare the records and the pool only)
    pool_before = case.pool.clone()
    _, cc, kg = run_kernel(case)
    _, ref_cc, ref_kg, _ = run_oracle(case)
    torch.cuda.synchronize()
    assert torch.equal(case.pool, pool_before)
    written = ref_cc != CORR_SENTINEL
    torch.testing.assert_close(cc[written], ref_cc[written], **OUT_TOL)
    assert bool((cc[~written] == CORR_SENTINEL).all()) and torch.equal(kg, ref_kg)


def test_equals_the_ucache_step_with_an_empty_history_bitwise():
    # the no-ring build computes what the ring build computes at P = 0 (bdec = 1, no ring term), with the same
    # schedule: identical outputs
    from kda_core.contracts import RING_SLOTS
    from kda_cute.ucache import ucache_verify_flush

    B, T, H = 8, 8, 12
    case = make_case(B, T, H, seed=20, T_max=None)
    out, _, _ = run_kernel(case)
    N = case.pool.shape[0]
    ring = lambda dt: torch.zeros(N, H, RING_SLOTS, K, dtype=dt, device="cuda")  # noqa: E731
    zeros = torch.zeros(B, dtype=torch.int32, device="cuda")
    ref = torch.empty_like(out)
    pool = case.pool.clone()
    ucache_verify_flush(case.A_log, case.g, case.dt_bias, case.lower_bound, case.q, case.k, case.v, case.b, pool,
                        case.slots, ring(torch.bfloat16), ring(torch.bfloat16), ring(torch.float32), zeros,
                        zeros.clone(), 9, 16, K**-0.5, ref)  # fmt: skip
    torch.cuda.synchronize()
    assert torch.equal(out, ref)


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_graph_replay_is_bitwise_equal_to_eager(varlen):
    case = make_case(6, 8, 12, seed=21, lengths=[8, 3, 0, 8, 11, 1] if varlen else None)
    eager = run_kernel(case)
    out = torch.full_like(case.q, OUT_SENTINEL)
    records = case.records()
    run_kernel(case)  # compiled and loaded before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_kernel(case, output=out, records=records)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager[0])
    assert torch.equal(records[0], eager[1]) and torch.equal(records[1], eager[2])


def test_an_empty_batch_returns_at_once():
    from kda_cute.ucache import frozen_verify

    case = make_case(1, 8, 12, seed=22)
    out = torch.empty(0, 8, 12, K, dtype=torch.bfloat16, device="cuda")
    empty = torch.empty(0, 8, 12, K, dtype=torch.bfloat16, device="cuda")
    res = frozen_verify(case.A_log, empty, case.dt_bias, -5.0, empty, empty, empty, empty[..., 0], case.pool,
                        torch.empty(0, dtype=torch.int32, device="cuda"), K**-0.5, out)  # fmt: skip
    assert res is out
