"""Timing helpers shared by the kda benchmarks (GPU only; import cost is torch only).

- ``KernelTimer``: per-iteration GPU kernel time of a callable. CUPTI activity records (cupti-python) when
  available: the sum of the kernel durations each iteration launched, excluding the L2-flush kernels; else CUDA
  events around each iteration (these read about 3 us higher: they include launch gaps).
- ``graph_of(fn)``: capture one call of ``fn`` into a CUDA graph (after a warm-up call on a side stream) and
  return the replay callable.
- ``L2Flusher``: writes a buffer of at least 120 MiB (twice the H200's 60 MiB L2) between iterations.
- ``copy_roofline(nbytes)``: a device-to-device copy moving ``nbytes`` in total (half read, half written): the
  bandwidth ceiling of a kernel that streams the same bytes, measured in the same process.
- ``eager_wall_us(fn)``: host wall time per call of back-to-back eager calls (the launcher's host cost).
- ``median``, ``gpu_name``.

Output (JSON with provenance, PNG) is ``_baseline``'s.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable

import torch

MIB = 1 << 20
L2_FLUSH_BYTES = 256 * MIB  # >= 2x the H200's 60 MiB L2


def median(values):
    return float(statistics.median(values))


def gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


class L2Flusher:
    def __init__(self, nbytes: int = L2_FLUSH_BYTES, device="cuda"):
        self.buffer = torch.empty(nbytes // 4, dtype=torch.int32, device=device)
        self.step = 0

    def __call__(self):
        self.step += 1
        self.buffer.fill_(self.step)


def graph_of(fn: Callable[[], object]) -> Callable[[], None]:
    """One call of ``fn`` captured into a CUDA graph; returns ``graph.replay``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up: lazy module loads and allocations happen outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph.replay


def copy_roofline(nbytes: int, device="cuda") -> Callable[[], None]:
    """A device-to-device copy kernel moving ``nbytes`` (nbytes/2 read, nbytes/2 written).

    An elementwise kernel rather than ``copy_``: a contiguous ``copy_`` becomes a memcpy node (copy engine) under
    graph capture, which CUPTI reports as a memcpy, not a kernel, and which costs ~10 us to start at small sizes.
    """
    words = max(nbytes // 2 // 4, 1)
    src = torch.empty(words, dtype=torch.int32, device=device).random_()
    dst = torch.empty_like(src)
    return lambda: torch.bitwise_or(src, 0, out=dst)


class KernelTimer:
    """Kernel time per iteration, in microseconds: CUPTI when importable, else CUDA events."""

    def __init__(self, prefer_cupti: bool = True):
        self._records: list[tuple[str, int, int]] = []
        self.backend = "cuda_event"
        if prefer_cupti:
            try:
                from cupti import cupti

                self._cupti = cupti
                cupti.activity_register_callbacks(self._buffer_requested, self._buffer_completed)
                # Enabled once, before any graph is captured: CUPTI reports the kernels of a CUDA graph only
                # when kernel activity was on when the graph was instantiated.
                cupti.activity_enable(cupti.ActivityKind.CONCURRENT_KERNEL)
                self.backend = "cupti"
                probe = torch.zeros(1 << 16, device="cuda")
                if not self._collect(lambda: probe.add_(1)):
                    cupti.activity_disable(cupti.ActivityKind.CONCURRENT_KERNEL)
                    raise RuntimeError("CUPTI recorded no kernel activity on this host")
            except Exception as err:  # cupti-python missing or CUPTI unusable: events are the fallback
                self.backend = "cuda_event"
                print(f"[timing] CUPTI unavailable ({type(err).__name__}: {err}); using CUDA events")

    # CUPTI buffer callbacks
    @staticmethod
    def _buffer_requested():
        return 8 * MIB, 0

    def _buffer_completed(self, activities):
        for act in activities:
            if act.kind == self._cupti.ActivityKind.CONCURRENT_KERNEL:
                self._records.append((act.name, act.start, act.end))

    def _collect(self, fn: Callable[[], object]) -> list[tuple[str, int, int]]:
        self._cupti.activity_flush_all(1)
        self._records = []
        fn()
        torch.cuda.synchronize()
        self._cupti.activity_flush_all(1)
        return sorted(self._records, key=lambda r: r[1])

    @contextlib.contextmanager
    def paused(self):
        """CUPTI off (host-overhead measurements must not pay for its instrumentation)."""
        if self.backend != "cupti":
            yield
            return
        self._cupti.activity_disable(self._cupti.ActivityKind.CONCURRENT_KERNEL)
        try:
            yield
        finally:
            self._cupti.activity_enable(self._cupti.ActivityKind.CONCURRENT_KERNEL)

    def time(self, fn: Callable[[], object], *, iterations: int = 100, warmup: int = 10,
             flush: Callable[[], None] | None = None) -> list[float]:
        for _ in range(warmup):
            if flush:
                flush()
            fn()
        torch.cuda.synchronize()
        self.last_backend = self.backend
        if self.backend == "cupti":
            try:
                return self._time_cupti(fn, iterations, flush)
            except RuntimeError as err:
                print(f"[timing] CUPTI measurement failed ({err}); CUDA events for this one")
        self.last_backend = "cuda_event"
        return self._time_events(fn, iterations, flush)

    def _time_events(self, fn, iterations, flush):
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iterations)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iterations)]
        for i in range(iterations):
            if flush:
                flush()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]

    def _time_cupti(self, fn, iterations, flush):
        flush_names = {name for name, _, _ in self._collect(flush)} if flush else set()
        per_call = len([r for r in self._collect(fn) if r[0] not in flush_names])  # kernels one call launches
        if per_call == 0:
            raise RuntimeError("timed function launched no kernel")

        def run_all():
            for _ in range(iterations):
                if flush:
                    flush()
                fn()

        records = [r for r in self._collect(run_all) if r[0] not in flush_names]
        if len(records) != per_call * iterations:
            raise RuntimeError(f"CUPTI saw {len(records)} kernels for {iterations} x {per_call}")
        chunks = (records[i : i + per_call] for i in range(0, len(records), per_call))
        return [sum(end - start for _, start, end in chunk) / 1e3 for chunk in chunks]


def eager_wall_us(fn: Callable[[], object], calls: int = 200, warmup: int = 20, rounds: int = 5) -> float:
    """Host wall time per call of back-to-back eager calls (one sync per round): the median over ``rounds``
    rounds of ``calls`` calls each. A GPU host's CPU clock and neighbours make single rounds vary by 1.5x."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    per_round = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        per_round.append((time.perf_counter() - t0) / calls * 1e6)
    return median(per_round)
