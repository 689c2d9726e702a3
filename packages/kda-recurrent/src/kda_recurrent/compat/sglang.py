"""SGLang's KDA T=1 decode call ``fused_recurrent_kda_packed_decode``, on kda's kernels.

Read from the stored engine sources:

- The function replaced: sgl-project/sglang ``python/sglang/kernels/ops/attention/fla/fused_recurrent.py``
  @ 047d31af2516212c09b8ce356fae8298ba8526d7 (the version with ``lower_bound``; an older copy
  @ 576695168ffae8ce50c14939f4836bc72ecc12f6 lacks it, and this signature takes both call forms).
- Its caller: ``TritonKDAKernel.packed_decode`` in
  ``python/sglang/srt/layers/attention/linear/kernels/kda_triton.py`` @ 007d1d93beabe99478bc855e6ccdc4ac0bfcdf7d,
  which imports the name at module level, allocates ``out = mixed_qkv.new_empty(B, 1, HV, V)``, flattens ``a`` to
  [B, HV * K] and ``b`` to [B, HV], and calls with every argument by keyword, ``use_qk_l2norm_in_kernel=True`` and
  no ``lower_bound`` (softplus gate); it returns ``out.transpose(0, 1)``.
- docs/serving.md §4.

Semantics kept: ``b`` is a beta logit (the kernel applies sigmoid in fp32; the source docstring's "post-sigmoid" is
not what its kernel does); ``A_log`` [HV] and ``dt_bias`` [HV * K] are per value head; value head hv reads query
head ``hv // (HV // H)``; the L2 norm is off unless asked for (SGLang's default; its call site asks for it); an
index ``< 0`` is null and slot 0 is live (``NullSlotPolicy.OUT_OF_RANGE``, docs/design.md §4; kda also nulls an
index ``>= slots``, which SGLang reads past the pool). ``out`` is written in place; the pool is updated in place.

Paths: H == HV with K = V = 128 on CUDA runs kda-cute's packed T=1 kernel on the arguments as they are (its
per-head gate indexing is SGLang's when H == HV). Any other call (GQA, HV > H; K = 64; the CPU) runs through
:func:`kda_recurrent.recurrent_kda` on zero-copy views; with HV != H the gate is computed per value head first (fp32,
kda-core's gate formula: a few elementwise kernels) because kda's in-kernel gate reads its parameters per query
head. Both are exact up to rounding.
"""

from __future__ import annotations

import sys

import torch

from kda_core.call_args import RecurrentArgs, SpecArgs
from kda_core.contracts import MAX_TREE_TOKENS, T1_HEAD_COUNTS, NullSlotPolicy
from kda_core.errors import fail
from kda_core.oracle import kda_gate_ref
from kda_core.validation import validate_gate_params, validate_recurrent
from kda_recurrent.compat import capability_of, constant, keepable, optional_entry, shape_text
from kda_recurrent.facade import recurrent_kda

__all__ = ["fused_recurrent_kda_packed_decode", "kda_target_verify"]

_NULL_POLICY = NullSlotPolicy.OUT_OF_RANGE

# As in kda_recurrent.compat.vllm.kimi_k3: the kernel branch's device threshold and the lazily imported entry.
_KERNEL_DEVICE_MIN = 0
_UNLOADED = object()
_packed_entry = _UNLOADED


def _load_packed():
    global _packed_entry
    _packed_entry = optional_entry("kda_cute.decode_t1", "kda_decode_t1_packed")
    return _packed_entry


def _heads(mixed_qkv, initial_state):
    """(H, HV, V, K) from the pool [slots, HV, V, K] and the packed width 2 * H * K + HV * V, as SGLang infers them."""
    if not isinstance(initial_state, torch.Tensor) or initial_state.dim() != 4:
        fail("initial_state", "the state pool [slots, HV, V, K]", shape_text(initial_state))
    if not isinstance(mixed_qkv, torch.Tensor) or mixed_qkv.dim() != 2:
        fail("mixed_qkv", "a 2-D tensor [B, 2 * H * K + HV * V]", shape_text(mixed_qkv))
    _, HV, V, K = initial_state.shape
    qk = mixed_qkv.shape[1] - HV * V
    H = qk // (2 * K) if K else 0
    if qk <= 0 or H * 2 * K != qk or HV % H:
        fail("mixed_qkv", f"a last dim 2 * H * K + HV * V with HV % H == 0 (HV = {HV}, V = {V}, K = {K} from "
             "initial_state)", shape_text(mixed_qkv))
    return H, HV, V, K


