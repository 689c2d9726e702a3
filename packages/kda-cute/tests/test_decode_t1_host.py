"""Host side of the T=1 decode (CPU): schedule policy, forced tiles, argument checks, alignment classes."""

from __future__ import annotations

import pytest
import torch

from kda_core.contracts import HEAD_DIM
from kda_core.errors import KDAError


def test_policy_returns_a_legal_tile_for_every_batch_and_head_count():
    from kda_cute.decode_t1 import TILE_V_CHOICES, select_config

    for B in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096):
        for H in (8, 12, 16, 24, 32, 48, 64, 96):
            for dtype in (torch.bfloat16, torch.float32):
                assert select_config(B, H, dtype, True).tile_v in TILE_V_CHOICES


def test_policy_uses_smaller_tiles_at_small_batch():
    from kda_cute.decode_t1 import select_config

    assert select_config(1, 12, torch.bfloat16, True).tile_v <= select_config(512, 12, torch.bfloat16, True).tile_v


@pytest.mark.parametrize("tile_v", [8, 16, 32, 64, 128])
def test_knob_forces_the_tile(tile_v, monkeypatch):
    from kda_cute.decode_t1 import select_config

    monkeypatch.setenv("KDA_DECODE_TILE_V", str(tile_v))
    assert select_config(512, 12, torch.bfloat16, True).tile_v == tile_v


@pytest.mark.parametrize("bad", ["24", "256", "-8", "abc"])
def test_invalid_forced_tile_raises_naming_the_knob(bad, monkeypatch):
    from kda_cute.decode_t1 import select_config

    monkeypatch.setenv("KDA_DECODE_TILE_V", bad)
    with pytest.raises(KDAError, match="KDA_DECODE_TILE_V"):
        select_config(4, 12, torch.bfloat16, True)


def _field(key, name):
    """The ``name`` entry of a variant key (the key's order is variant_key's signature)."""
    from kda_cute import decode_t1

    return key[decode_t1.variant_key.__code__.co_varnames.index(name)]


def _key(**over):
    from kda_core.contracts import GateMode
    from kda_cute import decode_t1

    base = dict(state_dtype=torch.bfloat16, g_dtype=torch.bfloat16, beta_dtype=torch.bfloat16,
                gate=GateMode.LOWER_BOUND, beta_is_logit=True, use_qk_l2norm=True, has_dt_bias=True, tile_v=128,
                aligned=True)
    return decode_t1.variant_key(**{**base, **over})


def test_variant_key_separates_rows_in_flight_and_cache_hint_and_normalises_the_default():
    assert _key(rows_in_flight=16) != _key()
    assert _key(rows_in_flight=0) == _key(rows_in_flight=8)  # 0 = 32 registers = 8 bf16 rows
    assert _key(tile_v=16, rows_in_flight=16) == _key(tile_v=16)  # capped at the thread's 2 rows
    assert _key(cache_hint="global") != _key()
    with pytest.raises(KDAError, match="^cache_hint: expected"):
        _key(cache_hint="default")


def test_a_requested_config_runs_as_asked_where_the_call_can_take_it():
    from kda_cute.decode_t1 import DecodeT1Config, effective_config

    for cfg in (DecodeT1Config(128, rows_in_flight=16, cache_hint="global"), DecodeT1Config(8),
                DecodeT1Config(64, rows_in_flight=4), DecodeT1Config(128, bulk_ring=4),
                DecodeT1Config(128, bulk_ring=8, slot_major=True)):
        assert effective_config(cfg, 512, torch.bfloat16, True, 512) == cfg


@pytest.mark.parametrize("field, bad", [("tile_v", 24), ("tile_v", 256), ("rows_in_flight", -1),
                                        ("rows_in_flight", 2.0), ("cache_hint", "default"), ("bulk_ring", 1),
                                        ("bulk_ring", 17)])
def test_an_illegal_config_raises_naming_its_field(field, bad):
    from kda_cute.decode_t1 import DecodeT1Config

    with pytest.raises(KDAError, match=rf"^config\.{field}: expected"):
        DecodeT1Config(**{"tile_v": 32, field: bad})


