"""Cost of each tensor-metadata read that validation makes, on CPU and CUDA tensors (host ns per call).

Validation's per-call cost is a sum of these reads (about 45 per T=1 call); this says which ones are dear on the
host at hand, CUDA tensors included.

    python benchmarks/profile_metadata.py [--calls 200000] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

READS = {
    "shape": lambda t: t.shape,
    "stride()": lambda t: t.stride(),
    "dtype": lambda t: t.dtype,
    "get_device()": lambda t: t.get_device(),
    "device": lambda t: t.device,
    "is_cuda": lambda t: t.is_cuda,
    "data_ptr()": lambda t: t.data_ptr(),
    "storage_offset()": lambda t: t.storage_offset(),
    "is_contiguous()": lambda t: t.is_contiguous(),
    "dim()": lambda t: t.dim(),
    "isinstance": lambda t: isinstance(t, torch.Tensor),
}


def ns_per_call(fn, t, calls):
    for _ in range(calls // 10):
        fn(t)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(t)
    return (time.perf_counter() - t0) / calls * 1e9


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--calls", type=int, default=200000)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    rows = []
    for name, fn in READS.items():
        row = {"read": name}
        for dev in devices:
            t = torch.empty(4, 1, 12, 128, dtype=torch.bfloat16, device=dev)[:, :, :, :]
            row[dev] = ns_per_call(fn, t, args.calls)
        rows.append(row)
        print(f"{name:18s} " + "  ".join(f"{dev} {row[dev]:7.1f} ns" for dev in devices), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
