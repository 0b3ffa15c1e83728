"""Validation of the composed config, before anything heavy is built: the schemas (types, ranges,
allowed values: config/schema.py and the components' annotated arguments), then the rules that span
keys (config/rules.py). Every error is one line naming the key, the value and what would work.

Hydra rejects unknown group options and keys that are not in the composed config; `+key=value`
adds any key, so unknown keys are checked here too.
"""

from __future__ import annotations

import importlib.util
import inspect
from dataclasses import fields
from typing import Annotated, Any, Literal, get_type_hints

from omegaconf import DictConfig, OmegaConf

from halfprec.config import rules, schema
from halfprec.errors import ConfigError
from halfprec.numerics.scaling import SCALERS  # torch-free, unlike the components' registries
from halfprec.spec import Spec, check_node, check_value, known_keys

# the keys every optim config has (schema.Optim's), beside the optimizer's own arguments
OPTIM_KEYS = tuple(f.name for f in fields(schema.Optim) if f.name != "args")
BATCH_SIZE = Annotated[int, Spec(low=1, doc="the micro-batch size; effective batch = batch_size * accum")]
RULE_KEYS = {f.name for f in fields(schema.QuantRule)}  # match and format; accumulate optional
SCALAR_LR_SCALE = Annotated[float | None, Spec(above=0, doc="lr multiplier of Fixup's scalar biases")]


def validate(cfg: DictConfig) -> None:
    """Raise ConfigError on the first value that cannot work."""
    check_node(cfg, schema.Top, "", "the top level")
    check_node(cfg.precision, schema.Precision, "precision", "precision")
    check_quantization(cfg.precision)
    kind = chosen(cfg, "scaler.kind", SCALERS, "the loss scalers of halfprec/numerics/scaling.py")
    check_node(cfg.scaler, SCALERS[kind], "scaler", f"scaler.kind={kind}", extra=("kind",))
    check_variant(cfg.sched, "sched", "name", schema.SCHEDULES)
    check_loggers(cfg.logger)
    check_node(cfg.trainer, schema.Trainer, "trainer", "trainer")
    check_node(cfg.diagnostics, schema.Diagnostics, "diagnostics", "diagnostics")
    optim = get_type_hints(schema.Optim, include_extras=True)
    for key in OPTIM_KEYS:  # the optimizer's own: validate_optimizer
        check_value(f"optim.{key}", cfg.optim.get(key), optim[key])
    rules.check_precision(cfg.precision, cfg.trainer.distributed)
    rules.check_scaler(cfg.scaler)
    rules.check_launch(cfg.trainer.distributed)
    rules.check_diagnostics(cfg.diagnostics)
    rules.check_schedule(cfg.precision, cfg.diagnostics.every, cfg.trainer.max_steps)
    # the components come last: their schemas are the arguments of registered factories, which
    # imports torch; every error above answers without it
    validate_components(cfg)


def check_recipe(p: DictConfig) -> None:
    """precision.recipe against its dataclass, numerics/quantized.Recipe (which imports torch)."""
    from halfprec.numerics.quantized import Recipe

    if not isinstance(p.recipe, DictConfig):  # precision.recipe=nvfp4: a recipe is the option's, not a name
        keys = ", ".join(f.name for f in fields(Recipe))
        raise ConfigError(
            "precision.recipe", p.recipe, f"a mapping of {keys}, set one at a time (precision.recipe.hadamard=true); "
            "a format's own recipe comes with its option: precision=nvfp4 is nvfp4 with its recipe",
        )  # fmt: skip
    check_node(p.recipe, Recipe, "precision.recipe", "precision.recipe")


