"""Host-side validation of the spec-decode modes of ``recurrent_kda`` and of the RecoverSSM commit
(docs/design.md §9): metadata only.

As every validator of :mod:`kda_core.validation`: shapes, dtypes, strides, devices, alignment and scalar
arguments; no tensor value is read, nothing synchronises or allocates, so the checks are safe during CUDA-graph
capture. A broken rule raises :class:`kda_core.errors.KDAError` (``"<argument>: expected <what>, got <what>"``);
a legal call returns a frozen description remembered by its facts.

:func:`validate_spec` runs :func:`kda_core.validation.validate_recurrent` on the call's
:class:`~kda_core.call_args.RecurrentArgs` (so every rule of the plain call holds as it does there), then checks the
six keywords of :class:`~kda_core.call_args.SpecArgs` and their combinations; :class:`SpecCall` carries every field
of :class:`~kda_core.validation.RecurrentCall` plus the spec-decode facts.

Layouts accepted (never rejected, never read out of bounds; the engines' layouts):

- ``initial_state_source`` and every pool / checkpoint: [rows, HV, V, K] bf16 or fp32, inner dims compact, row
  stride any number of elements >= the row (a stride that is not a 16-byte multiple makes the call unaligned).
- Slot, source and parent indices, accepted counts and offsets: int32 or int64, any strides (columns of wider
  tables; values are device data, bounded in the kernels).
- ``correction_cache`` / ``kg_cache``: last dim contiguous, every other stride free (vLLM interleaves each block's
  state and records in one page, so slot strides are arbitrary).

Aliasing: a tensor the call writes (the output, a written pool, the records, the committed checkpoint) shares no
byte with any other tensor of the call. Two tensors paged with one dim-0 byte stride, each of whose rows fits in that
stride, are compared row against row exactly (interleaved pages pass); any other pair by byte range.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from kda_core.call_args import RecurrentArgs, SpecArgs
from kda_core.contracts import (
    GENERIC_HEAD_DIMS,
    MAX_TREE_TOKENS,
    GateMode,
    NullSlotPolicy,
    gate_mode,
    null_policy_of,
)
from kda_core.errors import fail
from kda_core.validation import (
    _ACT_DTYPES,
    _POOL_DTYPES,
    RecurrentCall,
    _check_flag,
    _check_host_kind,
    _check_scalar_args,
    _fail_device,
    _pow2_alignment,
    _remember,
    _row_bits,
    _rows,
    _self_overlapping,
    _slots,
    _span,
    debug_check_slots,
    validate_recurrent,
)
from kda_core.validation import _MEMO as _VALIDATION_MEMO

__all__ = [
    "SpecCall",
    "CommitCall",
    "validate_spec",
    "validate_recoverssm_commit",
    "validate_recoverssm_layers",
    "spec_combination",
    "debug_check_spec_slots",
]

_Tensor = torch.Tensor
_F32 = torch.float32
_INDEX_DTYPES = (torch.int32, torch.int64)
_DEVICE_KINDS = ("cuda", "any")


@dataclass(frozen=True)
class SpecCall(RecurrentCall):
    """A validated ``recurrent_kda`` call with its spec-decode keywords (docs/design.md §9).

    The :class:`~kda_core.validation.RecurrentCall` fields describe the plain part as ``validate_recurrent`` does:
    ``mode`` is the form of ``ssm_state_indices`` ("pool": 1-D, "spec": 2-D, "dense": none, which with a source
    means a frozen verify with no pool at all; with ``frozen`` nothing is written whatever the mode), ``N`` and
    ``state_dtype`` are the pool's (None without one), and ``aligned`` / ``alignment`` also fold in the source's
    pointer and row stride. A call with any spec-decode keyword is never T=1 eligible.
    """

    null_policy: NullSlotPolicy = NullSlotPolicy.OUT_OF_RANGE
    has_source: bool = False
    """First states come from ``initial_state_source[initial_state_indices[n]]``."""
    source_rows: int | None = None
    """Ps, the source's row count (None without a source)."""
    source_dtype: torch.dtype | None = None
    source_index_dtype: torch.dtype | None = None
    read_rows: int | None = None
    """Pr, the rows of the tensor first states are read from (the source, else the pool; None in dense mode)."""
    frozen: bool = False
    """``disable_state_update=True``: no state is written."""
    records: bool = False
    """RecoverSSM records are written (``correction_cache`` and ``kg_cache``)."""
    t_max: int = 0
    """T_max, the records' token capacity (0 without records)."""
    kg_dtype: torch.dtype | None = None
    records_aligned: bool = False
    """Both record tensors' pointers and non-unit strides are 16-byte multiples (False without records)."""
    tree: bool = False
    """``parent_indices`` is given (tree verify)."""
    parent_cols: int = 0
    """T_p, the columns of ``parent_indices`` (tokens t >= T_p take parent t - 1)."""
    parent_dtype: torch.dtype | None = None


