"""Every routing rule of ``recurrent_kda`` and its kill switch, on the CPU.

The kernel entry points are replaced by recorders that run the kda-core oracle with the arguments the facade passed
them, so a test sees both WHICH path ran and whether the facade handed that path the right arguments. "CUDA" is
simulated by marking the validated call as on a CUDA device (the only fact routing reads about the device).
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings

import pytest
import torch

from kda_core.call_args import RecurrentArgs
from kda_core.contracts import GateMode, NullSlotPolicy
from kda_core.errors import KDAError
from kda_core.oracle import recurrent_kda_ref, recurrent_kda_ref_args
from kda_core.validation import validate_recurrent
from kda_recurrent import facade
from kda_recurrent.facade import Path, explain, recurrent_kda

BF16 = torch.bfloat16


class Recorder:
    """Stands in for the kda-cute entry points; records the path of every launch."""

    def __init__(self):
        self.paths: list[Path] = []

        self.policies: list[NullSlotPolicy] = []

    def t1(self, call, q, k, v, g, beta, state_pool, slot_indices, A_log, dt_bias, use_qk_l2norm_in_kernel, output,
           null_policy):
        """The T=1 kernel's contract: gate mode, lower bound, beta convention and scale come from the validated
        call (a wrong description shows as a mismatch with the oracle run on the facade's own arguments); the null
        policy is the trailing argument of decode_t1._run, a NullSlotPolicy member."""
        return self._t1(Path.T1, call, q, k, v, g, beta, state_pool, slot_indices, None, A_log, dt_bias,
                        use_qk_l2norm_in_kernel, output, null_policy)

    def t1_varlen(self, call, q, k, v, g, beta, state_pool, slot_indices, cu_seqlens, A_log, dt_bias,
                  use_qk_l2norm_in_kernel, output, null_policy):
        """decode_t1._run_varlen's contract: [1, T, H, 128] tokens, the offsets as given (never read on the host)."""
        assert call.varlen and call.mode == "pool" and q.shape[0] == 1
        return self._t1(Path.T1_VARLEN, call, q, k, v, g, beta, state_pool, slot_indices, cu_seqlens, A_log,
                        dt_bias, use_qk_l2norm_in_kernel, output, null_policy)

    def _t1(self, path, call, q, k, v, g, beta, state_pool, slot_indices, cu_seqlens, A_log, dt_bias, l2norm, output,
            null_policy):
        assert type(null_policy) is NullSlotPolicy
        self.paths.append(path)
        self.policies.append(null_policy)
        o, _ = recurrent_kda_ref(
            q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, scale=call.scale, initial_state=state_pool,
            use_qk_l2norm_in_kernel=l2norm,
            use_gate_in_kernel=call.gate_mode is not GateMode.PRECOMPUTED, lower_bound=call.lower_bound,
            beta_is_logit=call.beta_is_logit, ssm_state_indices=slot_indices, cu_seqlens=cu_seqlens,
            null_policy=null_policy,
        )
        if output is None:
            return o
        output.copy_(o)
        return output

    def generic(self, call, args, *, null_policy):
        """The generic kernel's contract: the validated description of exactly the bundle it gets, and the policy
        as kda_cute.generic.run's keyword."""
        assert type(null_policy) is NullSlotPolicy
        self.paths.append(Path.GENERIC)
        self.policies.append(null_policy)
        assert type(args) is RecurrentArgs
        described = validate_recurrent(args)  # kda-core's own validator: the facade's may be a counting stand-in
        assert call == dataclasses.replace(described, on_cuda=call.on_cuda, t1_eligible=call.t1_eligible)
        return recurrent_kda_ref_args(args, null_policy=null_policy)


@pytest.fixture
def kernels(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(facade, "_t1_kernel", rec.t1)
    monkeypatch.setattr(facade, "_t1_varlen_kernel", rec.t1_varlen)
    monkeypatch.setattr(facade, "_generic_kernel", rec.generic)
    monkeypatch.delenv("KDA_T1_FAST_PATH", raising=False)
    return rec


@pytest.fixture
def as_if_cuda(monkeypatch):
    """Validate for real, then mark the call as on CUDA; T=1 eligibility is then what it would be on a GPU."""
    real = facade._validate

    def validate(args):
        call = real(args)
        eligible = call.t1_eligible or "tensors not on a CUDA device" in call.t1_reason
        return dataclasses.replace(call, on_cuda=True, t1_eligible=eligible)

    monkeypatch.setattr(facade, "_validate", validate)


def make_call(B=3, T=1, H=12, HV=None, K=128, mode="pool", N=8, act=BF16, gate=True, l2norm=True, seed=0):
    """Keyword arguments of one recurrent_kda call. mode: pool | spec | dense | varlen."""
    HV = HV or H
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, dtype=act):
        return torch.randn(*shape, generator=gen).to(dtype)

    Bq = 1 if mode.startswith("varlen") else B
    Tq = 2 * B if mode.startswith("varlen") else T
    kw = dict(q=rnd(Bq, Tq, H, K), k=rnd(Bq, Tq, H, K), v=rnd(Bq, Tq, HV, K), g=rnd(Bq, Tq, HV, K, dtype=BF16),
              beta=rnd(Bq, Tq, HV, dtype=BF16), use_qk_l2norm_in_kernel=l2norm)
    if gate:
        kw.update(A_log=rnd(H, dtype=torch.float32) * 0.1, dt_bias=rnd(H * K, dtype=torch.float32),
                  use_gate_in_kernel=True, lower_bound=-5.0, beta_is_logit=True)
    else:
        kw.update(g=-torch.rand(Bq, Tq, HV, K, generator=gen), beta=torch.rand(Bq, Tq, HV, generator=gen))
    pool = rnd(N, HV, K, K, dtype=BF16) * 0.1
    if mode == "pool":
        kw.update(initial_state=pool, ssm_state_indices=torch.tensor([5, 0, -1, 2, 7][:B], dtype=torch.int32))
    elif mode == "spec":
        idx = torch.arange(B * T, dtype=torch.int32).reshape(B, T) % N
        kw.update(initial_state=pool, ssm_state_indices=idx,
                  num_accepted_tokens=torch.tensor([1, T, 2][:B], dtype=torch.int32))
    elif mode == "varlen":
        kw.update(cu_seqlens=torch.tensor([0, 2, 2, 2 * B][: B + 1], dtype=torch.int32),
                  initial_state=pool, ssm_state_indices=torch.tensor([1, 4, 6][:B], dtype=torch.int32))
    elif mode == "varlen_spec":
        kw.update(cu_seqlens=torch.tensor([0, 2, 2, 2 * B][: B + 1], dtype=torch.int32), initial_state=pool,
                  ssm_state_indices=torch.arange(B * 4, dtype=torch.int32).reshape(B, 4) % N)
    else:
        kw.update(initial_state=rnd(B, HV, K, K, dtype=torch.float32), output_final_state=True)
    return kw


def clone_call(kw):
    """Deep copies of the inputs; a given ``output`` buffer stays the same object."""
    return {n: (t.clone() if isinstance(t, torch.Tensor) and n != "output" else t) for n, t in kw.items()}


def assert_matches_oracle(kw):
    """Run the facade and the oracle on copies; outputs and states must be identical (the recorders ARE the oracle)."""
    mine, ref = clone_call(kw), clone_call(kw)
    ref.pop("output", None)
    o, s = recurrent_kda(**mine)
    o_ref, s_ref = recurrent_kda_ref(**ref)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    if s_ref is not None:
        torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
    return o, s, mine


# ---------------------------------------------------------------------------------------------------------------


def test_cpu_tensors_run_the_oracle_and_launch_nothing(kernels):
    kw = make_call()
    assert_matches_oracle(kw)
    assert kernels.paths == []
    assert explain(**kw).path is Path.ORACLE


def test_t1_eligible_call_takes_the_t1_kernel(kernels, as_if_cuda):
    kw = make_call()
    assert explain(**kw).path is Path.T1
    _, pool, mine = assert_matches_oracle(kw)
    assert kernels.paths == [Path.T1]
    assert pool is mine["initial_state"]


def test_kill_switch_sends_t1_eligible_calls_to_the_generic_kernel(kernels, as_if_cuda, monkeypatch):
    monkeypatch.setenv("KDA_T1_FAST_PATH", "0")
    kw = make_call()
    route = explain(**kw)
    assert route.path is Path.GENERIC and "KDA_T1_FAST_PATH=0" in route.reason
    assert_matches_oracle(kw)
    assert kernels.paths == [Path.GENERIC]


def test_kill_switch_is_read_at_call_time(kernels, as_if_cuda, monkeypatch):
    kw = make_call()
    recurrent_kda(**clone_call(kw))
    monkeypatch.setenv("KDA_T1_FAST_PATH", "off")
    recurrent_kda(**clone_call(kw))
    monkeypatch.setenv("KDA_T1_FAST_PATH", "1")
    recurrent_kda(**clone_call(kw))
    assert kernels.paths == [Path.T1, Path.GENERIC, Path.T1]


def test_bad_kill_switch_value_names_the_knob(kernels, as_if_cuda, monkeypatch):
    monkeypatch.setenv("KDA_T1_FAST_PATH", "maybe")
    with pytest.raises(KDAError, match="KDA_T1_FAST_PATH"):
        recurrent_kda(**make_call())
    assert kernels.paths == []


@pytest.mark.parametrize(
    "case, kw",
    [
        ("T=2 dense", dict(T=2, mode="dense")),
        ("T=4 pool", dict(T=4)),
        ("spec decode 2-D indices", dict(T=3, mode="spec")),
        ("varlen spec decode", dict(mode="varlen_spec", N=16)),
        ("varlen GQA", dict(mode="varlen", H=4, HV=8)),
        ("T=1 dense states", dict(mode="dense")),
        ("GQA", dict(H=4, HV=8)),
        ("K=64", dict(K=64)),
        ("H not a T=1 head count", dict(H=6)),
        ("fp32 activations", dict(act=torch.float32)),
        ("no in-kernel L2 norm", dict(l2norm=False)),
        ("precomputed fp32 gate, T=2", dict(T=2, gate=False)),
    ],
)
def test_every_other_cuda_call_takes_the_generic_kernel(kernels, as_if_cuda, case, kw):
    call = make_call(**kw)
    route = explain(**call)
    assert route.path is Path.GENERIC, route
    assert "not T=1 eligible" in route.reason
    assert_matches_oracle(call)
    assert kernels.paths == [Path.GENERIC]


def test_precomputed_fp32_gate_at_t1_still_takes_the_fast_path(kernels, as_if_cuda):
    kw = make_call(gate=False)
    assert explain(**kw).path is Path.T1
    assert_matches_oracle(kw)
    assert kernels.paths == [Path.T1]


def test_without_kda_cute_cuda_calls_run_the_oracle_with_one_warning(kernels, as_if_cuda, monkeypatch):
    monkeypatch.setattr(facade, "_t1_kernel", None)
    monkeypatch.setattr(facade, "_generic_kernel", None)
    monkeypatch.setattr(facade, "_missing", {"t1": "ImportError: no kda_cute", "generic": "ImportError: no kda_cute"})
    monkeypatch.setattr(facade, "_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for kw in (make_call(), make_call(T=2, mode="dense"), make_call()):
            assert explain(**kw).path is Path.ORACLE
            assert_matches_oracle(kw)
    mine = [w for w in caught if "kda-cute" in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in caught]
    assert "no kda_cute" in str(mine[0].message)
    assert kernels.paths == []


def test_a_missing_generic_kernel_does_not_hide_the_t1_kernel(kernels, as_if_cuda, monkeypatch):
    monkeypatch.setattr(facade, "_generic_kernel", None)
    monkeypatch.setattr(facade, "_missing", {"generic": "ImportError: kda_cute.generic"})
    monkeypatch.setattr(facade, "_warned", True)
    recurrent_kda(**make_call())
    recurrent_kda(**make_call(T=2, mode="dense"))
    assert kernels.paths == [Path.T1]
    assert "kda_cute.generic" in explain(**make_call(T=2, mode="dense")).reason


def test_kernel_modules_are_imported_once_not_per_call(kernels, as_if_cuda, monkeypatch):
    loads = []
    monkeypatch.setattr(facade, "_t1_kernel", facade._UNLOADED)

    def load(name):
        loads.append(name)
        monkeypatch.setattr(facade, "_t1_kernel", kernels.t1)
        return kernels.t1

    monkeypatch.setattr(facade, "_load", load)
    for _ in range(3):
        recurrent_kda(**make_call())
    assert loads == ["t1"] and kernels.paths == [Path.T1] * 3


def test_given_output_is_written_and_returned(kernels, as_if_cuda):
    for kw in (make_call(), make_call(T=2, mode="spec")):
        out = torch.full(kw["v"].shape, 7.0, dtype=BF16)
        o, _, _ = assert_matches_oracle({**kw, "output": out})
        assert o is out


def test_given_output_is_written_on_the_oracle_path():
    kw = make_call(T=2, mode="dense")
    out = torch.full(kw["v"].shape, 7.0, dtype=BF16)
    o, _, _ = assert_matches_oracle({**kw, "output": out})
    assert o is out


# ---------------------------------------------------------------------------------------------------------------
# Bad inputs: the kda-core error, naming the argument, before any launch.


def _bad(kw, **changes):
    return {**kw, **changes}


BAD_CASES = [
    ("k", lambda kw: _bad(kw, k=kw["k"][:, :, :6])),
    ("v", lambda kw: _bad(kw, v=kw["v"][..., :64])),
    ("g", lambda kw: _bad(kw, g=kw["g"][:, :, :6])),
    ("beta", lambda kw: _bad(kw, beta=kw["beta"][..., None])),
    ("q", lambda kw: _bad(kw, q=kw["q"].to(torch.int32))),
    ("q", lambda kw: _bad(kw, q=kw["q"].transpose(-1, -2).contiguous().transpose(-1, -2))),
    ("ssm_state_indices", lambda kw: _bad(kw, ssm_state_indices=kw["ssm_state_indices"].short())),
    ("ssm_state_indices", lambda kw: _bad(kw, ssm_state_indices=kw["ssm_state_indices"][:2])),
    ("initial_state", lambda kw: _bad(kw, initial_state=None)),
    ("initial_state", lambda kw: _bad(kw, initial_state=kw["initial_state"].half())),
    ("initial_state", lambda kw: _bad(kw, initial_state=kw["initial_state"].transpose(-1, -2))),
    ("num_accepted_tokens", lambda kw: _bad(kw, num_accepted_tokens=torch.ones(3, dtype=torch.int32))),
    ("A_log", lambda kw: _bad(kw, A_log=None)),
    ("A_log", lambda kw: _bad(kw, A_log=kw["A_log"].double())),
    ("dt_bias", lambda kw: _bad(kw, dt_bias=kw["dt_bias"][:100])),
    ("lower_bound", lambda kw: _bad(kw, lower_bound=2.0)),
    ("output", lambda kw: _bad(kw, output=torch.empty(kw["v"].shape, dtype=torch.float32))),
    ("output", lambda kw: _bad(kw, output=torch.empty(3, 2, 12, 128, dtype=BF16))),
    ("q", lambda kw: _bad(kw, cu_seqlens=torch.tensor([0, 1, 2, 3], dtype=torch.int32))),
    ("cu_seqlens", lambda kw: _bad(kw, cu_seqlens=torch.tensor([0.0, 1.0]))),
]


@pytest.mark.parametrize("argument, breaker", BAD_CASES, ids=[f"{a}-{i}" for i, (a, _) in enumerate(BAD_CASES)])
def test_bad_inputs_raise_the_kda_error_before_any_launch(kernels, as_if_cuda, argument, breaker):
    kw = breaker(make_call())
    pool_before = kw["initial_state"].clone() if isinstance(kw.get("initial_state"), torch.Tensor) else None
    with pytest.raises(KDAError, match=rf"^{argument}: expected"):
        recurrent_kda(**kw)
    with pytest.raises(KDAError, match=rf"^{argument}: expected"):
        explain(**kw)
    assert kernels.paths == []
    if pool_before is not None and kw["initial_state"].device.type == "cpu":
        assert torch.equal(kw["initial_state"], pool_before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("argument", ["k", "beta", "initial_state", "ssm_state_indices", "A_log"])
def test_a_tensor_on_another_device_raises_before_any_launch(kernels, argument):
    kw = {n: (t.cuda() if isinstance(t, torch.Tensor) else t) for n, t in make_call().items()}
    kw[argument] = kw[argument].cpu()
    with pytest.raises(KDAError, match=rf"^{argument}: expected"):
        recurrent_kda(**kw)
    assert kernels.paths == []


def test_kda_error_is_a_value_error():
    assert issubclass(KDAError, ValueError)


def test_t1_entry_is_the_launch_on_the_validated_call_without_validating_again(monkeypatch):
    decode_t1 = pytest.importorskip("kda_cute.decode_t1")
    launches = []
    monkeypatch.setattr(decode_t1, "_run", lambda *args: launches.append(args) or "o")
    monkeypatch.setattr(decode_t1, "kda_decode_t1", lambda *a, **k: pytest.fail("validated twice"))
    assert facade._t1_entry() is decode_t1._run  # no adapter frame between the facade and the launch
    kw = make_call()
    call = facade._validate(RecurrentArgs(**kw))
    o = facade._t1_entry()(call, kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], kw["initial_state"],
                           kw["ssm_state_indices"], kw["A_log"], kw["dt_bias"], True, None)
    assert o == "o" and len(launches) == 1
    args = launches[0]
    assert args[0] is call  # the validated description: gate mode, scale, lower bound, alignment class
    assert args[1:8] == (kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], kw["initial_state"], kw["ssm_state_indices"])
    assert args[8] is kw["A_log"] and args[9] is kw["dt_bias"] and args[10] is True and args[11] is None
    assert call.scale == 128**-0.5 and call.lower_bound == -5.0


def test_the_facade_validates_once_per_call(kernels, as_if_cuda, monkeypatch):
    from kda_core import validation

    seen = []
    real = facade._validate
    monkeypatch.setattr(facade, "_validate", lambda args: seen.append(1) or real(args))
    for name in ("validate_decode_t1", "validate_packed_decode_t1"):
        monkeypatch.setattr(validation, name, lambda *a, **k: pytest.fail("validated twice"))
    recurrent_kda(**make_call())
    assert seen == [1] and kernels.paths == [Path.T1]


@pytest.fixture
def hot_path(kernels, as_if_cuda, monkeypatch):
    """The facade's re-validation as on a GPU: a call described before comes back without the full validator
    (counted in ``validations``); ``reject`` makes the T=1 entry raise as its compiled wrapper does."""
    state = dict(described=None, validations=0, reject=None)
    full, t1 = facade._validate, kernels.t1

    def validate(args):
        state["validations"] += 1
        state["described"] = full(args)
        return state["described"]

    def t1_entry(*args):
        if state["reject"] is not None:
            kernels.paths.append("rejected")
            raise state["reject"]
        return t1(*args)

    monkeypatch.setattr(facade, "_validate", validate)
    monkeypatch.setattr(facade, "_revalidate", lambda args: state["described"])
    monkeypatch.setattr(facade, "_t1_kernel", t1_entry)
    return state


def test_a_described_t1_call_launches_without_the_full_validator(kernels, hot_path):
    kw = make_call()
    assert_matches_oracle(kw)
    assert_matches_oracle(kw)
    assert kernels.paths == [Path.T1, Path.T1] and hot_path["validations"] == 1


def test_a_wrapper_rejection_on_the_hot_path_gets_the_full_validators_error(kernels, hot_path):
    kw = make_call()
    recurrent_kda(**clone_call(kw))
    hot_path["reject"] = ValueError("Mismatched Tensor on argument #5, expected dtype=float32")
    with pytest.raises(KDAError, match="^A_log: expected"):
        recurrent_kda(**{**clone_call(kw), "A_log": kw["A_log"].half()})
    assert kernels.paths == [Path.T1, "rejected"] and hot_path["validations"] == 2
    with pytest.raises(ValueError, match="^Mismatched Tensor"):  # the full path launches T=1 again: not swallowed
        recurrent_kda(**clone_call(kw))
    assert kernels.paths[2:] == ["rejected", "rejected"]


def test_the_kill_switch_holds_on_the_hot_path(kernels, hot_path, monkeypatch):
    kw = make_call()
    recurrent_kda(**clone_call(kw))
    monkeypatch.setenv("KDA_T1_FAST_PATH", "0")
    assert_matches_oracle(kw)
    assert kernels.paths == [Path.T1, Path.GENERIC]


# ---------------------------------------------------------------------------------------------------------------
# KDA_DEBUG_VALIDATE: duplicate active slots on every path


@pytest.mark.parametrize("mode", ["pool", "spec"])
def test_debug_validation_refuses_duplicate_active_slots_on_the_cpu(monkeypatch, mode):
    monkeypatch.setenv("KDA_DEBUG_VALIDATE", "1")
    kw = make_call(B=3, T=2 if mode == "spec" else 1, mode=mode)
    slots = torch.tensor([0, 0, 1], dtype=torch.int32) if mode == "pool" else torch.tensor(
        [[0, 1], [2, 0], [3, 4]], dtype=torch.int32)
    with pytest.raises(KDAError, match="^ssm_state_indices: expected distinct active slots"):
        recurrent_kda(**{**kw, "ssm_state_indices": slots})


def test_debug_validation_is_off_by_default(monkeypatch):
    monkeypatch.delenv("KDA_DEBUG_VALIDATE", raising=False)
    kw = make_call(B=3)
    recurrent_kda(**{**kw, "ssm_state_indices": torch.tensor([0, 0, 1], dtype=torch.int32)})


def test_debug_validation_refuses_duplicates_on_the_t1_kernel_path(kernels, as_if_cuda, monkeypatch):
    monkeypatch.setenv("KDA_DEBUG_VALIDATE", "1")
    kw = make_call(B=3)
    with pytest.raises(KDAError, match="^ssm_state_indices: expected distinct"):
        recurrent_kda(**{**kw, "ssm_state_indices": torch.tensor([4, 1, 4], dtype=torch.int32)})
    assert kernels.paths == []


def test_the_hot_path_does_not_bypass_debug_validation(kernels, hot_path, monkeypatch):
    kw = make_call(B=3)
    recurrent_kda(**clone_call(kw))  # described: the next call of these facts takes the hot path
    monkeypatch.setenv("KDA_DEBUG_VALIDATE", "1")
    with pytest.raises(KDAError, match="^ssm_state_indices: expected distinct"):
        recurrent_kda(**{**clone_call(kw), "ssm_state_indices": torch.tensor([2, 2, 0], dtype=torch.int32)})
    assert kernels.paths == [Path.T1]


# ---------------------------------------------------------------------------------------------------------------
# Inputs validation accepts have an answer on the CPU, or are refused


def test_dt_bias_is_optional_and_means_zeros(kernels):
    kw = make_call()
    o, _ = recurrent_kda(**{**clone_call(kw), "dt_bias": None})
    o_zeros, _ = recurrent_kda(**{**clone_call(kw), "dt_bias": torch.zeros_like(kw["dt_bias"])})
    torch.testing.assert_close(o, o_zeros, rtol=0, atol=0)


def test_the_t1_kernel_gets_an_absent_dt_bias_as_none(kernels, as_if_cuda, monkeypatch):
    """decode_t1._run compiles its variant without dt_bias for None (its launch memo keys on ``dt_bias is None``),
    so the facade hands None through on the T=1 entries, hot path and full path alike."""
    seen = []
    for name in ("_t1_kernel", "_t1_varlen_kernel"):
        entry = getattr(facade, name)
        monkeypatch.setattr(facade, name, lambda *a, _entry=entry, _i=9 if name == "_t1_kernel" else 10:
                            seen.append(a[_i]) or _entry(*a))
    kw = make_call()
    o, _ = recurrent_kda(**{**clone_call(kw), "dt_bias": None})
    o_zeros, _ = recurrent_kda_ref(**{**clone_call(kw), "dt_bias": torch.zeros_like(kw["dt_bias"])})
    torch.testing.assert_close(o, o_zeros, rtol=0, atol=0)
    recurrent_kda(**{**_varlen_decode([1, 2]), "dt_bias": None})
    assert kernels.paths == [Path.T1, Path.T1_VARLEN] and seen == [None, None]


def test_meta_tensors_are_refused_on_the_cpu_path():
    kw = {n: (t.to("meta") if isinstance(t, torch.Tensor) else t) for n, t in make_call().items()}
    with pytest.raises(KDAError, match="^q: expected tensors with data"):
        recurrent_kda(**kw)


def test_a_meta_pool_in_a_cpu_call_is_refused():
    kw = make_call()
    kw["initial_state"] = kw["initial_state"].to("meta")
    with pytest.raises(KDAError, match="^initial_state: expected a tensor on cpu"):
        recurrent_kda(**kw)


def test_an_output_that_requires_grad_is_written():
    kw = make_call()
    out = torch.zeros(3, 1, 12, 128, dtype=BF16, requires_grad=True)
    o, _ = recurrent_kda(**{**clone_call(kw), "output": out})
    o_ref, _ = recurrent_kda_ref(**clone_call(kw))
    assert o is out
    torch.testing.assert_close(out.detach(), o_ref, rtol=0, atol=0)


def test_a_pool_that_requires_grad_is_updated_in_place():
    kw = make_call()
    pool = kw["initial_state"].clone().requires_grad_(True)
    _, s = recurrent_kda(**{**clone_call(kw), "initial_state": pool})
    _, s_ref = recurrent_kda_ref(**clone_call(kw))
    assert s is pool
    torch.testing.assert_close(pool.detach(), s_ref, rtol=0, atol=0)


def test_an_empty_pool_makes_every_row_inactive():
    kw = make_call(N=8)
    kw["initial_state"] = kw["initial_state"][:0]
    o, _ = recurrent_kda(**kw)
    assert torch.count_nonzero(o) == 0


def test_spec_decode_without_tokens_returns_an_empty_output():
    kw = make_call(B=2, T=0, mode="spec")
    before = kw["initial_state"].clone()
    o, pool = recurrent_kda(**kw)
    assert o.shape == (2, 0, 12, 128) and torch.equal(pool, before)


def test_an_output_over_a_pool_row_is_refused_naming_output():
    kw = make_call()
    row = kw["initial_state"][6].reshape(-1)[: 3 * 12 * 128].view(3, 1, 12, 128)
    with pytest.raises(KDAError, match="^output: expected a tensor that shares no byte with initial_state"):
        recurrent_kda(**{**kw, "output": row})


def test_an_expanded_output_is_refused_naming_output():
    kw = make_call()
    with pytest.raises(KDAError, match="^output: expected a tensor whose elements do not overlap"):
        recurrent_kda(**{**kw, "output": torch.zeros(1, 1, 12, 128, dtype=BF16).expand(3, 1, 12, 128)})


# ---------------------------------------------------------------------------------------------------------------
# One bundle of the call's arguments through the layers: every flat signature that lists them keeps its order


def _params(fn):
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


BUNDLE = [(name, RecurrentArgs._field_defaults.get(name, inspect.Parameter.empty)) for name in RecurrentArgs._fields]


@pytest.mark.parametrize("fn", [recurrent_kda, explain], ids=["recurrent_kda", "explain"])
def test_the_public_signatures_are_the_bundles_fields_then_the_keyword_only_policy(fn):
    from kda_core.call_args import SpecArgs

    keywords = [("null_policy", NullSlotPolicy.OUT_OF_RANGE), ("num_spec_tokens", None), ("backend", None),
                *((name, SpecArgs._field_defaults[name]) for name in SpecArgs._fields)]
    assert _params(fn) == BUNDLE + keywords
    for name, _ in keywords:
        assert inspect.signature(fn).parameters[name].kind is inspect.Parameter.KEYWORD_ONLY


def test_the_ops_schema_is_the_bundles_fields_in_order_then_the_policy_string():
    from kda_recurrent import ops

    schema = torch.ops.kda.recurrent_kda.default._schema
    assert [a.name for a in schema.arguments] == [*RecurrentArgs._fields, "null_policy"]
    assert str(schema.arguments[-1].type) == "str"
    assert [n for n, _ in _params(ops._recurrent_kda_op._init_fn)] == [*RecurrentArgs._fields, "null_policy"]


def test_the_facade_hands_each_layer_one_bundle(kernels, as_if_cuda, monkeypatch):
    seen = []
    revalidate, validate = facade._revalidate, facade._validate
    monkeypatch.setattr(facade, "_revalidate", lambda args: seen.append(("revalidate", args)) or revalidate(args))
    monkeypatch.setattr(facade, "_validate", lambda args: seen.append(("validate", args)) or validate(args))
    kw = make_call(T=2, mode="spec")
    recurrent_kda(**clone_call(kw))
    (_, hot), (_, full) = seen
    assert [n for n, _ in seen] == ["revalidate", "validate"] and kernels.paths == [Path.GENERIC]
    assert type(hot) is tuple and type(full) is RecurrentArgs  # the hot path's plain tuple, then the named bundle
    assert hot == full and full.ssm_state_indices.shape == (3, 2) and full.scale is None


def test_the_generic_entry_is_the_launch_on_the_validated_call(monkeypatch):
    generic = pytest.importorskip("kda_cute.generic")
    monkeypatch.setattr(facade, "_generic_kernel", facade._UNLOADED)
    assert facade._generic() is generic.run  # run(call, args): the description and the bundle, no adapter frame


# ---------------------------------------------------------------------------------------------------------------
# The null-slot policy (docs/design.md §4) reaches every path; the varlen decode form takes the T=1 kernel


POLICIES = [NullSlotPolicy.OUT_OF_RANGE, NullSlotPolicy.NONPOSITIVE, "nonpositive"]


def _policy_call(**kw):
    """A call with slot 0 live under OUT_OF_RANGE and null under NONPOSITIVE (and a -1 row null under both)."""
    call = make_call(**kw)
    call["ssm_state_indices"] = torch.tensor([3, 0, -1], dtype=torch.int64)
    return call


def _assert_policy_matches_oracle(kw, policy):
    mine, ref = clone_call(kw), clone_call(kw)
    o, s = recurrent_kda(**mine, null_policy=policy)
    o_ref, s_ref = recurrent_kda_ref(**ref, null_policy=policy)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
    return o


@pytest.mark.parametrize("policy", POLICIES, ids=["out_of_range", "nonpositive", "string"])
@pytest.mark.parametrize("case", ["t1", "t1 hot path", "generic", "oracle"])
def test_the_null_policy_reaches_the_chosen_entry(kernels, monkeypatch, case, policy):
    want = NullSlotPolicy(policy)
    if case != "oracle":
        real = facade._validate
        monkeypatch.setattr(facade, "_validate", lambda a: dataclasses.replace(
            real(a), on_cuda=True, t1_eligible=case != "generic"))
    kw = _policy_call(T=1 if case != "generic" else 2)
    if case == "t1 hot path":  # the facade's own hot path, as test_a_described_t1_call... stubs it
        described = {}
        monkeypatch.setattr(facade, "_revalidate", lambda a: described.get("call"))
        described["call"] = facade._validate(RecurrentArgs(**kw))
    o = _assert_policy_matches_oracle(kw, policy)
    expected = {"t1": [Path.T1], "t1 hot path": [Path.T1], "generic": [Path.GENERIC], "oracle": []}[case]
    assert kernels.paths == expected and kernels.policies == [want] * len(expected)
    # slot 0 (row 1) is null under NONPOSITIVE only
    assert bool(o[1].eq(0).all()) is (want is NullSlotPolicy.NONPOSITIVE)


@pytest.mark.parametrize("bad", ["NONPOSITIVE", 0, None, "vllm", NullSlotPolicy])
def test_a_bad_null_policy_is_named(kernels, as_if_cuda, bad):
    kw = make_call()
    with pytest.raises(KDAError, match="^null_policy: expected a kda_core.contracts.NullSlotPolicy"):
        recurrent_kda(**kw, null_policy=bad)
    with pytest.raises(KDAError, match="^null_policy: expected"):
        explain(**kw, null_policy=bad)
    assert kernels.paths == []


def test_debug_validation_lets_slot_0_repeat_under_nonpositive(kernels, as_if_cuda, monkeypatch):
    monkeypatch.setenv("KDA_DEBUG_VALIDATE", "1")
    kw = {**make_call(B=3), "ssm_state_indices": torch.tensor([0, 2, 0], dtype=torch.int32)}
    with pytest.raises(KDAError, match=r"^ssm_state_indices: expected distinct active slots in \[0, 8\)"):
        recurrent_kda(**clone_call(kw))
    _assert_policy_matches_oracle(kw, "nonpositive")
    assert kernels.paths == [Path.T1]


def _varlen_decode(lens, cu_dtype=torch.int32, slots=None, seed=3):
    """[1, T, 12, 128] tokens of sequences of the given lengths + cu_seqlens, pool mode."""
    T = sum(lens)
    call = make_call(B=1, T=T, seed=seed)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=cu_dtype)
    n = len(lens)
    call.update(cu_seqlens=cu, ssm_state_indices=torch.tensor(slots or [(2 * i + 1) % 8 for i in range(n)],
                                                               dtype=torch.int32))
    return call


