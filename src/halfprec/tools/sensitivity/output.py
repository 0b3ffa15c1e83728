"""What `halfprec sensitivity` writes: sensitivity.md (the tables), sensitivity.json (every number,
for `halfprec report` and scripts) and sensitivity.png (the damage of each layer in each format)."""

from __future__ import annotations

import json
import math
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from halfprec.numerics.layers import PARTIAL_SWITCHES
from halfprec.numerics.settings import HIGH
from halfprec.tools.sensitivity.measure import SIGNIFICANT, WHOLE, Measured, Row, SensitivityError

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

    def row(self, layer: str, fmt: str) -> dict[str, Any]:
        return next(r for r in self.rows if r["layer"] == layer and r["format"] == fmt)

    def damage(self, layer: str, fmt: str) -> float:
        return self.row(layer, fmt)["damage"]

    def candidate(self, layer: str) -> bool:
        """Whether a plan quantizes the layer (the output head: not); files from before the flag: all."""
        return layer != WHOLE and self.row(layer, self.formats[0]).get("candidate", True)

    def layers(self) -> list[str]:
        """The model's Linear layers (and attention cores, where measured) in model order, WHOLE first."""
        return [WHOLE, *dict.fromkeys(r["layer"] for r in self.rows if r["layer"] != WHOLE)]

    def cores(self) -> list[str]:
        """The attention cores measured (files from before them: none)."""
        return [n for n in self.layers()[1:] if self.row(n, self.formats[0]).get("core", False)]


def row_record(measured: Measured, row: Row) -> dict[str, Any]:
    dx, dw = row.input_grad, row.weight_grad
    return {
        "layer": row.layer,
        "format": row.format,
        "params": row.params,
        # a layer precision=<format> quantizes (not the output head); the whole model's row is neither
        "candidate": row.layer != WHOLE and measured.plans[row.format].get(row.layer) != HIGH,
        "damage": measured.damage(row),
        "damage_se": measured.damage_se(row),
        "significant": measured.significant(row),
        "weight_grad_cos": None if dw is None else dw.cosine,  # an attention core: no weight
        "weight_grad_rel_err": None if dw is None else dw.rel_err,
        "input_grad_cos": None if dx is None else dx.cosine,
        "input_grad_rel_err": None if dx is None else dx.rel_err,
        "core": row.core,
    }


def cell(value: float | None, fmt: str, none: str = "-") -> str:
    return none if value is None else format(value, fmt)


