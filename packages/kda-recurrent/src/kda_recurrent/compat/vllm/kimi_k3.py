"""vLLM Kimi K3's KDA decode calls on kda's kernels: the two recurrent calls (plain and spec decode), the native
fused op's argument list, and RecoverSSM's verify and commit context (each documented where it is defined).

Read from the stored engine sources (signatures, defaults, returns, null slots):

- ``fused_recurrent_kda_packed_decode`` and ``fused_recurrent_kda``: vllm-project/vllm
  ``vllm/models/kimi_k3/nvidia/ops/third_party/kda/fused_recurrent.py`` @ 03c20345bb2534b98224519afacb78a4baa6ccfa
  (an older copy @ a4929f1367bf43620919e3c0cf13f883331ff98f has no ``out`` in the packed decode: the signature here
  takes both), re-exported by the package ``vllm/models/kimi_k3/nvidia/ops/third_party/kda/__init__.py``
  @ 3f9a13d44d92a4535c34d186dce79edcb1e41b2f.
- The caller, ``KimiK3DeltaAttention._forward`` in ``vllm/models/kimi_k3/nvidia/kda.py``
  @ 3a1f05ba17aa4715f4020a4d304d57cfc1e37ebb: it imports both names from that package at call time and passes every
  argument by keyword; ``state_indices`` is a slice of the decode rows' block ids, ``out`` is None or a slice of
  ``core_attn_out`` [1, N, H, 128], and the result is read as ``[1, B, H, V]``.
- docs/serving.md §1 summarises both calls and the layer's tensors.

Semantics kept: the null policy is vLLM's (``NullSlotPolicy.NONPOSITIVE``: an index ``<= 0`` is null, block 0 is
never read or written; docs/design.md §4); scale defaults to K ** -0.5; q and k are L2-normalised; the pool is
updated in place and returned. Where kda differs on purpose: an index ``>= N`` is null too (vLLM reads past the
pool); in spec decode a row whose accepted count is outside ``[1, T]`` is null as a whole (vLLM bounds it by the
index row's stride instead, docs/serving.md §1); outputs are bf16 (what the layer allocates).
"""

from __future__ import annotations

import sys

import torch

from kda_core.call_args import RecurrentArgs, SpecArgs
from kda_core.contracts import T1_HEAD_COUNTS, NullSlotPolicy
from kda_core.errors import fail
from kda_core.oracle import kda_gate_ref
from kda_core.validation import validate_recurrent
from kda_core.validation_fused import MAX_FUSED_SPEC_TOKENS
from kda_recurrent.compat import capability_of, optional_entry, shape_text
from kda_recurrent.facade import recurrent_kda

__all__ = ["fused_recurrent_kda", "fused_recurrent_kda_packed_decode", "kda_recoverssm_verify",
           "KDARecoverSSMCommitContext"]

_NULL_POLICY = NullSlotPolicy.NONPOSITIVE

# Tensors whose device index is at least this take the kernel branch (CUDA: >= 0). The host-cost measurement sets
# -1 (CPU tensors, a stubbed launch), as kda-core's ``validation._LAUNCH_DEVICE_MIN`` is set by its CPU tests.
_KERNEL_DEVICE_MIN = 0

# kda-cute's packed T=1 entry in the token form (vLLM's tensors as they are), imported on the first CUDA call
# (importing the CuTe DSL is slow); None when kda-cute is not installed (the facade's oracle path then runs, with
# its warning). Tests replace it with a recorder.
_UNLOADED = object()
_packed_entry = _UNLOADED


def _load_packed():
    global _packed_entry
    _packed_entry = optional_entry("kda_cute.decode_t1", "kda_decode_t1_packed_tokens")
    return _packed_entry


def _refuse_packed(mixed_qkv, raw_g, raw_beta, initial_state, out):
    """Name the argument whose layout the packed call cannot view (the slow path of a malformed call)."""
    if not isinstance(initial_state, torch.Tensor) or initial_state.dim() != 4:
        fail("initial_state", "the state pool [slots, H, V, K]", shape_text(initial_state))
    _, H, _, K = initial_state.shape
    if not isinstance(mixed_qkv, torch.Tensor) or mixed_qkv.dim() != 2:
        fail("mixed_qkv", "a 2-D tensor [B, 3 * H * K]", shape_text(mixed_qkv))
    B = mixed_qkv.shape[0]
    if not isinstance(raw_g, torch.Tensor) or tuple(raw_g.shape) != (1, B, H, K):
        fail("raw_g", f"shape [1, {B}, {H}, {K}] (B from mixed_qkv, H and K from initial_state)", shape_text(raw_g))
    if raw_g.stride()[2:] != (K, 1):
        fail("raw_g", f"each token's [H, K] contiguous (strides [*, *, {K}, 1])", raw_g.stride())
    if not isinstance(raw_beta, torch.Tensor) or raw_beta.dim() != 3 or raw_beta.shape[0] != 1:
        fail("raw_beta", f"shape [1, {B}, {H}]", shape_text(raw_beta))
    fail("out", f"None or a tensor [1, {B}, {H}, V]", shape_text(out))


