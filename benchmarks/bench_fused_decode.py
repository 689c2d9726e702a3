"""Fused KDA decode layer (T=1) against the unfused pipeline, kda's T=1 kernel alone and the copy roofline.

For each state dtype, head count and batch size: build FlashInfer-style inputs (x rows of a padded GEMM output, a
paged conv cache and state pool, slots B..1), check the fused kernel against kda-core's reference
``fused_kda_decode_ref`` on copies of both caches, then time, with the same timer and in the same process:

- ``fused``: ``kda_cute.fused_decode.fused_kda_decode`` (output given);
- ``t1``: kda's T=1 kernel alone (``kda_decode_t1_packed``) on the same pool: the state step without the conv and
  the norm, the part of the layer the fused kernel must not slow down;
- ``unfused``: the three-kernel pipeline a serving engine runs without a fused op: a conv update + SiLU, the T=1
  kernel on its output, a gated RMSNorm. FLA's ``causal_conv1d_update`` (its dense per-row cache [B, C, 4]: no slot
  indirection) and ``rms_norm_gated`` (activation "sigmoid") when fla-core imports, else small torch ops; the
  record says which (``unfused_impl``). Its time is the sum of its kernels' times (CUPTI), launch gaps excluded;
- ``copy``: an elementwise copy of the bytes the layer must move (the B states read + written, the conv cache's 3
  columns read + written, x, raw_gate, raw_beta, output_gate and the output once), the bandwidth ceiling.

Times are CUDA-graph replays (``--mode direct``: eager launches), warm L2. The defaults are the baseline sweep (bf16
and fp32 states, H in {12, 24}, B = 1 .. 1024), written with provenance to
benchmarks/baselines/<gpu>/fused_kda_decode.{json,png}; about a minute and a half on an H200.

    python benchmarks/bench_fused_decode.py                                              # the baseline
    python benchmarks/bench_fused_decode.py --batch-size 256 1024 --heads 12 --bulk-ring 0 8 --out /tmp/f.json

``--bulk-ring`` takes several values (-1 = the schedule's, 0 = the register path, 2-16 = a ring depth; the ring only
runs in the aligned class, which these inputs are), and so does ``--cluster`` (-1 = the schedule's, 1 = one CTA per
(row, head), 2 / 4 / 8 = a cluster of that many CTAs per (row, head); a cluster runs on the register path): each
pair is a ``FusedDecodeConfig`` timed at every point; where only one of the two is forced the other reads as 0 / 1.
The defaults (both -1) time the schedule's choice, which each record names (``cluster``, ``bulk_ring``).

    python benchmarks/bench_fused_decode.py --batch-size 1 4 8 16 32 64 --heads 12 --cluster 1 2 4 8 --out /tmp/c.json

``--conv-layout ds`` times the conv cache in vLLM's dim-first layout (each channel's 3 columns contiguous) instead
of FlashInfer's channel-contiguous one.
"""

from __future__ import annotations

import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _baseline  # noqa: E402  (first: puts the repository's packages on sys.path)
import _timing  # noqa: E402

NAME = "fused_kda_decode"

D = 128
LOWER_BOUND = -5.0
NORM_EPS = 1e-5
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv=None):
    p = _baseline.parser(__doc__)
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256, 512, 1024])
    p.add_argument("--heads", type=int, nargs="+", default=[12, 24])
    p.add_argument("--state-dtype", choices=sorted(DTYPES), nargs="+", default=["bf16", "fp32"])
    p.add_argument("--mode", choices=["direct", "cuda_graph"], default="cuda_graph")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iterations", type=int, default=100)
    p.add_argument("--bulk-ring", type=int, nargs="+", default=[-1],
                   help="-1 = the schedule's, 0 = the register path, 2-16 = a ring depth; several make a sweep")
    p.add_argument("--cluster", type=int, nargs="+", default=[-1], choices=[-1, 1, 2, 4, 8],
                   help="-1 = the schedule's, 1 = one CTA per (row, head), 2/4/8 = CTAs per cluster; several sweep")
    p.add_argument("--conv-layout", choices=["sd", "ds"], default="sd",
                   help="the conv cache's layout: sd = channel-contiguous (FlashInfer's, the default), ds = each "
                        "channel's 3 columns contiguous (vLLM's dim-first cache)")
    p.add_argument("--no-fla", action="store_true", help="the unfused pipeline with torch ops instead of FLA's")
    _baseline.add_output_args(p)
    return p.parse_args(argv)


