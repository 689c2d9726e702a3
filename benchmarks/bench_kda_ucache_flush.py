"""The ucache verify+flush kernel against FLA's per-token-checkpoint spec decode and the copy roofline, in one process.

For each (T, w_ring), batch size and fold rate: build a pool and rings whose live windows hold P rows per request
(rows picked to fold get P = flush_min, the others P uniform in [0, flush_min) or, with ``--verify-hist max``,
flush_min - 1), check the kernel against the kda-core oracle (B <= ``--check-max-batch``), then time on CUDA-graph
replay, with the same timer: ours (``kda_delta_rule_mtp_ucache_flush``, ``w_ring`` passed explicitly), FLA
``fused_recurrent_kda_fwd`` with 2-D ``ssm_state_indices`` [B, T] and ``num_accepted_tokens`` (one state write per
draft token) for the same T and B, and a device-to-device copy of the bytes our kernel must move.

``--fla-form`` picks FLA's call forms (``FLA_FORMS``; FLA's time does not depend on the fold rate, so it is timed
once per T and B): ``bf16``, our pool's form, V-first [.., V, K] bf16 states with [B, T] inputs (``fla_spec_us``);
``fp32``, the same with fp32 per-token states (``fla_spec_fp32_us``: 2x the state bytes); ``kfirst``, FLA's default
state layout [.., K, V] (bf16) with the inputs flattened and ``cu_seqlens``, as vLLM passes them
(``fla_spec_kfirst_us``): the form whose times matched docs/design.md §7's FLA figures (169 / 1410 us at T=8,
B=64 / 512; 90 / 740 at T=4) within 1% on the H200.

The defaults are the baseline (T = 8, 4 x w_ring = 16, 32, H=12, B = 1 .. 512, fold rates 0 .. 100%, the three FLA
forms), written with its provenance to benchmarks/baselines/<gpu>/kda_ucache_flush.{json,png}; about two minutes on
an H200.

    python benchmarks/bench_kda_ucache_flush.py                                           # the baseline
    python benchmarks/bench_kda_ucache_flush.py --t 8 --w-ring 16 --batch-size 1 64 512 --fold-pct 0 100 \
        --out /tmp/ucache.json

Schedule sweeps (FLA off, fewer points): ``--tile-v 64 128`` forces the state rows per CTA and ``--min-blocks 3 4``
the resident-CTA floor asked of ptxas (0: ``kda_cute.ucache.MIN_CTAS_PER_SM`` of the tile); a forced point calls the
kernel's launcher with that ``kda_cute.ucache.UcacheConfig`` (``config=``), e.g.

    python benchmarks/bench_kda_ucache_flush.py --t 8 --w-ring 16 --batch-size 8 64 128 512 --fold-pct 0 100 \
        --no-fla --tile-v 128 --min-blocks 3 4 --iterations 50 --out /tmp/floors.json

``--restart-hist-on-flush 1`` adds the one-thread-per-row cursor restart kernel to every timed call (serving stacks
sharing one cursor set across layers run it once per step instead: the default 0 times the per-layer kernel).
"""

from __future__ import annotations

import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _baseline  # noqa: E402  (first: puts the repository's packages on sys.path)
import _timing  # noqa: E402

NAME = "kda_ucache_flush"
HEAD_DIM = 128
RING_SLOTS = 32
LOWER_BOUND = -5.0