@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64], ids=["cu32", "cu64"])
@pytest.mark.parametrize("policy", POLICIES[:2], ids=["out_of_range", "nonpositive"])
@pytest.mark.parametrize("lens", [[1, 1, 1, 1], [0, 1, 3, 1]], ids=["decode", "mixed"])
def test_varlen_decode_in_pool_mode_takes_the_t1_kernels_varlen_entry(kernels, as_if_cuda, lens, policy, cu_dtype):
    kw = _varlen_decode(lens, cu_dtype, slots=[0, 3, 5, 7])
    route = explain(**kw, null_policy=policy)
    assert route.path is Path.T1_VARLEN and "varlen entry" in route.reason, route
    o = _assert_policy_matches_oracle(kw, policy)
    assert kernels.paths == [Path.T1_VARLEN] and kernels.policies == [policy]
    first = lens[0]  # sequence 0 sits at slot 0: null under NONPOSITIVE
    if first:
        assert bool(o[:, :first].eq(0).all()) is (policy is NullSlotPolicy.NONPOSITIVE)


def test_varlen_decode_reason_says_the_offsets_stay_on_the_device():
    call = validate_recurrent(RecurrentArgs(**_varlen_decode([1, 2])))
    assert call.varlen and not call.t1_eligible  # CPU tensors
    eligible = dataclasses.replace(call, on_cuda=True, t1_eligible=True)
    from kda_core import validation

    assert "never on the host" in validation._T1_VARLEN_OK[True]
    assert facade._route(eligible) in (Path.T1_VARLEN, Path.ORACLE)


