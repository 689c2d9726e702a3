"""Reference of the fused KDA decode layer (docs/design.md §8): conv update, SiLU, the KDA step, gated RMSNorm.

One decode step of a whole KDA layer between the projection GEMM and ``o_proj``, written for clarity in plain
PyTorch (fp32 by default), on CPU or CUDA tensors, updating the conv cache and the state pool in place as a kernel
does. Two forms, with FlashInfer's argument names (``fused_kda_decode`` and ``packed_fused_kda_decode``):

- :func:`fused_kda_decode_ref`: T = 1, one row per request.
- :func:`packed_fused_kda_decode_ref`: the multi-token form of spec decode: ragged rows from ``query_start_loc``,
  per-token checkpoints ``state_indices [N, T]``, the conv over a T + 2 column window.

Per row (slot ``s``), with C = 3·H·128 channels and ``x`` the packed q|k|v row (bf16):

1. Convolution, width 4, depthwise: ``window = [conv_state[s] (3 history columns, oldest first) | x]``;
   ``mixed[c] = silu(sum_j window[c, j] · w[c, j] (+ bias[c]))`` rounded to bf16; ``conv_state[s]`` keeps the last
   3 columns (bf16, exact). ``weight`` is ``[3, 4, H·128]`` fp32, part-major (channel c = part·H·128 + i, tap j of
   channel c is ``weight[part, j, i]``; tap 0 multiplies the oldest column).
2. q, k, v = the three parts of ``mixed``; the KDA step of docs/design.md §3 (L2 norms, the gate from ``raw_gate`` +
   ``dt_bias``, ``beta = sigmoid(raw_beta)``, decay, delta rule), ``o`` from the fp32 state, rounded to bf16.
3. Gated RMSNorm per head over its 128 channels:
   ``y = o · rsqrt(mean(o²) + norm_eps) · norm_weight · sigmoid(output_gate)``, output bf16 ``[1, rows, H, 128]``.

Null rows follow docs/design.md §4 for the conv cache and the state pool alike (default ``NONPOSITIVE``, as
FlashInfer's op and vLLM use it): zero output, neither cache read nor written. Device data is bounded as the
kernels bound it (docs/design.md §4): ``query_start_loc`` clamped in 64 bits, the accepted count's column
``max(min(nat, T), 1) - 1``.

Multi-token conv cache: ``[slots, C, T + 2]`` (or wider). A row reads its history from columns ``col .. col + 2``
(``col`` = the accepted count's column: the window that precedes the row's first new token), then rewrites the
cache as ``[history[1], history[2], x_0, x_1, ...]``: after accepting ``a`` tokens of this step, columns
``a - 1 .. a + 1`` are the history of the next step's first token, which is where the next step reads. The conv runs
over every token of a live row; a token whose checkpoint slot is null is skipped by the recurrence as in
:func:`kda_core.oracle.recurrent_kda_ref` (zero output, no write, the running state does not absorb it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kda_core.contracts import HEAD_DIM, NullSlotPolicy
from kda_core.errors import fail
from kda_core.oracle_step import kda_gate_ref, kda_step_ref

__all__ = ["conv_taps", "fused_kda_decode_ref", "packed_fused_kda_decode_ref"]

CONV_WIDTH = 4
CONV_HISTORY = CONV_WIDTH - 1
NORM_EPS = 1e-5


def _live(slot: int, N: int, policy: NullSlotPolicy) -> bool:
    low = 1 if NullSlotPolicy(policy) is NullSlotPolicy.NONPOSITIVE else 0
    return low <= slot < N


def conv_taps(weight: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """``[C, 4]`` taps (channel-major, tap 0 the oldest column) from the ``[3, 4, H·128]`` part-major weight."""
    if weight.dim() != 3 or weight.shape[0] != 3 or weight.shape[1] != CONV_WIDTH:
        fail("weight", "shape [3, 4, H*128] (part-major conv taps)", tuple(weight.shape))
    return weight.to(dtype).permute(0, 2, 1).reshape(-1, CONV_WIDTH)


def _conv_token(window: torch.Tensor, taps: torch.Tensor, bias) -> torch.Tensor:
    """SiLU of one token's depthwise conv over its [C, 4] window, rounded to bf16 (returned in the window's dtype)."""
    acc = (window * taps).sum(-1)
    if bias is not None:
        acc = acc + bias
    return F.silu(acc).to(torch.bfloat16).to(window.dtype)


def _gated_rmsnorm(o: torch.Tensor, norm_weight, output_gate, eps: float) -> torch.Tensor:
    """o [..., H, 128] (bf16-rounded, in fp), gate [..., H, 128]: §8 step 3, in o's dtype."""
    inv = torch.rsqrt(o.square().mean(-1, keepdim=True) + eps)
    return o * inv * norm_weight.to(o.dtype) * torch.sigmoid(output_gate.to(o.dtype))


