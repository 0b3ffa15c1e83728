"""The tables: one row per job, and (when some jobs differ in the seed alone) one per configuration
with each metric's mean ± std over its completed jobs; their cells as markdown, and report.md's text."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from halfprec.tools.report.columns import column_format, job_metrics, metric_columns, spread_formats
from halfprec.tools.report.groups import COUNTED, Spread, group_jobs, is_seed, shown_overrides, spread, status_counts
from halfprec.tools.report.runs import Job

Table = tuple[list[str], list[list[Any]]]  # header, rows of raw values


def build_table(jobs: list[Job]) -> Table:
    """Header and raw values (numbers stay numbers, for W&B), one row per job."""
    logged = [job_metrics(job.rows, job.summary) for job in jobs]
    keys, columns = shown_overrides(jobs), metric_columns(logged)
    header = ["job", *keys, *columns, "status"]
    rows = []
    for job, metrics in zip(jobs, logged):
        rows.append([job.id, *(job.overrides.get(key) for key in keys), *(metrics.get(c) for c in columns), job.status])
    return header, rows


def build_group_table(jobs: list[Job]) -> Table | None:
    """One row per group, its metrics a Spread over the counted jobs; a job alone in its group keeps
    its plain values. None when every group holds one job: the per-job table says it all."""
    groups = group_jobs(jobs)
    if all(len(group.jobs) == 1 for group in groups):
        return None
    logged = {job.id: job_metrics(job.rows, job.summary) for job in jobs}
    keys, columns = [key for key in shown_overrides(jobs) if not is_seed(key)], metric_columns(list(logged.values()))
    header = [*keys, "jobs", *columns, "status"]
    rows = []
    for group in groups:
        if len(group.jobs) == 1:
            (job,) = group.jobs
            metrics, status = [logged[job.id].get(column) for column in columns], job.status
        else:
            each = [logged[job.id] for job in group.counted]
            metrics = [spread([values.get(column) for values in each]) for column in columns]
            status = status_counts(group.jobs)
        ids = ", ".join(job.id for job in group.jobs)
        rows.append([*(group.overrides.get(key) for key in keys), ids, *metrics, status])
    return header, rows


def format_cell(column: str, value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, Spread):
        fmt = spread_formats().get(column) or column_format(column) or ""
        if math.isnan(value.mean):
            return f"nan (n={value.n})"
        std = "" if value.std is None else f" ± {format(value.std, fmt)}"
        return f"{format(value.mean, fmt)}{std} (n={value.n})"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    number = column_format(column)
    if number is not None and isinstance(value, int | float):
        return format(value, number)
    return str(value).replace("|", "\\|")  # a literal | would split the markdown cell


def to_markdown(header: list[str], rows: list[list[Any]]) -> str:
    align = ["---:" if column_format(column) is not None else "---" for column in header]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(format_cell(column, value) for column, value in zip(header, row)) + " |")
    return "\n".join(lines)


def markdown_tables(tables: dict[str, Table]) -> list[str]:
    """The group table (when there is one) under a line saying what its cells are, then the per-job
    table, then the evaluation precisions' gaps (when a job logged them)."""
    parts = [to_markdown(*tables["table"])]
    if "groups" in tables:
        parts = [
            f"Per configuration (jobs whose overrides differ in the seed alone): mean ± std (sample std) over "
            f"its {COUNTED} jobs, n of them that logged the value. Jobs that ended otherwise or are still "
            "running are left out of the statistics and counted in the status column.",
            to_markdown(*tables["groups"]),
            "Per job:",
            *parts,
        ]
    if "eval_gaps" in tables:
        parts += [
            "Post-training quantization (precision.eval): each evaluation precision's val/loss minus the "
            f"run's own at the last validation, per configuration (mean ± std over its {COUNTED} jobs).",
            to_markdown(*tables["eval_gaps"]),
        ]
    return parts


def report_text(path: Path, jobs: list[Job], tables: list[str], images: list[Path], notes: tuple[str, ...] = ()) -> str:
    """report.md: a heading with the job counts, the tables, the failed jobs' errors, notes on the
    plots (what was left out), the plots."""
    parts = [f"## {path}: {len(jobs)} job{'s' if len(jobs) != 1 else ''}, {status_counts(jobs)}", *tables]
    errors = [f"- job {job.id}: {job.error}" for job in jobs if job.error]
    if errors:
        parts.append("Failed:\n\n" + "\n".join(errors))
    parts += [*notes, *(f"![{image.stem}]({image.name})" for image in images)]
    return "\n\n".join(parts) + "\n"