def check_accumulate(p: DictConfig) -> None:
    """precision.accumulate, the recipe's per-GEMM choices, the rules' and attention's: presets of
    numerics/accumulate.py, for the emulated layers (the native kernel sums as its GPU does)."""
    from halfprec.numerics.accumulate import EXACT, preset

    chosen = {"precision.accumulate": p.accumulate}
    for g in ("forward", "dgrad", "wgrad"):
        chosen[f"precision.recipe.{g}_accumulate"] = p.recipe.get(f"{g}_accumulate")
    for g in ("forward", "backward"):
        chosen[f"precision.attention.{g}_accumulate"] = p.attention.get(f"{g}_accumulate")
        if p.attention.get(f"{g}_accumulate") is not None and not p.attention.format:
            raise ConfigError(f"precision.attention.{g}_accumulate", p.attention[f"{g}_accumulate"], "sums quantized "
                              "attention's GEMMs: set precision.attention.format too")  # fmt: skip
    for i, rule in enumerate(p.rules):
        chosen[f"precision.rules[{i}].accumulate"] = rule.get("accumulate")
        if rule.get("accumulate") is not None and rule.format == "high" and not p.schedule:
            raise ConfigError(f"precision.rules[{i}].accumulate", rule.accumulate, "sums quantized layers' GEMMs, and "
                              "this rule keeps its layers high: drop it, or give the rule a format")  # fmt: skip
    for key, name in chosen.items():
        if name is not None:
            preset(name, key)
            if name != EXACT and p.kernel != "emulated":
                fix = "models the emulated layers' sums: add precision.kernel=emulated (native sums as its GPU does)"
                raise ConfigError(key, name, fix)


def check_attention(p: DictConfig) -> None:
    """precision.attention against its dataclass, numerics/attention.AttentionRecipe (imports torch)."""
    from halfprec.numerics.attention import AttentionRecipe

    if not isinstance(p.attention, DictConfig):  # precision.attention=mxfp8: its format is a key of it
        raise ConfigError(
            "precision.attention", p.attention, "a mapping of format, forward, backward, hadamard: set one at a time, "
            "e.g. precision.attention.format=mxfp8",
        )  # fmt: skip
    check_node(p.attention, AttentionRecipe, "precision.attention", "precision.attention")


def check_quantization(p: DictConfig) -> None:
    """Each of precision.rules: its keys and types (the format names are checked with the registry,
    in validate_components)."""
    for i, rule in enumerate(p.rules):
        key = f"precision.rules[{i}]"
        if not isinstance(rule, DictConfig) or not {"match", "format"} <= set(rule) <= RULE_KEYS:
            raise ConfigError(key, rule, "a rule is {match: <glob on module names>, format: <format> | high}, "
                              "optionally accumulate: <preset>")  # fmt: skip
        check_node(rule, schema.QuantRule, key, "a rule")
    for i, phase in enumerate(p.schedule):
        key = f"precision.schedule[{i}]"
        check_node(phase, schema.Phase, key, "a phase")
        starts = [k for k in ("from_step", "from_fraction", "when") if phase.get(k) is not None]
        if "format" not in phase or len(starts) != 1:
            raise ConfigError(
                key, phase, "a phase is {format: <format> | high, and one of from_step: <step>, from_fraction: "
                "<0..1>, when: grad_noise_below_sqrt3; gemms: [forward, dgrad, wgrad], match: <glob> optional}",
            )  # fmt: skip


def check_variant(node: DictConfig, group: str, key: str, variants: dict[str, type]) -> None:
    """A group whose keys depend on one of them (sched.name)."""
    choice = node.get(key)
    check_value(f"{group}.{key}", choice, Literal[tuple(variants)])
    check_node(node, variants[choice], group, f"{group}.{key}={choice}")


def check_loggers(node: DictConfig) -> None:
    """logger.<name> for each logger chosen: a registered one (halfprec/loggers), its keys its class's
    arguments, its package installed (a one-line error with the pip command, before anything runs)."""
    from halfprec.loggers import LOGGERS  # light: each imports its package when a run starts it

    known_keys(node, "logger", list(LOGGERS), "logger (the loggers: logger=[wandb,tensorboard] turns on two)")
    for name in map(str, node):  # a composed config's keys are str (known_keys checked each)
        entry = LOGGERS[name]
        check_node(node[name], entry.cls, f"logger.{name}", f"logger={name}", hidden=("run",))
        needed = [p for p in inspect.signature(entry.cls).parameters if p != "run" and p not in node[name]]
        if needed:  # +logger.wandb.project=x without logger=wandb: its YAML has the other keys
            fix = (
                f"lacks {', '.join(needed)}: turn it on with logger={name} (or logger=[...,{name}]), then set its keys"
            )
            raise ConfigError(f"logger.{name}", OmegaConf.to_container(node[name]), fix)
        if importlib.util.find_spec(entry.package) is None:
            fix = f"needs the {entry.package} package, which is not installed: {entry.install}"
            raise ConfigError("logger", name, fix)


