"""The report's metric columns and a job's values in them, from the one list of metric names
(halfprec/metrics.py): train/loss, the val/* metrics the registered tasks show, val/loss in each
evaluation precision a job logged (precision.eval: val/loss@<entry>), then the run-level
RUN_METRICS; each with how its values print. "-" is a value never logged, "nan" one logged as null
(metrics.jsonl writes inf and NaN as null).

The tasks package imports torch: it is imported once the tables are made, not with the report."""

from __future__ import annotations

import functools
from typing import Any

from halfprec.metrics import RUN_METRICS, TRAIN_LOSS, VAL_LOSS
from halfprec.tools.report.values import final, run_value


@functools.cache
def val_formats() -> dict[str, str]:
    """The val/* columns: the metrics each registered task says its tables show, in its format
    (components/tasks: a new task's metrics get columns of their own)."""
    from halfprec.components.tasks import TASKS

    return {m.name: m.fmt for task in TASKS.values() for m in task.metrics if m.column}


@functools.cache
def metric_formats() -> dict[str, str]:
    """Every metric column, in table order, with how its values print."""
    return {TRAIN_LOSS.name: TRAIN_LOSS.fmt, **val_formats(), **{m.column: m.fmt for m in RUN_METRICS}}


@functools.cache
def spread_formats() -> dict[str, str]:
    """The columns whose group mean ± std prints otherwise than their values: a mean of counts or
    powers of two is not whole."""
    return {m.column: m.spread_fmt for m in RUN_METRICS if m.spread_fmt is not None}


@functools.cache
def optional_columns() -> tuple[str, ...]:
    """Columns a setting logs, shown only where some job logged them: the optional RUN_METRICS
    (tokens/s: task=lm; the attention logits: a transformer with diagnostics=grads), and every val/*
    column but val/loss, which every task reports."""
    return (*(m.column for m in RUN_METRICS if m.optional), *(name for name in val_formats() if name != VAL_LOSS.name))


EVAL_LOSS = VAL_LOSS.name + "@"  # numerics/evaluation.eval_key's val/loss in an evaluation precision


def eval_losses(rows: list[dict]) -> list[str]:
    """The val/loss@<entry> keys a job logged (precision.eval), in the order it logged them."""
    return list(dict.fromkeys(key for row in rows for key in row if key.startswith(EVAL_LOSS)))


def column_format(column: str) -> str | None:
    """How a metric column's values print; None for a column that is not a metric (an override)."""
    if column.startswith(EVAL_LOSS):
        return VAL_LOSS.fmt
    return metric_formats().get(column)


def job_metrics(rows: list[dict], summary: dict[str, Any]) -> dict[str, Any]:
    """The table's metric columns for one job (keys as in metric_formats(), and its val/loss@<entry>)."""
    return {
        TRAIN_LOSS.name: final(rows, TRAIN_LOSS.name),
        **{name: final(rows, name) for name in val_formats()},
        **{key: final(rows, key) for key in eval_losses(rows)},
        **{metric.column: run_value(metric, rows, summary) for metric in RUN_METRICS},
    }


def metric_columns(logged: list[dict[str, Any]]) -> list[str]:
    """The metric columns, less the optional ones that no job logged (`logged`: job_metrics of each),
    with the val/loss@<entry> columns any job logged after the tasks' val/* ones."""
    optional = optional_columns()
    shown = [c for c in metric_formats() if c not in optional or any(m[c] is not None for m in logged)]
    evals = list(dict.fromkeys(key for m in logged for key in m if key.startswith(EVAL_LOSS)))
    at = max((i + 1 for i, c in enumerate(shown) if c in val_formats()), default=len(shown))
    return [*shown[:at], *evals, *shown[at:]]
