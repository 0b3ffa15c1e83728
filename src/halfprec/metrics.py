"""The metric names the tools read, in one place (docs/design.md, "Metrics"): what a task's
metrics are (`Metric`; each task lists its own on its class), train/loss and val/loss (every
task's), and RUN_METRICS, the values of a run that do not depend on its task (loss scale,
throughput, diagnostics). The objective (launch/objective.py, config/rules.py), sweep.jsonl
(`recorded`) and `halfprec report`'s columns all read them, so that a new task lists its metrics
on its class and a new run-level value (another diagnostic's peak, another perf/ number) is one
RunMetric line here. training/ writes the names; this module only says how they are read.

No torch (import-linter checks it): sweep.jsonl's callback and the report import it before, or
without, torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class Metric:
    """A metric a task reports. `higher_is_better` decides which way a sweeper optimizes it and
    which value a diverged trial gets (the worst); `fmt` is how `halfprec report` prints it, and
    `column` whether the report's tables show it."""

    name: str
    higher_is_better: bool = False
    fmt: str = ".4f"
    column: bool = True


TRAIN_LOSS = Metric("train/loss")  # every task's: the mean loss of the last logged window
VAL_LOSS = Metric("val/loss")  # every task's evaluator reports it; a run whose last one is not finite diverged

# Which of a key's logged values is the run's: the last, the smallest, the largest (inf where one was
# not finite), or the median without the step-1 row (warm-up) when there are others.
Reduce = Literal["last", "min", "max", "steady median"]


@dataclass(frozen=True)
class RunMetric:
    """A value of a run whatever its task: a column of `halfprec report`'s tables, named `column`,
    read from the metrics.jsonl key `key` as `reduce` says and printed with `fmt` (`spread_fmt` for a
    group's mean ± std). `optional`: a column only where some job logged it (a setting logs it).
    `summary`: summary.json's key for it, which sweep.jsonl records; `summary_first`: the report
    takes the value from there when a run has it, before the rows (logged every few steps, they
    may miss it)."""

    column: str
    key: str
    reduce: Reduce
    fmt: str
    spread_fmt: str | None = None
    optional: bool = False
    summary: str | None = None
    summary_first: bool = False


# In the report's column order, after train/loss and the tasks' val/* metrics. Counts and scales that
# are powers of two print whole and exact; a group's mean of them is not whole (spread_fmt).
RUN_METRICS = (
    RunMetric("skipped steps", "scaler/skipped_steps", "last", ".10g", ".6g", summary="scaler/skipped_steps"),
    RunMetric("min scale", "scaler/scale", "min", ".10g", ".6g", summary="scaler/min_scale", summary_first=True),
    RunMetric("final scale", "scaler/scale", "last", ".10g", ".6g", summary="scaler/final_scale"),
    RunMetric("samples/s", "perf/samples_per_s", "steady median", ".0f"),
    RunMetric("tokens/s", "perf/tokens_per_s", "steady median", ".0f", optional=True),  # task=lm's throughput
    RunMetric("MFU", "perf/mfu", "steady median", ".3f"),  # GPUs in halfprec/training/perf.py's table only
    # diagnostics=grads on a transformer: the growth Wortsman et al. watch
    RunMetric("peak attn logit", "diag/attn_logit_max", "max", ".4g", optional=True),
)


def recorded(summary: dict[str, Any]) -> dict[str, Any]:
    """What sweep.jsonl records of a job's summary.json: train/loss, the RUN_METRICS that have a
    summary key (null where the run has none), then every val/* value the summary holds."""
    keys = (TRAIN_LOSS.name, *(metric.summary for metric in RUN_METRICS if metric.summary is not None))
    return {**{key: summary.get(key) for key in keys}, **{k: v for k, v in summary.items() if k.startswith("val/")}}
