"""bits.png: for a sweep over number formats (precision.format, +experiment=formats), each format's
final val/loss against its bits per value (block scales included), mean ± std over its seeds where it
has several (the panel's title says how many), a panel per configuration of the other overrides
(task=classification, task=lm)."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from halfprec.tools.report.groups import COUNTED, group_jobs, shown_overrides
from halfprec.tools.report.plots import fit_title
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


def seeds_text(counts: list[int]) -> str:
    """What a panel's points are, from how many completed jobs each has: one seed each has no mean or
    std to speak of; several, the mean ± std over them (the range when the points differ)."""
    low, high = min(counts), max(counts)
    if high == 1:
        return "one seed each"
    text = f"mean ± std over {low if low == high else f'{low}-{high}'} seeds"
    return text + " (no error bar: one seed)" if low == 1 else text


def bits_figure(jobs: list[Job], metric: str) -> Any | None:
    """The Figure, or None when the jobs do not vary precision.format."""
    if FORMAT_KEY not in shown_overrides(jobs):
        return None
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    palette = colormaps["tab20"]  # the ten dark colours first, then their light ones: 20 formats apart
    panels = group_jobs(jobs, leave_out=(FORMAT_KEY,))
    varying = [key for key in shown_overrides(jobs) if key != FORMAT_KEY]
    fig = Figure(figsize=(8.5, 4.0 * len(panels)), layout="constrained")
    FigureCanvasAgg(fig)
    titles: dict[Any, str] = {}  # each panel's axes: its title
    for ax, panel in zip(fig.subplots(len(panels), 1, squeeze=False)[:, 0], panels):
        points = {g.overrides.get(FORMAT_KEY): format_points(g.jobs, metric) for g in group_jobs(panel.jobs)}
        points = {fmt: point for fmt, point in points.items() if point[1]}
        for i, ((fmt, (bits, values)), x) in enumerate(zip(points.items(), spread(points), strict=True)):
            # an error bar only over several seeds: one seed's "± 0" would claim a spread never measured
            sd = statistics.stdev(values) if len(values) > 1 else None
            style = {"color": palette(2 * i % 20 + i // 10 % 2), "marker": "osD^v"[i // 20 % 5], "capsize": 3}
            ax.errorbar(x, statistics.fmean(values), yerr=sd, linestyle="none", label=f"{fmt} ({bits:g} bits)", **style)
        where = ", ".join(f"{k}={v}" for k, v in panel.overrides.items() if k in varying) or "the sweep"
        counts = [len(values) for _, values in points.values()]
        titles[ax] = f"{where}: final {metric}, {seeds_text(counts)}" if counts else f"{where}: no final {metric}"
        ax.set_xlabel("bits per value (block scales included; null: the autocast dtype)")
        ax.set_ylabel(metric)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), title=FORMAT_KEY, title_fontsize=7)
    for ax, title in titles.items():  # once every panel has its legend: their widths set the titles' room
        fit_title(ax, title, fontsize="medium")
    return fig


def spread(points: dict[Any, tuple[float, list[float]]], step: float = 0.08) -> list[float]:
    """Each point's x: its bits, formats of equal bits side by side `step` apart (five 8-bit ones
    would otherwise draw their error bars over each other)."""
    total = Counter(bits for bits, _ in points.values())
    placed: Counter[float] = Counter()
    xs = []
    for bits, _ in points.values():
        xs.append(bits + (placed[bits] - (total[bits] - 1) / 2) * step)
        placed[bits] += 1
    return xs