def test_configs_are_frozen_and_hashable():
    import dataclasses

    from kda_cute.decode_t1 import DecodeT1Config

    cfg = DecodeT1Config(128, bulk_ring=8)
    assert hash(cfg) == hash(DecodeT1Config(128, bulk_ring=8)) and cfg != DecodeT1Config(128, bulk_ring=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.tile_v = 64


def test_bulk_ring_key_exists_only_for_aligned_tiles_of_32_to_128_and_replaces_the_other_staging():
    assert _key(bulk_ring=4) != _key() and _key(bulk_ring=4) != _key(bulk_ring=8)
    assert _key(tile_v=64, bulk_ring=4) != _key(tile_v=64)
    assert _key(tile_v=64, bulk_ring=16) == _key(tile_v=64, bulk_ring=8)  # capped at the tile's 8 chunks
    assert _key(tile_v=32, bulk_ring=8) == _key(tile_v=32, bulk_ring=4)
    assert _key(tile_v=16, bulk_ring=4) == _key(tile_v=16)  # two chunks: nothing to refill
    assert _key(aligned=False, bulk_ring=4) == _key(aligned=False)
    assert _key(bulk_ring=4, rows_in_flight=16, cache_hint="global") == _key(bulk_ring=4)
    fp32 = torch.float32
    assert _key(state_dtype=fp32, bulk_ring=16) == _key(state_dtype=fp32, bulk_ring=11)  # 48 KB of shared memory
    assert _key(bulk_ring=16) != _key(bulk_ring=11)  # bf16 chunks are half the size
    for bad in (1, 17, -2):
        with pytest.raises(KDAError, match="^bulk_ring: expected"):
            _key(bulk_ring=bad)


def test_a_requested_bulk_ring_runs_only_on_aligned_tiles_of_32_to_128_and_replaces_the_register_fields():
    from kda_cute.decode_t1 import DecodeT1Config, effective_config, select_config

    fp32_row = DecodeT1Config(128, rows_in_flight=16, cache_hint="global", bulk_ring=4)
    assert effective_config(fp32_row, 512, torch.float32, True) == DecodeT1Config(128, bulk_ring=4)
    assert effective_config(fp32_row, 512, torch.float32, False) == DecodeT1Config(128, rows_in_flight=16,
                                                                                   cache_hint="global")
    assert effective_config(DecodeT1Config(16, bulk_ring=8), 1, torch.bfloat16, True).bulk_ring == 0  # 2 chunks
    assert effective_config(DecodeT1Config(64, bulk_ring=16), 1, torch.bfloat16, True).bulk_ring == 8  # its chunks
    assert effective_config(DecodeT1Config(128, bulk_ring=16), 1, torch.float32, True).bulk_ring == 11  # 48 KB
    assert select_config(512, 12, torch.bfloat16, False).bulk_ring == 0  # the policy's unaligned row
    # the pool-realigning variant's ring (any slot stride): from 3 chunks deep, as the aligned ring is capped
    assert effective_config(fp32_row, 512, torch.float32, False, realign=True) == DecodeT1Config(128, bulk_ring=4)
    assert effective_config(DecodeT1Config(128, bulk_ring=2), 1, torch.bfloat16, False, realign=True).bulk_ring == 0
    assert effective_config(DecodeT1Config(32, bulk_ring=8), 1, torch.bfloat16, False, realign=True).bulk_ring == 4
    assert effective_config(DecodeT1Config(16, bulk_ring=8), 1, torch.bfloat16, False, realign=True).bulk_ring == 0
    assert effective_config(DecodeT1Config(128, bulk_ring=16), 1, torch.float32, False, realign=True).bulk_ring == 11


def test_schedule_rows_from_the_tuning_sweep():
    from kda_cute.decode_t1 import DecodeT1Config, select_config

    assert select_config(2, 12, torch.bfloat16, True) == DecodeT1Config(32)  # 24 states: B=2 at H=12
    assert select_config(1, 12, torch.bfloat16, True) == DecodeT1Config(16)
    assert select_config(4, 12, torch.bfloat16, True) == DecodeT1Config(16)
    assert select_config(32, 12, torch.bfloat16, True) == DecodeT1Config(64)  # 384 states: the last tile-64 row
    ring = DecodeT1Config(128, bulk_ring=8)  # the bulk ring replaces rows in flight / hint / staging
    assert select_config(33, 12, torch.bfloat16, True) == ring
    assert select_config(512, 12, torch.bfloat16, True) == ring
    assert select_config(512, 12, torch.bfloat16, False) == DecodeT1Config(128, rows_in_flight=16)  # element-wise:
    # the register path; the pool-realigning variant: its ring with both pool dtypes (measured)
    assert select_config(512, 12, torch.bfloat16, False, realign=True) == ring
    assert select_config(64, 12, torch.bfloat16, False, realign=True) == ring
    assert select_config(512, 12, torch.float32, False, realign=True) == ring
    assert select_config(64, 12, torch.float32, False, realign=True) == ring
    assert select_config(16, 12, torch.float32, True) == DecodeT1Config(64)
    assert select_config(24, 12, torch.float32, True) == ring
    assert select_config(256, 12, torch.float32, True) == ring
    assert select_config(256, 12, torch.float32, False) == DecodeT1Config(128, rows_in_flight=16, cache_hint="global")


def _call(case, **over):
    from kda_cute import kda_decode_t1

    args = dict(q=case.q, k=case.k, v=case.v, g=case.g, beta=case.beta, state_pool=case.pool,
                slot_indices=case.slots)
    kw = case.kwargs()
    for name, value in over.items():
        (args if name in args else kw)[name] = value
    return kda_decode_t1(*args.values(), **kw)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "argument, bad",
    [
        ("q", lambda c: c.q[..., :64]),
        ("k", lambda c: c.k.float()),
        ("v", lambda c: c.v[:1]),
        ("g", lambda c: c.g.half()),
        ("beta", lambda c: c.beta[..., :4]),
        ("state_pool", lambda c: c.pool.transpose(2, 3)),
        ("state_pool", lambda c: c.pool.half()),
        ("state_pool", lambda c: c.pool[:, :4]),
        ("slot_indices", lambda c: c.slots.float()),  # int32 and int64 are taken
        ("A_log", lambda c: None),
        ("dt_bias", lambda c: c.dt_bias[:100]),
        ("lower_bound", lambda c: 0.5),
    ],
)
def test_bad_argument_raises_kdaerror_naming_it(make_case, argument, bad):
    case = make_case(2, 8, n_slots=3)
    with pytest.raises(KDAError, match=rf"^{argument}: expected"):
        _call(case, **{argument: bad(case)})


def test_cpu_tensors_are_rejected_before_any_launch(make_case):
    with pytest.raises(KDAError, match="^q: expected a CUDA tensor"):
        _call(make_case(2, 8, n_slots=3, device="cpu"))


def test_alignment_classes_follow_pointer_and_strides():
    from kda_cute._launch import alignment_of

    base = torch.zeros(4, 3 * 128 + 8, dtype=torch.bfloat16)
    assert alignment_of(base[:, :128]) == 16
    assert alignment_of(base[:, 1:129]) == 2  # pointer shifted by one bf16
    odd_rows = torch.zeros(4, 3 * 128 + 3, dtype=torch.bfloat16)[:, :128]
    assert alignment_of(odd_rows) == 2  # 774-byte row stride
    assert alignment_of(torch.zeros(1, 1, 2, 128, dtype=torch.bfloat16)[:, :, :1]) == 16  # size-1 dims ignored


def test_variant_key_separates_the_packed_wrapper():
    assert _key(packed=True) != _key()
    assert _field(_key(packed=True), "packed") is True and _field(_key(), "packed") is False


# ---------------------------------------------------------------------------------------------------------------
# The per-call host path (validated call -> launch memo -> compiled function), with the compile step replaced by a
# recorder so that it runs on CPU tensors: what reaches the compiled function, and when a new variant is chosen.


class _Compiled:
    """Stands in for a compiled variant: remembers its variant key and every call's arguments."""

    def __init__(self, key):
        self.key = key
        self.calls = []
        self.reject = None  # an exception to raise, as the compiled TVM-FFI wrapper does for an argument it rejects

    def __call__(self, *args):
        self.calls.append(args)
        if self.reject is not None:
            raise self.reject


