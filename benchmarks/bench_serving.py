"""The engine adapters in their engines' call forms: adapter vs kda's bare kernel vs FLA vs the copy roofline.

For each engine form (docs/serving.md §1, §2, §4), state dtype, head count H and batch size B, every row live on
distinct slots of a pool of B + 1 slots (slot 0 unused, so every form reads the same rows), in the engine's own layout:

- ``vllm_k3``: ``kda_recurrent.compat.vllm.kimi_k3.fused_recurrent_kda_packed_decode`` (null slot 0): ``mixed_qkv``
  rows of a ``[B, 3HD + 1]`` buffer, raw gate and beta logits, lower bound -5, the pool's slot stride the row + 17
  elements (vLLM's test pool), the slot indices a stride-8 column of a block table;
- ``vllm_kimi_linear``: ``kda_recurrent.compat.vllm.kimi_linear.fused_recurrent_kda`` on ``[1, B, H, D]`` +
  ``cu_seqlens`` (one token per sequence), fp32 log decay and sigmoided beta precomputed, the same pool and index
  layout, ``out`` given (the layer passes none; the vendored op takes one);
- ``sglang``: ``kda_recurrent.compat.sglang.fused_recurrent_kda_packed_decode`` (null -1): contiguous packed rows,
  raw gate (softplus, no lower bound), beta logits, a contiguous pool and index tensor, ``out`` given.

Timed on the same buffers, in one process with one timer (``_timing.KernelTimer``), all CUDA-graph replays (warm L2):
the adapter; kda's bare kernel (``kda_cute.decode_t1.kda_decode_t1_packed`` for the packed forms, the plain T=1
``kda_decode_t1`` on ``[B, 1, H, D]`` views of the same tensors for the Kimi-Linear form, with the engine's null
policy); FLA 0.6.0's ``fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd`` in place on a copy of the pool with the
same slot indices, stride and ``cu_seqlens`` (FLA indexes activations as contiguous tensors: it gets contiguous
copies, not timed; it has no packed or null-slot form, and every row is live); a device-to-device copy of the B
states (read + write), the bandwidth ceiling. Records carry ``adapter_over_bare``, ``adapter_over_fla``,
``varlen_over_plain`` (Kimi-Linear: the ``[1, N]`` + ``cu_seqlens`` call over the plain T=1 kernel) and
``pct_of_copy`` (copy time / adapter time, in percent; the figure to read at B >= 256 with fp32 states).

Layout variants (``variant`` records) isolate what each part of the engines' layouts costs on the bare packed
kernel (vLLM K3 inputs), each against ``default`` (contiguous pool and int32 indices, out-of-range policy):
``nonpositive`` (vLLM's null policy), ``strided_idx`` (a stride-8 index column), ``slot_pad17`` (slot stride
row + 17: the unaligned variant), ``vllm`` (all three). To keep the run short they use a subset grid,
``--variant-batch-size`` (default 1, 64, 512) x ``--variant-heads`` (default 12) x both state dtypes.

Eager host cost: each adapter at B=1 (``out`` given), the median over rounds of back-to-back
calls (``_timing.eager_wall_us``), with the bare kernel's for comparison, once per (engine, H, dtype).

Before timing, every point checks the adapter against the kda-core oracle (B <= ``--check-max-batch``) and FLA
against the adapter. The defaults are the baseline: B = 1 .. 512, H = 12, 24, 32, bf16 and fp32 states, written
with its provenance to benchmarks/baselines/<gpu>/serving.{json,png}; sized to stay under about 150 s on an H200
(not yet measured; most of it is compiling each kernel variant on first use).

    python benchmarks/bench_serving.py                                                  # the baseline
    python benchmarks/bench_serving.py --engine vllm_k3 --heads 12 --batch-size 256 512 --state-dtype fp32 \
        --no-variants --out /tmp/serving_k3.json
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _baseline  # noqa: E402  (first: puts the repository's packages on sys.path)
import _timing  # noqa: E402

NAME = "serving"
K = 128
LOWER_BOUND = -5.0
SLOT_PAD = 17
INDEX_STRIDE = 8
DEVICE = "cuda"  # the device of every buffer
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
ENGINES = ("vllm_k3", "vllm_kimi_linear", "sglang")
VARIANTS = {  # name: (slot pad, index stride, nonpositive policy)
    "default": (0, 1, False),
    "nonpositive": (0, 1, True),
    "strided_idx": (0, INDEX_STRIDE, False),
    "slot_pad17": (SLOT_PAD, 1, False),
    "vllm": (SLOT_PAD, INDEX_STRIDE, True),
}


def parse_args(argv=None):
    p = _baseline.parser(__doc__)
    p.add_argument("--engine", nargs="+", choices=ENGINES, default=list(ENGINES))
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256, 512])
    p.add_argument("--heads", type=int, nargs="+", default=[12, 24, 32])
    p.add_argument("--state-dtype", choices=sorted(DTYPES), nargs="+", default=["bf16", "fp32"])
    p.add_argument("--variant-batch-size", type=int, nargs="+", default=[1, 64, 512])
    p.add_argument("--variant-heads", type=int, nargs="+", default=[12])
    p.add_argument("--no-variants", action="store_true", help="skip the layout variants")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iterations", type=int, default=100)
    p.add_argument("--no-fla", action="store_true", help="skip FLA (e.g. fla-core missing)")
    p.add_argument("--eager-calls", type=int, default=200, help="calls a round for the host-cost figure (0 = skip)")
    p.add_argument("--check-max-batch", type=int, default=128, help="oracle check for B up to this (0 = never)")
    _baseline.add_output_args(p, resumable=True)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------------------------
# buffers


def _policy(nonpositive):
    from kda_core.contracts import NullSlotPolicy

    return NullSlotPolicy.NONPOSITIVE if nonpositive else NullSlotPolicy.OUT_OF_RANGE


def make_pool(B, H, dtype, pad, gen):
    """B + 1 slots, slot stride the row + ``pad`` elements, over one flat storage."""
    row = H * K * K
    flat = (torch.randn((B + 1) * (row + pad), generator=gen, device=DEVICE) * 0.1).to(dtype)
    return flat.as_strided((B + 1, H, K, K), (row + pad, K * K, K, 1))


def clone_pool(pool):
    """A copy of the pool with the same strides (its own storage, padding included)."""
    flat = pool.as_strided((pool.untyped_storage().nbytes() // pool.element_size(),), (1,), 0)
    return flat.clone().as_strided(pool.shape, pool.stride(), pool.storage_offset())


def make_indices(B, stride, gen):
    """B distinct slots in 1..B (live under both policies), as column 0 of a [B, stride] int32 table."""
    table = torch.zeros(B, stride, dtype=torch.int32, device=DEVICE)
    table[:, 0] = torch.randperm(B, generator=gen, device=DEVICE).to(torch.int32) + 1
    return table[:, 0]


def make_case(engine, B, H, dtype, seed=0, layout=None):
    """The buffers of one engine form. ``layout`` (pad, index stride, nonpositive) overrides the engine's own."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    HK = H * K

    def randn(*shape, scale=1.0, to=torch.bfloat16):
        return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(to)

    if layout is None:
        layout = (0, 1, False) if engine == "sglang" else (SLOT_PAD, INDEX_STRIDE, True)
    pad, idx_stride, nonpositive = layout
    x = dict(engine=engine, B=B, H=H, policy=_policy(nonpositive), pool=make_pool(B, H, dtype, pad, gen),
             slots=make_indices(B, idx_stride, gen))
    if engine == "vllm_k3":
        mixed_buf = randn(B, 3 * HK + 1)
        x.update(mixed=mixed_buf[:, : 3 * HK], raw_g=randn(1, B, H, K), raw_beta=randn(1, B, H),
                 A_log=randn(H, scale=0.5, to=torch.float32), dt_bias=randn(H, K, scale=0.1, to=torch.float32),
                 out=torch.empty(1, B, H, K, dtype=torch.bfloat16, device=DEVICE))
    elif engine == "sglang":
        x.update(mixed=randn(B, 3 * HK), a=randn(B, HK), b=randn(B, H),
                 A_log=randn(H, scale=0.5, to=torch.float32), dt_bias=randn(HK, scale=0.1, to=torch.float32),
                 out=torch.empty(B, 1, H, K, dtype=torch.bfloat16, device=DEVICE))
    else:
        x.update(q=randn(1, B, H, K), k=randn(1, B, H, K), v=randn(1, B, H, K),
                 g=torch.nn.functional.logsigmoid(randn(1, B, H, K, to=torch.float32) + 2.0),
                 beta=torch.rand(1, B, H, generator=gen, device=DEVICE),
                 cu=torch.arange(B + 1, dtype=torch.int32, device=DEVICE),
                 out=torch.empty(1, B, H, K, dtype=torch.bfloat16, device=DEVICE))
    return x