def fused_recurrent_kda_packed_decode(
    mixed_qkv,
    raw_g,
    raw_beta,
    A_log,
    dt_bias,
    lower_bound,
    initial_state,
    state_indices,
    scale=None,
    out=None,
):
    """vLLM Kimi K3's plain-decode call (one token per request, straight from the packed post-conv rows).

    Args (B requests, H heads, K = V = 128, as vLLM passes them):
        mixed_qkv: [B, 3 * H * K] bf16 ``[q heads | k heads | v heads]``, last dim contiguous, row stride free.
        raw_g: [1, B, H, K] raw gate (bf16 or fp32), each token's [H, K] contiguous, token stride free.
        raw_beta: [1, B, H] beta logit, any strides.
        A_log: [H] fp32. dt_bias: [H * K] or [H, K] fp32, or None (zeros).
        lower_bound: negative float (Kimi K3's ``lb * sigmoid(exp(A_log) * x)`` gate) or None (softplus gate).
        initial_state: the pool [slots, H, V, K] (fp32 or bf16, inner dims compact, slot stride free); updated in
            place.
        state_indices: [B] int32 / int64, any stride. An index ``<= 0`` (or ``>= slots``) makes its row null: zero
            output, the pool neither read nor written there.
        scale: None (K ** -0.5) or a float.
        out: None (allocated [1, B, H, V] in ``mixed_qkv``'s dtype) or a bf16 [1, B, H, V] buffer (row and head
            strides free) written in place.

    Returns ``(out, initial_state)``: ``out`` is the tensor passed (or allocated), the pool the one passed.

    On CUDA this is kda-cute's packed T=1 kernel itself in the token form
    (:func:`kda_cute.decode_t1.kda_decode_t1_packed_tokens`), which takes ``raw_g``, ``raw_beta`` and ``out`` as they
    are: no view, no copy, no allocation when ``out`` is given. Its validator names the arguments as it sees them
    (``raw_gate``, ``raw_beta``, ``output``). On the CPU (and on CUDA without kda-cute) the same call runs through
    :func:`kda_recurrent.recurrent_kda` on zero-copy views, i.e. kda-core's oracle.
    """
    try:
        on_device = mixed_qkv.get_device() >= _KERNEL_DEVICE_MIN
    except AttributeError:  # not a tensor: the views below name it
        on_device = False
    if on_device:
        fn = _packed_entry
        if fn is _UNLOADED:
            fn = _load_packed()
        if fn is not None:
            return fn(mixed_qkv, raw_g, raw_beta, initial_state, state_indices, A_log=A_log, dt_bias=dt_bias,
                      lower_bound=lower_bound, scale=scale, output=out, null_policy=_NULL_POLICY), initial_state
    try:
        # B, H, K from raw_g: the kernel's validator checks them against mixed_qkv and the pool (and K = 128).
        one, B, H, K = raw_g.shape
        if one != 1 or raw_beta.shape[0] != 1:
            raise ValueError
        gate = raw_g.view(B, H * K)  # [1, B, H, K] with each token's [H, K] compact: a view
        beta = raw_beta[0]  # [B, H] (any other rank is refused by the kernel's validator, naming raw_beta)
        if out is None:
            out = torch.empty((1, B, H, initial_state.shape[2]), dtype=mixed_qkv.dtype, device=mixed_qkv.device)
        output = out.transpose(0, 1)  # [B, 1, H, V]: the kernel's output form (a size-1 dim's stride is not read)
    except (AttributeError, TypeError, ValueError, IndexError, RuntimeError):
        _refuse_packed(mixed_qkv, raw_g, raw_beta, initial_state, out)
    q, k, v, g, b = _unpacked_views(mixed_qkv, gate, beta, H, K)
    recurrent_kda(q, k, v, g, b, A_log=A_log, dt_bias=dt_bias, scale=scale, initial_state=initial_state,
                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=lower_bound, beta_is_logit=True,
                  ssm_state_indices=state_indices, output=output, null_policy=_NULL_POLICY)
    return out, initial_state


def _unpacked_views(mixed_qkv, gate, beta, H, K):
    """q, k, v, g [B, 1, H, K] and beta [B, 1, H]: views of the packed rows (the facade's T=1 form)."""
    if not isinstance(mixed_qkv, torch.Tensor) or mixed_qkv.dim() != 2 or mixed_qkv.shape[1] != 3 * H * K:
        fail("mixed_qkv", f"shape [B, {3 * H * K}] (3 * H * K, H and K from raw_g)", shape_text(mixed_qkv))
    if mixed_qkv.stride(1) != 1:
        fail("mixed_qkv", "a contiguous last dim", mixed_qkv.stride())
    q, k, v = (part.unflatten(1, (H, K)).unsqueeze(1) for part in mixed_qkv.split(H * K, dim=1))
    return q, k, v, gate.unflatten(1, (H, K)).unsqueeze(1), beta.unsqueeze(1)


