"""``examples/tp_decode.py``: the sharding of the 96-head decode layer (docs/multi_gpu.md §2).

The CPU test runs the ``--cpu`` mode with two processes (gloo, kda-recurrent's oracle path): every rank's heads, its
projection columns, its o_proj rows and the all-reduce must give the unsharded layer's output and states. The GPU
test (two GPUs) runs it under torchrun with NCCL and CUDA graphs, a short timing, and reads its run record.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "tp_decode.py"
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, sorted((ROOT / "packages").glob("*/src"))),
                                         env.get("PYTHONPATH", "")])
    return env


def _records(path):
    with open(path) as fh:
        run = json.load(fh)
    assert run["provenance"]["command"].startswith("python examples/tp_decode.py")
    return run["records"]


def test_the_sharded_layer_on_two_cpu_processes_equals_the_unsharded_layer(tmp_path):
    out = tmp_path / "multi_gpu.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--nproc", "2", "--batch", "3", "--check-steps",
                          "2", "--out", str(out)], capture_output=True, text=True, timeout=900, env=_env(), cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (record,) = _records(out)
    assert record["passed"] and record["processes"] == 2 and record["heads"] == 96 and record["heads_per_gpu"] == 48
    assert record["gpus"] == 0 and record["max_abs_error"] <= record["tolerance"]


def test_a_broken_shard_is_caught(tmp_path):
    """The check can fail: rank 1 reading rank 0's beta columns gives another layer."""
    broken = tmp_path / "tp_decode.py"
    text = SCRIPT.read_text()
    wrong = text.replace("w[:, 4 * cols + first: 4 * cols + first + heads]", "w[:, 4 * cols: 4 * cols + heads]")
    assert wrong != text
    broken.write_text(wrong.replace('ROOT = Path(__file__).resolve().parent.parent', f'ROOT = Path({str(ROOT)!r})'))
    run = subprocess.run([sys.executable, str(broken), "--cpu", "--nproc", "2", "--batch", "2", "--check-steps", "1"],
                         capture_output=True, text=True, timeout=900, env=_env(), cwd=ROOT)
    assert run.returncode == 1 and "differs from the unsharded one" in run.stdout, run.stdout + run.stderr


@pytest.mark.gpu
@pytest.mark.multi_gpu
@pytest.mark.skipif(GPUS < 2, reason="needs two CUDA GPUs")
def test_two_gpus_under_torchrun_match_the_unsharded_layer_and_write_a_record(tmp_path):
    out = tmp_path / "multi_gpu.json"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(SCRIPT),
                          "--batch", "1,64", "--replays", "20", "--out", str(out)], capture_output=True, text=True,
                         timeout=900, env=_env(), cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    records = _records(out)
    assert [r["batch"] for r in records] == [1, 64]
    for r in records:
        assert r["passed"] and r["gpus"] == 2 and len(r["per_gpu"]) == 2
        assert all(g["tp_step_us"] > 0 and g["alone_step_us"] > 0 for g in r["per_gpu"])


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
def test_one_gpu_under_torchrun_runs_the_whole_layer_in_a_graph_and_writes_a_record(tmp_path):
    """N = 1: the graph holds the kernel, the projections and a one-rank NCCL all-reduce."""
    out = tmp_path / "multi_gpu.json"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", str(SCRIPT),
                          "--batch", "8", "--replays", "20", "--out", str(out)], capture_output=True, text=True,
                         timeout=900, env=_env(), cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (record,) = _records(out)
    assert record["passed"] and record["gpus"] == 1 and record["heads_per_gpu"] == 96
    assert record["per_gpu"][0]["tp_step_us"] > 0 and record["per_gpu"][0]["alone_step_us"] > 0
