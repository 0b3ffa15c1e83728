"""The lines of a plot of one key against step: a group's mean over its completed seeds with a ±std
band, and a line of its own for every other job (one alone, failed, diverged or still running)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from halfprec.tools.report.groups import COUNTED, Group, group_jobs, is_seed, shown_overrides, spread
from halfprec.tools.report.looks import Look, group_looks, group_name
from halfprec.tools.report.runs import Job

# Jobs whose values may set a plot's y-range. Any other status (failed, diverged, whatever a newer
# version records) may mean the job ended because its values blew up.
IN_RANGE = ("completed", "running", "stopped")  # stopped: by a signal, resumable


@dataclass
class Line:
    """One line of a plot: a job's values, or the mean of a group's counted jobs with its ±std band."""

    label: str
    steps: list[float]
    values: list[float]
    look: Look
    in_range: bool  # its values may set the y-range (see IN_RANGE)
    band: tuple[list[float], list[float]] | None = None  # mean - std, mean + std
    lowest: list[float] | None = None  # with a band: the jobs' lowest positive value at each step (see band_edges)
    width: float = 1.8
    alpha: float = 1.0
    notes: list[str] = field(default_factory=list)  # shown in brackets after the label: status, off chart


def seed_mean(jobs: list[Job], key: str) -> tuple[list[float], list[float], list[float], list[float], list[float]]:
    """Steps, mean, mean - std, mean + std and the lowest positive value of `key` over the jobs, at
    each step where any of them logged it (a step some jobs did not log is over the others). A
    non-finite value makes its step nan (its lowest positive value is over the finite ones)."""
    by_step: dict[float, list[float]] = {}
    for job in jobs:
        for row in job.rows:
            if key in row:
                by_step.setdefault(row["step"], []).append(float(row[key]))
    steps, mean, low, high, lowest = [], [], [], [], []
    for step in sorted(by_step):
        spread_ = spread(by_step[step])
        assert spread_ is not None
        std = spread_.std or 0.0  # one job at this step: no spread to show
        steps.append(step)
        mean.append(spread_.mean)
        low.append(spread_.mean - std)
        high.append(spread_.mean + std)
        lowest.append(min([value for value in by_step[step] if 0 < value < math.inf], default=math.nan))
    return steps, mean, low, high, lowest


def job_line_label(job: Job, group: Group, label: str) -> str:
    """A job drawn on its own: its id, its group's label, and its seed when the group has others."""
    seeds = [f"{key}={value}" for key, value in job.overrides.items() if is_seed(key) and len(group.jobs) > 1]
    return " ".join([f"{job.id}:", label, *seeds])


def group_lines(group: Group, key: str, label: str, look: Look) -> list[Line]:
    """The group's mean line over its counted jobs that logged `key` (two or more), then a line for
    each other job: one counted job alone, or one that failed, diverged or is still running."""
    counted = [job for job in group.counted if any(key in row for row in job.rows)]
    lines, alone = [], group.jobs
    if len(counted) >= 2:
        steps, mean, low, high, lowest = seed_mean(counted, key)
        text = f"{label}: mean ± std, n={len(counted)}"
        lines.append(Line(text, steps, mean, look, True, (low, high), lowest))
        alone = [job for job in group.jobs if job not in counted]
    for job in alone:
        points = [(row["step"], float(row[key])) for row in job.rows if key in row]
        if points:
            steps, values = (list(column) for column in zip(*points))
            text, in_range = job_line_label(job, group, label), job.status in IN_RANGE
            width = 1.8 if job.status == COUNTED else 1.2  # thinner: not part of the group's result
            notes = [job.status] if job.status != "completed" else []
            lines.append(Line(text, steps, values, look, in_range, width=width, notes=notes))
    return lines


def plot_data(jobs: list[Job], key: str, dashed_key: str | None = None) -> tuple[list[Line], str]:
    """Every line of the plot of `key`, group by group, and the legend's title. With `dashed_key`, each
    group's lines of it follow, dashed in the group's colour (see dashed)."""
    groups = group_jobs(jobs)
    keys = [k for k in shown_overrides(jobs) if not is_seed(k)]
    looks, title = group_looks(groups, keys, styles=dashed_key is None)  # the dashes say which metric
    lines = []
    for group, look in zip(groups, looks):
        lines += group_lines(group, key, group_name(group, keys), look)
        if dashed_key is not None:
            lines += [dashed(line) for line in group_lines(group, dashed_key, group_name(group, keys), look)]
    if any(line.band for line in lines):
        title = "\n".join(filter(None, [title, "bands: ±std over completed seeds"]))
    if dashed_key is not None and any(line.label.startswith("_") for line in lines):
        title = "\n".join(filter(None, [title, f"dashed, same colour: {dashed_key}"]))
    return lines, title


def dashed(line: Line) -> Line:
    """A second metric's line (a maximum beside its mean): dashed, thinner, without a band (two bands
    per group would cover each other), and out of the legend (its label starts with _), whose title
    says what the dashes are: the legend would otherwise list every configuration twice."""
    look = dataclasses.replace(line.look, style="--")
    return dataclasses.replace(line, label=f"_{line.label}", look=look, band=None, lowest=None, width=1.2)