@pytest.fixture
def host_path(monkeypatch):
    from kda_cute import decode_t1

    compiled = []

    def get_or_compile(key, build, arch):
        compiled.append(_Compiled(key))
        return compiled[-1]

    monkeypatch.setattr(decode_t1._launch, "get_or_compile", get_or_compile)
    monkeypatch.setattr(decode_t1, "_LAUNCH_MEMO", {})
    monkeypatch.delenv("KDA_DECODE_TILE_V", raising=False)
    return compiled


def _packed_call(case, **over):
    """Validate the packed form of ``case`` on the CPU (the entry points insist on CUDA) and launch it."""
    from kda_core.contracts import NullSlotPolicy
    from kda_core.validation import validate_packed_decode_t1
    from kda_cute import decode_t1

    kw = {**case.kwargs(), "output": None, "use_qk_l2norm_in_kernel": True, "config": None,
          "null_policy": NullSlotPolicy.OUT_OF_RANGE, **over}
    l2norm, output, config = kw.pop("use_qk_l2norm_in_kernel"), kw.pop("output"), kw.pop("config")
    null_policy = kw.pop("null_policy")
    H = case.raw_beta.shape[1]
    call = validate_packed_decode_t1(case.mixed_qkv, case.raw_gate, case.raw_beta, case.pool, case.slots, num_heads=H,
                                     output=output, device_kind="any", **kw)
    return decode_t1._run_packed(call, case.mixed_qkv, case.raw_gate, case.raw_beta, case.pool, case.slots,
                                 kw["A_log"], kw["dt_bias"], l2norm, output, null_policy, config)


def _unpacked_call(case, **over):
    from kda_core.validation import validate_decode_t1
    from kda_cute import decode_t1

    kw = {**case.kwargs(), **over}
    call = validate_decode_t1(case.q, case.k, case.v, case.g, case.beta, case.pool, case.slots, device_kind="any",
                              **kw)
    return decode_t1._run(call, case.q, case.k, case.v, case.g, case.beta, case.pool, case.slots, kw["A_log"],
                          kw["dt_bias"], True, None)


def test_packed_path_hands_the_gemm_rows_to_the_packed_variant(host_path, make_case):
    case = make_case(3, 12, row_pad=24, device="cpu")
    out = _packed_call(case)
    (fn,) = host_path
    assert _field(fn.key, "packed") is True  # the packed wrapper
    (args,) = fn.calls
    assert args[:3] == (case.mixed_qkv, case.raw_gate, case.raw_beta)  # no views: the tensors themselves
    assert args[3] is case.A_log and args[4] is case.dt_bias and args[5] is case.pool and args[6] is case.slots
    assert args[7] is out and out.shape == (3, 1, 12, 128) and out.dtype == torch.bfloat16
    assert args[8:] == (128**-0.5, -5.0)


def test_unpacked_path_hands_the_five_views_to_the_unpacked_variant(host_path, make_case):
    from kda_core.contracts import NullSlotPolicy

    case = make_case(3, 12, gate="softplus", device="cpu")
    _unpacked_call(case, scale=0.25)  # _run's positional form (the facade's): the default null policy
    (fn,) = host_path
    assert _field(fn.key, "packed") is False
    assert _field(fn.key, "null_policy") is NullSlotPolicy.OUT_OF_RANGE
    (args,) = fn.calls
    assert args[:5] == (case.q, case.k, case.v, case.g, case.beta)
    assert args[10:] == (0.25, -1.0)  # the softplus gate's unused floor


def test_precomputed_gate_passes_no_gate_tensors_and_a_2d_dt_bias_is_flattened(host_path, make_case):
    case = make_case(2, 8, gate="precomputed", device="cpu")
    _packed_call(case, A_log=torch.zeros(8), dt_bias=torch.zeros(8 * 128))
    assert host_path[0].calls[0][3:5] == (None, None)
    case = make_case(2, 8, device="cpu")
    _packed_call(case, dt_bias=case.dt_bias.view(8, 128))
    dt = host_path[1].calls[0][4]
    assert dt.shape == (8 * 128,) and dt.data_ptr() == case.dt_bias.data_ptr()


def test_repeated_calls_reuse_the_launch_and_a_new_shape_configures_again(host_path, make_case):
    case = make_case(3, 12, device="cpu")
    for _ in range(3):
        _packed_call(case)
    assert len(host_path) == 1 and len(host_path[0].calls) == 3
    _unpacked_call(case)  # the same call through the unpacked entry: another variant
    _packed_call(make_case(5, 12, device="cpu"))
    assert [_field(fn.key, "packed") for fn in host_path] == [True, False, True]


def test_a_changed_forced_tile_is_honoured_on_the_next_call(host_path, make_case, monkeypatch):
    from kda_cute import decode_t1

    tile_of = decode_t1.variant_key.__code__.co_varnames.index("tile_v")  # the key's order is the signature's
    launched = []
    case = make_case(3, 12, device="cpu")
    for tile in (None, 64, 8, 64, None):
        if tile is None:
            monkeypatch.delenv("KDA_DECODE_TILE_V", raising=False)
        else:
            monkeypatch.setenv("KDA_DECODE_TILE_V", str(tile))
        _packed_call(case)
        (fn,) = [fn for fn in host_path if fn.calls]  # the variant this call launched
        launched.append(fn.key[tile_of])
        fn.calls.clear()
    assert launched == [16, 64, 8, 64, 16]  # the schedule's tile at B=3, H=12, then each forced one
    assert len(host_path) == 3  # a value seen before reuses its launch
    monkeypatch.setenv("KDA_DECODE_TILE_V", "24")
    with pytest.raises(KDAError, match="^KDA_DECODE_TILE_V: expected"):
        _packed_call(case)


def test_an_empty_batch_launches_nothing_and_returns_an_empty_output(host_path, make_case):
    case = make_case(1, 12, device="cpu")
    empty = {name: getattr(case, name)[:0] for name in ("mixed_qkv", "raw_gate", "raw_beta", "slots")}
    for name, t in empty.items():
        setattr(case, name, t)
    out = _packed_call(case)
    assert out.shape == (0, 1, 12, 128)
    assert host_path == []


