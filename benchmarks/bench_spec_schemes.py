"""The four spec-decode schemes on one workload, against FLA's per-token checkpoints and the copy roofline.

For each pool dtype (bf16, fp32), T (draft window) and batch size B, with H = HV = 12 heads, K = V = 128 and the
Kimi K3 gate (lower bound -5, raw gate, beta logits), in one process and with one timer (CUDA-graph replay, warm L2):

- ``per_token``: kda's per-token checkpoints (``recurrent_kda`` with 2-D ``ssm_state_indices`` [B, T] into a pool
  of B*T slots and ``num_accepted_tokens`` in [1, T]: the generic kernel, one state write per draft token);
- ``recoverssm``: vLLM K3's RecoverSSM, verify + commit in one graph: ``compat.vllm.kimi_k3.kda_recoverssm_verify``
  on ``[1, B*T]`` tokens with ``query_start_loc`` (reads the checkpoint, writes outputs and the per-token
  records) then ``kda_recurrent.recoverssm_commit`` (folds the accepted prefix, counts uniform in [1, T]);
  ``recoverssm_verify`` and ``recoverssm_commit`` are the two halves alone;
- ``frozen``: the frozen verify alone (``recurrent_kda(..., disable_state_update=True)``: outputs only);
- ``ucache_<p>``: the ReplaySSM ucache step at p = 0 / 50 / 100% folds (``kda_delta_rule_mtp_ucache_flush``,
  w_ring 16; bf16 checkpoints only, so absent for fp32 pools);
- ``fla``: FLA's per-token checkpoints (``fused_recurrent_kda_fwd``, V-first states in the pool's dtype, its
  fastest form for our layout);
- ``vllm_commit`` and ``vllm_commit_align``: vLLM's commit context for one layer (the commit plus the conv-window
  compaction), plain and in the prefix-cache align mode (a row whose count reaches T / 2 crosses a block
  boundary: with uniform counts 5 rows in 8 at T = 8, 3 in 4 at T = 4; ``commit_context_fns``), on a layer of
  their own;
- ``copy_<scheme>``: a device-to-device copy of the bytes the scheme must move (``bytes_<scheme>`` beside it).

Each scheme is checked against the kda-core oracle before it is timed (B <= ``--check-max-batch``). The defaults
are the baseline (T in {4, 8}, B in {1, 8, 64, 128, 512}), written with provenance to
benchmarks/baselines/<gpu>/spec_schemes.{json,png}.

    python benchmarks/bench_spec_schemes.py                                        # the baseline
    python benchmarks/bench_spec_schemes.py --t 8 --batch-size 64 512 --pool bf16 --out /tmp/spec.json
"""

from __future__ import annotations

import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _baseline  # noqa: E402  (first: puts the repository's packages on sys.path)
import _timing  # noqa: E402

NAME = "spec_schemes"
K = 128
LOWER_BOUND = -5.0
POOLS = {"bf16": torch.bfloat16, "fp32": torch.float32}
UCACHE_FOLDS = (0, 50, 100)


def parse_args(argv=None):
    p = _baseline.parser(__doc__)
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 64, 128, 512])
    p.add_argument("--t", type=int, nargs="+", choices=[4, 8], default=[4, 8])
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--pool", nargs="+", choices=list(POOLS), default=list(POOLS))
    p.add_argument("--no-fla", action="store_true", help="skip FLA (fla-core missing)")
    p.add_argument("--check-max-batch", type=int, default=64, help="oracle checks for B up to this (0 = never)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iterations", type=int, default=100)
    p.add_argument("--replot", metavar="JSON", help="only redraw the PNG beside a recorded run's JSON (no GPU)")
    _baseline.add_output_args(p)
    return p.parse_args(argv)


