"""What a job returns to a sweeper (Optuna): the `objective` metric of the run's task, and for a
run that diverged the worst value in the direction the sweeper optimizes. A diverged trial is a
result for a search (that region of the space is bad), not a failure that stops it; sweep.jsonl
still records it as diverged (halfprec.launch.sweep).
"""

from __future__ import annotations

import math


def sweep_value(task: str, objective: str | None, summary: dict) -> float:
    """The run's objective (`objective` of `task`: config/rules.py has checked that the task reports
    it) from its summary; for a run that diverged, the worst value for the way the sweeper optimizes:
    -inf when it maximizes, +inf when it minimizes."""
    from halfprec.components.tasks import task_metric  # torch: only once a run has ended

    metric = task_metric(task, objective)
    assert metric is not None  # validate() checked the objective against the task's metrics
    if summary.get("status") != "diverged":
        return summary.get(metric.name, math.nan)  # val/bpb of a token file whose bytes per token are unknown
    from hydra.core.hydra_config import HydraConfig

    from halfprec.config.resolvers import direction

    optimizes = HydraConfig.get().sweeper.get("direction") or direction(metric.name, task)
    return -math.inf if optimizes == "maximize" else math.inf
