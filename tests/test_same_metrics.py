"""scripts/same_metrics.py: the check that a refactor logs the same numbers finds any difference."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "same_metrics.py"
spec = importlib.util.spec_from_file_location("same_metrics", SCRIPT)
same_metrics = importlib.util.module_from_spec(spec)
spec.loader.exec_module(same_metrics)


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_timings_may_differ_and_nothing_else(tmp_path):
    before = write_rows(tmp_path / "a", [{"step": 1, "train/loss": 2.302585, "perf/step_ms": 1.9}])
    same = write_rows(tmp_path / "b", [{"step": 1, "train/loss": 2.302585, "perf/step_ms": 7.3}])
    bit = write_rows(tmp_path / "c", [{"step": 1, "train/loss": 2.3025850000000005, "perf/step_ms": 1.9}])
    extra = write_rows(tmp_path / "d", [{"step": 1, "train/loss": 2.302585, "val/acc": 0.5}])
    rows = same_metrics.rows_without_perf
    assert same_metrics.first_difference(rows(before), rows(same)) is None
    assert same_metrics.first_difference(rows(before), rows(bit)) == (
        "step 1: train/loss 2.302585 -> 2.3025850000000005"
    )
    assert same_metrics.first_difference(rows(before), rows(extra)) == "step 1: val/acc '<absent>' -> 0.5"
    assert same_metrics.first_difference(rows(before), rows(before) * 2) == "1 rows before, 2 now"
