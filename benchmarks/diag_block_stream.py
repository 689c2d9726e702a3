"""Which access structure streams a state pool in place at the copy's speed? (a diagnostic, Triton)

The T=1 kernel gives one CTA a whole (slot, head) state, 32 KB of bf16, and the CTAs visit the pool in the order of
the slot indices. This times in-place read-modify-writes of the same bytes with a memory-only Triton kernel
(``x ^ mask``, mask = 0 at run time, so nothing is elided) under several structures, against the elementwise copy
and in-place kernels, CUDA-graph replay, CUPTI:

- ``piece``: elements one program owns (16384 = a whole bf16 state; 4096 = a quarter of one);
- ``iters``: how many loads the program runs over its piece, one after the other (piece / iters in flight);
- ``order``: ``perm`` (the slots a random permutation, as in the benchmarks) or ``linear`` (slot b = b);
- ``warps``: warps per program.

    python benchmarks/diag_block_stream.py --batch-size 256 512 --json out.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _timing  # noqa: E402

STATE = 128 * 128


@triton.jit
def _block_inplace(ptr, perm, mask, H: tl.constexpr, PIECE: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    pieces: tl.constexpr = 16384 // PIECE
    item = pid // pieces
    piece = pid % pieces
    b = item // H
    h = item % H
    slot = tl.load(perm + b).to(tl.int64)
    base = (slot * H + h) * 16384 + piece * PIECE
    step: tl.constexpr = PIECE // ITERS
    offs = tl.arange(0, step)
    for i in tl.static_range(ITERS):
        p = ptr + base + i * step + offs
        x = tl.load(p)
        tl.store(p, x ^ mask)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-size", type=int, nargs="+", default=[256, 512])
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--iterations", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    timer = _timing.KernelTimer()
    H = args.heads
    records = []
    shapes = [(16384, 1, 4), (16384, 2, 4), (16384, 4, 4), (16384, 8, 4), (16384, 2, 8), (16384, 4, 8),
              (8192, 1, 4), (8192, 2, 4), (4096, 1, 4), (2048, 1, 4), (1024, 1, 4)]
    for B in args.batch_size:
        nbytes = B * H * STATE * 2 * 2
        pool = torch.randn(B * H * STATE, device="cuda").to(torch.int16)
        gen = torch.Generator(device="cuda").manual_seed(0)
        orders = {"perm": torch.randperm(B, generator=gen, device="cuda").to(torch.int32),
                  "linear": torch.arange(B, device="cuda", dtype=torch.int32)}
        copy = _timing.median(timer.time(_timing.graph_of(_timing.copy_roofline(nbytes)),
                                         iterations=args.iterations, warmup=5))
        src = pool.view(torch.int32)
        inplace = _timing.median(timer.time(_timing.graph_of(lambda src=src: torch.bitwise_or(src, 0, out=src)),
                                            iterations=args.iterations, warmup=5))
        print(f"B={B}: copy {copy:.2f} us, elementwise in place {inplace:.2f} us ({100 * copy / inplace:.1f}% of copy)",
              flush=True)
        records.append(dict(B=B, heads=H, variant="elementwise_inplace", us=inplace, copy_us=copy,
                            pct_copy=100 * copy / inplace, gpu=_timing.gpu_name()))
        for piece, iters, warps in shapes:
            for order, perm in orders.items():
                grid = (B * H * (16384 // piece),)

                def fn(pool=pool, perm=perm, piece=piece, iters=iters, warps=warps, grid=grid):
                    _block_inplace[grid](pool, perm, 0, H=H, PIECE=piece, ITERS=iters, num_warps=warps)

                fn()
                us = _timing.median(timer.time(_timing.graph_of(fn), iterations=args.iterations, warmup=5))
                name = f"piece{piece}_iters{iters}_w{warps}_{order}"
                print(f"  {name:32s} {us:8.2f} us  {100 * copy / us:5.1f}% of copy", flush=True)
                records.append(dict(B=B, heads=H, variant=name, piece=piece, iters=iters, warps=warps, order=order,
                                    us=us, copy_us=copy, pct_copy=100 * copy / us, gpu=_timing.gpu_name()))
        pool = src = None
        torch.cuda.empty_cache()
    if args.json:
        _timing.write_json(args.json, records)


if __name__ == "__main__":
    main()
