"""The ReplaySSM "ucache" API of KDA speculative decode (docs/design.md §5).

Per request the serving engine keeps one checkpoint state in the pool plus, per head, three 32-slot rings of
per-token ingredients (k^, u, cumulative log-decay G) and two int32 cursors (``cache_base``, ``hist_len``). Each
verify step runs the T draft tokens from the replayed checkpoint, appends their ingredients, and (when the ring is
full enough, ``hist_len >= flush_min``) folds the ring into the checkpoint. After sampling, the engine commits the
accepted count with :func:`commit_ucache`.

Everything here captures into CUDA graphs: the cursors are only ever read and written on the device, never synced
to the host. Tensors on the CPU (or an install without kda-cute) run the kda-core oracle instead.

Typical step (the cursors [B] belong to the batch rows and are shared by every layer)::

    k_cache, u_cache, g_cache = allocate_ucache(pool_rows, num_heads, device)   # once, per layer
    hist_len, cache_base = allocate_cursors(max_batch, device)                   # once; reset a row on reuse
    for layer in layers:                                                         # one verify step
        out = kda_delta_rule_mtp_ucache_flush(A_log, g, dt_bias, -5.0, q=q, k=k, v=v, b=b,
            initial_state_source=pool, initial_state_indices=slots, k_cache=k_cache, u_cache=u_cache,
            g_cache=g_cache, hist_len=hist_len, cache_base=cache_base, restart_hist_on_flush=False)
    commit_ucache(hist_len, cache_base, num_accepted_tokens, flush_min=9)        # after sampling
"""

from __future__ import annotations

import warnings

import torch

from kda_core.contracts import HEAD_DIM, RING_SLOTS, NullSlotPolicy, null_policy_of
from kda_core.errors import fail
from kda_core.oracle import commit_ucache_ref, ucache_verify_flush_ref
from kda_core.validation import (
    debug_check_slots,
    debug_check_ucache_cursors,
    debug_checks_enabled,
    validate_ucache,
)

__all__ = [
    "kda_delta_rule_mtp_ucache_flush",
    "allocate_ucache",
    "allocate_cursors",
    "commit_ucache",
]

_warned = False


def _kernel_module():
    """kda_cute.ucache, or None (with a one-time warning) when kda-cute or its DSL cannot be imported."""
    global _warned
    try:
        from kda_cute import ucache
    except ImportError as exc:
        if not _warned:
            _warned = True
            warnings.warn(
                f"kda_recurrent: kda-cute's ucache kernel is not importable ({exc}): the PyTorch oracle runs. "
                "Install kda-recurrent[cute] for the GPU kernel; this is slow.",
                RuntimeWarning,
                stacklevel=3,
            )
        return None
    return ucache