def parse_args(argv=None):
    p = _baseline.parser(__doc__)
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256, 512])
    p.add_argument("--fold-pct", type=int, nargs="+", default=[0, 13, 25, 50, 100],
                   help="percent of requests whose ring is folded into the checkpoint this step")
    p.add_argument("--t", type=int, nargs="+", choices=[4, 8], default=[8, 4], help="draft tokens per request")
    p.add_argument("--w-ring", type=int, nargs="+", choices=[16, 32], default=[16, 32])
    p.add_argument("--flush-min", type=int, default=None, help="default: kda_core default_flush_min(T, w_ring)")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--verify-hist", choices=["uniform", "max"], default="uniform",
                   help="P of the rows that do not fold: uniform in [0, flush_min) or flush_min - 1")
    p.add_argument("--restart-hist-on-flush", type=int, choices=[0, 1], default=0)
    p.add_argument("--tile-v", type=int, nargs="+", choices=[0, 64, 128], default=[0],
                   help="state rows per CTA (0 = the schedule policy's); several values make a sweep")
    p.add_argument("--min-blocks", type=int, nargs="+", default=[0],
                   help="resident-CTA floors asked of ptxas with a forced tile (0 = the tile's MIN_CTAS_PER_SM; "
                        "without --tile-v, the schedule's tile is forced)")
    p.add_argument("--cold-l2", action="store_true", help="flush the L2 (256 MiB write) before every iteration")
    p.add_argument("--no-fla", action="store_true", help="skip FLA (e.g. fla-core missing)")
    p.add_argument("--fla-form", nargs="+", choices=list(FLA_FORMS), default=list(FLA_FORMS),
                   help="FLA's call forms (FLA_FORMS; bf16: our checkpoint pool's layout and dtype)")
    p.add_argument("--check-max-batch", type=int, default=64, help="oracle check for B up to this (0 = never)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iterations", type=int, default=100)
    _baseline.add_output_args(p)
    return p.parse_args(argv)


