"""``recurrent_kda``: the one function a serving stack calls per KDA layer, and the routing behind it.

Routing (decided per call from tensor metadata only, never from tensor values):

1. kda-core validates the call (``kda_core.validation.validate_recurrent``); a bad call raises
   :class:`kda_core.errors.KDAError` before anything is launched.
2. CPU tensors run the PyTorch oracle (``kda_core.oracle.recurrent_kda_ref``).
3. CUDA tensors whose call meets the T=1 kernel's contract (``call.t1_eligible``) run the T=1 decode kernel,
   unless the knob ``KDA_T1_FAST_PATH=0`` switches the fast path off: ``[B, 1, H, 128]`` pool calls on its batch
   entry (``Path.T1``), ``[1, T, H, 128]`` + ``cu_seqlens`` pool calls on its varlen entry (``Path.T1_VARLEN``,
   ``decode_t1._run_varlen``: the offsets are device data, read and bounded in the kernel, never on the host; a
   one-token sequence takes the T=1 step, any other length the kernel's exact token loop).
4. Every other CUDA call runs the generic CuTe kernel (T > 1, varlen, spec decode, GQA, K = 64, dense states).
5. When a kernel module of kda-cute cannot be imported (kda-recurrent installed without the ``[cute]`` extra),
   CUDA calls that needed it run the oracle instead, with one warning per process.

:func:`explain` takes the same arguments and returns the path and the reason without running anything.

One description of the call goes through the layers: :func:`recurrent_kda` bundles its arguments once, in its own
order (:class:`kda_core.call_args.RecurrentArgs`); the validators read that bundle and return the call's
description (:class:`kda_core.validation.RecurrentCall`), and the chosen entry takes both: the generic kernel as
``kda_cute.generic.run(call, args)``, the oracle as ``kda_core.oracle.recurrent_kda_ref_args(args)``; the traced
path takes the bundle. The T=1 kernel's entry keeps its positional arguments (``decode_t1._run(call, q, k, v, g,
beta, pool, slots, A_log, dt_bias, l2norm, output)``, kda-cute's own form, shared with its T=1 entries).

Host cost: a T=1 call whose facts kda-core described before takes the hot path, in :func:`recurrent_kda` itself:
kda-core's re-validation (``revalidate_recurrent_t1``, the facts the T=1 kernel's compiled wrapper cannot check; the
wrapper checks the rest before launch) and the T=1 kernel's launch-on-a-validated-call entry (``decode_t1._run``,
called directly). The varlen decode form (``[1, T, H, 128]`` + ``cu_seqlens``, 1-D indices) has its own: kda-core's
``revalidate_recurrent_t1_varlen`` and the varlen entry (``decode_t1._run_varlen``); before it, that form took the
full path on every call (stubbed-launch timeit on CPU tensors, T = S = 1, H = 12, ``out`` given, vLLM's Kimi-Linear
adapter, three interleaved runs on the loaded 2-core development CPU: min 24.4-48.1 us before, 11.6-13.6 us after,
against 6.6-12.5 us for ``kda_decode_t1`` on ready views). Any other call, and a call the wrapper rejects, takes the
full path (:func:`_run_full`): one
validation (the description is remembered by its facts), the routing rules on it, and the chosen entry. Kernel
modules are imported once (on the first CUDA call) and cached here; nothing is allocated when ``output`` is given.
The hot path carries the bundle as a plain tuple and the full path as the NamedTuple (costs in
:mod:`kda_core.call_args`); with no frame between the facade and the re-validator, the hot path costs what it cost
with eighteen positional arguments passed down two frames (an A/B timeit of ``recurrent_kda`` on CPU tensors with
the launch stubbed out, interleaved in one process on the 2-core development CPU: min 8.25 us before, 8.25 after;
in a second run 7.91 and 8.09 us; median paired differences +0.00 and +0.05 us).
Under ``torch.compile`` the call goes through the ``kda::recurrent_kda`` custom op, which :mod:`kda_recurrent.ops`
registers with this function's eager call as its body (imports point one way: ops imports this module; the op is
reached here through ``torch.ops`` once the package has imported ops).

With ``KDA_DEBUG_VALIDATE=1`` (and no CUDA graph being captured) every call, the T=1 hot path included, takes the
full path and checks for duplicate active slots (``kda_core.validation.debug_check_slots``), which synchronises.
"""

