"""The README's main job: a Kimi K3-shaped KDA decode loop through the ``recurrent_kda`` facade.

A serving engine calls the facade once per layer per step; this loop does the same for one layer: the states live
in a pool [N, HV, V, K] larger than the batch, each request owns a slot (``--spec-t T`` > 1: a row of T slots, one
checkpoint per draft token, the first state read from the slot of the last accepted token), and padding rows carry
slot -1 or N (past the end), which docs/design.md §4 makes inactive (zero output, pool untouched).

Each step prints (or advances a progress bar with) its wall time in microseconds; at the end the demo reports the
path the facade took (``kda_recurrent.explain``), the median step time, the largest difference from the kda-core
oracle run on a mirror of the pool, and checks the bounds policy. On a GPU the facade runs the CuTe kernels; on a
machine without one it runs the oracle (and says so), so the error is zero there by construction.

    python -m kda_recurrent.demo --heads 12 --batch 8 --steps 32 --state-dtype bf16 [--spec-t 4]

``--fused`` runs a whole K3-shaped KDA layer instead (:func:`run_fused_demo`): the conv update, the recurrence and the
gated RMSNorm in one call of ``kda_recurrent.fused_kda_decode`` per step, on conv and state caches that share one
page per slot as vLLM keeps them, against kda-core's ``fused_kda_decode_ref`` on mirror caches. It prints the largest
difference and, on CUDA, each step's time as a CUDA-graph replay (the layer captured once, its inputs refreshed in
place between replays); on a machine without a GPU the call runs the oracle itself, so the error is zero there:

    python -m kda_recurrent.demo --fused --heads 12 --batch 8 --steps 8 [--state-dtype fp32]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field

import torch

from kda_core.contracts import HEAD_DIM
from kda_core.oracle import recurrent_kda_ref
from kda_core.oracle_fused import fused_kda_decode_ref
from kda_recurrent.facade import explain, recurrent_kda
from kda_recurrent.fused import fused_kda_decode

K3_LOWER_BOUND = -5.0
"""Kimi K3's gate: g_log = lower_bound * sigmoid(exp(A_log) * (g + dt_bias)) (docs/design.md §3, lower-bound form)."""
STATE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MAX_ERR = 5e-2
"""Largest tolerated |facade - oracle| over outputs and pool: a few bf16 roundings of O(1) values."""


@dataclass
class DemoRun:
    """Everything one run produced, so that a test can check it against an independent computation."""

    slots: torch.Tensor  # [batch] int32 (T=1) or [batch, T] (spec decode); -1 or pool_size on padding rows
    initial_pool: torch.Tensor  # [N, HV, V, K] before the first step
    pool: torch.Tensor  # [N, HV, V, K] after the last step (updated in place by the facade)
    A_log: torch.Tensor  # [H] fp32
    dt_bias: torch.Tensor  # [H * K] fp32
    inputs: list[tuple[torch.Tensor, ...]] = field(default_factory=list)  # per step: q, k, v, g, beta
    accepted: list[torch.Tensor | None] = field(default_factory=list)  # per step: num_accepted_tokens (spec)
    outputs: list[torch.Tensor] = field(default_factory=list)  # per step: o [batch, T, HV, V] bf16
    step_us: list[float] = field(default_factory=list)
    max_err: float = 0.0  # largest |facade - oracle| over every output and the final pool
    path: str = ""
    reason: str = ""

    @property
    def step_ms(self) -> list[float]:
        return [us / 1e3 for us in self.step_us]

    @property
    def checksums(self) -> list[float]:
        return [output_checksum(o) for o in self.outputs]


def output_checksum(o: torch.Tensor) -> float:
    """Sum of one step's output in fp64: a fingerprint that changes when any output element does."""
    return float(o.double().sum())


def pool_checksum(pool: torch.Tensor) -> float:
    return float(pool.double().sum())