def _layer_params(x, weight, conv_state, state, A_log, dt_bias, norm_weight, bias, dtype):
    C = x.shape[-1]
    if C % (3 * HEAD_DIM):
        fail("x", "a last dimension of 3*H*128 (the packed q|k|v row)", tuple(x.shape))
    H = C // (3 * HEAD_DIM)
    taps = conv_taps(weight, dtype)
    if taps.shape[0] != C:
        fail("weight", f"shape [3, 4, {H * HEAD_DIM}] for x's {C} channels", tuple(weight.shape))
    if conv_state.dim() != 3 or conv_state.shape[1] != C or conv_state.shape[2] < CONV_HISTORY:
        fail("conv_state", f"shape [slots, {C}, >= 3]", tuple(conv_state.shape))
    if state.dim() != 4 or state.shape[1:] != (H, HEAD_DIM, HEAD_DIM):
        fail("state", f"shape [slots, {H}, 128, 128]", tuple(state.shape))
    if conv_state.shape[0] != state.shape[0]:
        fail("state", f"as many slots as conv_state ({conv_state.shape[0]})", state.shape[0])
    if norm_weight is not None and norm_weight.numel() != HEAD_DIM:
        fail("norm_weight", "128 elements", norm_weight.numel())
    b = None
    if bias is not None:
        if bias.numel() != C:
            fail("bias", f"{C} elements (one per conv channel)", bias.numel())
        b = bias.to(dtype).reshape(C)
    return H, taps, b


def _step_head_inputs(mixed, raw_gate, raw_beta, A_log, dt_bias, lower_bound, H, dtype):
    """(q, k, v, g_log, beta) of one token from its conv output mixed [C] and its raw gate [H, 128] / beta [H]."""
    q, k, v = mixed.view(3, H, HEAD_DIM).unbind(0)
    g_log = kda_gate_ref(raw_gate.reshape(H, HEAD_DIM), A_log, dt_bias, lower_bound, True, dtype)
    beta = torch.sigmoid(raw_beta.reshape(H).to(dtype))
    return q, k, v, g_log, beta


@torch.no_grad()
def fused_kda_decode_ref(
    x,
    weight,
    conv_state,
    raw_gate,
    raw_beta,
    A_log,
    dt_bias,
    state_indices,
    state,
    output_gate,
    norm_weight,
    lower_bound=-5.0,
    norm_eps=NORM_EPS,
    output=None,
    *,
    bias=None,
    null_policy=NullSlotPolicy.NONPOSITIVE,
    dtype=torch.float32,
):
    """One T = 1 step of the fused layer for B rows; updates ``conv_state`` and ``state`` in place.

    Shapes (B rows, H heads): x [B, 3·H·128]; weight [3, 4, H·128] fp32; conv_state [slots, 3·H·128, >= 3]
    (history in columns 0..2, oldest first; any strides); raw_gate B·H·128 elements ([1, B, H, 128] or
    [B, H·128]); raw_beta B·H elements (a logit); A_log [H]; dt_bias H·128 elements or None; state_indices [B];
    state [slots, H, 128, 128] bf16 or fp32 (rounded once on store); output_gate B·H·128 elements; norm_weight [128];
    ``lower_bound`` None selects the softplus gate; ``bias`` [3·H·128] the conv bias, optional. ``output_gate`` and
    ``norm_weight`` both None: no gated RMSNorm, the output is o rounded to bf16 (vLLM's native op without them).

    Returns output [1, B, H, 128] bf16 (``output`` when given, written in place).
    """
    B = x.shape[0]
    if (output_gate is None) != (norm_weight is None):
        fail("output_gate" if output_gate is None else "norm_weight", "output_gate and norm_weight both or neither",
             None)
    H, taps, b = _layer_params(x, weight, conv_state, state, A_log, dt_bias, norm_weight, bias, dtype)
    N = state.shape[0]
    out = torch.zeros(1, B, H, HEAD_DIM, dtype=dtype, device=x.device)
    gates = raw_gate.reshape(B, H, HEAD_DIM)
    betas = raw_beta.reshape(B, H)
    ogate = None if output_gate is None else output_gate.reshape(B, H, HEAD_DIM)
    for r, s in enumerate(state_indices.reshape(B).tolist()):
        if not _live(s, N, null_policy):
            continue
        window = torch.cat((conv_state[s, :, :CONV_HISTORY].to(dtype), x[r].to(dtype)[:, None]), dim=1)
        conv_state[s, :, :CONV_HISTORY] = window[:, 1:].to(conv_state.dtype)
        mixed = _conv_token(window, taps, b)
        q, k, v, g_log, beta = _step_head_inputs(mixed, gates[r], betas[r], A_log, dt_bias, lower_bound, H, dtype)
        S, o, _, _ = kda_step_ref(state[s].to(dtype), q, k, v, g_log, beta, HEAD_DIM**-0.5, True)
        state[s] = S.to(state.dtype)
        o = o.to(torch.bfloat16).to(dtype)
        out[0, r] = o if ogate is None else _gated_rmsnorm(o, norm_weight, ogate[r], norm_eps)
    out = out.to(torch.bfloat16)
    return out if output is None else output.copy_(out.reshape(output.shape))


