"""Multi-token fused KDA decode layer (spec decode) against the unfused pipeline, the generic kernel alone and the
copy roofline.

For each state dtype, head count, token count T and batch size B (B rows of T tokens each, heterogeneous
``num_accepted_tokens``, checkpoint slots from 1): build FlashInfer-style inputs (x rows of a padded GEMM output, a
paged conv cache [slots, C, T + 2] and state pool), check the fused kernel against kda-core's reference
``packed_fused_kda_decode_ref`` on copies of both caches, then time, with the same timer and in the same process:

- ``fused``: ``kda_cute.fused_spec.packed_fused_kda_decode`` (output given);
- ``generic``: the generic kernel's spec mode alone (``kda_cute.generic.kda_recurrent_fwd`` with ``[B, T]``
  checkpoint slots) on the same pool: the recurrence without the conv and the norm;
- ``unfused``: the pipeline without a fused op: the conv update over the T + 2 window + SiLU (torch ops: gather the
  history at each row's read column, unfold, taps, the cache rewrite), the generic kernel's spec mode on its output,
  a gated RMSNorm (FLA's ``rms_norm_gated`` when fla-core imports, else torch ops; the record says which). Its time
  is the sum of its kernels' times (CUPTI), launch gaps excluded;
- ``copy``: an elementwise copy of the bytes the layer must move (each state read once and written once per token,
  the conv cache's window columns, the activations once), the bandwidth ceiling.

Times are CUDA-graph replays (``--mode direct``: eager launches), warm L2. The defaults are the target shape
(T = 4, B = 64, H = 12) with a small sweep around it; ``--rows-per-pass`` and ``--min-ctas`` (each -1 = the
schedule's) sweep ``FusedSpecConfig``, every pair at every point.

    python benchmarks/bench_fused_spec.py                                                   # the baseline
    python benchmarks/bench_fused_spec.py --t 4 --batch-size 64 --heads 12 --rows-per-pass 1 2 4 --min-ctas 0 5 6 \
        --out /tmp/s.json
"""

from __future__ import annotations

import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _baseline  # noqa: E402  (first: puts the repository's packages on sys.path)
import _timing  # noqa: E402

NAME = "fused_kda_decode_spec"