from __future__ import annotations

import warnings

import torch

from kda_core import knobs
from kda_core.call_args import RecurrentArgs, SpecArgs
from kda_core.contracts import NullSlotPolicy, first_live_slot, null_policy_of
from kda_core.errors import fail
from kda_core.oracle import recurrent_kda_ref_args
from kda_core.validation import (
    WRAPPER_REJECTED,
    debug_check_slots,
    debug_checks_enabled,
    revalidate_recurrent_t1,
    revalidate_recurrent_t1_varlen,
    validate_recurrent,
)
from kda_recurrent.compat import constant
from kda_recurrent.routes import Path, Route

__all__ = ["recurrent_kda", "explain", "Path", "Route"]


# Kernel entry points, imported on the first CUDA call that needs them (importing kda-cute's kernels pulls in the
# CuTe DSL, which is slow to import and needs its CUDA libraries). None after a failed import. Tests replace these
# module attributes with recorders.
_UNLOADED = object()
_t1_kernel = _UNLOADED
_t1_varlen_kernel = _UNLOADED
_generic_kernel = _UNLOADED
_missing: dict[str, str] = {}  # kernel name -> why it could not be imported
_warned = False


def _t1_entry():
    """The T=1 kernel as ``fn(call, q, k, v, g, beta, pool, slots, A_log, dt_bias, use_qk_l2norm_in_kernel, output)
    -> output``, where ``call`` is the validated :class:`kda_core.validation.RecurrentCall` of those arguments.

    That is decode_t1's launch-on-a-validated-call entry itself (``_run``): the description carries the gate mode,
    lower bound, scale and alignment class, and validating twice would cost about as much as the rest of the host
    path.
    """
    from kda_cute import decode_t1

    return decode_t1._run


def _load(name: str):
    """Import one kernel entry point once; remember why when it cannot be imported. The generic kernel's is
    ``kda_cute.generic.run(call, args, *, null_policy) -> (o, final_state)``: the validated description and the
    bundle it describes. "t1" loads the T=1 kernel's two entries (``_run`` and ``_run_varlen``)."""
    global _t1_kernel, _t1_varlen_kernel, _generic_kernel
    varlen = None
    try:
        if name == "t1":
            fn = _t1_entry()
            from kda_cute.decode_t1 import _run_varlen as varlen
        else:
            from kda_cute.generic import run as fn
    except ImportError as err:  # kda-cute not installed, or its DSL libraries missing
        fn = None
        _missing[name] = f"{type(err).__name__}: {err}"
    if name == "t1":
        _t1_kernel = fn
        _t1_varlen_kernel = varlen
    else:
        _generic_kernel = fn
    return fn


def _t1():
    fn = _t1_kernel
    return _load("t1") if fn is _UNLOADED else fn


def _t1_varlen():
    """The T=1 kernel's varlen entry ``fn(call, q, k, v, g, beta, pool, slots, cu_seqlens, A_log, dt_bias,
    use_qk_l2norm_in_kernel, output, null_policy) -> output`` (``decode_t1._run_varlen``), or None."""
    if _t1_varlen_kernel is _UNLOADED:
        _load("t1")
    return _t1_varlen_kernel


def _generic():
    fn = _generic_kernel
    return _load("generic") if fn is _UNLOADED else fn


def _route(call) -> Path:
    """The path of a validated call (the routing rules of the module docstring, in order).

    Per call: two attribute reads of the remembered description and the knob (a dict lookup while its value is
    unchanged, see ``kda_core.knobs``); the knob is read on every call, so ``KDA_T1_FAST_PATH`` takes effect on the
    next one.
    """
    if not call.on_cuda:
        return Path.ORACLE
    if call.t1_eligible and knobs.get("KDA_T1_FAST_PATH"):
        if call.varlen:
            return Path.T1_VARLEN if _t1_varlen() is not None else Path.ORACLE
        return Path.T1 if _t1() is not None else Path.ORACLE
    return Path.GENERIC if _generic() is not None else Path.ORACLE


