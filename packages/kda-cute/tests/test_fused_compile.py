"""CPU compile checks of the fused decode layer kernel: its variants build for sm_90a and sm_100a, the main ones
without a register spill or a stack frame, and the schedule / variant key normalise as documented.

No GPU needed (``CUTE_DSL_ARCH`` is set by conftest; ``--gpu-arch`` picks the target per compile). The structural
axes (pool dtype x gate x alignment) are crossed in full; the staging (register rows in flight, cache hint, bulk
ring), the null policy, the index dtype and the optional bias / dt_bias are flipped on a fixed base.
"""

from __future__ import annotations

import itertools
import re
import shutil

import pytest
import torch

ARCHS = ("sm_90a", "sm_100a")


def _variants():
    from kda_core.contracts import GateMode, NullSlotPolicy

    base = dict(state_dtype=torch.bfloat16, gate=GateMode.LOWER_BOUND, has_dt_bias=True, has_bias=False,
                aligned=True)
    out = []
    for sd, gate, aligned in itertools.product((torch.bfloat16, torch.float32),
                                               (GateMode.LOWER_BOUND, GateMode.SOFTPLUS), (True, False)):
        out.append({**base, "state_dtype": sd, "gate": gate, "aligned": aligned})
    for sd in (torch.bfloat16, torch.float32):
        out.append({**base, "state_dtype": sd, "bulk_ring": 8})
    out.append({**base, "gate": GateMode.SOFTPLUS, "bulk_ring": 4})
    out.append({**base, "state_dtype": torch.float32, "rows_in_flight": 16, "cache_hint": "global"})
    oor = {"null_policy": NullSlotPolicy.OUT_OF_RANGE}
    out.append({**base, **oor})
    out.append({**base, "state_dtype": torch.float32, "bulk_ring": 8, **oor})
    out.append({**base, "index_dtype": torch.int64})
    out.append({**base, "state_dtype": torch.float32, "bulk_ring": 8, "index_dtype": torch.int64})
    out.append({**base, "aligned": False, "index_dtype": torch.int64, **oor})
    out.append({**base, "has_bias": True, "has_dt_bias": False})
    out.append({**base, "state_dtype": torch.float32, "bulk_ring": 8, "has_bias": True})
    # The cluster variant (small B*H): every cluster size on the base, then its structural axes on one size.
    for c in (2, 4, 8):
        out.append({**base, "cluster": c})
    out.append({**base, "state_dtype": torch.float32, "gate": GateMode.SOFTPLUS, "cluster": 8})
    out.append({**base, "aligned": False, "cluster": 4})
    out.append({**base, "state_dtype": torch.float32, "cluster": 4, "index_dtype": torch.int64, **oor})
    out.append({**base, "has_bias": True, "has_dt_bias": False, "cluster": 8, **oor})
    # vLLM's native op forms: no gated RMSNorm, the DS conv layout (column stride 1), both, on each state path.
    nonorm, ds = {"has_norm": False}, {"conv_layout": "ds"}
    out.append({**base, "state_dtype": torch.float32, **nonorm})
    out.append({**base, "state_dtype": torch.float32, **ds})
    out.append({**base, "state_dtype": torch.float32, "gate": GateMode.SOFTPLUS, **nonorm, **ds})
    out.append({**base, "state_dtype": torch.float32, "bulk_ring": 8, **nonorm, **ds})
    out.append({**base, "aligned": False, "has_bias": True, **ds})
    out.append({**base, "cluster": 4, **nonorm})
    out.append({**base, "state_dtype": torch.float32, "cluster": 8, **nonorm, **ds})
    return out


def _ident(v):
    return (f"{str(v['state_dtype'])[6:]}-{v['gate'].value}-{'al' if v['aligned'] else 'unal'}"
            f"{'-rif%d' % v['rows_in_flight'] if v.get('rows_in_flight') else ''}"
            f"{'-' + v['cache_hint'] if v.get('cache_hint', 'stream') != 'stream' else ''}"
            f"{'-bulk%d' % v['bulk_ring'] if v.get('bulk_ring') else ''}"
            f"{'-' + v['null_policy'].value if 'null_policy' in v else ''}"
            f"{'-idx64' if v.get('index_dtype') is torch.int64 else ''}"
            f"{'-convbias' if v['has_bias'] else ''}{'' if v['has_dt_bias'] else '-nodtbias'}"
            f"{'-cluster%d' % v['cluster'] if v.get('cluster', 1) > 1 else ''}"
            f"{'' if v.get('has_norm', True) else '-nonorm'}{'-ds' if v.get('conv_layout') == 'ds' else ''}")


