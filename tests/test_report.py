"""`halfprec report` as users run it: on a real multirun (with failed jobs), a single run, nothing, and to W&B."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import read_jsonl

from halfprec.report import find_jobs, job_metrics

import wandb_records

METRICS = ["train/loss", "val/loss", "val/acc", "skipped steps", "min scale", "final scale", "samples/s", "MFU"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def report(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "halfprec.cli", "report", *args],
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )


def parse_table(markdown: str) -> tuple[list[str], list[dict[str, str]]]:
    """The markdown table's header and its rows as {column: cell}."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    header, *rows = ([cell.strip() for cell in line.strip("|").split("|")] for line in lines)
    return header, [dict(zip(header, row)) for row in rows[1:]]  # rows[0] is the |---| line


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk comes first
    assert width >= 400 and height >= 300 and len(data) > 10_000, (path, width, height, len(data))


@pytest.fixture(scope="module")
def started(cli):
    """The module's two training runs, started together on the 2-worker pool."""
    return {
        # init=fixup fails config validation on the mlp: jobs 1 and 3 fail, 0 (fp32) and 2 (fp16) train
        "sweep": cli.submit(
            "precision=fp32,fp16",
            "init=default,fixup",
            "logger=none",
            "trainer.max_steps=6",
            "trainer.log_every=2",
            multirun=True,
        ),
        "single": cli.submit("logger=none"),  # fp32: no loss scaler
    }


@pytest.fixture(scope="module")
def sweep(started):
    result = started["sweep"].result()
    assert result.returncode == 1, result.output[-4000:]  # Hydra re-raises the first failed job at the end
    assert len(result.job_dirs()) == 4
    return result


@pytest.fixture(scope="module")
def sweep_report(sweep):
    """`halfprec report <sweep dir>`, writing into the sweep dir (the default)."""
    return report(str(sweep.sweep_dir))


def test_sweep_table_has_a_row_per_job_with_values_from_metrics_jsonl(sweep, sweep_report):
    assert sweep_report.returncode == 0, sweep_report.stderr
    header, rows = parse_table(sweep_report.stdout)
    assert header == ["job", "precision", "init", *METRICS, "status"]  # overrides all jobs share are left out
    assert [(r["job"], r["precision"], r["init"], r["status"]) for r in rows] == [
        ("0", "fp32", "default", "completed"),
        ("1", "fp32", "fixup", "failed"),
        ("2", "fp16", "default", "completed"),
        ("3", "fp16", "fixup", "failed"),
    ]
    for row, job_dir in zip(rows, sweep.job_dirs()):
        if row["status"] == "failed":
            assert [row[m] for m in METRICS] == ["-"] * len(METRICS)  # it failed before its first step
            continue
        metrics = read_jsonl(job_dir / "metrics.jsonl")
        last = metrics[-1]
        for key in ("train/loss", "val/loss", "val/acc"):
            assert float(row[key]) == pytest.approx(last[key], abs=5e-5), key
        assert int(row["skipped steps"]) == last["scaler/skipped_steps"]
        assert float(row["min scale"]) == min(r["scaler/scale"] for r in metrics)
        assert float(row["final scale"]) == last["scaler/scale"]
        steady = [r["perf/samples_per_s"] for r in metrics if r["step"] != 1]
        assert float(row["samples/s"]) == pytest.approx(statistics.median(steady), abs=0.5)
        assert row["MFU"] == "-"  # no peak for a CPU: never logged
    assert rows[0]["min scale"] == "1" and rows[2]["min scale"] == "65536"  # scaler=auto: dynamic for fp16
    assert "- job 1: ConfigError: init=fixup: model=mlp has no residual branches" in sweep_report.stdout


def test_throughput_columns_are_medians_without_the_warm_up_row():
    rows = [
        {"step": 1, "perf/samples_per_s": 10.0, "perf/mfu": 0.01},  # step 1: compile, allocator warm-up
        {"step": 10, "perf/samples_per_s": 400.0, "perf/mfu": 0.4},
        {"step": 20, "perf/samples_per_s": 500.0, "perf/mfu": 0.5},
        {"step": 30, "perf/samples_per_s": float("nan"), "perf/mfu": 0.45},
    ]
    metrics = job_metrics(rows, {})
    assert (metrics["samples/s"], metrics["MFU"]) == (450.0, 0.45)
    assert job_metrics(rows[:1], {})["MFU"] == 0.01  # a run with one row: that row


