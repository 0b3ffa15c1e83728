"""eval_gap_<entry>.png: how far a run's val/loss in an evaluation precision (precision.eval's
val/loss@<entry>) lies above its own val/loss, against step: the cost of post-training quantization
as training goes on, a line per configuration (mean ± std over seeds)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from halfprec.metrics import VAL_LOSS
from halfprec.tools.report.columns import EVAL_LOSS, eval_losses
from halfprec.tools.report.plots import plot_lines
from halfprec.tools.report.runs import Job


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
        path = out / f"eval_gap_{''.join(c if c.isalnum() or c in '-_' else '_' for c in entry)}.png"
        title = f"val/loss in {entry} above the run's own: {where}"
        if plot_lines([gap_job(job, key, gap) for job in jobs], gap, title, path, whole=True):
            images.append(path)
    return images