def fused_recurrent_kda(
    q,
    k,
    v,
    raw_g,
    raw_beta,
    A_log,
    dt_bias,
    lower_bound,
    initial_state,
    cu_seqlens,
    ssm_state_indices,
    num_accepted_tokens=None,
    out=None,
    fuse_gate=None,
):
    """vLLM Kimi K3's speculative-decode call: per-token checkpoints from raw gate and beta.

    Args (n requests, 1 + S tokens each at most, concatenated; H heads, K = V = 128):
        q, k, v: [1, Ntok, H, K] bf16, strided views of the post-conv rows (head dims compact).
        raw_g: [1, Ntok, H, K] raw gate; raw_beta: [1, Ntok, H] beta logit.
        A_log [H] fp32, dt_bias [H * K] fp32 or None, lower_bound (negative float or None): the gate's parameters.
        initial_state: the pool [slots, H, V, K], updated in place.
        cu_seqlens: [n + 1] int offsets (device data, bounded in the kernel).
        ssm_state_indices: [n, 1 + S] rows of the block table (column stride 1, row stride free): the first state is
            read from column ``num_accepted_tokens[n] - 1`` and the state after token t written to column t.
            Under vLLM's policy an index ``<= 0`` is null (its token is skipped, no write), and a row whose accepted
            count is ``<= 0`` or ``> 1 + S`` is null as a whole.
        num_accepted_tokens: [n] int or None (column 0).
        out: None (a new bf16 [1, Ntok, H, V]) or a bf16 [1, Ntok, H, V] buffer written in place.
        fuse_gate: None or True (vLLM's default): the gate and sigmoid(beta) are computed in the kernel. False: as
            vLLM does, the fp32 gate ``gate(raw_g)`` and beta ``sigmoid(raw_beta)`` are materialised first
            (kda-core's gate formula, the same as vLLM's fused gate kernel) and the kernel takes them precomputed.
            Both give the same results up to rounding.

    The scale is K ** -0.5 and the L2 norm is on, as vLLM fixes them. Returns ``(out, initial_state)``.
    Runs through :func:`kda_recurrent.recurrent_kda` (the generic kernel on CUDA, the oracle on the CPU).
    """
    if fuse_gate is None:
        fuse_gate = True
    elif fuse_gate is not True and fuse_gate is not False:
        fail("fuse_gate", "None, True or False", repr(fuse_gate))
    if fuse_gate:
        g, beta = raw_g, raw_beta
    else:
        # Validate the call as vLLM makes it (the raw gate with its parameters) before any tensor code runs, then
        # materialise the gate and beta; the facade then validates the precomputed form.
        validate_recurrent(RecurrentArgs(
            q, k, v, raw_g, raw_beta, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=lower_bound, beta_is_logit=True,
            cu_seqlens=cu_seqlens, ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens,
            output=out))
        g = kda_gate_ref(raw_g, A_log, dt_bias, lower_bound)
        beta = torch.sigmoid(raw_beta.float())
        A_log = dt_bias = lower_bound = None
    return recurrent_kda(
        q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=fuse_gate, lower_bound=lower_bound, beta_is_logit=fuse_gate, cu_seqlens=cu_seqlens,
        ssm_state_indices=ssm_state_indices, num_accepted_tokens=num_accepted_tokens, output=out,
        null_policy=_NULL_POLICY,
    )


# ---------------------------------------------------------------------------------------------------------------
# RecoverSSM (``--use-replayssm``): read from vllm-project/vllm ``vllm/models/kimi_k3/nvidia/ops/recoverssm.py``
# @ 055e47c28003156421365af985d676fc921cb075 (``kda_recoverssm_verify`` and ``KDARecoverSSMCommitContext``; the copy
# @ 7752ecb8ac83fc27b687de672711efc5b8d94d32 has the same signatures). docs/serving.md §1 summarises both.


def kda_recoverssm_verify(
    q,
    k,
    v,
    raw_g,
    raw_beta,
    A_log,
    dt_bias,
    lower_bound,
    checkpoint_state,
    correction_cache,
    kg_cache,
    query_start_loc,
    state_indices,
    spec_query_len,
    out=None,
):
    """vLLM Kimi K3's RecoverSSM verify: run each request's speculative window from its checkpoint without writing
    it, and record what the commit needs.

    Args (n requests of at most ``spec_query_len`` tokens each, concatenated; H heads, K = V = 128):
        q, k, v: [1, Ntok, H, K] bf16 (head dims compact, token stride free); raw_g: [1, Ntok, H, K] raw gate;
            raw_beta: [1, Ntok, H] beta logits.
        A_log [H] fp32, dt_bias [H * K] fp32, lower_bound (negative float or None: softplus): the gate.
        checkpoint_state: [blocks, H, V, K] bf16 or fp32, **read only**.
        correction_cache: [blocks, H, spec_query_len, V] fp32; kg_cache: [blocks, H, spec_query_len, 2K] in k's
            dtype: per token t of request n, at its block ``state_indices[n]``, ``u_t = sigmoid(beta_t) (v_t -
            S'_{t-1} k^_t)`` and raw k_t | raw g_t (the records :class:`KDARecoverSSMCommitContext` folds).
        query_start_loc: [n + 1] int32/int64 offsets; state_indices: [n] int32/int64 (column 0 of the spec index
            rows, any stride). Device data, bounded in the kernel.
        spec_query_len: int, 1 + the draft tokens (the records' T_max; the tensor-core kernel is compiled for the
            smallest of 4 and 8 that covers it).
        out: None (a new bf16 [1, Ntok, H, V]) or a bf16 buffer of that shape written in place.

    vLLM's null policy (an index ``<= 0`` is null: zero output, nothing read or written); an index past the pool is
    null too (vLLM reads it). Scale K ** -0.5 and the q/k L2 norm, as vLLM fixes them. A request with more than
    ``spec_query_len`` tokens is malformed: its tokens past the window get no record (and, on the tensor-core
    kernel, no output), as vLLM's kernel processes only the window. Returns ``out``.
    """
    from kda_recurrent.spec import spec_call

    if type(spec_query_len) is not int or spec_query_len < 1:
        fail("spec_query_len", "an int >= 1 (1 + the draft tokens per request)", repr(spec_query_len))
    args = RecurrentArgs(q, k, v, raw_g, raw_beta, A_log, dt_bias, None, checkpoint_state, False, True, True,
                         lower_bound, True, query_start_loc, state_indices, None, out)
    spec = SpecArgs(disable_state_update=True, correction_cache=correction_cache, kg_cache=kg_cache)
    o, _ = spec_call(args, spec, _NULL_POLICY, rows_t=spec_query_len)
    return o


