"""FLA's per-token-checkpoint spec decode in the call forms a serving stack might use, timed in one process.

DESIGN §7 quotes FLA at T=8 B=64 169 us, B=512 1410 us and T=4 B=64 90 us, B=512 740 us (H200, 2026-11-29, graph
replay, warm L2); the ucache benchmark's form of the call (``bench_kda_ucache_flush.fla_spec_fn``: [B, T] inputs,
V-first bf16 states, gate, beta sigmoid and l2norm in the kernel) reads 26-30% below those figures on the same kind
of machine, while its T=1 call reproduces DESIGN's T=1 anchors to 2%. This script times the forms that could
explain the gap, each as FLA 0.6.0 ``fused_recurrent_kda_fwd`` with 2-D ``ssm_state_indices`` [B, T] and
``num_accepted_tokens`` (one state write per draft token into a permuted pool of B*T slots):

- ``layout``: ``bt`` ([B, T, H, K] inputs) or ``varlen`` ([1, B*T, H, K] with ``cu_seqlens``, as vLLM calls it);
- ``state``: bf16 or fp32 per-token states; ``v_first``: the [.., V, K] layout of our pool (else FLA's default
  [.., K, V]);
- ``gate``: ``kernel`` (the gate and beta's sigmoid inside the recurrent kernel) or ``outside`` (FLA's
  ``fused_kda_gate`` to fp32 and ``torch.sigmoid`` of beta first, as vLLM's KDA layer does; the timer sums the
  kernels of one call).

    python benchmarks/fla_spec_forms.py --t 8 4 --batch-size 64 512 --json fla_forms.json
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402

HEAD_DIM = 128
LOWER_BOUND = -5.0
ANCHORS_US = {(8, 64): 169.0, (8, 512): 1410.0, (4, 64): 90.0, (4, 512): 740.0}
"""DESIGN §7: FLA spec decode with per-token checkpoints, H200, 2026-11-29."""
STATES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--t", type=int, nargs="+", default=[8, 4])
    p.add_argument("--batch-size", type=int, nargs="+", default=[64, 512])
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--layout", nargs="+", choices=["bt", "varlen"], default=["bt", "varlen"])
    p.add_argument("--state", nargs="+", choices=list(STATES), default=["bf16", "fp32"])
    p.add_argument("--v-first", type=int, nargs="+", choices=[0, 1], default=[1, 0])
    p.add_argument("--gate", nargs="+", choices=["kernel", "outside"], default=["kernel", "outside"])
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iterations", type=int, default=50)
    p.add_argument("--json", type=str, default=None)
    return p.parse_args(argv)


def fla_spec_call(x, B, T, H, gen, state_dtype, v_first, varlen, gate="kernel", lower_bound=LOWER_BOUND):
    """One FLA per-token-checkpoint spec-decode call on the draft inputs ``x`` (q, k, v, g, b as [B, T, ..], A_log,
    dt_bias): a pool of B*T ``state_dtype`` states, permuted slots idx[b, t] and accepted counts drawn from ``gen``
    (in that order). The benchmark's FLA_FORMS and this script's sixteen forms both build their calls here."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    from fla.ops.kda.gate import fused_kda_gate

    pool = (torch.randn(B * T, H, HEAD_DIM, HEAD_DIM, generator=gen, device="cuda") * 0.1).to(state_dtype)
    idx = torch.randperm(B * T, generator=gen, device="cuda").to(torch.int32).view(B, T)
    accepted = torch.randint(1, T + 1, (B,), generator=gen, device="cuda").to(torch.int32)
    q, k, v, g, b = x["q"], x["k"], x["v"], x["g"], x["b"]
    A_log, dt_bias = x["A_log"], x["dt_bias"]
    cu = None
    if varlen:
        q, k, v, g, b = (t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, g, b))
        cu = torch.arange(0, B * T + 1, T, device="cuda", dtype=torch.long)
    out = torch.empty_like(v)
    in_kernel = gate == "kernel"

    def call():
        gk, bk = g, b
        if not in_kernel:
            gk = fused_kda_gate(g, A_log, dt_bias, lower_bound=lower_bound, output_dtype=torch.float32)
            bk = b.float().sigmoid()
        fused_recurrent_kda_fwd(
            q, k, v, gk, bk, A_log=A_log if in_kernel else None, dt_bias=dt_bias if in_kernel else None,
            initial_state=pool, inplace_final_state=True, state_v_first=v_first, cu_seqlens=cu,
            ssm_state_indices=idx, num_accepted_tokens=accepted, use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=in_kernel, use_beta_sigmoid_in_kernel=in_kernel,
            lower_bound=lower_bound if in_kernel else None, out=out,
        )  # fmt: skip

    return call


def make_call(B, T, H, layout, state, v_first, gate, seed=0):
    K = HEAD_DIM
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device="cuda") * scale

    q, k, v, g = (randn(B, T, H, K).bfloat16() for _ in range(4))
    x = dict(q=q, k=k, v=v, g=g, b=randn(B, T, H).bfloat16(),
             A_log=torch.log(torch.rand(H, generator=gen, device="cuda") * 15 + 1), dt_bias=randn(H * K, scale=0.5))
    return fla_spec_call(x, B, T, H, gen, STATES[state], bool(v_first), layout == "varlen", gate)


def main(argv=None):
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    timer = _timing.KernelTimer()
    records = []
    forms = list(itertools.product(args.layout, args.state, args.v_first, args.gate))
    for T, B in itertools.product(args.t, args.batch_size):
        anchor = ANCHORS_US.get((T, B))
        for layout, state, v_first, gate in forms:
            call = make_call(B, T, args.heads, layout, state, v_first, gate, seed=B * 7 + T)
            replay = _timing.graph_of(call)
            us = _timing.median(timer.time(replay, iterations=args.iterations, warmup=args.warmup))
            rec = dict(T=T, B=B, H=args.heads, layout=layout, state=state, v_first=bool(v_first), gate=gate,
                       fla_us=us, anchor_us=anchor, over_anchor=us / anchor if anchor else None,
                       timer=timer.backend, gpu=_timing.gpu_name())  # fmt: skip
            records.append(rec)
            rel = f"{us / anchor:6.3f} of the anchor" if anchor else ""
            print(f"T={T} B={B:4d} {layout:6s} {state} {'V-first' if v_first else 'K-first'} gate {gate:7s} "
                  f"{us:9.2f} us  {rel}", flush=True)
            del call, replay
            torch.cuda.empty_cache()
    if args.json:
        _timing.write_json(args.json, records)
    return records


if __name__ == "__main__":
    main()
