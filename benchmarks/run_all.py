"""Run every benchmark (benchmarks/bench_*.py) with its defaults, one process each: the baselines, regenerated.

Each benchmark prints its provenance, checks its kernels against the kda-core oracle and FLA, and writes
benchmarks/baselines/<gpu>/<name>.{json,png} (``<gpu>`` from the GPU's name: ``h200`` on an H200). All of them but
bench_serving.py (the engine adapters' call forms, sized for about 150 s, not yet measured) take about 6 minutes on
an H200. ``nox -s bench`` runs this script; it needs a CUDA GPU, the host's torch with CUDA,
nvidia-cutlass-dsl, apache-tvm-ffi, and for the FLA columns fla-core (matplotlib for the PNGs, cupti-python for
CUPTI kernel times); nothing is installed, and the kda packages are the repository's own sources.

    python benchmarks/run_all.py                                  # every baseline
    python benchmarks/run_all.py --only packed_kda_decode ucache  # those whose name holds one of the words
    python benchmarks/run_all.py --only serving                   # the engine adapters (bench_serving.py)
    python benchmarks/run_all.py --out /tmp/bench                 # write /tmp/bench/<name>.json instead

A benchmark that fails (or passes ``--timeout``) is reported and the next one still runs; the exit status says
whether any failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def benchmarks() -> list[Path]:
    return sorted(HERE.glob("bench_*.py"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", default=None, help="run the benchmarks whose name holds one of these")
    p.add_argument("--out", default=None, help="a folder for every <name>.json + .png (default: the baselines)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per benchmark before it is stopped")
    p.add_argument("--list", action="store_true", help="print the benchmarks and exit")
    args = p.parse_args(argv)
    scripts = [s for s in benchmarks() if args.only is None or any(w in s.stem for w in args.only)]
    if args.list or not scripts:
        for script in scripts:
            print(script.relative_to(ROOT))
        return 0 if scripts or args.list else f"no benchmark matches --only {' '.join(args.only)}"
    summary, failed = [], False
    start = time.monotonic()
    for i, script in enumerate(scripts, 1):
        cmd = [sys.executable, str(script.relative_to(ROOT))] + (["--out", args.out] if args.out else [])
        print(f"=== [{i}/{len(scripts)}] {' '.join(['python', *cmd[1:]])}", flush=True)
        t0 = time.monotonic()
        try:
            rc = subprocess.run(cmd, cwd=ROOT, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = f"stopped after {args.timeout:.0f} s"
        failed |= rc != 0
        summary.append(f"{script.stem:28s} {'ok' if rc == 0 else f'FAILED ({rc})':24s} {time.monotonic() - t0:6.0f} s")
    print(f"=== {len(scripts)} benchmarks in {time.monotonic() - start:.0f} s")
    print("\n".join(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