class KDARecoverSSMCommitContext:
    """vLLM Kimi K3's RecoverSSM commit context on kda's commit kernel: ``create(layers, *, spec_query_len,
    max_num_reqs)`` once, ``commit(num_accepted_tokens, state_indices, query_start_loc, request_indices=None,
    block_table=None, num_computed_tokens=None, mamba_block_size=None)`` after every sampling step.

    ``layers``: vLLM's KDA layer objects; each has ``kv_cache`` = (conv state, checkpoint [blocks, H, V, K],
    correction cache, kg cache), ``A_log`` [H], ``dt_bias`` ([H*K] or [H, K]), ``gate_lower_bound`` (one value for
    all layers). The checkpoints of every layer are folded in one launch (:class:`kda_recurrent.RecoverSSMCommit`);
    each layer's conv state (``[blocks, conv_dim, history + spec_query_len - 1]`` dim-first, or
    ``[blocks, width, conv_dim]``: ``conv_dim_first``, by default vLLM's ``is_conv_state_dim_first()``, else
    dim-first) is compacted as vLLM's commit compacts it: the ``history`` columns that end at the last accepted token
    move to the front, with device ops only (a gather and a masked copy per layer; no sync; null rows rewrite block
    0's columns with their own values, so block 0 stays bitwise unchanged). Counts come from
    ``num_accepted_tokens[request_indices[n]]`` when ``request_indices`` is given (a request outside the counts
    commits nothing). Commit length, null rows: :func:`kda_recurrent.recoverssm_commit`, under vLLM's policy (an
    index ``<= 0`` is null).

    vLLM's prefix-cache "align" mode (``block_table`` [requests, columns], ``num_computed_tokens`` [requests],
    ``mamba_block_size``, all three or none), as its commit computes it (``_prepare_commit_plan_kernel``,
    ``_compact_conv_state_kernel`` and ``_commit_kda_state_kernel`` in ``recoverssm.py``
    @ 7752ecb8ac83fc27b687de672711efc5b8d94d32): request r = ``request_indices[n]`` (or n)
    with c = ``num_computed_tokens[r]`` tokens before the window and ``commit_len`` accepted ends at block
    ``block_table[r, min((c + commit_len) // size, columns - 1)]`` (the *final* block, which receives the folded
    state and conv window instead of the source slot ``state_indices[n]``); when c + commit_len reaches the next
    boundary b = (c // size + 1) * size, the state after the window's first ``b - c`` tokens (and its conv window) also
    goes to ``block_table[r, b // size - 1]`` (the *boundary* block). Both are folded from the source slot's
    checkpoint and records. A final block ``<= 0`` makes the row null, as in vLLM; a final block past the pool, a
    request past ``block_table``, ``num_computed_tokens`` or ``num_accepted_tokens`` and c < 0 make it null too, and
    a boundary column past the table or a boundary block outside (0, blocks) leaves the boundary unwritten (vLLM's
    kernel would read or write out of bounds there); a boundary block equal to the final one is left to the final
    state (vLLM stores the boundary first, then the final state over it). Both are folded by the one-launch commit
    reading the source slot and storing to another (``destination_indices``), in three launches whose rows are
    disjoint: the boundary states of rows whose boundary block is not the source, then every row's final state (in
    place where the final block is the source), then the boundary states stored over the source itself, so no launch
    reads a slot an earlier one wrote. A row that does not cross a boundary costs what the plain mode's row costs; a
    crossing row adds one more read of its checkpoint and records and one more state write.
    """

    def __init__(self, commit, conv_states, history, spec_query_len, max_num_reqs):
        self._commit = commit
        self.conv_states = tuple(conv_states)
        self.conv_history_len = history
        self.spec_query_len = spec_query_len
        self.max_num_reqs = max_num_reqs

    @classmethod
    def create(cls, layers, *, spec_query_len, max_num_reqs, conv_dim_first=None):
        from kda_recurrent.spec import RecoverSSMCommit

        if conv_dim_first is None:  # vLLM's own switch when vLLM is importable, else its default (dim-first)
            try:
                from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
            except ImportError:
                conv_dim_first = True
            else:
                conv_dim_first = bool(is_conv_state_dim_first())

        layers = list(layers)
        if not layers:
            fail("layers", "at least one KDA layer", 0)
        if type(spec_query_len) is not int or spec_query_len < 1:
            fail("spec_query_len", "an int >= 1 (1 + the draft tokens per request)", repr(spec_query_len))
        for i, layer in enumerate(layers):
            cache = getattr(layer, "kv_cache", None)
            if cache is None or len(cache) != 4:
                fail(f"layers[{i}].kv_cache", "(conv state, checkpoint, correction cache, kg cache)",
                     None if cache is None else len(cache))
        bounds = {layer.gate_lower_bound for layer in layers}
        if len(bounds) != 1:
            fail("layers", "one gate_lower_bound for every layer", sorted(bounds, key=str))
        convs = [layer.kv_cache[0] if conv_dim_first else layer.kv_cache[0].transpose(-1, -2) for layer in layers]
        for i, conv in enumerate(convs):
            if conv.dim() != 3 or conv.shape[2] < spec_query_len:
                fail(f"layers[{i}].kv_cache[0]", f"a conv state [blocks, conv_dim, history + {spec_query_len} - 1]",
                     tuple(conv.shape))
        history = convs[0].shape[2] - spec_query_len + 1
        commit = RecoverSSMCommit(
            [layer.kv_cache[1] for layer in layers], [layer.kv_cache[2] for layer in layers],
            [layer.kv_cache[3] for layer in layers], [layer.A_log for layer in layers],
            [layer.dt_bias.reshape(-1) for layer in layers], bounds.pop(), null_policy=_NULL_POLICY)
        return cls(commit, convs, history, spec_query_len, max_num_reqs)

    def commit(self, num_accepted_tokens, state_indices, query_start_loc, request_indices=None, block_table=None,
               num_computed_tokens=None, mamba_block_size=None):
        """Fold the accepted prefix of every layer into its checkpoint and compact every layer's conv state."""
        align = self._check_align(block_table, num_computed_tokens, mamba_block_size)
        n = state_indices.shape[0]
        if n == 0:
            return
        if n > self.max_num_reqs:
            fail("state_indices", f"at most max_num_reqs = {self.max_num_reqs} rows", n)
        if align:
            self._commit_aligned(num_accepted_tokens, state_indices, query_start_loc, request_indices, block_table,
                                 num_computed_tokens, mamba_block_size)
            return
        nat = num_accepted_tokens
        if request_indices is not None:  # a request past the counts commits nothing (no read out of bounds)
            req, ok = _requests(request_indices, n, num_accepted_tokens=num_accepted_tokens)
            nat = torch.where(ok, num_accepted_tokens[req], 0)
        self._commit.commit(state_indices, nat, query_start_loc)
        self._compact_conv(state_indices, nat, query_start_loc)

    def _check_align(self, block_table, num_computed_tokens, mamba_block_size):
        """Whether the call is the align mode (all three of its arguments); a KDAError naming the first one that is
        missing or malformed (host metadata only)."""
        given = {"block_table": block_table, "num_computed_tokens": num_computed_tokens,
                 "mamba_block_size": mamba_block_size}
        if all(value is None for value in given.values()):
            return False
        for name, value in given.items():
            if value is None:
                fail(name, "given with the other align-mode arguments (block_table, num_computed_tokens, "
                     "mamba_block_size: all three or none)", None)
        if type(mamba_block_size) is not int or mamba_block_size < self.spec_query_len:
            fail("mamba_block_size", f"an int >= spec_query_len = {self.spec_query_len} (a block covers a window)",
                 repr(mamba_block_size))
        for name, dims in (("block_table", 2), ("num_computed_tokens", 1)):
            value = given[name]
            if not isinstance(value, torch.Tensor) or value.dim() != dims or value.dtype.is_floating_point \
                    or value.dtype.is_complex or value.dtype == torch.bool or value.numel() == 0:
                fail(name, f"a non-empty {dims}-D integer tensor", shape_text(value))
            if value.device != self.conv_states[0].device:
                fail(name, f"a tensor on {self.conv_states[0].device}", str(value.device))
        return True

    def _commit_aligned(self, num_accepted_tokens, state_indices, query_start_loc, request_indices, block_table,
                        num_computed_tokens, size):
        """The align mode (see the class docstring): device ops only, no sync."""
        n, T = state_indices.shape[0], self.spec_query_len
        if not isinstance(query_start_loc, torch.Tensor) or query_start_loc.dim() != 1 \
                or query_start_loc.shape[0] != n + 1:
            fail("query_start_loc", f"a 1-D tensor of {n + 1} offsets (state_indices has {n} rows)",
                 shape_text(query_start_loc))
        dev = state_indices.device
        width = block_table.shape[1]
        blocks = min(self.conv_states[0].shape[0], *(c.shape[0] for c in self._commit.checkpoints))
        req, req_ok = _requests(torch.arange(n, device=dev) if request_indices is None else request_indices, n,
                                block_table=block_table, num_computed_tokens=num_computed_tokens,
                                num_accepted_tokens=num_accepted_tokens)
        src = state_indices.long()
        src_ok = (src > 0) & (src < blocks)
        src = torch.where(src_ok, src, torch.zeros_like(src))
        lens = (query_start_loc[1 : n + 1] - query_start_loc[:n]).long().clamp(0, T)
        commit_len = torch.minimum(num_accepted_tokens[req].long().clamp(0, T), lens)
        done = num_computed_tokens[req].long()
        ends = done + commit_len
        table = block_table[req].long()  # [n, width]

        def block_at(col):
            col_ok = (col >= 0) & (col < width)
            block = table.gather(1, col.clamp(0, width - 1)[:, None])[:, 0]
            return block, col_ok & (block > 0) & (block < blocks)

        final, final_ok = block_at(torch.clamp(torch.div(ends, size, rounding_mode="floor"), max=width - 1))
        final_ok &= req_ok & src_ok & (commit_len > 0) & (done >= 0)
        boundary_end = (torch.div(done, size, rounding_mode="floor") + 1) * size
        bound, bound_ok = block_at(torch.div(boundary_end, size, rounding_mode="floor") - 1)
        bound_ok &= final_ok & (ends >= boundary_end) & (bound != final)
        bound_len = boundary_end - done  # read only where bound_ok (each pass and the conv store mask it)
        zero = torch.zeros_like(src)
        before = bound_ok & (bound != src)  # reads the source before the final pass may store over it
        after = bound_ok & (bound == src)  # stores over the source after the final pass has read it
        for these, block, length in ((before, bound, bound_len), (final_ok, final, commit_len),
                                     (after, bound, bound_len)):
            self._commit.commit(src, torch.where(these, length, zero), query_start_loc,
                                destination_indices=torch.where(these, block, zero))
        # the boundary's window first, then the final one, as vLLM stores them
        self._move_conv(src, ((bound, bound_ok, bound_len), (final, final_ok, commit_len)))

    def _compact_conv(self, state_indices, nat, query_start_loc):
        """Each live row's conv window: columns [commit_len - 1, commit_len - 1 + history) move to [0, history)."""
        T = self.spec_query_len
        slots = state_indices.long()
        lens = (query_start_loc[1:] - query_start_loc[:-1]).long().clamp(0, T)
        commit_len = torch.minimum(nat.long().clamp(0, T), lens)
        live = (slots > 0) & (slots < self.conv_states[0].shape[0]) & (commit_len > 0)
        safe = torch.where(live, slots, torch.zeros_like(slots))
        self._move_conv(safe, ((safe, live, commit_len),))

    def _move_conv(self, src, stores):
        """Every layer's conv state: for each (block, ok, length) of ``stores``, in order, row n's block receives
        in its first ``history`` columns the source slot ``src[n]``'s columns [length - 1, length - 1 + history) where
        ``ok[n]``; a row not ok writes the source slot's own first columns back onto it. Every source column is read
        (a copy per layer) before any write."""
        hist = self.conv_history_len
        steps = torch.arange(hist, device=src.device)
        stores = [(torch.where(ok, block, src), ok[:, None, None],
                   (length.clamp(1, self.spec_query_len) - 1)[:, None, None] + steps) for block, ok, length in stores]
        for conv in self.conv_states:
            window = conv[src]  # [n, conv_dim, width], a copy
            keep = window[:, :, :hist]
            for to, ok, cols in stores:
                conv[to, :, :hist] = torch.where(ok, window.gather(2, cols.expand(-1, window.shape[1], -1)), keep)


