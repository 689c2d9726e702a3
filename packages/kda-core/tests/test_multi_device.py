"""Every validator refuses a call whose tensors are on different devices, naming the odd argument (docs/multi_gpu.md).

No GPU is needed: the validators read metadata only, and a device is one fact of it, ``get_device()``. The tensors
here are CPU tensors of a subclass that reports a CUDA device index (``_OnCuda0`` / ``_OnCuda1``; views keep the
class), so a call "on cuda:0" with one argument "on cuda:1", or on the CPU, runs the CUDA rules
(``device_kind="cuda"``) exactly as a two-GPU host would. Each legal baseline call comes from the validators' own
tests (test_validation*.py), loaded by path (the tests run with ``--import-mode=importlib``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from kda_core import validation as V
from kda_core.call_args import RecurrentArgs, SpecArgs
from kda_core.errors import KDAError
from kda_core.validation_fused import validate_fused_decode
from kda_core.validation_spec import validate_recoverssm_commit, validate_recoverssm_layers, validate_spec

_HERE = Path(__file__).parent


def _load(name):
    spec = importlib.util.spec_from_file_location(f"kda_core_multi_device_{name}", _HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TV, TF, TS = _load("test_validation"), _load("test_validation_fused"), _load("test_validation_spec")


class _OnCuda(torch.Tensor):
    """CPU storage reporting CUDA device ``INDEX`` to the metadata the validators read."""

    INDEX = 0

    def get_device(self):
        return self.INDEX

    @property
    def device(self):
        return torch.device("cuda", self.INDEX)

    @property
    def is_cuda(self):
        return True


class _OnCuda0(_OnCuda):
    INDEX = 0


class _OnCuda1(_OnCuda):
    INDEX = 1


def _plain(t):
    return t.as_subclass(torch.Tensor)


def _to(cls, x):
    """``x`` (a tensor, a dict or list of tensors, a NamedTuple of them, anything else), every tensor of ``cls``."""
    if isinstance(x, torch.Tensor):
        return _plain(x).as_subclass(cls) if cls is not torch.Tensor else _plain(x)
    if isinstance(x, dict):
        return {k: _to(cls, v) for k, v in x.items()}
    if isinstance(x, list):
        return [_to(cls, e) for e in x]
    if isinstance(x, (RecurrentArgs, SpecArgs)):
        return type(x)(*(_to(cls, e) for e in x))
    return x


def _paths(x, prefix=()):
    """Paths to every tensor inside ``x``: keys of a dict, positions of a list, field names of a NamedTuple."""
    if isinstance(x, torch.Tensor):
        yield prefix
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _paths(v, (*prefix, i))
    elif isinstance(x, (RecurrentArgs, SpecArgs)):
        for name, v in zip(x._fields, x):
            yield from _paths(v, (*prefix, name))


def _replace(x, path, fn):
    if not path:
        return fn(x)
    head, rest = path[0], path[1:]
    if isinstance(x, dict):
        return {**x, head: _replace(x[head], rest, fn)}
    if isinstance(x, list):
        return [_replace(v, rest, fn) if i == head else v for i, v in enumerate(x)]
    return x._replace(**{head: _replace(getattr(x, head), rest, fn)})


# Layer 0 of a multi-layer commit is validated as a one-layer commit, whose messages name its tensors so
# (``correction_cache`` for ``correction_caches[0]``).
_LAYER0 = {"checkpoints": "checkpoint_state", "correction_caches": "correction_cache", "kg_caches": "kg_cache",
           "A_logs": "A_log", "dt_biases": "dt_bias"}


def _names(path):
    """The argument names a validator may give the tensor at ``path``: ``q``, ``source``, ``checkpoints[1]``..."""
    if not isinstance(path[-1], int):
        return (str(path[-1]),)
    name = f"{path[-2]}[{path[-1]}]"
    return (name, _LAYER0[path[-2]]) if path[-1] == 0 else (name,)


def _cuda(kwargs):
    return {**kwargs, "device_kind": "cuda"}


def _t1():
    a = TV.t1_args()
    a["output"] = torch.zeros(a["q"].shape, dtype=torch.bfloat16)
    return _cuda(a), lambda a: V.validate_decode_t1(**a)


def _packed():
    a = TV.packed_args(pad=8)
    a["output"] = torch.zeros(3, 1, TV.H, TV.D, dtype=torch.bfloat16)
    return _cuda(a), lambda a: V.validate_packed_decode_t1(**a)


def _packed_tokens():
    a = TV.packed_args(pad=8)
    B = a["mixed_qkv"].shape[0]
    a["raw_gate"] = a["raw_gate"].reshape(1, B, TV.H, TV.D)
    a["raw_beta"] = a["raw_beta"].reshape(1, B, TV.H)
    a["output"] = torch.zeros(1, B, TV.H, TV.D, dtype=torch.bfloat16)
    del a["num_heads"]
    return _cuda(a), lambda a: V.validate_packed_tokens_decode_t1(**a)


def _recurrent(mode):
    def build():
        if mode == "varlen":
            a = TV.rec_args(B=1, T=5, mode="pool", N=8)
            a["cu_seqlens"] = torch.tensor([0, 2, 5], dtype=torch.int32)
            a["ssm_state_indices"] = torch.zeros(2, dtype=torch.int32)
        elif mode == "dense":
            a = TV.rec_args(T=3, mode=None)
            a["initial_state"] = torch.zeros(2, TV.H, TV.D, TV.D)
        else:
            a = TV.rec_args(T=1 if mode == "pool" else 3, mode=mode)
        a["output"] = torch.zeros(a["v"].shape, dtype=torch.bfloat16)
        return {"args": RecurrentArgs(**a)}, lambda a: V.validate_recurrent(a["args"], device_kind="cuda")

    return build


def _ucache():
    return _cuda(TV.uc_args()), lambda a: V.validate_ucache(**a)


def _fused():
    return _cuda(TF._args()), lambda a: validate_fused_decode(**a)


def _spec(case):
    def build():
        args, spec = getattr(TS, case)()
        return {"args": args, "spec": spec}, lambda a: validate_spec(a["args"], a["spec"], device_kind="cuda")

    return build


def _commit():
    return _cuda(TS.commit_args()), lambda a: validate_recoverssm_commit(**a)


def _layers():
    return _cuda(TS.layer_args(L=2)), lambda a: validate_recoverssm_layers(**a)


def _gate_params():
    a = dict(like=torch.zeros(2, 1, 4, TV.D, dtype=torch.bfloat16), A_log=torch.zeros(8), dt_bias=torch.zeros(8 * TV.D))
    return a, lambda a: V.validate_gate_params(a["A_log"], a["dt_bias"], -5.0, 8, TV.D, like=a["like"],
                                               heads_text="HV")


def _fused_spec():  # the multi-token fused decode, where its validator exists
    from kda_core import validation_fused

    return _cuda(_load("test_validation_fused_spec")._args()), lambda a: validation_fused.validate_packed_fused_decode(
        **a)


CALLS = {
    "decode_t1": _t1, "packed_decode_t1": _packed, "packed_tokens_decode_t1": _packed_tokens,
    **{f"recurrent_{m}": _recurrent(m) for m in ("pool", "spec", "dense", "varlen")},
    "ucache": _ucache, "fused_decode": _fused,
    **{f"spec_{c}": _spec(c) for c in ("frozen_pool", "frozen_source", "source_2d", "tree")},
    "recoverssm_commit": _commit, "recoverssm_layers": _layers, "gate_params": _gate_params,
    **({"packed_fused_decode": _fused_spec} if (_HERE / "test_validation_fused_spec.py").exists() else {}),
}


def _cases():
    for call, build in CALLS.items():
        kwargs, _ = build()
        for path in _paths(kwargs):
            yield pytest.param(call, path, id=f"{call}-{'.'.join(map(str, path))}")


@pytest.mark.parametrize("call", list(CALLS))
def test_the_baseline_call_on_one_cuda_device_is_legal(call):
    kwargs, validate = CALLS[call]()
    validate(_to(_OnCuda1, kwargs))  # every tensor on cuda:1 (the current device is irrelevant to validation)
    validate(_to(_OnCuda0, kwargs))


@pytest.mark.parametrize("odd_device", [_OnCuda1, torch.Tensor], ids=["cuda1", "cpu"])
@pytest.mark.parametrize("call, path", list(_cases()))
def test_one_tensor_on_another_device_is_refused_naming_it(call, path, odd_device):
    kwargs, validate = CALLS[call]()
    mixed = _replace(_to(_OnCuda0, kwargs), path, lambda t: _to(odd_device, t))
    with pytest.raises(KDAError) as info:
        validate(mixed)
    msg = str(info.value)
    where = "cuda:1" if odd_device is _OnCuda1 else "cpu"
    assert ": expected " in msg and ", got " in msg, msg
    named = any(msg.startswith(f"{name}: expected ") for name in _names(path)) and msg.endswith(f"got {where}")
    # or the odd tensor is the one every other is compared with: the next is named, expected on the odd device
    reference = f"expected a tensor on {where}" in msg or (where == "cpu" and ("a CUDA tensor" in msg
                                                                   or "a tensor on the CPU" in msg))
    assert named or reference, msg
