"""Provenance and output of the kda benchmarks: every ``bench_*.py`` writes one JSON file and one PNG through here.

The JSON is ``{"provenance": {...}, "records": [...]}``; the provenance says what produced the records:

- ``commit``: the ``KDA_COMMIT`` environment variable when it is set (a copy of the tree whose ``.git`` is absent or
  not the tree's own, as on a GPU host the tree was copied to), else ``git rev-parse HEAD`` of this repository, with
  ``-dirty`` when a tracked file differs from it (changes under ``benchmarks/baselines/`` do not count: a run of
  every benchmark rewrites them), else null;
- ``command``: the command line, from the repository root (``python benchmarks/bench_x.py ...``), without the
  output options ``--out`` and ``--no-save``;
- ``gpu``, ``compute_capability``, ``driver`` (``nvidia-smi``), ``cuda`` (torch's CUDA runtime), ``timer``
  (``cupti`` or ``cuda_event``, see ``_timing.KernelTimer``);
- ``versions``: ``torch``, ``nvidia-cutlass-dsl``, ``fla-core`` (null when FLA is not installed); ``python``;
- ``date``: UTC, ISO 8601.

By default the files go to ``benchmarks/baselines/<gpu>/<name>.{json,png}``, ``<gpu>`` read from the GPU's name
(``h200`` for an NVIDIA H200): the committed baselines, which ``nox -s bench`` (``python benchmarks/run_all.py``)
regenerates. ``--out`` writes elsewhere (a ``.json`` path, or a folder for ``<name>.json``), ``--no-save`` nowhere.
While a benchmark runs, what it has measured so far is kept in ``<name>.partial.json`` next to the output (so a run
cut short by a time limit keeps its records); the finished run replaces it with ``<name>.json``.

Importing this module puts the repository's ``packages/*/src`` first on ``sys.path``: a benchmark measures the
sources of the commit it records, installed or not.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINES = ROOT / "benchmarks" / "baselines"
for _src in sorted((ROOT / "packages").glob("*/src"), reverse=True):
    if str(_src) not in sys.path:
        sys.path.insert(0, str(_src))


# ---------------------------------------------------------------------------------------------------------------
# provenance


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def commit() -> str | None:
    given = os.environ.get("KDA_COMMIT")
    if given:
        return given
    head = _git("rev-parse", "HEAD")
    if head is None:
        return None
    changed = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/baselines")
    return head + ("-dirty" if changed else "")


def command(argv: list[str] | None = None) -> str:
    """The command line from the repository root, without the output options (where the files go does not change
    what they hold, and a baseline written through ``--out`` elsewhere reads the same as one written in place)."""
    argv = sys.argv if argv is None else argv
    script = Path(argv[0]).resolve()
    first = str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) else argv[0]
    rest, skip = [], False
    for arg in argv[1:]:
        if skip:
            skip = False
        elif arg == "--out":
            skip = True
        elif arg != "--no-save" and not arg.startswith("--out="):
            rest.append(arg)
    return shlex.join(["python", first, *rest])


def _version(*distributions: str) -> str | None:
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def driver_version() -> str | None:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.split()
    return lines[0] if done.returncode == 0 and lines else None


def gpu_folder(gpu: str | None) -> str:
    """Folder name of a GPU: ``NVIDIA H200`` -> ``h200``, ``NVIDIA H100 80GB HBM3`` -> ``h100``, ``NVIDIA GeForce
    RTX 4090`` -> ``rtx-4090``; ``cpu`` without one. The words up to the first that holds a digit (the model)."""
    if not gpu:
        return "cpu"
    words = [w for w in re.split(r"[\s_-]+", gpu.lower()) if w and w not in ("nvidia", "geforce", "tesla")]
    kept = []
    for word in words:
        kept.append(re.sub(r"[^a-z0-9.]", "", word))
        if any(c.isdigit() for c in word):
            break
    return "-".join(w for w in kept if w) or "gpu"


def provenance() -> dict:
    import torch

    cuda = torch.cuda.is_available()
    gpu = torch.cuda.get_device_name() if cuda else None
    major, minor = torch.cuda.get_device_capability() if cuda else (None, None)
    return {
        "commit": commit(),
        "command": command(),
        "gpu": gpu,
        "compute_capability": f"sm_{major}{minor}" if cuda else None,
        "driver": driver_version() if cuda else None,
        "cuda": torch.version.cuda,
        "versions": {
            "torch": torch.__version__,
            "nvidia-cutlass-dsl": _version("nvidia-cutlass-dsl"),
            "fla-core": _version("fla-core", "flash-linear-attention"),
        },
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


# ---------------------------------------------------------------------------------------------------------------
# command line and output


def add_output_args(parser: argparse.ArgumentParser, resumable: bool = False) -> None:
    """--out and --no-save; --resume too for a benchmark that skips the points of ``Run.resumed``."""
    group = parser.add_argument_group("output")
    group.add_argument("--out", default=None,
                       help="where the JSON goes: a .json path, or a folder for <name>.json (default: the baseline, "
                            "benchmarks/baselines/<gpu>/<name>.json); the PNG goes next to it")
    group.add_argument("--no-save", action="store_true", help="print only: write no JSON and no PNG")
    if resumable:
        group.add_argument("--resume", action="store_true",
                           help="continue a run cut short: keep the records of <name>.partial.json next to the "
                                "output when they were measured on the same commit, GPU and driver, and measure only "
                                "the rest")


def parser(doc: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def require_cuda(what: str) -> None:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(f"{what}: needs a CUDA GPU and a CUDA build of torch (torch {torch.__version__} sees none)")


class Run:
    """One benchmark run: its provenance (printed at once) and where its JSON and PNG go."""

    def __init__(self, name: str, args: argparse.Namespace):
        self.name = name
        self.provenance = provenance()
        self.json_path = None if args.no_save else self._resolve(args.out)
        self._print()
        self.resumed = self._load_partial() if getattr(args, "resume", False) else []

    def _load_partial(self) -> list:
        """The records a cut-short run of the same commit on the same GPU kept (none if it differs or is absent)."""
        if self.json_path is None or not self._partial_path.exists():
            print("resume: no partial records; measuring every point")
            return []
        with open(self._partial_path) as fh:
            kept = json.load(fh)
        theirs = kept.get("provenance", {})
        for key in ("commit", "gpu", "driver"):
            if theirs.get(key) != self.provenance[key]:
                print(f"resume: the partial records' {key} is {theirs.get(key)!r}, this run's "
                      f"{self.provenance[key]!r}; measuring every point")
                return []
        print(f"resume: keeping {len(kept['records'])} records of {self._shown(self._partial_path)}")
        self.provenance["resumed"] = {"records": len(kept["records"]), "first_date": theirs.get("date")}
        return kept["records"]

    def _resolve(self, out: str | None) -> Path:
        if out is None:
            return BASELINES / gpu_folder(self.provenance["gpu"]) / f"{self.name}.json"
        path = Path(out)
        return path if path.suffix == ".json" else path / f"{self.name}.json"

    @property
    def png_path(self) -> Path | None:
        return None if self.json_path is None else self.json_path.with_suffix(".png")

    @property
    def _partial_path(self) -> Path:
        return self.json_path.with_name(self.json_path.stem + ".partial.json")

    def _print(self) -> None:
        p = self.provenance
        v = p["versions"]
        gpu = (f"{p['gpu']} ({p['compute_capability']}, driver {p['driver']}, CUDA {p['cuda']})" if p["gpu"]
               else "none")
        rows = [
            ("commit", p["commit"] or "unknown (no git; set KDA_COMMIT)"),
            ("command", p["command"]),
            ("gpu", gpu),
            ("versions", f"torch {v['torch']}, nvidia-cutlass-dsl {v['nvidia-cutlass-dsl']}, fla-core {v['fla-core']}"),
            ("python", f"{p['python']} ({platform.machine()})"),
            ("date", p["date"]),
            ("output", f"{self._shown(self.json_path)} (+ .png)" if self.json_path else "none (--no-save)"),
        ]
        print(f"kda benchmark {self.name}")
        for key, value in rows:
            print(f"  {key:9s} {value}")
        sys.stdout.flush()

    @staticmethod
    def _shown(path: Path) -> str:
        path = path.resolve()
        return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)

    def _write(self, path: Path, records: list) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as fh:
            json.dump({"provenance": self.provenance, "records": records}, fh, indent=1, default=str)
            fh.write("\n")
        os.replace(tmp, path)

    def checkpoint(self, records: list) -> None:
        """Keep what was measured so far in ``<name>.partial.json`` (a run cut short keeps its records)."""
        if self.json_path is not None:
            self._write(self._partial_path, records)

    def save(self, records: list) -> None:
        if self.json_path is None:
            return
        self._write(self.json_path, records)
        self._partial_path.unlink(missing_ok=True)
        print(f"wrote {self._shown(self.json_path)} ({len(records)} records)")

    def plot(self, panels: list[dict], title: str) -> None:
        if self.png_path is not None:
            write_plot(self.png_path, panels, title=title)


def progress(i: int, n: int, text: str) -> None:
    """The progress line every benchmark prints, one a measured point: ``[i/n] text``."""
    print(f"[{i}/{n}] {text}", flush=True)


# ---------------------------------------------------------------------------------------------------------------
# plots


def write_plot(path: Path, panels: list[dict], *, title: str) -> None:
    """One PNG, one panel a dict: a line panel (``records``, ``x``, ``series`` label -> key, ``ylabel``, optional
    ``title``, ``group``, ``shared``, ``logx``, ``logy``) or a bar panel (``bars`` label -> value, ``ylabel``,
    optional ``title``, ``target``).

    Line panels draw one line per (series, ``group`` value): one colour per group value and one line style per
    series; series named in ``shared`` do not depend on the group (e.g. FLA's time against our fold rate) and are
    drawn once, in black. Skipped with a message when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib missing: no plot written to {path}")
        return
    panels = [p for p in panels if p.get("records") or p.get("bars")]
    if not panels:
        return
    cols = min(len(panels), 2)
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(7.5 * cols, 4.8 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        (_bar_panel if "bars" in panel else _line_panel)(ax, panel, plt)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {Run._shown(path)}")


def _line_panel(ax, panel: dict, plt) -> None:
    def order(v):
        return (0, v, "") if isinstance(v, (int, float)) else (1, 0, str(v))

    records, x, group = panel["records"], panel["x"], panel.get("group")
    shared = panel.get("shared", ())
    groups = sorted({r.get(group) for r in records}, key=order) if group else [None]
    colours = plt.get_cmap("tab10").colors
    styles = ("-", "--", ":", "-.")
    drawn = set()
    for gi, gval in enumerate(groups):
        rows = sorted((r for r in records if group is None or r.get(group) == gval), key=lambda r: r[x])
        for si, (label, key) in enumerate(panel["series"].items()):
            pts = [(r[x], r[key]) for r in rows if r.get(key) is not None]
            if not pts or label in drawn:
                continue
            if label in shared:
                drawn.add(label)
                ax.plot(*zip(*pts), marker="s", markersize=4, color="black", linestyle=styles[si % len(styles)],
                        label=label)
                continue
            suffix = f" ({group}={gval})" if group else ""
            ax.plot(*zip(*pts), marker="o", markersize=4, color=colours[gi % len(colours)],
                    linestyle=styles[si % len(styles)], label=label + suffix)
    if panel.get("logx", True):
        ax.set_xscale("log", base=2)
    if panel.get("logy", True):
        ax.set_yscale("log")
    ax.set_xlabel(x)
    ax.set_ylabel(panel["ylabel"])
    ax.set_title(panel.get("title", ""), fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6 if len(ax.get_lines()) > 8 else 7, ncol=2 if len(ax.get_lines()) > 8 else 1)


def _bar_panel(ax, panel: dict, plt) -> None:
    labels, values = zip(*panel["bars"].items())
    ax.barh(range(len(values)), values, color=plt.get_cmap("tab10").colors[0])
    ax.set_yticks(range(len(values)), labels, fontsize=8)
    ax.invert_yaxis()
    for i, value in enumerate(values):
        ax.text(value, i, f" {value:.2f}", va="center", fontsize=8)
    if panel.get("target") is not None:
        ax.axvline(panel["target"], color="red", linestyle="--", label=f"target {panel['target']}")
        ax.legend(fontsize=8)
    ax.set_xlabel(panel["ylabel"])
    ax.set_title(panel.get("title", ""), fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
