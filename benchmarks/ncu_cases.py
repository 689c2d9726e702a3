"""Launch each kernel of interest a few times, for Nsight Compute (the H200 host runs Firecracker, where ncu reads
the counters with ``--clock-control none``). Cases are named on the command line:

    ncu --clock-control none --set full -k regex:'Ucache|KDARecurrent|KDADecode' --launch-skip-before-match 0 \
        -o prof python benchmarks/ncu_cases.py ucache512 generic64 t1_512

Each case runs its kernel ``--calls`` times (the first compiles; ncu profiles every matching launch, so keep the
count small).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

H = 12


def ucache(B, fold, tile_v=0):
    import bench_kda_ucache_flush as bu

    x = bu.make_step(B, 8, H, 16, 9, fold, "uniform", seed=1)
    out = torch.empty_like(x["v"])
    return bu.ours_fn(x, 16, 9, False, out, tile_v)


def generic(B, T=8, tile_v=0):
    import sweep_recurrent_tiles as sw

    from kda_cute import generic as R

    x = sw.inputs(B, T, H, seed=1)
    out = torch.empty(B, T, H, 128, dtype=torch.bfloat16, device="cuda")

    def call():
        saved = R.select_config
        if tile_v:
            R.select_config = lambda n, k: R.RecurrentConfig(tile_v)
        try:
            R.kda_recurrent_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                                lower_bound=-5.0, use_gate_in_kernel=True, beta_is_logit=True,
                                initial_state=x["pool"], ssm_state_indices=x["slots"], num_accepted_tokens=x["nat"],
                                output=out)  # fmt: skip
        finally:
            R.select_config = saved

    return call


def t1(B, dtype=torch.bfloat16):
    import bench_packed_kda_decode as bp

    x = bp.make_inputs(B, H, dtype)
    out = torch.empty(B, 1, H, 128, dtype=torch.bfloat16, device="cuda")
    return bp.ours_fn(x, H, out)


def copy(B, dtype=torch.bfloat16):
    """The copy roofline's kernel for the bytes a T=1 step at B moves (the state read and written)."""
    import _timing

    return _timing.copy_roofline(2 * B * H * 128 * 128 * dtype.itemsize)


CASES = {
    "ucache512": lambda: ucache(512, 0),
    "ucache512f": lambda: ucache(512, 100),
    "ucache512t64": lambda: ucache(512, 0, 64),
    "ucache64": lambda: ucache(64, 0),
    "ucache128": lambda: ucache(128, 0),
    "generic64": lambda: generic(64),
    "generic512": lambda: generic(512),
    "generic8": lambda: generic(8),
    "t1_512": lambda: t1(512),
    "t1_256": lambda: t1(256),
    "t1_1024": lambda: t1(1024),
    "copy_256": lambda: copy(256),
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cases", nargs="+", choices=sorted(CASES))
    p.add_argument("--calls", type=int, default=2)
    args = p.parse_args(argv)
    for name in args.cases:
        fn = CASES[name]()
        for _ in range(args.calls):
            fn()
        torch.cuda.synchronize()
        print("ran", name, flush=True)


if __name__ == "__main__":
    main()