def padding_slots(batch: int, pool_size: int, padding: int, generator: torch.Generator, spec_t: int = 1):
    """Slots of each request: distinct random pool rows for the real requests ([batch] for T=1, [batch, T] rows of
    T distinct slots for spec decode); padding rows alternate -1 and N (past the end)."""
    active = batch - padding
    rows = torch.randperm(pool_size, generator=generator)[: active * spec_t].to(torch.int32).reshape(active, spec_t)
    pads = torch.tensor([-1 if i % 2 == 0 else pool_size for i in range(padding)], dtype=torch.int32)
    order = torch.randperm(batch, generator=generator)
    slots = torch.cat([rows, pads[:, None].expand(padding, spec_t)])[order]
    return slots[:, 0].contiguous() if spec_t == 1 else slots.contiguous()


class _Progress:
    """A progress bar on stderr (tqdm when installed, else one line rewritten in place) and/or one stdout line per
    step (``lines``): short runs print every step, long runs only advance the bar."""

    def __init__(self, total: int, lines: bool, log):
        self.total, self.lines, self.log, self.n, self.bar = total, lines, log, 0, None
        try:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="step", leave=False, file=sys.stderr)
        except ImportError:
            pass

    def update(self, text: str, us: float):
        self.n += 1
        if self.bar is not None:
            self.bar.set_postfix_str(f"{us:.1f} us")
            self.bar.update()
        elif not self.lines:
            end = "\n" if self.n == self.total else ""
            print(f"\r  step {self.n}/{self.total}  {us:10.1f} us", end=end, file=sys.stderr, flush=True)
        if self.lines:
            if self.bar is not None:
                self.bar.clear()
            self.log(text)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def run_demo(
    heads: int = 12,
    batch: int = 8,
    steps: int = 8,
    state_dtype: str = "bf16",
    pool_size: int | None = None,
    padding: int | None = None,
    seed: int = 0,
    log=print,
    spec_t: int = 1,
    device: str | None = None,
    per_step_lines: bool = True,
) -> DemoRun:
    """Run the decode loop through the facade (and the oracle on a mirror pool); ``log`` receives each line."""
    K = V = HEAD_DIM
    H = HV = heads
    T = spec_t
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    pool_size = 2 * batch * T if pool_size is None else pool_size
    padding = max(1, batch // 4) if padding is None else padding
    if T < 1:
        raise ValueError(f"spec_t: expected a positive token count, got {T}")
    if not 0 <= padding < batch:
        raise ValueError(f"padding: expected 0 <= padding < batch ({batch}), got {padding}")
    if pool_size < (batch - padding) * T:
        raise ValueError(f"pool_size: expected at least {(batch - padding) * T} slots (active rows x T), "
                         f"got {pool_size}")
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)

    slots = padding_slots(batch, pool_size, padding, gen, T).to(device)
    pool = randn(pool_size, HV, V, K, scale=0.05, dtype=STATE_DTYPES[state_dtype])
    run = DemoRun(
        slots=slots,
        initial_pool=pool.clone(),
        pool=pool,
        A_log=torch.log(torch.linspace(1.0, 16.0, H)).to(device),
        dt_bias=randn(H * K, scale=0.1, dtype=torch.float32),
    )
    ref_pool = pool.clone()
    gate = dict(A_log=run.A_log, dt_bias=run.dt_bias, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                lower_bound=K3_LOWER_BOUND, beta_is_logit=True)
    output = torch.empty(batch, T, HV, V, dtype=torch.bfloat16, device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    bar = _Progress(steps, per_step_lines, log)
    for step in range(steps):
        q, k = randn(batch, T, H, K), randn(batch, T, H, K)
        v, g, beta = randn(batch, T, HV, V), randn(batch, T, HV, K), randn(batch, T, HV)
        accepted = None
        if T > 1:
            accepted = torch.randint(1, T + 1, (batch,), generator=gen, dtype=torch.int32).to(device)
        call = dict(initial_state=pool, ssm_state_indices=slots, num_accepted_tokens=accepted, **gate)
        if step == 0:
            run.path, run.reason = explain(q, k, v, g, beta, output=output, **call)
            log(f"kda demo: Kimi K3-shaped decode, H=HV={H}, K=V={K}, lower-bound gate {K3_LOWER_BOUND}, "
                f"T={T} token(s) per request per step\n"
                f"  device {device}; facade path: {run.path.value} ({run.reason})\n"
                + ("  no GPU here: the facade runs the kda-core PyTorch oracle on the CPU (slow, exact)\n"
                   if device == "cpu" else "")
                + f"  pool: {pool_size} slots of [{HV}, {V}, {K}] {state_dtype}; batch {batch} with {padding} "
                f"padding rows")
        sync()
        start = time.perf_counter()
        o, _ = recurrent_kda(q, k, v, g, beta, output=output, **call)
        sync()
        elapsed_us = (time.perf_counter() - start) * 1e6
        o_ref, _ = recurrent_kda_ref(q, k, v, g, beta, **{**call, "initial_state": ref_pool})
        run.max_err = max(run.max_err, float((o.float() - o_ref.float()).abs().max()))
        run.inputs.append((q, k, v, g, beta))
        run.accepted.append(accepted)
        run.outputs.append(o.clone())
        run.step_us.append(elapsed_us)
        bar.update(f"  step {step + 1:3d}/{steps}  {elapsed_us:10.1f} us = {elapsed_us / 1e3:9.3f} ms  checksum "
                   f"{output_checksum(o):+.6e}", elapsed_us)
    bar.close()
    run.max_err = max(run.max_err, float((pool.float() - ref_pool.float()).abs().max()))
    return run


def check_bounds_policy(run: DemoRun) -> list[str]:
    """docs/design.md §4 on this run: padding rows output zeros, pool rows no request owns are bitwise unchanged."""
    problems = []
    pool_size = run.pool.shape[0]
    slots = run.slots if run.slots.dim() == 2 else run.slots[:, None]
    inactive_row = ((slots < 0) | (slots >= pool_size)).all(dim=1)
    for step, o in enumerate(run.outputs):
        if bool(o[inactive_row].any()):
            problems.append(f"step {step + 1}: a padding row has a non-zero output")
    owned = torch.zeros(pool_size, dtype=torch.bool, device=run.pool.device)
    valid = (slots >= 0) & (slots < pool_size)
    owned[slots[valid].long()] = True
    if not torch.equal(run.pool[~owned], run.initial_pool[~owned]):
        problems.append("a pool row that no request owns changed")
    return problems


@dataclass
class FusedDemoRun:
    """One fused-layer run: what a test needs to check it."""

    slots: torch.Tensor  # [batch] int32; 0 (vLLM's null block) or N on padding rows
    initial_pages: torch.Tensor  # [N, page bytes] uint8: both caches of every slot before the first step
    pages: torch.Tensor  # [N, page bytes] after the last step
    layer: dict = field(default_factory=dict)  # weight, A_log, dt_bias, norm_weight, lower_bound
    inputs: list[dict] = field(default_factory=list)  # per step: x, raw_gate, raw_beta, output_gate
    outputs: list[torch.Tensor] = field(default_factory=list)  # per step: [1, batch, H, 128] bf16
    step_us: list[float] = field(default_factory=list)
    max_err: float = 0.0  # largest |layer - oracle| over every output, the conv cache and the state
    graph: bool = False  # the steps were CUDA-graph replays
    state_dtype: torch.dtype = torch.float32


def fused_page_views(pages: torch.Tensor, H: int, state_dtype: torch.dtype):
    """(conv [slots, C, 3] bf16, state [slots, H, 128, 128]) views of ``pages`` [slots, page] uint8: each slot's conv
    cache (SD: columns channel-contiguous) and then its state, vLLM's hybrid cache layout."""
    slots, page = pages.shape
    C = 3 * H * HEAD_DIM
    elem = torch.empty((), dtype=state_dtype).element_size()
    conv_bytes = C * 3 * 2
    flat = pages.view(-1)
    conv = torch.as_strided(flat.view(torch.bfloat16), (slots, C, 3), (page // 2, 1, C))
    state = torch.as_strided(flat.view(state_dtype), (slots, H, HEAD_DIM, HEAD_DIM),
                             (page // elem, HEAD_DIM * HEAD_DIM, HEAD_DIM, 1), conv_bytes // elem)
    return conv, state


def fused_pages(slots: int, C: int, H: int, state_dtype: torch.dtype, device: str):
    """Zeroed pages for ``slots`` slots of both caches; returns (pages [slots, page] uint8, conv view, state view)."""
    elem = torch.empty((), dtype=state_dtype).element_size()
    pages = torch.zeros(slots, C * 3 * 2 + H * HEAD_DIM * HEAD_DIM * elem, dtype=torch.uint8, device=device)
    return (pages, *fused_page_views(pages, H, state_dtype))


def run_fused_demo(
    heads: int = 12,
    batch: int = 8,
    steps: int = 8,
    state_dtype: str = "fp32",
    pool_size: int | None = None,
    padding: int | None = None,
    seed: int = 0,
    log=print,
    device: str | None = None,
    graph: bool | None = None,
) -> FusedDemoRun:
    """Run ``steps`` fused T=1 layer steps through :func:`kda_recurrent.fused_kda_decode` (and kda-core's reference
    on mirror caches); ``graph`` (default: on CUDA) captures the call once and replays it per step."""
    H, D = heads, HEAD_DIM
    C = 3 * H * D
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    graph = device.startswith("cuda") if graph is None else graph
    pool_size = 2 * batch + 1 if pool_size is None else pool_size
    padding = max(1, batch // 4) if padding is None else padding
    if not 0 <= padding < batch:
        raise ValueError(f"padding: expected 0 <= padding < batch ({batch}), got {padding}")
    if pool_size < batch - padding + 1:
        raise ValueError(f"pool_size: expected at least {batch - padding + 1} slots (active rows + the null slot 0), "
                         f"got {pool_size}")
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=device)

    # Slots: distinct live slots in [1, N) (slot 0 is vLLM's null block); padding rows alternate 0 and N.
    live = (torch.randperm(pool_size - 1, generator=gen)[: batch - padding] + 1).to(torch.int32)
    pads = torch.tensor([0 if i % 2 == 0 else pool_size for i in range(padding)], dtype=torch.int32)
    slots = torch.cat([live, pads])[torch.randperm(batch, generator=gen)].to(device)
    dtype = STATE_DTYPES[state_dtype]
    pages, conv, state = fused_pages(pool_size, C, H, dtype, device)
    conv.copy_(randn(pool_size, C, 3, scale=0.5))
    state.copy_(randn(pool_size, H, D, D, scale=0.05, dtype=dtype))
    ref_pages, ref_conv, ref_state = fused_pages(pool_size, C, H, dtype, device)
    ref_pages.copy_(pages)
    layer = dict(weight=randn(3, 4, H * D, scale=0.3, dtype=torch.float32),
                 A_log=torch.log(torch.linspace(1.0, 16.0, H)).to(device),
                 dt_bias=randn(H * D, scale=0.1, dtype=torch.float32),
                 norm_weight=(1.0 + randn(D, scale=0.1, dtype=torch.float32)), lower_bound=K3_LOWER_BOUND)
    x_rows = torch.empty(batch, C + 16, dtype=torch.bfloat16, device=device)  # x: a row-strided view, as the GEMM's
    inputs = dict(x=x_rows[:, :C], raw_gate=torch.empty(1, batch, H, D, dtype=torch.bfloat16, device=device),
                  raw_beta=torch.empty(1, batch, H, dtype=torch.bfloat16, device=device),
                  output_gate=torch.empty(batch, H, D, dtype=torch.bfloat16, device=device))
    output = torch.empty(1, batch, H, D, dtype=torch.bfloat16, device=device)
    run = FusedDemoRun(slots=slots, initial_pages=pages.clone(), pages=pages, layer=layer, graph=graph,
                       state_dtype=dtype)

    def refresh():
        for t in inputs.values():
            t.copy_(randn(*t.shape))

    def call(conv_cache, state_cache):
        return fused_kda_decode(inputs["x"], layer["weight"], conv_cache, inputs["raw_gate"], inputs["raw_beta"],
                                layer["A_log"], layer["dt_bias"], slots, state_cache, inputs["output_gate"],
                                layer["norm_weight"], layer["lower_bound"], output=output)

    log(f"kda demo --fused: Kimi K3-shaped KDA layer (conv + recurrence + gated RMSNorm in one call), H={H}, "
        f"head dim {D}, lower-bound gate {K3_LOWER_BOUND}\n"
        f"  device {device}; "
        + ("each step is a CUDA-graph replay of kda_recurrent.fused_kda_decode\n" if graph else
           "kda_recurrent.fused_kda_decode called eagerly\n")
        + ("  no GPU here: the call runs the kda-core PyTorch oracle on the CPU (slow, exact)\n"
           if device == "cpu" else "")
        + f"  caches: {pool_size} slots, conv [{C}, 3] bf16 and state [{H}, {D}, {D}] {state_dtype} in one page per "
        f"slot; batch {batch} with {padding} padding rows (slot 0 or {pool_size})")
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    replay = None
    if graph:
        refresh()
        scratch_pages, scratch_conv, scratch_state = fused_pages(pool_size, C, H, dtype, device)
        scratch_pages.copy_(pages)
        call(scratch_conv, scratch_state)  # compile and load the kernel before capture, on scratch caches
        sync()
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            call(conv, state)
        replay = cuda_graph.replay
        del scratch_pages, scratch_conv, scratch_state
    for step in range(steps):
        refresh()
        sync()
        if replay is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            replay()
            end.record()
            end.synchronize()
            elapsed_us = start.elapsed_time(end) * 1e3
        else:
            t0 = time.perf_counter()
            call(conv, state)
            sync()
            elapsed_us = (time.perf_counter() - t0) * 1e6
        want = fused_kda_decode_ref(inputs["x"], layer["weight"], ref_conv, inputs["raw_gate"], inputs["raw_beta"],
                                    layer["A_log"], layer["dt_bias"], slots, ref_state, inputs["output_gate"],
                                    layer["norm_weight"], layer["lower_bound"])
        run.max_err = max(run.max_err, float((output.float() - want.float()).abs().max()))
        run.inputs.append({name: t.clone() for name, t in inputs.items()})
        run.outputs.append(output.clone())
        run.step_us.append(elapsed_us)
        log(f"  step {step + 1:3d}/{steps}  {elapsed_us:10.1f} us  max |layer - oracle| so far {run.max_err:.3e}")
    run.max_err = max(run.max_err, float((conv.float() - ref_conv.float()).abs().max()),
                      float((state.float() - ref_state.float()).abs().max()))
    return run


def check_fused_bounds(run: FusedDemoRun) -> list[str]:
    """vLLM's null policy on this run: padding rows (slot 0 or N) output zeros; the page of every slot no live row
    names (slot 0 among them) is bitwise unchanged, both caches."""
    problems = []
    N = run.pages.shape[0]
    live = (run.slots > 0) & (run.slots < N)
    for step, o in enumerate(run.outputs):
        if bool(o[0, ~live].any()):
            problems.append(f"step {step + 1}: a padding row has a non-zero output")
    owned = torch.zeros(N, dtype=torch.bool, device=run.pages.device)
    owned[run.slots[live].long()] = True
    if not torch.equal(run.pages[~owned], run.initial_pages[~owned]):
        problems.append("a page (conv cache or state) that no request owns changed")
    return problems


def _fused_main(args, parser) -> int:
    try:
        run = run_fused_demo(args.heads, args.batch, args.steps, args.state_dtype or "fp32", args.pool_size,
                             args.padding, args.seed, device=args.device)
    except ValueError as err:
        parser.error(str(err))
    times = sorted(run.step_us)
    kind = "CUDA-graph replay" if run.graph else "eager call"
    print(f"  median step {times[len(times) // 2]:.1f} us ({kind}) over {len(times)} steps; max |layer - oracle| "
          f"{run.max_err:.3e} over outputs, conv cache and state")
    problems = check_fused_bounds(run)
    if run.max_err > MAX_ERR:
        problems.append(f"max |layer - oracle| {run.max_err:.3e} exceeds {MAX_ERR}")
    for problem in problems:
        print(f"  FAILED: {problem}")
    if problems:
        return 1
    print("  null policy holds: padding rows output zeros, pages no request owns are bitwise unchanged")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kda_recurrent.demo",
        description="Kimi K3-shaped KDA decode loop over a padded state pool through recurrent_kda "
        "(GPU kernels on CUDA, the kda-core oracle on a CPU-only machine).",
    )
    parser.add_argument("--heads", type=int, default=12, help="H = HV heads (Kimi K3: 12 at TP=8); default 12")
    parser.add_argument("--batch", type=int, default=8, help="rows per step, padding rows included; default 8")
    parser.add_argument("--steps", type=int, default=8, help="decode steps; default 8")
    parser.add_argument("--state-dtype", choices=sorted(STATE_DTYPES), default=None,
                        help="pool dtype; default bf16 (fp32 with --fused, Kimi K3's serving state)")
    parser.add_argument("--spec-t", type=int, default=1,
                        help="tokens per request per step: 1 = plain decode; T > 1 = spec decode verification with "
                        "one checkpoint slot per token (docs/design.md §5); default 1")
    parser.add_argument("--pool-size", type=int, default=None, help="slots in the pool; default 2 * batch * spec-t")
    parser.add_argument("--padding", type=int, default=None, help="padding rows (slot -1 or N); default batch // 4")
    parser.add_argument("--device", default=None, help="cuda or cpu; default cuda when available")
    parser.add_argument("--lines", choices=["auto", "all", "none"], default="auto",
                        help="one stdout line per step: all, none (progress bar only), auto (all up to 16 steps)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fused", action="store_true",
                        help="run the whole fused layer (conv + recurrence + gated RMSNorm) through "
                        "kda_recurrent.fused_kda_decode instead; on CUDA each step is a CUDA-graph replay")
    args = parser.parse_args(argv)
    for name in ("heads", "batch", "steps", "spec_t"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected a positive integer, got {getattr(args, name)}")
    if args.fused:
        if args.spec_t != 1:
            parser.error("--fused: the fused layer is the T=1 step (--spec-t 1)")
        return _fused_main(args, parser)
    try:
        run = run_demo(args.heads, args.batch, args.steps, args.state_dtype or "bf16", args.pool_size, args.padding,
                       args.seed, spec_t=args.spec_t, device=args.device,
                       per_step_lines=args.lines == "all" or (args.lines == "auto" and args.steps <= 16))
    except ValueError as err:
        parser.error(str(err))
    times = sorted(run.step_us)
    print(f"  path {run.path.value}; median step {times[len(times) // 2]:.1f} us over {len(times)} steps "
          f"(first step {run.step_us[0]:.1f} us includes compilation); max |facade - oracle| {run.max_err:.3e}; "
          f"final pool checksum {pool_checksum(run.pool):+.6e}")
    problems = check_bounds_policy(run)
    if run.max_err > MAX_ERR:
        problems.append(f"max |facade - oracle| {run.max_err:.3e} exceeds {MAX_ERR} (bf16 outputs and pool)")
    for problem in problems:
        print(f"  FAILED: {problem}")
    if problems:
        return 1
    print("  bounds policy holds: padding rows output zeros, pool rows no request owns are bitwise unchanged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
