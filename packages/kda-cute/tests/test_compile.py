"""CPU compile checks: every T=1 decode variant builds for sm_90a and sm_100a, and none spills registers.

Packed variants (``packed=True``: the host wrapper that builds the q/k/v/g/beta views from the GEMM rows) launch the
same kernel; they are compiled and spill-checked like the unpacked ones.

No GPU needed (``CUTE_DSL_ARCH`` is set by conftest; ``--gpu-arch`` picks the target per compile).
The structural axes (pool dtype x gate x alignment) are crossed in full at tiles 16 and 128, the other tiles (rows
per thread) with each pool dtype and alignment under the lower-bound gate; the small const_expr flags (beta logit,
in-kernel L2 norm, dt_bias, fp32 g / beta) are each flipped on a fixed base.
"""

from __future__ import annotations

import itertools
import re
import shutil

import pytest
import torch

ARCHS = ("sm_90a", "sm_100a")
TILES = (8, 16, 32, 64, 128)
# A thread holds tile_v / 8 rows (at most the rows in flight at once), so tile 128 is every variant's register
# high-water mark (the realigning one's, sm_90a: 72 at 16, 138 at 128) and 16 the small tiles' code shape; the spill
# checks run there, every tile compiles in test_decode_t1_variant_compiles (CI time: 2-core machine).
SPILL_TILES = (16, 128)


def _field(key, name):
    """The ``name`` entry of a variant key (the key's order is variant_key's signature)."""
    from kda_cute import decode_t1

    return key[decode_t1.variant_key.__code__.co_varnames.index(name)]