def activations(x):
    """q, k, v, g, beta [B, 1, H, K] views (kda's T=1 form) and the oracle's gate keywords."""
    from kda_core.oracle import unpack_packed

    B, H = x["B"], x["H"]
    if x["engine"] == "vllm_k3":
        views = unpack_packed(x["mixed"], x["raw_g"].view(B, H * K), x["raw_beta"].view(B, H), H, K)
        return views, dict(A_log=x["A_log"], dt_bias=x["dt_bias"].reshape(-1), use_gate_in_kernel=True,
                           lower_bound=LOWER_BOUND, beta_is_logit=True)
    if x["engine"] == "sglang":
        views = unpack_packed(x["mixed"], x["a"], x["b"], H, K)
        return views, dict(A_log=x["A_log"], dt_bias=x["dt_bias"], use_gate_in_kernel=True, lower_bound=None,
                           beta_is_logit=True)
    views = (x["q"].view(B, 1, H, K), x["k"].view(B, 1, H, K), x["v"].view(B, 1, H, K), x["g"].view(B, 1, H, K),
             x["beta"].view(B, 1, H))
    return views, dict(use_gate_in_kernel=False, beta_is_logit=False)


# ---------------------------------------------------------------------------------------------------------------
# the calls


def adapter_fn(x):
    """The engine's call form through kda's adapter; returns (call, output tensor [B, 1, H, K] view or None)."""
    B, H = x["B"], x["H"]
    if x["engine"] == "vllm_k3":
        from kda_recurrent.compat.vllm import kimi_k3

        def call():
            return kimi_k3.fused_recurrent_kda_packed_decode(x["mixed"], x["raw_g"], x["raw_beta"], x["A_log"],
                                                             x["dt_bias"], LOWER_BOUND, x["pool"], x["slots"],
                                                             out=x["out"])[0].view(B, 1, H, K)
    elif x["engine"] == "sglang":
        from kda_recurrent.compat import sglang

        def call():
            return sglang.fused_recurrent_kda_packed_decode(x["mixed"], x["a"], x["b"], x["A_log"], x["dt_bias"],
                                                            K ** -0.5, x["pool"], x["out"], x["slots"],
                                                            use_qk_l2norm_in_kernel=True, lower_bound=None)[0]
    else:
        from kda_recurrent.compat.vllm import kimi_linear

        def call():
            return kimi_linear.fused_recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["pool"],
                                                   inplace_final_state=True, use_qk_l2norm_in_kernel=True,
                                                   cu_seqlens=x["cu"], ssm_state_indices=x["slots"],
                                                   out=x["out"])[0].view(B, 1, H, K)
    return call


