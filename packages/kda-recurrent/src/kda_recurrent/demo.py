"""The README's main job: a Kimi K3-shaped KDA decode loop over a state pool with padding slots.

Every step feeds one new token (T=1) per request through the kda-core PyTorch oracle ``recurrent_kda_ref``, the
way a serving engine calls the facade once per layer per step: the states live in a pool [N, HV, V, K] larger
than the batch, each request owns one slot, and padding rows carry slot -1 or N (past the end), which DESIGN §4
makes inactive (zero output, pool untouched). It prints the time of each step and a checksum, then checks the
bounds policy: padding rows gave zeros and pool rows no request owns are bitwise unchanged.

This runs the reference on the CPU (fp32 math); it measures nothing about the GPU kernels.

    python -m kda_recurrent.demo --heads 12 --batch 8 --steps 8 --state-dtype bf16
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field

import torch

from kda_core.contracts import HEAD_DIM
from kda_core.oracle import recurrent_kda_ref

K3_LOWER_BOUND = -5.0
"""Kimi K3's gate: g_log = lower_bound * sigmoid(exp(A_log) * (g + dt_bias)) (DESIGN §3, lower-bound form)."""
STATE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass
class DemoRun:
    """Everything one run produced, so that a test can check it against an independent computation."""

    slots: torch.Tensor  # [batch] int32: a pool row for each request, -1 or pool_size for padding rows
    initial_pool: torch.Tensor  # [N, HV, V, K] before the first step
    pool: torch.Tensor  # [N, HV, V, K] after the last step (updated in place by the oracle)
    A_log: torch.Tensor  # [H] fp32
    dt_bias: torch.Tensor  # [H * K] fp32
    inputs: list[tuple[torch.Tensor, ...]] = field(default_factory=list)  # per step: q, k, v, g, beta
    outputs: list[torch.Tensor] = field(default_factory=list)  # per step: o [batch, 1, HV, V] bf16
    step_ms: list[float] = field(default_factory=list)

    @property
    def checksums(self) -> list[float]:
        return [output_checksum(o) for o in self.outputs]


def output_checksum(o: torch.Tensor) -> float:
    """Sum of one step's output in fp64: a fingerprint that changes when any output element does."""
    return float(o.double().sum())


def pool_checksum(pool: torch.Tensor) -> float:
    return float(pool.double().sum())


def padding_slots(batch: int, pool_size: int, padding: int, generator: torch.Generator) -> torch.Tensor:
    """Slot of each request: distinct random pool rows for the real requests; padding rows alternate -1 and N."""
    active = batch - padding
    slots = torch.randperm(pool_size, generator=generator)[:active].to(torch.int32)
    pads = torch.tensor([-1 if i % 2 == 0 else pool_size for i in range(padding)], dtype=torch.int32)
    order = torch.randperm(batch, generator=generator)
    return torch.cat([slots, pads])[order]