def _variants():
    from kda_core.contracts import GateMode, NullSlotPolicy

    base = dict(state_dtype=torch.bfloat16, g_dtype=torch.bfloat16, beta_dtype=torch.bfloat16,
                gate=GateMode.LOWER_BOUND, beta_is_logit=True, use_qk_l2norm=True, has_dt_bias=True, tile_v=32,
                aligned=True)
    out = []
    # The gate changes only the preamble, the tile only the rows per thread: the gates are crossed with the pool
    # dtypes and alignments at tile 16 (the small tiles' code shape) and 128 (the register high-water mark), the
    # other tiles under one gate (the full cross product is 24 more sm_90a compiles, about 1.3 s each on CI's
    # 2-core machine).
    for sd, gate, tile, aligned in itertools.product((torch.bfloat16, torch.float32), tuple(GateMode), SPILL_TILES,
                                                      (True, False)):
        out.append({**base, "state_dtype": sd, "gate": gate, "tile_v": tile, "aligned": aligned})
    for sd, tile, aligned in itertools.product((torch.bfloat16, torch.float32), [t for t in TILES if t not in
                                                                                  SPILL_TILES], (True, False)):
        out.append({**base, "state_dtype": sd, "tile_v": tile, "aligned": aligned})
    # Tuning variants: every row of the tile in flight, and the non-streaming cache operators.
    for sd, tile, rif, hint in itertools.product((torch.bfloat16, torch.float32), (64, 128), (16,),
                                                 ("stream", "global")):
        out.append({**base, "state_dtype": sd, "tile_v": tile, "rows_in_flight": rif, "cache_hint": hint})
    for flag in (dict(beta_is_logit=False), dict(use_qk_l2norm=False), dict(has_dt_bias=False),
                 dict(g_dtype=torch.float32, gate=GateMode.PRECOMPUTED), dict(beta_dtype=torch.float32)):
        out.append({**base, **flag})
    # The packed entry's host wrapper (views built in the traced host code) around the same kernel: every gate and
    # pool dtype in both alignment classes, the fp32 precomputed gate and beta, the all-rows tile.
    for sd, gate, aligned in itertools.product((torch.bfloat16, torch.float32), tuple(GateMode), (True, False)):
        out.append({**base, "state_dtype": sd, "gate": gate, "aligned": aligned, "packed": True})
    for flag in (dict(g_dtype=torch.float32, beta_dtype=torch.float32, gate=GateMode.PRECOMPUTED, beta_is_logit=False),
                 dict(tile_v=128, rows_in_flight=16, cache_hint="global"),
                 dict(tile_v=8, aligned=False)):
        out.append({**base, **flag, "packed": True})
    # Bulk ring (aligned variants), tile 128: both pool dtypes at three depths (fp32 16 is capped at 11 by shared
    # memory), every gate, and the packed wrapper around it.
    for sd, ring in itertools.product((torch.bfloat16, torch.float32), (2, 8, 16)):
        out.append({**base, "state_dtype": sd, "tile_v": 128, "bulk_ring": ring})
    for gate in GateMode:
        out.append({**base, "gate": gate, "tile_v": 128, "bulk_ring": 4})
    for sd in (torch.bfloat16, torch.float32):
        out.append({**base, "state_dtype": sd, "tile_v": 128, "bulk_ring": 4, "packed": True})
    # The slot-major grid (tile 128, aligned): around the ring (both pool dtypes, packed or not) and the register path.
    for sd, packed in itertools.product((torch.bfloat16, torch.float32), (False, True)):
        out.append({**base, "state_dtype": sd, "tile_v": 128, "bulk_ring": 8, "slot_major": True, "packed": packed})
    out.append({**base, "tile_v": 128, "slot_major": True})
    # The smaller tiles' rings (their rows are one contiguous run too; depth capped at the tile's chunks).
    for sd, tile in itertools.product((torch.bfloat16, torch.float32), (32, 64)):
        out.append({**base, "state_dtype": sd, "tile_v": tile, "bulk_ring": 8})
    # The NONPOSITIVE null policy (slot 0 is null) on each grid and staging: a few representatives.
    nonpositive = {"null_policy": NullSlotPolicy.NONPOSITIVE}
    for flag in (dict(tile_v=16), dict(tile_v=64, aligned=False), dict(tile_v=128, bulk_ring=8),
                 dict(state_dtype=torch.float32, tile_v=128, bulk_ring=8, slot_major=True, packed=True),
                 dict(tile_v=128, slot_major=True)):
        out.append({**base, **flag, **nonpositive})
    # int64 slot indices (read as they are, compared in 64 bits): each grid and staging, both entries.
    for flag in (dict(tile_v=16), dict(tile_v=32, aligned=False, packed=True), dict(tile_v=128, bulk_ring=8),
                 dict(state_dtype=torch.float32, tile_v=128, bulk_ring=8, slot_major=True, packed=True),
                 dict(tile_v=128, slot_major=True, **nonpositive)):
        out.append({**base, **flag, "index_dtype": torch.int64})
    # The varlen form (tokens [1, T, H, 128] + cu_seqlens): the T=1 path plus the token loop (tile 16 and the rings
    # are in test_varlen_variant_does_not_spill).
    for flag in (dict(tile_v=64, aligned=False),
                 dict(state_dtype=torch.float32, tile_v=128, rows_in_flight=16, cache_hint="global", aligned=False),
                 dict(gate=GateMode.PRECOMPUTED, g_dtype=torch.float32, beta_dtype=torch.float32, beta_is_logit=False,
                      index_dtype=torch.int64, **nonpositive)):
        out.append({**base, **flag, "cu_dtype": torch.int32})
    out.append({**base, "state_dtype": torch.float32, "tile_v": 128, "bulk_ring": 8, "cu_dtype": torch.int64})
    # The packed entry's token form (vLLM Kimi K3's [1, B, ...] gate, beta and output, read as they are): both pool
    # dtypes in both alignment classes, the fp32 precomputed gate and beta, the slot-major ring with int64
    # NONPOSITIVE slots.
    tokens = {"packed": "tokens"}
    for sd, aligned in itertools.product((torch.bfloat16, torch.float32), (True, False)):
        out.append({**base, "state_dtype": sd, "aligned": aligned, **tokens})
    out.append({**base, "g_dtype": torch.float32, "beta_dtype": torch.float32, "gate": GateMode.PRECOMPUTED,
                "beta_is_logit": False, **tokens})
    out.append({**base, "state_dtype": torch.float32, "tile_v": 128, "bulk_ring": 8, "slot_major": True,
                "index_dtype": torch.int64, **nonpositive, **tokens})
    # The pool-realigning variant (the pool in aligned vectors whatever its slot stride): every tile of both pool
    # dtypes, each entry, the null policy, int64 indices, the varlen form, its ring (from 3 chunks deep); a requested
    # slot-major grid is normalised away.
    realign = {"realign_pool": True}
    for sd, tile in itertools.product((torch.bfloat16, torch.float32), TILES):
        out.append({**base, "state_dtype": sd, "tile_v": tile, **realign})
    for flag in (dict(packed=True), dict(packed="tokens", state_dtype=torch.float32), dict(tile_v=128, bulk_ring=8),
                 dict(state_dtype=torch.float32, tile_v=64, bulk_ring=8, packed="tokens"),
                 dict(aligned=False, tile_v=128, bulk_ring=8, packed=True),
                 dict(state_dtype=torch.float32, tile_v=128, rows_in_flight=16, cache_hint="global"),
                 dict(gate=GateMode.PRECOMPUTED, g_dtype=torch.float32, beta_dtype=torch.float32, beta_is_logit=False),
                 dict(index_dtype=torch.int64, **nonpositive), dict(tile_v=64, cu_dtype=torch.int32),
                 dict(state_dtype=torch.float32, tile_v=16, cu_dtype=torch.int64, **nonpositive),
                 # the other tensors misaligned too (element-wise activations and output): the entries' unaligned calls
                 dict(aligned=False, tile_v=16), dict(aligned=False, state_dtype=torch.float32, tile_v=128,
                                                      rows_in_flight=16, cache_hint="global"),
                 dict(aligned=False, packed=True, tile_v=64), dict(aligned=False, packed="tokens", tile_v=128),
                 dict(aligned=False, tile_v=32, cu_dtype=torch.int32)):
        out.append({**base, **flag, **realign})
    return out


