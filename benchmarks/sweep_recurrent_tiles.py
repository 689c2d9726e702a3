"""Tile sweep of the generic recurrent kernel (kda_cute.generic) for its schedule table, with FLA in the same run.

Spec decode with per-token checkpoints (2-D slots + num_accepted_tokens, bf16 pool, H=HV=12, K=128), CUDA-graph
replay, CUPTI kernel time (``_timing.KernelTimer``). For every (T, B): each legal tile, FLA 0.6.0
``fused_recurrent_kda_fwd`` on the same inputs, and a device-to-device copy of the state bytes (read 1 + write T
states per sequence). One JSON record per point.

    python benchmarks/sweep_recurrent_tiles.py --t 4 8 --batch-size 1 2 4 8 16 32 64 --json out.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402

K = 128


def inputs(B, T, H, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    n_slots = B * T + 64
    return dict(
        q=rnd(B, T, H, K).bfloat16(), k=rnd(B, T, H, K).bfloat16(), v=rnd(B, T, H, K).bfloat16(),
        g=rnd(B, T, H, K).bfloat16(), beta=rnd(B, T, H).bfloat16(),
        A_log=torch.log(torch.rand(H, generator=gen, device="cuda") * 15 + 1), dt_bias=rnd(H * K) * 0.5,
        pool=(rnd(n_slots, H, K, K) * 0.1).bfloat16(),
        slots=torch.randperm(n_slots, generator=gen, device="cuda")[: B * T].to(torch.int32).view(B, T).contiguous(),
        nat=torch.randint(1, T + 1, (B,), generator=gen, device="cuda", dtype=torch.int32),
    )  # fmt: skip


def time_point(R, fla, timer, T, B, H, tiles, iterations):
    """One (T, B) point: every tile of ours, FLA and the copy of the state bytes, on the same inputs."""
    x = inputs(B, T, H, seed=B * 100 + T)
    out = torch.empty(B, T, H, K, dtype=torch.bfloat16, device="cuda")

    def ours():
        R.kda_recurrent_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                            lower_bound=-5.0, use_gate_in_kernel=True, beta_is_logit=True, initial_state=x["pool"],
                            ssm_state_indices=x["slots"], num_accepted_tokens=x["nat"], output=out)  # fmt: skip

    def time_us(fn):
        return _timing.median(timer.time(_timing.graph_of(fn), iterations=iterations, warmup=5))

    default_select = R.select_config
    nbytes = B * H * K * K * 2 * (1 + T)
    rec = dict(T=T, B=B, H=H, states=B * H, default_tile=default_select(B * H, K).tile_v,
               copy_us=time_us(_timing.copy_roofline(nbytes)), gpu=_timing.gpu_name(), timer=timer.backend)
    if fla is not None:
        rec["fla_us"] = time_us(lambda: fla(
            x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
            initial_state=x["pool"], inplace_final_state=True, state_v_first=True, ssm_state_indices=x["slots"],
            num_accepted_tokens=x["nat"], use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, out=out))  # fmt: skip
    rec["tiles"] = {}
    try:
        for tile in tiles:
            R.select_config = lambda n, k, tile=tile: R.RecurrentConfig(tile)
            rec["tiles"][tile] = time_us(ours)
    finally:
        R.select_config = default_select
    rec["best_tile"] = min(rec["tiles"], key=rec["tiles"].get)
    rec["best_us"] = rec["tiles"][rec["best_tile"]]
    return rec


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--t", type=int, nargs="+", default=[4, 8])
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--tile-v", type=int, nargs="+", default=None, help="default: every legal tile")
    p.add_argument("--iterations", type=int, default=50)
    p.add_argument("--no-fla", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from kda_cute import generic as R

    fla = None
    if not args.no_fla:
        try:
            from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd as fla
        except ImportError as err:
            print("FLA unavailable:", err)
    timer = _timing.KernelTimer()
    tiles = args.tile_v or list(R.tile_v_choices(K))
    records = []
    for T in args.t:
        for B in args.batch_size:
            rec = time_point(R, fla, timer, T, B, args.heads, tiles, args.iterations)
            records.append(rec)
            ratio = f" best/FLA {rec['best_us'] / rec['fla_us']:.2f}" if "fla_us" in rec else ""
            print(f"T={T} B={B:4d} " + " ".join(f"t{t}={us:7.2f}" for t, us in rec["tiles"].items())
                  + f"  fla={rec.get('fla_us', float('nan')):7.2f} copy={rec['copy_us']:6.2f}  "
                  f"best t{rec['best_tile']}{ratio} (table t{rec['default_tile']})", flush=True)
            torch.cuda.empty_cache()
    if args.json:
        _timing.write_json(args.json, records)
    return records


if __name__ == "__main__":
    main()