def workload(B, T, H, pool_dtype, seed, device="cuda"):
    """One verify step's inputs: draft activations [B, T, H, K], gate parameters, a committed pool of B + 1 slots
    (slot 0 is vLLM's null block: live rows use 1..B, permuted), per-token checkpoint slots, accepted counts."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device=device) * scale

    slots = (torch.randperm(B, generator=gen, device=device) + 1).to(torch.int32)
    return dict(
        q=randn(B, T, H, K).bfloat16(), k=randn(B, T, H, K).bfloat16(), v=randn(B, T, H, K).bfloat16(),
        g=randn(B, T, H, K).bfloat16(), b=randn(B, T, H).bfloat16(),
        A_log=torch.log(torch.rand(H, generator=gen, device=device) * 15 + 1), dt_bias=randn(H * K, scale=0.5),
        pool=randn(B + 1, H, K, K, scale=0.1).to(pool_dtype), slots=slots,
        spec_pool=randn(B * T, H, K, K, scale=0.1).to(pool_dtype),
        spec_idx=torch.randperm(B * T, generator=gen, device=device).to(torch.int32).view(B, T),
        accepted=torch.randint(1, T + 1, (B,), generator=gen, device=device).to(torch.int32),
        correction=torch.zeros(B + 1, H, T, K, device=device),
        kg=torch.zeros(B + 1, H, T, 2 * K, device=device, dtype=torch.bfloat16),
    )  # fmt: skip


def _gate_kw(x):
    return dict(A_log=x["A_log"], dt_bias=x["dt_bias"], use_gate_in_kernel=True, lower_bound=LOWER_BOUND,
                beta_is_logit=True)


def per_token_fn(x, out):
    from kda_recurrent import recurrent_kda

    def call():
        recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["b"], initial_state=x["spec_pool"],
                      ssm_state_indices=x["spec_idx"], num_accepted_tokens=x["accepted"], output=out, **_gate_kw(x))

    return call


def frozen_fn(x, out):
    from kda_recurrent import recurrent_kda

    def call():
        recurrent_kda(x["q"], x["k"], x["v"], x["g"], x["b"], initial_state=x["pool"], ssm_state_indices=x["slots"],
                      output=out, disable_state_update=True, **_gate_kw(x))

    return call


def _flat(x):
    B, T = x["q"].shape[:2]
    flat = {n: x[n].reshape(1, B * T, *x[n].shape[2:]) for n in ("q", "k", "v", "g", "b")}
    flat["qsl"] = torch.arange(0, B * T + 1, T, device=x["q"].device, dtype=torch.int32)
    return flat


def recoverssm_fns(x, out):
    """(verify, commit) on vLLM's call forms: the verify through the vLLM K3 adapter, the commit for one layer."""
    from kda_recurrent import recoverssm_commit
    from kda_recurrent.compat.vllm.kimi_k3 import kda_recoverssm_verify

    T = x["q"].shape[1]
    f = _flat(x)
    out_flat = out.view(1, -1, *out.shape[2:])

    def verify():
        kda_recoverssm_verify(f["q"], f["k"], f["v"], f["g"], f["b"], x["A_log"], x["dt_bias"], LOWER_BOUND,
                              x["pool"], x["correction"], x["kg"], f["qsl"], x["slots"], T, out=out_flat)

    def commit():
        recoverssm_commit(x["pool"], x["correction"], x["kg"], x["slots"], x["accepted"], x["A_log"], x["dt_bias"],
                          LOWER_BOUND, query_start_loc=f["qsl"], null_policy="nonpositive")

    return verify, commit


