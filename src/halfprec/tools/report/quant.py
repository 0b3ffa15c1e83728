"""The quantization statistics of an emulated number format with diagnostics=grads: quant_err.png
(the mean relative error against step, the largest dashed), grad_noise.png (the gradient-to-noise
ratio against step) and a heatmap per job of each layer's error per operand at its last diagnostics
step."""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from halfprec.tools.report.groups import shown_overrides
from halfprec.tools.report.plots import plot_lines
from halfprec.tools.report.runs import Job, file_id
from halfprec.tools.report.values import step_text

# The quantization statistics of an emulated number format (training/diagnostics.py): the heatmap's
# columns, in the order the layers log them, the line plot's keys, and how many jobs get a heatmap
# (one image each: a sweep of 50 jobs would bury report.md under 50 of them).
QUANT_OPERANDS = ("input", "weight", "grad_output")
QUANT_MEAN, QUANT_MAX = "diag/quant_rel_err", "diag/quant_rel_err_max"
QUANT_LABEL = "relative error ||q(x) - x|| / ||x||"
GRAD_NOISE = "diag/grad_noise"  # over the model's quantized weight gradients (training/diagnostics.py)
MAX_HEATMAPS = 12


def quant_cell(key: str) -> tuple[str, str] | None:
    """(layer, operand) of a `quant/<layer>/<operand>/rel_err` key, None for any other key. A layer's
    name has dots (blocks.0.attn.qkv) but no slash, so such a key splits into exactly four parts."""
    parts = key.split("/")
    if len(parts) == 4 and parts[0] == "quant" and parts[3] == "rel_err":
        return parts[1], parts[2]
    return None


@dataclass
class QuantMap:
    """A job's relative quantization error at one step: a row per layer, a column per operand."""

    step: float
    layers: list[str]  # in the order the step's row logged them: the model's order
    operands: list[str]
    values: list[list[float]]  # nan where the layer logged no such operand (or logged a nan)
    texts: list[list[str]]  # each cell's annotation: 2 significant digits, "" where not logged


def quant_map(rows: list[dict[str, Any]]) -> QuantMap | None:
    """The rel_err of each layer and operand at the last step that logged any (only diagnostics steps
    do; an earlier step may have other layers, so one step is shown, never a mix); None when no step did."""
    row = next((row for row in reversed(rows) if any(quant_cell(key) for key in row)), None)
    if row is None:
        return None
    cells = {cell: float(value) for key, value in row.items() if (cell := quant_cell(key))}
    layers = list(dict.fromkeys(layer for layer, _ in cells))
    # the three operands always, so that a missing one shows as a blank column; any other after them
    operands = list(dict.fromkeys([*QUANT_OPERANDS, *(operand for _, operand in cells)]))
    values = [[cells.get((layer, op), math.nan) for op in operands] for layer in layers]
    texts = [[f"{cells[layer, op]:.2g}" if (layer, op) in cells else "" for op in operands] for layer in layers]
    return QuantMap(row["step"], layers, operands, values, texts)


def quant_norm(values: Any) -> Any:
    """The colour scale: log when the positive errors span 10x or more (an fp4 gradient's error beside an
    fp8 weight's would leave every fp8 cell the same dark colour), from 0 otherwise."""
    import numpy as np
    from matplotlib.colors import LogNorm, Normalize

    finite = values[np.isfinite(values)]
    positive = finite[finite > 0]
    if positive.size and positive.max() >= 10 * positive.min():
        return LogNorm(float(positive.min()), float(positive.max()), clip=True)  # clip: an exact 0 at the bottom
    return Normalize(0.0, float(finite.max()) if finite.size and finite.max() > 0 else 1.0)


