"""The engines' fused Kimi K3 decode ops on kda's fused layer, with the engines' test inputs: vLLM's native op
(``kda_recurrent.compat.vllm.kimi_k3.fused_kda_decode``, docs/serving.md §3 "Native fused op") and, at the end,
SGLang's fused decode (``kda_recurrent.compat.sglang.kda_fused_decode`` and its ``covered`` test).

vLLM's inputs:

H in {12, 24, 48, 96}, B in {1, 4}, with the gated RMSNorm (bounded gate) and without it (softplus gate), the SD and
the DS conv layouts; x the first 3·H·128 columns of a [B, 3·H·128 + 17] buffer, weight 0.1·randn [3·H·128, 4]
re-laid to [3, 4, H·128], raw_beta a view of [1, B, H + 1], output_gate of [B, H·128 + 7], slots B + 2, indices
B, B - 1, ..., 1, and each slot's conv cache and fp32 state interleaved in one byte page (the state right after the
conv bytes, both slot strides the page). The expected values are an independent composition: the conv in plain
torch, kda-core's recurrence reference ``recurrent_kda_ref`` (vLLM's null policy), a hand-written gated RMSNorm.
Tolerances are FlashInfer's: output rtol 3e-2 / atol 2e-2, the conv cache bitwise, the state rtol 3e-2 / atol 2e-3.
On the CPU the adapter runs kda-core's fused reference; the GPU-marked tests run kda-cute's kernel.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kda_core.contracts import NullSlotPolicy
from kda_core.errors import KDAError
from kda_core.oracle import recurrent_kda_ref
from kda_recurrent.compat import sglang
from kda_recurrent.compat.vllm import kimi_k3

D, W = 128, 4
EPS = 1e-5
OUT_TOL = dict(rtol=3e-2, atol=2e-2)
STATE_TOL = dict(rtol=3e-2, atol=2e-3)
HAS_CUDA = torch.cuda.is_available()


def vllm_inputs(H, B, *, ds=False, norm=True, device="cpu", seed=None, state_dtype=torch.float32):
    """vLLM's native-op test inputs; returns (keyword arguments of the call, the page buffer). ``state_dtype``
    bf16: the pool a layer gets with a bf16 ``mamba_ssm_cache_dtype``, which takes this op once kda's backend test
    is installed (``integrations.vllm``)."""
    gen = torch.Generator().manual_seed(967 + H + B if seed is None else seed)

    def randn(*shape, scale=1.0, dtype=torch.float32):
        return (scale * torch.randn(*shape, generator=gen)).to(dtype=dtype, device=device)

    dim = H * D
    slots = B + 2
    x = randn(B, 3 * dim + 17, dtype=torch.bfloat16)[:, : 3 * dim]
    weight = randn(3 * dim, W, scale=0.1).reshape(3, dim, W).transpose(1, 2).contiguous()
    conv_seed = randn(slots, W - 1, 3 * dim, scale=0.1, dtype=torch.bfloat16).transpose(1, 2)
    state_seed = randn(slots, H, D, D, scale=0.01)
    conv_bytes = 3 * dim * (W - 1) * 2
    size = torch.empty((), dtype=state_dtype).element_size()
    page = conv_bytes + H * D * D * size
    storage = torch.zeros(slots * page, dtype=torch.uint8, device=device)
    conv_stride = (page // 2, W - 1, 1) if ds else (page // 2, 1, 3 * dim)
    conv = torch.as_strided(storage.view(torch.bfloat16), (slots, 3 * dim, W - 1), conv_stride)
    state = torch.as_strided(storage.view(state_dtype), (slots, H, D, D), (page // size, D * D, D, 1),
                             conv_bytes // size)
    conv.copy_(conv_seed)
    state.copy_(state_seed)
    args = dict(
        x=x, weight=weight, bias=None, conv_state=conv, raw_g=randn(1, B, H, D, dtype=torch.bfloat16),
        raw_beta=randn(1, B, H + 1, dtype=torch.bfloat16)[:, :, :H], A_log=randn(H, scale=0.5),
        dt_bias=randn(dim, scale=0.1), state_indices=torch.arange(B, 0, -1, dtype=torch.int32, device=device),
        state=state, lower_bound=-5.0 if norm else None,
        output_gate=randn(B, dim + 7, dtype=torch.bfloat16)[:, :dim].view(B, H, D) if norm else None,
        norm_weight=randn(D) if norm else None, norm_eps=EPS,
    )
    return args, storage


def composed(args, null_policy=NullSlotPolicy.NONPOSITIVE):
    """The layer from independent parts on CPU copies: (output [1, B, H, 128] bf16, conv cache after, state after);
    vLLM's null policy by default (an index <= 0 or >= slots is a null row), SGLang's with ``OUT_OF_RANGE`` (< 0)."""
    first_live = 1 if null_policy is NullSlotPolicy.NONPOSITIVE else 0
    cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    x, conv, state = cpu["x"], cpu["conv_state"].clone(), cpu["state"].clone()
    B, C = x.shape
    H = C // (3 * D)
    slots = cpu["state_indices"].tolist()
    taps = cpu["weight"].permute(0, 2, 1).reshape(C, 1, W)
    mixed = torch.zeros(B, C)
    for r, s in enumerate(slots):
        if first_live <= s < state.shape[0]:
            window = torch.cat((conv[s].float(), x[r].float()[:, None]), dim=1)  # [C, 4], oldest column first
            mixed[r] = F.silu(F.conv1d(window[None], taps, cpu.get("bias"), groups=C)[0, :, 0]).bfloat16().float()
            conv[s] = window[:, 1:].bfloat16()
    q, k, v = (mixed.view(B, 1, 3, H, D)[:, :, i].bfloat16() for i in range(3))
    o, state = recurrent_kda_ref(
        q, k, v, cpu["raw_g"].view(B, 1, H, D), cpu["raw_beta"].reshape(B, 1, H), A_log=cpu["A_log"],
        dt_bias=cpu["dt_bias"], initial_state=state, use_gate_in_kernel=True, lower_bound=cpu["lower_bound"],
        beta_is_logit=True, ssm_state_indices=torch.tensor(slots, dtype=torch.int32), null_policy=null_policy,
    )
    o = o.float().view(B, H, D)
    if cpu["norm_weight"] is not None:
        o = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + EPS) * cpu["norm_weight"]
        o = o * torch.sigmoid(cpu["output_gate"].float())
    return o.bfloat16().view(1, B, H, D), conv, state


def run_and_compare(H, B, ds, norm, device, out=False, state_dtype=torch.float32):
    """One call against the composition of the inputs as they were; the pages no row owns are bitwise unchanged."""
    args, storage = vllm_inputs(H, B, ds=ds, norm=norm, device=device, state_dtype=state_dtype)
    want, want_conv, want_state = composed(args)
    before = storage.clone()
    given = torch.full((1, B, H, D), float("nan"), dtype=torch.bfloat16, device=device) if out else None
    got = kimi_k3.fused_kda_decode(**args, out=given)
    if device == "cuda":
        torch.cuda.synchronize()
    assert got.shape == (1, B, H, D) and got.dtype is torch.bfloat16
    if out:
        assert got is given
    torch.testing.assert_close(got.cpu(), want, **OUT_TOL)
    torch.testing.assert_close(args["conv_state"].cpu(), want_conv, rtol=0, atol=0)
    torch.testing.assert_close(args["state"].cpu(), want_state, **STATE_TOL)
    page = storage.numel() // (B + 2)
    for s in (0, B + 1):  # the null block and the slot no row names: bitwise untouched (conv and state bytes)
        assert torch.equal(storage[s * page:(s + 1) * page], before[s * page:(s + 1) * page]), s
    return got


FORMS = [(False, True), (True, True), (False, False), (True, False)]
FORM_IDS = ["sd-norm", "ds-norm", "sd-nonorm", "ds-nonorm"]
SHAPES = [(H, B) for H in (12, 24, 48, 96) for B in (1, 4)]
SHAPE_IDS = [f"h{H}-b{B}" for H, B in SHAPES]


@pytest.mark.parametrize("ds, norm", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("H, B", SHAPES, ids=SHAPE_IDS)
def test_vllm_inputs_match_the_composition_on_cpu(H, B, ds, norm):
    run_and_compare(H, B, ds, norm, "cpu", out=B == 4)


BF16_SHAPES = [(12, 1), (24, 4), (16, 4)]  # 16: a head count vLLM's op lacks and kda's backend test takes


@pytest.mark.parametrize("ds", [False, True], ids=["sd", "ds"])
@pytest.mark.parametrize("H, B", BF16_SHAPES, ids=[f"h{H}-b{B}" for H, B in BF16_SHAPES])
def test_bf16_pool_matches_the_composition_on_cpu(H, B, ds):
    run_and_compare(H, B, ds, True, "cpu", out=B == 4, state_dtype=torch.bfloat16)


def test_null_rows_touch_nothing_on_cpu():
    _null_rows("cpu")


def _null_rows(device):
    """Index 0 (vLLM's null block), -1 and one past the pool: zero output, no byte of any page written but the
    live rows' own."""
    H, B = 12, 5
    args, storage = vllm_inputs(H, B, ds=True, device=device)
    slots = B + 2
    args["state_indices"] = torch.tensor([3, 0, slots, -1, 1], dtype=torch.int32, device=device)
    want, want_conv, want_state = composed(args)
    before = storage.clone()
    got = kimi_k3.fused_kda_decode(**args)
    if device == "cuda":
        torch.cuda.synchronize()
    for r in (1, 2, 3):
        assert not got[0, r].any(), r
    torch.testing.assert_close(got.cpu(), want, **OUT_TOL)
    torch.testing.assert_close(args["conv_state"].cpu(), want_conv, rtol=0, atol=0)
    torch.testing.assert_close(args["state"].cpu(), want_state, **STATE_TOL)
    page = storage.numel() // slots
    for s in range(slots):
        same = torch.equal(storage[s * page:(s + 1) * page], before[s * page:(s + 1) * page])
        assert same == (s not in (1, 3)), s


def test_bad_calls_raise_the_kda_error_naming_the_argument():
    args, _ = vllm_inputs(12, 1)
    with pytest.raises(KDAError, match="^norm_weight: expected an fp32 tensor"):
        kimi_k3.fused_kda_decode(**{**args, "norm_weight": None})
    with pytest.raises(KDAError, match="^conv_state: expected"):
        kimi_k3.fused_kda_decode(**{**args, "conv_state": args["conv_state"][:, :, :2]})
    with pytest.raises(KDAError, match="^raw_gate: expected"):  # FlashInfer's name for vLLM's raw_g
        kimi_k3.fused_kda_decode(**{**args, "raw_g": args["raw_g"][:, :, :6]})


def _own_caches(args):
    """The same call with each cache in its own allocation (same layout and values)."""
    own = dict(args)
    for name in ("conv_state", "state"):
        t = args[name]
        own[name] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).copy_(t)
    return own


