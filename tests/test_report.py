"""`halfprec report` as users run it: on a real multirun (with failed jobs), a single run, nothing, and to W&B."""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import struct
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import read_jsonl

from halfprec.tools.report import write_report
from halfprec.tools.report.columns import job_metrics
from halfprec.tools.report.plots import line_figure
from halfprec.tools.report.runs import find_jobs

import wandb_records

METRICS = ["train/loss", "val/loss", "val/acc", "skipped steps", "min scale", "final scale", "samples/s", "MFU"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def report(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "halfprec.tools.cli", "report", *args],
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )


def parse_tables(markdown: str) -> list[tuple[list[str], list[dict[str, str]]]]:
    """Each markdown table's header and its rows as {column: cell}, in order."""
    tables, lines = [], markdown.splitlines() + [""]
    start = None
    for i, line in enumerate(lines):
        if line.startswith("|") and start is None:
            start = i
        elif not line.startswith("|") and start is not None:
            header, *rows = ([cell.strip() for cell in row.strip("|").split("|")] for row in lines[start:i])
            tables.append((header, [dict(zip(header, row)) for row in rows[1:]]))  # rows[0] is the |---| line
            start = None
    return tables


def parse_table(markdown: str) -> tuple[list[str], list[dict[str, str]]]:
    """The per-job table (the last one: a per-group table may come first)."""
    return parse_tables(markdown)[-1]


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
    assert result.returncode == 5, result.output[-4000:]  # a sweep with a failed job (exits.SWEEP_FAILED)
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


@pytest.fixture
def another_run_metric(monkeypatch):
    """A new diagnostic's value added to the one list of metric names, as a fork would add it; the
    report's cached column lists are rebuilt with it and again without it afterwards."""
    from halfprec import metrics
    from halfprec.tools.report import columns

    cached = (columns.metric_formats, columns.spread_formats, columns.optional_columns)
    extra = metrics.RunMetric("peak logz", "diag/output_logz_max", "max", ".3g", optional=True, summary="diag/logz")
    grown = (*metrics.RUN_METRICS, extra)
    for module in (metrics, columns):  # the list, and the report's name for it
        monkeypatch.setattr(module, "RUN_METRICS", grown)
    for function in cached:
        function.cache_clear()
    yield
    monkeypatch.undo()
    for function in cached:
        function.cache_clear()


def test_a_run_level_metric_is_one_line_in_the_metric_list(tmp_path, capsys, another_run_metric):
    """The tables' columns and what sweep.jsonl records read halfprec/metrics.py's RUN_METRICS."""
    from halfprec.metrics import recorded

    jobs = [FakeJob({"precision": p}, decay(0.2)) for p in ("bf16", "fp16")]
    jobs[0].extra = {29: {"diag/output_logz_max": 12.345}, 3: {"diag/output_logz_max": 20.0}}
    assert write_report(write_sweep(tmp_path / "sweep", jobs), tmp_path / "out") == 0
    ((header, rows),) = parse_tables(capsys.readouterr().out)
    assert header == ["job", "precision", *METRICS, "peak logz", "status"]  # optional: logged by one job
    assert [row["peak logz"] for row in rows] == ["20", "-"]  # the largest logged, in its format
    summary = {"train/loss": 1.5, "diag/logz": 3.0, "val/acc": 0.5, "status": "completed"}
    assert recorded(summary) == {
        "train/loss": 1.5,
        "scaler/skipped_steps": None,
        "scaler/min_scale": None,
        "scaler/final_scale": None,
        "diag/logz": 3.0,
        "val/acc": 0.5,
    }


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


def test_a_dir_holding_two_sweeps_is_refused_rather_than_mixed(tmp_path):
    """Two launches into one hydra.sweep.dir (before train.py refused that) number their jobs from 0
    both: the report says so instead of averaging one sweep's jobs into the other's groups."""
    root = tmp_path / "sweep"
    write_sweep(root, [FakeJob({"precision": p, "seed": s}, decay(0.1)) for p in ("fp32", "bf16") for s in "01"])
    write_sweep(root, [FakeJob({"precision": "fp32", "seed": "0", "trainer.max_steps": "100"}, decay(0.5))])
    result = report(str(root))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == (
        f"halfprec report: error: {root}: holds the jobs of more than one sweep (job 0 is both "
        "0_precision=fp32,seed=0 and 0_precision=fp32,seed=0,trainer.max_steps=100); their statistics would mix: "
        "move each sweep's <n>_<overrides> dirs into a dir of their own and report each"
    )
    assert len(find_jobs(root / "0_precision=fp32,seed=0")) == 1  # one job dir still reports


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
    probe = f"import sys, halfprec.tools.cli, halfprec.tools.report; print(sorted({heavy} & sys.modules.keys()))"
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert loaded.stdout.strip() == "[]", loaded.stderr


# Synthetic sweeps: what Hydra and train.py leave on disk, written directly (no training), so that the
# plots and tables can be checked on 18+ jobs, diverged runs and exact numbers in well under a second.


@dataclass
class FakeJob:
    """One job of a synthetic sweep: its overrides and its train/loss at steps 10, 20, ... (None: a
    non-finite value, written as null as train.py does)."""

    overrides: dict[str, str]
    loss: list[float | None]
    status: str = "completed"  # completed, failed, running, or e.g. diverged
    in_summary: bool = False  # the status goes in summary.json's "status" key rather than sweep.jsonl
    scale: float = 1.0  # scaler/scale at every row
    val_acc: float | None = 0.9  # logged with the last row (None: logged as null)
    error: str = ""  # sweep.jsonl's error for a job that did not complete (default: a divergence)
    logs_val: bool = True  # val/loss and val/acc with the last row (False: it stopped before validating)
    extra: dict[int, dict[str, Any]] = field(default_factory=dict)  # row index -> more keys for that row


def write_sweep(root: Path, jobs: list[FakeJob], log_every: int = 10) -> Path:
    """A multirun sweep dir: `<n>_<overrides>/` job dirs with .hydra/overrides.yaml and config.yaml,
    metrics.jsonl and (for a job that ended) summary.json, and sweep.jsonl lines for ended jobs."""
    root.mkdir(parents=True, exist_ok=True)
    sweep_lines = []
    for num, job in enumerate(jobs):
        write_run(root / f"{num}_{','.join(f'{k}={v}' for k, v in job.overrides.items())}", job, log_every)
        if job.status != "running":
            line = {"job": num, "status": "completed" if job.in_summary else job.status}
            if job.status != "completed" and not job.in_summary:
                last = job.loss[-1] if job.loss else None
                line["error"] = job.error or f"Diverged: train/loss is {last} at step {log_every * len(job.loss)}"
            sweep_lines.append(json.dumps(line) + "\n")
    (root / "sweep.jsonl").write_text("".join(sweep_lines))
    return root