def _views(mixed_qkv, a, b, H, HV, V, K):
    """q, k [B, 1, H, K], v [B, 1, HV, V], the raw gate [B, 1, HV, K] and the beta logit [B, 1, HV]: views."""
    B = mixed_qkv.shape[0]
    if mixed_qkv.stride(1) != 1:
        fail("mixed_qkv", "a contiguous last dim", mixed_qkv.stride())
    if not isinstance(a, torch.Tensor) or tuple(a.shape) != (B, HV * K):
        fail("a", f"shape [{B}, {HV * K}] ([B, HV * K])", shape_text(a))
    if a.stride(1) != 1:
        fail("a", "a contiguous last dim", a.stride())
    if not isinstance(b, torch.Tensor) or tuple(b.shape) != (B, HV):
        fail("b", f"shape [{B}, {HV}] ([B, HV])", shape_text(b))
    q, k, v = mixed_qkv.split((H * K, H * K, HV * V), dim=1)
    return (q.unflatten(1, (H, K)).unsqueeze(1), k.unflatten(1, (H, K)).unsqueeze(1),
            v.unflatten(1, (HV, V)).unsqueeze(1), a.unflatten(1, (HV, K)).unsqueeze(1), b.unsqueeze(1))


def fused_recurrent_kda_packed_decode(
    mixed_qkv,
    a,
    b,
    A_log,
    dt_bias,
    scale,
    initial_state,
    out,
    ssm_state_indices,
    use_qk_l2norm_in_kernel=False,
    lower_bound=None,
):
    """SGLang's KDA packed T=1 decode (same arguments, defaults and return).

    Args (B requests; H query/key heads, HV value heads, K = V = 128, or 64 on the generic path):
        mixed_qkv: [B, 2 * H * K + HV * V] bf16 ``[q heads | k heads | v heads]``, last dim contiguous, row stride
            free.
        a: [B, HV * K] raw gate; b: [B, HV] beta logit.
        A_log: [HV] fp32; dt_bias: [HV * K] fp32 (per value head).
        scale: the query scale (None: K ** -0.5).
        initial_state: the pool [slots, HV, V, K], last dim contiguous; updated in place.
        out: bf16 [B, 1, HV, V], written in place.
        ssm_state_indices: [B] int32 / int64. An index ``< 0`` (or ``>= slots``) makes its row null: zero output, the
            pool neither read nor written; slot 0 is live.
        use_qk_l2norm_in_kernel: L2-normalise q and k (SGLang's default False; its call site passes True).
        lower_bound: None (softplus gate ``-exp(A_log) * softplus(a + dt_bias)``) or a negative float
            (``lower_bound * sigmoid(exp(A_log) * (a + dt_bias))``).

    Returns ``(out, initial_state)``, the tensors passed.
    """
    # The kernel's form, read from two shapes: K = V = 128 and a packed width of 3 * HV * 128 (so H == HV). The
    # packed entry's validator checks the rest (its KDAError names the argument); any other form goes to _heads.
    try:
        _, HV, V, K = initial_state.shape
        kernel = (V == 128 and K == 128 and mixed_qkv.shape[1] == 3 * HV * 128
                  and mixed_qkv.get_device() >= _KERNEL_DEVICE_MIN)
    except (AttributeError, TypeError, ValueError, IndexError):  # not tensors, or other ranks: _heads names them
        kernel = False
    if kernel:
        fn = _packed_entry
        if fn is _UNLOADED:
            fn = _load_packed()
        if fn is not None:
            fn(mixed_qkv, a, b, initial_state, ssm_state_indices, num_heads=HV, A_log=A_log, dt_bias=dt_bias,
               lower_bound=lower_bound, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, scale=scale, output=out,
               null_policy=_NULL_POLICY)
            return out, initial_state
    H, HV, V, K = _heads(mixed_qkv, initial_state)
    q, k, v, g, beta = _views(mixed_qkv, a, b, H, HV, V, K)
    use_gate = H == HV
    if not use_gate:
        # kda's in-kernel gate reads A_log / dt_bias per query head; SGLang's are per value head. Validate the call
        # as the kernel will take it (the raw gate stands in for the precomputed one: same shape) and the
        # per-value-head parameters, then compute the decay per value head (kda_gate_ref infers the head count
        # from A_log, so [HV] parameters map one-to-one onto value heads).
        validate_recurrent(RecurrentArgs(
            q, k, v, g, beta, scale=scale, initial_state=initial_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, beta_is_logit=True, ssm_state_indices=ssm_state_indices,
            output=out))
        validate_gate_params(A_log, dt_bias, lower_bound, HV, K, like=q, heads_text="HV")
        g = kda_gate_ref(g, A_log, dt_bias, lower_bound)
    recurrent_kda(
        q, k, v, g, beta, A_log=A_log if use_gate else None, dt_bias=dt_bias if use_gate else None, scale=scale,
        initial_state=initial_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate,
        lower_bound=lower_bound if use_gate else None, beta_is_logit=True, ssm_state_indices=ssm_state_indices,
        output=out, null_policy=_NULL_POLICY,
    )
    return out, initial_state