def quant_heatmap(qmap: QuantMap, title: str) -> Any:
    """The Figure of a QuantMap: a cell per layer and operand coloured by its error and annotated with
    it; grey and blank where the layer logged no such operand."""
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    values = np.asarray(qmap.values, dtype=float)
    norm = quant_norm(values)
    height = min(max(4.0, 0.3 * len(qmap.layers) + 2.0), 60.0)  # a row of text per layer, however many
    fig = Figure(figsize=(8, height), layout="constrained")
    FigureCanvasAgg(fig)  # as line_figure: no pyplot state
    ax = fig.subplots()
    cmap = colormaps["viridis"].with_extremes(bad="0.85")  # perceptually uniform; nan (not logged): grey
    image = ax.imshow(np.ma.masked_invalid(values), cmap=cmap, norm=norm, aspect="auto")
    for i, texts in enumerate(qmap.texts):
        for j, text in enumerate(texts):
            # white on viridis' dark low end, black on its light high end and on grey
            dark = math.isfinite(values[i, j]) and float(norm(values[i, j])) < 0.5
            ax.text(j, i, text, ha="center", va="center", fontsize=8, color="white" if dark else "black")
    ax.set_xticks(range(len(qmap.operands)), qmap.operands)
    ax.set_yticks(range(len(qmap.layers)), qmap.layers, fontsize=8)
    ax.set_xlabel("operand")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize="medium")
    fig.colorbar(image, ax=ax, label=QUANT_LABEL)
    return fig


def heatmap_name(job: Job) -> str:
    return f"quant_heatmap_{file_id(job)}.png"


def write_heatmaps(jobs: list[Job], out: Path) -> tuple[list[Path], list[str]]:
    """A heatmap per job with quantization statistics (the first MAX_HEATMAPS of them), and report.md's
    line naming the jobs left out (none when none were)."""
    maps = [(job, qmap) for job in jobs if (qmap := quant_map(job.rows)) is not None]
    keys = shown_overrides(jobs)
    images = []
    for job, qmap in maps[:MAX_HEATMAPS]:
        title = f"{textwrap.fill(job_label(job, keys), 60)}\nrelative quantization error at step {step_text(qmap.step)}"
        quant_heatmap(qmap, title).savefig(out / heatmap_name(job), dpi=100)
        images.append(out / heatmap_name(job))
    return images, left_out_note("Quantization heatmaps", "quantization", [job for job, _ in maps])


def job_label(job: Job, keys: list[str]) -> str:
    """'job <id>: key=value ...', with the overrides of `keys` the job has: a per-job plot's title."""
    return " ".join([f"job {job.id}:", *(f"{k}={job.overrides[k]}" for k in keys if k in job.overrides)])


def left_out_note(plots: str, stats: str, found: list[Job]) -> list[str]:
    """report.md's line naming the jobs past the first MAX_HEATMAPS of `found`, which get no plot (none
    when none are)."""
    left_out = [job.id for job in found[MAX_HEATMAPS:]]
    if not left_out:
        return []
    return [
        f"{plots} for the first {MAX_HEATMAPS} of the {len(found)} jobs with {stats} statistics; "
        f"{len(left_out)} left out: job{'s' if len(left_out) > 1 else ''} {', '.join(left_out)}."
    ]


def quant_err_title(where: str) -> str:
    """quant_err.png's title (line_figure wraps it to the plot's width)."""
    return f"quantization relative error, mean over layers and operands (dashed: the largest): {where}"


def write_quant_plots(jobs: list[Job], out: Path, where: str) -> tuple[list[Path], list[str]]:
    """quant_err.png (when a job logged the statistics) and the heatmaps, and report.md's line naming
    the jobs left out of them. How much each format loses, step by step (whole: a format whose error
    is far above the others' is the finding), then where in the model."""
    images = []
    title = quant_err_title(where)
    if plot_lines(jobs, QUANT_MEAN, title, out / "quant_err.png", whole=True, dashed_key=QUANT_MAX):
        images.append(out / "quant_err.png")
    noise = f"gradient-to-noise ratio ||dW|| / ||quantization noise|| (FP4 All the Way's threshold: sqrt(3)): {where}"
    if plot_lines(jobs, GRAD_NOISE, noise, out / "grad_noise.png", whole=True):
        images.append(out / "grad_noise.png")
    heatmaps, notes = write_heatmaps(jobs, out)
    return images + heatmaps, notes