def validate_components(cfg: DictConfig) -> None:
    """model, init, task and data against the registered components' annotated arguments."""
    from halfprec.components.data import DATASETS  # light: sklearn is imported inside load_digits
    from halfprec.components.init import INIT_SCHEMES
    from halfprec.components.models import MODELS  # light: factories import timm lazily
    from halfprec.components.tasks import TASKS
    from halfprec.numerics.rounding import ROUNDING_RULES

    # types built at run time from a registry: values to mypy (annotated, so not read as type aliases)
    rounding: Any = Literal[tuple(ROUNDING_RULES)]
    rule: Any = Annotated[rounding, Spec(doc="the rounding rules of halfprec/numerics/rounding.py")]
    check_value("precision.update", cfg.precision["update"], rule)
    from halfprec.numerics.formats import FORMATS

    check_recipe(cfg.precision)
    check_attention(cfg.precision)
    check_accumulate(cfg.precision)
    rules.check_formats(cfg.precision, FORMATS)
    rules.check_shadow(cfg.diagnostics, FORMATS)
    task = chosen(cfg, "task.name", TASKS, "tasks registered in halfprec.components.tasks")
    check_node(cfg.task, TASKS[task], "task", f"task={task}", extra=("name",))
    name = chosen(cfg, "data.name", DATASETS, "datasets registered in halfprec.components.data")
    arch = chosen(cfg, "model.arch", MODELS, "models registered in halfprec.components.models")
    rules.check_fit(cfg, TASKS[task], DATASETS, TASKS, MODELS)  # before data.*, which may read model.*
    factory = MODELS[arch].factory
    check_node(
        cfg.model, factory, "model", f"model.arch={arch}", extra=("arch",), hidden=("input_shape", "num_classes")
    )
    scheme = chosen(cfg, "init.scheme", INIT_SCHEMES, "init schemes of halfprec.components.init")
    fixup = ("scalar_lr_scale",) if scheme == "fixup" else ()  # read by the optimizer's param groups
    check_node(cfg.init, INIT_SCHEMES[scheme], "init", f"init={scheme}", extra=("scheme", *fixup), hidden=("model",))
    if fixup:
        check_value("init.scalar_lr_scale", cfg.init.get("scalar_lr_scale"), SCALAR_LR_SCALE)
    rules.check_residual(cfg.init, arch, MODELS)
    check_value("data.batch_size", cfg.data.get("batch_size"), BATCH_SIZE)
    check_node(cfg.data, DATASETS[name].load, "data", f"data={name}", extra=("name", "batch_size"))
    rules.check_workers(cfg.data)


def chosen(cfg: DictConfig, key: str, registry: dict, what: str) -> str:
    """The registered component `key` names."""
    value = OmegaConf.select(cfg, key)
    if value not in registry:
        raise ConfigError(key, value, f"must be one of {', '.join(registry)} ({what})")
    return value


def validate_optimizer(cfg: DictConfig) -> None:
    """Check optim.* against the optimizer's own signature (imports torch)."""
    from hydra.utils import get_class

    try:
        cls = get_class(cfg.optim._target_)
    except Exception:
        raise ConfigError("optim._target_", cfg.optim._target_, "no such class; e.g. torch.optim.SGD") from None
    import torch

    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(
            "optim._target_",
            cfg.optim._target_,
            "must be a torch.optim.Optimizer subclass: master weights, skipped steps and checkpoints "
            "rely on its param_groups and state_dict",
        )
    signature = inspect.signature(cls).parameters
    allowed = [*OPTIM_KEYS, *(p for p in signature if p not in ("params", "lr"))]
    known_keys(cfg.optim, "optim", allowed, cls.__name__)
    for key, value in cfg.optim.items():
        if key in signature:
            check_like_default(f"optim.{key}", value, signature[key].default, cls.__name__)


def check_like_default(key: str, value: Any, default: Any, owner: str) -> None:
    """An argument whose default is a tuple (AdamW's betas) takes as many values: a single number
    would otherwise be a TypeError inside the optimizer that names no key."""
    if not isinstance(default, tuple) or value is None:
        return
    value = OmegaConf.to_container(value) if OmegaConf.is_list(value) else value
    if not isinstance(value, list | tuple) or len(value) != len(default):
        shown = ",".join(map(str, default))
        fix = f"{owner} takes {len(default)} values here, as its default ({shown}): write {key}=[{shown}]"
        raise ConfigError(key, value, fix)