def test_a_changed_config_is_honoured_on_the_next_call(host_path, make_case):
    from kda_cute import decode_t1

    fields = decode_t1.variant_key.__code__.co_varnames
    case = make_case(3, 12, device="cpu")
    launched = []
    for config in (None, decode_t1.DecodeT1Config(128, bulk_ring=4), decode_t1.DecodeT1Config(128, bulk_ring=8),
                   decode_t1.DecodeT1Config(128, bulk_ring=4), decode_t1.DecodeT1Config(64, rows_in_flight=2), None):
        _packed_call(case, config=config)
        (fn,) = [fn for fn in host_path if fn.calls]
        launched.append(tuple(fn.key[fields.index(name)] for name in ("tile_v", "rows_in_flight", "bulk_ring")))
        fn.calls.clear()
    assert launched == [(16, 2, 0), (128, 0, 4), (128, 0, 8), (128, 0, 4), (64, 2, 0), (16, 2, 0)]
    assert len(host_path) == 4  # a config seen before reuses its launch
    with pytest.raises(KDAError, match="^config: expected a DecodeT1Config"):
        _packed_call(case, config=(128, 0))


# The public entries on CPU tensors: the launch device floor lowered and the full validators taking any device, so
# that the hot path (kda-core's re-validation, then the compiled function) runs as on a GPU.


@pytest.fixture
def entries_on_cpu(host_path, monkeypatch):
    import functools

    from kda_core import validation
    from kda_cute import decode_t1

    monkeypatch.setattr(validation, "_LAUNCH_DEVICE_MIN", -1)
    for name in ("validate_decode_t1", "validate_packed_decode_t1", "validate_packed_tokens_decode_t1"):
        full = functools.partial(getattr(validation, name), device_kind="any")
        monkeypatch.setattr(validation, name, full)
        monkeypatch.setattr(decode_t1, name, full)
    return host_path


def _packed_entry(case, **over):
    from kda_cute import kda_decode_t1_packed

    kw = {**case.kwargs(), **over}
    return kda_decode_t1_packed(case.mixed_qkv, case.raw_gate, case.raw_beta, case.pool, case.slots,
                                num_heads=case.raw_beta.shape[1], **kw)


def _unpacked_entry(case, **over):
    from kda_cute import kda_decode_t1

    kw = {**case.kwargs(), **over}
    return kda_decode_t1(case.q, case.k, case.v, case.g, case.beta, case.pool, case.slots, **kw)


@pytest.mark.parametrize("entry", [_packed_entry, _unpacked_entry], ids=["packed", "unpacked"])
def test_a_wrapper_rejection_runs_the_full_validator_which_names_the_argument(entries_on_cpu, make_case, entry):
    case = make_case(3, 12, device="cpu")
    entry(case)  # described and launched
    (fn,) = entries_on_cpu
    fn.reject = ValueError("Mismatched Tensor on argument #3, expected dtype=float32")  # what the wrapper says
    with pytest.raises(KDAError, match="^A_log: expected"):
        entry(case, A_log=case.A_log.half())  # a fact only the wrapper checks on the hot path
    assert len(fn.calls) == 2  # the broken call took the hot path to the wrapper
    with pytest.raises(ValueError, match="^Mismatched Tensor"):  # a rejection the validator cannot explain
        entry(case)  # is not swallowed
    fn.reject = None
    entry(case)
    assert len(fn.calls) == 4 and len(entries_on_cpu) == 1


def test_slot_major_grid_is_taken_by_the_large_ring_rows_on_a_pool_of_at_most_the_policy_factor_of_the_batch():
    from kda_cute import decode_t1

    factor = decode_t1.SLOT_MAJOR_MAX_POOL_PER_ROW
    assert decode_t1.select_config(512, 12, torch.bfloat16, True, 512).slot_major
    assert decode_t1.select_config(512, 12, torch.bfloat16, True, int(512 * factor)).slot_major
    assert not decode_t1.select_config(512, 12, torch.bfloat16, True, int(512 * factor) + 1).slot_major
    assert decode_t1.select_config(512, 12, torch.float32, True, 600).slot_major
    assert not decode_t1.select_config(512, 12, torch.bfloat16, True).slot_major  # pool rows unknown
    assert not decode_t1.select_config(512, 12, torch.bfloat16, False, 512).slot_major  # unaligned: no ring either
    assert not decode_t1.select_config(8, 12, torch.bfloat16, True, 8).slot_major  # the small-batch rows: no ring
    # The ring rows below the measured crossover (the scan's fixed cost outweighs the order there)
    assert decode_t1.select_config(256, 12, torch.bfloat16, True, 256).bulk_ring
    assert not decode_t1.select_config(256, 12, torch.bfloat16, True, 256).slot_major
    assert decode_t1.select_config(320, 12, torch.bfloat16, True, 320).slot_major
    assert not decode_t1.select_config(128, 12, torch.float32, True, 128).slot_major
    assert decode_t1.select_config(256, 12, torch.float32, True, 256).slot_major


def test_a_requested_slot_major_grid_runs_where_its_static_conditions_and_the_grid_allow():
    from kda_cute.decode_t1 import GRID_Z_MAX, DecodeT1Config, effective_config

    def slot_major(cfg, B, N, aligned=True):
        return effective_config(cfg, B, torch.bfloat16, aligned, N).slot_major

    assert not slot_major(DecodeT1Config(32, slot_major=True), 8, 8)  # tile 128 only
    assert slot_major(DecodeT1Config(128, slot_major=True), 8, 8)  # the register path too
    assert slot_major(DecodeT1Config(128, bulk_ring=8, slot_major=True), 8, 100)  # whatever the pool factor
    assert not slot_major(DecodeT1Config(128, slot_major=True), 8, 8, aligned=False)
    assert not slot_major(DecodeT1Config(128, slot_major=True), 8, None)  # pool rows unknown
    assert not slot_major(DecodeT1Config(128, slot_major=True), 8, GRID_Z_MAX)  # N + ceil(B / 128) past the grid
    assert not slot_major(DecodeT1Config(128, bulk_ring=8), 512, 512)  # not asked for


# Launch geometry, absent dt_bias and the debug duplicate check.