def kda_target_verify(
    A_log,
    dt_bias,
    q,
    k,
    v,
    a,
    b,
    *,
    ssm_states,
    cache_indices,
    query_start_loc,
    intermediate_states_buffer=None,
    intermediate_state_indices=None,
    cache_steps=None,
    retrieve_parent_token=None,
    lower_bound=None,
    cache_ring=False,
    **kwargs,
):
    """SGLang's KDA speculative verify (``TritonKDAKernel.target_verify``'s arguments, without ``self``).

    Read from sgl-project/sglang ``python/sglang/srt/layers/attention/linear/kernels/kda_triton.py`` (stored copy
    without a recorded commit, the one whose ``target_verify`` passes ``lower_bound``) and the kernel it calls,
    ``python/sglang/srt/layers/attention/fla/fused_sigmoid_gating_recurrent.py``
    @ 06a2775440b93b1d4e570c952a8fefcd8a94b4df (``fused_sigmoid_gating_delta_rule_update`` with ``is_kda=True``,
    ``disable_state_update=True``); docs/serving.md §4.

    Args (N requests, concatenated, at most ``cache_steps`` tokens each; H q/k heads, HV value heads):
        A_log: [HV] fp32; dt_bias: [HV * K] fp32 (per value head, as SGLang indexes them).
        q, k: [1, Ntok, H, K]; v: [1, Ntok, HV, V] (head dims compact); a: the raw gate, [1, Ntok, HV * K] (or
            [Ntok, HV * K]); b: beta logits [1, Ntok, HV] (or [Ntok, HV]).
        ssm_states: the committed pool [slots, HV, V, K], **read only**; cache_indices: [N] its slots (``< 0``:
            null, as SGLang pads).
        query_start_loc: [N + 1] int offsets (device data, bounded in the kernel).
        intermediate_states_buffer: [cache_slots, S, HV, V, K] (or a view of that memory as
            [cache_slots * cache_steps, HV, V, K]) receiving the state after every draft token;
            intermediate_state_indices: [N] each request's cache slot (``< 0``, or a slot whose rows lie past the
            buffer: no states stored, and then the request has no output either; the rows are built in int64, so no
            slot wraps onto another); cache_steps: int, the draft steps of this call (at most S; None: S).
            Request n's token t goes to ``buffer[slot_n, t]``: the 5-D buffer's S is the per-slot stride, as in
            SGLang's later kernel (``fused_sigmoid_gating_delta_rule_update`` of
            ``python/sglang/kernels/ops/attention/fla/fused_sigmoid_gating_recurrent.py``, stored copy without a
            recorded commit: "kept for API compat; stride is derived from intermediate_states_buffer.shape[1]"),
            which ``--speculative-adaptive`` needs (its steps per call change, the buffer does not). A 4-D view
            takes ``cache_steps`` as the stride.
        retrieve_parent_token: None (a chain) or [N, T] (EAGLE trees): token t > 0 continues from the stored state
            of token ``retrieve_parent_token[n, t]`` (docs/design.md §9 gives the rule for parents outside [0, t),
            which SGLang's kernel reads out of bounds).
        lower_bound: None (softplus gate) or a negative float.
        cache_ring: False. A later stored copy of ``target_verify`` (no recorded commit) adds ``cache_ring`` and the
            ReplaySSM ring tensors ``replayssm_rawv``, ``replayssm_rawk``, ``replayssm_g``, ``replayssm_beta``: with
            ``cache_ring=True`` its kernel writes every draft token's records into those rings instead of the
            intermediate states. kda does not write them, so ``cache_ring=True`` raises a KDAError rather than return
            outputs while leaving the rings stale. ``kwargs``: SGLang's other keywords (the ring tensors included,
            which only the ring mode reads), ignored.

    Without an intermediate buffer the call is a frozen verify (outputs only). The committed pool is never
    written. Returns the output [1, Ntok, HV, V] (q's dtype is SGLang's; kda writes bf16 there).
    """
    from kda_recurrent.spec import spec_call

    if cache_ring is not False:
        fail("cache_ring", "False (kda's verify does not write SGLang's ReplaySSM rings; take the intermediate states "
             "path)", repr(cache_ring))
    if not isinstance(ssm_states, torch.Tensor) or ssm_states.dim() != 4:
        fail("ssm_states", "the state pool [slots, HV, V, K]", shape_text(ssm_states))
    _, HV, V, K = ssm_states.shape
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[0] != 1:
        fail("q", "[1, Ntok, H, K]", shape_text(q))
    n_tok, H = q.shape[1], q.shape[2]
    g = a.reshape(1, n_tok, HV, K)
    beta = b.reshape(1, n_tok, HV)
    use_gate = H == HV
    if not use_gate:  # per-value-head gate parameters: the decay first (see fused_recurrent_kda_packed_decode)
        validate_gate_params(A_log, dt_bias, lower_bound, HV, K, like=q, heads_text="HV")
        g = kda_gate_ref(g, A_log, dt_bias, lower_bound)
    out = torch.empty(1, n_tok, HV, V, dtype=torch.bfloat16, device=q.device)
    pool = idx = None
    if intermediate_states_buffer is not None:
        buf = intermediate_states_buffer
        # A [cache_slots, steps, HV, V, K] buffer fixes the steps per slot: the per-request stride (SGLang's later
        # kernel derives it from the buffer, not from cache_steps: the two differ under adaptive speculation).
        per_slot = buf.shape[1] if isinstance(buf, torch.Tensor) and buf.dim() == 5 else None
        if cache_steps is None and per_slot is not None:
            cache_steps = per_slot
        if type(cache_steps) is not int or cache_steps < 1:
            fail("cache_steps", "an int >= 1 (the intermediate buffer's steps per slot)", repr(cache_steps))
        if per_slot is not None and cache_steps > per_slot:
            fail("cache_steps", f"at most the buffer's steps per slot, intermediate_states_buffer.shape[1] = "
                 f"{per_slot}", cache_steps)
        if intermediate_state_indices is None:
            fail("intermediate_state_indices", "[N] cache slots with an intermediate_states_buffer", None)
        pool = buf.reshape(-1, HV, V, K)
        stride = cache_steps if per_slot is None else per_slot
        # Request n's step t at pool row cache_n * stride + t (t < cache_steps <= stride), in one elementwise launch
        # (the steps are a kept constant), in int64 so that no cache slot wraps: a negative one gives negative rows
        # for every step and a past-the-end one rows past the pool, both null (out_of_range), never another slot.
        steps = constant(cache_steps, torch.int64, q.device)
        idx = torch.add(steps, intermediate_state_indices[:, None], alpha=stride)
    args = RecurrentArgs(q, k, v, g, beta, A_log if use_gate else None, dt_bias if use_gate else None, None, pool,
                         False, True, use_gate, lower_bound if use_gate else None, True, query_start_loc, idx, None,
                         out)
    spec = SpecArgs(initial_state_source=ssm_states, initial_state_indices=cache_indices,
                    disable_state_update=pool is None,
                    parent_indices=retrieve_parent_token if pool is not None else None)
    o, _ = spec_call(args, spec, _NULL_POLICY, rows_t=cache_steps)
    return o