def write_run(run_dir: Path, job: FakeJob, log_every: int = 10) -> None:
    """One run dir: .hydra/overrides.yaml and config.yaml, metrics.jsonl and (for a job that ended) summary.json."""
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"{k}={v}" for k, v in job.overrides.items()]))
    (run_dir / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"seed": 0, "logger": {"project": "halfprec"}}))
    rows = [
        {"step": log_every * (i + 1), "train/loss": loss, "scaler/scale": job.scale, "scaler/skipped_steps": 0}
        for i, loss in enumerate(job.loss)
    ]
    if rows and job.status != "running" and job.logs_val:
        rows[-1].update({"val/loss": rows[-1]["train/loss"], "val/acc": job.val_acc})
    for i, keys in job.extra.items():
        rows[i].update(keys)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    if job.status == "completed" or job.in_summary:
        status = {"status": job.status} if job.in_summary else {}
        (run_dir / "summary.json").write_text(json.dumps({"scaler/min_scale": job.scale, **status}))


def decay(end: float, seed: int = 0, start: float = 2.3, steps: int = 30) -> list[float]:
    """A loss falling from `start` towards `end`, with a little seed-dependent wobble."""
    return [(end + (start - end) * math.exp(-i / 6)) * (1 + 0.03 * math.sin(i + 2.0 * seed)) for i in range(steps)]


def grid(diverged: float | None = 0.0) -> list[FakeJob]:
    """precision x scaler x seed, 18 jobs, as `+experiment=loss_scaling` has them (job number order).
    fp32 trains the same with and without a scaler; fp16 without one stalls. Unless `diverged` is 0.0,
    fp16/dynamic seed 2 diverges at step 110: its loss becomes `diverged` (None: null)."""
    ends = {"fp32": 0.1, "fp16": 0.3, "bf16": 0.15}
    jobs = []
    for precision in ("fp32", "fp16", "bf16"):
        for scaler in ("none", "dynamic"):
            for seed in range(3):
                end = 2.2 if (precision, scaler) == ("fp16", "none") else ends[precision]
                overrides = {"precision": precision, "scaler": scaler, "seed": str(seed)}
                scale = 65536.0 if scaler == "dynamic" else 1.0
                jobs.append(FakeJob(overrides, decay(end, seed), scale=scale, val_acc=0.95 - end / 10 + seed / 1000))
    if diverged != 0.0:
        jobs[11].loss = jobs[11].loss[:10] + [diverged] * 20
        jobs[11].status = "diverged"
    return jobs


def drawn_lines(fig: Any) -> dict[str, Any]:
    """The plot's labelled lines by label (one line of text); markers and bands have no label."""
    return {
        line.get_label().replace("\n", " "): line
        for line in fig.axes[0].get_lines()
        if not line.get_label().startswith("_")
    }


def test_lines_are_coloured_by_override_value_one_distinct_colour_each(tmp_path):
    from matplotlib.colors import to_hex

    # 12 learning rates x 2 seeds: matplotlib's 10-colour cycle gave lr 11 and 12 the colours of lr 1 and 2
    lrs = [f"{0.01 * (i + 1):g}" for i in range(12)]
    jobs = [
        FakeJob({"optim.lr": lr, "seed": str(s)}, decay(0.1 + 0.1 * i, s)) for i, lr in enumerate(lrs) for s in (0, 1)
    ]
    fig = line_figure(find_jobs(write_sweep(tmp_path / "lr", jobs)), "train/loss", "t")
    lines = drawn_lines(fig)
    assert sorted(lines) == sorted(f"optim.lr={lr}: mean ± std, n=2" for lr in lrs)
    assert len({to_hex(line.get_color()) for line in lines.values()}) == 12
    legend = fig.axes[0].get_legend()
    assert legend.get_title().get_text().startswith("colour: optim.lr")
    assert sorted(text.get_text().replace("\n", " ") for text in legend.get_texts()) == sorted(lines)

    # precision x scaler x seed: one colour per precision, one line style per scaler
    lines = drawn_lines(line_figure(find_jobs(write_sweep(tmp_path / "grid", grid())), "train/loss", "t"))
    assert len(lines) == 6
    looks = {tuple(v.split("=")[1] for v in label.split(":")[0].split()): line for label, line in lines.items()}
    for precision in ("fp32", "fp16", "bf16"):
        assert to_hex(looks[precision, "none"].get_color()) == to_hex(looks[precision, "dynamic"].get_color())
        assert looks[precision, "none"].get_linestyle() != looks[precision, "dynamic"].get_linestyle()
    assert len({to_hex(looks[p, "none"].get_color()) for p in ("fp32", "fp16", "bf16")}) == 3
    assert len({looks[p, "dynamic"].get_linestyle() for p in ("fp32", "fp16", "bf16")}) == 1
    # fp32 logs the same losses with and without a scaler: the one drawn first is wider, so both show
    assert looks["fp32", "none"].get_linewidth() > looks["fp32", "dynamic"].get_linewidth()


def test_jobs_differing_only_in_seed_or_not_at_all_draw_one_mean_line_with_a_std_band(tmp_path):
    import numpy as np

    jobs = [FakeJob({"precision": "fp16", "seed": str(s)}, decay(0.3, s)) for s in range(3)]
    jobs += [FakeJob({"precision": "bf16"}, decay(0.5, s)) for s in range(2)]  # run twice, same overrides
    jobs += [FakeJob({"precision": "fp32", "seed": "0"}, decay(0.1))]
    fig = line_figure(find_jobs(write_sweep(tmp_path, jobs)), "train/loss", "t")
    lines = drawn_lines(fig)
    assert sorted(lines) == ["5: precision=fp32", "precision=bf16: mean ± std, n=2", "precision=fp16: mean ± std, n=3"]
    seeds = np.array([job.loss for job in jobs[:3]])
    fp16 = lines["precision=fp16: mean ± std, n=3"]
    assert list(fp16.get_xdata()) == list(range(10, 310, 10))
    np.testing.assert_allclose(fp16.get_ydata(), seeds.mean(axis=0))
    # the band around it: mean ± sample std at every step
    (band,) = [c for c in fig.axes[0].collections if np.allclose(c.get_facecolor()[0][:3], fp16.get_color()[:3])]
    vertices = band.get_paths()[0].vertices
    std = seeds.std(axis=0, ddof=1)
    for step, mean, s in zip(range(10, 310, 10), seeds.mean(axis=0), std):
        ys = vertices[np.isclose(vertices[:, 0], step), 1]
        assert (ys.min(), ys.max()) == pytest.approx((mean - s, mean + s))