def _reason(path: Path, call, args: RecurrentArgs) -> str:
    """Why :func:`_route` chose ``path`` (built only for :func:`explain` and the oracle warning)."""
    if path is Path.T1:
        return f"T=1 fast path ({call.t1_reason})"
    if path is Path.T1_VARLEN:
        return f"T=1 kernel, varlen entry ({call.t1_reason})"
    if path is Path.GENERIC:
        if call.t1_eligible:
            return "eligible for the T=1 kernel, but KDA_T1_FAST_PATH=0 switches the fast path off"
        return f"generic kernel: not T=1 eligible ({call.t1_reason})"
    if not call.on_cuda:
        return f"tensors on {args.q.device.type}: the PyTorch oracle runs (the kernels need CUDA)"
    wanted = "t1" if call.t1_eligible and knobs.get("KDA_T1_FAST_PATH") else "generic"
    return f"kda-cute's {wanted} kernel is not importable ({_missing.get(wanted, 'unknown error')}): the oracle runs"


def _warn_oracle_once(reason: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"kda_recurrent: {reason}. Install kda-recurrent[cute] for the GPU kernels; this is slow.",
                      RuntimeWarning, stacklevel=4)


# kda-core's validators take the call's bundle and are called without a wrapper frame (a keyword call through a wrapper
# cost ~0.4 us). Tests replace these module attributes.
_validate = validate_recurrent
_revalidate = revalidate_recurrent_t1
_revalidate_varlen = revalidate_recurrent_t1_varlen
_named = tuple.__new__  # _named(RecurrentArgs, args): the NamedTuple without its Python-level __new__