VARIANTS = _variants()


# Every other variant on sm_100a, by its place in VARIANTS (pytest's callspec indices count across both parameters).
@pytest.mark.sm100_share(lambda params, indices: VARIANTS.index(params["variant"]) % 2 == 0)  # see conftest
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", VARIANTS, ids=[_ident(v) for v in VARIANTS])
def test_fused_variant_compiles(variant, arch):
    from kda_cute import fused_decode

    key = fused_decode.variant_key(**variant)
    assert fused_decode.compile_variant(key, arch) is not None


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not on PATH")
@pytest.mark.sm100_share(lambda params, indices: params["state_dtype"] is torch.float32)  # see conftest
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("aligned, bulk_ring", [(True, 0), (True, 8), (False, 0)], ids=["regs", "ring8", "unaligned"])
def test_fused_variant_does_not_spill(state_dtype, aligned, bulk_ring, arch, tmp_path, ptxas):
    """The softplus gate and the conv bias are the longest preamble and phase 0: no spill, no stack frame (measured
    on sm_90a: 133-168 registers on the register path, 72 with the ring; the ring keeps no state row in registers
    and stays under 96, as the T=1 kernel's)."""
    from kda_core.contracts import GateMode
    from kda_cute import fused_decode

    key = fused_decode.variant_key(state_dtype=state_dtype, gate=GateMode.SOFTPLUS, has_dt_bias=True, has_bias=True,
                                   aligned=aligned, bulk_ring=bulk_ring)
    fused_decode.compile_variant(key, arch, ptxas.keep(tmp_path))
    (ptx,) = sorted(tmp_path.glob("*.ptx"))
    registers, spills = ptxas.registers_and_spills(ptx, arch)
    assert spills == 0 and (registers <= 96 or not bulk_ring), (registers, spills)
    report = ptxas.report(ptx, arch)
    assert all(int(x) == 0 for x in re.findall(r"(\d+) bytes stack frame", report)), report
    if bulk_ring:
        text = ptx.read_text()
        assert "cp.async.bulk.global.shared::cta" in text and "fence.proxy.async.shared::cta" in text


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not on PATH")
@pytest.mark.sm100_share(lambda params, indices: params["cluster"] == 8)  # see conftest
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("cluster", [2, 4, 8], ids=["cluster2", "cluster4", "cluster8"])
def test_fused_cluster_variant_does_not_spill(state_dtype, cluster, arch, tmp_path, ptxas):
    """The cluster variant with the longest preamble (softplus gate, conv bias): no spill, no stack frame; its PTX
    launches as a cluster, waits on the "started" cluster barrier and exchanges the RMSNorm's partials by st.async
    onto each CTA's mbarrier, with no release arrive (its MEMBAR waited for every store before it); the state rows
    are stored in the row stream, before that barrier's wait."""
    from kda_core.contracts import GateMode
    from kda_cute import fused_decode

    key = fused_decode.variant_key(state_dtype=state_dtype, gate=GateMode.SOFTPLUS, has_dt_bias=True, has_bias=True,
                                   aligned=True, cluster=cluster)
    fused_decode.compile_variant(key, arch, ptxas.keep(tmp_path))
    (ptx,) = sorted(tmp_path.glob("*.ptx"))
    registers, spills = ptxas.registers_and_spills(ptx, arch)
    assert spills == 0, (registers, spills)
    report = ptxas.report(ptx, arch)
    assert all(int(x) == 0 for x in re.findall(r"(\d+) bytes stack frame", report)), report
    text = ptx.read_text()
    for needle in ("fence.mbarrier_init.release.cluster", "barrier.cluster.arrive.relaxed", "barrier.cluster.wait",
                   "st.async.shared::cluster.mbarrier::complete_tx::bytes.b32", "mbarrier.try_wait.parity"):
        assert needle in text, needle
    assert "barrier.cluster.arrive;" not in text and "st.shared::cluster" not in text
    # The mbarrier's init is fenced before the "started" arrive, and its arrival comes after a CTA barrier: with
    # the arrival right after the init, racecheck reported a hazard between them (docs dsl_notes.md).
    init = text.index("mbarrier.init.shared")
    assert init < text.index("fence.mbarrier_init.release.cluster") < text.index("barrier.cluster.arrive.relaxed")
    arrival = text.index("mbarrier.arrive.expect_tx")
    assert init < text.rindex("bar.sync", 0, arrival) and arrival < text.index("barrier.cluster.wait;")
    wait = text.index("barrier.cluster.wait;")
    exchange = text.index("st.async.shared::cluster", wait)
    rows = [m.start() for m in re.finditer(r"st\.global[.\w]*\.v4\.", text)]
    assert rows and all(at < wait for at in rows)
    assert text.index("mbarrier.try_wait.parity", exchange) > exchange


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not on PATH")
@pytest.mark.sm100_share(lambda params, indices: params["norm"])  # see conftest
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "nonorm"])
def test_fused_ds_variant_does_not_spill(norm, arch, tmp_path, ptxas):
    """vLLM's DS conv layout with the longest preamble (softplus gate, conv bias, fp32 state, register path), with
    and without the norm: no spill, no stack frame."""
    from kda_core.contracts import GateMode
    from kda_cute import fused_decode

    key = fused_decode.variant_key(state_dtype=torch.float32, gate=GateMode.SOFTPLUS, has_dt_bias=True,
                                   has_bias=True, aligned=True, has_norm=norm, conv_layout="ds")
    fused_decode.compile_variant(key, arch, ptxas.keep(tmp_path))
    (ptx,) = sorted(tmp_path.glob("*.ptx"))
    registers, spills = ptxas.registers_and_spills(ptx, arch)
    assert spills == 0, (registers, spills)
    report = ptxas.report(ptx, arch)
    assert all(int(x) == 0 for x in re.findall(r"(\d+) bytes stack frame", report)), report


