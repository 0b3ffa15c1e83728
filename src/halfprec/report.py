"""`halfprec report PATH`: one markdown table and two plots for a run, a multirun sweep, or a dir of them.

Reads what the runs left on disk (metrics.jsonl, .hydra/overrides.yaml and config.yaml, summary.json,
the sweep's sweep.jsonl), so it works on finished, failed and still-running sweeps alike.
matplotlib and wandb are imported inside the functions that draw and upload.
"""

from __future__ import annotations

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

EXPECTED = (
    "expected a run dir (with metrics.jsonl or .hydra/), a multirun sweep dir (with <n>_<overrides>/ job dirs), "
    "or a dir holding such runs"
)

# Table columns after the overrides, and how their values print. "-" is a value never logged,
# "nan" one logged as null (non-finite: metrics.jsonl writes inf and NaN as null).
METRIC_FORMATS = {
    "train/loss": ".4f",
    "val/loss": ".4f",
    "val/acc": ".4f",
    "skipped steps": ".10g",  # whole and exact: counts, and scales that are powers of two
    "min scale": ".10g",
    "final scale": ".10g",
    "samples/s": ".0f",
    "MFU": ".3f",
}
LINE_STYLES = ["-", "--", "-.", ":"]


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
    status: str  # completed | failed | running
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
            sweep_lines[run_dir.parent] = read_sweep_lines(run_dir.parent / "sweep.jsonl")
        jobs.append(read_job(run_dir, root, sweep_lines[run_dir.parent]))
    return sorted(jobs, key=lambda job: job.sort_key)


