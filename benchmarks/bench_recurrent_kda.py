"""The ``recurrent_kda`` facade: host overhead, and the generic kernel against FLA (spec decode, prefill chunks).

Three parts, one process, one timer (``_timing.KernelTimer``: CUPTI kernel time when available, else CUDA events):

1. ``overhead``: eager host wall time per call at B=1, T=1 (H=12, bf16 pool, output given) of the whole facade
   call, of its parts (kda-core validation, the routing decision, the T=1 launch on the validated call), and of
   FLA's eager call for comparison. Targets: facade <= 15 us, routing <= 2 us.
2. ``spec``: speculative decode with per-token checkpoints (2-D ``ssm_state_indices`` + ``num_accepted_tokens``,
   bf16 pool), T = 4 and 8: ours (facade -> generic kernel) vs FLA ``fused_recurrent_kda_fwd`` vs a
   device-to-device copy of the same state bytes (read one checkpoint, write T). Target: ours <= 0.8x FLA at
   B >= 64.
3. ``prefill``: short prefill chunks, T = 16 and 64, dense fp32 initial states in, fp32 final states out.

Kernel times are CUDA-graph replays (warm L2 unless ``--cold-l2``). Every configuration is checked first: ours
against FLA, and against the kda-core oracle where the batch is small (B <= 8).

The defaults are the baseline (H=12; spec B = 1 .. 512, prefill B = 1, 8, 32), written with its provenance to
benchmarks/baselines/<gpu>/recurrent_kda.{json,png}; about two minutes on an H200.

    python benchmarks/bench_recurrent_kda.py                                            # the baseline
    python benchmarks/bench_recurrent_kda.py --parts spec --spec-batch 64 512 --out /tmp/spec.json

Schedule sweep of the generic kernel: ``--tile-v 8 16 32 64`` times each tile (``kda_cute.generic.GenericConfig``,
passed as ``config=`` to ``kda_recurrent_fwd`` on the facade-validated inputs; 0 = the facade, whose kernel takes the
schedule policy's tile) at every spec / prefill point; FLA and the copy are timed once per point, e.g.

    python benchmarks/bench_recurrent_kda.py --parts spec --spec-batch 1 8 16 64 512 --tile-v 8 16 32 64 --no-fla \
        --out /tmp/tiles.json
"""

from __future__ import annotations

import functools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _baseline  # noqa: E402  (first: puts the repository's packages on sys.path)
import _timing  # noqa: E402

NAME = "recurrent_kda"
K = 128
LOWER_BOUND = -5.0
ORACLE_MAX_B = 8  # the oracle loops over tokens in PyTorch: check it only where that is quick
# Largest difference, output or state, that passes the check against FLA and the oracle: an order of magnitude above
# the largest the H200 has shown (4e-3, bf16 spec decode at T=8 B=512); a broken kernel is off by far more.
CHECK_TOL = 5e-2


def parse_args(argv=None):
    p = _baseline.parser(__doc__)
    p.add_argument("--parts", nargs="+", choices=["overhead", "spec", "prefill"],
                   default=["overhead", "spec", "prefill"])
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--spec-t", type=int, nargs="+", default=[4, 8])
    p.add_argument("--spec-batch", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256, 512])
    p.add_argument("--prefill-t", type=int, nargs="+", default=[16, 64])
    p.add_argument("--prefill-batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--tile-v", type=int, nargs="+", choices=[0, 8, 16, 32, 64], default=[0],
                   help="generic kernel tiles to time (0 = the facade and the schedule policy's tile)")
    p.add_argument("--iterations", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--eager-calls", type=int, default=2000, help="calls per round of the host-overhead figures")
    p.add_argument("--cold-l2", action="store_true", help="flush the L2 before every timed iteration")
    p.add_argument("--no-fla", action="store_true", help="skip FLA (fla-core missing)")
    _baseline.add_output_args(p)
    return p.parse_args(argv)


def gate_inputs(H, gen):
    A_log = torch.log(torch.rand(H, generator=gen, device="cuda") * 15 + 1)
    dt_bias = torch.randn(H * K, generator=gen, device="cuda") * 0.5
    return A_log, dt_bias


def activations(B, T, H, gen):
    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)

    return dict(q=rnd(B, T, H, K), k=rnd(B, T, H, K), v=rnd(B, T, H, K), g=rnd(B, T, H, K), beta=rnd(B, T, H))


# ---------------------------------------------------------------------------------------------------------------
# 1. host overhead