def test_schedule_and_key_normalisation():
    """The ring only in the aligned class (the unaligned call keeps the register path); the ring replaces rows in
    flight and the cache hint in the key; the precomputed gate and unknown dtypes are refused by name."""
    from kda_core.contracts import GateMode, NullSlotPolicy
    from kda_core.errors import KDAError
    from kda_cute import fused_decode as fd

    big = fd.select_config(1024, 12, torch.bfloat16, aligned=True)
    assert big.bulk_ring == 8
    assert fd.select_config(1024, 12, torch.bfloat16, aligned=False).bulk_ring == 0
    assert fd.select_config(1, 12, torch.float32, aligned=True).bulk_ring == 0
    fp32_ring = fd.select_config(1024, 24, torch.float32, aligned=True)
    assert 2 <= fp32_ring.bulk_ring <= 11  # capped by 48 KB of shared memory
    base = dict(state_dtype=torch.bfloat16, gate=GateMode.LOWER_BOUND, has_dt_bias=True, has_bias=False)
    ring = fd.variant_key(**base, aligned=True, bulk_ring=8, rows_in_flight=16, cache_hint="global")
    assert ring == fd.variant_key(**base, aligned=True, bulk_ring=8)
    assert fd.variant_key(**base, aligned=False, bulk_ring=8) == fd.variant_key(**base, aligned=False)
    assert fd.variant_key(**base, aligned=True)[-3] is NullSlotPolicy.NONPOSITIVE  # FlashInfer's default
    assert fd.variant_key(**base, aligned=True) == fd.variant_key(**base, aligned=True, has_norm=True,
                                                                  conv_layout="sd")
    assert len({fd.variant_key(**base, aligned=True, has_norm=n, conv_layout=c)
                for n in (True, False) for c in ("sd", "ds")}) == 4
    with pytest.raises(KDAError, match="^conv_state: expected a layout in"):
        fd.variant_key(**base, aligned=True, conv_layout="dim-first")
    with pytest.raises(KDAError, match="^gate: expected"):
        fd.variant_key(**{**base, "gate": GateMode.PRECOMPUTED}, aligned=True)
    with pytest.raises(KDAError, match="^state_indices: expected"):
        fd.variant_key(**base, aligned=True, index_dtype=torch.int16)
    with pytest.raises(KDAError, match="^config.bulk_ring: expected|^bulk_ring: expected"):
        fd.FusedDecodeConfig(bulk_ring=1)


