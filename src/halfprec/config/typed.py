"""The composed config, once valid, as the typed objects the code reads (schema.Config), and back:
`typed(cfg)` after validate(); `saved(config)`, the resolved config as W&B, checkpoints and the
resume check keep it (secrets redacted)."""

from __future__ import annotations

import os
import re
from dataclasses import asdict, fields, is_dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from halfprec.config import schema
from halfprec.spec import Choice

# the key that names each component's choice; the group's other keys are its arguments
CHOSEN_BY = {"task": "name", "init": "scheme", "model": "arch", "data": "name", "scaler": "kind"}
VARIANTS = {"sched": ("name", schema.SCHEDULES)}


def typed(cfg: DictConfig) -> schema.Config:
    """The validated `cfg` as a schema.Config (validate(cfg) first: this checks nothing)."""
    tree: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    groups: dict[str, Any] = {key: tree[key] for key in ("accum", "seed", "resume", "objective", "fail_fast")}
    for group in CHOSEN_BY:
        groups[group] = choice_of(group, tree[group])
    for group, (key, variants) in VARIANTS.items():
        groups[group] = variants[tree[group][key]](**tree[group])
    common = [f.name for f in fields(schema.Optim) if f.name != "args"]
    optim = tree["optim"]
    groups["optim"] = schema.Optim(
        **{k: optim[k] for k in common}, args={k: v for k, v in optim.items() if k not in common}
    )
    groups["precision"] = precision_of(tree["precision"])
    groups["trainer"] = schema.Trainer(**tree["trainer"])
    groups["diagnostics"] = schema.Diagnostics(**tree["diagnostics"])
    groups["logger"] = tree["logger"]
    return schema.Config(**groups)


def choice_of(group: str, node: dict[str, Any]) -> Choice:
    """A component group's keys (model, data, init, task) as its choice and its arguments."""
    args = dict(node)
    name = args.pop(CHOSEN_BY[group])
    if group == "data":
        return schema.Data(name=name, batch_size=args.pop("batch_size"), args=args)
    return Choice(name=name, args=args)


def precision_of(node: dict[str, Any]) -> schema.Precision:
    """precision.*'s keys as the typed Precision: its recipe a numerics/quantized.Recipe, its rules
    QuantRules, its schedule Phases."""
    from halfprec.numerics.quantized import Recipe  # imports torch, as a run does anyway

    rules = [schema.QuantRule(**rule) for rule in node["rules"]]
    schedule = [schema.Phase(**phase) for phase in node["schedule"]]
    return schema.Precision(**{**node, "recipe": Recipe(**node["recipe"]), "rules": rules, "schedule": schedule})


def objective_of(cfg: DictConfig) -> tuple[str, str | None]:
    """The task and the objective a sweeper is given back (train.py), from the composed config."""
    return cfg.task.name, cfg.objective


def fail_fast_of(cfg: DictConfig) -> bool:
    """Whether a sweep stops at its first failed job (a Hydra callback's job config: a job that failed
    validation has no typed config, and its fail_fast may be anything)."""
    return bool(cfg.get("fail_fast"))


def as_config(cfg: DictConfig | schema.Config) -> schema.Config:
    """A run's entry points (run, build) take either: a Config as it is, a composed one typed."""
    return cfg if isinstance(cfg, schema.Config) else typed(cfg)


def as_tree(config: schema.Config) -> dict[str, Any]:
    """The config as the composed tree it came from (typed's inverse), with what the run filled in
    since (trainer.threads, sched.total_steps)."""
    tree: dict[str, Any] = {}
    for f in fields(config):
        value = getattr(config, f.name)
        if f.name in CHOSEN_BY:
            extra = {"batch_size": value.batch_size} if f.name == "data" else {}
            value = {CHOSEN_BY[f.name]: value.name, **extra, **value.args}
        elif f.name == "optim":
            value = {k: v for k, v in asdict(value).items() if k != "args"} | value.args
        elif is_dataclass(value) and not isinstance(value, type):
            value = asdict(value)
        if f.name == "precision":
            value["schedule"] = [given(phase) for phase in config.precision.schedule]
        tree[f.name] = value
    return tree


def given(phase: schema.Phase) -> dict[str, Any]:
    """A schedule phase as a config writes it: the keys away from their defaults (a phase names one
    start and what it changes; gemms defaults to all three)."""
    default = schema.Phase(format=phase.format)
    return {k: v for k, v in asdict(phase).items() if k == "format" or v != getattr(default, k)}


SECRET_KEY = re.compile(r"(api_?key|token|secret|password)", re.IGNORECASE)
URL_PASSWORD = re.compile(r"(://[^/@\s:]*:)[^/@\s]+@")  # scheme://user:password@host (an MLflow store's URI)


def redact(tree: Any) -> Any:
    """The config as saved to W&B and checkpoints: values under secret-looking keys, and any value
    equal to $WANDB_API_KEY (e.g. interpolated by ${oc.env:...}), become '***'; so does the password
    of a URL (logger.mlflow.tracking_uri from $MLFLOW_TRACKING_URI)."""
    key = os.environ.get("WANDB_API_KEY")
    if isinstance(tree, dict):
        return {k: "***" if SECRET_KEY.search(str(k)) else redact(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [redact(v) for v in tree]
    if not isinstance(tree, str):
        return tree
    return "***" if key and key in tree else URL_PASSWORD.sub(r"\1***@", tree)


def saved(config: schema.Config) -> dict:
    """The resolved config as it is written to W&B, to other loggers and into checkpoints: redacted."""
    return redact(as_tree(config))
