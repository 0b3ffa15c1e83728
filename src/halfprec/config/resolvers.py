"""Every resolver halfprec's config uses, registered by `register_resolvers()` wherever a config is
composed (train.py, config.compose, the tests' compose helpers, scripts/config_reference.py):
`${div:...}` (conf/experiment/accumulation.yaml), `${halfprec.direction:...}`
(conf/hparams_search/optuna.yaml) and `${halfprec.dirname:...}` (conf/hydra/default.yaml's job dirs).

Hydra hands registered resolvers on to the jobs its launchers start in other processes (submitit, joblib)."""

from __future__ import annotations

import hashlib

from omegaconf import OmegaConf

DIRNAME_MAX = 128  # a job dir's name after its number; file systems allow 255 bytes


def div(a: int, b: int) -> int:
    """`${div:256,${accum}}`: a micro-batch that keeps the effective batch fixed across accum."""
    return int(a) // int(b)


def dirname(overrides: str) -> str:
    """A job dir's name from its overrides (Hydra's override_dirname): as it is when it is short,
    else its start and a hash of the whole, so that a sweep over long values (precision.rules
    lists) still gets a dir per job and distinct names; .hydra/overrides.yaml keeps them whole."""
    if len(overrides.encode()) <= DIRNAME_MAX:
        return overrides
    digest = hashlib.sha1(overrides.encode()).hexdigest()[:8]
    return overrides.encode()[: DIRNAME_MAX - 9].decode(errors="ignore") + "~" + digest


def direction(objective: str | None, task: str) -> str:
    """`${halfprec.direction:${objective},${task.name}}`: what conf/hparams_search/optuna.yaml's sweeper
    does with the objective, `maximize` (val/acc) or `minimize` (val/loss)."""
    from halfprec.components.tasks import task_metric  # torch: only when the sweeper asks

    metric = task_metric(task, objective)
    return "maximize" if metric is not None and metric.higher_is_better else "minimize"


def register_resolvers() -> None:
    """Before composing: a resolver is looked up when its value is read, which may be much later."""
    OmegaConf.register_new_resolver("div", div, replace=True)
    OmegaConf.register_new_resolver("halfprec.direction", direction, replace=True)
    OmegaConf.register_new_resolver("halfprec.dirname", dirname, replace=True)
