"""CPU compile checks of the multi-token fused decode kernel (kda_cute.fused_spec): its variants build for sm_90a
(every one) and sm_100a (a share), the widest ones without a register spill or a stack frame, and the token bucket,
the schedule and the variant key normalise as documented; the validator's refusals that need no GPU.

No GPU needed (``CUTE_DSL_ARCH`` is set by conftest). The structural axes (pool dtype x gate x alignment) are
crossed in full at T = 4; the token buckets, the pass size, the cache hint, the null policy, the three index dtypes
and the optional bias / dt_bias are flipped on a fixed base.
"""

from __future__ import annotations

import itertools
import re
import shutil

import pytest
import torch

ARCHS = ("sm_90a", "sm_100a")
D = 128


def _variants():
    from kda_core.contracts import GateMode, NullSlotPolicy

    base = dict(state_dtype=torch.float32, gate=GateMode.LOWER_BOUND, has_dt_bias=True, has_bias=False,
                aligned=True, max_tokens=4)
    out = []
    for sd, gate, aligned in itertools.product((torch.bfloat16, torch.float32),
                                               (GateMode.LOWER_BOUND, GateMode.SOFTPLUS), (True, False)):
        out.append({**base, "state_dtype": sd, "gate": gate, "aligned": aligned})
    for mt in (1, 2, 8, 16):
        out.append({**base, "max_tokens": mt})
    out.append({**base, "state_dtype": torch.bfloat16, "max_tokens": 16, "gate": GateMode.SOFTPLUS})
    for rpp in (1, 2):
        out.append({**base, "rows_per_pass": rpp})
    out.append({**base, "state_dtype": torch.bfloat16, "rows_per_pass": 4, "cache_hint": "global"})
    oor = {"null_policy": NullSlotPolicy.OUT_OF_RANGE}
    out.append({**base, **oor})
    out.append({**base, "state_dtype": torch.bfloat16, "aligned": False, **oor})
    out.append({**base, "index_dtype": torch.int64})
    out.append({**base, "qsl_dtype": torch.int64, "nat_dtype": torch.int64})
    out.append({**base, "index_dtype": torch.int64, "qsl_dtype": torch.int64, "nat_dtype": torch.int64, **oor})
    out.append({**base, "has_bias": True, "has_dt_bias": False})
    out.append({**base, "state_dtype": torch.bfloat16, "has_bias": True, "max_tokens": 8})
    out.append({**base, "rows_per_pass": 1, "min_ctas": 6})
    out.append({**base, "state_dtype": torch.bfloat16, "min_ctas": 5, "gate": GateMode.SOFTPLUS})
    return out


def _ident(v):
    return (f"{str(v['state_dtype'])[6:]}-{v['gate'].value}-{'al' if v['aligned'] else 'unal'}-t{v['max_tokens']}"
            f"{'-rpp%d' % v['rows_per_pass'] if 'rows_per_pass' in v else ''}"
            f"{'-' + v['cache_hint'] if v.get('cache_hint', 'stream') != 'stream' else ''}"
            f"{'-' + v['null_policy'].value if 'null_policy' in v else ''}"
            f"{'-idx64' if v.get('index_dtype') is torch.int64 else ''}"
            f"{'-qsl64' if v.get('qsl_dtype') is torch.int64 else ''}"
            f"{'-nat64' if v.get('nat_dtype') is torch.int64 else ''}"
            f"{'-convbias' if v['has_bias'] else ''}{'' if v['has_dt_bias'] else '-nodtbias'}"
            f"{'-min%d' % v['min_ctas'] if v.get('min_ctas') else ''}")


VARIANTS = _variants()


# Every third variant on sm_100a, by its place in VARIANTS (see conftest).
@pytest.mark.sm100_share(lambda params, indices: VARIANTS.index(params["variant"]) % 3 == 0)
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", VARIANTS, ids=[_ident(v) for v in VARIANTS])
def test_fused_spec_variant_compiles(variant, arch):
    from kda_cute import fused_spec

    key = fused_spec.variant_key(**variant)
    assert fused_spec.compile_variant(key, arch) is not None


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not on PATH")
@pytest.mark.sm100_share(lambda params, indices: params["state_dtype"] is torch.float32)  # see conftest
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("max_tokens, rows_per_pass", [(4, 4), (16, 4)], ids=["t4", "t16"])
def test_fused_spec_variant_does_not_spill(state_dtype, max_tokens, rows_per_pass, arch, tmp_path, ptxas):
    """The softplus gate and the conv bias are the longest preamble and phase 0; the largest token bucket holds the
    most token inputs in registers: no spill, no stack frame, at the default four rows per pass (two rows per pass
    holds fewer rows; register counts: docs/fused_spec.md, "What it costs")."""
    from kda_core.contracts import GateMode
    from kda_cute import fused_spec

    key = fused_spec.variant_key(state_dtype=state_dtype, gate=GateMode.SOFTPLUS, has_dt_bias=True, has_bias=True,
                                 aligned=True, max_tokens=max_tokens, rows_per_pass=rows_per_pass)
    fused_spec.compile_variant(key, arch, ptxas.keep(tmp_path))
    (ptx,) = sorted(tmp_path.glob("*.ptx"))
    registers, spills = ptxas.registers_and_spills(ptx, arch)
    assert spills == 0, (registers, spills)
    report = ptxas.report(ptx, arch)
    assert all(int(x) == 0 for x in re.findall(r"(\d+) bytes stack frame", report)), report


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas (CUDA toolkit) not on PATH")
@pytest.mark.sm100_share(lambda params, indices: False)  # see conftest: sm_90a, where the counts were read
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("state_dtype, rows_per_pass, min_ctas, registers",
                         [(torch.float32, 1, 6, 80), (torch.bfloat16, 2, 5, 96)], ids=["fp32-rpp1-min6", "bf16-min5"])
