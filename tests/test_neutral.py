"""scripts/neutral.py: the check that a refactor logs the same numbers finds any difference but time."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from halfprec.config import validate

from helpers import compose_cfg

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "neutral.py"
spec = importlib.util.spec_from_file_location("neutral", SCRIPT)
neutral = importlib.util.module_from_spec(spec)
spec.loader.exec_module(neutral)

ROWS = [
    {"step": 1, "train/loss": 2.302585, "scaler/scale": 65536.0, "perf/step_ms": 1.9, "perf/tflops": 1e-5},
    {"step": 2, "train/loss": 2.25, "scaler/scale": 65536.0, "perf/step_ms": 1.2, "val/acc": 0.5},
]


def changed(step: int, **values) -> list[dict]:
    """ROWS with `values` set in the row of `step` (a value None: the key removed)."""
    rows = [dict(row) for row in ROWS]
    row = rows[step - 1]
    for key, value in values.items():
        key = key.replace("__", "/")
        if value is None:
            del row[key]
        else:
            row[key] = value
    return rows


def test_identical_rows_pass_and_timing_keys_are_ignored():
    assert neutral.first_difference(ROWS, [dict(row) for row in ROWS]) is None
    slower = changed(2, perf__step_ms=7.3, perf__samples_per_s=10.0)  # a timing key may even appear
    assert neutral.first_difference(ROWS, slower) is None
    assert neutral.first_difference([{"wall_s": 1.0, "steps": 8}], [{"wall_s": 2.5, "steps": 8}]) is None


def test_the_last_bit_of_a_float_is_a_difference():
    bit = changed(1, train__loss=2.3025850000000005)  # the next double after 2.302585
    assert neutral.first_difference(ROWS, bit) == "step 1: train/loss 2.302585 -> 2.3025850000000005"
    # Python's == takes these as equal: the script compares the values' exact JSON text
    assert neutral.first_difference([{"step": 3, "x": 0.0}], [{"step": 3, "x": -0.0}]) == "step 3: x 0.0 -> -0.0"
    assert neutral.first_difference([{"step": 3, "x": 1}], [{"step": 3, "x": 1.0}]) == "step 3: x 1 -> 1.0"


def test_a_missing_or_new_key_is_a_difference():
    assert neutral.first_difference(ROWS, changed(2, val__acc=None)) == "step 2: val/acc missing (was 0.5)"
    assert neutral.first_difference(ROWS, changed(1, scaler__growths=0)) == "step 1: scaler/growths new (0)"


def test_a_missing_or_extra_row_is_a_difference():
    extra = [*ROWS, {"step": 3, "train/loss": 2.0}]
    assert neutral.first_difference(ROWS, extra) == "2 rows before, 3 now (from step 3)"
    assert neutral.first_difference(extra, ROWS) == "3 rows before, 2 now (from step 3)"


def test_summaries_compare_without_their_run_dirs(tmp_path):
    for run, wall in (("a", 1.5), ("b", 2.5)):
        (tmp_path / run).mkdir()
        summary = {"train/loss": 2.0, "wall_s": wall, "checkpoint": str(tmp_path / run / "checkpoints/step-8.pt")}
        (tmp_path / run / "summary.json").write_text(json.dumps(summary))
    a, b = neutral.read_summary(tmp_path / "a"), neutral.read_summary(tmp_path / "b")
    assert a["checkpoint"] == "checkpoints/step-8.pt"
    assert neutral.first_difference([a], [b]) is None


def test_a_run_compares_its_rows_then_its_summary(tmp_path):
    for tree, loss in (("commit", 2.0), ("tree", 2.5)):
        run = tmp_path / tree / "fp32"
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
        (run / "summary.json").write_text(json.dumps({"train/loss": loss, "wall_s": 1.0}))
    assert neutral.compare_run("fp32", tmp_path / "commit", tmp_path / "tree") == (
        2,
        "summary.json: train/loss 2.0 -> 2.5",
    )


@pytest.mark.parametrize("name", list(neutral.COMMANDS))
def test_every_command_is_a_valid_config(name):
    """The command set stays runnable as conf/ changes (a rename here would show as FAILED there)."""
    validate(compose_cfg(*neutral.COMMON, *neutral.COMMANDS[name]))


@pytest.mark.slow
def test_the_working_tree_logs_what_head_logs():
    """End to end on one command: HEAD's checkout and this tree agree (locally, only if the tree's
    uncommitted changes are neutral: which is what the script is for)."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--only", "fp32"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fp32                      8 OK" in proc.stdout and "all identical" in proc.stdout