def _big_call(B, N):
    """A validated call's description for B rows (kda-core's fields that _configure reads), no tensors."""
    from types import SimpleNamespace

    from kda_core.contracts import GateMode

    return SimpleNamespace(gate_mode=GateMode.LOWER_BOUND, B=B, H=8, N=N, state_dtype=torch.bfloat16, aligned=True,
                           beta_is_logit=True, lower_bound=-5.0, scale=1.0)


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_a_batch_past_grid_z_on_the_batch_major_grid_runs_as_several_launches(host_path, packed, monkeypatch):
    from kda_cute import decode_t1

    B = decode_t1.GRID_Z_MAX + 5
    monkeypatch.setenv("KDA_DECODE_TILE_V", "64")  # tile 64: never the slot-major grid
    entry = decode_t1._configure(("big", packed), _big_call(B, 4), packed, True, torch.empty(1), torch.bfloat16,
                                 torch.bfloat16, True)
    rows = torch.empty(1, 8).expand(B, 8)  # the batch-indexed arguments (row views are all that is taken)
    batch_args = decode_t1._PACKED_BATCH_ARGS if packed else decode_t1._BATCH_ARGS
    n_args = 10 if packed else 12
    args = [rows if i in batch_args else object() for i in range(n_args)]
    entry[1](*args)
    (fn,) = host_path
    assert [len(part[0]) for part in fn.calls] == [decode_t1.GRID_Z_MAX, 5]
    for part in fn.calls:
        assert all((part[i].shape[0] <= decode_t1.GRID_Z_MAX) if i in batch_args else (part[i] is args[i])
                   for i in range(n_args))
    decode_t1._LAUNCH_MEMO.pop(("big", packed), None)


def test_a_large_batch_on_the_slot_major_grid_is_one_launch(host_path):
    from kda_cute import decode_t1

    B = decode_t1.GRID_Z_MAX + 5
    entry = decode_t1._configure(("big-slot-major",), _big_call(B, 4), False, True, torch.empty(1), torch.bfloat16,
                                 torch.bfloat16, True)
    (fn,) = host_path
    assert _field(fn.key, "slot_major") is True  # grid z = N + ceil(B / 128)
    assert entry[1] is fn  # the compiled function itself, no split
    decode_t1._LAUNCH_MEMO.pop(("big-slot-major",), None)


def test_an_absent_dt_bias_compiles_the_variant_without_it(host_path, make_case):
    from kda_core.validation import validate_decode_t1
    from kda_cute import decode_t1

    case = make_case(3, 12, device="cpu")
    call = validate_decode_t1(case.q, case.k, case.v, case.g, case.beta, case.pool, case.slots, device_kind="any",
                              **case.kwargs())
    has_dt_bias = decode_t1.variant_key.__code__.co_varnames.index("has_dt_bias")
    for dt_bias in (case.dt_bias, None, case.dt_bias):
        decode_t1._run(call, case.q, case.k, case.v, case.g, case.beta, case.pool, case.slots, case.A_log, dt_bias,
                       True, None)
    assert [fn.key[has_dt_bias] for fn in host_path] == [True, False]  # the third call reuses the first launch
    assert host_path[1].calls[0][6] is None and len(host_path[0].calls) == 2


@pytest.mark.parametrize("entry", ["packed", "unpacked"])
def test_debug_validate_rejects_duplicate_active_slots_on_the_hot_path(entries_on_cpu, make_case, entry,
                                                                       monkeypatch):
    case = make_case(3, 12, slots=[4, 1, 4], device="cpu")
    run = _packed_entry if entry == "packed" else _unpacked_entry
    run(case)  # knob off: not checked (a caller error), launched
    assert sum(len(fn.calls) for fn in entries_on_cpu) == 1
    monkeypatch.setenv("KDA_DEBUG_VALIDATE", "1")
    for _ in range(2):  # the remembered call (kda-core's re-validation) is checked too
        with pytest.raises(KDAError, match="^slot_indices: expected distinct active slots"):
            run(case)
    assert sum(len(fn.calls) for fn in entries_on_cpu) == 1
    case.slots = torch.tensor([4, 1, 99], dtype=torch.int32)  # an inactive row may repeat nothing: fine
    run(case)
    assert sum(len(fn.calls) for fn in entries_on_cpu) == 2


# Null-slot policies: a compile-time constant, in the variant key and the launch memo key.


def test_variant_key_separates_the_null_policy():
    from kda_core.contracts import NullSlotPolicy

    assert _field(_key(), "null_policy") is NullSlotPolicy.OUT_OF_RANGE
    assert _key(null_policy=NullSlotPolicy.NONPOSITIVE) != _key()
    assert _key(null_policy="nonpositive") == _key(null_policy=NullSlotPolicy.NONPOSITIVE)
    assert _key(slot_major=True, null_policy=NullSlotPolicy.NONPOSITIVE) != _key(slot_major=True)


def test_each_null_policy_gets_its_own_variant_and_a_repeated_one_reuses_its_launch(host_path, make_case):
    from kda_core.contracts import NullSlotPolicy

    case = make_case(3, 12, device="cpu")
    policies = [NullSlotPolicy.OUT_OF_RANGE, NullSlotPolicy.NONPOSITIVE, NullSlotPolicy.OUT_OF_RANGE,
                NullSlotPolicy.NONPOSITIVE]
    for policy in policies:
        _packed_call(case, null_policy=policy)
    assert [_field(fn.key, "null_policy") for fn in host_path] == policies[:2]
    assert [len(fn.calls) for fn in host_path] == [2, 2]
    with pytest.raises(KDAError, match="^null_policy: expected a NullSlotPolicy"):
        _packed_call(case, null_policy="nonpositive")


@pytest.mark.parametrize("entry", ["packed", "unpacked"])
def test_debug_validate_lets_rows_share_slot_0_only_where_it_is_null(entries_on_cpu, make_case, entry, monkeypatch):
    from kda_core.contracts import NullSlotPolicy

    run = _packed_entry if entry == "packed" else _unpacked_entry
    monkeypatch.setenv("KDA_DEBUG_VALIDATE", "1")
    case = make_case(4, 12, slots=[0, 3, 0, 0], device="cpu")  # vLLM's padding rows name slot 0
    run(case, null_policy=NullSlotPolicy.NONPOSITIVE)
    with pytest.raises(KDAError, match="^slot_indices: expected distinct active slots"):
        run(case)  # OUT_OF_RANGE: slot 0 is live, three rows race on it
    case.slots = torch.tensor([0, 3, 3, 0], dtype=torch.int32)
    with pytest.raises(KDAError, match="^slot_indices: expected distinct active slots"):
        run(case, null_policy=NullSlotPolicy.NONPOSITIVE)


