"""From measured damage to a `precision.rules` list: the most sensitive layers stay high, within a
budget of layers or of parameters (`--keep`, `--keep-by`)."""

from __future__ import annotations

from collections.abc import Callable

from halfprec.numerics.settings import HIGH
from halfprec.tools.sensitivity.measure import WHOLE, Measured, Row


def ranked(measured: Measured, fmt: str) -> list[Row]:
    """The layers precision=<fmt> would quantize, most damaged first (ties: the larger weight-gradient
    error first; an attention core has none); the output head and other layers the plan keeps high
    are not candidates."""
    planned = measured.plans[fmt]
    rows = [r for r in measured.rows if r.format == fmt and r.layer != WHOLE and planned.get(r.layer) != HIGH]
    return sorted(rows, key=lambda r: (measured.damage(r), r.weight_grad.rel_err if r.weight_grad else 0.0),
                  reverse=True)  # fmt: skip


def keep_high(candidates: list[Row], keep: float, by: str, significant: Callable[[Row], bool]) -> list[Row]:
    """The first of `candidates` whose damage is `significant` that fit in the budget: `keep` of
    the candidates' number (rounded down), or of their parameters (by="params": in rank order,
    skipping a layer that would overflow it; an attention core has none, so it always fits). A
    damage within its noise makes no rule."""
    if by == "layers":
        return [r for r in candidates if significant(r)][: int(keep * len(candidates) + 1e-9)]
    chosen: list[Row] = []
    budget, used = keep * sum(r.params for r in candidates), 0.0
    for row in candidates:
        if significant(row) and used + row.params <= budget:
            chosen.append(row)
            used += row.params
    return chosen


def rules_list(layers: list[str]) -> str:
    """Rules that keep `layers` high, as Hydra's command line writes a list; each name quoted, since
    Hydra would read an nn.Sequential's "3" as a number."""
    return "[" + ", ".join(f'{{match: "{name}", format: {HIGH}}}' for name in layers) + "]"


def rules_override(layers: list[str]) -> str:
    """The rules as a train.py override, quoted for a POSIX shell (layer names hold no quote)."""
    return f"'precision.rules={rules_list(layers)}'"


def suggested_override(rows: list[Row], fmt: str) -> str:
    """The rules keeping `rows` high as train.py takes them; with an attention core among them, beside
    precision.attention.format=`fmt`, without which a rule naming a core is a config error."""
    rules = rules_override([r.layer for r in rows])
    return f"{rules} precision.attention.format={fmt}" if any(r.core for r in rows) else rules