# ---------------------------------------------------------------------------------------------------------------
# Kimi K3's fused decode (conv update + SiLU + the KDA step + gated RMSNorm in one launch): read from
# sgl-project/sglang ``python/sglang/kernels/ops/attention/kda_fused_decode.py``
# @ 0000e9b46f38dd9055ecad825a42c47a047077e6 (``covered`` and ``kda_fused_decode``), its caller in the KDA backend
# (``python/sglang/srt/layers/attention/linear/kda_backend.py``, stored copies without a recorded commit), which binds
# the module by ``from sglang.kernels.ops.attention import kda_fused_decode`` and reads both attributes per call, and
# the model's ``_prepare_fused_decode`` in ``python/sglang/srt/models/kimi_k3.py`` (stored copy without a recorded
# commit), which builds the static arguments: per-part transposed fp32 conv weights [4, seg], a dense fp32 conv bias
# [3 * seg] (zeros without one), A_log [H], the fp32 norm weight [128] and eps. On an SM90 GPU this is SGLang's
# default T=1 decode for Kimi K3 at TP8 (12 local heads) ahead of the packed decode replaced above; its own kernel
# takes an fp32 pool and H in {3, 6, 12}.

SCALE = 128 ** -0.5
_stacked: dict = {}  # (data_ptr, _version) of the three parts -> their [3, 4, seg] stack, built once per weight set