def read_job(run_dir: Path, root: Path, sweep_lines: dict[int, dict]) -> Job:
    num = job_number(run_dir)
    own = str(num) if num is not None else run_dir.name
    sweep = "." if run_dir == root else run_dir.parent.relative_to(root).as_posix()  # "." : directly in PATH
    job_id = own if sweep == "." else f"{sweep}/{own}"
    status, error = job_status(run_dir, sweep_lines.get(num) if num is not None else None)
    return Job(
        id=job_id,
        dir=run_dir,
        overrides=read_overrides(run_dir / ".hydra" / "overrides.yaml"),
        config=read_yaml(run_dir / ".hydra" / "config.yaml") or {},
        rows=read_rows(run_dir / "metrics.jsonl"),
        status=status,
        summary=read_json(run_dir / "summary.json"),
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


def read_sweep_lines(path: Path) -> dict[int, dict]:
    """sweep.jsonl by job number; a job run again in the same sweep dir has its latest line kept."""
    if not path.is_file():
        return {}
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {line["job"]: line for line in lines if "job" in line}


def job_status(run_dir: Path, sweep_line: dict | None) -> tuple[str, str | None]:
    """(status, first line of the error) from what the job left behind."""
    # summary.json is written only when training ends normally; it goes first because a job that
    # failed in its sweep may have been finished later by hand (hydra.run.dir=<job dir> resume=auto)
    if (run_dir / "summary.json").is_file():
        return "completed", None
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


def steady_median(rows: list[dict], key: str) -> float | None:
    """Median of a perf/ metric over the rows, leaving out the step-1 row (warm-up) when there are others."""
    timed = [row for row in rows if key in row]
    steady = [row for row in timed if row["step"] != 1] or timed
    values = [row[key] for row in steady if math.isfinite(row[key])]
    return statistics.median(values) if values else None


def job_metrics(rows: list[dict], summary: dict[str, Any]) -> dict[str, Any]:
    """The table's metric columns for one job (keys as in METRIC_FORMATS). A finished run's
    summary.json has the exact minimum scale; the rows, logged every few steps, may miss it."""
    return {
        "train/loss": final(rows, "train/loss"),
        "val/loss": final(rows, "val/loss"),
        "val/acc": final(rows, "val/acc"),
        "skipped steps": final(rows, "scaler/skipped_steps"),
        "min scale": summary.get("scaler/min_scale", smallest(rows, "scaler/scale")),
        "final scale": final(rows, "scaler/scale"),
        "samples/s": steady_median(rows, "perf/samples_per_s"),
        "MFU": steady_median(rows, "perf/mfu"),  # GPUs in halfprec/perf.py's table only
    }


def shown_overrides(jobs: list[Job]) -> list[str]:
    """The override keys whose value differs between jobs (or is missing in some), in command-line order.
    A lone run shows all of its overrides: there is nothing to tell it apart from."""
    keys = list(dict.fromkeys(key for job in jobs for key in job.overrides))
    if len(jobs) == 1:
        return keys
    return [key for key in keys if len({job.overrides.get(key) for job in jobs}) > 1]


def build_table(jobs: list[Job]) -> tuple[list[str], list[list[Any]]]:
    """Header and raw values (numbers stay numbers, for W&B), one row per job."""
    keys = shown_overrides(jobs)
    header = ["job", *keys, *METRIC_FORMATS, "status"]
    rows = [
        [job.id, *(job.overrides.get(key) for key in keys), *job_metrics(job.rows, job.summary).values(), job.status]
        for job in jobs
    ]
    return header, rows


def format_cell(column: str, value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if column in METRIC_FORMATS and isinstance(value, int | float):
        return format(value, METRIC_FORMATS[column])
    return str(value).replace("|", "\\|")  # a literal | would split the markdown cell


def to_markdown(header: list[str], rows: list[list[Any]]) -> str:
    align = ["---:" if column in METRIC_FORMATS else "---" for column in header]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(format_cell(column, value) for column, value in zip(header, row)) + " |")
    return "\n".join(lines)


def report_text(path: Path, jobs: list[Job], table: str, images: list[Path]) -> str:
    """report.md: a heading with the job counts, the table, the failed jobs' errors, the plots."""
    counts = {status: sum(job.status == status for job in jobs) for status in ("completed", "failed", "running")}
    summary = ", ".join(f"{n} {status}" for status, n in counts.items() if n)
    parts = [f"## {path}: {len(jobs)} job{'s' if len(jobs) != 1 else ''}, {summary}", table]
    errors = [f"- job {job.id}: {job.error}" for job in jobs if job.error]
    if errors:
        parts.append("Failed:\n\n" + "\n".join(errors))
    parts += [f"![{image.stem}]({image.name})" for image in images]
    return "\n\n".join(parts) + "\n"


def legend_labels(jobs: list[Job]) -> dict[str, str]:
    """Job id -> its line's label: the id, the overrides that tell it apart, and its status unless completed."""
    keys = shown_overrides(jobs)
    labels = {}
    for job in jobs:
        label = " ".join([job.id + ":", *(f"{key}={job.overrides[key]}" for key in keys if key in job.overrides)])
        label = label.removesuffix(":")
        if job.status != "completed":
            label += f" ({job.status})"
        labels[job.id] = textwrap.fill(label, 48)  # long labels would make the legend wider than the plot
    return labels


def has_scaler(job: Job) -> bool:
    """A loss scaler shows as a scale other than 1.0 (scaler=none logs 1.0 throughout)."""
    return any(row.get("scaler/scale", 1.0) != 1.0 for row in job.rows)


def plot_lines(jobs: list[Job], key: str, title: str, path: Path, log2_y: bool = False) -> bool:
    """`key` against step, one line per job that logged it; False (and no file) when none did."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    # a bare Figure on the Agg canvas: no pyplot state, no display needed (headless machines, tests)
    fig = Figure(figsize=(9, 5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    labels = legend_labels(jobs)
    drawn: list[float] = []
    for job in jobs:
        points = [(row["step"], row[key]) for row in job.rows if key in row]
        if not points:
            continue
        steps, values = zip(*points)
        # jobs often trace the same line (every scaler=none job sits at scale 1): dashes keep each visible;
        # a nan (non-finite value) leaves a gap in its line
        style = LINE_STYLES[len(ax.lines) % len(LINE_STYLES)]
        marker = "o" if len(points) <= 20 else None
        ax.plot(steps, values, style, label=labels[job.id], marker=marker, markersize=3, linewidth=1.5)
        drawn += [v for v in values if math.isfinite(v)]
    if not drawn:
        return False
    if log2_y:
        ax.set_yscale("log", base=2)
    elif min(drawn) > 0 and max(drawn) / min(drawn) > 100:  # a diverging or fast-falling loss
        ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers, even on short runs
    ax.set_xlabel("step (optimizer steps)")
    ax.set_ylabel(key + (" (log2)" if log2_y else ""))
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize="small", title="job: overrides")
    fig.savefig(path, dpi=100)
    return True


def wandb_value(value: Any) -> Any:
    return None if isinstance(value, float) and math.isnan(value) else value


def log_to_wandb(
    root: Path, out: Path, jobs: list[Job], header: list[str], rows: list[list[Any]], images: list[Path]
) -> str:
    """A new W&B run (job_type report) with the table and the plots, under `out`/wandb/ unless $WANDB_DIR
    says otherwise; returns where it went."""
    import wandb

    # the sweep's own project and group, so that the report sits next to the runs it describes
    logger = jobs[0].config.get("logger") or {}
    in_one_sweep = all(job.dir.parent == root and job_number(job.dir) is not None for job in jobs)
    group = logger.get("group") or (f"{root.parent.name}_{root.name}" if in_one_sweep else None)
    run = wandb.init(
        project=logger.get("project") or "halfprec",
        entity=logger.get("entity"),
        mode=os.environ.get("WANDB_MODE", "offline"),  # the project's default: no account or network needed
        dir=os.environ.get("WANDB_DIR") or str(out),
        group=group,
        job_type="report",
        name=f"report_{group or root.name}",
        config={"path": str(root), "jobs": len(jobs)},
        settings=wandb.Settings(console="off", x_disable_stats=True, quiet=True),
    )
    try:
        table = wandb.Table(columns=header, data=[[wandb_value(v) for v in row] for row in rows])
        run.log({"report/table": table, **{f"report/{image.stem}": wandb.Image(str(image)) for image in images}})
    finally:
        run.finish()
    if run.offline:
        return f"{run.settings.sync_dir} (offline: `wandb sync {run.settings.sync_dir}` uploads it)"
    return run.url or f"none (WANDB_MODE={run.settings.mode})"


def note(message: str) -> None:
    """Progress and skipped outputs go to stderr, so that stdout is the markdown alone."""
    print(message, file=sys.stderr, flush=True)


def write_report(path: Path, out: Path | None = None, to_wandb: bool = False) -> int:
    """Print the table, write report.md, loss.png and scale.png into `out` (default: PATH); 0 on success."""
    jobs = find_jobs(path)
    root = path.resolve()
    out = out or path
    out.mkdir(parents=True, exist_ok=True)
    header, rows = build_table(jobs)
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

    text = report_text(path, jobs, to_markdown(header, rows), images)
    (out / "report.md").write_text(text)
    print(text, end="", flush=True)
    note(f"wrote {', '.join(p.name for p in [out / 'report.md', *images])} in {out}")
    if to_wandb:
        note(f"W&B report run: {log_to_wandb(root, out, jobs, header, rows, images)}")
    return 0