def _ident(v):
    align = "realign" if v.get("realign_pool") else "al" if v["aligned"] else "unal"
    return (f"{str(v['state_dtype'])[6:]}-{v['gate'].value}-tv{v['tile_v']}-{align}"
            f"{'-rif%d' % v['rows_in_flight'] if v.get('rows_in_flight') else ''}"
            f"{'-' + v['cache_hint'] if v.get('cache_hint', 'stream') != 'stream' else ''}"
            f"{'-bulk%d' % v['bulk_ring'] if v.get('bulk_ring') else ''}"
            f"{'-slotmajor' if v.get('slot_major') else ''}"
            f"{'' if v['beta_is_logit'] else '-sigbeta'}{'' if v['use_qk_l2norm'] else '-nonorm'}"
            f"{'' if v['has_dt_bias'] else '-nobias'}-g{str(v['g_dtype'])[6:]}-b{str(v['beta_dtype'])[6:]}"
            f"{('-tokens' if v.get('packed') == 'tokens' else '-packed') if v.get('packed') else ''}"
            f"{'-' + v['null_policy'].value if 'null_policy' in v else ''}"
            f"{'-idx64' if v.get('index_dtype') is torch.int64 else ''}"
            f"{'-varlen-' + str(v['cu_dtype'])[6:] if v.get('cu_dtype') else ''}")


VARIANTS = _variants()


@pytest.mark.sm100_share(lambda params, indices: VARIANTS.index(params["variant"]) % 4 == 0)  # see conftest
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", VARIANTS, ids=[_ident(v) for v in VARIANTS])
def test_decode_t1_variant_compiles(variant, arch):
    from kda_cute import decode_t1

    key = decode_t1.variant_key(**variant)
    assert decode_t1.compile_variant(key, arch) is not None


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not on PATH")
@pytest.mark.sm100_share(lambda params, indices: params["tile_v"] == 128)  # see conftest
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("tile_v", SPILL_TILES)
@pytest.mark.parametrize("aligned, rows_in_flight, packed, realign_pool",
                         [(True, 0, False, False), (False, 0, False, False), (True, 16, False, False),
                          (True, 0, True, False), (False, 0, True, False), (True, 0, False, True),
                          (True, 16, False, True), (False, 0, False, True), (False, 16, True, True)],
                         ids=["aligned", "unaligned", "allrows", "packed", "packed-unaligned", "realign",
                              "realign-allrows", "realign-unaligned", "realign-unaligned-allrows-packed"])
