"""`halfprec report PATH`: markdown tables and plots of a run, a multirun sweep, or a dir of them.

Reads what the runs left on disk (metrics.jsonl, .hydra/overrides.yaml and config.yaml, summary.json,
the sweep's sweep.jsonl), so it works on finished, failed and still-running sweeps alike.

Writes report.md (the tables), loss.png (train/loss against step), scale.png (the loss scale; only
when a job has a loss scaler), sweep.png (final val/loss against a swept number, such as the lr) and,
for a transformer with diagnostics=grads, attn_logits.png and logz.png; into PATH or --out. Runs in an
emulated number format with diagnostics=grads (quant/<layer>/<operand>/rel_err keys) also get
quant_err.png (the mean relative quantization error against step, the largest dashed) and, per job,
quant_heatmap_<job>.png (each layer's error per operand at its last diagnostics step; at most
MAX_HEATMAPS of them, report.md names the jobs left out).

Jobs whose overrides differ in the seed alone (or not at all) form a group: one configuration run
several times. The group table and the plots show each group as mean ± std over its completed jobs;
the per-job table keeps every job. In the plots a group's colour comes from the value of the first
override that varies between groups, its line style from the second; past 20 colours, markers too.
matplotlib, numpy and wandb are imported inside the functions that draw and upload.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from halfprec.launch.sweep_log import STATUSES, read_lines

EXPECTED = (
    "expected a run dir (with metrics.jsonl or .hydra/), a multirun sweep dir (with <n>_<overrides>/ job dirs), "
    "or a dir holding such runs"
)

# Table columns after the overrides and the tasks' val/* metrics (val_formats), and how their values
# print. "-" is a value never logged, "nan" one logged as null (metrics.jsonl writes inf and NaN as null).
RUN_FORMATS = {
    "skipped steps": ".10g",  # whole and exact: counts, and scales that are powers of two
    "min scale": ".10g",
    "final scale": ".10g",
    "samples/s": ".0f",
    "tokens/s": ".0f",
    "MFU": ".3f",
    "peak attn logit": ".4g",
}
# Columns a setting logs: shown only where some job logged them (tokens/s: task=lm; the attention
# logits: a transformer with diagnostics=grads). So is every val/* column but val/loss.
OPTIONAL_COLUMNS = ("tokens/s", "peak attn logit")
# Group rows print mean and std with these: a mean of counts or powers of two is not whole.
SPREAD_FORMATS = {"skipped steps": ".6g", "min scale": ".6g", "final scale": ".6g"}


@functools.cache
def val_formats() -> dict[str, str]:
    """The val/* columns: the metrics each registered task says its tables show, in its format
    (components/tasks: a new task's metrics get columns of their own)."""
    from halfprec.components.tasks import TASKS  # imports torch: only once tables are made

    return {m.name: m.fmt for task in TASKS.values() for m in task.metrics if m.column}


@functools.cache
def metric_formats() -> dict[str, str]:
    """Every metric column, in table order, with how its values print."""
    return {"train/loss": ".4f", **val_formats(), **RUN_FORMATS}


# Overrides that pick a replicate rather than a configuration ("+seed=1" as well as "seed=1").
SEED_KEYS = ("seed",)
# The status whose jobs a group's mean ± std is over. A failed or diverged job stopped early and a
# running one is still moving: averaging them in would mix final values with those of other steps.
# They stay in the per-job table and are drawn as lines of their own; the group's status cell counts them.
COUNTED = "completed"
# Jobs whose values may set a plot's y-range. Any other status (failed, diverged, whatever a newer
# version records) may mean the job ended because its values blew up.
IN_RANGE = ("completed", "running", "stopped")  # stopped: by a signal, resumable
STATUS_ORDER = (*STATUSES, "running")  # others follow, by first appearance

LINE_STYLES = ["-", "--", "-.", ":"]
# Past 20 configurations, the markers that tell apart those sharing a colour (see palette): none of
# ^ v X x, which mark values off the chart and jobs that did not complete.
MARKERS = ["o", "s", "D", "P", "*", "h", "<", ">"]
# Stretches off the chart that a line's label names (and marks) one by one, per kind; more are counted.
SHOWN_RUNS = 3
# The sweep plot's markers, as its title explains them.
SWEEP_MARKS = {
    "x": "x: a job that did not complete, at its last {metric}",
    "^": "^ on the top edge: a final {metric} above the chart, non-finite or never logged (beside it)",
    "v": "v on the bottom edge: a final {metric} below the chart (beside it)",
}
# Plots made when a job logged the key (diagnostics=grads): (key, file, title).
LOGIT_PLOTS = (
    ("diag/attn_logit_max", "attn_logits.png", "largest attention logit"),
    ("diag/output_logz", "logz.png", "output logits' log Z (mean)"),
)
# The quantization statistics of an emulated number format (training/diagnostics.py): the heatmap's
# columns, in the order the layers log them, the line plot's keys, and how many jobs get a heatmap
# (one image each: a sweep of 50 jobs would bury report.md under 50 of them).
QUANT_OPERANDS = ("input", "weight", "grad_output")
QUANT_MEAN, QUANT_MAX = "diag/quant_rel_err", "diag/quant_rel_err_max"
QUANT_LABEL = "relative error ||q(x) - x|| / ||x||"
MAX_HEATMAPS = 12
# A line whose maximum lies further above the lines' typical maximum than FAR times their whole
# range (in decades, on positive values) is left out of the y-range: one blow-up to 1e13 would
# otherwise squash every other line flat. It is still drawn, clipped, and marked where it leaves.
FAR = 1.0


Table = tuple[list[str], list[list[Any]]]  # header, rows of raw values


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
    sweep_lines: dict[Path, dict[int, dict]] = {}
    jobs = []
    for run_dir in run_dirs:
        if run_dir.parent not in sweep_lines:
            sweep_lines[run_dir.parent] = read_lines(run_dir.parent / "sweep.jsonl")
        jobs.append(read_job(run_dir, root, sweep_lines[run_dir.parent]))
    return sorted(jobs, key=lambda job: job.sort_key)


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


def final(rows: list[dict], key: str) -> Any:
    """The key's last logged value; None if it was never logged."""
    values = [row[key] for row in rows if key in row]
    return values[-1] if values else None


def smallest(rows: list[dict], key: str) -> float | None:
    values = [row[key] for row in rows if key in row and math.isfinite(row[key])]
    return min(values) if values else None


def largest(rows: list[dict], key: str) -> float | None:
    """The largest value logged; inf where a logged value was not finite (metrics.jsonl's null)."""
    values = [row[key] for row in rows if key in row]
    if any(v is None or not math.isfinite(v) for v in values):
        return math.inf
    return max(values) if values else None


def steady_median(rows: list[dict], key: str) -> float | None:
    """Median of a perf/ metric over the rows, leaving out the step-1 row (warm-up) when there are others."""
    timed = [row for row in rows if key in row]
    steady = [row for row in timed if row["step"] != 1] or timed
    values = [row[key] for row in steady if math.isfinite(row[key])]
    return statistics.median(values) if values else None


def job_metrics(rows: list[dict], summary: dict[str, Any]) -> dict[str, Any]:
    """The table's metric columns for one job (keys as in metric_formats()). A finished run's
    summary.json has the exact minimum scale; the rows, logged every few steps, may miss it."""
    return {
        "train/loss": final(rows, "train/loss"),
        **{name: final(rows, name) for name in val_formats()},
        "skipped steps": final(rows, "scaler/skipped_steps"),
        "min scale": summary.get("scaler/min_scale", smallest(rows, "scaler/scale")),
        "final scale": final(rows, "scaler/scale"),
        "samples/s": steady_median(rows, "perf/samples_per_s"),
        "tokens/s": steady_median(rows, "perf/tokens_per_s"),
        "MFU": steady_median(rows, "perf/mfu"),  # GPUs in halfprec/training/perf.py's table only
        "peak attn logit": largest(rows, "diag/attn_logit_max"),  # the growth Wortsman et al. watch
    }


def metric_columns(logged: list[dict[str, Any]]) -> list[str]:
    """The metric columns, less the optional ones that no job logged (`logged`: job_metrics of each)."""
    optional = (*OPTIONAL_COLUMNS, *(name for name in val_formats() if name != "val/loss"))
    return [c for c in metric_formats() if c not in optional or any(m[c] is not None for m in logged)]


def shown_overrides(jobs: list[Job]) -> list[str]:
    """The override keys whose value differs between jobs (or is missing in some), in command-line order.
    A lone run shows all of its overrides: there is nothing to tell it apart from."""
    keys = list(dict.fromkeys(key for job in jobs for key in job.overrides))
    if len(jobs) == 1:
        return keys
    return [key for key in keys if len({job.overrides.get(key) for job in jobs}) > 1]


def is_seed(key: str) -> bool:
    return key.lstrip("+~") in SEED_KEYS


@dataclass
class Group:
    """Jobs whose overrides differ in the seed alone, or not at all: one configuration run several times."""

    overrides: dict[str, str]  # the non-seed overrides its jobs share
    jobs: list[Job]

    @property
    def counted(self) -> list[Job]:
        """The jobs its statistics are over (see COUNTED)."""
        return [job for job in self.jobs if job.status == COUNTED]


def group_jobs(jobs: list[Job], leave_out: tuple[str, ...] = ()) -> list[Group]:
    """The jobs' groups, in the order of each group's first job; overrides in `leave_out` (a plot's
    x-axis) do not tell groups apart, as the seed does not."""
    groups: dict[tuple, Group] = {}
    for job in jobs:
        overrides = {key: value for key, value in job.overrides.items() if not is_seed(key) and key not in leave_out}
        groups.setdefault(tuple(sorted(overrides.items())), Group(overrides, [])).jobs.append(job)
    return list(groups.values())


@dataclass(frozen=True)
class Spread:
    """One metric over a group's counted jobs that logged it: n of them, their mean and sample std."""

    mean: float
    std: float | None  # None for a single value
    n: int


def spread(values: list[Any]) -> Spread | None:
    """None when no job logged it; a nan mean (and std) when one of them logged a non-finite value."""
    numbers = [float(value) for value in values if value is not None]
    if not numbers:
        return None
    if len(numbers) == 1:
        return Spread(numbers[0], None, 1)
    if not all(math.isfinite(number) for number in numbers):
        return Spread(math.nan, math.nan, len(numbers))
    return Spread(statistics.fmean(numbers), statistics.stdev(numbers), len(numbers))


def status_counts(jobs: list[Job]) -> str:
    """Each status the jobs have, with how many have it, known statuses first: "2 completed, 1 diverged"."""
    statuses = [*STATUS_ORDER, *dict.fromkeys(job.status for job in jobs)]
    counts = {status: sum(job.status == status for job in jobs) for status in dict.fromkeys(statuses)}
    return ", ".join(f"{n} {status}" for status, n in counts.items() if n)


def build_table(jobs: list[Job]) -> Table:
    """Header and raw values (numbers stay numbers, for W&B), one row per job."""
    logged = [job_metrics(job.rows, job.summary) for job in jobs]
    keys, columns = shown_overrides(jobs), metric_columns(logged)
    header = ["job", *keys, *columns, "status"]
    rows = []
    for job, metrics in zip(jobs, logged):
        rows.append([job.id, *(job.overrides.get(key) for key in keys), *(metrics[c] for c in columns), job.status])
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
            metrics, status = [logged[job.id][column] for column in columns], job.status
        else:
            each = [logged[job.id] for job in group.counted]
            metrics = [spread([values[column] for values in each]) for column in columns]
            status = status_counts(group.jobs)
        ids = ", ".join(job.id for job in group.jobs)
        rows.append([*(group.overrides.get(key) for key in keys), ids, *metrics, status])
    return header, rows


def format_cell(column: str, value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, Spread):
        fmt = SPREAD_FORMATS.get(column, metric_formats()[column])
        if math.isnan(value.mean):
            return f"nan (n={value.n})"
        std = "" if value.std is None else f" ± {format(value.std, fmt)}"
        return f"{format(value.mean, fmt)}{std} (n={value.n})"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if column in metric_formats() and isinstance(value, int | float):
        return format(value, metric_formats()[column])
    return str(value).replace("|", "\\|")  # a literal | would split the markdown cell


def to_markdown(header: list[str], rows: list[list[Any]]) -> str:
    align = ["---:" if column in metric_formats() else "---" for column in header]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(format_cell(column, value) for column, value in zip(header, row)) + " |")
    return "\n".join(lines)


def markdown_tables(tables: dict[str, Table]) -> list[str]:
    """The group table (when there is one) under a line saying what its cells are, then the per-job table."""
    if "groups" not in tables:
        return [to_markdown(*tables["table"])]
    return [
        f"Per configuration (jobs whose overrides differ in the seed alone): mean ± std (sample std) over "
        f"its {COUNTED} jobs, n of them that logged the value. Jobs that ended otherwise or are still "
        "running are left out of the statistics and counted in the status column.",
        to_markdown(*tables["groups"]),
        "Per job:",
        to_markdown(*tables["table"]),
    ]


def report_text(path: Path, jobs: list[Job], tables: list[str], images: list[Path], notes: tuple[str, ...] = ()) -> str:
    """report.md: a heading with the job counts, the tables, the failed jobs' errors, notes on the
    plots (what was left out), the plots."""
    parts = [f"## {path}: {len(jobs)} job{'s' if len(jobs) != 1 else ''}, {status_counts(jobs)}", *tables]
    errors = [f"- job {job.id}: {job.error}" for job in jobs if job.error]
    if errors:
        parts.append("Failed:\n\n" + "\n".join(errors))
    parts += [*notes, *(f"![{image.stem}]({image.name})" for image in images)]
    return "\n\n".join(parts) + "\n"


def has_scaler(job: Job) -> bool:
    """A loss scaler shows as a scale other than 1.0 (scaler=none logs 1.0 throughout)."""
    return any(row.get("scaler/scale", 1.0) != 1.0 for row in job.rows)


@dataclass(frozen=True)
class Look:
    """How a configuration's lines look: colour, line style, and a marker of its own (None: only the
    dots a short line gets)."""

    colour: Any
    style: str = "-"
    marker: str | None = None


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


def palette(n: int) -> list[tuple[Any, str | None]]:
    """n (colour, marker) pairs, all distinct up to 80. Up to 20, colours alone: tab10, then tab20's
    light shades after its dark ones (tab20 in its own order puts a light and a dark blue next to each
    other). Past 20, the shades of a colormap would be too close to tell apart (34 configurations read
    as one smear): tab10's colours again, each ten with a marker of their own (MARKERS)."""
    from matplotlib import colormaps

    # tab10 and tab20 are ListedColormaps, whose `colors` is a tuple of RGB tuples; matplotlib types the
    # registry's entries as Colormap (no `colors`), and ListedColormap.colors as any array-like or colour
    tab10 = colormaps["tab10"].colors  # type: ignore[attr-defined]
    if n <= 10:
        return [(colour, None) for colour in tab10[:n]]
    if n <= 20:
        tab20 = colormaps["tab20"].colors  # type: ignore[attr-defined]
        return [(colour, None) for colour in (tab20[0::2] + tab20[1::2])[:n]]
    return [(tab10[i % 10], MARKERS[i // 10 % len(MARKERS)]) for i in range(n)]


def ordered_values(values: list[str | None]) -> list[str | None]:
    """Distinct values in first-seen order, or in numeric order when all are numbers (lr=1e-3,1e-2,...)."""
    distinct = list(dict.fromkeys(values))
    try:
        return sorted(distinct, key=lambda value: float(value))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return distinct


def group_looks(groups: list[Group], keys: list[str], styles: bool = True) -> tuple[list[Look], str]:
    """The Look of each group, and the legend title that says what they stand for.

    Colour by the value of the first varying key; line style by the second when it has at most four
    values (the first and second swap when only the first fits four). Three or more keys, or two
    with many values each: a colour per group, so no two groups look alike. Past 20 colours, markers
    tell apart the groups that share one (see palette). Not `styles`: every line solid (a plot that
    dashes a second metric), so a colour per group wherever the line style would have told them apart."""
    values = {key: ordered_values([group.overrides.get(key) for group in groups]) for key in keys}
    colour_key: str | None
    style_key: str | None
    colour_key, style_key = (keys[0], None) if keys else (None, None)
    if len(keys) == 2:
        first, second = keys
        if len(values[second]) <= len(LINE_STYLES):
            colour_key, style_key = first, second
        elif len(values[first]) <= len(LINE_STYLES):
            colour_key, style_key = second, first
        else:
            colour_key = None
    elif len(keys) > 2:
        colour_key = None
    if style_key is not None and not styles:
        colour_key, style_key = None, None
    pairs = palette(len(values[colour_key]) if colour_key else len(groups))
    looks = []
    for i, group in enumerate(groups):
        colour, marker = pairs[values[colour_key].index(group.overrides.get(colour_key)) if colour_key else i]
        style = LINE_STYLES[values[style_key].index(group.overrides.get(style_key))] if style_key else "-"
        looks.append(Look(colour, style, marker))
    by = "colour and marker" if any(look.marker for look in looks) else "colour"
    title = f"{by}: {colour_key or 'each configuration'}" + (f", line: {style_key}" if style_key else "")
    return looks, title if len(groups) > 1 else ""  # one configuration: nothing to tell apart


def group_name(group: Group, keys: list[str]) -> str:
    """A configuration's name in a legend: the varying overrides it sets (all of its own when none
    vary), or "defaults" when it sets none of them, so that no line goes unnamed."""
    shown = keys or list(group.overrides)
    return " ".join(f"{key}={group.overrides[key]}" for key in shown if key in group.overrides) or "defaults"


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


def band_edges(line: Line, log: bool) -> tuple[list[float], list[float]]:
    """The band's lower and upper edges (mean ∓ std). On a log axis the lower edge stops at the
    group's lowest value at that step: mean - std may be 0 or below (the band would fill down to the
    bottom of the axes), and even above 0 it can lie decades below every seed, a spread no seed shows."""
    assert line.band is not None and line.lowest is not None
    low, high = line.band
    if log:  # a nan `lowest` (no positive value at the step) compares false and leaves the edge as it was
        low = [lowest if edge < lowest else edge for edge, lowest in zip(low, line.lowest)]
    return low, high


def extent(line: Line, positive: bool = False, log: bool = False) -> list[float]:
    """The finite values the line draws, its band's edges included (only those above 0 when
    `positive`: a wide band can reach below 0 while the mean stays positive; `log`: the edges a log
    axis draws, see band_edges)."""
    edges = band_edges(line, log) if line.band else ([], [])
    band = [edge for edge in edges[0] + edges[1] if edge > 0 or not positive]
    return [value for value in [*line.values, *band] if math.isfinite(value)]


def y_range(lines: list[Line], log2_y: bool, whole: bool = False) -> tuple[float, float, str]:
    """(bottom, top, scale) of the y axis, scale one of linear, log, log2.

    From the lines of jobs that did not end badly (all lines when there are none), leaving out a line
    that reaches far above the others (see FAR) unless `whole` (a plot whose point is that growth).
    log: positive values spanning over 100x (a loss falling from 2.3 to 0.01, whose first steps would
    otherwise be a spike above a flat line)."""
    candidates = [line for line in lines if line.in_range and extent(line)] or [line for line in lines if extent(line)]
    positive = all(value > 0 for line in candidates for value in line.values if math.isfinite(value))
    if positive:  # in decades: a loss of 1e13 is 13 of them above 1, whatever the others' scale
        to, back = math.log10, (lambda x: 10.0**x)
    else:
        to, back = float, float
    # bands as a log axis would draw them: a band's lower edge far below its seeds would pick a log axis
    extents = [[to(value) for value in extent(line, positive, log=positive)] for line in candidates]
    highs = [max(values) for values in extents]
    low = min(min(values) for values in extents)
    typical = statistics.median(highs)
    fence = typical + FAR * max(typical - low, 1.0 if positive else abs(typical) * 0.1 or 1e-12)
    kept = [i for i, high in enumerate(highs) if log2_y or whole or high <= fence] or list(range(len(extents)))
    bottom, top = min(min(extents[i]) for i in kept), max(max(extents[i]) for i in kept)
    if log2_y or (positive and top - bottom > 2):
        margin = 0.05 * (top - bottom or 1.0)  # in decades
        return back(bottom - margin), back(top + margin), "log2" if log2_y else "log"
    values = [value for i in kept for value in extent(candidates[i], positive)]  # linear: the whole band
    bottom, top = min(values), max(values)
    margin = 0.05 * (top - bottom) or max(abs(top) * 0.05, 1e-6)
    return bottom - margin, top + margin, "linear"


def off_chart_runs(line: Line, bottom: float, top: float) -> list[tuple[int, int, str]]:
    """Each stretch of consecutive points off the chart: (first index, last index, why), why "off
    chart" (above or below it) or "non-finite" (a value logged as inf or nan, which draws as a gap)."""
    runs: list[tuple[int, int, str]] = []
    for i, value in enumerate(line.values):
        why = "non-finite" if not math.isfinite(value) else None if bottom <= value <= top else "off chart"
        if why is None:
            continue
        if runs and runs[-1][1] == i - 1 and runs[-1][2] == why:
            runs[-1] = (runs[-1][0], i, why)
        else:
            runs.append((i, i, why))
    return runs


def step_text(step: float) -> str:
    return str(int(step)) if float(step).is_integer() else f"{step:g}"


def at_steps(line: Line, runs: list[tuple[int, int, str]], more: int) -> str:
    """The stretches a line comes back from, as its label names them: "at step 40", "at steps 20-30, 60 (+2 more)"."""
    texts = [step_text(line.steps[a]) + (f"-{step_text(line.steps[b])}" if b > a else "") for a, b, _ in runs]
    plural = len(runs) > 1 or runs[0][1] > runs[0][0]
    return f"at step{'s' if plural else ''} {', '.join(texts)}" + (f" (+{more} more)" if more else "")


def edge_marker(ax: Any, x: float, y: float, marker: str, text: str, colour: Any, above: bool = True) -> None:
    """A marker on the chart's edge at x (drawn over the axes' border) with `text` beside it, inside the chart."""
    ax.plot([x], [y], marker=marker, markersize=9, color=colour, clip_on=False, zorder=5, linestyle="none")
    offset = (5, -11 if above else 4)  # points: inside the chart, beside the marker
    ax.annotate(text, (x, y), xytext=offset, textcoords="offset points", fontsize=7, color=colour)


def mark_stretch(ax: Any, line: Line, run: tuple[int, int, str], bottom: float, top: float) -> None:
    """A marker where a stretch off the chart starts, on the edge it crosses, with the value furthest
    out beside it (an X on the top edge for a non-finite value, with the value: nan or inf)."""
    first, last, why = run
    values = line.values[first : last + 1]
    above = why == "non-finite" or values[0] > top
    value = values[0] if why == "non-finite" else max(values) if above else min(values)
    marker = "X" if why == "non-finite" else "^" if above else "v"
    edge_marker(ax, line.steps[first], top if above else bottom, marker, f"{value:.3g}", line.look.colour, above)


def mark_off_chart(ax: Any, line: Line, bottom: float, top: float) -> str | None:
    """Mark each stretch of the line off the chart (the first SHOWN_RUNS of each kind, and one that
    lasts to the end) and return what its label says of them: "off chart from step 110" only for a
    line that stays off to its end, "off chart at steps 20-30, 60" for one that comes back; None
    when the line stays on the chart."""
    runs = off_chart_runs(line, bottom, top)
    notes = []
    for why in dict.fromkeys(run[2] for run in runs):
        mine = [run for run in runs if run[2] == why]
        last = mine[-1]
        for_good = mine.pop() if last[1] == len(line.values) - 1 and last[1] > last[0] else None
        shown = mine[:SHOWN_RUNS]
        for run in [*shown, *([for_good] if for_good else [])]:
            mark_stretch(ax, line, run, bottom, top)
        parts = [at_steps(line, shown, len(mine) - len(shown))] if mine else []
        if for_good:
            parts.append(f"from step {step_text(line.steps[for_good[0]])}")
        notes.append(f"{why} {' and '.join(parts)}")
    return "; ".join(notes) or None


def stack_coinciding(lines: list[Line], scale: str, bottom: float, top: float) -> None:
    """Keep lines that trace the same curve visible (fp32 with and without a static scale logs the
    same losses, every scaler=none job a scale of 1): each line gets wider by how many later lines
    (drawn on top of it) lie on it, and paler, so that each shows as an edge around the next, and
    a dashed line in the same colour still shows its dashes on the line below."""
    import numpy as np

    to = np.log10 if scale != "linear" else (lambda x: x)
    tolerance = 0.004 * abs(float(to(top)) - float(to(bottom)))  # under a pixel or two apart
    with np.errstate(all="ignore"):
        curves = [np.asarray(to(np.asarray(line.values, dtype=float))) for line in lines]

    def same(i: int, j: int) -> bool:
        a, b = curves[i], curves[j]
        if lines[i].steps != lines[j].steps or not np.array_equal(np.isnan(a), np.isnan(b)):
            return False
        finite = ~np.isnan(a)
        return bool(np.all(np.abs(a[finite] - b[finite]) <= tolerance))

    for i, line in enumerate(lines):
        later = sum(same(i, j) for j in range(i + 1, len(lines)))
        if later:
            line.width, line.alpha = line.width + 1.6 * later, 0.55


def beyond(bottom: float, top: float, scale: str) -> tuple[float, float]:
    """Where values off the chart are clipped to: just beyond it, so that a line visibly runs off the
    edge (and its far-out values do not overflow the drawing)."""
    if scale == "linear":
        return bottom - (top - bottom), top + (top - bottom)
    return bottom / 10, top * 10


def draw_line(ax: Any, line: Line, bottom: float, top: float, scale: str) -> Any:
    """Draw one line (and its band); return its legend handle. Values far outside the chart are
    clipped to just beyond it; each stretch off the chart is marked on the edge (see mark_off_chart)
    and its label says at which steps."""
    import numpy as np
    from matplotlib.patches import Patch

    lo, hi = beyond(bottom, top, scale)
    values = np.clip(np.asarray(line.values, dtype=float), lo, hi)  # nan stays nan: a gap
    notes = [*line.notes, *filter(None, [mark_off_chart(ax, line, bottom, top)])]
    label = line.label + (f" ({'; '.join(notes)})" if notes else "")
    look = line.look
    # a marker of its own (many configurations) every few points; dots on every point of a short line
    marker = look.marker or ("o" if len(values) <= 20 else None)
    every = 1 if len(values) <= 20 else max(1, len(values) // 12)
    size = 3 if look.marker is None else 5
    style = {"color": look.colour, "alpha": line.alpha, "linewidth": line.width, "marker": marker, "markersize": size}
    (drawn,) = ax.plot(line.steps, values, look.style, markevery=every, **style)
    drawn.set_label(textwrap.fill(label, 52))  # long labels would make the legend wider than the plot
    if line.band is None:
        return drawn
    low, high = (np.clip(np.asarray(edge, dtype=float), lo, hi) for edge in band_edges(line, scale != "linear"))
    ax.fill_between(line.steps, low, high, color=look.colour, alpha=0.18, linewidth=0)
    return (Patch(facecolor=look.colour, alpha=0.18), drawn)


def line_figure(
    jobs: list[Job], key: str, title: str, log2_y: bool = False, whole: bool = False, dashed_key: str | None = None
) -> Any:
    """The Figure of `key` against step, a line per group or job that logged it; None when none did.
    whole: the y-range takes in every line (see y_range). dashed_key: a second metric, dashed (see plot_data)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    lines, legend_title = plot_data(jobs, key, dashed_key)
    if not any(extent(line) for line in lines):
        return None
    bottom, top, scale = y_range(lines, log2_y, whole)
    if scale != "linear" and any(line.band for line in lines):
        legend_title += "\n(log axis: a band's lower edge stops at the lowest seed)"
    stack_coinciding(lines, scale, bottom, top)
    # the legend grows with the lines (and their wrapped labels); the figure grows with it
    label_rows = sum(1 + len(line.label) // 52 for line in lines if not line.label.startswith("_")) + 2
    # a bare Figure on the Agg canvas: no pyplot state, no display needed (headless machines, tests)
    fig = Figure(figsize=(11, min(max(5.0, 0.2 * label_rows + 1.0), 30.0)), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    handles = [draw_line(ax, line, bottom, top, scale) for line in lines]
    labels = [(handle[1] if isinstance(handle, tuple) else handle).get_label() for handle in handles]
    # an explicit handle list shows every label, even those that (like a dashed line's) start with _
    shown = [i for i, label in enumerate(labels) if not label.startswith("_")]
    handles, labels = [handles[i] for i in shown], [labels[i] for i in shown]
    if scale == "log2":
        ax.set_yscale("log", base=2)
    elif scale == "log":
        ax.set_yscale("log")
    ax.set_ylim(bottom, top)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers, even on short runs
    ax.set_xlabel("step (optimizer steps)")
    ax.set_ylabel(key + (" (log2)" if log2_y else ""))
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(
        handles,
        labels,
        loc="upper left",
        bbox_to_anchor=(1.01, 1),
        fontsize="small",
        title=legend_title,
        title_fontsize="small",
        alignment="left",
        handlelength=3,  # long enough to show a dash pattern
    )
    return fig


def plot_lines(
    jobs: list[Job],
    key: str,
    title: str,
    path: Path,
    log2_y: bool = False,
    whole: bool = False,
    dashed_key: str | None = None,
) -> bool:
    """Write the plot of `key` against step to `path`; False (and no file) when no job logged it."""
    fig = line_figure(jobs, key, title, log2_y, whole, dashed_key)
    if fig is None:
        return False
    fig.savefig(path, dpi=100)
    return True


def numeric_sweep_key(jobs: list[Job]) -> str | None:
    """The swept override whose values are numbers, three or more of them (optim.lr=3e-4,...,1e-1):
    the x-axis of an "objective against hyperparameter" plot. None when there is none, or several."""
    keys = []
    for key in shown_overrides(jobs):
        values = {job.overrides.get(key) for job in jobs}
        try:
            numbers = {float(value) for value in values}  # type: ignore[arg-type]
        except (TypeError, ValueError):
            continue
        if len(numbers) >= 3 and not is_seed(key):
            keys.append(key)
    return keys[0] if len(keys) == 1 else None


SweepPoints = tuple[dict[float, float], list[tuple[float, float | None]]]


def sweep_points(config: Group, key: str, metric: str) -> SweepPoints:
    """The configuration's mean final `metric` at each value of `key`, over its completed jobs with a
    finite one; and (x, final value) of each other job (None: never logged): one that did not
    complete, or (in a sweep from before the "diverged" status) completed with a non-finite value."""
    by_x: dict[float, list[float]] = {}
    rest = []
    for job in config.jobs:
        x, value = float(job.overrides[key]), final(job.rows, metric)
        if job.status == COUNTED and value is not None and math.isfinite(value):
            by_x.setdefault(x, []).append(value)
        else:
            rest.append((x, value))
    return {x: statistics.fmean(by_x[x]) for x in sorted(by_x)}, rest


def sweep_range(points: list[SweepPoints]) -> tuple[float, float, str]:
    """The sweep plot's y-range, as a line plot's (see y_range): a blow-up to 1e13 is left out of it."""
    lines = [Line("", list(means), list(means.values()), Look(None), True) for means, _ in points]
    lines += [Line("", [x], [value], Look(None), True) for _, rest in points for x, value in rest if value is not None]
    if not any(extent(line) for line in lines):  # not one finite value: only markers on the top edge
        return 0.0, 1.0, "linear"
    bottom, top, scale = y_range(lines, False)
    # headroom: the markers on the top edge and the values beside them would cover the highest point
    if scale == "linear":
        return bottom, top + 0.1 * (top - bottom), scale
    return bottom, top * (top / bottom) ** 0.1, scale


def draw_sweep_config(ax: Any, points: SweepPoints, look: Look, label: str, bottom: float, top: float) -> set[str]:
    """A configuration's line of means and its other jobs: a cross at a final value on the chart, a
    marker on the edge otherwise, with what it logged beside it (counted at the same x: "nan ×2").
    Returns the kinds of marker drawn ("x", "^", "v") for the title to explain."""
    means, rest = points
    lo, hi = beyond(bottom, top, ax.get_yscale())  # the y scale is set before the points are drawn
    shown = [min(max(mean, lo), hi) for mean in means.values()]  # clipped: the line runs off the edge
    ax.plot(list(means), shown, look.style, color=look.colour, marker=look.marker or "o", label=label)
    off: dict[tuple[float, bool], list[str]] = {}  # (x, above) -> texts
    for x, mean in means.items():
        if not bottom <= mean <= top:
            off.setdefault((x, mean > top), []).append(f"mean {mean:.3g}")
    kinds = set()
    for x, value in rest:
        if value is not None and math.isfinite(value) and bottom <= value <= top:
            ax.plot(x, value, "x", color=look.colour, markersize=9)
            kinds.add("x")
        else:  # off the chart (on the edge it lies beyond), or no finite value at all (on the top edge)
            text = "not logged" if value is None else f"{value:.3g}"
            off.setdefault((x, value is None or not value < top), []).append(text)
    for (x, above), texts in off.items():
        counted = ", ".join(t if n == 1 else f"{t} ×{n}" for t, n in collections.Counter(texts).items())
        edge_marker(ax, x, top if above else bottom, "^" if above else "v", counted, look.colour, above)
        kinds.add("^" if above else "v")
    return kinds


def sweep_figure(jobs: list[Job], key: str, metric: str) -> Any:
    """The Figure of each job's final `metric` against the value of `key`: a line per configuration of
    the other overrides (seeds averaged over the completed jobs), a cross for a job that did not
    complete at its last value, and every job with no final value on the chart (non-finite, never
    logged, or above it) on the edge at its x. Wortsman et al.'s plot of final loss against learning rate."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    others = [k for k in shown_overrides(jobs) if k != key and not is_seed(k)]
    configs = group_jobs(jobs, leave_out=(key,))
    looks, legend_title = group_looks(configs, others)
    points = [sweep_points(config, key, metric) for config in configs]
    bottom, top, scale = sweep_range(points)
    fig = Figure(figsize=(9, 5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    if scale == "log":
        ax.set_yscale("log")
    ax.set_ylim(bottom, top)
    kinds: set[str] = set()
    for config, look, config_points in zip(configs, looks, points):
        kinds |= draw_sweep_config(ax, config_points, look, group_name(config, others), bottom, top)
    values = [float(job.overrides[key]) for job in jobs]
    if min(values) > 0 and max(values) / min(values) >= 100:
        ax.set_xscale("log")
    ax.set_xlabel(key)
    ax.set_ylabel(f"final {metric}")
    explained = [SWEEP_MARKS[kind].format(metric=metric) for kind in ("x", "^", "v") if kind in kinds]
    ax.set_title("\n".join([f"final {metric} against {key}", *explained]), fontsize="medium")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", title=legend_title or None, title_fontsize="small")
    return fig


def quant_cell(key: str) -> tuple[str, str] | None:
    """(layer, operand) of a `quant/<layer>/<operand>/rel_err` key, None for any other key. A layer's
    name has dots (blocks.0.attn.qkv) but no slash, so such a key splits into exactly four parts."""
    parts = key.split("/")
    if len(parts) == 4 and parts[0] == "quant" and parts[3] == "rel_err":
        return parts[1], parts[2]
    return None


@dataclass
class QuantMap:
    """A job's relative quantization error at one step: a row per layer, a column per operand."""

    step: float
    layers: list[str]  # in the order the step's row logged them: the model's order
    operands: list[str]
    values: list[list[float]]  # nan where the layer logged no such operand (or logged a nan)
    texts: list[list[str]]  # each cell's annotation: 2 significant digits, "" where not logged


def quant_map(rows: list[dict[str, Any]]) -> QuantMap | None:
    """The rel_err of each layer and operand at the last step that logged any (only diagnostics steps
    do; an earlier step may have other layers, so one step is shown, never a mix); None when no step did."""
    row = next((row for row in reversed(rows) if any(quant_cell(key) for key in row)), None)
    if row is None:
        return None
    cells = {cell: float(value) for key, value in row.items() if (cell := quant_cell(key))}
    layers = list(dict.fromkeys(layer for layer, _ in cells))
    # the three operands always, so that a missing one shows as a blank column; any other after them
    operands = list(dict.fromkeys([*QUANT_OPERANDS, *(operand for _, operand in cells)]))
    values = [[cells.get((layer, op), math.nan) for op in operands] for layer in layers]
    texts = [[f"{cells[layer, op]:.2g}" if (layer, op) in cells else "" for op in operands] for layer in layers]
    return QuantMap(row["step"], layers, operands, values, texts)


def quant_norm(values: Any) -> Any:
    """The colour scale: log when the positive errors span 10x or more (an fp4 gradient's error beside an
    fp8 weight's would leave every fp8 cell the same dark colour), from 0 otherwise."""
    import numpy as np
    from matplotlib.colors import LogNorm, Normalize

    finite = values[np.isfinite(values)]
    positive = finite[finite > 0]
    if positive.size and positive.max() >= 10 * positive.min():
        return LogNorm(float(positive.min()), float(positive.max()), clip=True)  # clip: an exact 0 at the bottom
    return Normalize(0.0, float(finite.max()) if finite.size and finite.max() > 0 else 1.0)


def quant_heatmap(qmap: QuantMap, title: str) -> Any:
    """The Figure of a QuantMap: a cell per layer and operand coloured by its error and annotated with
    it; grey and blank where the layer logged no such operand."""
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    values = np.asarray(qmap.values, dtype=float)
    norm = quant_norm(values)
    height = min(max(4.0, 0.3 * len(qmap.layers) + 2.0), 60.0)  # a row of text per layer, however many
    fig = Figure(figsize=(8, height), layout="constrained")
    FigureCanvasAgg(fig)  # as line_figure: no pyplot state
    ax = fig.subplots()
    cmap = colormaps["viridis"].with_extremes(bad="0.85")  # perceptually uniform; nan (not logged): grey
    image = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, norm=norm, aspect="auto")
    for i, texts in enumerate(qmap.texts):
        for j, text in enumerate(texts):
            # white on viridis' dark low end, black on its light high end and on grey
            dark = math.isfinite(values[i, j]) and float(norm(values[i, j])) < 0.5
            ax.text(j, i, text, ha="center", va="center", fontsize=8, color="white" if dark else "black")
    ax.set_xticks(range(len(qmap.operands)), qmap.operands)
    ax.set_yticks(range(len(qmap.layers)), qmap.layers, fontsize=8)
    ax.set_xlabel("operand")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize="medium")
    fig.colorbar(image, ax=ax, label=QUANT_LABEL)
    return fig


def heatmap_name(job: Job) -> str:
    """quant_heatmap_<job id>.png, the id made safe for a file name and a W&B key (no / or .)."""
    return "quant_heatmap_" + "".join(c if c.isalnum() or c in "-_" else "_" for c in job.id) + ".png"


def write_heatmaps(jobs: list[Job], out: Path) -> tuple[list[Path], list[str]]:
    """A heatmap per job with quantization statistics (the first MAX_HEATMAPS of them), and report.md's
    line naming the jobs left out (none when none were)."""
    maps = [(job, qmap) for job in jobs if (qmap := quant_map(job.rows)) is not None]
    keys = shown_overrides(jobs)
    images = []
    for job, qmap in maps[:MAX_HEATMAPS]:
        run = " ".join([f"job {job.id}:", *(f"{k}={job.overrides[k]}" for k in keys if k in job.overrides)])
        title = f"{textwrap.fill(run, 60)}\nrelative quantization error at step {step_text(qmap.step)}"
        quant_heatmap(qmap, title).savefig(out / heatmap_name(job), dpi=100)
        images.append(out / heatmap_name(job))
    left_out = [job.id for job, _ in maps[MAX_HEATMAPS:]]
    if not left_out:
        return images, []
    return images, [
        f"Quantization heatmaps for the first {MAX_HEATMAPS} of the {len(maps)} jobs with quantization "
        f"statistics; {len(left_out)} left out: job{'s' if len(left_out) > 1 else ''} {', '.join(left_out)}."
    ]


def wandb_value(value: Any) -> Any:
    return None if isinstance(value, float) and math.isnan(value) else value


def wandb_table(header: list[str], rows: list[list[Any]]) -> Any:
    """A wandb.Table of raw numbers: a metric column of the group table becomes its mean, std and n."""
    import wandb

    spread_columns = [
        column in metric_formats() and any(isinstance(row[i], Spread) for row in rows)
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
    logger = jobs[0].config.get("logger") or {}
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


def note(message: str) -> None:
    """Progress and skipped outputs go to stderr, so that stdout is the markdown alone."""
    print(message, file=sys.stderr, flush=True)


def write_report(path: Path, out: Path | None = None, to_wandb: bool = False) -> int:
    """Print the tables, write report.md, loss.png, scale.png, sweep.png (final val/loss against a
    swept number such as the lr), the logit plots of transformer diagnostics and the quantization
    error plots (quant_err.png, quant_heatmap_<job>.png) into `out` (default: PATH); 0 on success."""
    jobs = find_jobs(path)
    root = path.resolve()
    out = out or path
    out.mkdir(parents=True, exist_ok=True)
    tables = {"table": build_table(jobs)}
    groups = build_group_table(jobs)
    if groups is not None:
        tables["groups"] = groups
    where = "/".join(root.parts[-2:])  # e.g. 2026-12-03/08-09-58.123456: the sweep's date and time

    images = []
    if plot_lines(jobs, "train/loss", f"train/loss: {where}", out / "loss.png"):
        images.append(out / "loss.png")
    else:
        note("no loss.png: no job logged train/loss")
    if not any(has_scaler(job) for job in jobs):
        note("no scale.png: no job has a loss scaler (scaler/scale is 1.0 throughout)")
    elif plot_lines(jobs, "scaler/scale", f"loss scale: {where}", out / "scale.png", log2_y=True):
        images.append(out / "scale.png")
    swept = numeric_sweep_key(jobs)
    if swept is not None and any(final(job.rows, "val/loss") is not None for job in jobs):
        sweep_figure(jobs, swept, "val/loss").savefig(out / "sweep.png", dpi=100)
        images.append(out / "sweep.png")
    for key, name, title in LOGIT_PLOTS:  # diagnostics=grads on a transformer: where instabilities show first
        if plot_lines(jobs, key, f"{title}: {where}", out / name, whole=True):  # the growth is the point
            images.append(out / name)
    # an emulated number format with diagnostics=grads: how much each format loses, step by step
    # (whole: a format whose error is far above the others' is the finding), then where in the model
    title = f"quantization relative error, mean over layers and operands (dashed: the largest): {where}"
    if plot_lines(jobs, QUANT_MEAN, title, out / "quant_err.png", whole=True, dashed_key=QUANT_MAX):
        images.append(out / "quant_err.png")
    heatmaps, notes = write_heatmaps(jobs, out)
    images += heatmaps

    text = report_text(path, jobs, markdown_tables(tables), images, tuple(notes))
    (out / "report.md").write_text(text)
    print(text, end="", flush=True)
    note(f"wrote {', '.join(p.name for p in [out / 'report.md', *images])} in {out}")
    if to_wandb:
        note(f"W&B report run: {log_to_wandb(root, out, jobs, tables, images)}")
    return 0