def test_sweep_report_writes_plots_and_report_md(sweep, sweep_report):
    assert sweep_report.returncode == 0, sweep_report.stderr
    assert_png(sweep.sweep_dir / "loss.png")
    assert_png(sweep.sweep_dir / "scale.png")  # the fp16 job has a loss scaler
    assert (sweep.sweep_dir / "report.md").read_text() == sweep_report.stdout
    assert "wrote report.md, loss.png, scale.png" in sweep_report.stderr


def test_single_run_dir_without_a_scaler_gets_no_scale_plot(started, tmp_path):
    single = started["single"].result().check()
    out = tmp_path / "out"
    result = report(str(single.run_dir), "--out", str(out))
    assert result.returncode == 0, result.stderr
    _, rows = parse_table(result.stdout)
    (row,) = rows
    assert row["status"] == "completed" and row["logger"] == "none"  # a lone run shows all its overrides
    assert float(row["train/loss"]) == pytest.approx(single.metrics()[-1]["train/loss"], abs=5e-5)
    assert_png(out / "loss.png")
    assert not (out / "scale.png").exists()
    assert "no scale.png: no job has a loss scaler" in result.stderr
    assert (out / "report.md").read_text() == result.stdout
    assert not (single.run_dir / "report.md").exists()  # --out: the run dir is left as it was


@pytest.mark.parametrize("kind", ["empty", "missing"])
def test_a_path_without_runs_is_a_one_line_error(tmp_path, kind):
    path = tmp_path / kind
    if kind == "empty":
        path.mkdir()
    result = report(str(path))
    assert result.returncode == 2
    assert result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"halfprec report: error: {path}: ")
    assert "expected a run dir (with metrics.jsonl or .hydra/), a multirun sweep dir" in line


def test_a_job_with_no_end_recorded_is_running(started, tmp_path):
    single = started["single"].result().check()
    run_dir = tmp_path / "run"
    shutil.copytree(single.run_dir, run_dir)
    (run_dir / "summary.json").unlink()
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "train/lo')  # a row being written right now
    (job,) = find_jobs(run_dir)
    assert job.status == "running"
    assert [row["step"] for row in job.rows] == [1, 2, 3]


def test_wandb_flag_logs_table_and_plots_to_an_offline_report_run(sweep, tmp_path):
    result = report(
        str(sweep.sweep_dir),
        "--out",
        str(tmp_path / "out"),
        "--wandb",
        env={"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr
    (run_file,) = wandb_records.run_files(tmp_path)
    info = wandb_records.run_info(run_file)
    assert info["job_type"] == "report" and info["project"] == "halfprec"
    assert info["group"] == f"{sweep.sweep_dir.parent.name}_{sweep.sweep_dir.name}"  # the sweep's own group
    (logged,) = wandb_records.history(run_file)
    assert logged["report/table._type"] == "table-file" and logged["report/table.nrows"] == 4
    assert logged["report/loss._type"] == logged["report/scale._type"] == "image-file"
    table = json.loads((run_file.parent / "files" / logged["report/table.path"]).read_text())
    header, rows = parse_table(result.stdout)
    assert table["columns"] == header
    assert [row[-1] for row in table["data"]] == [row["status"] for row in rows]
    assert wandb_records.exit_codes(run_file) == [0]


def test_help_is_fast_and_lists_report():
    script = Path(sysconfig.get_path("scripts")) / "halfprec"
    assert script.exists(), f"no {script}: reinstall (pip install -e .) to get the `halfprec` console script"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "report" in result.stdout
    # the heavy imports wait until a command needs them
    heavy = "{'torch', 'matplotlib', 'wandb'}"
    probe = f"import sys, halfprec.cli, halfprec.report; print(sorted({heavy} & sys.modules.keys()))"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert loaded.stdout.strip() == "[]", loaded.stderr
