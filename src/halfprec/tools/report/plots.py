"""Line plots of a key against step (loss.png, scale.png, the diagnostics' logit plots): the lines,
their legend, the y axis, and lines that coincide kept visible. matplotlib and numpy are imported
when a figure is drawn."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from halfprec.tools.report.lines import Line, plot_data
from halfprec.tools.report.offchart import mark_off_chart
from halfprec.tools.report.runs import Job
from halfprec.tools.report.yaxis import band_edges, beyond, extent, y_range

# Plots made when a job logged the key (diagnostics=grads): (key, file, title).
LOGIT_PLOTS = (
    ("diag/attn_logit_max", "attn_logits.png", "largest attention logit"),
    ("diag/output_logz", "logz.png", "output logits' log Z (mean)"),
)


def has_scaler(job: Job) -> bool:
    """A loss scaler shows as a scale other than 1.0 (scaler=none logs 1.0 throughout)."""
    return any(row.get("scaler/scale", 1.0) != 1.0 for row in job.rows)


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