def _requests(request_indices, n, **per_request):
    """Row n's request ``request_indices[n]`` (int64), bounded by the length of every per-request tensor (named in
    ``per_request`` for the error): (index, clamped to 0 where out of range; in range). A KDAError if one of them is
    empty."""
    for name, tensor in per_request.items():
        if tensor.shape[0] == 0:
            fail(name, "a value per request", 0)
    req = request_indices[:n].long()
    ok = (req >= 0) & (req < min(tensor.shape[0] for tensor in per_request.values()))
    return torch.where(ok, req, torch.zeros_like(req)), ok


# ---------------------------------------------------------------------------------------------------------------
# The native fused op (``kda_decode_backend`` "native"/"auto"): conv + SiLU + the KDA step + gated RMSNorm in one
# call. Read from vllm-project/vllm ``csrc/libtorch_stable/kimi_k3/fused_kda_decode_kernel.cu``
# @ 75162ed0be3505bbdaa9f24849afbb03dd7d2568 (the op's parameters and host checks; the copy
# @ 15a3fd47ef45622a355ab7be62035231891f5e44 takes the SD conv layout only) and its caller ``_forward`` in
# ``vllm/models/kimi_k3/nvidia/kda.py`` @ 3a1f05ba17aa4715f4020a4d304d57cfc1e37ebb, which binds
# ``from vllm import _custom_ops as ops`` at import and calls ``ops.fused_kda_decode(x=..., ..., norm_eps=...)``
# with every argument by keyword; vLLM's test ``tests/models/kimi_k3/test_kda.py``
# @ 8c4f545247ba170836eec21c7d181490de09c7fa calls it without ``out`` and reads the returned tensor.
# docs/serving.md §1 "Native fused op" summarises it. The Python function's own source (``vllm/_custom_ops.py``) was
# not among the stored copies read: the parameter order here is the C++ op's, the defaults follow its optional
# parameters and the call sites (every argument by keyword, ``out`` left out); ``integrations.vllm.enable()``
# compares the installed function's signature and keeps vLLM's own on a mismatch.