def test_resident_cta_floor_fits_without_spill(state_dtype, rows_per_pass, min_ctas, registers, arch, tmp_path,
                                               ptxas):
    """Kimi K3's layer (lower-bound gate, no conv bias) at T = 4 with a resident-CTA floor: ptxas fits the floor's
    register cap without a spill (sm_90a: 80 registers for fp32 at one row per pass and 6 CTAs per SM, 94 for bf16
    at 5), so the floor is a config to sweep, not a spill. (The softplus gate with a conv bias spills under these
    floors; fp32 at two rows per pass and 6 CTAs spills too.)"""
    from kda_core.contracts import GateMode
    from kda_cute import fused_spec

    key = fused_spec.variant_key(state_dtype=state_dtype, gate=GateMode.LOWER_BOUND, has_dt_bias=True, has_bias=False,
                                 aligned=True, max_tokens=4, rows_per_pass=rows_per_pass, min_ctas=min_ctas)
    fused_spec.compile_variant(key, arch, ptxas.keep(tmp_path))
    (ptx,) = sorted(tmp_path.glob("*.ptx"))
    used, spills = ptxas.registers_and_spills(ptx, arch)
    assert spills == 0 and used <= registers, (used, spills)


def test_token_bucket_schedule_and_key():
    """T rounds up to a bucket, 17 is refused naming state_indices; the key carries every facet and refuses the
    precomputed gate, unknown index dtypes, pass sizes and buckets by name."""
    from kda_core.contracts import GateMode, NullSlotPolicy
    from kda_core.errors import KDAError
    from kda_cute import fused_spec as fs

    assert [fs.token_bucket(t) for t in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]
    with pytest.raises(KDAError, match="^state_indices: expected"):
        fs.token_bucket(17)
    assert fs.select_config(64, 12, 4, torch.bfloat16) == fs.FusedSpecConfig()
    base = dict(state_dtype=torch.bfloat16, gate=GateMode.LOWER_BOUND, has_dt_bias=True, has_bias=False,
                aligned=True, max_tokens=4)
    key = fs.variant_key(**base)
    assert key[8] is NullSlotPolicy.NONPOSITIVE  # FlashInfer's default
    assert len({key, fs.variant_key(**base, rows_per_pass=2), fs.variant_key(**base, qsl_dtype=torch.int64),
                fs.variant_key(**base, nat_dtype=torch.int64), fs.variant_key(**base, index_dtype=torch.int64),
                fs.variant_key(**{**base, "max_tokens": 8}), fs.variant_key(**base, min_ctas=6)}) == 7
    with pytest.raises(KDAError, match="^gate: expected"):
        fs.variant_key(**{**base, "gate": GateMode.PRECOMPUTED})
    for name in ("index_dtype", "qsl_dtype", "nat_dtype"):
        with pytest.raises(KDAError, match="^(state_indices|query_start_loc|num_accepted_tokens): expected"):
            fs.variant_key(**base, **{name: torch.int16})
    with pytest.raises(KDAError, match="^max_tokens: expected"):
        fs.variant_key(**{**base, "max_tokens": 3})
    with pytest.raises(KDAError, match="^config.rows_per_pass: expected"):
        fs.FusedSpecConfig(rows_per_pass=3)
    with pytest.raises(KDAError, match="^config.cache_hint: expected"):
        fs.FusedSpecConfig(cache_hint="l1")
    with pytest.raises(KDAError, match="^config.min_ctas: expected"):
        fs.FusedSpecConfig(min_ctas=7)


def _cpu_args(H=12, n_tok=5, rows=3, T=2, slots=6):
    C = 3 * H * D
    return dict(
        x=torch.zeros(n_tok, C, dtype=torch.bfloat16), weight=torch.zeros(3, 4, H * D),
        conv_state=torch.zeros(slots, T + 2, C, dtype=torch.bfloat16).transpose(1, 2),
        raw_gate=torch.zeros(1, n_tok, H, D, dtype=torch.bfloat16),
        raw_beta=torch.zeros(1, n_tok, H, dtype=torch.bfloat16), A_log=torch.zeros(H), dt_bias=None,
        state_indices=torch.ones(rows, T, dtype=torch.int32), state=torch.zeros(slots, H, D, D),
        output_gate=torch.zeros(n_tok, H, D, dtype=torch.bfloat16), norm_weight=torch.ones(D),
        query_start_loc=torch.zeros(rows + 1, dtype=torch.int32),
        num_accepted_tokens=torch.ones(rows, dtype=torch.int32))


def test_entry_refuses_cpu_tensors_before_compiling():
    """The entry validates before it compiles or launches: a CPU call is refused naming x."""
    from kda_core.errors import KDAError
    from kda_cute import fused_spec as fs

    with pytest.raises(KDAError, match="^x: expected a CUDA tensor"):
        fs.packed_fused_kda_decode(**_cpu_args())


def test_entry_refuses_t1_rows_with_several_columns():
    """FlashInfer's pre-resolved T = 1 rows only with a one-column state_indices."""
    from kda_core.errors import KDAError
    from kda_cute import fused_spec as fs

    with pytest.raises(KDAError, match="^t1_state_indices: expected"):
        fs.packed_fused_kda_decode(**_cpu_args(T=2), t1_state_indices=torch.ones(5, dtype=torch.int32))
