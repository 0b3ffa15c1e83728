"""What a line plot marks where a line leaves the chart: a marker on the edge it crosses with the
value beside it, and the words its label adds ("off chart at steps 20-30", "non-finite from step 110")."""

from __future__ import annotations

import math
from typing import Any

from halfprec.tools.report.lines import Line
from halfprec.tools.report.values import step_text

# Stretches off the chart that a line's label names (and marks) one by one, per kind; more are counted.
SHOWN_RUNS = 3


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