__all__ += ["fused_kda_decode"]


def fused_kda_decode(
    x,
    weight,
    bias,
    conv_state,
    raw_g,
    raw_beta,
    A_log,
    dt_bias,
    state_indices,
    state,
    out=None,
    lower_bound=None,
    output_gate=None,
    norm_weight=None,
    norm_eps=1e-5,
):
    """vLLM Kimi K3's native fused T=1 decode (``vllm._custom_ops.fused_kda_decode`` over
    ``torch.ops._C.fused_kda_decode``) on kda's fused layer; updates ``conv_state`` and ``state`` in place and returns
    ``out`` [1, B, H, 128] bf16.

    Args (B rows, H heads, C = 3 * H * 128; vLLM's op takes H in {12, 24, 48, 96}, kda's kernel every head count of
    ``kda_core.contracts.T1_HEAD_COUNTS``):
        x: [B, C] bf16, the packed q|k|v projection row (channel stride 1, row stride free).
        weight: [3, 4, H * 128] fp32 contiguous; bias: [C] fp32 contiguous or None (the conv bias).
        conv_state: [slots, C, 3] bf16 in vLLM's SD layout, strides (slot, 1, C), or its DS layout, strides
            (slot, 3, 1); the slot stride is free (vLLM keeps both caches of a block in one page).
        raw_g: [1, B, H, 128] bf16 raw gate; raw_beta: [1, B, H] bf16 beta logits (row stride free).
        A_log: [H] fp32; dt_bias: [H * 128] fp32 (None: zeros, kda's rule; vLLM requires it).
        state_indices: [B] int32 (int64 too, any stride). state: [slots, H, 128, 128] fp32 (bf16 too), inner dims
            compact, slot stride free; as many slots as ``conv_state``.
        out: None (allocated) or [1, B, H, 128] bf16, last dim contiguous, written in place.
        lower_bound: a negative float (Kimi K3's bounded gate) or None (softplus).
        output_gate: [B, H, 128] or [1, B, H, 128] bf16 and norm_weight [128] fp32: together (the gated RMSNorm
            with ``norm_eps``), or both None (the output is the KDA step's o).

    Semantics: scale 128 ** -0.5 and the q / k L2 norm, as vLLM fixes them. Null rows follow vLLM's policy
    (``NullSlotPolicy.NONPOSITIVE``: an index <= 0, and here also one >= slots): zero output, neither the conv cache
    nor the state read or written. vLLM's own op has **no null test**: its padding rows (index 0) compute into the
    reserved block 0 and emit non-zero output, and a negative or too large index reads out of bounds
    (docs/serving.md §6); kda leaves block 0 untouched and writes zeros there on purpose. The conv outputs are
    rounded to bf16 before the step, o to bf16 before the norm (docs/design.md §8); vLLM's op keeps both in fp32, a
    difference within its own test's tolerances (3e-2).

    On CUDA this is kda-cute's fused kernel (:func:`kda_cute.fused_decode.fused_kda_decode`, the DS layout and the
    no-norm call being compile-time variants of it); on the CPU (or without kda-cute) kda-core's reference
    :func:`kda_core.oracle_fused.fused_kda_decode_ref`. No host sync and no allocation when ``out`` is given: safe
    under CUDA-graph capture. Under ``torch.compile`` the call is the ``kda::vllm_fused_kda_decode`` custom op. A
    malformed call raises a :class:`kda_core.errors.KDAError` naming the argument (FlashInfer's names:
    ``raw_gate`` for ``raw_g``, ``output`` for ``out``).
    """
    from kda_recurrent.fused import vllm_native_call

    return vllm_native_call(x, weight, bias, conv_state, raw_g, raw_beta, A_log, dt_bias, state_indices, state, out,
                            lower_bound, output_gate, norm_weight, norm_eps)