def recurrent_kda(
    q,
    k,
    v,
    g,
    beta,
    A_log=None,
    dt_bias=None,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=True,
    use_gate_in_kernel=False,
    lower_bound=None,
    beta_is_logit=False,
    cu_seqlens=None,
    ssm_state_indices=None,
    num_accepted_tokens=None,
    output=None,
    *,
    null_policy=NullSlotPolicy.OUT_OF_RANGE,
    num_spec_tokens=None,
    backend=None,
    initial_state_source=None,
    initial_state_indices=None,
    disable_state_update=False,
    correction_cache=None,
    kg_cache=None,
    parent_indices=None,
):
    r"""Kimi Delta Attention over T tokens per sequence, with an in-place state pool or dense states.

    Names and semantics follow FlashInfer's ``recurrent_kda``, so a serving stack switches by import. The
    positional order matches FlashInfer's up to ``lower_bound``; pass the rest by keyword.

    Notation: B sequences, T tokens each, H query/key heads, HV value heads (HV % H == 0; value head hv uses
    query head hv // (HV // H)), K = V = 128 (the generic kernel also takes K = V = 64), N pool slots.

    Args:
        q, k: [B, T, H, K] bf16, last dim contiguous (other strides free: views of a fused QKV output).
        v: [B, T, HV, V] bf16, last dim contiguous.
        g: [B, T, HV, K] bf16 or fp32: the raw gate pre-activation (``use_gate_in_kernel=True``) or the
            log-space decay itself (``use_gate_in_kernel=False``, the default).
        beta: [B, T, HV] bf16 or fp32: a logit (``beta_is_logit=True``) or already sigmoided.
        A_log: [H] fp32, per query head; needed when ``use_gate_in_kernel``.
        dt_bias: [H*K] (or [H, K]) fp32, per query-head channel, optional (None: zeros); used when
            ``use_gate_in_kernel``.
        scale: query scale; default K ** -0.5.
        initial_state: with ``ssm_state_indices``, the state POOL [N, HV, V, K] (bf16 or fp32, K contiguous,
            inner dims compact, dim-0 (slot) stride any number of elements >= HV*V*K; one that is not a 16-byte
            multiple takes the kernels' unaligned variant), updated in place. Without indices, dense initial
            states [N_seq, HV, V, K] (read only) or None (zeros).
        output_final_state: also return the final states (see Returns): dense mode, fp32 [N_seq, HV, V, K];
            1-D indices without ``cu_seqlens``, the gathered per-sequence states (FlashInfer's return).
        use_qk_l2norm_in_kernel: L2-normalise q and k per head (eps 1e-6) before use.
        use_gate_in_kernel: compute the log-space decay from ``g`` in the kernel:
            ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` (Kimi K3, ``lower_bound < 0``) or
            ``-exp(A_log) * softplus(g + dt_bias)`` (Kimi-Linear, ``lower_bound=None``).
        lower_bound: negative float selecting the lower-bound gate, or None.
        beta_is_logit: apply ``sigmoid`` to ``beta`` in the kernel (in fp32).
        cu_seqlens: [N_seq + 1] int cumulative lengths; then B == 1 and the N_seq sequences are concatenated
            along T. Zero-length sequences are allowed.
        ssm_state_indices: [N_seq] slot of each sequence (read, then the final state written back), or
            [N_seq, T] for speculative decode (int32 or int64, any strides: a view of a wider table): the
            first state is read from slot ``idx[n, max(min(num_accepted_tokens[n], T), 1) - 1]`` and the state
            after token t is written to slot ``idx[n, t]``. A null slot (see ``null_policy``) makes its sequence
            (1-D) or token (2-D) inactive: zero output, the pool is neither read nor written for it, and a
            skipped token is not absorbed.
        num_accepted_tokens: [N_seq] int32 or int64 (any stride) accepted draft count per sequence (2-D
            indices only).
        output: [B, T, HV, V] bf16 buffer to write into (no allocation then); it shares no byte with another
            argument, and no two of its elements share bytes.
        null_policy: keyword only; which slot indices are null (docs/design.md §4), a
            :class:`kda_core.contracts.NullSlotPolicy` or its string value. ``OUT_OF_RANGE`` (the default; kda,
            SGLang, FlashInfer): null iff ``idx < 0 or idx >= N``. ``NONPOSITIVE`` (vLLM, whose padding slot is
            0): null iff ``idx <= 0 or idx >= N``, so slot 0 is never read or written, and with 2-D indices a
            sequence whose ``num_accepted_tokens`` is <= 0 or > T is null as a whole. A null sequence gets zero
            output; the pool is neither read nor written for it. Unlike FlashInfer's dense form, ``-1`` never
            wraps to the last slot (FlashInfer gathers ``pool[idx]`` on the host, so -1 reads and writes slot N-1).
        num_spec_tokens: keyword only; FlashInfer's S, the draft tokens per sequence (None or an int >= 1): each
            sequence has 1 + S tokens (without ``cu_seqlens`` q is [B, 1 + S, ...]) and ``ssm_state_indices``
            is 2-D [N_seq, 1 + S]; without ``cu_seqlens`` the indices may be omitted, and then the pool's first
            B * (1 + S) slots are the checkpoints (row b's token t at slot b * (1 + S) + t), as in FlashInfer.
        backend: keyword only; FlashInfer's ``"cute-dsl"``, ``"cake"`` or ``"auto"`` (every one runs kda's
            kernels, routed as any other call; anything else is a KDAError), or None (kda's form). Given, a
            dense ``initial_state`` (no indices) is updated in place with the final states, as FlashInfer's is,
            and returned as final_state when ``output_final_state``; kda's own form (None) keeps it read only
            (FLA's convention, which ``kda_recurrent.compat.fla`` relies on).
        initial_state_source, initial_state_indices: keyword only (FlashInfer's names): a separate, read-only
            committed pool [Ps, HV, V, K] (bf16 or fp32) and the slot [N_seq] (int32/int64, any stride) each
            sequence's first state is read from; ``initial_state`` with ``ssm_state_indices`` is then only written
            (2-D: per-token checkpoints; 1-D: the final state). A null source slot makes the sequence inactive.
        disable_state_update: keyword only; a frozen verify: outputs only, no state written anywhere (the pool read
            is ``initial_state_source`` at ``initial_state_indices``, else ``initial_state`` at 1-D
            ``ssm_state_indices`` or column 0 of 2-D ones); ``num_accepted_tokens`` and ``output_final_state`` are
            refused.
        correction_cache, kg_cache: keyword only, together, with ``disable_state_update`` (vLLM's RecoverSSM
            records, FlashInfer's layout): fp32 [Pr, HV, T_max, V] and [Pr, HV, T_max, 2K] in k's dtype, Pr the
            read pool's rows. Per token t < T_max of a sequence read from slot r: ``u_t = b_t (v_t - S'_{t-1}
            k^_t)`` at ``correction_cache[r, hv, t]`` and raw k_t | raw g_t at ``kg_cache[r, hv, t]``;
            :func:`kda_recurrent.recoverssm_commit` later folds an accepted prefix of them into the checkpoint.
        parent_indices: keyword only; a tree verify (SGLang's EAGLE trees) [N_seq, T_p] int32/int64: token t
            continues from the state stored for token ``parent_indices[n, t]`` when that lies in [0, t), else
            from the sequence's first state; needs 2-D ``ssm_state_indices`` (the per-token states are stored)
            and ``disable_state_update=False``. docs/design.md §9 gives every rule.

    Returns:
        ``(o, final_state)``: o [B, T, HV, V] bf16 (``output`` when given). final_state: with 1-D
        ``ssm_state_indices``, no ``cu_seqlens`` and ``output_final_state``, what FlashInfer returns there: the
        per-sequence states gathered after the update, [N_seq, HV, V, K] in the pool's dtype (a copy; a null row
        gathers zeros, never a wrapped slot). With any other indices (2-D, or 1-D with ``cu_seqlens``) the pool
        itself, updated in place. Without indices: fp32 [N_seq, HV, V, K] when ``output_final_state`` (with a
        ``backend`` and a dense ``initial_state``, that tensor itself, updated in place), else None.

    Raises:
        kda_core.errors.KDAError: a malformed call (shapes, dtypes, strides, devices, flag combinations), before
        anything is launched. Duplicate active slots in one call are a caller error, detected only with
        ``KDA_DEBUG_VALIDATE=1``.

    Example (runs on CPU through the oracle, on CUDA through the kernels)::

        >>> import torch
        >>> from kda_recurrent import recurrent_kda
        >>> dev = "cuda" if torch.cuda.is_available() else "cpu"
        >>> B, H, K, N = 4, 12, 128, 16                      # 4 decoding requests, a pool of 16 slots
        >>> bf = dict(device=dev, dtype=torch.bfloat16)
        >>> q, k, v, g = (torch.randn(B, 1, H, K, **bf) for _ in range(4))
        >>> beta = torch.randn(B, 1, H, **bf)
        >>> A_log = torch.zeros(H, device=dev)
        >>> dt_bias = torch.zeros(H * K, device=dev)
        >>> pool = torch.zeros(N, H, K, K, **bf)             # V-first: [N, HV, V, K]
        >>> slots = torch.tensor([3, 0, 7, -1], device=dev, dtype=torch.int32)  # -1: a padding row
        >>> o, pool_out = recurrent_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=pool,
        ...                             use_gate_in_kernel=True, lower_bound=-5.0, beta_is_logit=True,
        ...                             ssm_state_indices=slots)
        >>> o.shape, pool_out is pool, bool(o[3].eq(0).all())
        (torch.Size([4, 1, 12, 128]), True, True)
    """
    args = (q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
            use_gate_in_kernel, lower_bound, beta_is_logit, cu_seqlens, ssm_state_indices, num_accepted_tokens, output)
    if type(null_policy) is not _POLICY:  # its string value, or a KDAError naming null_policy
        null_policy = null_policy_of(null_policy)
    if (num_spec_tokens is not None or backend is not None or initial_state_source is not None
            or initial_state_indices is not None or disable_state_update or correction_cache is not None
            or kg_cache is not None or parent_indices is not None):  # FlashInfer's keywords: see _flashinfer_form
        spec = SpecArgs(initial_state_source, initial_state_indices, disable_state_update, correction_cache,
                        kg_cache, parent_indices)
        return _flashinfer_form(_named(RecurrentArgs, args), null_policy, num_spec_tokens, backend, spec)
    if torch.compiler.is_compiling():
        return _traced(_named(RecurrentArgs, args), null_policy)
    # The T=1 hot path (see _run_full for the rest): a call whose facts kda-core has described before, re-validated
    # from the facts the T=1 kernel's compiled wrapper cannot check, launched on the T=1 entry (the varlen form on
    # its varlen entry).
    if cu_seqlens is None:
        call = _revalidate(args)
        if (call is not None and knobs.get("KDA_T1_FAST_PATH") and (t1 := _t1()) is not None
                and not knobs.get("KDA_DEBUG_VALIDATE")):
            try:
                # (an absent dt_bias goes as None: the T=1 entry compiles its variant without one)
                return (t1(call, q, k, v, g, beta, initial_state, ssm_state_indices, A_log, dt_bias,
                           use_qk_l2norm_in_kernel, output, null_policy), initial_state)
            except WRAPPER_REJECTED:  # the T=1 wrapper refused an argument before launch: the full path names it
                pass
    else:
        call = _revalidate_varlen(args)
        if (call is not None and knobs.get("KDA_T1_FAST_PATH") and _t1() is not None
                and (t1v := _t1_varlen_kernel) is not None and not knobs.get("KDA_DEBUG_VALIDATE")):
            try:
                return (t1v(call, q, k, v, g, beta, initial_state, ssm_state_indices, cu_seqlens, A_log, dt_bias,
                            use_qk_l2norm_in_kernel, output, null_policy), initial_state)
            except WRAPPER_REJECTED:  # as above
                pass
    return _run_full(_named(RecurrentArgs, args), null_policy)