@dataclass(frozen=True)
class CommitCall:
    """A validated RecoverSSM commit (one layer, or ``layers`` layers sharing every layout; docs/design.md §9)."""

    N: int
    """Rows (requests) of ``state_indices`` / ``num_accepted_tokens``."""
    P: int
    """Checkpoint slots (the caches have as many)."""
    H: int
    """Query heads of the gate parameters (HV without ``A_log``)."""
    HV: int
    K: int
    V: int
    t_max: int
    state_dtype: torch.dtype
    kg_dtype: torch.dtype
    index_dtype: torch.dtype
    nat_dtype: torch.dtype
    qsl_dtype: torch.dtype | None
    """``query_start_loc``'s dtype (None without offsets: every row's length is T_max)."""
    gate_mode: GateMode
    lower_bound: float | None
    has_dt_bias: bool
    use_qk_l2norm_in_kernel: bool
    null_policy: NullSlotPolicy
    aligned: bool
    alignment: int
    on_cuda: bool
    layers: int = 1


# ----------------------------------------------------------------------------------------------------------------
# Shared pieces


def _tensor(name, t):
    if not isinstance(t, _Tensor):
        fail(name, "a torch.Tensor", type(t).__name__)


def _same_device(name, t, dev):
    if t.get_device() != dev:
        _fail_device(name, t, dev)


def _bits(t) -> int:
    """Alignment bits of ``t``: its pointer OR'ed with the byte stride of every dimension it steps over (size > 1,
    stride != 1)."""
    acc = t.data_ptr()
    es = t.element_size()
    for n, s in zip(t.shape, t.stride()):
        if n > 1 and s != 1:
            acc |= s * es
    return acc


def _inner_span(t) -> int:
    """Bytes one dim-0 row of ``t`` spans (as :func:`kda_core.validation._span` of ``t[0]``)."""
    shape, st = t.shape, t.stride()
    return (sum((n - 1) * s for n, s in zip(shape[1:], st[1:])) + 1) * t.element_size()