def test_decode_t1_variant_does_not_spill(tile_v, state_dtype, aligned, rows_in_flight, packed, realign_pool, arch,
                                          tmp_path, ptxas):
    from kda_core.contracts import GateMode
    from kda_cute import decode_t1

    # The softplus gate is the longest preamble (log1p + exp per channel): the register high-water mark.
    key = decode_t1.variant_key(state_dtype=state_dtype, g_dtype=torch.bfloat16, beta_dtype=torch.bfloat16,
                                gate=GateMode.SOFTPLUS, beta_is_logit=True, use_qk_l2norm=True, has_dt_bias=True,
                                tile_v=tile_v, aligned=aligned, rows_in_flight=rows_in_flight, packed=packed,
                                realign_pool=realign_pool)
    decode_t1.compile_variant(key, arch, ptxas.keep(tmp_path))
    ptx = sorted(tmp_path.glob("*.ptx"))
    assert ptx, "no PTX kept"
    report = ptxas.report(ptx[0], arch)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills, report
    assert all(int(s) == 0 and int(ld) == 0 for s, ld in spills), report
    stack = re.findall(r"(\d+) bytes stack frame", report)
    assert all(int(x) == 0 for x in stack), report


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not on PATH")
@pytest.mark.sm100_share(lambda params, indices: params["bulk_ring"] in (8, 16) and params["tile_v"] == 128)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("tile_v, bulk_ring, packed",
                         [(128, 2, False), (128, 4, False), (128, 8, False), (128, 16, False), (128, 8, True),
                          (64, 8, False), (32, 4, False)],
                         ids=["ring2", "ring4", "ring8", "ring16", "ring8-packed", "tile64-ring8", "tile32-ring4"])
def test_bulk_ring_variant_does_not_spill(tile_v, bulk_ring, packed, state_dtype, arch, tmp_path, ptxas):
    """The bulk ring keeps no state row in registers: it must fit well under the register path's 126 (measured 64-72
    on both archs), with no spill and no stack frame."""
    from kda_core.contracts import GateMode
    from kda_cute import decode_t1

    key = decode_t1.variant_key(state_dtype=state_dtype, g_dtype=torch.bfloat16, beta_dtype=torch.bfloat16,
                                gate=GateMode.SOFTPLUS, beta_is_logit=True, use_qk_l2norm=True, has_dt_bias=True,
                                tile_v=tile_v, aligned=True, bulk_ring=bulk_ring, packed=packed)
    assert _field(key, "bulk_ring") == decode_t1.bulk_ring_for(tile_v, state_dtype.itemsize, True, bulk_ring) > 0
    decode_t1.compile_variant(key, arch, ptxas.keep(tmp_path))
    ptx = sorted(tmp_path.glob("*.ptx"))
    assert ptx, "no PTX kept"
    text = ptx[0].read_text()
    assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in text
    assert "cp.async.bulk.global.shared::cta" in text and "fence.proxy.async.shared::cta" in text
    registers, spills = ptxas.registers_and_spills(ptx[0], arch)
    assert spills == 0 and registers <= 96, (registers, spills)
    report = ptxas.report(ptx[0], arch)
    assert all(int(x) == 0 for x in re.findall(r"(\d+) bytes stack frame", report)), report


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not on PATH")
@pytest.mark.sm100_share(lambda params, indices: params["tile_v"] == 128 and not params["cu_dtype"])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("tile_v, bulk_ring, packed, cu_dtype, gate",
                         [(128, 8, True, None, "softplus"), (32, 3, False, None, "softplus"),
                          (128, 8, False, torch.int32, "softplus"), (128, 8, False, torch.int32, "kimi-linear"),
                          (128, 8, False, torch.int32, "lower-bound")],
                         ids=["ring8-packed", "tile32-ring3", "ring8-varlen", "ring8-varlen-kimi-linear",
                              "ring8-varlen-lower-bound"])
