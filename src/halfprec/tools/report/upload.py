"""The report as a new W&B run: the tables as wandb.Tables of numbers, and the plots. wandb is
imported when the report is uploaded."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from halfprec.tools.report.columns import column_format
from halfprec.tools.report.groups import Spread
from halfprec.tools.report.runs import Job, job_number
from halfprec.tools.report.tables import Table


def wandb_value(value: Any) -> Any:
    return None if isinstance(value, float) and math.isnan(value) else value


def wandb_table(header: list[str], rows: list[list[Any]]) -> Any:
    """A wandb.Table of raw numbers: a metric column of the group table becomes its mean, std and n."""
    import wandb

    spread_columns = [
        column_format(column) is not None and any(isinstance(row[i], Spread) for row in rows)
        for i, column in enumerate(header)
    ]
    columns: list[str | int] = [  # wandb.Table's annotation; the names are all strings
        name
        for column, split in zip(header, spread_columns)
        for name in ([column, f"{column} std", f"{column} n"] if split else [column])
    ]
    data = []
    for row in rows:
        cells = []
        for value, split in zip(row, spread_columns):
            if not split:
                cells.append(wandb_value(value))
            elif isinstance(value, Spread):
                cells += [wandb_value(value.mean), wandb_value(value.std), value.n]
            else:  # a job alone in its group, or no job logged it
                cells += [wandb_value(value), None, 0 if value is None else 1]
        data.append(cells)
    return wandb.Table(columns=columns, data=data)


def log_to_wandb(root: Path, out: Path, jobs: list[Job], tables: dict[str, Table], images: list[Path]) -> str:
    """A new W&B run (job_type report) with the tables (report/table per job, report/groups when
    seeds were grouped) and the plots, under `out`/wandb/ unless $WANDB_DIR says otherwise; returns
    where it went."""
    import wandb

    # the sweep's own project and group, so that the report sits next to the runs it describes
    loggers = jobs[0].config.get("logger") or {}
    logger = loggers.get("wandb") or loggers  # runs from before logger=[...] kept W&B's keys at logger.*
    in_one_sweep = all(job.dir.parent == root and job_number(job.dir) is not None for job in jobs)
    group = logger.get("group") or (f"{root.parent.name}_{root.name}" if in_one_sweep else None)
    run = wandb.init(
        project=logger.get("project") or "halfprec",
        entity=logger.get("entity"),
        # the project's default: no account or network needed. wandb annotates `mode` as a Literal of its
        # modes and checks the environment's string itself
        mode=os.environ.get("WANDB_MODE", "offline"),  # type: ignore[arg-type]
        dir=os.environ.get("WANDB_DIR") or str(out),
        group=group,
        job_type="report",
        name=f"report_{group or root.name}",
        config={"path": str(root), "jobs": len(jobs)},
        settings=wandb.Settings(console="off", x_disable_stats=True, quiet=True),
    )
    try:
        logged = {f"report/{name}": wandb_table(*table) for name, table in tables.items()}
        run.log({**logged, **{f"report/{image.stem}": wandb.Image(str(image)) for image in images}})
    finally:
        run.finish()
    if run.offline:
        return f"{run.settings.sync_dir} (offline: `wandb sync {run.settings.sync_dir}` uploads it)"
    return run.url or f"none (WANDB_MODE={run.settings.mode})"
