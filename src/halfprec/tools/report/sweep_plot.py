"""sweep.png: each job's final value of a metric against a swept number such as the lr (Wortsman et
al.'s plot), a line per configuration of the other overrides, and the jobs that did not complete or
have no final value on the chart marked."""

from __future__ import annotations

import collections
import math
import statistics
from typing import Any

from halfprec.tools.report.groups import COUNTED, Group, group_jobs, is_seed, shown_overrides
from halfprec.tools.report.lines import Line
from halfprec.tools.report.looks import Look, group_looks, group_name
from halfprec.tools.report.offchart import edge_marker
from halfprec.tools.report.runs import Job
from halfprec.tools.report.values import final
from halfprec.tools.report.yaxis import beyond, extent, y_range

# The sweep plot's markers, as its title explains them.
SWEEP_MARKS = {
    "x": "x: a job that did not complete, at its last {metric}",
    "^": "^ on the top edge: a final {metric} above the chart, non-finite or never logged (beside it)",
    "v": "v on the bottom edge: a final {metric} below the chart (beside it)",
}


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