def kda_delta_rule_mtp_ucache_flush(
    A_log: torch.Tensor,
    g: torch.Tensor,
    dt_bias: torch.Tensor | None,
    lower_bound: float | None = -5.0,
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    b: torch.Tensor,
    initial_state_source: torch.Tensor,
    initial_state_indices: torch.Tensor,
    k_cache: torch.Tensor,
    u_cache: torch.Tensor,
    g_cache: torch.Tensor,
    hist_len: torch.Tensor,
    cache_base: torch.Tensor,
    flush_min: int | None = None,
    restart_hist_on_flush: bool = True,
    w_ring: int | None = None,
    scale: float | None = None,
    output: torch.Tensor | None = None,
    null_policy: NullSlotPolicy | str = NullSlotPolicy.OUT_OF_RANGE,
) -> torch.Tensor:
    """One verify(+flush) step of T draft tokens per request; returns the draft outputs [B, T, H, 128] bf16.

    Args:
        A_log: [H] fp32, per head. dt_bias: [H*128] (or [H, 128]) fp32, or None (zeros).
        g: [B, T, H, 128] bf16 raw gate. lower_bound: < 0, the Kimi K3 gate ``lb * sigmoid(exp(A_log) * (g +
            dt_bias))``; ``None`` is Kimi-Linear's ``-exp(A_log) * softplus(g + dt_bias)``.
        q, k, v: [B, T, H, 128] bf16 (last dim contiguous; other strides free), T in {4, 8}, H in 8..96.
        b: [B, T, H] bf16 beta logits (sigmoid applied in fp32).
        initial_state_source: the checkpoint pool [N, H, 128, 128] bf16 (V-first, K contiguous; dim-0 stride any
            number of elements >= the row, one that is not a 16-byte multiple taking the unaligned variant).
            Written in place (one rounding) on rows that flush.
        initial_state_indices: [B] int32 or int64 pool slots, any stride; a null slot (see ``null_policy``) makes
            the row inactive (zero output, nothing read or written, cursors untouched).
        k_cache, u_cache: [N, H, 32, 128] bf16; g_cache: [N, H, 32, 128] fp32 (:func:`allocate_ucache`; the row
            stride as the pool's).
        hist_len, cache_base: [B] int32 cursors of the requests (rows of :func:`allocate_cursors`' tensors).
        flush_min: fold the ring when hist_len >= flush_min; default ``default_flush_min(T, w_ring)``
            (9 for T=8, 13 for T=4 with w_ring 16). w_ring: 16 or 32 (None: ``KDA_UCACHE_WRING``).
        restart_hist_on_flush: apply the flush part of the commit here, on the device (flushed rows:
            cache_base += hist_len (mod 32), hist_len = 0); the caller then commits with ``flush_min=None``.
            Pass False when several layers share one cursor set and commit with ``flush_min`` once.
        scale: query scale, default 128 ** -0.5. output: optional [B, T, H, 128] bf16 destination.
        null_policy: which slots are null (docs/design.md §4), a :class:`kda_core.contracts.NullSlotPolicy` or its
            string value: ``OUT_OF_RANGE`` (default; outside [0, N)) or ``NONPOSITIVE`` (vLLM: <= 0 or >= N, so
            slot 0's pool row, rings and cursors are never touched).

    Duplicate active slots are a caller error (checked, like the cursor ranges, under ``KDA_DEBUG_VALIDATE``;
    the kernel clamps cursors so a malformed one can never index outside the ring or the pool row).

    Example::

        >>> import torch
        >>> from kda_recurrent.ucache import allocate_ucache, allocate_cursors, kda_delta_rule_mtp_ucache_flush
        >>> B, T, H, K, N = 2, 8, 8, 128, 4
        >>> q, k, v, g = (torch.randn(B, T, H, K).bfloat16() for _ in range(4))
        >>> b = torch.randn(B, T, H).bfloat16()
        >>> pool = torch.zeros(N, H, K, K, dtype=torch.bfloat16)
        >>> rings = allocate_ucache(N, H, "cpu")
        >>> hist_len, cache_base = allocate_cursors(B, "cpu")
        >>> out = kda_delta_rule_mtp_ucache_flush(torch.zeros(H), g, torch.zeros(H * K), q=q, k=k, v=v, b=b,
        ...     initial_state_source=pool, initial_state_indices=torch.tensor([1, 3], dtype=torch.int32),
        ...     k_cache=rings[0], u_cache=rings[1], g_cache=rings[2], hist_len=hist_len, cache_base=cache_base)
        >>> out.shape
        torch.Size([2, 8, 8, 128])
    """
    on_cuda = isinstance(q, torch.Tensor) and q.is_cuda
    null_policy = null_policy_of(null_policy)
    call = validate_ucache(
        A_log, g, dt_bias, lower_bound, q=q, k=k, v=v, b=b, initial_state_source=initial_state_source,
        initial_state_indices=initial_state_indices, k_cache=k_cache, u_cache=u_cache, g_cache=g_cache,
        hist_len=hist_len, cache_base=cache_base, flush_min=flush_min, restart_hist_on_flush=restart_hist_on_flush,
        w_ring=w_ring, scale=scale, output=output, device_kind="cuda" if on_cuda else "any",
    )  # fmt: skip
    if debug_checks_enabled():
        debug_check_slots(initial_state_indices, call.N, argument="initial_state_indices", null_policy=null_policy)
        debug_check_ucache_cursors(
            hist_len, cache_base, call.T, call.w_ring, slot_indices=initial_state_indices, N=call.N,
            null_policy=null_policy,
        )
    kernels = _kernel_module() if on_cuda else None
    if kernels is None:
        if q.is_meta:
            fail("q", "tensors with data, on the CPU or a CUDA device (meta tensors describe shapes only)", q.device)
        out = ucache_verify_flush_ref(
            A_log, g, dt_bias, lower_bound, q=q, k=k, v=v, b=b, initial_state_source=initial_state_source,
            initial_state_indices=initial_state_indices, k_cache=k_cache, u_cache=u_cache, g_cache=g_cache,
            hist_len=hist_len, cache_base=cache_base, flush_min=call.flush_min,
            restart_hist_on_flush=restart_hist_on_flush, w_ring=call.w_ring, scale=call.scale,
            null_policy=null_policy,
        )  # fmt: skip
        if output is None:
            return out
        with torch.no_grad():  # the kernel writes an output that requires grad as well
            output.copy_(out)
        return output
    if output is None:
        output = torch.empty(call.B, call.T, call.H, HEAD_DIM, dtype=torch.bfloat16, device=q.device)
    A_log32 = A_log if A_log.dtype == torch.float32 and A_log.is_contiguous() else A_log.float().contiguous()
    if dt_bias is None:  # zeros: the kernel always adds dt_bias
        dt_bias32 = torch.zeros(call.H * HEAD_DIM, dtype=torch.float32, device=q.device)
    else:
        dt_bias32 = dt_bias.reshape(-1)
        if dt_bias32.dtype != torch.float32 or not dt_bias32.is_contiguous():
            dt_bias32 = dt_bias32.float().contiguous()
    kernels.ucache_verify_flush(
        A_log32, g, dt_bias32, call.lower_bound, q, k, v, b, initial_state_source, initial_state_indices,
        k_cache, u_cache, g_cache, hist_len, cache_base, call.flush_min, call.w_ring, call.scale, output,
        restart_hist_on_flush=restart_hist_on_flush, aligned=call.aligned, null_policy=null_policy,
    )  # fmt: skip
    return output