def _conv_weight(w_q_t, w_k_t, w_v_t, fused_weight):
    """kda's conv weight [3, 4, seg] fp32 from SGLang's three [4, seg] parts: a stack, kept per weight set (the parts
    are static after loading; an in-place change bumps their ``_version`` and rebuilds it). Never kept while a CUDA
    graph is being captured (its memory would be the graph's): built in the graph instead. A graph captured with a
    stack keeps reading it, as SGLang's graphs keep reading the derived parts they were captured with (its
    ``_prepare_fused_decode`` makes new tensors, never rewrites them in place)."""
    if fused_weight is not None:
        return fused_weight
    parts = (w_q_t, w_k_t, w_v_t)
    if not all(isinstance(p, torch.Tensor) for p in parts):
        fail("w_q_t", "three [4, H*128] fp32 tensors (w_q_t, w_k_t, w_v_t)", [type(p).__name__ for p in parts])
    key = tuple((p.data_ptr(), p._version, p.device) for p in parts)
    got = _stacked.get(key)
    if got is None:
        got = torch.stack(parts)
        if not keepable(got):
            return got
        if len(_stacked) > 4096:  # weights reloaded many times over: start again
            _stacked.clear()
        _stacked[key] = got
    return got


def kda_fused_decode(mixed_qkv, a, b, conv_states, w_q_t, w_k_t, w_v_t, conv_bias, A_log, dt_bias, onorm_g,
                     onorm_weight, ssm_states, cache_indices, scale, onorm_eps, lower_bound=None, *,
                     fused_weight=None, actual_batch_size=None):
    """SGLang's fused Kimi K3 decode step on kda's fused layer (:func:`kda_recurrent.fused.fused_kda_decode`):
    shifts ``conv_states`` and updates ``ssm_states`` in place for the rows of ``cache_indices``, returns the
    gated-normed output [1, B, H, 128] bf16 (allocated, as SGLang's does).

    Args (B rows, H heads, seg = H * 128):
        mixed_qkv: [B, 3 * seg] bf16, the raw (pre-conv) q|k|v row (row stride free).
        a: [B, seg] bf16, the raw forget gate; b: [B, H] bf16, beta logits (both row stride free).
        conv_states: [slots, 3, 3 * seg] bf16, channel-contiguous columns oldest first (kda's SD layout seen
            transposed; its slot stride free).
        w_q_t, w_k_t, w_v_t: [4, seg] fp32 each, the conv taps of q, k, v (tap 0 the oldest column); conv_bias
            [3 * seg] fp32. A_log [H] fp32, dt_bias [seg] fp32; lower_bound None (softplus gate) or negative (Kimi K3).
        onorm_g: [B, seg] bf16, the output gate; onorm_weight [128] fp32; onorm_eps the norm's eps.
        ssm_states: [slots, H, 128, 128] fp32 (bf16 too), inner dims compact, slot stride free; as many slots as
            ``conv_states``. cache_indices: [B] int32 (int64 too).
        scale: 128 ** -0.5 (kda's fixed scale; another value raises a KDAError).
        fused_weight, actual_batch_size: the keywords a later copy's tests pass: the three parts already stacked
            [3, 4, seg] (used as given), and the rows that are real (rows past it are CUDA-graph padding: zero
            output, no cache touched).

    Null rows are SGLang's: an index ``< 0`` (its graph padding) gets zero output and touches neither cache; slot 0 is
    live (``NullSlotPolicy.OUT_OF_RANGE``); kda also nulls an index ``>= slots``, which SGLang's kernel would read
    past the pool. The conv outputs and o are rounded to bf16 inside the layer (docs/design.md §8). No host sync;
    CUDA-graph capturable once a first eager call has built the stacked weight (SGLang's warm-up runs do).
    """
    from kda_recurrent.fused import fused_kda_decode as fused
    from kda_recurrent.integrations import original

    engine = original(_FUSED_MODULE, "kda_fused_decode")
    if engine is not None and not _kda_covers(mixed_qkv, a, b, conv_states, ssm_states, cache_indices, onorm_g):
        kwargs = {} if fused_weight is None and actual_batch_size is None else \
            dict(fused_weight=fused_weight, actual_batch_size=actual_batch_size)
        return engine(mixed_qkv, a, b, conv_states, w_q_t, w_k_t, w_v_t, conv_bias, A_log, dt_bias, onorm_g,
                      onorm_weight, ssm_states, cache_indices, scale, onorm_eps, lower_bound, **kwargs)
    if not isinstance(scale, (int, float)) or abs(float(scale) - SCALE) > 1e-12 * SCALE:
        fail("scale", f"128 ** -0.5 = {SCALE!r} (kda's fused layer fixes it)", repr(scale))
    weight = _conv_weight(w_q_t, w_k_t, w_v_t, fused_weight)
    if not isinstance(ssm_states, torch.Tensor) or ssm_states.dim() != 4:
        fail("ssm_states", "the state pool [slots, H, 128, 128]", shape_text(ssm_states))
    if not isinstance(conv_states, torch.Tensor) or conv_states.dim() != 3:
        fail("conv_states", "the conv pool [slots, 3, 3*H*128]", shape_text(conv_states))
    H = ssm_states.shape[1]
    B = mixed_qkv.shape[0]
    out = torch.empty((1, B, H, 128), dtype=torch.bfloat16, device=mixed_qkv.device)
    n = B if actual_batch_size is None else max(0, min(int(actual_batch_size), B))
    if n < B:
        out[:, n:].zero_()
    if n == 0:
        return out
    fused(mixed_qkv[:n], weight, conv_states.transpose(1, 2), a[:n].unflatten(-1, (H, 128)).unsqueeze(0),
          b[:n].unsqueeze(0), A_log, dt_bias, cache_indices[:n], ssm_states, onorm_g[:n].unflatten(-1, (H, 128)),
          onorm_weight, lower_bound, float(onorm_eps), out[:, :n], bias=conv_bias, null_policy=_NULL_POLICY)
    return out


