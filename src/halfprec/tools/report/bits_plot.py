"""bits.png: for a sweep over number formats (precision.format, +experiment=formats), each format's
final val/loss against its bits per value (block scales included), mean ± std over seeds, a panel
per configuration of the other overrides (task=classification, task=lm)."""

from __future__ import annotations

import statistics
from typing import Any

from halfprec.tools.report.groups import COUNTED, group_jobs, shown_overrides
from halfprec.tools.report.runs import Job
from halfprec.tools.report.values import final

FORMAT_KEY = "precision.format"
HIGH_BITS = {"bfloat16": 16.0, "float16": 16.0}  # no format: the autocast dtype's bits (none: fp32's 32)


def format_points(jobs: list[Job], metric: str) -> tuple[float, list[float]]:
    """The bits per value of the jobs' format (their precision.format override; null: their autocast
    dtype's) and their completed jobs' final values of `metric`."""
    from halfprec.numerics.formats import FORMATS  # torch

    fmt = jobs[0].overrides.get(FORMAT_KEY)
    autocast = jobs[0].config.get("precision", {}).get("autocast")
    bits = FORMATS[fmt].bits if fmt in FORMATS else HIGH_BITS.get(autocast, 32.0)
    return bits, [v for job in jobs if job.status == COUNTED and (v := final(job.rows, metric)) is not None]


def bits_figure(jobs: list[Job], metric: str) -> Any | None:
    """The Figure, or None when the jobs do not vary precision.format."""
    if FORMAT_KEY not in shown_overrides(jobs):
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = group_jobs(jobs, leave_out=(FORMAT_KEY,))
    varying = [key for key in shown_overrides(jobs) if key != FORMAT_KEY]
    fig = Figure(figsize=(6.5, 4.0 * len(panels)), layout="constrained")
    FigureCanvasAgg(fig)
    for ax, panel in zip(fig.subplots(len(panels), 1, squeeze=False)[:, 0], panels):
        for fmt, group in ((g.overrides.get(FORMAT_KEY), g) for g in group_jobs(panel.jobs)):
            bits, values = format_points(group.jobs, metric)
            if not values:
                continue
            mean, spread = statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0
            ax.errorbar(bits, mean, yerr=spread, fmt="o", capsize=3)
            ax.annotate(str(fmt), (bits, mean), textcoords="offset points", xytext=(4, 4), fontsize=7)
        where = ", ".join(f"{k}={v}" for k, v in panel.overrides.items() if k in varying) or "the sweep"
        ax.set_title(f"{where}: final {metric}, mean ± std over seeds", fontsize="medium")
        ax.set_xlabel("bits per value (block scales included; null: the autocast dtype)")
        ax.set_ylabel(metric)
    return fig
