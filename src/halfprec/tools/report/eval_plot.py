"""How far a run's val/loss in an evaluation precision (precision.eval's val/loss@<entry>) lies above
its own val/loss, the cost of post-training quantization: at the last validation, a table per
configuration (mean ± std over seeds), and against step, eval_gap_<entry>.png."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from halfprec.metrics import VAL_LOSS
from halfprec.tools.report.columns import EVAL_LOSS, eval_losses
from halfprec.tools.report.groups import group_jobs, is_seed, shown_overrides, spread
from halfprec.tools.report.plots import plot_lines
from halfprec.tools.report.runs import Job, safe_name
from halfprec.tools.report.tables import Table


def gap_job(job: Job, key: str, gap: str) -> Job:
    """The job with one row per validation that logged both `key` and val/loss: their difference as `gap`."""
    rows = [
        {"step": row["step"], gap: row[key] - row[VAL_LOSS.name]}
        for row in job.rows
        if row.get(key) is not None and row.get(VAL_LOSS.name) is not None
    ]
    return dataclasses.replace(job, rows=rows)


def write_eval_plots(jobs: list[Job], out: Path, where: str) -> list[Path]:
    """eval_gap_<entry>.png for each evaluation precision any job logged; the files written."""
    images = []
    for key in dict.fromkeys(k for job in jobs for k in eval_losses(job.rows)):
        entry = key[len(EVAL_LOSS) :]
        gap = f"{key} - {VAL_LOSS.name}"
        path = out / f"eval_gap_{safe_name(entry)}.png"
        title = f"val/loss in {entry} above the run's own: {where}"
        if plot_lines([gap_job(job, key, gap) for job in jobs], gap, title, path, whole=True):
            images.append(path)
    return images


def last_gap(job: Job, key: str) -> float | None:
    """`key` minus val/loss at the job's last validation that logged both; None where none did."""
    rows = gap_job(job, key, "gap").rows
    return rows[-1]["gap"] if rows else None


def gap_table(jobs: list[Job]) -> Table | None:
    """Per configuration, each evaluation precision's val/loss minus the run's own at the last
    validation, a Spread over the completed jobs (a job alone: its value); None without precision.eval."""
    keys = list(dict.fromkeys(k for job in jobs for k in eval_losses(job.rows)))
    if not keys:
        return None
    shown = [key for key in shown_overrides(jobs) if not is_seed(key)]
    header = [*shown, "jobs", *(f"{key} - {VAL_LOSS.name}" for key in keys)]
    rows = []
    for group in group_jobs(jobs):
        counted = group.counted if len(group.jobs) > 1 else group.jobs
        gaps = [spread([last_gap(job, key) for job in counted]) for key in keys]
        rows.append([*(group.overrides.get(k) for k in shown), ", ".join(job.id for job in group.jobs), *gaps])
    return header, rows