def test_the_kill_switch_sends_varlen_decode_to_the_generic_kernel(kernels, as_if_cuda, monkeypatch):
    monkeypatch.setenv("KDA_T1_FAST_PATH", "0")
    kw = _varlen_decode([1, 0, 2])
    assert explain(**kw).path is Path.GENERIC
    assert_matches_oracle(kw)
    assert kernels.paths == [Path.GENERIC]


def test_a_missing_t1_kernel_sends_varlen_decode_to_the_oracle(kernels, as_if_cuda, monkeypatch):
    monkeypatch.setattr(facade, "_t1_varlen_kernel", None)
    kw = _varlen_decode([1, 1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert explain(**kw).path is Path.ORACLE
        assert_matches_oracle(kw)
    assert kernels.paths == []


# ---------------------------------------------------------------------------------------------------------------
# FlashInfer 0.7.2's recurrent_kda: num_spec_tokens, backend, the gathered final states of 1-D indices


def _pool_call_with_a_marked_last_slot():
    """FlashInfer's regression form: slot -1 must never wrap to the last slot (filled with 7.0 here)."""
    kw = make_call(B=3)
    kw["initial_state"][-1] = 7.0
    kw["ssm_state_indices"] = torch.tensor([-1, 3, 5], dtype=torch.int32)
    return kw


@pytest.mark.parametrize("backend", [None, "cute-dsl", "auto"])
def test_output_final_state_with_1d_indices_returns_the_gathered_states(kernels, as_if_cuda, backend):
    kw = {**_pool_call_with_a_marked_last_slot(), "output_final_state": True}
    mine = clone_call(kw)
    o, states = recurrent_kda(**mine, backend=backend)
    ref = clone_call(kw)
    o_ref, pool_ref = recurrent_kda_ref(**ref)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(mine["initial_state"], pool_ref, rtol=0, atol=0)  # the pool updated in place
    assert states.shape == (3, 12, 128, 128) and states.dtype == BF16
    assert bool(states[0].eq(0).all())  # the null row gathers zeros, not the last slot's 7.0
    torch.testing.assert_close(states[1:], pool_ref[[3, 5]], rtol=0, atol=0)
    assert bool(mine["initial_state"][-1].eq(7.0).all()) and kernels.paths == [Path.T1]


def test_the_gathered_states_follow_the_null_policy(kernels, as_if_cuda):
    kw = {**make_call(B=3), "output_final_state": True, "ssm_state_indices": torch.tensor([0, 2, 9])}
    _, states = recurrent_kda(**clone_call(kw), null_policy="nonpositive")
    assert bool(states[0].eq(0).all()) and bool(states[2].eq(0).all()) and not bool(states[1].eq(0).all())
    _, states = recurrent_kda(**clone_call(kw))
    assert not bool(states[0].eq(0).all())


def test_spec_and_varlen_calls_still_return_the_pool(kernels, as_if_cuda):
    for mode in ("spec", "varlen"):
        kw = {**make_call(T=2, mode=mode), "output_final_state": True}
        o, pool = recurrent_kda(**kw)
        assert pool is kw["initial_state"]


@pytest.mark.parametrize("bad", ["cuda", "CUTE-DSL", 1, "flashinfer"])
def test_a_backend_kda_does_not_know_is_named(kernels, bad):
    with pytest.raises(KDAError, match="^backend: expected one of"):
        recurrent_kda(**make_call(), backend=bad)
    with pytest.raises(KDAError, match="^backend: expected one of"):
        explain(**make_call(), backend=bad)


@pytest.mark.parametrize("backend", ["cute-dsl", "cake", "auto"])
def test_every_backend_runs_kdas_kernels(kernels, as_if_cuda, backend):
    kw = make_call()
    o, pool = recurrent_kda(**clone_call(kw), backend=backend)
    assert kernels.paths == [Path.T1] and explain(**kw, backend=backend).path is Path.T1


def test_a_dense_initial_state_is_updated_in_place_with_a_backend_and_read_only_without(kernels):
    kw = make_call(T=2, mode="dense")
    kw["output_final_state"] = False
    before = kw["initial_state"].clone()
    o_kda, final = recurrent_kda(**clone_call(kw))
    assert final is None
    mine = clone_call(kw)
    o, state = recurrent_kda(**mine, backend="auto")
    assert state is None and not torch.equal(mine["initial_state"], before)
    o_ref, final_ref = recurrent_kda_ref(**{**clone_call(kw), "output_final_state": True})
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(mine["initial_state"], final_ref.to(mine["initial_state"].dtype), rtol=0, atol=0)
    mine = clone_call(kw)
    _, state = recurrent_kda(**{**mine, "output_final_state": True}, backend="cute-dsl")
    assert state is mine["initial_state"]
    untouched = clone_call(kw)
    recurrent_kda(**untouched)
    assert torch.equal(untouched["initial_state"], before)  # kda's own form: read only


def test_num_spec_tokens_checks_the_token_count_and_the_index_columns(kernels):
    kw = make_call(T=3, mode="spec", N=16)
    with pytest.raises(KDAError, match=r"^q: expected T = 1 \+ num_spec_tokens = 4"):
        recurrent_kda(**kw, num_spec_tokens=3)
    for bad in (0, -1, 1.0, True, "2"):
        with pytest.raises(KDAError, match="^num_spec_tokens: expected an int >= 1"):
            recurrent_kda(**kw, num_spec_tokens=bad)
    one_d = {**kw, "ssm_state_indices": kw["ssm_state_indices"][:, 0].contiguous(), "num_accepted_tokens": None}
    with pytest.raises(KDAError, match=r"^ssm_state_indices: expected 2-D \[N_seq, 1 \+ num_spec_tokens\]"):
        recurrent_kda(**one_d, num_spec_tokens=2)
    assert_matches_oracle(kw)
    o, _ = recurrent_kda(**clone_call(kw), num_spec_tokens=2)
    o_ref, _ = recurrent_kda_ref(**clone_call(kw))
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)


def test_num_spec_tokens_without_indices_uses_the_first_checkpoint_slots(kernels):
    kw = make_call(B=2, T=3, mode="spec", N=8)
    B, T = 2, 3
    implicit = {**clone_call(kw), "ssm_state_indices": None, "num_accepted_tokens": None}
    explicit = {**clone_call(kw), "ssm_state_indices": torch.arange(B * T, dtype=torch.int32).view(B, T),
                "num_accepted_tokens": None}
    o, pool = recurrent_kda(**implicit, num_spec_tokens=T - 1)
    o_ref, pool_ref = recurrent_kda_ref(**explicit)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=0)
    torch.testing.assert_close(pool, pool_ref, rtol=0, atol=0)
    assert explain(**implicit, num_spec_tokens=T - 1).path is Path.ORACLE
    small = {**implicit, "initial_state": implicit["initial_state"][:5]}
    with pytest.raises(KDAError, match=r"^initial_state: expected the checkpoint pool of at least"):
        recurrent_kda(**small, num_spec_tokens=T - 1)