def test_realigning_ring_variant_does_not_spill(tile_v, bulk_ring, packed, cu_dtype, gate, state_dtype, arch,
                                                tmp_path, ptxas):
    """The pool-realigning variant's ring (any slot stride): chunk 0's bulk copies one vector short (the run's head
    vector is lane 0's, in pieces), each chunk waited for one step early by the row that writes its first vector, and
    the realigned coefficients; no spill, no stack frame, and the aligned ring's occupancy: at most 80 registers
    (measured 2026-12-06, sm_90a / sm_100a: tile 128 72 / 72 both dtypes, tile 32 56 / 56-63), the varlen build at most
    104 (softplus, bf16 96 / 86, fp32 77 / 80); the bf16 merges of lane 0's straddling vector by 32-bit word
    (``blend_head``) keep it there (a select per 16-bit element: 92-93 at tile 128, 122 varlen). ``kimi-linear``: the
    build vLLM Kimi-Linear's decode call takes from the ring batch sizes on (fp32 log decay and beta, slot 0 null), at
    most the plain builds' 80 (measured 2026-12-07, sm_90a / sm_100a: fp32 74 / 74 with the token loop's rows rolled,
    88 / 96 unrolled; bf16 75 / 75 unrolled: docs/decode_t1.md, "Varlen form"). ``lower-bound``: the facade's varlen
    call with Kimi K3's gate (bf16 raw gate and beta, in-kernel lower-bound gate), whose bf16 build spilled 64 / 704
    bytes with the token loop unrolled (rolled: 96 / 94; the fp32 build runs unrolled, 94 / 96)."""
    from kda_core.contracts import GateMode, NullSlotPolicy
    from kda_cute import decode_t1

    gate = {"kimi-linear": dict(g_dtype=torch.float32, beta_dtype=torch.float32, gate=GateMode.PRECOMPUTED,
                                beta_is_logit=False, has_dt_bias=False, null_policy=NullSlotPolicy.NONPOSITIVE),
            "softplus": dict(g_dtype=torch.bfloat16, beta_dtype=torch.bfloat16, gate=GateMode.SOFTPLUS,
                             beta_is_logit=True, has_dt_bias=True),
            "lower-bound": dict(g_dtype=torch.bfloat16, beta_dtype=torch.bfloat16, gate=GateMode.LOWER_BOUND,
                                beta_is_logit=True, has_dt_bias=True)}[gate]
    key = decode_t1.variant_key(state_dtype=state_dtype, use_qk_l2norm=True, tile_v=tile_v, aligned=True,
                                bulk_ring=bulk_ring, packed=packed, cu_dtype=cu_dtype, realign_pool=True, **gate)
    assert _field(key, "bulk_ring") == bulk_ring and _field(key, "realign_pool") is True
    decode_t1.compile_variant(key, arch, ptxas.keep(tmp_path))
    (ptx,) = sorted(tmp_path.glob("*.ptx"))
    text = ptx.read_text()
    n_chunks = tile_v // decode_t1.BULK_CHUNK_ROWS
    chunk = decode_t1.BULK_CHUNK_ROWS * 128 * state_dtype.itemsize
    consts = dict(re.findall(r"mov\.b32 \s*(%r\d+), (\d+);", text))

    def sizes(op):  # the byte count of every bulk copy of this kind (an immediate or a register set to one)
        found = re.findall(op + r" \[[^]]+\], \[[^]]+\], ([^,;]+)", text)
        return sorted(int(consts.get(x.strip(), x)) for x in found)

    # every chunk stored once, chunk 0 one vector short (its first vector is the run's head: lane 0's, in pieces)
    assert sizes(r"cp\.async\.bulk\.global\.shared::cta\.bulk_group") == [chunk - 16] + [chunk] * (n_chunks - 1)
    loads = sizes(r"cp\.async\.bulk\.shared::cluster\.global\.mbarrier::complete_tx::bytes")
    assert loads == [chunk - 16] + [chunk] * (n_chunks - 1), loads
    # each chunk waited for by every thread, and every chunk after the first one step early by row 7's lane 0
    assert text.count("mbarrier.try_wait") >= 2 * n_chunks - 1
    registers, spills = ptxas.registers_and_spills(ptx, arch)
    bound = 80 if not cu_dtype or gate["gate"] is GateMode.PRECOMPUTED else 104
    assert spills == 0 and registers <= bound, (registers, spills)
    report = ptxas.report(ptx, arch)
    assert all(int(x) == 0 for x in re.findall(r"(\d+) bytes stack frame", report)), report


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not on PATH")
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("bulk_ring, packed", [(8, False), (8, True), (0, False)],
                         ids=["ring8", "ring8-packed", "regs"])
def test_slot_major_variant_does_not_spill(bulk_ring, packed, state_dtype, arch, tmp_path, ptxas):
    """The slot-major grid adds the slot scan (8 loads per thread in flight, warp redux, one CTA barrier) and the zero
    stores of the rows it answers for: still no spill and no stack frame, and the bulk ring stays under 96
    registers. Its PTX has the scan's redux and the CTA-uniform loop over the batch (absent without it)."""
    from kda_core.contracts import GateMode
    from kda_cute import decode_t1

    kwargs = dict(state_dtype=state_dtype, g_dtype=torch.bfloat16, beta_dtype=torch.bfloat16, gate=GateMode.SOFTPLUS,
                  beta_is_logit=True, use_qk_l2norm=True, has_dt_bias=True, tile_v=128, aligned=True,
                  bulk_ring=bulk_ring, packed=packed)
    key = decode_t1.variant_key(**kwargs, slot_major=True)
    assert _field(key, "slot_major") is True
    assert _field(decode_t1.variant_key(**kwargs), "slot_major") is False
    decode_t1.compile_variant(key, arch, ptxas.keep(tmp_path))
    ptx = sorted(tmp_path.glob("*.ptx"))
    assert ptx, "no PTX kept"
    text = ptx[0].read_text()
    assert "redux.sync.min.s32" in text and "redux.sync.max.s32" in text
    registers, spills = ptxas.registers_and_spills(ptx[0], arch)
    assert spills == 0 and (registers <= 96 or not bulk_ring), (registers, spills)
    report = ptxas.report(ptx[0], arch)
    assert all(int(x) == 0 for x in re.findall(r"(\d+) bytes stack frame", report)), report