@torch.no_grad()
def packed_fused_kda_decode_ref(
    x,
    weight,
    conv_state,
    raw_gate,
    raw_beta,
    A_log,
    dt_bias,
    state_indices,
    state,
    output_gate,
    norm_weight,
    lower_bound=-5.0,
    norm_eps=NORM_EPS,
    output=None,
    *,
    query_start_loc,
    num_accepted_tokens,
    bias=None,
    null_policy=NullSlotPolicy.NONPOSITIVE,
    dtype=torch.float32,
):
    """The multi-token fused step (spec decode) over the ragged rows of ``query_start_loc``; updates ``conv_state``
    and ``state`` in place (the module docstring gives the conv cache's window rule).

    Shapes (Ntok tokens, N rows, T = state_indices.shape[1]): x [Ntok, 3·H·128]; raw_gate Ntok·H·128 elements;
    raw_beta Ntok·H; output_gate Ntok·H·128; state_indices [N, T] (column 0 is also the row's conv slot; token t's
    checkpoint goes to column t); conv_state [slots, 3·H·128, >= T + 2]; query_start_loc [N + 1];
    num_accepted_tokens [N]. Row n owns tokens [bos_n, eos_n) with ``bos_n = clamp(qsl[n], 0, Ntok)`` and
    ``eos_n = clamp(qsl[n + 1], bos_n, Ntok)``, at most T of them (later ones get zero output). A row is null when
    its conv slot (column 0) or the slot it reads its state from (column ``max(min(nat, T), 1) - 1``) is null, and
    under ``NONPOSITIVE`` also when nat <= 0 or nat > T (docs/design.md §4).

    Returns output [1, Ntok, H, 128] bf16 (``output`` when given).
    """
    Ntok = x.shape[0]
    H, taps, b = _layer_params(x, weight, conv_state, state, A_log, dt_bias, norm_weight, bias, dtype)
    N = state.shape[0]
    if state_indices.dim() != 2:
        fail("state_indices", "a 2-D [N, T] tensor (one checkpoint slot per token)", tuple(state_indices.shape))
    n_rows, T = state_indices.shape
    if conv_state.shape[2] < T + 2:
        fail("conv_state", f"at least T + 2 = {T + 2} columns (the T-token conv window)", conv_state.shape[2])
    gates = raw_gate.reshape(Ntok, H, HEAD_DIM)
    betas = raw_beta.reshape(Ntok, H)
    ogate = output_gate.reshape(Ntok, H, HEAD_DIM)
    qsl = query_start_loc.reshape(-1).to(torch.long).tolist()
    nat = num_accepted_tokens.reshape(-1).to(torch.long).tolist()
    idx = state_indices.to(torch.long).tolist()
    if len(qsl) != n_rows + 1 or len(nat) != n_rows:
        fail("query_start_loc", f"{n_rows + 1} offsets and num_accepted_tokens {n_rows} counts",
             f"{len(qsl)} and {len(nat)}")
    out = torch.zeros(1, Ntok, H, HEAD_DIM, dtype=dtype, device=x.device)
    nonpositive = NullSlotPolicy(null_policy) is NullSlotPolicy.NONPOSITIVE
    for n in range(n_rows):
        bos = min(max(qsl[n], 0), Ntok)
        eos = min(max(qsl[n + 1], bos), Ntok)
        length = min(eos - bos, T)
        if length <= 0 or T == 0 or (nonpositive and not 1 <= nat[n] <= T):
            continue
        col = max(min(nat[n], T), 1) - 1
        conv_slot, read_slot = idx[n][0], idx[n][col]
        if not (_live(conv_slot, N, null_policy) and _live(read_slot, N, null_policy)):
            continue
        history = conv_state[conv_slot, :, col:col + CONV_HISTORY].to(dtype).clone()
        conv_state[conv_slot, :, :CONV_HISTORY - 1] = history[:, 1:].to(conv_state.dtype)
        S = state[read_slot].to(dtype)
        for t in range(length):
            r = bos + t
            xt = x[r].to(dtype)
            window = torch.cat((history, xt[:, None]), dim=1)
            history = window[:, 1:]
            conv_state[conv_slot, :, t + CONV_HISTORY - 1] = x[r].to(conv_state.dtype)
            dest = idx[n][t]
            if not _live(dest, N, null_policy):
                continue  # skipped by the recurrence: zero output, nothing stored, the state does not absorb it
            mixed = _conv_token(window, taps, b)
            q, k, v, g_log, beta = _step_head_inputs(mixed, gates[r], betas[r], A_log, dt_bias, lower_bound, H, dtype)
            S, o, _, _ = kda_step_ref(S, q, k, v, g_log, beta, HEAD_DIM**-0.5, True)
            state[dest] = S.to(state.dtype)
            out[0, r] = _gated_rmsnorm(o.to(torch.bfloat16).to(dtype), norm_weight, ogate[r], norm_eps)
    out = out.to(torch.bfloat16)
    return out if output is None else output.copy_(out.reshape(output.shape))