def bare_fn(x):
    """kda's kernel entry on the same buffers (no adapter): packed for the packed forms, plain T=1 otherwise."""
    from kda_cute import decode_t1

    B, H = x["B"], x["H"]
    if x["engine"] == "vllm_kimi_linear":
        (q, k, v, g, beta), _ = activations(x)

        def call():
            return decode_t1.kda_decode_t1(q, k, v, g, beta, x["pool"], x["slots"], use_gate_in_kernel=False,
                                           beta_is_logit=False, output=x["out"].view(B, 1, H, K),
                                           null_policy=x["policy"])
        return call
    raw_g, raw_beta = ((x["raw_g"].view(B, H * K), x["raw_beta"].view(B, H)) if x["engine"] == "vllm_k3"
                       else (x["a"], x["b"]))
    lb = LOWER_BOUND if x["engine"] == "vllm_k3" else None
    out = x["out"].view(B, 1, H, K)

    def call():
        return decode_t1.kda_decode_t1_packed(x["mixed"], raw_g, raw_beta, x["pool"], x["slots"], num_heads=H,
                                              A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=lb, output=out,
                                              null_policy=x["policy"])
    return call


def fla_fn(x, pool):
    """FLA's in-place decode on ``pool`` (a copy of the case's), contiguous activation copies; (call, out)."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    (q, k, v, g, beta), gate = activations(x)
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    out = torch.empty_like(v)
    varlen = x["engine"] == "vllm_kimi_linear"
    if varlen:  # the [1, N] + cu_seqlens form, as vLLM's Kimi-Linear layer calls FLA
        q, k, v, g, beta, out = (t.view(1, *t.shape[:1], *t.shape[2:]) for t in (q, k, v, g, beta, out))

    def call():
        return fused_recurrent_kda_fwd(q, k, v, g, beta, A_log=gate.get("A_log"), dt_bias=gate.get("dt_bias"),
                                       initial_state=pool, inplace_final_state=True, state_v_first=True,
                                       cu_seqlens=x["cu"] if varlen else None, ssm_state_indices=x["slots"],
                                       use_qk_l2norm_in_kernel=True, use_gate_in_kernel=gate["use_gate_in_kernel"],
                                       use_beta_sigmoid_in_kernel=gate["beta_is_logit"],
                                       lower_bound=gate.get("lower_bound"), out=out)

    return call, out.view(x["B"], 1, x["H"], K)


def check(x, adapter, with_oracle, fla=False):
    """The adapter against the oracle (on a copy of the pool) and the bare kernel; FLA against the adapter.
    Restores the pool. Returns (state err, output err, adapter output bitwise equal to the bare kernel's, FLA err)."""
    from kda_core.oracle import recurrent_kda_ref

    saved = clone_pool(x["pool"])
    live = x["slots"].long()
    s_err = o_err = None
    o = adapter().clone()
    if with_oracle:
        ref_pool = clone_pool(saved)
        views, gate = activations(x)
        o_ref, ref_pool = recurrent_kda_ref(*views, initial_state=ref_pool, use_qk_l2norm_in_kernel=True,
                                            ssm_state_indices=x["slots"], null_policy=x["policy"],
                                            scale=K ** -0.5, **gate)
        s_err = (x["pool"][live].float() - ref_pool[live].float()).abs().max().item()
        o_err = (o.float() - o_ref.float()).abs().max().item()
        s_scale = ref_pool[live].float().abs().max().item()
        s_tol = max(2e-2, s_scale / 64) if x["pool"].dtype == torch.bfloat16 else 1e-3 * max(1.0, s_scale)
        if s_err > s_tol or o_err > 2e-2 * o_ref.float().abs().max().item() + 1e-3:
            raise SystemExit(f"{x['engine']} B={x['B']} H={x['H']}: adapter vs oracle: state err {s_err:.3e}, "
                             f"output err {o_err:.3e}")
    after = clone_pool(x["pool"])
    x["pool"].copy_(saved)
    o_bare = bare_fn(x)().clone()
    bitwise = bool(torch.equal(o_bare, o)) and bool(torch.equal(x["pool"], after))
    x["pool"].copy_(saved)
    fla_err = None
    if fla:
        fla_pool = clone_pool(saved)
        call, fla_out = fla_fn(x, fla_pool)
        call()
        fla_err = max((fla_pool[live].float() - after[live].float()).abs().max().item(),
                      (fla_out.float() - o.float()).abs().max().item())
    return s_err, o_err, bitwise, fla_err


# ---------------------------------------------------------------------------------------------------------------
# the run


def time_calls(timer, calls, args):
    times, backends = {}, {}
    for name, fn in calls.items():
        replay = _timing.graph_of(fn)
        times[name] = _timing.median(timer.time(replay, iterations=args.iterations, warmup=args.warmup))
        backends[name] = timer.last_backend
        del replay
    return times, backends


def state_bytes(x):
    return 2 * x["B"] * x["pool"][0].numel() * x["pool"].element_size()  # the B states, read + write


def engine_point(x, dtype_name, args, timer, with_fla):
    B, H = x["B"], x["H"]
    adapter = adapter_fn(x)
    s_err, o_err, bitwise, _ = check(x, adapter, 0 < B <= args.check_max_batch)
    nbytes = state_bytes(x)
    calls = {"adapter": adapter, "bare": bare_fn(x), "copy": _timing.copy_roofline(nbytes)}
    times, backends = time_calls(timer, calls, args)
    fla_err = fla_failed = None
    if with_fla:  # FLA last, and on its own: a form FLA does not take is recorded, and the sweep goes on
        try:
            fla_err = check(x, adapter, False, fla=True)[3]
            fla_times, fla_backends = time_calls(timer, {"fla": fla_fn(x, clone_pool(x["pool"]))[0]}, args)
            times.update(fla_times)
            backends.update(fla_backends)
        except Exception as err:  # noqa: BLE001 (FLA's own failure, recorded with the point)
            fla_failed = f"{type(err).__name__}: {err}"[:300]
            print(f"{x['engine']} B={B} H={H} {dtype_name}: FLA failed ({fla_failed})", flush=True)
    rec = dict(kind="engine", engine=x["engine"], B=B, heads=H, state_dtype=dtype_name,
               slot_stride_pad=x["pool"].stride(0) - x["pool"][0].numel(), index_stride=x["slots"].stride(0),
               null_policy=x["policy"].value, mode="cuda_graph", timer=backends,
               adapter_us=times["adapter"], bare_us=times["bare"], fla_us=times.get("fla"), copy_us=times["copy"],
               state_bytes=nbytes, adapter_TBps=nbytes / times["adapter"] / 1e6,
               adapter_over_bare=times["adapter"] / times["bare"],
               pct_of_copy=100 * times["copy"] / times["adapter"],
               check_state_err=s_err, check_out_err=o_err, adapter_bitwise_bare=bitwise, fla_vs_adapter_err=fla_err,
               fla_failed=fla_failed)
    if times.get("fla"):
        rec["adapter_over_fla"] = times["adapter"] / times["fla"]
    if x["engine"] == "vllm_kimi_linear":
        rec["varlen_over_plain"] = rec["adapter_over_bare"]
    if args.eager_calls and B == 1:
        with timer.paused():
            rec["adapter_eager_call_us"] = _timing.eager_wall_us(adapter, calls=args.eager_calls)
            rec["bare_eager_call_us"] = _timing.eager_wall_us(calls["bare"], calls=args.eager_calls)
    return rec


def variant_point(name, B, H, dtype, dtype_name, args, timer, default_us):
    x = make_case("vllm_k3", B, H, dtype, seed=B + H, layout=VARIANTS[name])
    call = bare_fn(x)
    check_ok = None
    if 0 < B <= args.check_max_batch:
        from kda_core.oracle import recurrent_kda_ref

        ref_pool = clone_pool(x["pool"])
        views, gate = activations(x)
        o_ref, ref_pool = recurrent_kda_ref(*views, initial_state=ref_pool, use_qk_l2norm_in_kernel=True,
                                            ssm_state_indices=x["slots"], null_policy=x["policy"], **gate)
        saved = clone_pool(x["pool"])
        o = call()
        live = x["slots"].long()
        err = max((x["pool"][live].float() - ref_pool[live].float()).abs().max().item(),
                  (o.float() - o_ref.float()).abs().max().item())
        check_ok = err < 5e-2
        x["pool"].copy_(saved)
        if not check_ok:
            raise SystemExit(f"variant {name} B={B} H={H} {dtype_name}: bare kernel vs oracle err {err:.3e}")
    times, backends = time_calls(timer, {"bare": call}, args)
    pad, idx_stride, nonpositive = VARIANTS[name]
    rec = dict(kind="variant", variant=name, B=B, heads=H, state_dtype=dtype_name, slot_stride_pad=pad,
               index_stride=idx_stride, null_policy=x["policy"].value, mode="cuda_graph", timer=backends,
               bare_us=times["bare"], check_ok=check_ok)
    default = default_us.get((B, H, dtype_name), times["bare"] if name == "default" else None)
    if name == "default":
        default_us[(B, H, dtype_name)] = times["bare"]
    rec["variant_over_default"] = times["bare"] / default if default else None
    return rec


def record_key(rec):
    """What a record measured: (kind, engine or variant, B, H, state dtype); ``--resume`` keeps records by it."""
    return (rec["kind"], rec.get("engine", rec.get("variant")), rec["B"], rec["heads"], rec["state_dtype"])


def main(argv=None):
    args = parse_args(argv)
    _baseline.require_cuda(NAME)
    run = _baseline.Run(NAME, args)
    with_fla = not args.no_fla
    if with_fla:
        try:
            import fla.ops.kda.fused_recurrent  # noqa: F401
        except ImportError as err:
            print(f"FLA unavailable ({err}); timing kda and the copy only")
            with_fla = False
    timer = _timing.KernelTimer()
    run.provenance["timer"] = timer.backend
    variants = [] if args.no_variants else [
        (name, B, H, d) for d in args.state_dtype for H in args.variant_heads for B in args.variant_batch_size
        for name in VARIANTS]
    points = [(e, B, H, d) for d in args.state_dtype for e in args.engine for H in args.heads
              for B in args.batch_size]
    total, done, records = len(points) + len(variants), 0, []
    kept = {record_key(r): r for r in run.resumed}
    default_us = {}
    for engine, B, H, dtype_name in points:
        rec = kept.get(("engine", engine, B, H, dtype_name))
        if rec is not None:
            records.append(rec)
            done += 1
            continue
        x = make_case(engine, B, H, DTYPES[dtype_name], seed=B + H)
        rec = engine_point(x, dtype_name, args, timer, with_fla)
        records.append(rec)
        run.checkpoint(records)
        done += 1
        fla_txt = f"fla {rec['fla_us']:8.2f} us ({rec['adapter_over_fla']:.2f}x)  " if rec.get("fla_us") else ""
        eager = (f"  eager {rec['adapter_eager_call_us']:.1f} us (bare {rec['bare_eager_call_us']:.1f})"
                 if "adapter_eager_call_us" in rec else "")
        _baseline.progress(done, total, f"{engine:16s} {dtype_name} H={H:2d} B={B:4d}  adapter "
                           f"{rec['adapter_us']:8.2f} us ({rec['adapter_over_bare']:.3f}x bare {rec['bare_us']:.2f})  "
                           f"{fla_txt}"
                           f"copy {rec['copy_us']:8.2f} us ({rec['pct_of_copy']:.0f}%){eager}")
        del x
        torch.cuda.empty_cache()
    for name, B, H, dtype_name in variants:
        rec = kept.get(("variant", name, B, H, dtype_name))
        if rec is not None:
            records.append(rec)
            done += 1
            if name == "default":
                default_us[(B, H, dtype_name)] = rec["bare_us"]
            continue
        rec = variant_point(name, B, H, DTYPES[dtype_name], dtype_name, args, timer, default_us)
        records.append(rec)
        run.checkpoint(records)
        done += 1
        ratio = f" ({rec['variant_over_default']:.3f}x default)" if rec["variant_over_default"] else ""
        _baseline.progress(done, total, f"variant {name:12s} {dtype_name} H={H:2d} B={B:4d}  bare "
                           f"{rec['bare_us']:8.2f} us{ratio}")
        torch.cuda.empty_cache()
    if run.json_path is not None:
        run.save(records)
        eng = [r for r in records if r["kind"] == "engine"]
        series = {"adapter": "adapter_us", "bare kernel": "bare_us", "FLA": "fla_us", "copy roofline": "copy_us"}
        panels = [dict(records=[r for r in eng if r["engine"] == e and r["state_dtype"] == d], x="B", series=series,
                       group="heads", title=f"{e}, {d} states", ylabel="kernel time per call (us)")
                  for e in args.engine for d in args.state_dtype]
        var = [r for r in records if r["kind"] == "variant" and r["variant_over_default"]]
        if var:
            panels.append(dict(bars={f"{r['variant']} {r['state_dtype']} B={r['B']} H={r['heads']}":
                                     r["variant_over_default"] for r in var if r["variant"] != "default"},
                               ylabel="bare kernel time / default layout", target=1.0,
                               title="layout variants (vLLM K3 inputs, bare packed kernel)"))
        eager = {f"{r['engine']} {r['state_dtype']} H={r['heads']}": r["adapter_eager_call_us"] for r in eng
                 if "adapter_eager_call_us" in r}
        if eager:
            panels.append(dict(bars=eager, ylabel="eager host wall time per call at B=1 (us)", target=15.0,
                               title="adapter host cost"))
        run.plot(panels, title=f"KDA decode in the engines' call forms, cuda_graph, {_timing.gpu_name()}")
    return records


if __name__ == "__main__":
    main()