def allocate_ucache(
    pool_rows: int, num_heads: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zeroed rings of one layer: k_cache, u_cache [pool_rows, num_heads, 32, 128] bf16 and g_cache (same shape,
    fp32). Rings must start zeroed; a reallocated pool slot needs only its cursors reset, not its rings (rows past
    hist_len are never read as numbers)."""
    if isinstance(pool_rows, bool) or not isinstance(pool_rows, int) or pool_rows < 1:
        fail("pool_rows", "an int >= 1", pool_rows)
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        fail("num_heads", "an int >= 1", num_heads)
    shape = (pool_rows, num_heads, RING_SLOTS, HEAD_DIM)
    return (
        torch.zeros(shape, dtype=torch.bfloat16, device=device),
        torch.zeros(shape, dtype=torch.bfloat16, device=device),
        torch.zeros(shape, dtype=torch.float32, device=device),
    )


def allocate_cursors(batch: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed cursors (hist_len, cache_base), int32 [batch]: an empty ring starting at physical slot 0."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        fail("batch", "an int >= 1", batch)
    return (
        torch.zeros(batch, dtype=torch.int32, device=device),
        torch.zeros(batch, dtype=torch.int32, device=device),
    )


def commit_ucache(
    hist_len: torch.Tensor,
    cache_base: torch.Tensor,
    num_accepted_tokens: torch.Tensor,
    flush_min: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The caller's commit after sampling, in place (docs/design.md §5); returns (hist_len, cache_base).

    ``flush_min=None``: the step ran with ``restart_hist_on_flush=True`` (flushed rows already restarted), so
    every row does hist_len += accepted. Otherwise rows with hist_len >= flush_min flushed in that step:
    cache_base = (cache_base + hist_len) & 31 and hist_len = accepted; the others hist_len += accepted.
    num_accepted_tokens: [B] integer tensor on the cursors' device (values 1..T, not checked: no sync).
    Device ops only, so it captures into a CUDA graph.
    """
    for name, t in (("hist_len", hist_len), ("cache_base", cache_base)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
            fail(name, "an int32 tensor [B]", _describe(t))
    B = hist_len.shape[0]
    if cache_base.shape != (B,) or cache_base.device != hist_len.device:
        fail("cache_base", f"an int32 tensor [{B}] on {hist_len.device}", _describe(cache_base))
    acc = num_accepted_tokens
    if (
        not isinstance(acc, torch.Tensor)
        or acc.shape != (B,)
        or acc.dtype.is_floating_point
        or acc.dtype == torch.bool
        or acc.device != hist_len.device
    ):
        fail("num_accepted_tokens", f"an integer tensor [{B}] on {hist_len.device}", _describe(acc))
    if flush_min is not None and (isinstance(flush_min, bool) or not isinstance(flush_min, int) or flush_min < 1):
        fail("flush_min", "None or an int >= 1", flush_min)
    return commit_ucache_ref(hist_len, cache_base, acc, flush_min)


def _describe(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} {list(t.shape)} on {t.device}"
    return type(t).__name__
