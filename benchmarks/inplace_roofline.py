"""Is an in-place read-modify-write of a buffer as fast as a copy of the same bytes to another buffer?

The T=1 kernel updates the pool in place (every state row is read, then written back to the same address); the
benchmarks' roofline is a copy (read A, write B). This times the same elementwise kernel over the same bytes
(CUDA-graph replay, CUPTI): the copy ``dst = src | 0`` and the in-place ``src = src | 0``.

    python benchmarks/inplace_roofline.py --mbytes 100 201 403 805 --json out.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402


def time_size(timer, nbytes, iterations):
    words = nbytes // 2 // 4
    src = torch.empty(words, dtype=torch.int32, device="cuda").random_()
    dst = torch.empty_like(src)
    times = {}
    for name, fn in (("copy", lambda: torch.bitwise_or(src, 0, out=dst)),
                     ("inplace", lambda: torch.bitwise_or(src, 0, out=src))):
        times[name] = _timing.median(timer.time(_timing.graph_of(fn), iterations=iterations, warmup=5))
    return dict(copy_us=times["copy"], inplace_us=times["inplace"], copy_TBps=nbytes / times["copy"] / 1e6,
                inplace_TBps=nbytes / times["inplace"] / 1e6, inplace_over_copy=times["copy"] / times["inplace"],
                gpu=_timing.gpu_name(), timer=timer.backend)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mbytes", type=float, nargs="+", default=[100.7, 201.3, 402.7, 805.3],
                   help="bytes moved (read + written), MB: B * 12 heads * 32 KB * 2 for B = 128..1024 (bf16)")
    p.add_argument("--iterations", type=int, default=50)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    timer = _timing.KernelTimer()
    records = []
    for mb in args.mbytes:
        rec = time_size(timer, int(mb * 1e6), args.iterations)
        rec["mbytes"] = mb
        records.append(rec)
        print(f"{mb:7.1f} MB: copy {rec['copy_us']:8.2f} us ({rec['copy_TBps']:.2f} TB/s)  in place "
              f"{rec['inplace_us']:8.2f} us ({rec['inplace_TBps']:.2f} TB/s)  in-place speed = "
              f"{100 * rec['inplace_over_copy']:.0f}% of copy", flush=True)
        torch.cuda.empty_cache()
    if args.json:
        _timing.write_json(args.json, records)


if __name__ == "__main__":
    main()