def test_group_table_has_mean_std_and_n_over_completed_seeds_then_the_per_job_table(tmp_path, capsys):
    jobs = grid(diverged=1e13)
    jobs[12].val_acc = None  # bf16/none seed 0 logged a non-finite val/acc
    jobs.append(FakeJob({"precision": "fp8", "scaler": "dynamic", "seed": "0"}, decay(0.4), val_acc=0.8))
    sweep_dir = write_sweep(tmp_path / "sweep", jobs)
    assert write_report(sweep_dir, tmp_path / "out") == 0
    text = capsys.readouterr().out
    assert (tmp_path / "out" / "report.md").read_text() == text
    assert text.startswith(f"## {sweep_dir}: 19 jobs, 18 completed, 1 diverged\n")
    assert "- job 11: Diverged: train/loss is 10000000000000.0 at step 300" in text
    (group_header, groups), (job_header, per_job) = parse_tables(text)
    assert group_header == ["precision", "scaler", "jobs", *METRICS, "status"]
    assert job_header == ["job", "precision", "scaler", "seed", *METRICS, "status"]
    assert [r["job"] for r in per_job] == [str(n) for n in range(19)]  # every job, as before
    assert [(g["precision"], g["scaler"], g["jobs"]) for g in groups][:2] == [
        ("fp32", "none", "0, 1, 2"),
        ("fp32", "dynamic", "3, 4, 5"),
    ]
    accs = [jobs[n].val_acc for n in (0, 1, 2)]
    mean, std = statistics.fmean(accs), statistics.stdev(accs)
    assert groups[0]["val/acc"] == f"{mean:.4f} ± {std:.4f} (n=3)" and groups[0]["status"] == "3 completed"
    assert groups[0]["min scale"] == "1 ± 0 (n=3)" and groups[0]["MFU"] == "-"  # never logged
    # the diverged seed is left out of the statistics and counted in the status
    accs = [jobs[n].val_acc for n in (9, 10)]
    assert groups[3]["val/acc"] == f"{statistics.fmean(accs):.4f} ± {statistics.stdev(accs):.4f} (n=2)"
    assert groups[3]["status"] == "2 completed, 1 diverged"
    assert groups[4]["val/acc"] == "nan (n=3)" and per_job[12]["val/acc"] == "nan"
    assert (groups[6]["jobs"], groups[6]["val/acc"], groups[6]["status"]) == ("18", "0.8000", "completed")


def test_without_repeated_configurations_there_is_only_the_per_job_table(tmp_path, capsys):
    jobs = [FakeJob({"precision": p, "seed": "0"}, decay(0.1)) for p in ("fp32", "fp16")]
    jobs.append(FakeJob({"precision": "bf16", "seed": "0"}, decay(0.1), status="diverged", in_summary=True))
    assert write_report(write_sweep(tmp_path / "sweep", jobs), tmp_path / "out") == 0
    text = capsys.readouterr().out
    assert ": 3 jobs, 2 completed, 1 diverged\n" in text  # summary.json's "status" key
    ((header, rows),) = parse_tables(text)
    assert [(r["job"], r["status"]) for r in rows] == [("0", "completed"), ("1", "completed"), ("2", "diverged")]


@pytest.mark.parametrize(
    ("diverged", "tag"), [(1e13, "diverged; off chart from step 110"), (None, "diverged; non-finite from step 110")]
)
def test_a_diverged_seed_does_not_stretch_the_y_axis_and_is_marked_where_it_leaves(tmp_path, diverged, tag):
    fig = line_figure(find_jobs(write_sweep(tmp_path, grid(diverged))), "train/loss", "t")
    ax = fig.axes[0]
    bottom, top = ax.get_ylim()
    assert ax.get_yscale() == "linear"  # the others span 0.1 to 2.3: no need for a log axis
    assert 2.3 < top < 2.6 and bottom < 0.1
    lines = drawn_lines(fig)
    assert f"11: precision=fp16 scaler=dynamic seed=2 ({tag})" in lines
    assert "precision=fp16 scaler=dynamic: mean ± std, n=2" in lines  # its completed seeds
    assert sum("off chart" in label or "non-finite" in label for label in lines) == 1
    (marker,) = [line for line in ax.get_lines() if list(line.get_xdata()) == [110]]
    assert list(marker.get_ydata()) == [top]


def test_a_blow_up_in_a_job_that_completed_is_still_kept_off_the_y_range(tmp_path):
    # a sweep recorded before the "diverged" status existed: the blow-up's job says completed
    jobs = [FakeJob({"optim.lr": lr}, decay(end)) for lr, end in (("0.01", 0.5), ("0.1", 0.1), ("0.3", 0.2))]
    jobs.append(FakeJob({"optim.lr": "10"}, decay(0.1)[:5] + [3e5, 1e13, 1e13]))
    fig = line_figure(find_jobs(write_sweep(tmp_path, jobs)), "train/loss", "t")
    assert fig.axes[0].get_ylim()[1] < 3 and fig.axes[0].get_yscale() == "linear"
    assert "3: optim.lr=10 (off chart from step 60)" in drawn_lines(fig)


def test_losses_spanning_decades_keep_a_log_axis_and_scales_a_log2_one(tmp_path):
    jobs = [FakeJob({"seed": str(s), "scaler": "static"}, decay(0.005, s, steps=80), scale=2.0**16) for s in range(2)]
    jobs += [FakeJob({"seed": str(s), "scaler": "dynamic"}, decay(0.01, s, steps=80), scale=2.0**10) for s in range(2)]
    found = find_jobs(write_sweep(tmp_path, jobs))
    fig = line_figure(found, "train/loss", "t")
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    assert ax.get_ylim()[0] < 0.005 and ax.get_ylim()[1] > 2.3  # the first steps and the last, all on the chart
    assert sorted(drawn_lines(fig)) == ["scaler=dynamic: mean ± std, n=2", "scaler=static: mean ± std, n=2"]
    ax = line_figure(found, "scaler/scale", "t", log2_y=True).axes[0]
    assert ax.get_yscale() == "log" and ax.yaxis.get_transform().base == 2
    assert ax.get_ylim()[0] < 2**10 and ax.get_ylim()[1] > 2**16


def test_wandb_gets_the_group_table_as_numbers(tmp_path):
    sweep_dir = write_sweep(tmp_path / "sweep", grid(diverged=1e13))
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)}
    result = report(str(sweep_dir), "--out", str(tmp_path / "out"), "--wandb", env=env)
    assert result.returncode == 0, result.stderr
    (run_file,) = wandb_records.run_files(tmp_path)
    (logged,) = wandb_records.history(run_file)
    assert logged["report/table.nrows"] == 18 and logged["report/groups.nrows"] == 6
    table = json.loads((run_file.parent / "files" / logged["report/groups.path"]).read_text())
    columns = table["columns"]
    assert columns[:3] == ["precision", "scaler", "jobs"]
    fp16_dynamic = dict(zip(columns, table["data"][3]))
    accs = [0.95 - 0.03 + seed / 1000 for seed in (0, 1)]  # seed 2 diverged: not counted
    assert fp16_dynamic["val/acc"] == pytest.approx(statistics.fmean(accs))
    assert fp16_dynamic["val/acc std"] == pytest.approx(statistics.stdev(accs))
    assert fp16_dynamic["val/acc n"] == 2 and fp16_dynamic["status"] == "2 completed, 1 diverged"


