"""``--resume`` of the benchmarks (benchmarks/_baseline.py): a run cut short keeps its records for the next run of
the same commit on the same GPU and driver, and for no other."""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _baseline  # noqa: E402


def _run(tmp_path, resume=True):
    return _baseline.Run("probe", argparse.Namespace(out=str(tmp_path), no_save=False, resume=resume))


def test_a_cut_short_run_keeps_its_records_for_the_same_commit_gpu_and_driver(tmp_path):
    first = _run(tmp_path)
    assert first.resumed == []  # nothing to resume
    records = [{"kind": "engine", "B": 1}, {"kind": "engine", "B": 8}]
    first.checkpoint(records)
    second = _run(tmp_path)
    assert second.resumed == records
    assert second.provenance["resumed"]["records"] == 2
    assert _run(tmp_path, resume=False).resumed == []  # without --resume every point is measured
    second.save(records)
    assert not (tmp_path / "probe.partial.json").exists()  # a finished run leaves no partial records


def test_records_of_another_commit_gpu_or_driver_are_measured_again(tmp_path):
    partial = tmp_path / "probe.partial.json"
    for key in ("commit", "gpu", "driver"):
        _run(tmp_path).checkpoint([{"kind": "engine", "B": 1}])
        kept = json.loads(partial.read_text())
        kept["provenance"][key] = "something else"
        partial.write_text(json.dumps(kept))
        run = _run(tmp_path)
        assert run.resumed == [], key
        assert "resumed" not in run.provenance