# ---------------------------------------------------------------------------------------------------------------
# The varlen form's hot path: kda-core's real re-validator (revalidate_recurrent_t1_varlen) on CPU tensors, with the
# launch floor lowered and every CPU description also remembered as the CUDA one of the same facts.


@pytest.fixture
def varlen_hot_path(kernels, as_if_cuda, monkeypatch):
    from kda_core import validation

    monkeypatch.setattr(validation, "_LAUNCH_DEVICE_MIN", -1)
    monkeypatch.setattr(validation, "_MEMO", {})
    remember = validation._remember

    def twin(key, call):
        call = remember(key, call)
        if key[0] == "recurrent" and key[-1] is False and "not on a CUDA device" in call.t1_reason:
            validation._MEMO[(*key[:-1], True)] = dataclasses.replace(call, on_cuda=True, t1_eligible=True)
        return call

    monkeypatch.setattr(validation, "_remember", twin)
    state = dict(validations=0, reject=None)
    full, t1v = facade._validate, kernels.t1_varlen

    def validate(args):
        state["validations"] += 1
        return full(args)

    def entry(*args):
        if state["reject"] is not None:
            kernels.paths.append("rejected")
            raise state["reject"]
        return t1v(*args)

    monkeypatch.setattr(facade, "_validate", validate)
    monkeypatch.setattr(facade, "_t1_varlen_kernel", entry)
    return state