def make_step(B, T, H, w_ring, flush_min, fold_pct, verify_hist, seed=0):
    """Inputs of one verify step: a pool of B slots (permuted), rings with live windows, cursors."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    K = HEAD_DIM

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device="cuda") * scale

    n_fold = round(B * fold_pct / 100)
    fold = torch.zeros(B, dtype=torch.bool, device="cuda")
    fold[torch.randperm(B, generator=gen, device="cuda")[:n_fold]] = True
    if verify_hist == "max":
        verify_P = torch.full((B,), flush_min - 1, device="cuda")
    else:
        verify_P = torch.randint(0, flush_min, (B,), generator=gen, device="cuda")
    hist = torch.where(fold, torch.full_like(verify_P, flush_min), verify_P).to(torch.int32)
    base = torch.randint(0, RING_SLOTS, (B,), generator=gen, device="cuda").to(torch.int32)
    slots = torch.randperm(B, generator=gen, device="cuda").to(torch.int32)
    kk = randn(B, H, RING_SLOTS, K)
    # G must be a cumulative decay in LOGICAL order (row j at physical slot (base + j) & 31): a cumsum in physical
    # order makes G_{P-1} - G_j positive on wrapped windows, replay weights up to e^8, and outputs no real step sees.
    g_steps = -0.5 * torch.rand(B, H, RING_SLOTS, K, generator=gen, device="cuda")
    # The rings are indexed by POOL SLOT while the cursors are per request: request b's window lives in ring row
    # slots[b] and starts at base[b], so lay each request's cumulative decay out there.
    phys = ((base[:, None] + torch.arange(RING_SLOTS, device="cuda")[None, :]) % RING_SLOTS).long()
    g_by_request = torch.empty_like(g_steps).scatter_(2, phys[:, None, :, None].expand_as(g_steps), g_steps.cumsum(2))
    g_cache = torch.empty_like(g_by_request)
    g_cache[slots.long()] = g_by_request
    return dict(
        q=randn(B, T, H, K).bfloat16(), k=randn(B, T, H, K).bfloat16(), v=randn(B, T, H, K).bfloat16(),
        g=randn(B, T, H, K).bfloat16(), b=randn(B, T, H).bfloat16(),
        A_log=torch.log(torch.rand(H, generator=gen, device="cuda") * 15 + 1), dt_bias=randn(H * K, scale=0.5),
        pool=randn(B, H, K, K, scale=0.1).bfloat16(), slots=slots,
        # The ring contents only need to be finite and plausible (normalised k^, a decaying G in logical order).
        k_cache=(kk / kk.norm(dim=-1, keepdim=True)).bfloat16(), u_cache=randn(B, H, RING_SLOTS, K).bfloat16(),
        g_cache=g_cache, hist_len=hist, cache_base=base,
    )  # fmt: skip


def ours_fn(x, w_ring, flush_min, restart, out, config=None):
    """Ours: the public API, or with ``config`` (a kda_cute.ucache.UcacheConfig) the kernel's launcher itself on the
    same (well-formed) inputs."""
    from kda_recurrent.ucache import kda_delta_rule_mtp_ucache_flush

    if config is not None:
        from kda_cute.ucache import ucache_verify_flush

        def forced():
            ucache_verify_flush(
                x["A_log"], x["g"], x["dt_bias"], LOWER_BOUND, x["q"], x["k"], x["v"], x["b"], x["pool"],
                x["slots"], x["k_cache"], x["u_cache"], x["g_cache"], x["hist_len"], x["cache_base"], flush_min,
                w_ring, HEAD_DIM**-0.5, out, restart_hist_on_flush=restart, config=config,
            )  # fmt: skip

        return forced

    def call():
        kda_delta_rule_mtp_ucache_flush(
            x["A_log"], x["g"], x["dt_bias"], LOWER_BOUND, q=x["q"], k=x["k"], v=x["v"], b=x["b"],
            initial_state_source=x["pool"], initial_state_indices=x["slots"], k_cache=x["k_cache"],
            u_cache=x["u_cache"], g_cache=x["g_cache"], hist_len=x["hist_len"], cache_base=x["cache_base"],
            flush_min=flush_min, restart_hist_on_flush=restart, w_ring=w_ring, output=out,
        )  # fmt: skip

    return call


# --fla-form -> (FLA's state pool dtype, V-first states, flattened inputs with cu_seqlens, the record's time field,
# its speedup field). kfirst is FLA's default state layout.
FLA_FORMS = {
    "bf16": (torch.bfloat16, True, False, "fla_spec_us", "speedup_vs_fla"),
    "fp32": (torch.float32, True, False, "fla_spec_fp32_us", "speedup_vs_fla_fp32"),
    "kfirst": (torch.bfloat16, False, True, "fla_spec_kfirst_us", "speedup_vs_fla_kfirst"),
}


def fla_spec_fn(x, B, T, H, form="bf16"):
    """FLA's per-token checkpoints on the draft inputs ``x`` in call form ``form``: a pool of B*T states, permuted
    slots idx[b, t], accepted counts in [1, T]; the call reads slot idx[b, accepted-1] and writes a state after
    every draft token. Gate, beta's sigmoid and the q/k l2norm run inside FLA's kernel."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    state_dtype, v_first, varlen = FLA_FORMS[form][:3]
    gen = torch.Generator(device="cuda").manual_seed(B)
    pool = (torch.randn(B * T, H, HEAD_DIM, HEAD_DIM, generator=gen, device="cuda") * 0.1).to(state_dtype)
    idx = torch.randperm(B * T, generator=gen, device="cuda").to(torch.int32).view(B, T)
    accepted = torch.randint(1, T + 1, (B,), generator=gen, device="cuda").to(torch.int32)
    q, k, v, g, b = x["q"], x["k"], x["v"], x["g"], x["b"]
    cu = None
    if varlen:
        q, k, v, g, b = (t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, g, b))
        cu = torch.arange(0, B * T + 1, T, device="cuda", dtype=torch.long)
    out = torch.empty_like(v)

    def call():
        fused_recurrent_kda_fwd(
            q, k, v, g, b, A_log=x["A_log"], dt_bias=x["dt_bias"], initial_state=pool, inplace_final_state=True,
            state_v_first=v_first, cu_seqlens=cu, ssm_state_indices=idx, num_accepted_tokens=accepted,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
            lower_bound=LOWER_BOUND, out=out,
        )  # fmt: skip

    return call


