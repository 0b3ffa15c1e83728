"""The what-if statistics of diagnostics.shadow: per job and shadow format, shadow_<format>_<job>.png,
the damage the format would do to each layer over the run (a heatmap of rel_err, a row per layer and a
column per diagnostics step, a panel per operand), where quant_heatmap_<job>.png shows one step of the
format a run computes in. A heatmap rather than a line per layer: a GPT's 49 Linear layers would be 49
lines per panel."""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from halfprec.tools.report.groups import shown_overrides
from halfprec.tools.report.quant import MAX_HEATMAPS, QUANT_LABEL, QUANT_OPERANDS, job_label, left_out_note, quant_norm
from halfprec.tools.report.runs import Job, file_id
from halfprec.tools.report.values import step_text

MAX_STEP_TICKS = 12  # step labels under a panel: every n-th column past this many


def shadow_cell(key: str) -> tuple[str, str, str] | None:
    """(format, layer, operand) of a `shadow/<format>/<layer>/<operand>/rel_err` key, None for any other
    key. Neither a format's nor a layer's name has a slash, so such a key splits into exactly five parts."""
    parts = key.split("/")
    if len(parts) == 5 and parts[0] == "shadow" and parts[4] == "rel_err":
        return parts[1], parts[2], parts[3]
    return None


@dataclass
class ShadowMap:
    """One shadow format's relative error in a job: per operand, a row per layer and a column per step."""

    format: str
    steps: list[float]  # the diagnostics steps that logged the format, in order
    layers: list[str]  # in the order the rows logged them: the model's order
    operands: list[str]
    values: dict[str, list[list[float]]]  # operand -> [layer][step]; nan where not logged (or logged as null)


def shadow_maps(rows: list[dict[str, Any]]) -> list[ShadowMap]:
    """A ShadowMap per format the rows logged shadow statistics of, in the order they were logged."""
    cells: dict[str, dict[tuple[str, str, float], float]] = {}  # format -> (layer, operand, step) -> rel_err
    steps: dict[str, list[float]] = {}
    for row in rows:
        for key, value in row.items():
            if (cell := shadow_cell(key)) is None:
                continue
            fmt, layer, operand = cell
            cells.setdefault(fmt, {})[layer, operand, row["step"]] = float(value)
            if row["step"] not in steps.setdefault(fmt, []):
                steps[fmt].append(row["step"])
    maps = []
    for fmt, found in cells.items():
        layers = list(dict.fromkeys(layer for layer, _, _ in found))
        operands = list(dict.fromkeys([*QUANT_OPERANDS, *(op for _, op, _ in found)]))
        values = {
            op: [[found.get((layer, op, step), math.nan) for step in steps[fmt]] for layer in layers] for op in operands
        }
        maps.append(ShadowMap(fmt, steps[fmt], layers, operands, values))
    return maps


def shadow_figure(smap: ShadowMap, title: str) -> Any:
    """The Figure of a ShadowMap: a heatmap per operand (layers down, steps across), one colour scale
    for all three (log when the errors span 10x), grey where a layer logged no such operand."""
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = [np.asarray(smap.values[op], dtype=float) for op in smap.operands]
    norm = quant_norm(np.concatenate([p.ravel() for p in panels]))
    height = min(max(4.0, 0.3 * len(smap.layers) + 2.0), 60.0)  # a row of text per layer, however many
    width = 3.0 + len(panels) * min(max(3.0, 0.15 * len(smap.steps)), 12.0)
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)  # as line_figure: no pyplot state
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    cmap = colormaps["viridis"].with_extremes(bad="0.85")  # as the quant heatmaps: nan (not logged) grey
    every = max(1, math.ceil(len(smap.steps) / MAX_STEP_TICKS))
    ticks = list(range(0, len(smap.steps), every))
    images = []
    for ax, op, values in zip(axes, smap.operands, panels):
        images.append(ax.imshow(np.ma.masked_invalid(values), cmap=cmap, norm=norm, aspect="auto"))
        ax.set_xticks(ticks, [step_text(smap.steps[i]) for i in ticks], fontsize=8, rotation=45)
        ax.set_xlabel("step")
        ax.set_title(op, fontsize="medium")
    axes[0].set_yticks(range(len(smap.layers)), smap.layers, fontsize=8)
    axes[0].set_ylabel("layer")
    fig.suptitle(title, fontsize="medium")
    fig.colorbar(images[0], ax=list(axes), label=QUANT_LABEL)  # one norm: any panel's
    return fig


def shadow_name(fmt: str, job: Job) -> str:
    return f"shadow_{fmt}_{file_id(job)}.png"  # a format's name is a file name (fp8_e4m3, nvfp4)


def write_shadow_plots(jobs: list[Job], out: Path) -> tuple[list[Path], list[str]]:
    """shadow_<format>_<job>.png per job with shadow statistics (the first MAX_HEATMAPS jobs) and
    format, and report.md's line naming the jobs left out (none when none were)."""
    found = [(job, maps) for job in jobs if (maps := shadow_maps(job.rows))]
    keys = shown_overrides(jobs)
    images = []
    for job, maps in found[:MAX_HEATMAPS]:
        run = job_label(job, keys)
        for smap in maps:
            what = f"relative error {smap.format} would have (diagnostics.shadow), per layer and step"
            path = out / shadow_name(smap.format, job)
            shadow_figure(smap, f"{textwrap.fill(run, 80)}\n{what}").savefig(path, dpi=100)
            images.append(path)
    return images, left_out_note("Shadow format plots", "shadow", [job for job, _ in found])
