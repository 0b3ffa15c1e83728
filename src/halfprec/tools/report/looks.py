"""How a configuration's lines look in a plot: a colour (and past 20 configurations a marker) for
the first override that varies, a line style for the second, and the legend's names for them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from halfprec.tools.report.groups import Group

LINE_STYLES = ["-", "--", "-.", ":"]

# Past 20 configurations, the markers that tell apart those sharing a colour (see palette): none of
# ^ v X x, which mark values off the chart and jobs that did not complete.
MARKERS = ["o", "s", "D", "P", "*", "h", "<", ">"]


@dataclass(frozen=True)
class Look:
    """How a configuration's lines look: colour, line style, and a marker of its own (None: only the
    dots a short line gets)."""

    colour: Any
    style: str = "-"
    marker: str | None = None


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