def moved_bytes(x, T, flush_min):
    """DRAM bytes the verify step must move: checkpoints read (and written on folds), the live ring rows read,
    the appended rows written, the draft inputs read and the outputs written."""
    B, _, H, K = x["q"].shape
    P = x["hist_len"].long()
    state = H * K * K * 2
    ring_row = H * K * (2 + 2 + 4)  # k^ bf16, u bf16, G fp32
    folds = int((P >= flush_min).sum())
    per_step_io = B * T * H * K * 2 * 5 + B * T * H * 2  # q, k, v, g in; o out; beta
    return B * state + folds * state + int(P.sum()) * ring_row + B * T * ring_row + per_step_io


def check_correctness(x, T, w_ring, flush_min, config=None):
    """Ours vs the oracle on copies; raises on mismatch. Returns (output err, state err)."""
    from kda_core.oracle import ucache_verify_flush_ref

    mine = {n: t.clone() for n, t in x.items()}
    ref = {n: t.clone() for n, t in x.items()}
    out = torch.empty_like(x["v"])
    ours_fn(mine, w_ring, flush_min, True, out, config)()
    expected = ucache_verify_flush_ref(
        ref["A_log"], ref["g"], ref["dt_bias"], LOWER_BOUND, q=ref["q"], k=ref["k"], v=ref["v"], b=ref["b"],
        initial_state_source=ref["pool"], initial_state_indices=ref["slots"], k_cache=ref["k_cache"],
        u_cache=ref["u_cache"], g_cache=ref["g_cache"], hist_len=ref["hist_len"], cache_base=ref["cache_base"],
        flush_min=flush_min, restart_hist_on_flush=True, w_ring=w_ring, out_dtype=None,
    )  # fmt: skip
    o_err = (out.float() - expected).abs().max().item()
    s_err = (mine["pool"].float() - ref["pool"].float()).abs().max().item()
    r_err = max((mine[n].float() - ref[n].float()).abs().max().item() for n in ("k_cache", "u_cache", "g_cache"))
    cursors_ok = torch.equal(mine["hist_len"], ref["hist_len"]) and torch.equal(mine["cache_base"], ref["cache_base"])
    if o_err > 8e-3 + 8e-3 * expected.abs().max().item() or s_err > 2e-2 or r_err > 2e-2 or not cursors_ok:
        raise SystemExit(f"correctness check failed: output {o_err:.3e}, state {s_err:.3e}, rings {r_err:.3e}, "
                         f"cursors {'ok' if cursors_ok else 'WRONG'}")
    return o_err, s_err