def test_a_sweep_over_a_number_plots_the_final_val_loss_against_it(tmp_path):
    """Wortsman et al.'s plot: final val/loss against the lr, a line per value of the other override,
    seeds averaged, a cross for a job that diverged; a sweep with no numeric axis gets no sweep.png."""
    from halfprec.tools.report.sweep_plot import numeric_sweep_key, sweep_figure

    ends = {("1e-3", "false"): 0.5, ("1e-2", "false"): 0.4, ("1e-1", "false"): 0.9,
            ("1e-3", "true"): 0.6, ("1e-2", "true"): 0.45, ("1e-1", "true"): 0.5}  # fmt: skip
    jobs = [
        FakeJob({"optim.lr": lr, "model.qk_norm": qk, "seed": str(seed)}, decay(end + seed / 100, seed))
        for (lr, qk), end in ends.items()
        for seed in (0, 1)
    ]
    jobs[5].status = "diverged"  # lr 1e-1, no qk-norm, seed 1
    sweep = write_sweep(tmp_path / "sweep", jobs)
    found = find_jobs(sweep)
    assert numeric_sweep_key(found) == "optim.lr"
    fig = sweep_figure(found, "optim.lr", "val/loss")
    lines = drawn_lines(fig)
    assert set(lines) == {"model.qk_norm=false", "model.qk_norm=true"}
    no_qk = lines["model.qk_norm=false"]
    assert list(no_qk.get_xdata()) == [1e-3, 1e-2, 1e-1] and fig.axes[0].get_xscale() == "log"
    last = {lr: [j for j in found if j.overrides["optim.lr"] == lr and j.overrides["model.qk_norm"] == "false"]
            for lr in ("1e-3", "1e-1")}  # fmt: skip
    mean = statistics.fmean(j.rows[-1]["val/loss"] for j in last["1e-3"])
    assert no_qk.get_ydata()[0] == pytest.approx(mean)
    assert no_qk.get_ydata()[2] == pytest.approx(last["1e-1"][0].rows[-1]["val/loss"])  # the completed seed only
    crosses = [line for line in fig.axes[0].get_lines() if line.get_marker() == "x"]
    assert len(crosses) == 1 and "did not complete" in fig.axes[0].get_title()

    assert report(str(sweep)).returncode == 0 and (sweep / "sweep.png").is_file()
    assert numeric_sweep_key(find_jobs(write_sweep(tmp_path / "grid", grid()))) is None  # precision x scaler x seed


def edge_markers(ax: Any, marker: str, y: float) -> list[tuple[float, str]]:
    """(x, colour) of the unlabelled single-point markers `marker` drawn at height y (an edge of the chart)."""
    from matplotlib.colors import to_hex

    return sorted(
        (float(line.get_xdata()[0]), to_hex(line.get_color()))
        for line in ax.get_lines()
        if line.get_marker() == marker and len(line.get_xdata()) == 1 and line.get_ydata()[0] == pytest.approx(y)
    )


def test_sweep_marks_every_job_that_did_not_complete_even_without_a_finite_value(tmp_path):
    """Four diverged fp16 jobs: one with a finite last val/loss (a cross at it), one whose val/loss is null,
    one that stopped before validating and one whose val/loss blew up to 1e13: the last three sit on the
    top edge at their x with what they logged beside them, and the blow-up does not squash the chart."""
    from matplotlib.colors import to_hex

    from halfprec.tools.report.sweep_plot import sweep_figure

    ends = {"1e-3": 0.5, "1e-2": 0.4, "1e-1": 0.6}
    jobs = [
        FakeJob({"optim.lr": lr, "precision": precision, "seed": str(seed)}, decay(end, seed))
        for lr, end in ends.items()
        for precision in ("bf16", "fp16")
        for seed in (0, 1)
    ]
    for num, loss in ((3, None), (7, 1.0), (10, 1e13), (11, 0.95)):  # fp16 at lr 1e-3, 1e-2, 1e-1, 1e-1
        jobs[num].loss = [*jobs[num].loss[:-1], loss]
        jobs[num].status = "diverged"
    jobs[7].logs_val = False
    fig = sweep_figure(find_jobs(write_sweep(tmp_path, jobs)), "optim.lr", "val/loss")
    ax = fig.axes[0]
    bottom, top = ax.get_ylim()
    assert ax.get_yscale() == "linear" and 0.95 < top < 3  # the blow-up does not stretch the axis
    fp16 = to_hex(drawn_lines(fig)["precision=fp16"].get_color())
    crosses = [(line.get_xdata()[0], line.get_ydata()[0]) for line in ax.get_lines() if line.get_marker() == "x"]
    assert crosses == [(0.1, pytest.approx(0.95))]
    assert edge_markers(ax, "^", top) == [(1e-3, fp16), (1e-2, fp16), (1e-1, fp16)]
    assert sorted(text.get_text() for text in ax.texts) == ["1e+13", "nan", "not logged"]
    title = ax.get_title()
    assert "x: a job that did not complete" in title and "^ on the top edge" in title


def test_off_chart_labels_say_when_a_line_leaves_the_chart_and_whether_it_comes_back(tmp_path):
    from matplotlib.colors import to_hex

    jobs = [FakeJob({"optim.lr": lr}, decay(end)) for lr, end in (("0.01", 0.5), ("0.1", 0.1), ("0.3", 0.2))]
    spiky = decay(0.3)
    spiky[1:3] = [1e6, 1e6]  # steps 20 and 30: a spike it recovers from
    spiky[5] = None  # step 60: one non-finite loss
    spiky[20:] = [1e9] * 10  # from step 210 on, for good
    once = decay(0.2)
    once[3] = 1e7  # step 40 alone
    jobs += [FakeJob({"optim.lr": "1"}, spiky), FakeJob({"optim.lr": "3"}, once)]
    fig = line_figure(find_jobs(write_sweep(tmp_path, jobs)), "train/loss", "t")
    ax = fig.axes[0]
    top = ax.get_ylim()[1]
    assert ax.get_yscale() == "linear" and top < 3  # the spikes are off the chart
    lines = drawn_lines(fig)
    assert "3: optim.lr=1 (off chart at steps 20-30 and from step 210; non-finite at step 60)" in lines
    assert "4: optim.lr=3 (off chart at step 40)" in lines
    colour = to_hex(
        lines["3: optim.lr=1 (off chart at steps 20-30 and from step 210; non-finite at step 60)"].get_color()
    )
    assert [x for x, c in edge_markers(ax, "^", top) if c == colour] == [20, 210]  # where each excursion starts
    assert [x for x, _ in edge_markers(ax, "X", top)] == [60]
    # every label's claim holds: off the chart at the steps it names, on it at the others
    bottom = ax.get_ylim()[0]
    spiky_line = lines["3: optim.lr=1 (off chart at steps 20-30 and from step 210; non-finite at step 60)"]
    steps, values = spiky_line.get_xdata(), spiky_line.get_ydata()
    off = {int(s) for s, v in zip(steps, values) if not (math.isfinite(v) and bottom <= v <= top)}
    assert off == {20, 30, 60, *range(210, 310, 10)}


def test_a_std_band_on_a_log_axis_stops_at_the_lowest_seed_instead_of_the_bottom(tmp_path):
    import numpy as np

    low = decay(0.005, 0, steps=80)
    high = [value * (30 if 20 <= i < 40 else 1) for i, value in enumerate(decay(0.005, 1, steps=80))]
    jobs = [FakeJob({"precision": "bf16", "seed": "0"}, low), FakeJob({"precision": "bf16", "seed": "1"}, high)]
    fig = line_figure(find_jobs(write_sweep(tmp_path, jobs)), "train/loss", "t")
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    seeds = np.array([low, high])
    mean, std = seeds.mean(axis=0), seeds.std(axis=0, ddof=1)
    assert (mean - std <= 0).sum() >= 20  # steps 210-400: mean - std has no place on a log axis
    (band,) = ax.collections
    vertices = band.get_paths()[0].vertices
    for step, lowest, upper in zip(range(10, 810, 10), seeds.min(axis=0), mean + std):
        ys = vertices[np.isclose(vertices[:, 0], step), 1]
        assert (ys.min(), ys.max()) == pytest.approx((lowest, upper))  # 2 seeds: mean - std is below the lower one
    assert ax.get_ylim()[0] < seeds.min() and ax.get_ylim()[0] > seeds.min() / 3  # the data sets the bottom
    assert "lowest seed" in ax.get_legend().get_title().get_text()