_FUSED_MODULE = "sglang.kernels.ops.attention.kda_fused_decode"
_KDA_CAPABILITY = (9, 0)  # kda stands in for SGLang's fused decode and verify on Hopper only (see covered)


def _on_kda_gpu(x) -> bool:
    """Whether kda stands in for SGLang's kernel on a call whose tensor ``x`` lives where it does (a Hopper GPU; tests
    may lower ``_KERNEL_DEVICE_MIN`` to let CPU tensors stand for one)."""
    if x.get_device() < _KERNEL_DEVICE_MIN:
        return False
    return not x.is_cuda or capability_of(x) == _KDA_CAPABILITY


def kda_fused_decode_covered(mixed_qkv, a, b, conv_states, ssm_states, cache_indices, onorm_g):
    """SGLang's ``covered`` test for its fused decode, answered for kda's fused layer: True where
    :func:`kda_fused_decode` takes the call. SGLang's own needs an fp32 pool and H in {3, 6, 12}; kda's takes an fp32
    or bf16 pool and H in ``kda_core.contracts.T1_HEAD_COUNTS`` (not 3 or 6: those keep SGLang's chain), the
    module's ``kda_fused_decode`` being kda's (``integrations.sglang``), tensors on a Hopper GPU, and the layouts
    above. Any other call (another GPU: SGLang runs its kernel on SM100 too, where kda's kernels have not run; H 3
    or 6) gets SGLang's own answer, and :func:`kda_fused_decode` hands exactly those calls to SGLang's kernel."""
    from kda_recurrent.integrations import original

    module = sys.modules.get(_FUSED_MODULE)
    if module is None or getattr(module, "kda_fused_decode", None) is not kda_fused_decode:
        return False
    if _kda_covers(mixed_qkv, a, b, conv_states, ssm_states, cache_indices, onorm_g):
        return True
    engine = original(_FUSED_MODULE, "covered")
    return bool(engine(mixed_qkv, a, b, conv_states, ssm_states, cache_indices, onorm_g)) if engine else False