# The archs kda-cute's fused kernel is compiled and tested for (sm_90a on the H200 and H100; sm_100a compiled in CI).
_FUSED_CAPABILITIES = ((9, 0), (10, 0))
_K3_LAYER = "vllm.models.kimi_k3.nvidia.kda"


def _layer_fits(num_heads, head_dim, conv_width, input_dtype, conv_state_dtype, recurrent_state_dtype) -> bool:
    """The layer facts vLLM's two backend tests pass that kda's fused layers (T=1 and multi-token) take."""
    return (num_heads in T1_HEAD_COUNTS and head_dim == 128 and conv_width == 4 and input_dtype == torch.bfloat16
            and conv_state_dtype == torch.bfloat16 and recurrent_state_dtype in (torch.float32, torch.bfloat16))


def is_fused_kda_decode_supported(num_heads, head_dim, conv_width, num_spec, input_dtype, conv_state_dtype,
                                  recurrent_state_dtype):
    """vLLM Kimi K3's test for its native fused decode backend, answered for kda's fused layer.

    vLLM's layer asks this once, at construction (``resolve_kda_decode_backend`` in
    ``vllm/models/kimi_k3/nvidia/kda.py`` @ 3a1f05ba17aa4715f4020a4d304d57cfc1e37ebb, which reads the module's
    attribute at call time): True makes it take the native backend, one ``ops.fused_kda_decode`` call per decode
    step; False sends it to FlashInfer's fused decode where that applies (SM100 / SM103), else to the Triton path
    (the conv update, the packed recurrence and the gated RMSNorm as three launches). vLLM's own answer needs an fp32
    state, H in {12, 24, 48, 96} and its compiled op. kda's: the native op's Python function is kda's adapter
    (:func:`fused_kda_decode`, installed by ``kda_recurrent.integrations.vllm``; without it vLLM's op would get the
    pool), H in ``kda_core.contracts.T1_HEAD_COUNTS``, head_dim 128, conv width 4, no speculative tokens, bf16
    activations and conv cache, an **fp32 or bf16** state, and a CUDA device of capability 9.0 or 10.0. So with
    kda enabled a bf16 pool on Hopper decodes in one fused launch, where vLLM alone runs three. Any other layer gets
    vLLM's own answer (as before ``enable()``).
    """
    from kda_recurrent.integrations import original

    ops = sys.modules.get("vllm._custom_ops")
    if ops is None or getattr(ops, "fused_kda_decode", None) is not fused_kda_decode:
        return False
    if (num_spec == 0 and _layer_fits(num_heads, head_dim, conv_width, input_dtype, conv_state_dtype,
                                      recurrent_state_dtype)
            and torch.cuda.is_available() and tuple(torch.cuda.get_device_capability()) in _FUSED_CAPABILITIES):
        return True
    engine = original(_K3_LAYER, "is_fused_kda_decode_supported")
    return bool(engine(num_heads, head_dim, conv_width, num_spec, input_dtype, conv_state_dtype,
                       recurrent_state_dtype)) if engine is not None else False