def _varlen_with_output(lens=(1, 1, 1, 1), policy=None):
    kw = _varlen_decode(list(lens), slots=[1, 3, 5, 7][: len(lens)])
    kw["output"] = torch.zeros(kw["v"].shape, dtype=BF16)
    return kw


def test_a_described_varlen_call_launches_without_the_full_validator(kernels, varlen_hot_path):
    kw = _varlen_with_output()
    assert_matches_oracle(kw)
    assert_matches_oracle(kw)
    assert_matches_oracle({**_varlen_with_output(), "output": None})  # (an output is no fact of the description)
    assert kernels.paths == [Path.T1_VARLEN] * 3 and varlen_hot_path["validations"] == 1
    assert_matches_oracle(_varlen_with_output((1, 1, 1)))  # new facts: validated once, then hot
    assert_matches_oracle(_varlen_with_output((1, 1, 1)))
    assert kernels.paths == [Path.T1_VARLEN] * 5 and varlen_hot_path["validations"] == 2


def _cu_output(kw):
    """An output whose bytes cover cu_seqlens (a view of the same storage)."""
    T = kw["q"].shape[1]
    buf = torch.zeros(T * 12 * 128, dtype=BF16)
    n = kw["cu_seqlens"].shape[0]
    return {"output": buf.view(1, T, 12, 128), "cu_seqlens": buf.view(torch.int32)[:n].copy_(kw["cu_seqlens"])}


