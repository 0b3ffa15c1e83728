"""A job's value of a metric, from its rows (the last, the smallest, the largest, the steady median)
or its summary, as a RunMetric (halfprec/metrics.py) says; and a step as the report prints it."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

from halfprec.metrics import RunMetric


def final(rows: list[dict], key: str) -> Any:
    """The key's last logged value; None if it was never logged."""
    values = [row[key] for row in rows if key in row]
    return values[-1] if values else None


def smallest(rows: list[dict], key: str) -> float | None:
    values = [row[key] for row in rows if key in row and math.isfinite(row[key])]
    return min(values) if values else None


def largest(rows: list[dict], key: str) -> float | None:
    """The largest value logged; inf where a logged value was not finite (metrics.jsonl's null)."""
    values = [row[key] for row in rows if key in row]
    if any(v is None or not math.isfinite(v) for v in values):
        return math.inf
    return max(values) if values else None


def steady_median(rows: list[dict], key: str) -> float | None:
    """Median of a perf/ metric over the rows, leaving out the step-1 row (warm-up) when there are others."""
    timed = [row for row in rows if key in row]
    steady = [row for row in timed if row["step"] != 1] or timed
    values = [row[key] for row in steady if math.isfinite(row[key])]
    return statistics.median(values) if values else None


def step_text(step: float) -> str:
    return str(int(step)) if float(step).is_integer() else f"{step:g}"


# RunMetric.reduce: which of the logged values is the run's
READERS: dict[str, Callable[[list[dict], str], Any]] = {
    "last": final,
    "min": smallest,
    "max": largest,
    "steady median": steady_median,
}


def run_value(metric: RunMetric, rows: list[dict], summary: dict[str, Any]) -> Any:
    """The job's value of a run-level metric; None if it never logged it."""
    if metric.summary_first and metric.summary in summary:  # a finished run's exact value
        return summary[metric.summary]
    return READERS[metric.reduce](rows, metric.key)