@pytest.mark.parametrize("backend, interleaved", [("eager", True), ("aot_eager", False)],
                         ids=["eager-pages", "aot_eager-own-caches"])
def test_torch_compile_fullgraph_matches_eager_on_cpu(backend, interleaved):
    """The adapter inside a compiled function is the ``kda::vllm_fused_kda_decode`` op (fullgraph: no break).
    Dynamo alone on vLLM's interleaved pages; aot_eager (functionalisation and the fake implementation) with each
    cache in its own allocation: AOTAutograd refuses input mutations on views of one storage in two dtypes, which
    is what an interleaved page is (vLLM runs the layer's decode outside its compiled graph)."""
    eager_args, eager_pages = vllm_inputs(12, 4, ds=True, seed=5)
    compiled_args, compiled_pages = vllm_inputs(12, 4, ds=True, seed=5)
    if not interleaved:
        eager_args, compiled_args = _own_caches(eager_args), _own_caches(compiled_args)
    want = kimi_k3.fused_kda_decode(**eager_args)
    rest = {k: eager_args[k] for k in ("weight", "bias", "A_log", "dt_bias", "state_indices", "lower_bound",
                                        "norm_weight", "norm_eps")}

    def layer(x, conv_state, state, raw_g, raw_beta, output_gate, out):
        o = kimi_k3.fused_kda_decode(x=x, conv_state=conv_state, raw_g=raw_g, raw_beta=raw_beta, state=state,
                                     out=out, output_gate=output_gate, **rest)
        return o.float() * 2

    out = torch.empty(1, 4, 12, D, dtype=torch.bfloat16)
    run = torch.compile(layer, fullgraph=True, backend=backend)
    got = run(compiled_args["x"], compiled_args["conv_state"], compiled_args["state"], compiled_args["raw_g"],
              compiled_args["raw_beta"], compiled_args["output_gate"], out)
    assert torch.equal(got, want.float() * 2) and torch.equal(out, want)
    assert torch.equal(compiled_args["conv_state"], eager_args["conv_state"])
    assert torch.equal(compiled_args["state"], eager_args["state"])
    if interleaved:
        assert torch.equal(compiled_pages, eager_pages)  # every byte of every page


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("ds, norm", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("H, B", SHAPES, ids=SHAPE_IDS)
def test_vllm_inputs_match_the_composition_on_cuda(H, B, ds, norm):
    run_and_compare(H, B, ds, norm, "cuda", out=B == 4)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("ds", [False, True], ids=["sd", "ds"])
@pytest.mark.parametrize("H, B", BF16_SHAPES, ids=[f"h{H}-b{B}" for H, B in BF16_SHAPES])
def test_bf16_pool_matches_the_composition_on_cuda(H, B, ds):
    run_and_compare(H, B, ds, True, "cuda", out=B == 4, state_dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_null_rows_touch_nothing_on_cuda():
    _null_rows("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("ds", [False, True], ids=["sd", "ds"])
def test_cuda_graph_replay_with_new_inputs(ds):
    """Captured once with ``out`` given (no allocation, no sync), replayed on new activations and indices."""
    H, B = 24, 4
    args, _ = vllm_inputs(H, B, ds=ds, device="cuda")
    out = torch.empty(1, B, H, D, dtype=torch.bfloat16, device="cuda")
    warm, _ = vllm_inputs(H, B, ds=ds, device="cuda")
    kimi_k3.fused_kda_decode(**warm, out=torch.empty_like(out))  # compile and load before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = kimi_k3.fused_kda_decode(**args, out=out)
    assert captured is out
    fresh, _ = vllm_inputs(H, B, ds=ds, device="cuda", seed=11)
    for name in ("x", "raw_g", "raw_beta", "output_gate"):
        args[name].copy_(fresh[name])
    args["state_indices"].copy_(torch.tensor([2, 0, 5, 1], dtype=torch.int32))
    want, want_conv, want_state = composed(args)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.cpu(), want, **OUT_TOL)
    assert not out[0, 1].any()
    torch.testing.assert_close(args["conv_state"].cpu(), want_conv, rtol=0, atol=0)
    torch.testing.assert_close(args["state"].cpu(), want_state, **STATE_TOL)


# ---------------------------------------------------------------------------------------------------------------
# SGLang's fused Kimi K3 decode (``sglang.kernels.ops.attention.kda_fused_decode``) on kda's fused layer. Inputs as
# SGLang's own test builds them: the raw q|k|v row, ``a`` [B, seg] and ``b`` [B, H] (here views of strided buffers),
# the conv pool [slots, 3, C] channel-contiguous (here the transposed view of vLLM's interleaved pages), the conv
# weight split into three transposed [4, seg] parts, a dense fp32 conv bias, cache indices with -1 padding and slot 0
# live (SGLang's allocator).

SGL_ROWS = [2, 0, -1, 3]  # slot 0 live, -1 a padded graph row; slots 1 and 4 belong to nobody


def sglang_inputs(H, *, device="cpu", state_dtype=torch.float32, seed=None):
    """(SGLang's positional arguments as a dict, the equivalent kda/vLLM-form args for ``composed``, the pages)."""
    B = len(SGL_ROWS)
    args, storage = vllm_inputs(H, B, device=device, seed=seed, state_dtype=state_dtype)
    seg = H * D
    gen = torch.Generator().manual_seed(31 + H)
    args["bias"] = (0.1 * torch.randn(3 * seg, generator=gen)).to(device)
    args["state_indices"] = torch.tensor(SGL_ROWS, dtype=torch.int32, device=device)
    args["lower_bound"] = -5.0
    w_q_t, w_k_t, w_v_t = (args["weight"][i].clone() for i in range(3))
    call = dict(
        mixed_qkv=args["x"], a=args["raw_g"].reshape(B, seg), b=args["raw_beta"][0],
        conv_states=args["conv_state"].transpose(1, 2), w_q_t=w_q_t, w_k_t=w_k_t, w_v_t=w_v_t,
        conv_bias=args["bias"], A_log=args["A_log"], dt_bias=args["dt_bias"], onorm_g=args["output_gate"].flatten(1),
        onorm_weight=args["norm_weight"], ssm_states=args["state"], cache_indices=args["state_indices"],
        scale=D ** -0.5, onorm_eps=EPS, lower_bound=-5.0,
    )
    return call, args, storage


def _sglang_matches_the_composition(H, device, state_dtype):
    call, args, storage = sglang_inputs(H, device=device, state_dtype=state_dtype)
    want, want_conv, want_state = composed(args, NullSlotPolicy.OUT_OF_RANGE)
    before = storage.clone()
    got = sglang.kda_fused_decode(**call)
    if device == "cuda":
        torch.cuda.synchronize()
    assert got.shape == (1, len(SGL_ROWS), H, D) and got.dtype is torch.bfloat16
    torch.testing.assert_close(got.cpu(), want, **OUT_TOL)
    assert not got[0, 2].any()  # the padded row
    torch.testing.assert_close(args["conv_state"].cpu(), want_conv, rtol=0, atol=0)
    torch.testing.assert_close(args["state"].cpu(), want_state, **STATE_TOL)
    page = storage.numel() // (len(SGL_ROWS) + 2)
    for s in range(len(SGL_ROWS) + 2):  # slot 0 is SGLang's to use; 1 and 4 nobody's: bitwise untouched
        same = torch.equal(storage[s * page:(s + 1) * page], before[s * page:(s + 1) * page])
        assert same == (s not in (0, 2, 3)), s


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("H", [12, 24])
def test_sglang_fused_decode_matches_the_composition_on_cpu(H, state_dtype):
    _sglang_matches_the_composition(H, "cpu", state_dtype)


def test_sglang_fused_decode_padding_rows_scale_and_stacked_weight():
    """``actual_batch_size`` (a later copy's keyword): rows past it are graph padding, zero and untouched. A scale
    other than 128 ** -0.5 is refused by name. The three weight parts are stacked once per weight set, and again
    after an in-place change of one (its version moves)."""
    call, args, storage = sglang_inputs(12)
    before = storage.clone()
    got = sglang.kda_fused_decode(**call, actual_batch_size=0)
    assert not got.any() and torch.equal(storage, before)
    with pytest.raises(KDAError, match=r"^scale: expected 128 \*\* -0.5"):
        sglang.kda_fused_decode(**{**call, "scale": 1.0})
    stacked = sglang._conv_weight(call["w_q_t"], call["w_k_t"], call["w_v_t"], None)
    assert stacked is sglang._conv_weight(call["w_q_t"], call["w_k_t"], call["w_v_t"], None)
    assert torch.equal(stacked, args["weight"])
    call["w_k_t"].mul_(2)
    restacked = sglang._conv_weight(call["w_q_t"], call["w_k_t"], call["w_v_t"], None)
    assert restacked is not stacked and torch.equal(restacked[1], 2 * args["weight"][1])


def test_sglang_covered_answers_for_kdas_layer(monkeypatch):
    """kda's ``covered``: True for the shapes and layouts kda's fused layer takes (fp32 and bf16 pools, H 12 and 16),
    False where SGLang's chain must run (H 6, the DS conv pool, an fp16 row, SGLang's own op still installed)."""
    import sys
    import types

    module = types.ModuleType("sglang.kernels.ops.attention.kda_fused_decode")
    module.kda_fused_decode = sglang.kda_fused_decode
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(sglang, "_KERNEL_DEVICE_MIN", -1)  # CPU tensors stand for CUDA ones here
    keys = ("mixed_qkv", "a", "b", "conv_states", "ssm_states", "cache_indices", "onorm_g")

    def covered(call, **changed):
        merged = {**call, **changed}
        return sglang.kda_fused_decode_covered(*(merged[k] for k in keys))

    for H, dtype in ((12, torch.float32), (12, torch.bfloat16), (16, torch.float32)):
        call, _, _ = sglang_inputs(H, state_dtype=dtype)
        assert covered(call), (H, dtype)
    call, _, _ = sglang_inputs(12)
    assert covered(call, conv_states=call["conv_states"].contiguous())  # a compact [slots, 3, C] pool of its own
    assert not covered(call, conv_states=torch.empty(6, 3 * 12 * D, 3, dtype=torch.bfloat16).transpose(1, 2))
    assert not covered(call, mixed_qkv=call["mixed_qkv"].half())
    six, _, _ = sglang_inputs(12)
    assert not covered(six, ssm_states=six["ssm_states"][:, :6])
    monkeypatch.setattr(sglang, "_KERNEL_DEVICE_MIN", 0)
    assert not covered(call)  # CPU tensors
    monkeypatch.setattr(sglang, "_KERNEL_DEVICE_MIN", -1)
    module.kda_fused_decode = lambda *a, **kw: None  # SGLang's own
    assert not covered(call)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("H", [12, 24])
def test_sglang_fused_decode_matches_the_composition_on_cuda(H, state_dtype):
    _sglang_matches_the_composition(H, "cuda", state_dtype)