VARLEN_HOT_BAD = [
    ("ssm_state_indices", lambda kw: {"ssm_state_indices": kw["ssm_state_indices"][:3]}),
    ("cu_seqlens", lambda kw: {"cu_seqlens": kw["cu_seqlens"].float()}),
    ("output", _cu_output),
    ("output", lambda kw: {"output": kw["q"]}),
    ("initial_state", lambda kw: {"initial_state": kw["initial_state"][:, :6]}),
    ("dt_bias", lambda kw: {"dt_bias": kw["dt_bias"][:100]}),
    ("lower_bound", lambda kw: {"lower_bound": 0.5}),
    ("scale", lambda kw: {"scale": -1.0}),
    ("beta_is_logit", lambda kw: {"beta_is_logit": 1}),
    ("num_accepted_tokens", lambda kw: {"num_accepted_tokens": torch.ones(4, dtype=torch.int32)}),
]


@pytest.mark.parametrize("argument, bad", VARLEN_HOT_BAD, ids=[f"{a}-{i}" for i, (a, _) in enumerate(VARLEN_HOT_BAD)])
def test_a_bad_varlen_call_after_a_good_one_raises_naming_the_argument(kernels, varlen_hot_path, argument, bad):
    kw = _varlen_with_output()
    recurrent_kda(**clone_call(kw))  # described: the next call of these facts takes the hot path
    fresh = clone_call(kw)
    broken = {**fresh, **bad(fresh)}
    pool_before = broken["initial_state"].clone()
    with pytest.raises(KDAError, match=rf"^{argument}: expected"):
        recurrent_kda(**broken)
    assert kernels.paths == [Path.T1_VARLEN] and varlen_hot_path["validations"] == 2
    assert torch.equal(broken["initial_state"], pool_before)