__all__ += ["is_fused_kda_decode_supported"]


# ---------------------------------------------------------------------------------------------------------------
# The fused spec-decode backend (``kda_spec_decode_backend`` "flashinfer"/"auto"): in ``vllm/models/kimi_k3/nvidia/
# kda.py`` @ 3a1f05ba17aa4715f4020a4d304d57cfc1e37ebb a pure spec-decode batch calls
# ``flashinfer_packed_fused_kda_decode(x=, weight=, conv_state=, raw_gate=, raw_beta=, A_log=, dt_bias=,
# state_indices=, query_start_loc=, num_accepted_tokens=, state=, output_gate=, norm_weight=, lower_bound=,
# norm_eps=, output=)`` (every argument by keyword) when ``resolve_kda_spec_decode_backend`` chose this backend at
# construction through ``is_flashinfer_fused_kda_spec_decode_supported``. The module binds the name at import from
# ``vllm/utils/flashinfer.py``, where it is ``_lazy_import_wrapper("flashinfer", "packed_fused_kda_decode")``, a
# ``wrapper(*args, **kwargs)`` (the stored copy that has the KDA names carries no commit in the code index; the copy
# @ 487151de954b26f8f2d3263b88d2a182f2a1b0cd predates them).

_FI_WRAPPER = ("vllm.utils.flashinfer", "flashinfer_packed_fused_kda_decode")
_SPEC_CAPABILITY = (9, 0)  # kda's fused spec path stands in for FlashInfer's on Hopper only (see below)


def _spec_on_kda(x) -> bool:
    """Whether kda's fused spec layer takes a call whose rows ``x`` live where they do (a Hopper GPU)."""
    return capability_of(x) == _SPEC_CAPABILITY


def flashinfer_packed_fused_kda_decode(*args, **kwargs):
    """vLLM's binding of FlashInfer's ``packed_fused_kda_decode``: on Hopper kda's fused multi-token layer
    (:func:`kda_recurrent.fused.packed_fused_kda_decode`, FlashInfer 0.7.2's signature and semantics: an index
    ``<= 0`` is null, as vLLM's metadata pads), elsewhere (and on the CPU) vLLM's own wrapper, i.e. FlashInfer's
    kernel, which vLLM takes on SM100 and kda's kernels have not run on. vLLM's wrapper forwards ``*args,
    **kwargs``; so does this."""
    from kda_recurrent.fused import packed_fused_kda_decode
    from kda_recurrent.integrations import original

    x = kwargs["x"] if "x" in kwargs else (args[0] if args else None)
    engine = original(*_FI_WRAPPER)
    if engine is not None and isinstance(x, torch.Tensor) and not _spec_on_kda(x):
        return engine(*args, **kwargs)
    return packed_fused_kda_decode(*args, **kwargs)


def is_flashinfer_fused_kda_spec_decode_supported(num_heads, head_dim, conv_width, num_spec, input_dtype,
                                                  conv_state_dtype, recurrent_state_dtype, lower_bound,
                                                  use_recoverssm):
    """vLLM Kimi K3's test for the fused spec-decode backend, answered for kda's fused multi-token layer on Hopper.

    vLLM's answer needs FlashInfer and an SM100-family device, H in {12, 24, 32, 48, 96}, 1-7 speculative tokens; on
    any device but Hopper it is the answer given here (vLLM's own test, run as it is), and the wrapper above runs
    FlashInfer's kernel there. On Hopper (capability 9.0), where vLLM alone has no fused spec path, kda's answer:
    the layer module's ``flashinfer_packed_fused_kda_decode`` is kda's (above), H in
    ``kda_core.contracts.T1_HEAD_COUNTS``, head_dim 128, conv width 4, 1 to ``MAX_FUSED_SPEC_TOKENS - 1``
    speculative tokens, bf16 activations and conv cache, an fp32 or bf16 state, a negative ``lower_bound`` (Kimi
    K3's gate), RecoverSSM off (its verify writes records, not checkpoints), vLLM's SD conv layout (not
    ``is_conv_state_dim_first()``). With kda enabled, a pure spec-decode batch on Hopper then runs one fused launch
    (conv window, recurrence with per-token checkpoints, gated RMSNorm) where vLLM alone runs its conv update, the
    recurrence and the norm.
    """
    from kda_recurrent.integrations import original

    if not torch.cuda.is_available() or tuple(torch.cuda.get_device_capability()) != _SPEC_CAPABILITY:
        engine = original(_K3_LAYER, "is_flashinfer_fused_kda_spec_decode_supported")
        return bool(engine(num_heads, head_dim, conv_width, num_spec, input_dtype, conv_state_dtype,
                           recurrent_state_dtype, lower_bound, use_recoverssm)) if engine is not None else False
    layer = sys.modules.get(_K3_LAYER)
    if layer is None or getattr(layer, "flashinfer_packed_fused_kda_decode", None) is not \
            flashinfer_packed_fused_kda_decode:
        return False
    if (not _layer_fits(num_heads, head_dim, conv_width, input_dtype, conv_state_dtype, recurrent_state_dtype)
            or not 1 <= num_spec < MAX_FUSED_SPEC_TOKENS or lower_bound is None or not lower_bound < 0
            or use_recoverssm):
        return False
    dim_first = getattr(layer, "is_conv_state_dim_first", None)
    return dim_first is not None and not dim_first()


__all__ += ["flashinfer_packed_fused_kda_decode", "is_flashinfer_fused_kda_spec_decode_supported"]