_POLICY = NullSlotPolicy


def _check_flashinfer_keywords(args, num_spec_tokens, backend, spec=None):
    """:func:`_flashinfer_form`'s checks, for :func:`explain` (runs nothing: the call is not made)."""
    _flashinfer_form(args, NullSlotPolicy.OUT_OF_RANGE, num_spec_tokens, backend, spec, check_only=True)


_NO_SPEC = SpecArgs()


def _is_spec(spec) -> bool:
    return spec is not None and spec != _NO_SPEC


BACKENDS = ("cute-dsl", "cake", "auto")
"""FlashInfer's ``backend`` values; every one runs kda's kernels (routed as any other call)."""


def _flashinfer_form(args: RecurrentArgs, null_policy: NullSlotPolicy, num_spec_tokens, backend, spec=None,
                     check_only=False):
    """A call with FlashInfer's keywords ``num_spec_tokens`` / ``backend`` (FlashInfer 0.7.2's ``recurrent_kda``).

    ``backend``: one of :data:`BACKENDS` or None, else a KDAError naming it. Given (not None), a dense
    ``initial_state`` (no indices) is updated in place with the final states, as FlashInfer updates it, and is what
    ``output_final_state`` returns. ``num_spec_tokens`` S: None or an int >= 1; each sequence then has 1 + S tokens:
    without ``cu_seqlens`` q is [B, 1 + S, ...]; ``ssm_state_indices`` must be 2-D with 1 + S columns, and without
    ``cu_seqlens`` may be omitted, when the pool's first B * (1 + S) slots are the checkpoint slots (row b's
    token t at slot b * (1 + S) + t; FlashInfer's batched spec-decode form). A frozen verify
    (``spec.disable_state_update``) writes no checkpoint, so its indices may be 1-D, 2-D or (with a source) absent.
    ``spec``: the spec keywords (:class:`kda_core.call_args.SpecArgs`), run by :func:`kda_recurrent.spec.spec_call`
    with ``1 + S`` as the rows' token bound.
    """
    frozen = spec is not None and spec.disable_state_update is True
    if backend is not None and (type(backend) is not str or backend not in BACKENDS):
        fail("backend", f"one of {BACKENDS} (all run kda's kernels) or None", repr(backend))
    q, idx, cu, state = args.q, args.ssm_state_indices, args.cu_seqlens, args.initial_state
    if num_spec_tokens is not None:
        if type(num_spec_tokens) is not int or num_spec_tokens < 1:
            fail("num_spec_tokens", "an int >= 1 (draft tokens per sequence) or None", repr(num_spec_tokens))
        T_spec = 1 + num_spec_tokens
        if not isinstance(q, torch.Tensor) or q.dim() != 4:
            _validate(args)  # names the malformed argument
        if cu is None and q.shape[1] != T_spec:
            fail("q", f"T = 1 + num_spec_tokens = {T_spec} tokens per sequence (dim 1)", f"T={q.shape[1]}")
        if frozen:
            pass  # no checkpoint is written: the read slots are validated with the rest of the call
        elif idx is None and cu is None:
            B = q.shape[0]
            if not isinstance(state, torch.Tensor) or state.dim() != 4 or state.shape[0] < B * T_spec:
                fail("initial_state", f"the checkpoint pool of at least B * (1 + num_spec_tokens) = {B * T_spec} "
                     "slots when ssm_state_indices is omitted",
                     tuple(state.shape) if isinstance(state, torch.Tensor) else None)
            if check_only:
                return None
            idx = constant(B * T_spec, torch.int32, q.device).view(B, T_spec)  # read only: a kept constant
            args = args._replace(ssm_state_indices=idx)
        elif not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.shape[1] != T_spec:
            fail("ssm_state_indices", f"2-D [N_seq, 1 + num_spec_tokens] = [N_seq, {T_spec}] with num_spec_tokens",
                 tuple(idx.shape) if isinstance(idx, torch.Tensor) else None)
    if check_only:
        return None
    if _is_spec(spec):
        from kda_recurrent.spec import spec_call

        rows_t = None if num_spec_tokens is None else 1 + num_spec_tokens
        return spec_call(args, spec, null_policy, rows_t)
    if backend is not None and idx is None and isinstance(state, torch.Tensor):
        # FlashInfer's dense form: the final states overwrite initial_state (rounded once to its dtype).
        o, final = _call(args._replace(output_final_state=True), null_policy)
        with torch.no_grad():
            state.copy_(final)
        return o, (state if args.output_final_state else None)
    return _call(args, null_policy)


