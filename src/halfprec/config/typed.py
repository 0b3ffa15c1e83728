"""The composed config, once valid, as the typed objects the code reads (schema.Config): `typed(cfg)`
after validate(); `compose(overrides)` for a script, as train.py would compose, validate and type it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from halfprec.config import schema
from halfprec.config.resolvers import register_resolvers
from halfprec.config.validate import validate, validate_optimizer
from halfprec.spec import Choice

CONF = Path(__file__).resolve().parents[3] / "conf"  # the checkout's (halfprec is installed editable from it)

# the key that names each component's choice; the group's other keys are its arguments
CHOSEN_BY = {"task": "name", "init": "scheme", "model": "arch", "data": "name", "scaler": "kind"}
VARIANTS = {"sched": ("name", schema.SCHEDULES)}


def typed(cfg: DictConfig) -> schema.Config:
    """The validated `cfg` as a schema.Config (validate(cfg) first: this checks nothing)."""
    return from_tree(OmegaConf.to_container(cfg, resolve=True))  # type: ignore[arg-type]


def from_tree(tree: dict[str, Any]) -> schema.Config:
    """A resolved config tree (composed, or saved: config/saved.py) as a schema.Config."""
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
    """precision.*'s keys as the typed Precision: its recipe a numerics/quantized.Recipe, its
    attention a numerics/attention.AttentionRecipe, its rules QuantRules, its schedule Phases."""
    from halfprec.numerics.attention import AttentionRecipe
    from halfprec.numerics.quantized import Recipe  # imports torch, as a run does anyway

    rules = [schema.QuantRule(**rule) for rule in node["rules"]]
    schedule = [schema.Phase(**phase) for phase in node["schedule"]]
    nested: dict[str, Any] = {"recipe": Recipe(**node["recipe"]), "attention": AttentionRecipe(**node["attention"])}
    return schema.Precision(**{**node, **nested, "rules": rules, "schedule": schedule})


def fail_fast_of(cfg: DictConfig) -> bool:
    """Whether a sweep stops at its first failed job (a Hydra callback's job config: a job that failed
    validation has no typed config, and its fail_fast may be anything)."""
    return bool(cfg.get("fail_fast"))


def as_config(cfg: DictConfig | schema.Config) -> schema.Config:
    """A run's entry points (run, build) take either: a Config as it is, a composed one typed."""
    return cfg if isinstance(cfg, schema.Config) else typed(cfg)


def checked(cfg: DictConfig) -> schema.Config:
    """`cfg` validated (the schemas and rules, then the optimizer's arguments) and typed."""
    validate(cfg)
    validate_optimizer(cfg)
    return typed(cfg)


def compose(overrides: Sequence[str] = (), conf: Path = CONF) -> schema.Config:
    """`python train.py <overrides>`'s config, validated and typed: a benchmark's or a notebook's."""
    from hydra import compose as compose_tree
    from hydra import initialize_config_dir

    register_resolvers()
    with initialize_config_dir(str(conf), version_base="1.3"):
        return checked(compose_tree("train", overrides=list(overrides)))