def markdown(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def damage_cell(record: dict[str, Any]) -> str:
    """A loss increase, starred when it exceeds its noise (SIGNIFICANT standard errors)."""
    return cell(record["damage"], "+.4f") + ("*" if record.get("significant") else "")


def layer_label(summary: Summary, layer: str) -> str:
    return layer if layer == WHOLE or summary.candidate(layer) else f"{layer} (high)"


def damage_table(summary: Summary) -> list[str]:
    """Layers x formats, the loss increase in each cell, most damaged first by the first format;
    the layers a plan keeps high (the output head) last."""
    first = summary.formats[0]
    layers = sorted(summary.layers()[1:], key=lambda n: (summary.candidate(n), summary.damage(n, first)), reverse=True)
    params = {r["layer"]: r["params"] for r in summary.rows if r["format"] == first}
    rows = [[layer_label(summary, n), str(params[n]), *(damage_cell(summary.row(n, f)) for f in summary.formats)]
            for n in [WHOLE, *layers]]  # fmt: skip
    return markdown(["layer", "params", *summary.formats], rows)


def detail_table(summary: Summary) -> list[str]:
    """Every row with its gradients' agreement, sorted by damage."""
    rows = sorted(summary.rows, key=lambda r: r["damage"], reverse=True)
    na = {True: "n/a", False: "-"}  # an attention core has no weight; a first layer no input gradient
    body = [[r["layer"], r["format"], damage_cell(r), cell(r["damage_se"], ".4f"),
             cell(r["weight_grad_cos"], ".4f", na[r.get("core", False)]),
             cell(r["weight_grad_rel_err"], ".3f", na[r.get("core", False)]),
             cell(r["input_grad_cos"], ".4f"), cell(r["input_grad_rel_err"], ".3f")] for r in rows]  # fmt: skip
    header = ["layer", "format", "damage", "+-", "dW cos", "dW rel err", "dx cos", "dx rel err"]
    return markdown(header, body)


def recipe_text(recipe: dict[str, Any], formats: list[str]) -> str:
    """The recipe's switches, each with the measured formats it reaches where not all (weight_2d)."""
    parts = []
    for switch in (k for k, v in recipe.items() if v is True):
        partial = PARTIAL_SWITCHES.get(switch)
        reached = [f for f in formats if partial is None or partial[0](f, recipe.get("grad_format") or f)]
        only = ", ".join(reached) or "none of these formats"
        parts.append(switch if reached == formats else f"{switch} (for {only})")
    return ", ".join(parts) or "none (nearest rounding, 1D blocks)"


def describe(summary: Summary) -> list[str]:
    cores = summary.cores()
    attention = (
        f" Attention cores ({len(cores)}, e.g. {cores[0]}): their six GEMMs in the format, no weight (dW n/a, 0 "
        "params), dx over their queries, keys and values; the reference computes them in torch's fused attention; "
        "rules naming them need precision.attention.format."
        if cores
        else ""
    )
    return [
        f"Run: {summary.run} (checkpoint of step {summary.step}); reference: precision={summary.precision} "
        f"with every Linear layer high, loss {summary.reference_loss:.4f} on {summary.batches} validation batches.",
        "Damage: the loss increase when the layer alone computes in the format (its forward GEMM changes the "
        f"loss); *: more than {SIGNIFICANT:g} standard errors over the batches (the others are within noise and "
        "are not ranked or suggested); dW, dx: cosine and relative error of the layer's weight and input gradients "
        f"with its three GEMMs in the format.{attention}",
        f"Recipe: {recipe_text(summary.recipe, summary.formats)}. {WHOLE}: every layer precision=<format>"
        f"{' precision.attention.format=<format>' if cores else ''} would quantize; (high): a layer it keeps high "
        "(the output head), measured alone for reference.",
    ]


def heatmap(summary: Summary, title: str) -> Any:
    """The Figure: a row per layer (the whole model first), a column per format, coloured by damage
    on a scale the candidate layers set (the whole model's row saturates; the layers a plan keeps
    high are grey, their numbers shown, so that the head's damage does not wash the others out)."""
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure

    layers = summary.layers()
    values = np.array([[summary.damage(n, f) for f in summary.formats] for n in layers], dtype=float)
    shown = np.array([[n == WHOLE or summary.candidate(n)] * len(summary.formats) for n in layers])
    scale = np.abs(values[1:][shown[1:]])
    top = float(np.nanmax(scale)) if scale.size and np.isfinite(scale).any() else 1.0
    norm = Normalize(-top or -1.0, top or 1.0)  # 0 white: a layer that helps is blue, one that hurts red
    cmap = colormaps["RdBu_r"].with_extremes(bad="0.85")
    fig = Figure(figsize=(2.0 + 1.2 * len(summary.formats), min(2.0 + 0.3 * len(layers), 60.0)), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    image = ax.imshow(np.where(shown, values, np.nan), cmap=cmap, norm=norm, aspect="auto")
    for i, n in enumerate(layers):
        for j, f in enumerate(summary.formats):
            value, record = values[i, j], summary.row(n, f)
            strong = shown[i, j] and math.isfinite(value) and abs(value) > 0.6 * top
            ax.text(j, i, damage_cell(record), ha="center", va="center", fontsize=7,
                    color="white" if strong else "black")  # fmt: skip
    ax.axhline(0.5, color="black", linewidth=1)  # the whole model's row apart from the layers'
    ax.set_xticks(range(len(summary.formats)), summary.formats)
    ax.set_yticks(range(len(layers)), [layer_label(summary, n) for n in layers], fontsize=8)
    ax.set_title(textwrap.fill(title, 70), fontsize="medium")
    fig.colorbar(image, ax=ax, label=DAMAGE_LABEL, extend="both")
    return fig


def writable(out: Path, flag: str) -> None:
    """`out` is, or can be made, a directory this process can write into: checked before measuring."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".sensitivity-write-check"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        why = err.strerror or err
        raise SensitivityError(f"{flag} {out}: cannot write there ({why}); choose another dir") from None


def write(summary: Summary, out: Path, extra: list[str]) -> list[Path]:
    """sensitivity.json, .md (with `extra` lines: the suggested rules) and .png into `out`."""
    paths = [out / "sensitivity.json", out / "sensitivity.md", out / "sensitivity.png"]
    text = ["# Format sensitivity", "", *describe(summary), "", *damage_table(summary), "", *extra, "",
            "## Every layer and format", "", *detail_table(summary)]  # fmt: skip
    try:
        out.mkdir(parents=True, exist_ok=True)
        paths[0].write_text(json.dumps(summary.__dict__, indent=1) + "\n")
        paths[1].write_text("\n".join(text) + "\n")
        heatmap(summary, f"{Path(summary.run).name}: {DAMAGE_LABEL}").savefig(paths[2], dpi=100)
    except OSError as err:
        raise SensitivityError(f"{err.filename or out}: cannot write ({err.strerror or err})") from None
    return paths
