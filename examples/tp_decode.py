"""A Kimi K3-shaped KDA decode layer (96 heads) sharded over N GPUs, one process per GPU (docs/multi_gpu.md §2).

Each rank owns heads [r * 96 / N, (r + 1) * 96 / N): its columns of the input projection (q, k, v, raw gate, beta
logits of its heads), its heads' gate parameters and recurrent-state pool, and its rows of the output projection. A
step is: the projection, ``recurrent_kda`` on the rank's heads (the T=1 kernel, one token per sequence), the o_proj
shard, and one all-reduce (sum) of the [B, hidden] partial outputs, as an engine's tensor-parallel attention layer
does. On GPUs the step is captured in a CUDA graph, the NCCL all-reduce inside it.

    torchrun --nproc-per-node 2 examples/tp_decode.py --out run.json    # GPUs: N = nproc, N divides 96
    python examples/tp_decode.py --cpu --nproc 2                        # gloo, the oracle path: sharding check

Per batch size (one record each, ``passed`` and ``gpus`` in it): rank 0 checks the sharded layer's output and its
heads' states, after ``--check-steps`` eager steps, against the unsharded layer (all 96 heads, one device, the same
code with N = 1) run from the same state; on GPUs every rank then times its graph-captured step (mean over
``--replays`` replays, CUDA events, after warm-up) with all ranks stepping together, and then alone (its shard's step
without the all-reduce, the other GPUs idle); each rank reports which devices hold an active CUDA primary context.
``--out`` writes the run record (the provenance of ``benchmarks/_baseline.py``); the default on GPUs is
``benchmarks/baselines/<gpu>x<N>/multi_gpu.json``.

NVLink multicast is off (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1``,
set here before anything initialises).
"""

from __future__ import annotations

import os

for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_name] = _value

import argparse  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import _baseline  # noqa: E402  (puts packages/*/src on sys.path)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

HEADS = 96  # Kimi K3's KDA heads per layer
D = 128
LOWER_BOUND = -5.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU (the oracle path): the sharding check only")
    p.add_argument("--nproc", type=int, default=2, help="processes to start without torchrun (--cpu)")
    p.add_argument("--batch", default=None, help="comma-separated batch sizes (default: 1,8,64,256; --cpu: 2)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default 2048; --cpu: 256)")
    p.add_argument("--check-steps", type=int, default=2, help="eager steps compared with the unsharded layer")
    p.add_argument("--replays", type=int, default=200, help="timed graph replays per measurement")
    p.add_argument("--seed", type=int, default=0)
    _baseline.add_output_args(p)
    args = p.parse_args(argv)
    args.batch = [int(b) for b in (args.batch or ("2" if args.cpu else "1,8,64,256")).split(",")]
    args.hidden = args.hidden or (256 if args.cpu else 2048)
    return args


# ---------------------------------------------------------------------------------------------------------------
# the layer and its shards


@dataclass
class Shard:
    """One rank's part of the layer (``heads`` of them, from ``first``), on its device."""

    first: int
    heads: int
    w_in: torch.Tensor  # [hidden, 4 * heads * D + heads]: q | k | v | raw gate | beta logits of these heads
    A_log: torch.Tensor  # [heads] fp32
    dt_bias: torch.Tensor  # [heads * D] fp32
    w_out: torch.Tensor  # [heads * D, hidden] fp32: these heads' rows of o_proj


def full_layer(hidden: int, seed: int) -> dict:
    """The unsharded layer's parameters, on the CPU, the same on every rank (seeded)."""
    g = torch.Generator().manual_seed(seed)
    cols = HEADS * D
    return dict(
        w_in=torch.randn(hidden, 4 * cols + HEADS, generator=g) / hidden**0.5,
        A_log=torch.randn(HEADS, generator=g) * 0.5,
        dt_bias=torch.randn(cols, generator=g) * 0.1,
        w_out=torch.randn(cols, hidden, generator=g) / cols**0.5,
    )