def per_call_us(fn, calls):
    for _ in range(max(calls // 10, 10)):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def bench_overhead(args, timer, fla_fwd):
    from kda_core.call_args import RecurrentArgs
    from kda_recurrent import facade

    H = args.heads
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = activations(1, 1, H, gen)
    A_log, dt_bias = gate_inputs(H, gen)
    pool = torch.zeros(8, H, K, K, dtype=torch.bfloat16, device="cuda")
    slots = torch.tensor([3], dtype=torch.int32, device="cuda")
    out = torch.empty(1, 1, H, K, dtype=torch.bfloat16, device="cuda")
    kw = dict(A_log=A_log, dt_bias=dt_bias, initial_state=pool, use_gate_in_kernel=True, lower_bound=LOWER_BOUND,
              beta_is_logit=True, ssm_state_indices=slots, output=out)
    bundle = RecurrentArgs(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)  # what the facade hands its validators
    route = facade.explain(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)
    call = facade._validate(bundle)
    facade.recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)  # compile + module load
    t1 = facade._t1_kernel
    rec = dict(part="overhead", B=1, T=1, H=H, path=route.path.value, reason=route.reason)
    with timer.paused():
        rec["facade_us"] = _timing.eager_wall_us(
            lambda: facade.recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw), calls=args.eager_calls)
        # validate: the full validator (a call shape's first call); revalidate: what every later call of that shape
        # pays on the hot path (kda-core's re-validation; the compiled wrapper checks the rest).
        rec["validate_us"] = per_call_us(lambda: facade._validate(bundle), args.eager_calls)
        rec["revalidate_us"] = per_call_us(lambda: facade._revalidate(bundle), args.eager_calls)
        rec["route_us"] = per_call_us(lambda: facade._route(call), args.eager_calls * 10)
        if callable(t1):
            rec["t1_launch_us"] = _timing.eager_wall_us(
                lambda: t1(call, x["q"], x["k"], x["v"], x["g"], x["beta"], pool, slots, A_log, dt_bias, True, out),
                calls=args.eager_calls)
        if fla_fwd is not None:
            fla_kw = dict(A_log=A_log, dt_bias=dt_bias, initial_state=pool, inplace_final_state=True,
                          state_v_first=True, ssm_state_indices=slots, use_qk_l2norm_in_kernel=True,
                          use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=LOWER_BOUND, out=out)
            fla_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], **fla_kw)
            rec["fla_eager_us"] = _timing.eager_wall_us(
                lambda: fla_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], **fla_kw), calls=args.eager_calls // 4)
    rec["facade_target_met"] = rec["facade_us"] <= 15.0
    rec["route_target_met"] = rec["route_us"] <= 2.0
    _baseline.progress(1, 1, f"overhead: path={rec['path']} facade {rec['facade_us']:.1f} us (target 15), "
                       f"validate {rec['validate_us']:.1f} us (hot path: revalidate {rec['revalidate_us']:.1f} us), "
                       f"route {rec['route_us']:.2f} us (target 2), T=1 launch "
                       f"{rec.get('t1_launch_us', float('nan')):.1f} us, "
                       f"FLA eager {rec.get('fla_eager_us', float('nan')):.1f} us")
    return [rec]


# ---------------------------------------------------------------------------------------------------------------
# 2./3. kernels vs FLA


def max_err(a, b):
    return float((a.float() - b.float()).abs().max())


def time_graph(timer, fn, args, flusher):
    return _timing.median(timer.time(_timing.graph_of(fn), iterations=args.iterations, warmup=args.warmup,
                                     flush=flusher))


def spec_case(B, T, H, gen):
    x = activations(B, T, H, gen)
    A_log, dt_bias = gate_inputs(H, gen)
    N = B * T + 7
    pool = (torch.randn(N, H, K, K, generator=gen, device="cuda") * 0.1).to(torch.bfloat16)
    slots = torch.randperm(N, generator=gen, device="cuda")[: B * T].reshape(B, T).to(torch.int32)
    accepted = torch.randint(1, T + 1, (B,), generator=gen, device="cuda", dtype=torch.int32)
    kw = dict(A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True, lower_bound=LOWER_BOUND, beta_is_logit=True,
              ssm_state_indices=slots, num_accepted_tokens=accepted)
    fla_kw = dict(A_log=A_log, dt_bias=dt_bias, inplace_final_state=True, state_v_first=True,
                  ssm_state_indices=slots, num_accepted_tokens=accepted, use_qk_l2norm_in_kernel=True,
                  use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=LOWER_BOUND)
    state_bytes = B * H * (1 + T) * K * K * 2  # read one checkpoint, write T
    return x, pool, kw, fla_kw, state_bytes