def _rows_meet(a, b, pa: int, pb: int) -> bool:
    """Whether ``a`` (at byte ``pa``) and ``b`` (at ``pb``), whose byte ranges intersect, share a byte: False only
    for a paged pair whose rows provably miss each other (see :func:`_overlap`)."""
    if a.dim() >= 2 and b.dim() >= 2 and (Pa := a.shape[0]) > 1 and (Pb := b.shape[0]) > 1:
        s = a.stride(0) * a.element_size()
        if s > 0 and s == b.stride(0) * b.element_size():
            la, lb = _inner_span(a), _inner_span(b)
            if la <= s and lb <= s:
                d = pb - pa
                m_lo = (-lb - d) // s + 1
                m_hi = -((d - la) // s) - 1
                return max(m_lo, 1 - Pa) <= min(m_hi, Pb - 1)
    return True


def _overlap(a, b) -> bool:
    """Whether tensors ``a`` and ``b`` may share a byte (metadata only).

    Paged pairs (both more than one dim-0 row, one dim-0 byte stride s, each row spanning at most s bytes) are exact:
    row i of a covers [pa + i s, pa + i s + la), row j of b [pb + j s, pb + j s + lb), and they meet iff some
    m = j - i in [-(Pa - 1), Pb - 1] has -lb < pb - pa + m s < la. Every other pair compares byte ranges."""
    sa, sb = _span(a), _span(b)
    if not sa or not sb:
        return False
    pa, pb = a.data_ptr(), b.data_ptr()
    if (not pa and a.is_meta) or (not pb and b.is_meta):
        return False
    return pa < pb + sb and pb < pa + sa and _rows_meet(a, b, pa, pb)


def _check_aliasing(written, read) -> None:
    """Each (name, tensor) of ``written`` writes each element once and shares no byte with any other tensor of
    ``written`` or ``read`` (None entries skipped); a clash is named by the written tensor. Each byte range is
    computed once; only pairs whose ranges meet are compared row by row."""
    ranges = []
    for name, t in written + read:
        if t is None:
            continue
        span = _span(t)
        lo = t.data_ptr()
        if span and (lo or not t.is_meta):
            ranges.append((name, t, lo, lo + span))
    for name, t in written:
        if t is None:
            continue
        if not t.is_contiguous() and _self_overlapping(t.shape, t.stride()):
            fail(name, "a tensor whose elements do not overlap (sorted by stride, each dimension steps at least the "
                       "span of the dimensions inside it; no stride 0)",
                 f"shape {tuple(t.shape)}, strides {t.stride()}")
        mine = next((r for r in ranges if r[0] == name), None)
        if mine is None:
            continue
        lo, hi = mine[2], mine[3]
        for other_name, o, olo, ohi in ranges:
            if other_name != name and lo < ohi and olo < hi and _rows_meet(t, o, lo, olo):
                fail(name, f"a tensor that shares no byte with {other_name}",
                     f"bytes [{lo:#x}, {hi:#x}) overlapping {other_name}'s [{olo:#x}, {ohi:#x})")


def _index_rows(name, t, shape, text, dev):
    """Indices or counts of an exact ``shape``: int32 or int64, any strides (values are never read)."""
    _tensor(name, t)
    if t.shape != shape:
        fail(name, f"shape {text} = {tuple(shape)}", tuple(t.shape))
    if t.dtype not in _INDEX_DTYPES:
        fail(name, "dtype int32 or int64", t.dtype)
    _same_device(name, t, dev)


def _record_cache(name, t, rows, HV, t_max_text, last, dtypes, dtype_text, dev, what):
    """A record cache [rows, HV, T_max, last]: dtype, device, last dim contiguous (other strides free). Returns
    T_max."""
    _tensor(name, t)
    shape = t.shape
    if len(shape) != 4 or shape[0] != rows or shape[1] != HV or shape[3] != last or shape[2] < 1:
        fail(name, f"shape [Pr, HV, T_max, {what}] = ({rows}, {HV}, {t_max_text}, {last}) with T_max >= 1 "
                   f"(Pr: the rows of the read tensor)", tuple(shape))
    if t.dtype not in dtypes:
        fail(name, f"dtype {dtype_text}", t.dtype)
    _same_device(name, t, dev)
    if t.stride(3) != 1 and shape[3] > 1:
        fail(name, "a contiguous last dimension (stride 1; other strides are free)", f"strides {t.stride()}")
    return shape[2]


def _check_null_policy(null_policy):
    return null_policy_of(null_policy)


# ----------------------------------------------------------------------------------------------------------------
# recurrent_kda with the spec-decode keywords


def spec_combination(args: RecurrentArgs, spec: SpecArgs) -> None:
    """Refuse the keyword combinations docs/design.md §9 leaves undefined (which keywords need, or exclude, which),
    reading only which arguments are given, and ``ssm_state_indices``' rank for a tree verify. Shared by
    :func:`validate_spec` and the oracle (:func:`kda_core.oracle_spec.spec_verify_ref`), so both refuse alike."""
    src, src_idx, frozen, cc, kg, parents = spec
    _check_flag("disable_state_update", frozen)
    idx = args.ssm_state_indices
    pool = args.initial_state
    if src is None and src_idx is not None:
        fail("initial_state_indices", "None without initial_state_source", "a tensor")
    if src is not None and src_idx is None:
        fail("initial_state_indices", "a tensor [N_seq] with initial_state_source", None)
    if (cc is None) != (kg is None):
        missing = "kg_cache" if kg is None else "correction_cache"
        fail(missing, "a tensor: correction_cache and kg_cache come together", None)
    records = cc is not None
    if records and not frozen:
        fail("correction_cache", "None unless disable_state_update=True (records come from a frozen verify)",
             "a tensor")
    if src is not None and args.num_accepted_tokens is not None:
        fail("num_accepted_tokens", "None with initial_state_source (the first state is the source row)", "a tensor")
    if frozen:
        if args.num_accepted_tokens is not None:
            fail("num_accepted_tokens", "None with disable_state_update=True (column 0 is read)", "a tensor")
        if args.output_final_state is True:
            fail("output_final_state", "False with disable_state_update=True (no state is written)", True)
        if parents is not None:
            fail("parent_indices", "None with disable_state_update=True (tree verify stores per-token states)",
                 "a tensor")
        if src is None:
            if pool is None:
                fail("initial_state", "the state pool [N, HV, V, K] read by a frozen verify without "
                                      "initial_state_source", None)
            if idx is None:
                fail("ssm_state_indices", "1-D or 2-D slot indices with disable_state_update=True without "
                                          "initial_state_source (the pool read)", None)
        else:
            if pool is not None:
                fail("initial_state", "None with initial_state_source and disable_state_update=True (nothing is "
                                      "written)", "a tensor")
            if idx is not None:
                fail("ssm_state_indices", "None with initial_state_source and disable_state_update=True (nothing "
                                          "is written)", "a tensor")
    elif src is not None:
        if pool is None:
            fail("initial_state", "the written pool [N, HV, V, K] with initial_state_source", None)
        if idx is None:
            fail("ssm_state_indices", "1-D or 2-D write slots with initial_state_source", None)
    if parents is not None and (idx is None or not isinstance(idx, _Tensor) or idx.dim() != 2):
        fail("ssm_state_indices", "2-D [N_seq, T_idx] write slots with parent_indices (tree verify)",
             "None" if idx is None else (f"{idx.dim()}-D" if isinstance(idx, _Tensor) else type(idx).__name__))


def validate_spec(args: RecurrentArgs, spec: SpecArgs, null_policy=NullSlotPolicy.OUT_OF_RANGE,
                  device_kind="cuda") -> SpecCall:
    """Validate a ``recurrent_kda`` call with its spec-decode keywords (docs/design.md §9) and describe it.

    Rules beyond :func:`kda_core.validation.validate_recurrent`'s (each refusal names its argument):

    - ``initial_state_source`` [Ps, HV, V, K] bf16/fp32 (pool layout) and ``initial_state_indices`` [N_seq]
      int32/int64 come together; ``num_accepted_tokens`` is refused with them.
    - ``disable_state_update`` a bool. True (frozen verify): ``num_accepted_tokens``, ``output_final_state=True``
      and ``parent_indices`` are refused; without a source ``initial_state`` and ``ssm_state_indices`` (1-D or 2-D)
      are required, with one they are refused (nobody writes them).
    - a source without a frozen verify: ``initial_state`` and ``ssm_state_indices`` are required (the written pool),
      and ``initial_state`` must not overlap the source.
    - ``correction_cache`` [Pr, HV, T_max, V] fp32 and ``kg_cache`` [Pr, HV, T_max, 2K] (dtype of k, which must be
      g's too) come together and only with a frozen verify; Pr is the read tensor's rows; T_max >= 1.
    - ``parent_indices`` [N_seq, T_p] int32/int64 needs 2-D ``ssm_state_indices`` and no frozen verify.
    - aliasing: the output, a written pool and the records share no byte with any other tensor (module docstring).

    ``null_policy``: the :class:`~kda_core.contracts.NullSlotPolicy` member or its string value (a compile-time
    constant of the kernels, kept in the description). ``device_kind``: "cuda" (default, the launchers) or "any".
    """
    if type(spec) is not SpecArgs:
        fail("spec", "a kda_core.call_args.SpecArgs (the spec-decode keywords, bundled)", type(spec).__name__)
    policy = _check_null_policy(null_policy)
    if device_kind not in _DEVICE_KINDS:
        fail("device_kind", f"one of {_DEVICE_KINDS}", repr(device_kind))
    if type(args) is not RecurrentArgs:
        fail("args", "a kda_core.call_args.RecurrentArgs (the call's arguments, bundled)", type(args).__name__)
    spec_combination(args, spec)
    src, src_idx, frozen, cc, kg, parents = spec
    idx = args.ssm_state_indices
    pool = args.initial_state
    records = cc is not None

    base = validate_recurrent(args, device_kind=device_kind)
    if src is None and not frozen and not records and parents is None:
        key = ("spec-plain", base, policy)
        call = _VALIDATION_MEMO.get(key)
        if call is None:
            call = _remember(key, SpecCall(**{f.name: getattr(base, f.name) for f in fields(RecurrentCall)},
                                           null_policy=policy, read_rows=base.N))
        return call

    dev = args.q.get_device()
    HV, K, N_seq = base.HV, base.K, base.N_seq
    acc = 0
    source_rows = source_dtype = source_index_dtype = None
    if src is not None:
        source_rows = _rows("initial_state_source", src, (HV, K, K), _POOL_DTYPES, "bfloat16 or float32 (a pool)",
                            "[Ps, HV, V, K]", dev)
        source_dtype = src.dtype
        acc |= _row_bits(src)
        _slots("initial_state_indices", src_idx, N_seq, "[N_seq] (one source slot per sequence)", dev)
        source_index_dtype = src_idx.dtype
    read_rows = source_rows if src is not None else base.N

    t_max = 0
    kg_dtype = None
    records_aligned = False
    if records:
        t_max = _record_cache("correction_cache", cc, read_rows, HV, "T_max", K, (_F32,), "float32", dev, "V")
        k_dtype = args.k.dtype
        if args.g.dtype is not k_dtype:
            fail("g", f"dtype {k_dtype} (the dtype of k: kg_cache records both raw)", args.g.dtype)
        _record_cache("kg_cache", kg, read_rows, HV, str(t_max), 2 * K, (k_dtype,), f"{k_dtype} (the dtype of k)",
                      dev, "2K")
        if kg.shape[2] != t_max:
            fail("kg_cache", f"T_max (dim 2) = {t_max}, correction_cache's", kg.shape[2])
        kg_dtype = kg.dtype
        records_aligned = _pow2_alignment(_bits(cc) | _bits(kg)) >= 16

    parent_cols = 0
    parent_dtype = None
    if parents is not None:
        _tensor("parent_indices", parents)
        if parents.dim() != 2 or parents.shape[0] != N_seq:
            fail("parent_indices", f"a 2-D tensor [N_seq, T_p] = ({N_seq}, T_p)", tuple(parents.shape))
        if parents.dtype not in _INDEX_DTYPES:
            fail("parent_indices", "dtype int32 or int64", parents.dtype)
        _same_device("parent_indices", parents, dev)
        parent_cols = parents.shape[1]
        parent_dtype = parents.dtype
        if idx is not None and idx.dim() == 2 and idx.shape[1] > MAX_TREE_TOKENS:
            fail("ssm_state_indices", f"at most {MAX_TREE_TOKENS} columns with parent_indices (tree verify)",
                 idx.shape[1])

    spec_tensors = (("initial_state_source", src), ("initial_state_indices", src_idx), ("correction_cache", cc),
                    ("kg_cache", kg), ("parent_indices", parents))
    if dev < 0:
        _check_host_kind("q", args.q, spec_tensors)
    pool_written = pool if (idx is not None and not frozen) else None
    read = [("q", args.q), ("k", args.k), ("v", args.v), ("g", args.g), ("beta", args.beta),
            ("cu_seqlens", args.cu_seqlens), ("ssm_state_indices", idx), ("initial_state_indices", src_idx),
            ("parent_indices", parents), ("initial_state_source", src)]
    if pool_written is None:
        read.append(("initial_state", pool))
    if args.use_gate_in_kernel:
        read += [("A_log", args.A_log), ("dt_bias", args.dt_bias)]
    written = [("initial_state", pool_written), ("correction_cache", cc), ("kg_cache", kg)]
    _check_aliasing(written, read + [("output", args.output)])
    if args.output is not None:  # validate_recurrent compared it with the plain arguments already
        _check_aliasing([("output", args.output)], written + list(spec_tensors))

    alignment = min(base.alignment, _pow2_alignment(acc)) if src is not None else base.alignment
    key = ("spec", base, policy, source_rows, source_dtype, source_index_dtype, frozen, records, t_max, kg_dtype,
           records_aligned, parent_cols, parent_dtype, alignment)
    call = _VALIDATION_MEMO.get(key)
    if call is None:
        values = {f.name: getattr(base, f.name) for f in fields(RecurrentCall)}
        values.update(aligned=alignment >= 16, alignment=alignment, t1_eligible=False,
                      t1_reason="not eligible: spec-decode keywords (initial_state_source, disable_state_update, "
                                "records or parent_indices) run on the generic kernel")
        call = _remember(key, SpecCall(
            **values, null_policy=policy, has_source=src is not None, source_rows=source_rows,
            source_dtype=source_dtype, source_index_dtype=source_index_dtype, read_rows=read_rows, frozen=frozen,
            records=records, t_max=t_max, kg_dtype=kg_dtype, records_aligned=records_aligned,
            tree=parents is not None, parent_cols=parent_cols, parent_dtype=parent_dtype,
        ))
    return call


def debug_check_spec_slots(args: RecurrentArgs, spec: SpecArgs, call: SpecCall) -> None:
    """Raise when two active entries name one slot that the call writes (docs/design.md §4: a caller error): the
    pool's write slots (``ssm_state_indices``, 2-D flattened) unless the verify is frozen, and with records the read
    slots (``initial_state_indices``, else ``ssm_state_indices`` or its column 0), whose record rows are written.
    Read-only slots may repeat. Reads values and synchronises: run it only where
    :func:`kda_core.validation.debug_checks_enabled` says so (``KDA_DEBUG_VALIDATE=1``, no graph capture); the
    commit's rows are checked with ``debug_check_slots(state_indices, P)``."""
    idx = args.ssm_state_indices
    policy = call.null_policy
    if idx is not None and not call.frozen:
        debug_check_slots(idx, call.N, argument="ssm_state_indices", null_policy=policy)
    if call.records:
        if spec.initial_state_source is not None:
            debug_check_slots(spec.initial_state_indices, call.read_rows, argument="initial_state_indices",
                              null_policy=policy)
        else:
            debug_check_slots(idx if idx.dim() == 1 else idx[:, 0], call.read_rows, argument="ssm_state_indices",
                              null_policy=policy)


# ----------------------------------------------------------------------------------------------------------------
# RecoverSSM commit


def _commit_layout(checkpoint_state, correction_cache, kg_cache, dev, suffix=""):
    """(P, HV, K, T_max, alignment bits) of one layer's checkpoint and caches."""
    name = "checkpoint_state" + suffix
    _tensor(name, checkpoint_state)
    cs = checkpoint_state.shape
    if len(cs) != 4 or cs[2] != cs[3] or cs[3] not in GENERIC_HEAD_DIMS or cs[1] < 1:
        fail(name, f"shape [P, HV, V, K] with V == K in {GENERIC_HEAD_DIMS}", tuple(cs))
    P, HV, K = cs[0], cs[1], cs[3]
    _rows(name, checkpoint_state, (HV, K, K), _POOL_DTYPES, "bfloat16 or float32 (a pool)", "[P, HV, V, K]", dev)
    T_max = _record_cache("correction_cache" + suffix, correction_cache, P, HV, "T_max", K, (_F32,), "float32", dev,
                          "V")
    _record_cache("kg_cache" + suffix, kg_cache, P, HV, str(T_max), 2 * K, _ACT_DTYPES,
                  "bfloat16, float16 or float32 (the activation dtype of the verify)", dev, "2K")
    if kg_cache.shape[2] != T_max:
        fail("kg_cache" + suffix, f"T_max (dim 2) = {T_max}, correction_cache's", kg_cache.shape[2])
    bits = _row_bits(checkpoint_state) | _bits(correction_cache) | _bits(kg_cache)
    return P, HV, K, T_max, bits


def _commit_gate(A_log, dt_bias, lower_bound, HV, K, dev, suffix=""):
    """(H, gate mode, lower bound, has dt_bias, dt_bias pointer) of a commit's gate parameters: A_log None means the
    recorded g is the log decay (dt_bias and lower_bound unused)."""
    if A_log is None:
        return HV, GateMode.PRECOMPUTED, None, False, 0
    a_name, d_name = ("A_log", "dt_bias") if not suffix else ("A_logs" + suffix, "dt_biases" + suffix)
    _tensor(a_name, A_log)
    if A_log.dim() != 1 or A_log.shape[0] < 1 or HV % A_log.shape[0]:
        fail(a_name, f"a 1-D fp32 tensor [H] with H dividing HV = {HV}", tuple(A_log.shape))
    H = A_log.shape[0]
    if A_log.dtype is not _F32:
        fail(a_name, "dtype float32", A_log.dtype)
    _same_device(a_name, A_log, dev)
    ptr = 0
    if dt_bias is not None:
        _tensor(d_name, dt_bias)
        if dt_bias.shape != (H * K,) and dt_bias.shape != (H, K):
            fail(d_name, f"shape [H*K] = ({H * K},) or [H, K] = ({H}, {K})", tuple(dt_bias.shape))
        if dt_bias.dtype is not _F32:
            fail(d_name, "dtype float32", dt_bias.dtype)
        _same_device(d_name, dt_bias, dev)
        if not dt_bias.is_contiguous():
            fail(d_name, "a contiguous tensor", f"strides {dt_bias.stride()}")
        ptr = dt_bias.data_ptr()
    _check_scalar_args(lower_bound, None, K, True)
    mode = gate_mode(True, lower_bound)
    return H, mode, None if lower_bound is None else float(lower_bound), dt_bias is not None, ptr


def _commit_rows(state_indices, num_accepted_tokens, query_start_loc, destination_indices, dev):
    _tensor("state_indices", state_indices)
    if state_indices.dim() != 1:
        fail("state_indices", "a 1-D tensor [N] (one checkpoint slot per request)", tuple(state_indices.shape))
    N = state_indices.shape[0]
    _slots("state_indices", state_indices, N, "[N]", dev)
    _slots("num_accepted_tokens", num_accepted_tokens, N, "[N] (the rows of state_indices)", dev)
    if query_start_loc is not None:
        _index_rows("query_start_loc", query_start_loc, (N + 1,), "[N + 1]", dev)
    if destination_indices is not None:
        _slots("destination_indices", destination_indices, N, "[N] (the rows of state_indices)", dev)
        if destination_indices.dtype is not state_indices.dtype:
            fail("destination_indices", f"state_indices' dtype {state_indices.dtype}", destination_indices.dtype)
    return N


def validate_recoverssm_commit(checkpoint_state, correction_cache, kg_cache, state_indices, num_accepted_tokens,
                               A_log, dt_bias, lower_bound, *, query_start_loc=None, use_qk_l2norm_in_kernel=True,
                               null_policy=NullSlotPolicy.OUT_OF_RANGE, destination_indices=None,
                               device_kind="cuda") -> CommitCall:
    """Validate one layer's RecoverSSM commit (docs/design.md §9; the arguments of
    :func:`kda_core.oracle_spec.recoverssm_commit_ref`) and describe it.

    checkpoint_state [P, HV, V, K] bf16/fp32 (pool layout, written in place); correction_cache [P, HV, T_max, V]
    fp32 and kg_cache [P, HV, T_max, 2K] bf16/fp16/fp32, last dims contiguous, other strides free, T_max >= 1;
    state_indices and num_accepted_tokens [N] int32/int64, any stride; query_start_loc [N + 1] int32/int64, any
    stride, or None. A_log fp32 [H] with H dividing HV, dt_bias fp32 [H*K] / [H, K] contiguous or None, lower_bound
    a finite negative float or None (softplus); A_log None: the recorded g is the log decay, dt_bias and lower_bound
    are unused. destination_indices [N] with state_indices' dtype, any stride, or None (in place). The checkpoint
    shares no byte with any other argument (paged layouts compared row by row).
    """
    policy = _check_null_policy(null_policy)
    _tensor("checkpoint_state", checkpoint_state)
    dev = checkpoint_state.get_device()
    if device_kind == "cuda":
        if dev < 0:
            fail("checkpoint_state", "a CUDA tensor (device_kind='cuda'; the oracle path passes device_kind='any')",
                 checkpoint_state.device)
    elif device_kind != "any":
        fail("device_kind", f"one of {_DEVICE_KINDS}", repr(device_kind))
    _check_flag("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    P, HV, K, T_max, bits = _commit_layout(checkpoint_state, correction_cache, kg_cache, dev)
    H, gmode, lb, has_dt_bias, ptr = _commit_gate(A_log, dt_bias, lower_bound, HV, K, dev)
    N = _commit_rows(state_indices, num_accepted_tokens, query_start_loc, destination_indices, dev)
    read = [("correction_cache", correction_cache), ("kg_cache", kg_cache), ("state_indices", state_indices),
            ("num_accepted_tokens", num_accepted_tokens), ("query_start_loc", query_start_loc),
            ("destination_indices", destination_indices)]
    if A_log is not None:
        read += [("A_log", A_log), ("dt_bias", dt_bias)]
    if dev < 0:
        _check_host_kind("checkpoint_state", checkpoint_state, read)
    _check_aliasing([("checkpoint_state", checkpoint_state)], read)
    alignment = _pow2_alignment(bits | ptr)
    key = ("recoverssm", N, P, H, HV, K, T_max, checkpoint_state.dtype, kg_cache.dtype, state_indices.dtype,
           num_accepted_tokens.dtype, None if query_start_loc is None else query_start_loc.dtype, gmode, lb,
           has_dt_bias, use_qk_l2norm_in_kernel, policy, alignment, dev >= 0, destination_indices is not None)
    call = _VALIDATION_MEMO.get(key)
    if call is None:
        call = _remember(key, CommitCall(
            N=N, P=P, H=H, HV=HV, K=K, V=K, t_max=T_max, state_dtype=checkpoint_state.dtype, kg_dtype=kg_cache.dtype,
            index_dtype=state_indices.dtype, nat_dtype=num_accepted_tokens.dtype,
            qsl_dtype=None if query_start_loc is None else query_start_loc.dtype, gate_mode=gmode, lower_bound=lb,
            has_dt_bias=has_dt_bias, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, null_policy=policy,
            aligned=alignment >= 16, alignment=alignment, on_cuda=dev >= 0,
        ))
    return call


def _same_layout(name, t, first):
    """Layer i's tensor shares layer 0's shape, dtype, strides and device (its base pointer is free)."""
    _tensor(name, t)
    if t.shape != first.shape or t.dtype is not first.dtype or t.stride() != first.stride():
        fail(name, f"layer 0's layout: shape {tuple(first.shape)}, dtype {first.dtype}, strides {first.stride()}",
             f"shape {tuple(t.shape)}, dtype {t.dtype}, strides {t.stride()}")
    _same_device(name, t, first.get_device())


def validate_recoverssm_layers(checkpoints, correction_caches, kg_caches, A_logs, dt_biases, lower_bound,
                               state_indices, num_accepted_tokens, *, query_start_loc=None,
                               use_qk_l2norm_in_kernel=True, null_policy=NullSlotPolicy.OUT_OF_RANGE,
                               device_kind="cuda") -> CommitCall:
    """Validate a multi-layer RecoverSSM commit (one launch for L layers; the arguments of
    :func:`kda_core.oracle_spec.recoverssm_commit_layers_ref`) and describe it (``layers`` = L).

    Layer 0 is validated as :func:`validate_recoverssm_commit`; every other layer's checkpoint and caches share layer
    0's shape, dtype and strides (base pointers free). ``A_logs`` is None (every layer: the recorded g is the log
    decay) or L fp32 [H] tensors; ``dt_biases`` None (zeros) or L tensors of one shape; one ``lower_bound``. No
    checkpoint shares a byte with another layer's checkpoint or caches, nor with the shared indices. Checks are
    O(L^2) pairs of byte ranges (L = 64: a few milliseconds): validate once when the layers are registered.
    """
    lists = (("checkpoints", checkpoints), ("correction_caches", correction_caches), ("kg_caches", kg_caches))
    for name, seq in lists:
        if not isinstance(seq, (list, tuple)) or not seq:
            fail(name, "a non-empty list or tuple of per-layer tensors", type(seq).__name__)
    L = len(checkpoints)
    for name, seq in lists[1:] + (("A_logs", A_logs), ("dt_biases", dt_biases)):
        if seq is not None and (not isinstance(seq, (list, tuple)) or len(seq) != L):
            fail(name, f"a list or tuple of {L} entries (one per layer){' or None' if name[0] in 'Ad' else ''}",
                 len(seq) if isinstance(seq, (list, tuple)) else type(seq).__name__)
    A0 = None if A_logs is None else A_logs[0]
    if A_logs is not None and A0 is None:
        fail("A_logs[0]", "an fp32 tensor [H] (or A_logs None for every layer: the recorded g is the log decay)",
             None)
    d0 = None if dt_biases is None else dt_biases[0]
    call = validate_recoverssm_commit(checkpoints[0], correction_caches[0], kg_caches[0], state_indices,
                                      num_accepted_tokens, A0, d0, lower_bound, query_start_loc=query_start_loc,
                                      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, null_policy=null_policy,
                                      device_kind=device_kind)
    dev = checkpoints[0].get_device()
    written = []
    read = [("state_indices", state_indices), ("num_accepted_tokens", num_accepted_tokens),
            ("query_start_loc", query_start_loc)]
    bits = 0
    for i in range(L):
        sfx = f"[{i}]"
        if i:
            _same_layout("checkpoints" + sfx, checkpoints[i], checkpoints[0])
            _same_layout("correction_caches" + sfx, correction_caches[i], correction_caches[0])
            _same_layout("kg_caches" + sfx, kg_caches[i], kg_caches[0])
            bits |= checkpoints[i].data_ptr() | correction_caches[i].data_ptr() | kg_caches[i].data_ptr()
            if A_logs is not None:
                if A_logs[i] is None:
                    fail("A_logs" + sfx, "an fp32 tensor [H] (A_logs is given for layer 0)", None)
                if (dt_biases is None or dt_biases[i] is None) != (d0 is None):
                    fail("dt_biases" + sfx, "a tensor exactly when layer 0 has one", dt_biases[i] if dt_biases
                         else None)
                _tensor("A_logs" + sfx, A_logs[i])
                if A_logs[i].shape != A0.shape:
                    fail("A_logs" + sfx, f"layer 0's shape {tuple(A0.shape)}", tuple(A_logs[i].shape))
                _commit_gate(A_logs[i], None if dt_biases is None else dt_biases[i], lower_bound, call.HV, call.K,
                             dev, sfx)
                if d0 is not None:
                    bits |= dt_biases[i].data_ptr()
                    if dt_biases[i].shape != d0.shape:
                        fail("dt_biases" + sfx, f"layer 0's shape {tuple(d0.shape)}", tuple(dt_biases[i].shape))
        written.append(("checkpoints" + sfx, checkpoints[i]))
        read += [("correction_caches" + sfx, correction_caches[i]), ("kg_caches" + sfx, kg_caches[i])]
        if A_logs is not None:
            read += [("A_logs" + sfx, A_logs[i]), ("dt_biases" + sfx, None if dt_biases is None else dt_biases[i])]
    _check_aliasing(written, read)
    alignment = min(call.alignment, _pow2_alignment(bits)) if L > 1 else call.alignment
    values = {f.name: getattr(call, f.name) for f in fields(CommitCall)}
    values.update(layers=L, alignment=alignment, aligned=alignment >= 16)
    return CommitCall(**values)