def test_cluster_schedule_and_key():
    """The schedule's measured rows: a cluster at small B*H on an aligned call only (bf16 4 / 2 CTAs up to 24 / 48
    states; fp32 8 / 2 up to 24 / 48, 1 to 96, 2 to 192), one CTA per (row, head) above and on unaligned calls; a
    cluster drops the ring and fits rows in flight to its tile; an illegal cluster size is refused by name."""
    from kda_core.contracts import GateMode
    from kda_core.errors import KDAError
    from kda_cute import fused_decode as fd

    bf16, fp32 = torch.bfloat16, torch.float32
    for B, H, sd, want in ((1, 12, bf16, 4), (2, 12, bf16, 4), (1, 24, bf16, 4), (4, 12, bf16, 2), (2, 24, bf16, 2),
                           (8, 12, bf16, 1), (1, 12, fp32, 8), (2, 12, fp32, 8), (1, 24, fp32, 8), (4, 12, fp32, 2),
                           (8, 12, fp32, 1), (16, 12, fp32, 2), (24, 12, fp32, 1), (64, 12, fp32, 1)):
        assert fd.select_config(B, H, sd, aligned=True).cluster == want, (B, H, sd)
        assert fd.select_config(B, H, sd, aligned=False) == fd.FusedDecodeConfig(
            rows_in_flight=fd.rows_in_flight_for(128, sd.itemsize, 0)), (B, H, sd)
    # bf16 from 1537 to 3072 states: the register path, measured faster than the ring at 3072 (B=256, H=12)
    assert fd.select_config(128, 12, bf16, aligned=True).bulk_ring == 8
    assert fd.select_config(256, 12, bf16, aligned=True) == fd.FusedDecodeConfig(rows_in_flight=8)
    assert fd.select_config(257, 12, bf16, aligned=True).bulk_ring == 8
    for sd in (bf16, fp32):
        assert fd.select_config(1024, 12, sd, aligned=True) == fd.FusedDecodeConfig(bulk_ring=8)
        assert fd.select_config(1, 12, sd, aligned=True).bulk_ring == 0
    cfg = fd.effective_config(fd.FusedDecodeConfig(bulk_ring=8, cluster=4), torch.bfloat16, True)
    assert cfg.bulk_ring == 0 and cfg.cluster == 4 and cfg.rows_in_flight == 4  # tile 32: 4 rows per thread
    base = dict(state_dtype=torch.float32, gate=GateMode.LOWER_BOUND, has_dt_bias=True, has_bias=False, aligned=True)
    assert fd.variant_key(**base, cluster=8) == fd.variant_key(**base, cluster=8, bulk_ring=8)
    assert fd.variant_key(**base, cluster=8) != fd.variant_key(**base)
    assert fd.variant_key(**base)[-1] == 1
    for bad in (0, 3, 16):
        with pytest.raises(KDAError, match="^config.cluster: expected"):
            fd.FusedDecodeConfig(cluster=bad)


def test_entry_refuses_cpu_tensors_before_compiling():
    """The entry validates before it compiles or launches: a CPU call is refused naming x."""
    from kda_core.errors import KDAError
    from kda_cute import fused_decode as fd

    H, D = 8, 128
    C = 3 * H * D
    with pytest.raises(KDAError, match="^x: expected a CUDA tensor"):
        fd.fused_kda_decode(torch.zeros(1, C, dtype=torch.bfloat16), torch.zeros(3, 4, H * D),
                            torch.zeros(2, 3, C, dtype=torch.bfloat16).transpose(1, 2),
                            torch.zeros(1, 1, H, D, dtype=torch.bfloat16), torch.zeros(1, 1, H, dtype=torch.bfloat16),
                            torch.zeros(H), None, torch.ones(1, dtype=torch.int32), torch.zeros(2, H, D, D),
                            torch.zeros(1, H, D, dtype=torch.bfloat16), torch.ones(D))