def test_a_report_of_many_configurations_tells_every_line_apart_and_names_the_defaults(tmp_path):
    """`halfprec report outputs/runs/<date>`: 34 configurations of three overrides, the defaults run twice."""
    import itertools

    import numpy as np
    from matplotlib.colors import to_rgb

    runs = [({"precision": p, "optim.lr": f"{lr:g}"}, 0.1 + lr) for p in ("fp16", "bf16", "fp32") for lr in range(11)]
    runs = [
        ({**overrides, "scaler": "dynamic"} if i % 4 == 0 else overrides, end)
        for i, (overrides, end) in enumerate(runs)
    ]
    runs += [({}, 0.3), ({"seed": "1"}, 0.31)]  # `python train.py` and `python train.py seed=1`
    for i, (overrides, end) in enumerate(runs):
        write_run(tmp_path / "2026-12-03" / f"08-{i:02d}-00.000000", FakeJob(overrides, decay(end)))
    fig = line_figure(find_jobs(tmp_path / "2026-12-03"), "train/loss", "t")
    lines = drawn_lines(fig)
    assert len(lines) == 34 and "defaults: mean ± std, n=2" in lines
    legend = fig.axes[0].get_legend()
    assert all(text.get_text().strip() and not text.get_text().startswith(("mean", ":")) for text in legend.get_texts())
    looks = [(line.get_linestyle(), line.get_marker()) for line in lines.values()]
    assert len(set(zip([to_rgb(line.get_color()) for line in lines.values()], looks))) == 34
    # lines that share a line style and marker differ clearly in colour (a colormap at 34 points did not)
    for (look_a, a), (look_b, b) in itertools.combinations(zip(looks, lines.values()), 2):
        if look_a == look_b:
            assert np.linalg.norm(np.subtract(to_rgb(a.get_color()), to_rgb(b.get_color()))) > 0.2


