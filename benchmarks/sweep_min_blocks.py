"""Occupancy sweep: each kernel family recompiled with a resident-CTA floor (``min_blocks_per_mp``, which makes
ptxas cap the registers per thread) and timed on CUDA-graph replay (CUPTI), against its default build.

    python benchmarks/sweep_min_blocks.py --json out.json

The floor is a sweep hook (``_FORCE_MIN_BLOCKS`` in decode_t1 / generic / ucache), not a knob: it is not part of
the compile key, so the compile caches are cleared between values.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402
import ncu_cases  # noqa: E402

# (case name in ncu_cases.CASES, module whose hook applies, floors to try)
POINTS = (
    ("generic64", "generic", (0, 4, 5)),
    ("generic512", "generic", (0, 4, 5)),
    ("ucache64", "ucache", (0, 3)),
    ("ucache512", "ucache", (0, 3)),
    ("ucache512f", "ucache", (0, 3)),
    ("ucache512t64", "ucache", (0, 5, 6)),
    ("t1_512", "decode_t1", (0, 5, 6)),
)
# Run only when named by --only: the bulk ring's floors (8 CTAs per SM = 64 registers without spill).
EXTRA_POINTS = (("t1_256", "decode_t1", (0, 8)), ("t1_1024", "decode_t1", (0, 8)))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--iterations", type=int, default=50)
    p.add_argument("--json", default=None)
    p.add_argument("--only", nargs="+", default=None, help="case names of POINTS or EXTRA_POINTS to run")
    p.add_argument("--floors", type=int, nargs="+", default=None, help="floors to try instead of each case's")
    args = p.parse_args(argv)
    from kda_cute import _launch, decode_t1, generic, ucache

    mods = dict(decode_t1=decode_t1, generic=generic, ucache=ucache)
    timer = _timing.KernelTimer()
    records = []
    points = POINTS if args.only is None else [p for p in POINTS + EXTRA_POINTS if p[0] in args.only]
    for case, mod_name, floors in points:
        floors = args.floors or floors
        mod = mods[mod_name]
        fn = ncu_cases.CASES[case]()
        for floor in floors:
            mod._FORCE_MIN_BLOCKS = floor
            _launch.clear_cache()
            decode_t1._LAUNCH_MEMO.clear()
            try:
                us = _timing.median(timer.time(_timing.graph_of(fn), iterations=args.iterations, warmup=5))
            finally:
                mod._FORCE_MIN_BLOCKS = 0
            records.append(dict(case=case, min_blocks=floor, us=us, gpu=_timing.gpu_name(), timer=timer.backend))
            print(f"{case:14s} min_blocks={floor}: {us:8.2f} us", flush=True)
        _launch.clear_cache()
        decode_t1._LAUNCH_MEMO.clear()
    if args.json:
        _timing.write_json(args.json, records)


if __name__ == "__main__":
    main()