def prefill_case(B, T, H, gen):
    x = activations(B, T, H, gen)
    A_log, dt_bias = gate_inputs(H, gen)
    h0 = torch.randn(B, H, K, K, generator=gen, device="cuda") * 0.1
    kw = dict(A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True, lower_bound=LOWER_BOUND, beta_is_logit=True,
              output_final_state=True)
    fla_kw = dict(A_log=A_log, dt_bias=dt_bias, output_final_state=True, inplace_final_state=False,
                  state_v_first=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                  use_beta_sigmoid_in_kernel=True, lower_bound=LOWER_BOUND)
    state_bytes = B * H * K * K * 4 * 2 + B * T * H * K * 2 * 5  # fp32 state in + out, bf16 q, k, v, g, o
    return x, h0, kw, fla_kw, state_bytes


def ours_fn(tile_v, qkvgb, kw):
    """Ours on the given inputs: the facade (tile_v 0), or the generic kernel with that tile forced (the inputs are
    the facade-validated ones, so the kernel's entry is called directly with ``config=``)."""
    from kda_recurrent import facade

    if not tile_v:
        return functools.partial(facade.recurrent_kda, *qkvgb, **kw)
    from kda_cute.generic import GenericConfig, kda_recurrent_fwd

    return functools.partial(kda_recurrent_fwd, *qkvgb, config=GenericConfig(tile_v), **kw)


def bench_kernels(part, args, timer, fla_fwd, flusher, keep):
    from kda_core.oracle import recurrent_kda_ref
    from kda_cute.generic import select_config
    from kda_recurrent import facade

    H = args.heads
    ts, batches = (args.spec_t, args.spec_batch) if part == "spec" else (args.prefill_t, args.prefill_batch)
    configs = [(T, B, tile) for T in ts for B in batches for tile in args.tile_v]
    records = []
    fla_us = {}  # (T, B) -> FLA's and the copy's times: they do not depend on our tile
    for i, (T, B, tile) in enumerate(configs, 1):
        gen = torch.Generator(device="cuda").manual_seed(1000 * T + B)
        build = spec_case if part == "spec" else prefill_case
        x, state, kw, fla_kw, nbytes = build(B, T, H, gen)
        qkvgb = (x["q"], x["k"], x["v"], x["g"], x["beta"])
        out = torch.empty(B, T, H, K, dtype=torch.bfloat16, device="cuda")
        rec = dict(part=part, T=T, B=B, H=H, tile_v=tile or select_config(B * H, K).tile_v, tile_v_forced=tile)
        rec["path"] = facade.explain(*qkvgb, initial_state=state, **kw).path.value
        if tile and rec["path"] != "generic":
            raise SystemExit(f"--tile-v {tile}: the {part} T={T} B={B} point takes the {rec['path']} path")

        # correctness on copies: ours vs FLA vs oracle
        ours_state = state.clone()
        o, ours_final = ours_fn(tile, qkvgb, dict(kw, initial_state=ours_state, output=out.clone()))()
        if part == "spec":
            ours_final = ours_state
        if fla_fwd is not None:
            fla_state = state.clone()
            o_fla, fla_final = fla_fwd(*qkvgb, initial_state=fla_state, **fla_kw)
            rec["max_err_vs_fla"] = max(max_err(o, o_fla), max_err(ours_final, fla_final))
        if B <= ORACLE_MAX_B:
            ref_state = state.clone()
            o_ref, ref_final = recurrent_kda_ref(*qkvgb, initial_state=ref_state, **kw)
            rec["max_err_vs_oracle"] = max(max_err(o, o_ref), max_err(ours_final, ref_final))
        worst = max(rec.get("max_err_vs_fla", 0.0), rec.get("max_err_vs_oracle", 0.0))
        if not worst <= CHECK_TOL:  # NaN fails too; the point is still timed and recorded
            rec["check_failed"] = f"max difference {worst:.3e} > {CHECK_TOL:g}"

        # timing: CUDA-graph replays on scratch state (spec: pool mutated in place each replay, like serving)
        work = state.clone()
        ours = ours_fn(tile, qkvgb, dict(kw, initial_state=work, output=out))
        rec["ours_us"] = time_graph(timer, ours, args, flusher)
        if (T, B) not in fla_us:
            times = fla_us[(T, B)] = {}
            if fla_fwd is not None:
                fla = functools.partial(fla_fwd, *qkvgb, initial_state=state.clone(), out=torch.empty_like(out),
                                        **fla_kw)
                times["fla_us"] = time_graph(timer, fla, args, flusher)
            times["copy_us"] = time_graph(timer, _timing.copy_roofline(nbytes), args, flusher)
        rec.update(fla_us[(T, B)])
        if "fla_us" in rec:
            rec["ours_over_fla"] = rec["ours_us"] / rec["fla_us"]
        rec["state_gb_per_s"] = nbytes / rec["ours_us"] / 1e3
        records.append(rec)
        keep(rec)
        del x, state, work, ours
        ratio = f"{rec['ours_over_fla']:.2f}x FLA" if "ours_over_fla" in rec else "no FLA"
        _baseline.progress(i, len(configs), f"{part} T={T:>2} B={B:>4} tile {rec['tile_v']:>2}"
                           f"{' (forced)' if tile else ''}: ours {rec['ours_us']:8.1f} us ({ratio}), "
                           f"copy {rec['copy_us']:7.1f} us, err vs FLA {rec.get('max_err_vs_fla', float('nan')):.2e}, "
                           f"vs oracle {rec.get('max_err_vs_oracle', float('nan')):.2e}, path {rec['path']}"
                           f"{'  CHECK FAILED' if 'check_failed' in rec else ''}")
    if part == "spec":
        big = [r for r in records if r["B"] >= 64 and r["T"] == 8 and "ours_over_fla" in r and not r["tile_v_forced"]]
        if big:
            worst = max(r["ours_over_fla"] for r in big)
            verdict = "met" if worst <= 0.8 else "MISSED"
            print(f"spec T=8 B>=64: worst ours/FLA = {worst:.2f} (target <= 0.80): {verdict}")
    return records


