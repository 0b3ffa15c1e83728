"""A plot's y axis: its range and scale (linear, log, log2) from the lines that may set it, leaving
out a line that blew up far above the others, and where values off the chart are clipped to."""

from __future__ import annotations

import math
import statistics

from halfprec.tools.report.lines import Line

# A line whose maximum lies further above the lines' typical maximum than FAR times their whole
# range (in decades, on positive values) is left out of the y-range: one blow-up to 1e13 would
# otherwise squash every other line flat. It is still drawn, clipped, and marked where it leaves.
FAR = 1.0


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


def beyond(bottom: float, top: float, scale: str) -> tuple[float, float]:
    """Where values off the chart are clipped to: just beyond it, so that a line visibly runs off the
    edge (and its far-out values do not overflow the drawing)."""
    if scale == "linear":
        return bottom - (top - bottom), top + (top - bottom)
    return bottom / 10, top * 10