def test_slot_major_normalised_to_its_static_conditions():
    """slot_major only exists for tile 128 in the aligned class (the key says so, and the policy never asks else)."""
    from kda_core.contracts import GateMode
    from kda_cute import decode_t1

    base = dict(state_dtype=torch.bfloat16, g_dtype=torch.bfloat16, beta_dtype=torch.bfloat16,
                gate=GateMode.LOWER_BOUND, beta_is_logit=True, use_qk_l2norm=True, has_dt_bias=True, slot_major=True)
    assert _field(decode_t1.variant_key(**base, tile_v=128, aligned=True), "slot_major") is True
    assert _field(decode_t1.variant_key(**base, tile_v=64, aligned=True), "slot_major") is False
    assert _field(decode_t1.variant_key(**base, tile_v=128, aligned=False), "slot_major") is False


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not on PATH")
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("tile_v, bulk_ring, slot_major", [(16, 0, False), (128, 8, True)],
                         ids=["tile16", "slot_major_ring8"])
def test_nonpositive_null_policy_reaches_the_kernel_without_spills(tile_v, bulk_ring, slot_major, state_dtype, arch,
                                                                   tmp_path, ptxas):
    """The NONPOSITIVE variant generates other code than OUT_OF_RANGE's (the slot check's low bound; on the slot-major
    grid also the pool-row CTA's) and stays within a few instructions of it: no spill, no stack frame, at most one
    ptxas allocation step (8 registers) more (measured: the same count, except fp32 slot-major ring on sm_90a, 72 ->
    80, where shared memory already caps residency at 6 CTAs)."""
    from kda_core.contracts import GateMode, NullSlotPolicy
    from kda_cute import decode_t1

    kwargs = dict(state_dtype=state_dtype, g_dtype=torch.bfloat16, beta_dtype=torch.bfloat16, gate=GateMode.SOFTPLUS,
                  beta_is_logit=True, use_qk_l2norm=True, has_dt_bias=True, tile_v=tile_v, aligned=True,
                  bulk_ring=bulk_ring, slot_major=slot_major)
    found = {}
    for policy in NullSlotPolicy:
        out = tmp_path / policy.value
        out.mkdir()
        decode_t1.compile_variant(decode_t1.variant_key(**kwargs, null_policy=policy), arch,
                                  ptxas.keep(out))
        (ptx,) = sorted(out.glob("*.ptx"))
        report = ptxas.report(ptx, arch)
        assert all(int(x) == 0 for x in re.findall(r"(\d+) bytes stack frame", report)), report
        body = ptx.read_text()
        found[policy] = (ptxas.registers_and_spills(ptx, arch), body[body.index(".entry"):])
    (regs_oor, spills_oor), text_oor = found[NullSlotPolicy.OUT_OF_RANGE]
    (regs_np, spills_np), text_np = found[NullSlotPolicy.NONPOSITIVE]
    assert spills_oor == spills_np == 0
    assert text_np != text_oor
    assert regs_np <= regs_oor + 8, (regs_np, regs_oor)


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not on PATH")
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tile_v, bulk_ring, slot_major", [(16, 0, False), (128, 8, True)],
                         ids=["tile16", "slot_major_ring8"])