D = 128
LOWER_BOUND = -5.0
NORM_EPS = 1e-5
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv=None):
    p = _baseline.parser(__doc__)
    p.add_argument("--batch-size", type=int, nargs="+", default=[8, 64, 256])
    p.add_argument("--heads", type=int, nargs="+", default=[12])
    p.add_argument("--t", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--state-dtype", choices=sorted(DTYPES), nargs="+", default=["bf16", "fp32"])
    p.add_argument("--mode", choices=["direct", "cuda_graph"], default="cuda_graph")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iterations", type=int, default=100)
    p.add_argument("--rows-per-pass", type=int, nargs="+", default=[-1], choices=[-1, 1, 2, 4],
                   help="-1 = the schedule's; several make a sweep")
    p.add_argument("--min-ctas", type=int, nargs="+", default=[-1], choices=[-1, 0, 2, 3, 4, 5, 6, 8],
                   help="-1 = the schedule's, 0 = ptxas's register count, n = n resident CTAs per SM; several sweep")
    p.add_argument("--no-fla", action="store_true", help="the unfused norm with torch ops instead of FLA's")
    _baseline.add_output_args(p)
    return p.parse_args(argv)


def make_inputs(B, T, H, state_dtype, seed=0):
    """B rows of T tokens; slots 1 .. B*T shuffled (slot 0 is the reserved null slot); nat cycles through 1..T."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    HK = H * D
    C = 3 * HK
    n_tok = B * T
    slots = B * T + 1
    W = T + 2

    def randn(*shape, dtype=torch.float32, scale=1.0):
        return (scale * torch.randn(shape, generator=gen, device="cuda")).to(dtype)

    conv_page = C * W + 24
    conv = torch.empty(slots * conv_page, dtype=torch.bfloat16, device="cuda").as_strided((slots, C, W),
                                                                                          (conv_page, 1, C))
    conv.copy_(randn(slots, C, W, dtype=torch.bfloat16, scale=0.1))
    state = randn(slots, H, D, D, dtype=state_dtype, scale=0.01)
    idx = (torch.randperm(B * T, generator=gen, device="cuda") + 1).to(torch.int32).view(B, T)
    return dict(
        x=randn(n_tok, C + 17, dtype=torch.bfloat16)[:, :C], weight=randn(3, 4, HK, scale=0.1), conv_state=conv,
        raw_gate=randn(1, n_tok, H, D, dtype=torch.bfloat16),
        raw_beta=randn(1, n_tok, H + 1, dtype=torch.bfloat16)[..., :H], A_log=randn(H, scale=0.5),
        dt_bias=randn(HK, scale=0.1), state_indices=idx, state=state,
        output_gate=randn(n_tok, HK + 7, dtype=torch.bfloat16).as_strided((n_tok, H, D), (HK + 7, D, 1)),
        norm_weight=randn(D),
        query_start_loc=torch.arange(0, n_tok + 1, T, dtype=torch.int32, device="cuda"),
        num_accepted_tokens=(torch.arange(B, dtype=torch.int32, device="cuda") % T) + 1,
    )


def layer_bytes(x) -> int:
    """Bytes one step must move: each state read once and written per token, the conv window columns read (3) and
    written (T + 2), the activations once."""
    B, T = x["state_indices"].shape
    n_tok, C = x["x"].shape
    H = x["A_log"].numel()
    state = B * (1 + T) * H * D * D * x["state"].element_size()
    conv = B * C * (3 + T + 2) * 2
    activations = n_tok * (C + 3 * H * D + H) * 2  # x, raw_gate, output_gate, output (bf16), raw_beta
    return state + conv + activations + x["weight"].numel() * 4


def fused_fn(x, out, config=None):
    from kda_cute.fused_spec import packed_fused_kda_decode

    def call():
        packed_fused_kda_decode(**x, lower_bound=LOWER_BOUND, norm_eps=NORM_EPS, output=out, config=config)

    return call


def _generic_call(x, mixed, o, B, T, H):
    from kda_core.contracts import NullSlotPolicy
    from kda_cute.generic import kda_recurrent_fwd

    parts = mixed.view(B, T, 3, H, D)
    gate = x["raw_gate"][0].view(B, T, H, D)
    beta = x["raw_beta"][0].contiguous().view(B, T, H)  # the unfused path reads a compact beta (copied once)

    def call():
        kda_recurrent_fwd(parts[:, :, 0], parts[:, :, 1], parts[:, :, 2], gate, beta, A_log=x["A_log"],
                          dt_bias=x["dt_bias"], initial_state=x["state"], use_qk_l2norm_in_kernel=True,
                          use_gate_in_kernel=True, lower_bound=LOWER_BOUND, beta_is_logit=True,
                          ssm_state_indices=x["state_indices"], num_accepted_tokens=x["num_accepted_tokens"],
                          output=o, null_policy=NullSlotPolicy.NONPOSITIVE)

    return call


def generic_fn(x):
    """The generic kernel's spec mode alone on the layer's pool (random q|k|v rows)."""
    B, T = x["state_indices"].shape
    H = x["A_log"].numel()
    mixed = torch.randn(B * T, 3 * H * D, device="cuda").to(torch.bfloat16)
    o = torch.empty(B, T, H, D, dtype=torch.bfloat16, device="cuda")
    return _generic_call(x, mixed, o, B, T, H)


def unfused_fn(x, use_fla):
    """The conv update over the window + SiLU (torch ops), the generic spec kernel, the gated RMSNorm. Returns
    (call, implementation name of the norm)."""
    B, T = x["state_indices"].shape
    n_tok, C = x["x"].shape
    H = x["A_log"].numel()
    taps = x["weight"].permute(0, 2, 1).reshape(C, 4).contiguous()  # [C, 4], tap 0 the oldest column
    og = x["output_gate"].contiguous()
    o = torch.empty(B, T, H, D, dtype=torch.bfloat16, device="cuda")
    mixed = torch.empty(n_tok, C, dtype=torch.bfloat16, device="cuda")
    conv_slot = x["state_indices"][:, 0].long()
    cols = ((x["num_accepted_tokens"].long().clamp(1, T) - 1)[:, None] + torch.arange(3, device="cuda"))  # [B, 3]
    recurrence = _generic_call(x, mixed, o, B, T, H)
    impl = "torch"
    if use_fla:
        try:
            from fla.modules.norm.fused_norm_gate import rms_norm_gated
            impl = "fla"
        except ImportError as err:
            print(f"FLA unavailable ({err}); the unfused norm uses torch ops")

    def call():
        with torch.no_grad():
            cache = x["conv_state"]
            rows = cache[conv_slot]  # [B, C, W]
            hist = torch.gather(rows, 2, cols[:, None, :].expand(B, C, 3))
            xt = x["x"].view(B, T, C).transpose(1, 2)  # [B, C, T]
            window = torch.cat((hist, xt), dim=2).float()  # [B, C, T + 3]
            acc = (window.unfold(2, 4, 1) * taps[None, :, None, :]).sum(-1)  # [B, C, T]
            mixed.view(B, T, C).copy_(torch.nn.functional.silu(acc).transpose(1, 2))
            new = torch.cat((hist[:, :, 1:], xt), dim=2)  # [B, C, T + 2]
            cache[conv_slot] = new
            recurrence()
            ov = o.view(n_tok, H, D)
            if impl == "fla":
                rms_norm_gated(ov, og, x["norm_weight"], None, activation="sigmoid", eps=NORM_EPS)
            else:
                of = ov.float()
                y = of * torch.rsqrt(of.square().mean(-1, keepdim=True) + NORM_EPS) * x["norm_weight"]
                (y * torch.sigmoid(og.float())).to(torch.bfloat16)

    return call, impl


def _clone(t):
    c = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    c.copy_(t)
    return c


def check_correctness(x, config):
    """The fused kernel vs the reference on copies of both caches (FlashInfer's tolerances); raises on mismatch.
    Returns (output error, state error)."""
    from kda_core.oracle_fused import packed_fused_kda_decode_ref

    conv, state = _clone(x["conv_state"]), _clone(x["state"])
    ref_conv, ref_state = _clone(conv), _clone(state)
    expected = packed_fused_kda_decode_ref(**{**x, "conv_state": ref_conv, "state": ref_state},
                                           lower_bound=LOWER_BOUND, norm_eps=NORM_EPS)
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
    from kda_cute import fused_spec

    timer = _timing.KernelTimer()
    run.provenance["timer"] = timer.backend
    records = []
    points = list(itertools.product(args.state_dtype, args.heads, args.t, args.batch_size))
    variants = list(itertools.product(args.rows_per_pass, args.min_ctas))
    total = len(points) * len(variants)
    done = 0
    for dtype_name, H, T, B in points:
        sdt = DTYPES[dtype_name]
        x = make_inputs(B, T, H, sdt, seed=B + H + T)
        nbytes = layer_bytes(x)
        out = torch.empty(1, B * T, H, D, dtype=torch.bfloat16, device="cuda")
        unfused_call, impl = unfused_fn(x, not args.no_fla)
        baselines = {}
        for rpp, mc in variants:
            default = fused_spec.select_config(B, H, T, sdt)
            config = None if rpp < 0 and mc < 0 else fused_spec.FusedSpecConfig(
                rows_per_pass=default.rows_per_pass if rpp < 0 else rpp, min_ctas=default.min_ctas if mc < 0 else mc)
            cfg = default if config is None else config
            try:
                o_err, s_err = check_correctness(x, config)
            except AssertionError as err:  # reported, not timed; the sweep goes on
                print(f"{dtype_name} H={H} T={T} B={B} {cfg}: check failed: {err}", flush=True)
                records.append(dict(B=B, T=T, heads=H, state_dtype=dtype_name, config=str(cfg),
                                    check_failed=str(err)))
                continue
            calls = {"fused": fused_fn(x, out, config)}
            if not baselines:
                calls.update(generic=generic_fn(x), unfused=unfused_call, copy=_timing.copy_roofline(nbytes))
            if args.mode == "cuda_graph":
                calls = {name: _timing.graph_of(fn) for name, fn in calls.items()}
            times, timers = {}, {}
            for name, fn in calls.items():
                times[name] = _timing.median(timer.time(fn, iterations=args.iterations, warmup=args.warmup))
                timers[name] = timer.last_backend
            baselines.update({k: v for k, v in times.items() if k != "fused"})
            times.update(baselines)
            rec = dict(B=B, T=T, heads=H, state_dtype=dtype_name, mode=args.mode, rows_per_pass=cfg.rows_per_pass,
                       rows_per_pass_forced=rpp, min_ctas=cfg.min_ctas, min_ctas_forced=mc,
                       cache_hint=cfg.cache_hint, unfused_norm_impl=impl, timer=timers,
                       fused_us=times["fused"], generic_us=times["generic"], unfused_us=times["unfused"],
                       copy_us=times["copy"], layer_bytes=nbytes, fused_TBps=nbytes / times["fused"] / 1e6,
                       copy_TBps=nbytes / times["copy"] / 1e6, check_out_err=o_err, check_state_err=s_err)
            rec["fused_over_unfused"] = times["fused"] / times["unfused"]
            rec["frac_of_copy"] = times["copy"] / times["fused"]
            records.append(rec)
            run.checkpoint(records)
            done += 1
            _baseline.progress(done, total, f"{dtype_name} H={H:2d} T={T:2d} B={B:5d} rpp={cfg.rows_per_pass} "
                               f"min_ctas={cfg.min_ctas}  "
                               f"fused {rec['fused_us']:8.2f} us ({rec['fused_TBps']:.2f} TB/s, "
                               f"{100 * rec['frac_of_copy']:.0f}% of copy, {rec['fused_over_unfused']:.2f}x unfused)"
                               f"  generic {rec['generic_us']:8.2f} us  unfused[{impl}] {rec['unfused_us']:8.2f} us"
                               f"  copy {rec['copy_us']:8.2f} us")
        del x, unfused_call
        torch.cuda.empty_cache()
    if run.json_path:
        run.save(records)
        timed = [r for r in records if "fused_us" in r]
        series = {"fused": "fused_us", "generic spec kernel alone": "generic_us", "unfused pipeline": "unfused_us",
                  "copy roofline": "copy_us"}
        run.plot([dict(records=[r for r in timed if r["state_dtype"] == name and r["heads"] == H and r["T"] == T],
                       x="B", series=series, title=f"{name} states, H={H}, T={T}",
                       ylabel="kernel time per call (us)")
                  for name, H, T in itertools.product(args.state_dtype, args.heads, args.t)],
                 title=f"Fused KDA decode layer, multi-token, {args.mode}, {_timing.gpu_name()}")
    failed = [r for r in records if "check_failed" in r]
    if failed:
        raise SystemExit(f"{NAME}: {len(failed)} of {len(records)} points failed the oracle check (check_failed)")
    return records


if __name__ == "__main__":
    main()