def shard_of(layer: dict, rank: int, world: int, device, act_dtype) -> Shard:
    """Rank ``rank``'s shard of ``layer``: column blocks of each of q, k, v and the gate, the beta columns, and the
    o_proj rows of its heads."""
    if HEADS % world:
        raise SystemExit(f"--nproc / torchrun processes: expected a divisor of {HEADS}, got {world}")
    heads = HEADS // world
    first = rank * heads
    cols = HEADS * D
    lo, hi = first * D, (first + heads) * D
    w = layer["w_in"]
    w_in = torch.cat([w[:, part * cols + lo: part * cols + hi] for part in range(4)]
                     + [w[:, 4 * cols + first: 4 * cols + first + heads]], dim=1)
    return Shard(first, heads, w_in.to(device, act_dtype).contiguous(), layer["A_log"][first:first + heads].to(device),
                 layer["dt_bias"][lo:hi].to(device), layer["w_out"][lo:hi].to(device).contiguous())


def initial_pool(batch: int, seed: int) -> torch.Tensor:
    """Every head's state of ``batch`` sequences in slots 1..batch (slot 0 unused), bf16 [batch + 1, 96, D, D]."""
    g = torch.Generator().manual_seed(seed + 1)
    return (torch.randn(batch + 1, HEADS, D, D, generator=g) * 0.05).to(torch.bfloat16)


def inputs(batch: int, hidden: int, seed: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + step + 2)
    return torch.randn(batch, hidden, generator=g)


class Step:
    """One decode step of a shard on static buffers (CUDA-graph safe): ``run(all_reduce)`` returns y [B, hidden]."""

    def __init__(self, shard: Shard, pool: torch.Tensor, x: torch.Tensor, slots: torch.Tensor):
        from kda_recurrent import recurrent_kda

        self.recurrent_kda = recurrent_kda
        self.shard, self.pool, self.x, self.slots = shard, pool, x, slots
        B, h = x.shape[0], shard.heads
        self.o = torch.empty(B, 1, h, D, dtype=torch.bfloat16, device=x.device)

    def run(self, all_reduce: bool) -> torch.Tensor:
        s = self.shard
        B, h = self.x.shape[0], s.heads
        proj = (self.x.to(s.w_in.dtype) @ s.w_in).to(torch.bfloat16)  # [B, 4 h D + h]
        q, k, v, g = (proj[:, i * h * D:(i + 1) * h * D].view(B, 1, h, D) for i in range(4))
        beta = proj[:, 4 * h * D:].view(B, 1, h)
        self.recurrent_kda(q, k, v, g, beta, s.A_log, s.dt_bias, initial_state=self.pool,
                           ssm_state_indices=self.slots, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                           lower_bound=LOWER_BOUND, beta_is_logit=True, output=self.o)
        y = self.o.view(B, h * D).float() @ s.w_out
        if all_reduce:
            dist.all_reduce(y)
        return y


# ---------------------------------------------------------------------------------------------------------------
# one rank


def active_contexts() -> list[int] | None:
    """Per visible device, whether its CUDA primary context is active in this process (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    states = []
    for index in range(torch.cuda.device_count()):
        _, dev = driver.cuDeviceGet(index)
        _, _, active = driver.cuDevicePrimaryCtxGetState(dev)
        states.append(int(active))
    return states


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> tuple[bool, float]:
    err = float((a.float() - b.float()).abs().max()) if a.numel() else 0.0
    return err <= tol * max(1.0, float(b.float().abs().max())), err


def check(args, layer, shard, batch, device, rank, world) -> dict:
    """``--check-steps`` eager steps of the sharded layer against the unsharded one (rank 0 runs it): outputs and the
    rank-0 heads' states. Returns rank 0's verdict on every rank."""
    tol = 1e-3 if args.cpu else 3e-2  # fp32 CPU arithmetic; bf16 projections on the GPU (different GEMM splits)
    slots = torch.arange(1, batch + 1, dtype=torch.int32, device=device)
    pool0 = initial_pool(batch, args.seed)
    x = torch.empty(batch, args.hidden, device=device)
    mine = Step(shard, pool0[:, shard.first:shard.first + shard.heads].to(device).contiguous(), x, slots)
    if rank == 0:
        whole = Step(shard_of(layer, 0, 1, device, mine.shard.w_in.dtype), pool0.to(device), torch.empty_like(x),
                     slots)
    ok, worst = True, 0.0
    for step in range(args.check_steps):
        xs = inputs(batch, args.hidden, args.seed, step).to(device)
        mine.x.copy_(xs)
        y = mine.run(all_reduce=True)
        if rank == 0:
            whole.x.copy_(xs)
            y_full = whole.run(all_reduce=False)
            good, err = _close(y, y_full, tol)
            ok, worst = ok and good, max(worst, err)
    if rank == 0:
        good, err = _close(mine.pool, whole.pool[:, :shard.heads], tol)
        ok, worst = ok and good, max(worst, err)
    verdict = [ok, worst]
    if world > 1:
        box = [verdict]
        dist.broadcast_object_list(box, src=0)
        verdict = box[0]
    return {"passed": bool(verdict[0]), "max_abs_error": verdict[1], "tolerance": tol}


def time_graph(step: Step, all_reduce: bool, replays: int) -> float:
    """Mean microseconds per replay of a CUDA graph holding one step (after warm-up), CUDA events."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm-up: compile, NCCL communicator, cuBLAS handles
            step.run(all_reduce)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.run(all_reduce)
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / replays


