"""What a job returns to a sweeper (Optuna): the `objective` metric of the run's task, and for a
run that diverged the worst value in the direction the sweeper optimizes. A diverged trial is a
result for a search (that region of the space is bad), not a failure that stops it; sweep.jsonl
still records it as diverged (halfprec.launch.sweep).
"""

from __future__ import annotations

import math
from typing import Any


def task_metric(task: str, objective: str | None) -> Any:
    """The Metric of task `task` that `objective` names (null: the task's own default, val/acc for
    classification, val/loss for lm); None for an unknown task or name (validate() says which)."""
    from halfprec.components.tasks import TASKS

    return TASKS[task].metric(objective or TASKS[task].objective) if task in TASKS else None


def direction(objective: str | None, task: str) -> str:
    """`maximize` or `minimize`: the resolver `${halfprec.direction:${objective},${task.name}}`
    that conf/hparams_search/optuna.yaml gives the sweeper, so val/loss is minimized, val/acc maximized."""
    metric = task_metric(task, objective)
    return "maximize" if metric is not None and metric.higher_is_better else "minimize"


def sweep_value(task: str, objective: str | None, summary: dict) -> float:
    """The run's objective (`objective` of `task`: config/rules.py has checked that the task reports
    it) from its summary; for a run that diverged, the worst value for the way the sweeper optimizes:
    -inf when it maximizes, +inf when it minimizes."""
    metric = task_metric(task, objective)
    if summary.get("status") != "diverged":
        return summary.get(metric.name, math.nan)  # val/bpb of a token file whose bytes per token are unknown
    from hydra.core.hydra_config import HydraConfig

    optimizes = HydraConfig.get().sweeper.get("direction") or direction(metric.name, task)
    return -math.inf if optimizes == "maximize" else math.inf
