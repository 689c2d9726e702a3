"""Which access structure streams a state pool in place at the copy's speed? (a diagnostic, Triton)

The T=1 kernel gives one CTA a whole (slot, head) state, 32 KB of bf16, and the CTAs visit the pool in the order of
the slot indices. This times in-place read-modify-writes of the same bytes with a memory-only Triton kernel
(``x ^ mask``, mask = 0 at run time, so nothing is elided) under several structures, against the elementwise copy
and in-place kernels, CUDA-graph replay, CUPTI:

- ``piece``: elements one program owns (16384 = a whole bf16 state; 4096 = a quarter of one);
- ``iters``: how many loads the program runs over its piece, one after the other (piece / iters in flight);
- ``order``: ``perm`` (the slots a random permutation, as in the benchmarks) or ``linear`` (slot b = b);
- ``warps``: warps per program;
- ``state*``: one whole state per step, optionally with the activation rows and output row the T=1 kernel also
  moves (``_io``), items in (head, sequence) order (``_hmajor``), or a persistent grid of N programs per SM walking
  the items (``_persistN``).

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


@triton.jit
def _state_inplace(ptr, perm, acts, out, mask, B, n_items, H: tl.constexpr, IO: tl.constexpr, HMAJOR: tl.constexpr):
    """One whole state per step, items pid, pid + grid, ... (grid = n_items: one item per program). ``IO``: also
    read the item's q, k, v, g rows (acts [B, 4 * H * 128]) and write its output row (out [B, H, 128]), the bytes
    the T=1 kernel moves besides the state. ``HMAJOR``: items in (head, sequence) order instead of (sequence, head)."""
    offs = tl.arange(0, 16384)
    for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
        if HMAJOR:
            b = item % B
            h = item // B
        else:
            b = item // H
            h = item % H
        slot = tl.load(perm + b).to(tl.int64)
        p = ptr + (slot * H + h) * 16384 + offs
        x = tl.load(p)
        if IO:
            rows = tl.arange(0, 4)[:, None] * (H * 128) + tl.arange(0, 128)[None, :]  # q, k, v, g of the item
            a = tl.load(acts + b.to(tl.int64) * (4 * H * 128) + h * 128 + rows)
            tl.store(out + (b.to(tl.int64) * H + h) * 128 + tl.arange(0, 128), (tl.sum(a, axis=0) ^ mask).to(tl.int16))
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
        acts = torch.randn(B, 4 * H * 128, device="cuda").to(torch.int16)
        out = torch.empty(B, H, 128, device="cuda", dtype=torch.int16)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        for io, hmajor, per_sm in [(False, False, 0), (True, False, 0), (False, True, 0), (True, True, 0),
                                   (False, False, 4), (False, False, 8), (True, False, 8)]:
            for order, perm in orders.items():
                grid = (B * H if not per_sm else per_sm * sms,)

                def fn(pool=pool, perm=perm, acts=acts, out=out, io=io, hmajor=hmajor, grid=grid, B=B):
                    _state_inplace[grid](pool, perm, acts, out, 0, B, B * H, H=H, IO=io, HMAJOR=hmajor, num_warps=4)

                fn()
                us = _timing.median(timer.time(_timing.graph_of(fn), iterations=args.iterations, warmup=5))
                name = (f"state{'_io' if io else ''}{'_hmajor' if hmajor else ''}"
                        f"{f'_persist{per_sm}' if per_sm else ''}_{order}")
                print(f"  {name:32s} {us:8.2f} us  {100 * copy / us:5.1f}% of copy", flush=True)
                records.append(dict(B=B, heads=H, variant=name, io=io, hmajor=hmajor, persist_per_sm=per_sm,
                                    order=order, us=us, copy_us=copy, pct_copy=100 * copy / us,
                                    gpu=_timing.gpu_name()))
        acts = out = None
        pool = src = None
        torch.cuda.empty_cache()
    if args.json:
        _timing.write_json(args.json, records)


if __name__ == "__main__":
    main()