def rank_main(rank: int, world: int, args) -> list[dict]:
    warnings.filterwarnings("ignore", message=".*oracle.*")  # the CPU mode's one-time "oracle path" warning
    if args.cpu:
        device, act_dtype = torch.device("cpu"), torch.float32
    else:
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device, act_dtype = torch.device("cuda", local), torch.bfloat16
    layer = full_layer(args.hidden, args.seed)
    shard = shard_of(layer, rank, world, device, act_dtype)
    records = []
    for batch in args.batch:
        record = {"case": f"B={batch}", "batch": batch, "heads": HEADS, "heads_per_gpu": shard.heads,
                  "hidden": args.hidden, "gpus": 0 if args.cpu else world, "processes": world,
                  "device": "cpu" if args.cpu else torch.cuda.get_device_name(device)}
        record.update(check(args, layer, shard, batch, device, rank, world))
        if not args.cpu:
            slots = torch.arange(1, batch + 1, dtype=torch.int32, device=device)
            pool = initial_pool(batch, args.seed)[:, shard.first:shard.first + shard.heads].to(device).contiguous()
            x = inputs(batch, args.hidden, args.seed, 0).to(device)
            step = Step(shard, pool, x, slots)
            together = time_graph(step, True, args.replays)
            alone = None
            for turn in range(world):  # each rank alone in turn, the others waiting
                if turn == rank:
                    alone = time_graph(step, False, args.replays)
                dist.barrier()
            mine = {"tp_step_us": together, "alone_step_us": alone, "contexts_active": active_contexts()}
            gathered = [None] * world
            dist.all_gather_object(gathered, mine)
            record["per_gpu"] = gathered
            record["tp_step_us_max"] = max(g["tp_step_us"] for g in gathered)
            record["alone_step_us_max"] = max(g["alone_step_us"] for g in gathered)
        if rank == 0:
            _baseline.progress(len(records) + 1, len(args.batch), f"B={batch}: passed={record['passed']}"
                               + ("" if args.cpu else f", tp {record['tp_step_us_max']:.1f} us/step, alone "
                                  f"{record['alone_step_us_max']:.1f} us/step"))
        records.append(record)
    return records


def _worker(rank: int, world: int, args, port: int, result_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        records = rank_main(rank, world, args)
        if rank == 0:
            import json

            with open(result_path, "w") as fh:
                json.dump(records, fh)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if args.cpu:
            dist.init_process_group("gloo")
        else:
            _baseline.require_cuda("tp_decode")
            local = int(os.environ.get("LOCAL_RANK", rank))
            torch.cuda.set_device(local)
            dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        try:
            records = rank_main(rank, world, args)
        finally:
            dist.destroy_process_group()
    else:
        if not args.cpu:
            raise SystemExit("tp_decode: GPUs need one process per GPU: torchrun --nproc-per-node N "
                             "examples/tp_decode.py (or --cpu --nproc N)")
        import json
        import tempfile

        import torch.multiprocessing as mp

        rank, world = 0, args.nproc
        with tempfile.TemporaryDirectory() as tmp:
            result = os.path.join(tmp, "records.json")
            mp.spawn(_worker, args=(world, args, _free_port(), result), nprocs=world, join=True)
            with open(result) as fh:
                records = json.load(fh)
    if rank == 0:
        if args.cpu and args.out is None:
            args.no_save = True  # a CPU check is no baseline
        if args.out is None and not args.no_save:
            gpu = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.cpu else None
            args.out = str(_baseline.BASELINES / f"{_baseline.gpu_folder(gpu)}x{world}" / "multi_gpu.json")
        _baseline.Run("multi_gpu", args).save(records)
        failed = [r["case"] for r in records if not r["passed"]]
        if failed:
            print(f"tp_decode: the sharded layer differs from the unsharded one at {failed}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