def _kda_covers(mixed_qkv, a, b, conv_states, ssm_states, cache_indices, onorm_g) -> bool:
    """kda's rules for SGLang's fused call: the device (:func:`_on_kda_gpu`), the shapes, dtypes and layouts."""
    tensors = (mixed_qkv, a, b, conv_states, ssm_states, cache_indices, onorm_g)
    if not all(isinstance(t, torch.Tensor) for t in tensors) or ssm_states.dim() != 4 or not _on_kda_gpu(mixed_qkv) \
            or not all(t.get_device() == mixed_qkv.get_device() for t in tensors):
        return False
    slots, H, V, K = ssm_states.shape
    seg = H * 128
    B = mixed_qkv.shape[0] if mixed_qkv.dim() == 2 else -1
    bf16 = torch.bfloat16
    return (
        H in T1_HEAD_COUNTS and V == 128 and K == 128
        and ssm_states.dtype in (torch.float32, bf16) and ssm_states.stride()[1:] == (V * K, K, 1)
        and mixed_qkv.dim() == 2 and mixed_qkv.shape[1] == 3 * seg and mixed_qkv.stride(1) == 1
        and a.shape == (B, seg) and a.stride(1) == 1 and b.shape == (B, H) and b.stride(1) == 1
        and onorm_g.shape == (B, seg) and onorm_g.stride(1) == 1
        and all(t.dtype == bf16 for t in (mixed_qkv, a, b, onorm_g, conv_states))
        and conv_states.dim() == 3 and conv_states.shape == (slots, 3, 3 * seg)
        and conv_states.stride()[1:] == (3 * seg, 1)
        and cache_indices.shape == (B,) and cache_indices.dtype in (torch.int32, torch.int64)
    )


__all__ += ["kda_fused_decode", "kda_fused_decode_covered"]


# ---------------------------------------------------------------------------------------------------------------
# The Triton KDA backend's speculative verify, the method SGLang's KDA backend calls for every target-verify step
# (``_forward_target_verify`` -> ``kernel_dispatcher.target_verify`` -> the verify kernel's ``target_verify``; the
# backend's wrapper kernel classes forward to a ``TritonKDAKernel`` too). Read from sgl-project/sglang
# ``python/sglang/srt/layers/attention/linear/kernels/kda_triton.py`` (stored copy without a recorded commit, the one
# with ``cache_ring`` and the ReplaySSM ring keywords; the earlier @ 007d1d93beabe99478bc855e6ccdc4ac0bfcdf7d takes
# the same arguments without them) and ``python/sglang/srt/layers/attention/linear/kda_backend.py`` (stored copy
# without a recorded commit). Its body calls ``fused_sigmoid_gating_delta_rule_update`` with ``is_kda=True``: that
# module function also serves GDN, so the method, which only KDA reaches, is what kda replaces.