def main(argv=None):
    args = parse_args(argv)
    _baseline.require_cuda(NAME)
    run = _baseline.Run(NAME, args)
    from kda_core.contracts import default_flush_min

    H = args.heads
    with_fla = not args.no_fla
    if with_fla:
        try:
            import fla.ops.kda.fused_recurrent  # noqa: F401
        except ImportError as err:
            print(f"FLA unavailable ({err}); timing ours and the copy only")
            with_fla = False
    timer = _timing.KernelTimer()
    run.provenance["timer"] = timer.backend
    flush = _timing.L2Flusher() if args.cold_l2 else None
    records = []

    from kda_cute.ucache import UcacheConfig, select_config

    schedules = list(itertools.product(args.tile_v, args.min_blocks))
    shapes = list(itertools.product(args.t, args.w_ring))
    total = len(shapes) * len(args.batch_size) * len(args.fold_pct) * len(schedules)
    done = 0
    fla_times = {}  # (T, B) -> {--fla-form: us}: FLA's cost depends on neither our fold rate nor our ring
    for (T, w_ring), B in itertools.product(shapes, args.batch_size):
        flush_min = args.flush_min or default_flush_min(T, w_ring)
        fla_us = fla_times.setdefault((T, B), {})
        for fold_pct in args.fold_pct:
            for tile_v, min_blocks in schedules:
                config = None  # the public API and the schedule policy
                if tile_v or min_blocks:
                    config = UcacheConfig(tile_v or select_config(B, H).tile_v, min_blocks)
                used = config or select_config(B, H)
                x = make_step(B, T, H, w_ring, flush_min, fold_pct, args.verify_hist, seed=B * 101 + fold_pct)
                check = None
                if B <= args.check_max_batch:
                    check = check_correctness(x, T, w_ring, flush_min, config)
                nbytes = moved_bytes(x, T, flush_min)
                out = torch.empty_like(x["v"])
                calls = {"ours": ours_fn(x, w_ring, flush_min, bool(args.restart_hist_on_flush), out, config),
                         "copy": _timing.copy_roofline(nbytes)}
                for form in args.fla_form if with_fla and not fla_us else ():
                    try:
                        fla_call = fla_spec_fn(x, B, T, H, form)
                        fla_call()  # a failing FLA build must not cost the rest of the sweep
                        calls[f"fla {form}"] = fla_call
                    except Exception as err:
                        print(f"FLA spec decode ({form}) failed ({type(err).__name__}: {err}); "
                              "no further FLA timing")
                        with_fla = False
                        break
                graphs = {name: _timing.graph_of(fn) for name, fn in calls.items()}
                times = {name: _timing.median(timer.time(fn, iterations=args.iterations, warmup=args.warmup,
                                                         flush=flush))
                         for name, fn in graphs.items()}
                fla_us.update({k.split()[1]: v for k, v in times.items() if k.startswith("fla ")})
                rec = dict(B=B, T=T, H=H, w_ring=w_ring, flush_min=flush_min, fold_pct=fold_pct, tile_v=used.tile_v,
                           min_ctas_asked=used.floor, tile_v_forced=tile_v, min_blocks_forced=min_blocks,
                           mean_hist_len=float(x["hist_len"].float().mean()), verify_hist=args.verify_hist,
                           restart_hist_on_flush=bool(args.restart_hist_on_flush), cold_l2=args.cold_l2,
                           ours_us=times["ours"], fla_spec_us=None,
                           copy_us=times["copy"], moved_bytes=nbytes, ours_TBps=nbytes / times["ours"] / 1e6,
                           copy_TBps=nbytes / times["copy"] / 1e6)  # fmt: skip
                if check is not None:
                    rec["check_out_err"], rec["check_state_err"] = check
                for form, us in fla_us.items():
                    us_field, speedup_field = FLA_FORMS[form][3:]
                    rec[us_field], rec[speedup_field] = us, us / times["ours"]
                records.append(rec)
                run.checkpoint(records)
                done += 1
                fla_txt = "".join(f"fla {k} {v:8.2f} us ({v / times['ours']:.1f}x)  " for k, v in fla_us.items())
                _baseline.progress(done, total, f"T={T} w={w_ring} B={B:4d} fold={fold_pct:3d}% tile {used.tile_v:3d} "
                                   f"floor {used.floor}{' (forced)' if config else ''}  "
                                   f"ours {times['ours']:8.2f} us ({rec['ours_TBps']:.2f} TB/s)  {fla_txt}"
                                   f"copy {times['copy']:8.2f} us")
                del x, graphs, calls
                torch.cuda.empty_cache()
    run.save(records)
    fla = {"FLA per-token, bf16 states": "fla_spec_us", "FLA per-token, fp32 states": "fla_spec_fp32_us",
           "FLA per-token, K-first bf16 (FLA's default layout)": "fla_spec_kfirst_us"}
    run.plot([dict(records=[r for r in records if (r["T"], r["w_ring"]) == shape], x="B",
                   series={"ours": "ours_us", "copy roofline": "copy_us", **fla}, group="fold_pct", shared=tuple(fla),
                   ylabel="kernel time per call (us, CUDA-graph replay)", title=f"T={shape[0]}, w_ring={shape[1]}")
              for shape in shapes],
             title=f"KDA ucache verify+flush, H={H}, {_timing.gpu_name()}")
    return records


if __name__ == "__main__":
    main()