def test_help_and_docstring_name_every_plot_the_report_writes(capsys):
    from halfprec.tools import report as report_module
    from halfprec.tools.cli import main

    with pytest.raises(SystemExit):
        main(["report", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    doc = " ".join((report_module.__doc__ or "").split())
    for text in (help_text, doc):
        for name in ("report.md", "loss.png", "scale.png", "sweep.png", "attn_logits.png", "logz.png"):
            assert name in text, (name, text)
    for name in (
        "quant_err.png",
        "grad_noise.png",
        "quant_heatmap_<job>.png",
        "shadow_<format>_<job>.png",
        "eval_gap_<entry>.png",
    ):
        assert name in doc, name  # (the help is cli.py's)
    assert "two plots" not in doc


def test_evaluation_precisions_get_a_column_each_and_a_gap_plot(tmp_path, capsys):
    """precision.eval's val/loss@<entry>: a column per entry after the val/* ones (mean ± std over seeds,
    "-" for a job that did not evaluate in it), and eval_gap_<entry>.png of its distance above val/loss."""
    jobs = []
    for steps in ("100", "200"):
        for seed in range(2):
            gap = 0.01 * int(steps) / 100 + seed / 1000
            job = FakeJob({"trainer.max_steps": steps, "seed": str(seed)}, decay(0.5, seed, steps=4))
            job.extra = {i: {"val/loss": 1.0, "val/loss@mxfp4": 1.0 + gap * (i + 1)} for i in range(4)}
            jobs.append(job)
    jobs.append(FakeJob({"trainer.max_steps": "400", "seed": "0"}, decay(0.5, steps=4)))  # no precision.eval
    sweep_dir = write_sweep(tmp_path / "sweep", jobs)
    assert write_report(sweep_dir, tmp_path / "out") == 0
    (group_header, groups), (job_header, per_job), (gap_header, gaps) = parse_tables(capsys.readouterr().out)
    assert job_header[job_header.index("val/acc") + 1] == "val/loss@mxfp4"
    assert [row["val/loss@mxfp4"] for row in per_job] == ["1.0400", "1.0440", "1.0800", "1.0840", "-"]
    assert groups[1]["val/loss@mxfp4"] == f"1.0820 ± {statistics.stdev([1.08, 1.084]):.4f} (n=2)"
    # the gap at the last validation, per configuration; the job without precision.eval has none
    assert gap_header == ["trainer.max_steps", "jobs", "val/loss@mxfp4 - val/loss"]
    assert [row["val/loss@mxfp4 - val/loss"] for row in gaps] == [
        f"0.0420 ± {statistics.stdev([0.04, 0.044]):.4f} (n=2)",
        f"0.0820 ± {statistics.stdev([0.08, 0.084]):.4f} (n=2)",
        "-",
    ]
    assert_png(tmp_path / "out" / "eval_gap_mxfp4.png")
    from halfprec.tools.report.eval_plot import gap_job

    gaps = gap_job(find_jobs(sweep_dir)[2], "val/loss@mxfp4", "gap").rows
    assert [row["step"] for row in gaps] == [10, 20, 30, 40]
    assert [round(row["gap"], 6) for row in gaps] == [0.02, 0.04, 0.06, 0.08]


# Quantization statistics (an emulated number format with diagnostics=grads): on diagnostics steps,
# quant/<layer>/<operand>/{rel_err, underflow, saturated} and their mean and largest rel_err.


def quant_stats(errors: dict[str, dict[str, float | None]]) -> dict[str, Any]:
    """A diagnostics row's quant keys, as training/diagnostics.py logs them: {layer: {operand: rel_err}}
    (None: a non-finite value, written as null)."""
    row: dict[str, Any] = {}
    for layer, ops in errors.items():
        for op, err in ops.items():
            stats = {"rel_err": err, "underflow": 0.0, "saturated": 0.0}
            row.update({f"quant/{layer}/{op}/{stat}": value for stat, value in stats.items()})
    finite = [err for ops in errors.values() for err in ops.values() if err is not None]
    return {**row, "diag/quant_rel_err": statistics.fmean(finite), "diag/quant_rel_err_max": max(finite)}


def quant_job(overrides: dict[str, str], scale: float, seed: int = 0) -> FakeJob:
    """A job that logged quant stats every 10th row (steps 10, 110, 210): errors `scale` times a layer's base."""
    base = {"blocks.0.attn.qkv": 0.01, "blocks.0.mlp.fc": 0.02, "head": 0.005}
    extra = {
        i: quant_stats({layer: {op: err * scale * (1 + i / 100) for op in ("input", "weight", "grad_output")}
                        for layer, err in base.items()})
        for i in (0, 10, 20)
    }  # fmt: skip
    for i, row in extra.items():
        row["diag/grad_noise"] = 10.0 / scale - i / 10  # the ratio falls as training goes on
    return FakeJob(overrides, decay(0.2, seed), extra=extra)


def test_quant_map_is_the_last_step_with_quant_keys_a_row_per_layer_in_logged_order():
    from halfprec.tools.report.quant import quant_cell, quant_map

    early = {"step": 10, "quant/blocks.0.attn.qkv/input/rel_err": 0.5, "quant/early.only/weight/rel_err": 0.5}
    last = {
        "step": 30,
        "train/loss": 1.0,
        "quant/blocks.1.mlp.fc/weight/rel_err": 0.0123,  # logged first: its row comes first
        "quant/blocks.1.mlp.fc/weight/underflow": 0.25,  # not an error: not in the map
        "quant/blocks.1.mlp.fc/input/rel_err": 0.5,
        "quant/blocks.0.attn.qkv/grad_output/rel_err": math.nan,  # logged as null
        "quant/blocks.0.attn.qkv/input/rel_err": 0.000123,
        "diag/quant_rel_err": 0.1,
    }
    rows = [early, {"step": 20, "train/loss": 2.0}, last, {"step": 40, "train/loss": 0.9}]
    qmap = quant_map(rows)
    assert qmap is not None and qmap.step == 30  # not step 40 (no quant keys), not step 10 (earlier)
    assert qmap.layers == ["blocks.1.mlp.fc", "blocks.0.attn.qkv"]  # early.only was not logged at step 30
    assert qmap.operands == ["input", "weight", "grad_output"]
    (fc_in, fc_w, fc_g), (qkv_in, qkv_w, qkv_g) = qmap.values
    assert (fc_in, fc_w, qkv_in) == (0.5, 0.0123, 0.000123)
    assert all(math.isnan(v) for v in (fc_g, qkv_w, qkv_g))  # not logged (or logged as null): no colour
    assert qmap.texts == [["0.5", "0.012", ""], ["0.00012", "", "nan"]]  # 2 significant digits; blank: missing
    assert quant_cell("quant/blocks.1.mlp.fc/input/saturated") is None and quant_cell("diag/quant_rel_err") is None
    assert quant_map([{"step": 1, "train/loss": 1.0, "diag/quant_rel_err": 0.1}]) is None


def test_a_quant_heatmap_colours_and_annotates_each_cell_and_labels_its_colorbar():
    import numpy as np

    from halfprec.tools.report.quant import QUANT_LABEL, quant_heatmap, quant_map

    errors = {"blocks.0.attn.qkv": {"input": 0.01, "weight": 0.002}, "head": {"input": 0.3, "grad_output": 0.0}}
    qmap = quant_map([{"step": 7, **quant_stats(errors)}])
    assert qmap is not None
    fig = quant_heatmap(qmap, "job 3: precision=nvfp4\nrelative quantization error at step 7")
    ax, colorbar = fig.axes
    (image,) = ax.images
    shown = image.get_array()
    np.testing.assert_array_equal(shown.mask, [[False, False, True], [False, True, False]])  # grey: not logged
    np.testing.assert_allclose(shown.data[~shown.mask], [0.01, 0.002, 0.3, 0.0])
    assert image.get_cmap().name.startswith("viridis") and image.norm.__class__.__name__ == "LogNorm"  # 150x apart
    assert [t.get_text() for t in ax.texts] == ["0.01", "0.002", "", "0.3", "", "0"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["blocks.0.attn.qkv", "head"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["input", "weight", "grad_output"]
    assert colorbar.get_ylabel() == QUANT_LABEL == "relative error ||q(x) - x|| / ||x||"
    assert "step 7" in ax.get_title() and "job 3" in ax.get_title()


def test_report_draws_a_quant_heatmap_per_job_with_stats_and_none_for_the_others(tmp_path, capsys):
    jobs = [
        quant_job({"precision": "mxfp8"}, 1.0),
        FakeJob({"precision": "bf16"}, decay(0.2)),  # no emulated format: no stats
        quant_job({"precision": "nvfp4"}, 8.0),
    ]
    sweep_dir = write_sweep(tmp_path / "sweep", jobs)
    out = tmp_path / "out"
    assert write_report(sweep_dir, out) == 0
    text = capsys.readouterr().out
    assert sorted(p.name for p in out.glob("quant*")) == ["quant_err.png", "quant_heatmap_0.png", "quant_heatmap_2.png"]
    for name in ("quant_err.png", "grad_noise.png", "quant_heatmap_0.png", "quant_heatmap_2.png"):
        assert_png(out / name)
        assert f"![{name[:-4]}]({name})" in text
    assert "left out" not in text

    # a run without stats: no heatmap, no line plot, nothing said of them
    single = tmp_path / "single"
    write_run(single, FakeJob({"precision": "bf16"}, decay(0.2)))
    assert write_report(single, tmp_path / "single_out") == 0
    text = capsys.readouterr().out
    assert "![quant" not in text and "quantization" not in text  # (tmp_path's name has "quant" in it)
    assert not list((tmp_path / "single_out").glob("quant*"))
    assert not (tmp_path / "single_out" / "grad_noise.png").exists()


def test_past_max_heatmaps_report_md_names_the_jobs_left_out(tmp_path, capsys, monkeypatch):
    from halfprec.tools.report import quant

    monkeypatch.setattr(quant, "MAX_HEATMAPS", 2)  # 12 real heatmaps would take a while to draw
    jobs = [quant_job({"optim.lr": lr}, scale) for lr, scale in (("1e-3", 1.0), ("1e-2", 2.0), ("1e-1", 4.0))]
    jobs.insert(1, FakeJob({"optim.lr": "3e-3"}, decay(0.2)))  # without stats: not counted
    jobs.append(quant_job({"optim.lr": "1"}, 8.0))
    out = tmp_path / "out"
    assert write_report(write_sweep(tmp_path / "sweep", jobs), out) == 0
    text = capsys.readouterr().out
    assert sorted(p.name for p in out.glob("quant_heatmap_*")) == ["quant_heatmap_0.png", "quant_heatmap_2.png"]
    assert "the first 2 of the 4 jobs with quantization statistics; 2 left out: jobs 3, 4." in text


def test_quant_err_plot_dashes_the_largest_error_beside_each_mean_in_its_colour(tmp_path):
    from matplotlib.colors import to_hex

    from halfprec.tools.report.quant import QUANT_MAX, QUANT_MEAN

    # two overrides with few values: a plain line plot would tell the second apart by line style
    jobs = [
        quant_job({"precision": p, "model.block": b, "seed": str(s)}, scale * (1 + s / 10), s)
        for p, scale in (("mxfp8", 1.0), ("nvfp4", 8.0))
        for b in ("16", "32")
        for s in (0, 1)
    ]
    jobs.append(FakeJob({"precision": "bf16", "model.block": "16"}, decay(0.2)))  # no stats: no line
    fig = line_figure(find_jobs(write_sweep(tmp_path, jobs)), QUANT_MEAN, "t", whole=True, dashed_key=QUANT_MAX)
    ax = fig.axes[0]
    solid = drawn_lines(fig)
    configs = [f"precision={p} model.block={b}" for p in ("mxfp8", "nvfp4") for b in ("16", "32")]
    assert sorted(solid) == sorted(f"{config}: mean ± std, n=2" for config in configs)
    assert {line.get_linestyle() for line in solid.values()} == {"-"}
    dashes = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert len(dashes) == 4 and len({to_hex(line.get_color()) for line in solid.values()}) == 4
    assert {to_hex(line.get_color()) for line in dashes} == {to_hex(line.get_color()) for line in solid.values()}
    for line in solid.values():  # each mean's dashed line: its largest layer, at the same steps
        (maximum,) = [d for d in dashes if to_hex(d.get_color()) == to_hex(line.get_color())]
        assert list(maximum.get_xdata()) == list(line.get_xdata()) == [10, 110, 210]
        assert all(m > v for m, v in zip(maximum.get_ydata(), line.get_ydata()))
    bottom, top = ax.get_ylim()  # whole: every line on the chart, nvfp4's 8x larger errors too
    assert all(bottom <= v <= top for line in [*solid.values(), *dashes] for v in line.get_ydata())
    assert "dashed, same colour: diag/quant_rel_err_max" in ax.get_legend().get_title().get_text()
    assert len(ax.collections) == 4  # a band per mean, none for the dashed lines


def test_a_sweep_over_formats_plots_val_loss_against_bits_per_value(tmp_path):
    from halfprec.tools.report.bits_plot import bits_figure, format_points, spread
    from halfprec.tools.report.groups import group_jobs
    from halfprec.tools.report.runs import find_jobs

    fakes = [FakeJob({"precision.format": f, "seed": str(s)}, decay(0.5 + s / 10)) for f in ("null", "mxfp4", "nvfp4")
             for s in (0, 1)]  # fmt: skip
    jobs = find_jobs(write_sweep(tmp_path / "sweep", fakes))
    points = {g.overrides["precision.format"]: format_points(g.jobs, "train/loss") for g in group_jobs(jobs)}
    # MXFP4: 4 bits and an 8-bit scale per 32 values; NVFP4: an 8-bit scale per 16; null: no config: fp32
    assert {f: bits for f, (bits, _) in points.items()} == {"null": 32.0, "mxfp4": 4.25, "nvfp4": 4.5}
    assert [len(values) for _, values in points.values()] == [2, 2, 2]
    fig = bits_figure(jobs, "train/loss")
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == [
        "null (32 bits)", "mxfp4 (4.25 bits)", "nvfp4 (4.5 bits)"]  # fmt: skip
    assert write_report(tmp_path / "sweep", tmp_path / "out") == 0 and (tmp_path / "out" / "bits.png").is_file()
    # formats of equal bits side by side around their bits, the others where their bits are
    same = {"fp8_e4m3": (8.0, [1.0]), "mxfp4": (4.25, [1.0]), "fp8_e5m2": (8.0, [1.0]), "fp8_e4m3_row": (8.0, [1.0])}
    assert spread(same, step=0.1) == pytest.approx([7.9, 4.25, 8.0, 8.1])
    plain = find_jobs(write_sweep(tmp_path / "lr", [FakeJob({"optim.lr": "0.1"}, decay(0.5))] * 2))
    assert bits_figure(plain, "train/loss") is None  # no format swept: no plot


def assert_inside(fig: Any, ax: Any) -> None:
    """The axes' title, once the figure is laid out, lies inside the figure and above its axes alone
    (not over the legend beside them)."""
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    title, axes = ax.title.get_window_extent(renderer), ax.get_window_extent(renderer)
    assert 0 <= title.x0 and title.x1 <= fig.bbox.width and 0 <= title.y0 and title.y1 <= fig.bbox.height
    assert axes.x0 - 1 <= title.x0 and title.x1 <= axes.x1 + 1, (title, axes)


def test_a_long_title_is_wrapped_to_fit_above_its_plot(tmp_path):
    """quant_err.png's title ran off the figure's left edge: a constrained layout makes room above the
    axes for a title, not beside them. A sweep with long overrides: a long title, a wide legend."""
    from halfprec.tools.report.quant import QUANT_MAX, QUANT_MEAN, quant_err_title

    jobs = [
        quant_job({"precision.recipe.stochastic_rounding": sr, "precision.recipe.hadamard_block": h}, 1.0)
        for sr in ("false", "true")
        for h in ("16", "32")
    ]
    found = find_jobs(write_sweep(tmp_path / "sweep", jobs))
    title = quant_err_title("2026-12-03/08-09-58.123456")  # the sweep's date and time, as write_report has it
    fig = line_figure(found, QUANT_MEAN, title, whole=True, dashed_key=QUANT_MAX)
    ax = fig.axes[0]
    shown = ax.get_title()
    assert "\n" in shown and shown.split() == title.split()  # wrapped between words, every word kept
    assert "2026-12-03/08-09-58.123456" in shown  # not broken at its hyphens
    assert_inside(fig, ax)
    # a word longer than the room (a path of overrides, no spaces) is broken: it fits all the same
    title = quant_err_title("multirun/2026-12-03/08-09-58.123456_precision.recipe.stochastic_rounding=true,false")
    fig = line_figure(found, QUANT_MEAN, title, whole=True, dashed_key=QUANT_MAX)
    assert "".join(fig.axes[0].get_title().split()) == "".join(title.split())
    assert_inside(fig, fig.axes[0])
    short = line_figure(found, QUANT_MEAN, "train/loss: 2026-12-03/08-09-58.123456")
    assert short.axes[0].get_title() == "train/loss: 2026-12-03/08-09-58.123456"  # a title that fits: one line


def bits_panel(tmp_path: Path, seeds: dict[str, int]) -> Any:
    """bits.png's one panel for a sweep of formats, each run with seeds 0 to seeds[format] - 1."""
    from halfprec.tools.report.bits_plot import bits_figure

    fakes = [
        FakeJob({"precision.format": fmt, "seed": str(s)}, decay(0.5 + s / 10, s))
        for fmt, n in seeds.items()
        for s in range(n)
    ]
    fig = bits_figure(find_jobs(write_sweep(tmp_path / "_".join(map(str, seeds.values())), fakes)), "val/loss")
    (ax,) = fig.axes
    assert_inside(fig, ax)
    return ax


def test_the_bits_plot_says_how_many_seeds_each_point_is_and_bars_only_several(tmp_path):
    """A sweep of one seed per format said "mean ± std over seeds" and drew no bar: its title says one
    seed each; over several, the mean ± std over how many (their range when they differ), barred."""

    def title_and_bars(seeds: dict[str, int]) -> tuple[str, list[bool]]:
        ax = bits_panel(tmp_path, seeds)
        return " ".join(ax.get_title().split()), [container.has_yerr for container in ax.containers]

    title, bars = title_and_bars({"mxfp4": 1, "nvfp4": 1, "fp8_e4m3": 1})
    assert title == "the sweep: final val/loss, one seed each" and bars == [False] * 3
    title, bars = title_and_bars({"mxfp4": 2, "nvfp4": 2})
    assert title == "the sweep: final val/loss, mean ± std over 2 seeds" and bars == [True, True]
    title, bars = title_and_bars({"mxfp4": 3, "nvfp4": 2})
    assert title.endswith("mean ± std over 2-3 seeds") and bars == [True, True]
    title, bars = title_and_bars({"mxfp4": 3, "nvfp4": 1})
    assert title.endswith("mean ± std over 1-3 seeds (no error bar: one seed)") and bars == [True, False]


def logit_job(overrides: dict[str, str], attention: bool) -> FakeJob:
    """A job with diagnostics=grads at rows 0, 10 and 20: log Z of its output, as every model logs it,
    and with `attention` its attention layers' largest logits, as a transformer (the GPT) logs them."""
    extra = {}
    for i in (0, 10, 20):
        row = {"diag/output_logz": 2.0 + i / 10, "diag/output_logz_max": 3.0 + i / 10}
        if attention:
            layers = {"attn_logit_max/blocks.0.attn": 5.0 + i, "attn_logit_max/blocks.1.attn": 6.0 + i}
            row.update({**layers, "diag/attn_logit_max": max(layers.values())})
        extra[i] = row
    return FakeJob(overrides, decay(0.2), extra=extra)


def test_logit_plots_are_written_for_transformers_alone(tmp_path, capsys):
    """A plain MLP logs its output's log Z too; logz.png, which the help promises for a transformer
    with diagnostics=grads, is written only for jobs that also logged attention logits."""
    mlp = [logit_job({"optim.lr": lr}, attention=False) for lr in ("1e-3", "1e-2")]
    assert write_report(write_sweep(tmp_path / "mlp", mlp), tmp_path / "mlp_out") == 0
    text = capsys.readouterr().out
    assert not (tmp_path / "mlp_out" / "logz.png").exists() and not (tmp_path / "mlp_out" / "attn_logits.png").exists()
    assert "logz" not in text and "attn_logits" not in text
    assert (tmp_path / "mlp_out" / "loss.png").is_file()

    gpt = [logit_job({"task": "lm", "optim.lr": lr}, attention=True) for lr in ("1e-3", "1e-2")]
    assert write_report(write_sweep(tmp_path / "gpt", gpt), tmp_path / "gpt_out") == 0
    text = capsys.readouterr().out
    for name in ("attn_logits.png", "logz.png"):
        assert_png(tmp_path / "gpt_out" / name)
        assert f"![{name[:-4]}]({name})" in text


# What-if statistics (diagnostics.shadow=[...], in any run): on diagnostics steps,
# shadow/<format>/<layer>/<operand>/{rel_err, underflow, saturated} and diag/shadow/<format>/rel_err.


def shadow_stats(fmt: str, errors: dict[str, dict[str, float | None]]) -> dict[str, Any]:
    """A diagnostics row's shadow keys for one format, as training/diagnostics.py logs them."""
    quant = quant_stats(errors)
    row = {f"shadow/{fmt}/{k.partition('/')[2]}": v for k, v in quant.items() if k.startswith("quant/")}
    mean, largest = quant["diag/quant_rel_err"], quant["diag/quant_rel_err_max"]
    return {**row, f"diag/shadow/{fmt}/rel_err": mean, f"diag/shadow/{fmt}/rel_err_max": largest}


def shadow_job(steps: int = 30) -> FakeJob:
    """A bf16 job that logged mxfp4 and nvfp4 shadow stats every 5th row (steps 10, 60, ... 260), each
    layer's error its base times 1 + row / 10 (nvfp4's 0.7 times mxfp4's)."""
    base = {"blocks.0.attn.qkv": 0.1, "blocks.0.mlp.fc": 0.2, "lm_head": 0.05}

    def row(i: int) -> dict[str, Any]:
        keys: dict[str, Any] = {}
        for fmt, scale in (("mxfp4", 1.0), ("nvfp4", 0.7)):
            errors = {layer: {op: err * scale * (1 + i / 10) for op in QUANT_OPS} for layer, err in base.items()}
            keys.update(shadow_stats(fmt, errors))
        return keys

    extra = {i: row(i) for i in range(0, steps, 5)}
    return FakeJob({"precision": "bf16", "diagnostics.shadow": "[mxfp4,nvfp4]"}, decay(0.2, steps=steps), extra=extra)


QUANT_OPS = ("input", "weight", "grad_output")


def test_shadow_maps_are_a_layer_by_step_grid_per_format_and_operand():
    from halfprec.tools.report.shadow import shadow_cell, shadow_maps

    rows = [
        {"step": 1, "shadow/mxfp4/fc1/input/rel_err": 0.1, "shadow/mxfp4/fc1/weight/rel_err": 0.2,
         "shadow/mxfp4/fc1/input/underflow": 0.5, "diag/shadow/mxfp4/rel_err": 0.15},
        {"step": 2, "train/loss": 1.0},  # not a diagnostics step: no column
        {"step": 4, "shadow/mxfp4/fc1/input/rel_err": 0.3, "shadow/mxfp4/head/grad_output/rel_err": math.nan,
         "shadow/nvfp4/fc1/input/rel_err": 0.05},
    ]  # fmt: skip
    mx, nv = shadow_maps(rows)
    assert (mx.format, mx.steps, mx.layers, mx.operands) == ("mxfp4", [1, 4], ["fc1", "head"], list(QUANT_OPS))
    assert mx.values["input"][0] == [0.1, 0.3] and all(math.isnan(v) for v in mx.values["input"][1])
    assert mx.values["weight"][0][0] == 0.2 and math.isnan(mx.values["weight"][0][1])  # not logged at step 4
    assert all(math.isnan(v) for v in mx.values["grad_output"][1])  # logged as null, or not at all
    assert (nv.steps, nv.layers, nv.values["input"]) == ([4], ["fc1"], [[0.05]])
    assert shadow_cell("shadow/mxfp4/fc1/input/saturated") is None and shadow_cell("diag/shadow/mxfp4/rel_err") is None
    assert shadow_cell("quant/fc1/input/rel_err") is None and shadow_maps([{"step": 1, "train/loss": 1.0}]) == []


def test_a_run_with_shadow_stats_gets_its_damage_per_layer_over_steps_per_format(tmp_path, capsys):
    single = tmp_path / "single"
    write_run(single, shadow_job())
    out = tmp_path / "out"
    assert write_report(single, out) == 0
    text = capsys.readouterr().out
    names = ["shadow_mxfp4_single.png", "shadow_nvfp4_single.png"]
    assert sorted(p.name for p in out.glob("shadow*")) == names
    for name in names:
        assert_png(out / name)
        assert f"![{name[:-4]}]({name})" in text
    assert not list(out.glob("quant*"))  # bf16 quantizes nothing itself: no quant plots

    from halfprec.tools.report.shadow import shadow_figure, shadow_maps

    mx, _ = shadow_maps(find_jobs(single)[0].rows)
    fig = shadow_figure(mx, "t")
    *panels, colorbar = fig.axes
    assert [ax.get_title() for ax in panels] == list(QUANT_OPS)
    image = panels[0].images[0].get_array()
    assert image.shape == (3, 6)  # 3 layers down, the 6 diagnostics steps across
    assert image[0, 0] == pytest.approx(0.1) and image[0, -1] == pytest.approx(0.1 * 3.5)  # blocks.0.attn.qkv, growing
    assert [t.get_text() for t in panels[0].get_yticklabels()] == ["blocks.0.attn.qkv", "blocks.0.mlp.fc", "lm_head"]
    assert [t.get_text() for t in panels[0].get_xticklabels()] == ["10", "60", "110", "160", "210", "260"]
    assert colorbar.get_ylabel() == "relative error ||q(x) - x|| / ||x||"

    plain = tmp_path / "plain"  # without shadow stats: no shadow figure, nothing said of it
    write_run(plain, FakeJob({"precision": "bf16"}, decay(0.2)))
    assert write_report(plain, tmp_path / "plain_out") == 0
    assert "![shadow" not in capsys.readouterr().out and not list((tmp_path / "plain_out").glob("shadow*"))