# Layouts kda-core's validators still reject: int64 slot indices are a variant of their own.


def test_variant_key_separates_the_index_dtype():
    assert _field(_key(), "index_dtype") is torch.int32
    assert _key(index_dtype=torch.int64) != _key()
    with pytest.raises(KDAError, match="^slot_indices: expected dtype int32 or int64"):
        _key(index_dtype=torch.int16)


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_int64_slot_indices_compile_the_int64_variant(host_path, make_case, packed):
    import dataclasses

    from kda_core.validation import validate_decode_t1
    from kda_cute import decode_t1

    case = make_case(3, 12, device="cpu")
    call = validate_decode_t1(case.q, case.k, case.v, case.g, case.beta, case.pool, case.slots, device_kind="any",
                              **case.kwargs())
    for slots in (case.slots, case.slots.long()):
        described = dataclasses.replace(call)  # as kda-core will: int32 and int64 calls are distinct descriptions
        if packed:
            decode_t1._run_packed(described, case.mixed_qkv, case.raw_gate, case.raw_beta, case.pool, slots,
                                  case.A_log, case.dt_bias, True, None)
        else:
            decode_t1._run(described, case.q, case.k, case.v, case.g, case.beta, case.pool, slots, case.A_log,
                           case.dt_bias, True, None)
    assert [_field(fn.key, "index_dtype") for fn in host_path] == [torch.int32, torch.int64]
    assert host_path[1].calls[0][6 if packed else 8].dtype is torch.int64  # handed over as it is


# The varlen form (tokens [1, T, H, 128] + cu_seqlens [S + 1]) through _run_varlen.


def test_variant_key_of_the_varlen_form():
    assert _field(_key(), "cu_dtype") is None
    assert _key(cu_dtype=torch.int32) != _key() and _key(cu_dtype=torch.int64) != _key(cu_dtype=torch.int32)
    assert _field(_key(cu_dtype=torch.int32, slot_major=True), "slot_major") is False  # never slot-major
    with pytest.raises(KDAError, match="^cu_seqlens: expected the unpacked entry"):
        _key(cu_dtype=torch.int32, packed=True)
    with pytest.raises(KDAError, match="^cu_seqlens: expected dtype int32 or int64"):
        _key(cu_dtype=torch.int16)


def _varlen_call(case, n_seq, slots, cu, output=None, **kw):
    import dataclasses

    from kda_core.validation import validate_decode_t1
    from kda_cute import decode_t1

    T = case.q.shape[0]
    call = validate_decode_t1(case.q, case.k, case.v, case.g, case.beta, case.pool,
                              torch.zeros(T, dtype=torch.int32), device_kind="any", **case.kwargs())
    call = dataclasses.replace(call, B=n_seq)
    tokens = [x.transpose(0, 1) for x in (case.q, case.k, case.v, case.g, case.beta)]
    return decode_t1._run_varlen(call, *tokens, case.pool, slots, cu, case.A_log, case.dt_bias, True, output, **kw)


def test_varlen_path_hands_the_token_views_and_offsets_to_the_varlen_variant(host_path, make_case):
    from kda_cute import decode_t1

    case = make_case(5, 12, device="cpu")
    slots = torch.tensor([3, 1, 4], dtype=torch.int32)
    cu = torch.tensor([0, 1, 3, 5], dtype=torch.int64)
    out = _varlen_call(case, 3, slots, cu, config=decode_t1.DecodeT1Config(128, bulk_ring=8, slot_major=True))
    (fn,) = host_path
    assert _field(fn.key, "cu_dtype") is torch.int64 and _field(fn.key, "slot_major") is False
    assert _field(fn.key, "bulk_ring") == 8
    (args,) = fn.calls
    assert args[0].shape == (1, 5, 12, 128) and args[0].data_ptr() == case.q.data_ptr()
    assert args[8] is slots and args[9] is cu and args[10] is out and out.shape == (1, 5, 12, 128)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_varlen_form_on_an_odd_pool_takes_the_ring_where_the_dense_form_does(state_dtype, entries_on_cpu,
                                                                                 make_case):
    """A `+17` pool past the ring rows: the varlen form takes the realigning ring as the dense call does."""
    case = make_case(64, 12, device="cpu", state_dtype=state_dtype, pool_row_pad=17)
    slots = torch.arange(64, dtype=torch.int32)
    _varlen_call(case, 64, slots, torch.arange(65, dtype=torch.int32))
    _unpacked_entry(case)
    varlen, dense = entries_on_cpu
    for fn in (varlen, dense):
        assert _field(fn.key, "realign_pool") is True and _field(fn.key, "bulk_ring") == 8
        assert _field(fn.key, "tile_v") == 128
    assert _field(varlen.key, "rows_in_flight") == _field(dense.key, "rows_in_flight")