def _call(args: RecurrentArgs, null_policy: NullSlotPolicy):
    """The traced or the full path of a bundled call (after the FlashInfer keywords are applied)."""
    if torch.compiler.is_compiling():
        return _traced(args, null_policy)
    return _run_full(args, null_policy)


def _gathered_states(pool, idx, null_policy: NullSlotPolicy):
    """The per-sequence states FlashInfer returns for 1-D indices with ``output_final_state``: ``pool[idx[n]]``
    (a copy, in the pool's dtype) for a live slot, zeros for a null one (never a wrapped slot). Device ops only."""
    if pool.shape[0] == 0 or idx.shape[0] == 0:
        return pool.new_zeros((idx.shape[0], *pool.shape[1:]))
    i = idx.long()
    live = (i >= first_live_slot(null_policy)) & (i < pool.shape[0])
    states = pool[torch.where(live, i, 0)]  # a copy; a null row reads slot 0's bytes, then becomes zeros
    return states.masked_fill_(~live[:, None, None, None], 0)


def _run_full(args: RecurrentArgs, null_policy: NullSlotPolicy = NullSlotPolicy.OUT_OF_RANGE):
    """:func:`_run_path`; then, with 1-D indices, no ``cu_seqlens`` and ``output_final_state``, the gathered
    per-sequence states (:func:`_gathered_states`) instead of the pool, as FlashInfer returns them."""
    o, final = _run_path(args, null_policy)
    if args.output_final_state and args.cu_seqlens is None and _one_d(args.ssm_state_indices):
        return o, _gathered_states(final, args.ssm_state_indices, null_policy)
    return o, final