def make_inputs(B, H, state_dtype, seed=0, conv_layout="sd"):
    """FlashInfer's test recipe (docs/serving.md §5): padded x rows, page-strided caches, strided beta / gate views.
    ``conv_layout``: "sd" (channel-contiguous columns) or "ds" (each channel's 3 columns contiguous, vLLM's)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    HK = H * D
    C = 3 * HK
    slots = B + 1

    def randn(*shape, dtype=torch.float32, scale=1.0):
        return (scale * torch.randn(shape, generator=gen, device="cuda")).to(dtype)

    elem = torch.empty((), dtype=state_dtype).element_size()
    page = C * 3 * 2 + H * D * D * elem
    conv_strides = (page // 2, 1, C) if conv_layout == "sd" else (page // 2, 3, 1)
    conv = torch.empty_strided((slots, C, 3), conv_strides, dtype=torch.bfloat16, device="cuda")
    conv.copy_(randn(slots, C, 3, dtype=torch.bfloat16, scale=0.1))
    state = torch.empty_strided((slots, H, D, D), (page // elem, D * D, D, 1), dtype=state_dtype, device="cuda")
    state.copy_(randn(slots, H, D, D, dtype=state_dtype, scale=0.01))
    return dict(
        x=randn(B, C + 17, dtype=torch.bfloat16)[:, :C], weight=randn(3, 4, HK, scale=0.1), conv_state=conv,
        raw_gate=randn(1, B, H, D, dtype=torch.bfloat16), raw_beta=randn(1, B, H + 1, dtype=torch.bfloat16)[..., :H],
        A_log=randn(H, scale=0.5), dt_bias=randn(HK, scale=0.1),
        state_indices=torch.arange(B, 0, -1, dtype=torch.int32, device="cuda"), state=state,
        output_gate=randn(B, HK + 7, dtype=torch.bfloat16).as_strided((B, H, D), (HK + 7, D, 1)),
        norm_weight=randn(D),
    )


def layer_bytes(x) -> int:
    """Bytes one step of the layer must move: states and conv columns read + written, activations once."""
    B, C = x["x"].shape
    H = x["A_log"].numel()
    state = 2 * B * H * D * D * x["state"].element_size()
    conv = 2 * B * C * 3 * 2
    activations = B * (C + 3 * H * D + H) * 2  # x, raw_gate, output_gate, output (bf16), raw_beta
    return state + conv + activations + x["weight"].numel() * 4


def fused_fn(x, out, config=None):
    from kda_cute.fused_decode import fused_kda_decode

    def call():
        fused_kda_decode(**x, lower_bound=LOWER_BOUND, norm_eps=NORM_EPS, output=out, config=config)

    return call


def t1_fn(x, mixed, out):
    """kda's T=1 kernel alone on the layer's pool (its q|k|v rows: ``mixed``)."""
    from kda_cute import kda_decode_t1_packed

    H = x["A_log"].numel()
    gate = x["raw_gate"][0].reshape(-1, H * D)
    beta = x["raw_beta"][0]

    def call():
        kda_decode_t1_packed(mixed, gate, beta, x["state"], x["state_indices"], num_heads=H, A_log=x["A_log"],
                             dt_bias=x["dt_bias"], lower_bound=LOWER_BOUND, output=out)

    return call


def unfused_fn(x, use_fla):
    """The conv update + SiLU, the T=1 kernel, the gated RMSNorm as three launches (four or more with torch ops).
    Returns (call, output [B, H, 128], implementation name)."""
    from kda_cute import kda_decode_t1_packed

    B, C = x["x"].shape
    H = x["A_log"].numel()
    taps = x["weight"].permute(0, 2, 1).reshape(C, 4).contiguous()  # [C, 4], tap 0 the oldest column
    gate = x["raw_gate"][0].reshape(B, H * D)
    beta = x["raw_beta"][0]
    og = x["output_gate"].contiguous()  # the norm kernels read a compact gate (copied once, not timed)
    o = torch.empty(B, 1, H, D, dtype=torch.bfloat16, device="cuda")
    impl = "torch"
    if use_fla:
        try:
            from fla.modules.causal_conv1d import causal_conv1d_update
            from fla.modules.norm.fused_norm_gate import rms_norm_gated
            impl = "fla"
        except ImportError as err:
            print(f"FLA unavailable ({err}); the unfused pipeline uses torch ops")
    cache = torch.zeros(B, C, 4, dtype=torch.bfloat16, device="cuda")  # FLA's dense cache: 4 columns, one per row
    cache[:, :, 1:] = x["conv_state"][1 : B + 1].flip(0)  # the rows' histories (slots B..1), as the fused call sees
    out = {}

    def call():
        with torch.no_grad():
            if impl == "fla":
                mixed, _ = causal_conv1d_update(x["x"], cache, weight=taps, activation="silu")
            else:
                window = torch.cat((cache[:, :, 1:], x["x"][:, :, None]), dim=2)  # FLA's rule: read 1..3, keep 4
                cache.copy_(window)
                mixed = torch.nn.functional.silu((window.float() * taps).sum(-1)).to(torch.bfloat16)
            kda_decode_t1_packed(mixed, gate, beta, x["state"], x["state_indices"], num_heads=H, A_log=x["A_log"],
                                 dt_bias=x["dt_bias"], lower_bound=LOWER_BOUND, output=o)
            if impl == "fla":
                out["y"] = rms_norm_gated(o.view(B, H, D), og, x["norm_weight"], None, activation="sigmoid",
                                          eps=NORM_EPS)
            else:
                of = o.view(B, H, D).float()
                y = of * torch.rsqrt(of.square().mean(-1, keepdim=True) + NORM_EPS) * x["norm_weight"]
                out["y"] = (y * torch.sigmoid(og.float())).to(torch.bfloat16)

    return call, out, impl


def _clone(t):
    c = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    c.copy_(t)
    return c


def check_correctness(x, config):
    """The fused kernel vs the reference on copies of both caches (FlashInfer's tolerances); raises on mismatch.
    Returns (output error, state error)."""
    from kda_core.oracle_fused import fused_kda_decode_ref

    conv, state = _clone(x["conv_state"]), _clone(x["state"])
    ref_conv, ref_state = _clone(conv), _clone(state)
    expected = fused_kda_decode_ref(**{**x, "conv_state": ref_conv, "state": ref_state}, lower_bound=LOWER_BOUND,
                                    norm_eps=NORM_EPS)
    out = torch.empty_like(expected)
    fused_fn({**x, "conv_state": conv, "state": state}, out, config)()
    torch.testing.assert_close(out, expected, rtol=3e-2, atol=2e-2)
    torch.testing.assert_close(conv, ref_conv, rtol=0, atol=0)
    torch.testing.assert_close(state, ref_state, rtol=3e-2, atol=2e-3)
    return ((out.float() - expected.float()).abs().max().item(),
            (state.float() - ref_state.float()).abs().max().item())


def main(argv=None):
    args = parse_args(argv)
    _baseline.require_cuda(NAME)
    run = _baseline.Run(NAME, args)
    from kda_cute import fused_decode

    timer = _timing.KernelTimer()
    run.provenance["timer"] = timer.backend
    records = []
    points = list(itertools.product(args.state_dtype, args.heads, args.batch_size))
    variants = list(itertools.product(args.bulk_ring, args.cluster))
    total = len(points) * len(variants)
    done = 0
    for dtype_name, H, B in points:
        sdt = DTYPES[dtype_name]
        x = make_inputs(B, H, sdt, seed=B + H, conv_layout=args.conv_layout)
        nbytes = layer_bytes(x)
        out = torch.empty(1, B, H, D, dtype=torch.bfloat16, device="cuda")
        t1_out = torch.empty(B, 1, H, D, dtype=torch.bfloat16, device="cuda")
        mixed = torch.randn(B, 3 * H * D, device="cuda").to(torch.bfloat16)
        unfused_call, unfused_out, impl = unfused_fn(x, not args.no_fla)
        baselines = {}
        for ring, cluster in variants:
            config = (None if ring < 0 and cluster < 0
                      else fused_decode.FusedDecodeConfig(bulk_ring=max(ring, 0), cluster=max(cluster, 1)))
            aligned = fused_decode.validate_fused_decode(**x, lower_bound=LOWER_BOUND, output=out).aligned
            cfg = (fused_decode.select_config(B, H, sdt, aligned) if config is None
                   else fused_decode.effective_config(config, sdt, aligned))  # what runs
            try:
                o_err, s_err = check_correctness(x, config)
            except AssertionError as err:  # reported, not timed; the sweep goes on
                print(f"{dtype_name} H={H} B={B} {cfg}: check failed: {err}", flush=True)
                records.append(dict(B=B, heads=H, state_dtype=dtype_name, config=str(cfg), check_failed=str(err)))
                continue
            calls = {"fused": fused_fn(x, out, config)}
            if not baselines:
                calls.update(t1=t1_fn(x, mixed, t1_out), unfused=unfused_call, copy=_timing.copy_roofline(nbytes))
            if args.mode == "cuda_graph":
                calls = {name: _timing.graph_of(fn) for name, fn in calls.items()}
            times, timers = {}, {}
            for name, fn in calls.items():
                times[name] = _timing.median(timer.time(fn, iterations=args.iterations, warmup=args.warmup))
                timers[name] = timer.last_backend
            baselines.update({k: v for k, v in times.items() if k != "fused"})
            times.update(baselines)
            rec = dict(B=B, heads=H, state_dtype=dtype_name, mode=args.mode, conv_layout=args.conv_layout,
                       bulk_ring=cfg.bulk_ring,
                       bulk_ring_forced=ring, cluster=cfg.cluster, cluster_forced=cluster,
                       rows_in_flight=cfg.rows_in_flight, cache_hint=cfg.cache_hint,
                       unfused_impl=impl, timer=timers, fused_us=times["fused"], t1_us=times["t1"],
                       unfused_us=times["unfused"], copy_us=times["copy"], layer_bytes=nbytes,
                       fused_TBps=nbytes / times["fused"] / 1e6, copy_TBps=nbytes / times["copy"] / 1e6,
                       check_out_err=o_err, check_state_err=s_err)
            rec["fused_over_unfused"] = times["fused"] / times["unfused"]
            rec["frac_of_copy"] = times["copy"] / times["fused"]
            records.append(rec)
            run.checkpoint(records)
            done += 1
            _baseline.progress(done, total, f"{dtype_name} H={H:2d} B={B:5d} ring={cfg.bulk_ring:2d} "
                               f"cluster={cfg.cluster}  "
                               f"fused {rec['fused_us']:8.2f} us ({rec['fused_TBps']:.2f} TB/s, "
                               f"{100 * rec['frac_of_copy']:.0f}% of copy)  t1 {rec['t1_us']:8.2f} us  "
                               f"unfused[{impl}] {rec['unfused_us']:8.2f} us  copy {rec['copy_us']:8.2f} us")
        del x, unfused_call, unfused_out
        torch.cuda.empty_cache()
    if run.json_path:
        run.save(records)
        timed = [r for r in records if "fused_us" in r]
        series = {"fused": "fused_us", "T=1 kernel alone": "t1_us", "unfused pipeline": "unfused_us",
                  "copy roofline": "copy_us"}
        run.plot([dict(records=[r for r in timed if r["state_dtype"] == name and r["heads"] == H], x="B",
                       series=series, title=f"{name} states, H={H}", ylabel="kernel time per call (us)")
                  for name, H in itertools.product(args.state_dtype, args.heads)],
                 title=f"Fused KDA decode layer (T=1), {args.mode}, {_timing.gpu_name()}")
    failed = [r for r in records if "check_failed" in r]
    if failed:
        raise SystemExit(f"{NAME}: {len(failed)} of {len(records)} points failed the oracle check (check_failed)")
    return records


if __name__ == "__main__":
    main()
