"""Finding the runs below PATH and reading each into a Job: its overrides and config (.hydra/), its
metric rows (metrics.jsonl), and how it ended (summary.json, the sweep's sweep.jsonl, crash
checkpoints). What the runs left on disk is all it reads, so finished, failed and still-running
sweeps read alike."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from halfprec.launch.sweep_log import read_lines

EXPECTED = (
    "expected a run dir (with metrics.jsonl or .hydra/), a multirun sweep dir (with <n>_<overrides>/ job dirs), "
    "or a dir holding such runs"
)


class ReportError(Exception):
    """PATH holds nothing to report on; the message says what was expected."""


@dataclass
class Job:
    """One run dir: its overrides and config, its metric rows, and how it ended."""

    id: str  # the job number in a sweep ("3"), the dir name of a single run, prefixed by its sweep below PATH
    dir: Path
    overrides: dict[str, str]
    config: dict[str, Any]
    rows: list[dict[str, Any]]
    status: str  # completed | failed | running, or what sweep.jsonl or summary.json say ("diverged", ...)
    summary: dict[str, Any] = field(default_factory=dict)  # summary.json of a finished run
    error: str | None = None
    sort_key: tuple = field(default=(), repr=False)


def safe_name(text: str) -> str:
    """`text` made safe for a file name and a W&B key (no / or .)."""
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in text)


def file_id(job: Job) -> str:
    """The job's id made safe (safe_name): the plots named after a job."""
    return safe_name(job.id)


def is_run_dir(path: Path) -> bool:
    return (path / "metrics.jsonl").is_file() or (path / ".hydra").is_dir()


def job_number(run_dir: Path) -> int | None:
    """Hydra names multirun job dirs `<job.num>_<overrides>`; other run dirs have no number."""
    head = run_dir.name.split("_", 1)[0]
    return int(head) if "_" in run_dir.name and head.isdigit() else None


def find_jobs(path: Path) -> list[Job]:
    """Every run at or below `path`, sorted by sweep, then job number."""
    if not path.is_dir():
        raise ReportError(f"{path}: no such directory; {EXPECTED}")
    root = path.resolve()
    if is_run_dir(root):
        run_dirs = [root]
    else:
        markers = [*root.rglob("metrics.jsonl"), *root.rglob(".hydra")]
        run_dirs = sorted({marker.parent for marker in markers})
    if not run_dirs:
        raise ReportError(f"{path}: no runs found; {EXPECTED}")
    check_one_sweep_per_dir(run_dirs)
    sweep_lines: dict[Path, dict[int, dict]] = {}
    jobs = []
    for run_dir in run_dirs:
        if run_dir.parent not in sweep_lines:
            sweep_lines[run_dir.parent] = read_lines(run_dir.parent / "sweep.jsonl")
        jobs.append(read_job(run_dir, root, sweep_lines[run_dir.parent]))
    return sorted(jobs, key=lambda job: job.sort_key)


def check_one_sweep_per_dir(run_dirs: list[Path]) -> None:
    """Refuse a sweep dir that holds the jobs of several sweeps (launched into one hydra.sweep.dir
    before train.py refused that): Hydra numbers each launch's jobs from 0, so their sweep.jsonl
    lines and their statistics would mix."""
    seen: dict[tuple[Path, int], Path] = {}
    for run_dir in run_dirs:
        num = job_number(run_dir)
        if num is None:
            continue
        other = seen.setdefault((run_dir.parent, num), run_dir)
        if other != run_dir:
            raise ReportError(
                f"{run_dir.parent}: holds the jobs of more than one sweep (job {num} is both {other.name} and "
                f"{run_dir.name}); their statistics would mix: move each sweep's <n>_<overrides> dirs into a dir "
                f"of their own and report each"
            )


def read_job(run_dir: Path, root: Path, sweep_lines: dict[int, dict]) -> Job:
    num = job_number(run_dir)
    own = str(num) if num is not None else run_dir.name
    sweep = "." if run_dir == root else run_dir.parent.relative_to(root).as_posix()  # "." : directly in PATH
    job_id = own if sweep == "." else f"{sweep}/{own}"
    summary = read_json(run_dir / "summary.json")
    status, error = job_status(run_dir, summary, sweep_lines.get(num) if num is not None else None)
    return Job(
        id=job_id,
        dir=run_dir,
        overrides=read_overrides(run_dir / ".hydra" / "overrides.yaml"),
        config=read_yaml(run_dir / ".hydra" / "config.yaml") or {},
        rows=read_rows(run_dir / "metrics.jsonl"),
        status=status,
        summary=summary,
        error=error,
        sort_key=(sweep, num if num is not None else math.inf, run_dir.name),
    )


def read_rows(path: Path) -> list[dict[str, Any]]:
    """metrics.jsonl rows, with null (a non-finite value) read as nan so that it differs from a key never logged."""
    if not path.is_file():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # a running job may be halfway through writing its last row
                break
            raise ReportError(f"{path}, line {i + 1}: not JSON: {line[:80]!r}") from None
        rows.append({key: math.nan if value is None else value for key, value in row.items()})
    return rows


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def read_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text()) if path.is_file() else None


def read_overrides(path: Path) -> dict[str, str]:
    """`precision=fp16` -> {"precision": "fp16"}, in the order given on the command line."""
    overrides = {}
    for item in read_yaml(path) or []:
        key, _, value = str(item).partition("=")
        overrides[key] = value
    return overrides


def job_status(run_dir: Path, summary: dict[str, Any], sweep_line: dict | None) -> tuple[str, str | None]:
    """(status, first line of the error) from what the job left behind."""
    # summary.json is written only when training ends; it goes first because a job that failed in
    # its sweep may have been finished later by hand (hydra.run.dir=<job dir> resume=auto). A run that
    # ended may still say it went wrong ("status": "diverged"); without the key it completed.
    if (run_dir / "summary.json").is_file():
        error = summary.get("error")  # a diverged run's holds its culprit and scale history too
        return str(summary.get("status") or "completed"), error.splitlines()[0] if error else None
    if sweep_line is not None:
        error = sweep_line.get("error")
        return sweep_line.get("status", "failed"), error.splitlines()[0] if error else None
    if any((run_dir / "checkpoints").glob("crash-step-*.pt")):
        return "failed", None
    # no end recorded: still training, or killed before it could write one (SIGKILL, out of memory)
    return "running", None