def _one_d(idx) -> bool:
    return isinstance(idx, torch.Tensor) and idx.dim() == 1


def _run_path(args: RecurrentArgs, null_policy: NullSlotPolicy = NullSlotPolicy.OUT_OF_RANGE):
    """Validate, route, run one call (its bundled arguments and its null policy, a NullSlotPolicy member);
    :func:`recurrent_kda` returns what this returns.

    The full path: a call the hot path did not take (new facts, not T=1 eligible, a wrapper rejection, or
    ``KDA_DEBUG_VALIDATE`` on, which checks the slots for duplicates here). The validator raises the KDAError of a
    bad call; the description it returns goes with the bundle and the policy to the chosen entry.
    """
    call = _validate(args)
    if call.mode != "dense" and debug_checks_enabled():
        debug_check_slots(args.ssm_state_indices, call.N, argument="ssm_state_indices", null_policy=null_policy)
    path = _route(call)
    if path is Path.T1 or path is Path.T1_VARLEN:
        q, k, v, g, beta, A_log, dt_bias, _, pool, _, l2norm, _, _, _, cu, slots, _, output = args
        if path is Path.T1_VARLEN:
            return _t1_varlen_kernel(call, q, k, v, g, beta, pool, slots, cu, A_log, dt_bias, l2norm, output,
                                     null_policy), pool
        return _t1_kernel(call, q, k, v, g, beta, pool, slots, A_log, dt_bias, l2norm, output, null_policy), pool
    if path is Path.GENERIC:
        return _generic_kernel(call, args, null_policy=null_policy)
    if call.on_cuda:
        _warn_oracle_once(_reason(path, call, args))
    elif args.q.is_meta:
        fail("q", "tensors with data, on the CPU or a CUDA device (meta tensors describe shapes only)", args.q.device)
    return recurrent_kda_ref_args(args, null_policy=null_policy)