def run_demo(
    heads: int = 12,
    batch: int = 8,
    steps: int = 8,
    state_dtype: str = "bf16",
    pool_size: int | None = None,
    padding: int | None = None,
    seed: int = 0,
    log=print,
) -> DemoRun:
    """Run the decode loop on the CPU oracle; ``log`` receives each printed line."""
    K = V = HEAD_DIM
    H = HV = heads
    pool_size = 2 * batch if pool_size is None else pool_size
    padding = max(1, batch // 4) if padding is None else padding
    if not 0 <= padding < batch:
        raise ValueError(f"padding: expected 0 <= padding < batch ({batch}), got {padding}")
    if pool_size < batch - padding:
        raise ValueError(f"pool_size: expected at least the {batch - padding} active requests, got {pool_size}")
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    slots = padding_slots(batch, pool_size, padding, gen)
    pool = randn(pool_size, HV, V, K, scale=0.05, dtype=STATE_DTYPES[state_dtype])
    run = DemoRun(
        slots=slots,
        initial_pool=pool.clone(),
        pool=pool,
        A_log=torch.log(torch.linspace(1.0, 16.0, H)),
        dt_bias=randn(H * K, scale=0.1, dtype=torch.float32),
    )
    log(
        f"kda demo: Kimi K3-shaped decode, H=HV={H}, K=V={K}, lower-bound gate {K3_LOWER_BOUND}, T=1 per step\n"
        f"  runs the kda-core PyTorch oracle (recurrent_kda_ref) on the CPU in fp32; no GPU kernel is involved\n"
        f"  pool: {pool_size} slots of [{HV}, {V}, {K}] {state_dtype}; batch {batch} with {padding} padding rows; "
        f"slots {slots.tolist()}"
    )
    for step in range(steps):
        q, k = randn(batch, 1, H, K), randn(batch, 1, H, K)
        v, g, beta = randn(batch, 1, HV, V), randn(batch, 1, HV, K), randn(batch, 1, HV)
        start = time.perf_counter()
        o, _ = recurrent_kda_ref(
            q, k, v, g, beta,
            A_log=run.A_log, dt_bias=run.dt_bias, initial_state=pool, ssm_state_indices=slots,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=K3_LOWER_BOUND, beta_is_logit=True,
        )  # fmt: skip
        elapsed_ms = (time.perf_counter() - start) * 1e3
        run.inputs.append((q, k, v, g, beta))
        run.outputs.append(o)
        run.step_ms.append(elapsed_ms)
        log(f"  step {step + 1:3d}/{steps}  {elapsed_ms:8.2f} ms  checksum {output_checksum(o):+.6e}")
    return run


def check_bounds_policy(run: DemoRun) -> list[str]:
    """DESIGN §4 on this run: padding rows output zeros, pool rows no request owns are bitwise unchanged."""
    problems = []
    pool_size = run.pool.shape[0]
    inactive = (run.slots < 0) | (run.slots >= pool_size)
    for step, o in enumerate(run.outputs):
        if bool(o[inactive].any()):
            problems.append(f"step {step + 1}: a padding row has a non-zero output")
    owned = torch.zeros(pool_size, dtype=torch.bool)
    owned[run.slots[~inactive].long()] = True
    if not torch.equal(run.pool[~owned], run.initial_pool[~owned]):
        problems.append("a pool row that no request owns changed")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kda_recurrent.demo",
        description="Kimi K3-shaped KDA decode loop (T=1) over a padded state pool, on the kda-core CPU oracle.",
    )
    parser.add_argument("--heads", type=int, default=12, help="H = HV heads (Kimi K3: 12 at TP=8); default 12")
    parser.add_argument("--batch", type=int, default=8, help="rows per step, padding rows included; default 8")
    parser.add_argument("--steps", type=int, default=8, help="decode steps; default 8")
    parser.add_argument("--state-dtype", choices=sorted(STATE_DTYPES), default="bf16", help="pool dtype")
    parser.add_argument("--pool-size", type=int, default=None, help="slots in the pool; default 2 * batch")
    parser.add_argument("--padding", type=int, default=None, help="padding rows (slot -1 or N); default batch // 4")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("heads", "batch", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: expected a positive integer, got {getattr(args, name)}")
    try:
        run = run_demo(
            args.heads, args.batch, args.steps, args.state_dtype, args.pool_size, args.padding, args.seed
        )
    except ValueError as err:
        parser.error(str(err))
    times = sorted(run.step_ms)
    print(
        f"  median step {times[len(times) // 2]:.2f} ms over {len(times)} steps; "
        f"final pool checksum {pool_checksum(run.pool):+.6e}"
    )
    problems = check_bounds_policy(run)
    for problem in problems:
        print(f"  FAILED: {problem}")
    if problems:
        return 1
    print("  bounds policy holds: padding rows output zeros, pool rows no request owns are bitwise unchanged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