def main(argv=None):
    args = parse_args(argv)
    _baseline.require_cuda(NAME)
    run = _baseline.Run(NAME, args)
    fla_fwd = None
    if not args.no_fla:
        try:
            from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla_fwd
        except ImportError as err:
            print(f"FLA not importable ({err}): timing ours and the copy only")
    timer = _timing.KernelTimer()
    run.provenance["timer"] = timer.backend
    flusher = _timing.L2Flusher() if args.cold_l2 else None
    records = []

    def keep(rec):  # after every point: a run cut short keeps what it measured
        records.append(rec)
        run.checkpoint(records)

    panels = []
    if "overhead" in args.parts:
        for rec in bench_overhead(args, timer, fla_fwd):
            keep(rec)
            bars = {"facade call": "facade_us", "validation (first call)": "validate_us",
                    "re-validation (hot path)": "revalidate_us", "routing": "route_us",
                    "T=1 launch (validated)": "t1_launch_us", "FLA eager call": "fla_eager_us"}
            panels.append(dict(bars={label: rec[key] for label, key in bars.items() if key in rec},
                               ylabel="host wall time per call (us)", target=15.0,
                               title=f"overhead: B=1, T=1, path {rec['path']}"))
    series = {"ours (facade)": "ours_us", "FLA": "fla_us", "copy roofline": "copy_us"}
    for part in ("spec", "prefill"):
        if part in args.parts:
            part_records = bench_kernels(part, args, timer, fla_fwd, flusher, keep)
            if len(args.tile_v) == 1:
                panels.append(dict(records=part_records, x="B", series=series, group="T",
                                   ylabel="kernel time per call (us)", title=part))
            else:  # a tile sweep: one panel per T, one line per tile
                for T in sorted({r["T"] for r in part_records}):
                    panels.append(dict(records=[r for r in part_records if r["T"] == T], x="B",
                                       series={"ours": "ours_us", "FLA": "fla_us"}, group="tile_v_forced",
                                       shared=("FLA",), ylabel="kernel time per call (us)",
                                       title=f"{part} T={T}, by forced tile (0 = schedule)"))
    run.save(records)
    run.plot(panels, title=f"recurrent_kda, H={args.heads}, K=V=128, {_timing.gpu_name()}")
    failed = [r for r in records if "check_failed" in r]
    if failed:
        print(f"{NAME}: {len(failed)} of {len(records)} points failed the check against FLA / the oracle "
              "(check_failed in the JSON)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