def commit_context_fns(x, block_size=64):
    """(plain, align): vLLM's commit context for one layer (``compat.vllm.kimi_k3.KDARecoverSSMCommitContext``:
    the one-launch commit and the conv-window compaction) on a layer of its own, 2B + 1 blocks, a bf16 conv state
    [blocks, 3HK, 3 + T - 1]; the align mode with ``block_table`` [B, 2] = (the source slot, a block of its own) and
    ``num_computed_tokens`` = block_size - T // 2 for every request, so a row whose count reaches T // 2 crosses the
    boundary (its final state moves to the second block, the boundary state goes back to the source)."""
    import types

    from kda_recurrent.compat.vllm.kimi_k3 import KDARecoverSSMCommitContext

    B, T, H, _ = x["q"].shape
    dev = x["q"].device
    blocks = 2 * B + 1
    ckpt = torch.empty(blocks, H, K, K, device=dev, dtype=x["pool"].dtype)
    ckpt[: B + 1] = x["pool"]
    ckpt[B + 1:] = x["pool"][1:]
    layer = types.SimpleNamespace(
        kv_cache=(torch.randn(blocks, 3 * H * K, 3 + T - 1, device=dev).bfloat16(), ckpt,
                  torch.zeros(blocks, H, T, K, device=dev), torch.zeros(blocks, H, T, 2 * K, device=dev,
                                                                         dtype=torch.bfloat16)),
        A_log=x["A_log"], dt_bias=x["dt_bias"], gate_lower_bound=LOWER_BOUND)
    ctx = KDARecoverSSMCommitContext.create([layer], spec_query_len=T, max_num_reqs=B, conv_dim_first=True)
    qsl = torch.arange(0, B * T + 1, T, device=dev, dtype=torch.int32)
    table = torch.stack([x["slots"], torch.arange(B + 1, 2 * B + 1, device=dev, dtype=torch.int32)], dim=1)
    computed = torch.full((B,), block_size - T // 2, device=dev, dtype=torch.int32)

    def plain():
        ctx.commit(x["accepted"], x["slots"], qsl)

    def align():
        ctx.commit(x["accepted"], x["slots"], qsl, block_table=table, num_computed_tokens=computed,
                   mamba_block_size=block_size)

    return plain, align


def fla_fn(x, out):
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    def call():
        fused_recurrent_kda_fwd(
            x["q"], x["k"], x["v"], x["g"], x["b"], A_log=x["A_log"], dt_bias=x["dt_bias"],
            initial_state=x["spec_pool"], inplace_final_state=True, state_v_first=True,
            ssm_state_indices=x["spec_idx"], num_accepted_tokens=x["accepted"], use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=LOWER_BOUND, out=out,
        )  # fmt: skip

    return call


def moved_bytes(x, scheme):
    """DRAM bytes a scheme must move per step (states, records, draft inputs and outputs)."""
    B, T, H, _ = x["q"].shape
    state = H * K * K * x["pool"].element_size()
    io = B * T * H * K * 2 * 5 + B * T * H * 2  # q, k, v, g in; o out; beta
    records = B * H * T * (K * 4 + 2 * K * 2)  # u fp32, raw k | raw g bf16
    accepted = int(x["accepted"].sum())
    commit = 2 * B * state + accepted * H * (K * 4 + 2 * K * 2)
    return {
        "per_token": B * state + int(x["spec_idx"].numel()) * state + io,
        "frozen": B * state + io,
        "recoverssm_verify": B * state + io + records,
        "recoverssm_commit": commit,
        "recoverssm": B * state + io + records + commit,
    }[scheme]


def check(x, out_ref_pool_dtype, T):
    """Every kda scheme against kda-core's oracle on copies (raises on mismatch); returns the largest errors."""
    from kda_core.call_args import RecurrentArgs, SpecArgs
    from kda_core.contracts import NullSlotPolicy
    from kda_core.oracle import recurrent_kda_ref
    from kda_core.oracle_spec import recoverssm_commit_ref, spec_verify_ref

    errs = {}
    gate = _gate_kw(x)
    # per-token checkpoints
    mine = {n: t.clone() for n, t in x.items()}
    out = torch.empty_like(x["v"])
    per_token_fn(mine, out)()
    ref_pool = x["spec_pool"].clone()
    o_ref, _ = recurrent_kda_ref(x["q"], x["k"], x["v"], x["g"], x["b"], initial_state=ref_pool,
                                 ssm_state_indices=x["spec_idx"], num_accepted_tokens=x["accepted"], **gate)
    errs["per_token"] = (out.float() - o_ref.float()).abs().max().item()
    # frozen verify: outputs only, the pool untouched
    mine = {n: t.clone() for n, t in x.items()}
    out = torch.empty_like(x["v"])
    frozen_fn(mine, out)()
    if not torch.equal(mine["pool"], x["pool"]):
        raise SystemExit("frozen verify wrote the pool")
    args = RecurrentArgs(x["q"], x["k"], x["v"], x["g"], x["b"], x["A_log"], x["dt_bias"], None, x["pool"].clone(),
                         False, True, True, LOWER_BOUND, True, None, x["slots"])
    o_ref, _ = spec_verify_ref(args, SpecArgs(disable_state_update=True))
    errs["frozen"] = (out.float() - o_ref.float()).abs().max().item()
    # RecoverSSM verify + commit against the recurrence over the accepted prefix
    mine = {n: t.clone() for n, t in x.items()}
    out = torch.empty_like(x["v"])
    verify, commit = recoverssm_fns(mine, out)
    verify()
    commit()
    ref = {n: x[n].clone() for n in ("pool", "correction", "kg")}
    args = args._replace(initial_state=ref["pool"])
    o_ref, _ = spec_verify_ref(args, SpecArgs(disable_state_update=True, correction_cache=ref["correction"],
                                              kg_cache=ref["kg"]), null_policy=NullSlotPolicy.NONPOSITIVE)
    recoverssm_commit_ref(ref["pool"], ref["correction"], ref["kg"], x["slots"], x["accepted"], x["A_log"],
                          x["dt_bias"], LOWER_BOUND, null_policy=NullSlotPolicy.NONPOSITIVE)
    errs["recoverssm"] = (out.float() - o_ref.float()).abs().max().item()
    errs["recoverssm_state"] = (mine["pool"].float() - ref["pool"].float()).abs().max().item()
    tol = 8e-3 + 8e-3 * o_ref.abs().max().item()
    bad = {n: e for n, e in errs.items() if e > (2e-2 if n.endswith("state") else tol)}
    if bad:
        raise SystemExit(f"correctness check failed (T={T}): {bad}")
    return errs


def ucache_calls(B, T, H):
    """The ucache step at each fold rate (bf16 checkpoints, w_ring 16), from the ucache benchmark's workload."""
    import bench_kda_ucache_flush as uc

    from kda_core.contracts import default_flush_min

    flush_min = default_flush_min(T, 16)
    calls, nbytes = {}, {}
    for fold in UCACHE_FOLDS:
        x = uc.make_step(B, T, H, 16, flush_min, fold, "uniform", seed=B * 101 + fold)
        out = torch.empty_like(x["v"])
        calls[f"ucache_{fold}"] = uc.ours_fn(x, 16, flush_min, False, out)
        nbytes[f"ucache_{fold}"] = uc.moved_bytes(x, T, flush_min)
    return calls, nbytes


SCHEMES = {"per-token checkpoints": "per_token_us", "RecoverSSM verify + commit": "recoverssm_us",
           "frozen verify": "frozen_us", "ucache 0% folds": "ucache_0_us", "ucache 100% folds": "ucache_100_us",
           "FLA per-token (V-first)": "fla_us", "copy of RecoverSSM's bytes": "copy_recoverssm_us"}


def plot_panels(records):
    """One panel per (pool dtype, T): time against B, one colour per scheme (SCHEMES)."""
    panels = []
    for pool, T in sorted({(r["pool"], r["T"]) for r in records}, key=lambda k: (k[0] != "bf16", k[1])):
        rows = [dict(B=r["B"], scheme=label, us=r[key]) for r in records if (r["pool"], r["T"]) == (pool, T)
                for label, key in SCHEMES.items() if r.get(key) is not None]
        panels.append(dict(records=rows, x="B", series={"us": "us"}, group="scheme",
                           ylabel="kernel time per step (us, CUDA-graph replay)", title=f"{pool} pool, T={T}"))
    return panels


def main(argv=None):
    args = parse_args(argv)
    if args.replot:  # redraw a recorded run's PNG (no GPU): the records and their provenance are the file's
        import json
        from pathlib import Path

        path = Path(args.replot)
        recorded = json.loads(path.read_text())
        gpu = recorded["provenance"].get("gpu", "")
        H = recorded["records"][0]["H"] if recorded["records"] else args.heads
        _baseline.write_plot(path.with_suffix(".png"), plot_panels(recorded["records"]),
                             title=f"KDA spec-decode schemes, H={H}, {gpu}")
        return recorded["records"]
    _baseline.require_cuda(NAME)
    run = _baseline.Run(NAME, args)
    H = args.heads
    with_fla = not args.no_fla
    if with_fla:
        try:
            import fla.ops.kda.fused_recurrent  # noqa: F401
        except ImportError as err:
            print(f"FLA unavailable ({err}); timing kda and the copy only")
            with_fla = False
    timer = _timing.KernelTimer()
    run.provenance["timer"] = timer.backend
    records = []
    points = list(itertools.product(args.pool, args.t, args.batch_size))
    for i, (pool_name, T, B) in enumerate(points):
        x = workload(B, T, H, POOLS[pool_name], seed=B * 7 + T)
        rec = dict(B=B, T=T, H=H, pool=pool_name)
        if B <= args.check_max_batch:
            rec.update({f"check_err_{n}": e for n, e in check(x, POOLS[pool_name], T).items()})
        out = torch.empty_like(x["v"])
        verify, commit = recoverssm_fns(x, out)

        def both(verify=verify, commit=commit):
            verify()
            commit()

        calls = {"per_token": per_token_fn(x, out), "frozen": frozen_fn(x, out), "recoverssm": both,
                 "recoverssm_verify": verify, "recoverssm_commit": commit}
        nbytes = {n: moved_bytes(x, n) for n in calls}
        calls["vllm_commit"], calls["vllm_commit_align"] = commit_context_fns(x)
        if pool_name == "bf16":
            more, more_bytes = ucache_calls(B, T, H)
            calls.update(more)
            nbytes.update(more_bytes)
        if with_fla:
            calls["fla"] = fla_fn(x, torch.empty_like(out))
            nbytes["fla"] = nbytes["per_token"]
        for n in ("per_token", "recoverssm", "frozen"):
            calls[f"copy_{n}"] = _timing.copy_roofline(nbytes[n])
        graphs = {n: _timing.graph_of(fn) for n, fn in calls.items()}
        for n, fn in graphs.items():
            rec[f"{n}_us"] = _timing.median(timer.time(fn, iterations=args.iterations, warmup=args.warmup))
        rec.update({f"bytes_{n}": v for n, v in nbytes.items()})
        rec["recoverssm_over_per_token"] = rec["recoverssm_us"] / rec["per_token_us"]
        if "fla_us" in rec:
            rec["fla_over_recoverssm"] = rec["fla_us"] / rec["recoverssm_us"]
        rec["vllm_commit_align_over_plain"] = rec["vllm_commit_align_us"] / rec["vllm_commit_us"]
        if "ucache_0_us" in rec:
            rec["frozen_over_ucache_0"] = rec["frozen_us"] / rec["ucache_0_us"]
        records.append(rec)
        run.checkpoint(records)
        _baseline.progress(i + 1, len(points), f"{pool_name} T={T} B={B:4d}  " + "  ".join(
            f"{n} {rec[f'{n}_us']:.1f}" for n in ("per_token", "recoverssm", "frozen", "ucache_0", "fla",
                                                   "vllm_commit", "vllm_commit_align")
            if f"{n}_us" in rec))
        del x, graphs, calls
        torch.cuda.empty_cache()
    run.save(records)
    run.plot(plot_panels(records), title=f"KDA spec-decode schemes, H={H}, {_timing.gpu_name()}")
    return records


if __name__ == "__main__":
    main()