def test_a_wrapper_rejection_on_the_varlen_hot_path_gets_the_full_validators_error(kernels, varlen_hot_path):
    kw = _varlen_with_output()
    recurrent_kda(**clone_call(kw))
    varlen_hot_path["reject"] = ValueError("Mismatched Tensor on argument #5, expected dtype=float32")
    with pytest.raises(KDAError, match="^A_log: expected"):
        recurrent_kda(**{**clone_call(kw), "A_log": kw["A_log"].half()})
    assert kernels.paths == [Path.T1_VARLEN, "rejected"] and varlen_hot_path["validations"] == 2


def test_calls_that_launch_nothing_and_debug_validation_take_the_full_path(kernels, varlen_hot_path, monkeypatch):
    kw = _varlen_with_output()
    recurrent_kda(**clone_call(kw))
    empty = {**clone_call(kw), "cu_seqlens": kw["cu_seqlens"][:1], "ssm_state_indices": kw["ssm_state_indices"][:0]}
    recurrent_kda(**empty)  # no sequence: validated every time (no wrapper would check it)
    recurrent_kda(**empty)
    assert varlen_hot_path["validations"] == 3
    monkeypatch.setenv("KDA_DEBUG_VALIDATE", "1")
    with pytest.raises(KDAError, match="^ssm_state_indices: expected distinct"):
        recurrent_kda(**{**clone_call(kw), "ssm_state_indices": torch.tensor([1, 1, 3, 5], dtype=torch.int32)})
    monkeypatch.delenv("KDA_DEBUG_VALIDATE")
    monkeypatch.setenv("KDA_T1_FAST_PATH", "0")
    assert_matches_oracle(kw)
    assert kernels.paths[-1] is Path.GENERIC