_VERIFY_MODULE = "sglang.srt.layers.attention.linear.kernels.kda_triton"
_VERIFY_NAME = "TritonKDAKernel.target_verify"


def triton_kda_target_verify(
    self,
    A_log,
    dt_bias,
    q,
    k,
    v,
    a,
    b,
    *,
    ssm_states,
    cache_indices,
    query_start_loc,
    intermediate_states_buffer,
    intermediate_state_indices,
    cache_steps,
    retrieve_parent_token,
    lower_bound=None,
    cache_ring=False,
    replayssm_rawv=None,
    replayssm_rawk=None,
    replayssm_g=None,
    replayssm_beta=None,
    **kwargs,
):
    """``TritonKDAKernel.target_verify`` (``self`` is SGLang's kernel object), on :func:`kda_target_verify` where kda
    takes the call (:func:`_verify_covers`: a Hopper GPU, the intermediate-states mode, the Kimi shapes and dtypes);
    every other call (the ReplaySSM ring mode, which writes records kda does not; another GPU, where SGLang's kernel
    runs on SM100 too and kda's kernels have not; shapes kda's kernels lack) goes to SGLang's own method, unchanged.
    Same arguments and return value as SGLang's: the output [1, Ntok, HV, V]; the committed pool is read only."""
    from kda_recurrent.integrations import original

    call = dict(ssm_states=ssm_states, cache_indices=cache_indices, query_start_loc=query_start_loc,
                intermediate_states_buffer=intermediate_states_buffer,
                intermediate_state_indices=intermediate_state_indices, cache_steps=cache_steps,
                retrieve_parent_token=retrieve_parent_token, lower_bound=lower_bound)
    if _verify_covers(q, k, v, a, b, ssm_states, intermediate_states_buffer, cache_steps, retrieve_parent_token,
                      cache_ring):
        return kda_target_verify(A_log, dt_bias, q, k, v, a, b, **call)
    engine = original(_VERIFY_MODULE, _VERIFY_NAME)
    if engine is None:
        fail("TritonKDAKernel.target_verify", "SGLang's own method to hand this call to (kda's integration holds it "
             "while enabled)", None)
    return engine(self, A_log, dt_bias, q, k, v, a, b, **call, cache_ring=cache_ring, replayssm_rawv=replayssm_rawv,
                  replayssm_rawk=replayssm_rawk, replayssm_g=replayssm_g, replayssm_beta=replayssm_beta, **kwargs)


def _verify_covers(q, k, v, a, b, ssm_states, buffer, cache_steps, parents, cache_ring) -> bool:
    """kda's rules for SGLang's verify: not the ring mode; a Hopper GPU (:func:`_on_kda_gpu`), every tensor on it;
    q, k [1, Ntok, H, 128], v [1, Ntok, HV, 128] bf16 with HV a multiple of H; a and b bf16 or fp32; a pool
    [slots, HV, 128, 128] and a buffer (or none) of fp32 or bf16; a tree of at most ``MAX_TREE_TOKENS`` steps."""
    if cache_ring is not False:
        return False
    tensors = (q, k, v, a, b, ssm_states)
    if not all(isinstance(t, torch.Tensor) for t in tensors) or not _on_kda_gpu(q):
        return False
    device = q.get_device()
    if any(t.get_device() != device for t in tensors[1:]):
        return False
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or ssm_states.dim() != 4 or q.shape[0] != 1:
        return False
    H, HV = q.shape[2], v.shape[2]
    pool = (torch.float32, torch.bfloat16)
    if buffer is not None and (not isinstance(buffer, torch.Tensor) or buffer.dtype not in pool
                               or buffer.get_device() != device):
        return False
    if parents is not None and (type(cache_steps) is not int or cache_steps > MAX_TREE_TOKENS):
        return False
    return (
        q.shape[3] == 128 and v.shape[:2] == q.shape[:2] and v.shape[3] == 128 and HV % H == 0
        and all(t.dtype == torch.bfloat16 for t in (q, k, v))
        and a.dtype in pool and b.dtype in pool
        and ssm_states.dtype in pool and tuple(ssm_states.shape[1:]) == (HV, 128, 128)
    )


__all__ += ["triton_kda_target_verify"]
