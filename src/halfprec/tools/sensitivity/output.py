"""What `halfprec sensitivity` writes: sensitivity.md (the tables), sensitivity.json (every number,
for `halfprec report` and scripts) and sensitivity.png (the damage of each layer in each format)."""

from __future__ import annotations

import json
import math
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from halfprec.tools.sensitivity.measure import WHOLE, Measured, Row

DAMAGE_LABEL = "loss increase with the layer in the format"


@dataclass
class Summary:
    """The JSON of one measurement: what was measured, and each row's numbers."""

    run: str
    step: int
    precision: str
    recipe: dict[str, Any]
    batches: int
    reference_loss: float
    formats: list[str]
    rows: list[dict[str, Any]]

    @classmethod
    def of(cls, run: str, step: int, precision: str, recipe: dict[str, Any], measured: Measured,
           formats: list[str]) -> Summary:  # fmt: skip
        rows = [row_record(measured, r) for r in measured.rows]
        return cls(run, step, precision, recipe, measured.batches, measured.reference_loss, formats, rows)

    @classmethod
    def read(cls, path: Path) -> Summary:
        return cls(**json.loads(path.read_text()))

    def damage(self, layer: str, fmt: str) -> float:
        return next(r["damage"] for r in self.rows if r["layer"] == layer and r["format"] == fmt)

    def layers(self) -> list[str]:
        """The model's Linear layers in model order, WHOLE first."""
        return [WHOLE, *dict.fromkeys(r["layer"] for r in self.rows if r["layer"] != WHOLE)]


def row_record(measured: Measured, row: Row) -> dict[str, Any]:
    dx = row.input_grad
    return {
        "layer": row.layer,
        "format": row.format,
        "params": row.params,
        "damage": measured.damage(row),
        "damage_se": measured.damage_se(row),
        "weight_grad_cos": row.weight_grad.cosine,
        "weight_grad_rel_err": row.weight_grad.rel_err,
        "input_grad_cos": None if dx is None else dx.cosine,
        "input_grad_rel_err": None if dx is None else dx.rel_err,
    }


def cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def markdown(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def damage_table(summary: Summary) -> list[str]:
    """Layers x formats, the loss increase in each cell, most damaged first by the first format."""
    first = summary.formats[0]
    layers = sorted(summary.layers()[1:], key=lambda n: summary.damage(n, first), reverse=True)
    params = {r["layer"]: r["params"] for r in summary.rows if r["format"] == first}
    rows = [[n, str(params[n]), *(cell(summary.damage(n, f), "+.4f") for f in summary.formats)]
            for n in [WHOLE, *layers]]  # fmt: skip
    return markdown(["layer", "params", *summary.formats], rows)


def detail_table(summary: Summary) -> list[str]:
    """Every row with its gradients' agreement, sorted by damage."""
    rows = sorted(summary.rows, key=lambda r: r["damage"], reverse=True)
    body = [[r["layer"], r["format"], cell(r["damage"], "+.4f"), cell(r["damage_se"], ".4f"),
             cell(r["weight_grad_cos"], ".4f"), cell(r["weight_grad_rel_err"], ".3f"),
             cell(r["input_grad_cos"], ".4f"), cell(r["input_grad_rel_err"], ".3f")] for r in rows]  # fmt: skip
    header = ["layer", "format", "damage", "+-", "dW cos", "dW rel err", "dx cos", "dx rel err"]
    return markdown(header, body)


def describe(summary: Summary) -> list[str]:
    recipe = ", ".join(k for k, v in summary.recipe.items() if v is True) or "none (nearest rounding, 1D blocks)"
    return [
        f"Run: {summary.run} (checkpoint of step {summary.step}); reference: precision={summary.precision} "
        f"with every Linear layer high, loss {summary.reference_loss:.4f} on {summary.batches} validation batches.",
        "Damage: the loss increase when the layer alone computes in the format (its forward GEMM changes the "
        "loss); +-: its standard error over the batches (damages closer than that are not ranked); dW, dx: cosine "
        "and relative error of the layer's weight and input gradients with its three GEMMs in the format.",
        f"Recipe: {recipe}. {WHOLE}: every layer precision=<format> would quantize.",
    ]


def heatmap(summary: Summary, title: str) -> Any:
    """The Figure: a row per layer (the whole model first), a column per format, coloured by damage."""
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure

    layers = summary.layers()
    values = np.array([[summary.damage(n, f) for f in summary.formats] for n in layers])
    top = float(np.nanmax(np.abs(values))) if values.size else 1.0
    norm = Normalize(-top or -1.0, top or 1.0)  # 0 white: a layer that helps is blue, one that hurts red
    fig = Figure(figsize=(2.0 + 1.2 * len(summary.formats), min(2.0 + 0.3 * len(layers), 60.0)), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    image = ax.imshow(values, cmap=colormaps["RdBu_r"], norm=norm, aspect="auto")
    for i, row in enumerate(values):
        for j, value in enumerate(row):
            strong = math.isfinite(value) and abs(value) > 0.6 * top
            ax.text(j, i, f"{value:+.4f}", ha="center", va="center", fontsize=7, color="white" if strong else "black")
    ax.axhline(0.5, color="black", linewidth=1)  # the whole model's row apart from the layers'
    ax.set_xticks(range(len(summary.formats)), summary.formats)
    ax.set_yticks(range(len(layers)), layers, fontsize=8)
    ax.set_title(textwrap.fill(title, 70), fontsize="medium")
    fig.colorbar(image, ax=ax, label=DAMAGE_LABEL)
    return fig


def write(summary: Summary, out: Path, extra: list[str]) -> list[Path]:
    """sensitivity.json, .md (with `extra` lines: the suggested rules) and .png into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "sensitivity.json", out / "sensitivity.md", out / "sensitivity.png"]
    paths[0].write_text(json.dumps(summary.__dict__, indent=1) + "\n")
    text = ["# Format sensitivity", "", *describe(summary), "", *damage_table(summary), "", *extra, "",
            "## Every layer and format", "", *detail_table(summary)]  # fmt: skip
    paths[1].write_text("\n".join(text) + "\n")
    heatmap(summary, f"{Path(summary.run).name}: {DAMAGE_LABEL}").savefig(paths[2], dpi=100)
    return paths
