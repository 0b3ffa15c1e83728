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

# Plots of a transformer's diagnostics (diagnostics=grads): (key, file, title). Only jobs whose
# attention layers logged their logits (attn_logit_max/<layer>, their largest as ATTN_KEY) get them:
# a plain classifier logs its output's log Z too, but these are the instabilities of large-lr
# transformers (Dehghani et al. 2023; Chowdhery et al. 2022), and the report's help promises them for those.
ATTN_KEY, ATTN_PREFIX = "diag/attn_logit_max", "attn_logit_max/"
LOGIT_PLOTS = (
    (ATTN_KEY, "attn_logits.png", "largest attention logit"),
    ("diag/output_logz", "logz.png", "output logits' log Z (mean)"),
)


def has_scaler(job: Job) -> bool:
    """A loss scaler shows as a scale other than 1.0 (scaler=none logs 1.0 throughout)."""
    return any(row.get("scaler/scale", 1.0) != 1.0 for row in job.rows)


def wrap_lines(text: str, width: int) -> str:
    """Each line of `text` wrapped to `width` characters; its own line breaks kept (textwrap.fill
    alone would join them). Not at hyphens: a date (2026-12-03) or a range (1-3 seeds) stays whole."""
    return "\n".join(textwrap.fill(line, width, break_on_hyphens=False) for line in text.splitlines())


def fit_title(ax: Any, title: str, fontsize: str = "large") -> None:
    """Set the axes' title, wrapped to the axes' width. A constrained layout makes room above the axes
    for a title but not beside them: a centred title wider than its axes (a long sweep path, a panel
    named by its overrides) ran off the figure's left edge. The width left by the legend and the tick
    labels is known only once the figure is laid out, so it is laid out once (no pixels drawn) first."""
    fig = ax.get_figure()
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    room = ax.get_window_extent(renderer).width
    text = ax.set_title(title, fontsize=fontsize)
    width = max(map(len, title.splitlines()), default=0)
    # fewer characters a line until it fits (10 at least: a word longer than a line is broken)
    while text.get_window_extent(renderer).width > room and width > 10:
        width -= 1
        text.set_text(wrap_lines(title, width))


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
    label_rows = sum(len(textwrap.wrap(line.label, 52)) for line in lines if not line.label.startswith("_")) + 2
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
    fit_title(ax, title)  # last: the legend sets how much width the axes have
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


def has_attention(job: Job) -> bool:
    """Whether the job's attention layers logged their logits: a transformer with diagnostics=grads."""
    return any(key == ATTN_KEY or key.startswith(ATTN_PREFIX) for row in job.rows for key in row)


def write_logit_plots(jobs: list[Job], out: Path, where: str) -> list[Path]:
    """attn_logits.png and logz.png of the transformers among the jobs (see LOGIT_PLOTS); those written."""
    transformers = [job for job in jobs if has_attention(job)]
    if not transformers:
        return []
    images = []
    for key, name, title in LOGIT_PLOTS:  # where instabilities show first; whole: the growth is the point
        if plot_lines(transformers, key, f"{title}: {where}", out / name, whole=True):
            images.append(out / name)
    return images