_OUTPUT_DTYPE = torch.bfloat16


def _traced(args: RecurrentArgs, null_policy: NullSlotPolicy = NullSlotPolicy.OUT_OF_RANGE):
    """The facade as a graph: allocate ``output`` when missing, call the ``kda::recurrent_kda`` op (registered by
    :mod:`kda_recurrent.ops`; its flat schema is the bundle's order, then the null policy's string value), return
    what the facade returns (the op cannot return an alias of its input)."""
    output = args.output
    if output is None:
        output = args.v.new_empty(args.v.shape, dtype=_OUTPUT_DTYPE)
    final_state = torch.ops.kda.recurrent_kda(*args[:-1], output, null_policy.value)
    if args.output_final_state and args.cu_seqlens is None and _one_d(args.ssm_state_indices):
        return output, final_state  # the gathered per-sequence states
    if args.ssm_state_indices is not None:
        return output, args.initial_state
    return output, (final_state if args.output_final_state else None)


def explain(
    q,
    k,
    v,
    g,
    beta,
    A_log=None,
    dt_bias=None,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=True,
    use_gate_in_kernel=False,
    lower_bound=None,
    beta_is_logit=False,
    cu_seqlens=None,
    ssm_state_indices=None,
    num_accepted_tokens=None,
    output=None,
    *,
    null_policy=NullSlotPolicy.OUT_OF_RANGE,
    num_spec_tokens=None,
    backend=None,
    initial_state_source=None,
    initial_state_indices=None,
    disable_state_update=False,
    correction_cache=None,
    kg_cache=None,
    parent_indices=None,
) -> Route:
    """The :class:`Route` (path, reason) :func:`recurrent_kda` would take for these arguments; runs nothing.

    Validates like the real call (a bad call raises the same :class:`kda_core.errors.KDAError`, ``null_policy``
    included; the policy never changes the path). May import the kda-cute kernel modules, as the first real CUDA
    call would.

        >>> explain(q, k, v, g, beta, initial_state=pool, ssm_state_indices=slots)  # doctest: +SKIP
        Route(path=<Path.T1: 't1_decode'>, reason='T=1 fast path (...)')
    """
    args = _named(RecurrentArgs, (q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
                                  use_qk_l2norm_in_kernel, use_gate_in_kernel, lower_bound, beta_is_logit,
                                  cu_seqlens, ssm_state_indices, num_accepted_tokens, output))
    policy = null_policy_of(null_policy)
    spec = SpecArgs(initial_state_source, initial_state_indices, disable_state_update, correction_cache, kg_cache,
                    parent_indices)
    if num_spec_tokens is not None or backend is not None or _is_spec(spec):
        _check_flashinfer_keywords(args, num_spec_tokens, backend, spec)
        if _is_spec(spec):
            from kda_core.validation_spec import validate_spec
            from kda_recurrent.spec import spec_route

            rows_t = None if num_spec_tokens is None else 1 + num_spec_tokens
            return spec_route(validate_spec(args, spec, policy, device_kind="any"), args, spec, rows_t)
        if num_spec_tokens is not None and args.ssm_state_indices is None and args.cu_seqlens is None:
            B, T = args.q.shape[:2]
            args = args._replace(ssm_state_indices=torch.zeros(B, T, dtype=torch.int32, device=args.q.device))
    call = _validate(args)
    path = _route(call)
    return Route(path, _reason(path, call, args))