def test_int64_slot_indices_are_compared_in_64_bits_without_spills(tile_v, bulk_ring, slot_major, arch, tmp_path,
                                                                   ptxas):
    """The int64 variant compares the slot with N (batch-major) or the pool row (slot-major scan) in 64 bits, so a
    value past 2^31 is never truncated onto a live slot; no spill, no stack frame."""
    from kda_core.contracts import GateMode
    from kda_cute import decode_t1

    key = decode_t1.variant_key(state_dtype=torch.bfloat16, g_dtype=torch.bfloat16, beta_dtype=torch.bfloat16,
                                gate=GateMode.SOFTPLUS, beta_is_logit=True, use_qk_l2norm=True, has_dt_bias=True,
                                tile_v=tile_v, aligned=True, bulk_ring=bulk_ring, slot_major=slot_major,
                                index_dtype=torch.int64)
    decode_t1.compile_variant(key, arch, ptxas.keep(tmp_path))
    (ptx,) = sorted(tmp_path.glob("*.ptx"))
    text = ptx.read_text()
    assert re.search(r"setp\.eq\.[bs]64" if slot_major else r"setp\.lt\.s64", text)
    registers, spills = ptxas.registers_and_spills(ptx, arch)
    assert spills == 0, (registers, spills)
    report = ptxas.report(ptx, arch)
    assert all(int(x) == 0 for x in re.findall(r"(\d+) bytes stack frame", report)), report


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not on PATH")
@pytest.mark.sm100_share(lambda params, indices: params["state_dtype"] is torch.float32)  # see conftest
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("state_dtype, tile_v, bulk_ring, aligned",
                         [(torch.bfloat16, 16, 0, True), (torch.bfloat16, 128, 8, True), (torch.float32, 128, 8, True),
                          (torch.float32, 128, 0, False)],
                         ids=["bf16-tile16", "bf16-ring8", "fp32-ring8", "fp32-tile128-unaligned"])
def test_varlen_variant_does_not_spill(state_dtype, tile_v, bulk_ring, aligned, arch, tmp_path, ptxas):
    """The varlen kernel holds the one-token path and the token loop: no spill, no stack frame (measured 76-128
    registers aligned, the unaligned tile-128 register path 168-243 as without the loop)."""
    from kda_core.contracts import GateMode
    from kda_cute import decode_t1

    key = decode_t1.variant_key(state_dtype=state_dtype, g_dtype=torch.bfloat16, beta_dtype=torch.bfloat16,
                                gate=GateMode.SOFTPLUS, beta_is_logit=True, use_qk_l2norm=True, has_dt_bias=True,
                                tile_v=tile_v, aligned=aligned, bulk_ring=bulk_ring, cu_dtype=torch.int32)
    decode_t1.compile_variant(key, arch, ptxas.keep(tmp_path))
    (ptx,) = sorted(tmp_path.glob("*.ptx"))
    registers, spills = ptxas.registers_and_spills(ptx, arch)
    assert spills == 0, (registers, spills)
    report = ptxas.report(ptx, arch)
    assert all(int(x) == 0 for x in re.findall(r"(\d+) bytes stack frame", report)), report


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not on PATH")
def test_varlen_fast_path_holds_the_plain_builds_registers(tmp_path, ptxas):
    """vLLM Kimi-Linear's decode call (`[1, N]` + cu_seqlens, fp32 gate and beta, slot 0 null) on a bf16 `+17` pool:
    the varlen build of the pool-realigning variant at tile 128 holds no more registers than the plain T=1 build
    (one allocation step of slack), so its one-token path runs at the plain build's occupancy. Measured (sm_90a):
    142 against 142; 182 with the edge tokens' zeros written after the state stream (the fp32 build keeps that
    order, measured faster there: 147 registers against the plain build's 126)."""
    from kda_core.contracts import GateMode, NullSlotPolicy
    from kda_cute import decode_t1

    state_dtype = torch.bfloat16

    found = {}
    for form, cu_dtype in (("plain", None), ("varlen", torch.int32)):
        key = decode_t1.variant_key(state_dtype=state_dtype, g_dtype=torch.float32, beta_dtype=torch.float32,
                                    gate=GateMode.PRECOMPUTED, beta_is_logit=False, use_qk_l2norm=True,
                                    has_dt_bias=False, tile_v=128, aligned=True, realign_pool=True,
                                    null_policy=NullSlotPolicy.NONPOSITIVE, cu_dtype=cu_dtype)
        (tmp_path / form).mkdir()
        decode_t1.compile_variant(key, "sm_90a", ptxas.keep(tmp_path / form))
        (ptx,) = sorted((tmp_path / form).glob("*.ptx"))
        found[form] = ptxas.registers_and_spills(ptx, "sm_90a")
    assert found["varlen"][1] == 0 and found["plain"][1] == 0, found
    assert found["varlen"][0] <= found["plain"][0] + 8, found