def test_varlen_path_checks_the_offsets_length_and_launches_nothing_without_sequences_or_tokens(host_path, make_case):
    case = make_case(4, 12, device="cpu")
    with pytest.raises(KDAError, match=r"^cu_seqlens: expected shape \[3\]"):
        _varlen_call(case, 2, torch.tensor([1, 2], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32))
    out = _varlen_call(case, 0, torch.zeros(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
    assert out.shape == (1, 4, 12, 128) and host_path == []  # no sequence
    empty = make_case(1, 12, device="cpu")
    for name in ("q", "k", "v", "g", "beta"):
        setattr(empty, name, getattr(empty, name)[:0])
    out = _varlen_call(empty, 2, torch.tensor([1, 2], dtype=torch.int32), torch.zeros(3, dtype=torch.int32))
    assert out.shape == (1, 0, 12, 128)
    assert all(fn.calls == [] for fn in host_path)  # configured, never launched: no token


def test_varlen_refuses_more_sequences_than_grid_z_before_compiling(host_path):
    from kda_cute import decode_t1

    with pytest.raises(KDAError, match="^cu_seqlens: expected at most 65535 sequences"):
        decode_t1._configure(("varlen-big",), _big_call(decode_t1.GRID_Z_MAX + 1, 4), False, True, torch.empty(1),
                             torch.bfloat16, torch.bfloat16, True, cu_dtype=torch.int32)
    assert host_path == []


# The public entries take the serving layouts kda-core now accepts (any pool slot stride >= the row, int32 or int64
# slot indices of any stride) and compile the variant of what they were given: the index dtype, the alignment class
# of the pool stride, the null policy.


@pytest.mark.parametrize("entry", [_packed_entry, _unpacked_entry], ids=["packed", "unpacked"])
def test_the_entries_compile_the_variant_of_the_serving_layout_they_get(entries_on_cpu, make_case, entry):
    from kda_core.contracts import NullSlotPolicy

    case = make_case(3, 12, device="cpu")
    entry(case)
    case64 = make_case(3, 12, device="cpu", pool_row_pad=17)
    wide = torch.full((3, 4), -9, dtype=torch.int64)
    wide[:, 2] = case64.slots.long()
    case64.slots = wide[:, 2]
    entry(case64, null_policy=NullSlotPolicy.NONPOSITIVE)
    entry(case64, null_policy=NullSlotPolicy.NONPOSITIVE)  # the same facts: no new variant
    first, second = entries_on_cpu
    assert _field(first.key, "index_dtype") is torch.int32 and _field(first.key, "aligned") is True
    assert _field(first.key, "null_policy") is NullSlotPolicy.OUT_OF_RANGE
    assert _field(first.key, "realign_pool") is False
    # only the pool is misaligned (slot stride row + 17): the pool-realigning variant, the rest read in vectors
    assert _field(second.key, "index_dtype") is torch.int64 and _field(second.key, "aligned") is True
    assert _field(second.key, "realign_pool") is True
    assert _field(second.key, "null_policy") is NullSlotPolicy.NONPOSITIVE
    assert len(second.calls) == 2
    slots_arg = second.calls[0][6 if entry is _packed_entry else 8]
    assert slots_arg is case64.slots and slots_arg.stride() == (4,)  # handed to the kernel as it is


@pytest.mark.parametrize("entry", [_packed_entry, _unpacked_entry], ids=["packed", "unpacked"])
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_misaligned_call_takes_the_realigning_variant_without_slot_major(entries_on_cpu, make_case, entry,
                                                                            state_dtype):
    from kda_cute import decode_t1

    # B*H past the ring rows and a pool of at most 1.25 B rows: the aligned pool would take ring + slot-major
    case = make_case(512, 12, device="cpu", state_dtype=state_dtype, n_slots=520, pool_row_pad=17)
    entry(case)
    # a misaligned activation as well (mixed_qkv / q one element in): the same pool path, the rest element-wise
    both = make_case(3, 12, device="cpu", state_dtype=state_dtype, pool_row_pad=17, row_shift=1)
    entry(both)
    # only an activation misaligned, the pool aligned: the pool path too (its slots all read as aligned ones)
    act = make_case(3, 12, device="cpu", state_dtype=state_dtype, row_shift=1)
    entry(act)
    # everything aligned: the aligned variant, which never realigns
    entry(make_case(3, 12, device="cpu", state_dtype=state_dtype))
    realigned, elementwise, act_only, aligned = entries_on_cpu
    assert _field(realigned.key, "aligned") is True and _field(realigned.key, "realign_pool") is True
    # the realigning ring where the schedule takes it, never a slot-major grid
    assert _field(realigned.key, "bulk_ring") == 8 and _field(realigned.key, "slot_major") is False
    assert _field(realigned.key, "tile_v") == 128
    for other in (elementwise, act_only):
        assert _field(other.key, "aligned") is False and _field(other.key, "realign_pool") is True
    assert _field(aligned.key, "aligned") is True and _field(aligned.key, "realign_pool") is False
    # the key normalises: the realigning ring from 3 chunks deep, no slot-major grid with a realigned pool
    base = dict(state_dtype=state_dtype, g_dtype=torch.bfloat16, beta_dtype=torch.bfloat16,
                gate=decode_t1.GateMode.LOWER_BOUND, beta_is_logit=True, use_qk_l2norm=True, has_dt_bias=True,
                tile_v=128)
    assert _field(decode_t1.variant_key(**base, aligned=False, realign_pool=True), "realign_pool") is True
    ringed = decode_t1.variant_key(**base, aligned=True, realign_pool=True, bulk_ring=8, slot_major=True)
    assert _field(ringed, "bulk_ring") == 8 and _field(ringed, "slot_major") is False
    assert _field(decode_t1.variant_key(**base, aligned=True, realign_pool=True, bulk_ring=2), "bulk_ring") == 0


def test_debug_validation_of_the_entries_lets_slot_0_repeat_under_nonpositive(entries_on_cpu, make_case,
                                                                                monkeypatch):
    from kda_core.contracts import NullSlotPolicy
    from kda_core.errors import KDAError

    monkeypatch.setenv("KDA_DEBUG_VALIDATE", "1")
    case = make_case(3, 12, device="cpu")
    case.slots = torch.tensor([0, 2, 0], dtype=torch.int64)
    with pytest.raises(KDAError, match="^slot_indices: expected distinct active slots"):
        _unpacked_entry(case)
    _unpacked_entry(case, null_policy=NullSlotPolicy.NONPOSITIVE)
    assert len(entries_on_cpu) == 1


# ---------------------------------------------------------------------------------------------------------------
# The packed entry's token form (vLLM Kimi K3's raw gate [1, B, H, 128], raw beta [1, B, H], output [1, B, H, 128]):
# the compiled function takes those tensors as they are.


def _tokens(case, out=True):
    """The token-form tensors of ``case`` (views of its packed rows: the same memory) and an output."""
    B, H = case.raw_beta.shape
    gate = case.raw_gate.unsqueeze(0).unflatten(2, (H, HEAD_DIM))
    beta = case.raw_beta.unsqueeze(0)
    return gate, beta, (torch.zeros(1, B, H, HEAD_DIM, dtype=torch.bfloat16) if out else None)


def _tokens_entry(case, gate, beta, output, **over):
    from kda_cute.decode_t1 import kda_decode_t1_packed_tokens

    kw = {**case.kwargs(), **over}
    return kda_decode_t1_packed_tokens(case.mixed_qkv, gate, beta, case.pool, case.slots, output=output, **kw)


def test_the_token_form_hands_the_tensors_as_they_are_to_its_variant(entries_on_cpu, make_case):
    from kda_core import validation
    from kda_cute import decode_t1

    case = make_case(3, 12, device="cpu", row_pad=8)
    gate, beta, out = _tokens(case)
    assert _tokens_entry(case, gate, beta, out) is out
    assert _tokens_entry(case, *_tokens(case)) is not out  # new tensors of the same facts: the same launch
    (fn,) = entries_on_cpu
    assert decode_t1.PACKED_TOKENS == _field(fn.key, "packed") and len(fn.calls) == 2
    args = fn.calls[0]
    assert args[0] is case.mixed_qkv and args[1] is gate and args[2] is beta and args[7] is out
    assert args[5] is case.pool and args[6] is case.slots
    # The description is the packed form's on the [B, H*128], [B, H], [B, 1, H, 128] views of the same memory.
    call = validation.revalidate_packed_tokens_decode_t1(case.mixed_qkv, gate, beta, case.pool, case.slots,
                                                         case.A_log, case.dt_bias, case.lower_bound, True, True, None,
                                                         out)
    assert call is validation.validate_packed_decode_t1(
        case.mixed_qkv, case.raw_gate, case.raw_beta, case.pool, case.slots, num_heads=12, output=out.transpose(0, 1),
        **case.kwargs())
    allocated = _tokens_entry(case, gate, beta, None)
    assert allocated.shape == (1, 3, 12, HEAD_DIM) and allocated.dtype is torch.bfloat16
    assert len(entries_on_cpu) == 2  # with no output: another alignment class of the description, or the same
    # variant's launch; either way the packed [B, ...] variant never runs the token form
    assert all(_field(f.key, "packed") == decode_t1.PACKED_TOKENS for f in entries_on_cpu)


def _overlapping_output(case, gate, beta, out):
    return dict(output=case.mixed_qkv.unsqueeze(0)[..., : 12 * HEAD_DIM].unflatten(2, (12, HEAD_DIM)))


TOKEN_RULES = [
    ("raw_gate rank", lambda c, g, b, o: dict(gate=g[0]), "raw_gate", "4-D"),
    # H is raw_gate's dim 2: a mixed_qkv row of another width is refused against it
    ("raw_gate heads", lambda c, g, b, o: dict(gate=g[:, :, :8]), "mixed_qkv", "3*num_heads"),
    ("raw_beta rank", lambda c, g, b, o: dict(beta=b[0]), "raw_beta", "[1, B, H]"),
    ("output rank", lambda c, g, b, o: dict(output=o[0]), "output", "[1, B, H, 128]"),
    ("output over mixed_qkv", lambda c, g, b, o: _overlapping_output(c, g, b, o), "output", "mixed_qkv"),
    ("output tokens overlap", lambda c, g, b, o: dict(output=o[:, :1].expand(1, 3, 12, HEAD_DIM)), "output",
     "overlap"),
    ("lower_bound", lambda c, g, b, o: dict(lower_bound=0.5), "lower_bound", "negative"),
    ("pool heads", lambda c, g, b, o: dict(state_pool=c.pool[:, :8]), "state_pool", "shape"),
]


@pytest.mark.parametrize("change, argument, fragment", [r[1:] for r in TOKEN_RULES], ids=[r[0] for r in TOKEN_RULES])
def test_a_bad_token_form_call_after_a_good_one_raises_naming_the_argument(entries_on_cpu, make_case, change,
                                                                             argument, fragment):
    import dataclasses

    case = make_case(3, 12, device="cpu")
    gate, beta, out = _tokens(case)
    _tokens_entry(case, gate, beta, out)  # described and launched
    over = change(case, gate, beta, out)
    gate, beta, out = over.pop("gate", gate), over.pop("beta", beta), over.pop("output", out)
    if "state_pool" in over:
        case = dataclasses.replace(case, pool=over.pop("state_pool"))
    with pytest.raises(KDAError, match=rf"^{argument}: expected") as info:
        _tokens_entry(case, gate, beta, out, **over)
    assert fragment in str(info.value), info.value
    (fn,) = entries_on_cpu
    assert len(fn.calls) == 1


def test_a_wrapper_rejection_of_the_token_form_names_the_argument(entries_on_cpu, make_case):
    case = make_case(3, 12, device="cpu")
    gate, beta, out = _tokens(case)
    _tokens_entry(case, gate, beta, out)
    (fn,) = entries_on_cpu
    fn.reject = ValueError("Mismatched Tensor on argument #3, expected dtype=float32")
    with pytest.raises(KDAError, match="^A_log: expected"):
        _tokens_entry(case, gate, beta, out, A_log=case.A_log.half())
    assert len(fn.calls) == 2  # the broken call took the hot path to the wrapper
    with pytest.raises(KDAError, match="^raw_gate: expected each token's"):  # static strides: the wrapper's
        _tokens_entry(case, gate.transpose(2, 3).contiguous().transpose(2, 3), beta, out)
    assert len(fn.calls) == 3


def test_a_token_form_batch_past_grid_z_splits_along_the_token_dim(host_path, monkeypatch):
    from kda_cute import decode_t1

    B = decode_t1.GRID_Z_MAX + 5
    monkeypatch.setenv("KDA_DECODE_TILE_V", "64")  # tile 64: never the slot-major grid
    entry = decode_t1._configure(("big", "tokens"), _big_call(B, 4), decode_t1.PACKED_TOKENS, True, torch.empty(1),
                                 torch.bfloat16, torch.bfloat16, True)
    rows, tokens = torch.empty(1, 8).expand(B, 8), torch.empty(1, 1, 8).expand(1, B, 8)
    args = [rows if i in (0, 6) else tokens if i in (1, 2, 7) else object() for i in range(10)]
    entry[1](*args)
    (fn,) = host_path
    assert [part[0].shape[0] for part in fn.calls] == [decode_t1.GRID_Z_MAX, 5]
    for part in fn.calls:
        assert all(part[i].shape[1] == part[0].shape[0] for i in (1, 2, 7)) and part[6].shape[0] == part[0].shape[0]
        assert all(part[i] is args[i] for i in (3, 4, 5, 8, 9))
    decode_t1._LAUNCH_MEMO.pop(("big", "tokens"), None)
