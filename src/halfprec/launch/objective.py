"""What a job returns to a sweeper (Optuna): the `objective` metric of the run's task, and for a
run that diverged the worst value in the direction the sweeper optimizes. A diverged trial is a
result for a search (that region of the space is bad), not a failure that stops it; sweep.jsonl
still records it as diverged (halfprec.launch.sweep).
"""

from __future__ import annotations

import math
from typing import Any

from omegaconf import DictConfig, OmegaConf


def objective_metric(cfg: DictConfig) -> Any:
    """The task's Metric that `objective` names (null: the task's own default, val/acc for
    classification, val/loss for lm). config/rules.py has checked that the task reports it."""
    from halfprec.components.tasks import TASKS

    task = TASKS[cfg.task.name]
    return task.metric(cfg.objective or task.objective)


def direction(objective: str | None, task: str) -> str:
    """`maximize` or `minimize`: the resolver `${halfprec.direction:${objective},${task.name}}`
    that conf/hparams_search/optuna.yaml gives the sweeper, so val/loss is minimized, val/acc maximized."""
    from halfprec.components.tasks import TASKS

    metric = TASKS[task].metric(objective or TASKS[task].objective) if task in TASKS else None
    if metric is None:  # validate() names the bad key when the job starts
        return "minimize"
    return "maximize" if metric.higher_is_better else "minimize"


def register_resolvers() -> None:
    """Before Hydra composes the config (train.py)."""
    OmegaConf.register_new_resolver("halfprec.direction", direction, replace=True)


def sweep_value(cfg: DictConfig, summary: dict | None) -> float:
    """The run's objective; for a run that diverged (summary None), the worst value for the way the
    sweeper optimizes: -inf when it maximizes, +inf when it minimizes."""
    name = objective_metric(cfg).name
    if summary is not None:
        return summary.get(name, math.nan)  # val/bpb of a token file whose bytes per token are unknown
    from hydra.core.hydra_config import HydraConfig

    optimizes = HydraConfig.get().sweeper.get("direction") or direction(name, cfg.task.name)
    return -math.inf if optimizes == "maximize" else math.inf
