"""The saved config: the typed one as the tree it was composed from (what W&B, the other loggers and
checkpoints keep, secrets redacted), and a checkpoint's tree read back as a Config, in today's keys."""

from __future__ import annotations

import copy
import os
import re
from dataclasses import asdict, fields, is_dataclass
from typing import Any

from halfprec.config import schema
from halfprec.config.typed import CHOSEN_BY, from_tree
from halfprec.spec import flat_keys

# Keys added since checkpoints were first written, with the value every older version behaved as
# (a key only some options have, as the GPT's model.pos, is implied only where the run has it).
IMPLIED_BY_OLDER_CHECKPOINTS: dict[str, object] = {
    "task.name": "classification",
    # from before the number formats: no layer quantized
    "precision.format": None,
    # each recipe switch off: Recipe's defaults (filled in by implied())
    # attention unquantized: AttentionRecipe's defaults, precision.attention.* (filled in by implied())
    "precision.rules": [],
    "precision.schedule": [],
    "precision.high_first": 0,
    "precision.high_last": 0,
    "precision.master": None,
    "precision.kernel": "emulated",
    "precision.quantizer": "eager",  # from before compiled quantizers
    "optim.no_decay": [],  # from before param groups: every tensor decayed
    "optim.state_dtype": "float32",
    "optim.state_rounding": "nearest",
    "scaler.max_overflow_rate": None,  # never stopped on the overflow rate
    "trainer.threads": None,  # torch's own default
    "model.pos": "learned",  # from before model=llama: the GPT's learned positions, tied head
    "model.rope_base": 10000.0,
    "model.tie_embeddings": True,
    "model.norm_eps": None,  # from before GPT-2's biases and LLaMA's eps: torch's eps, no biases
    "model.bias": False,
    "data.dtype": "uint16",  # from before uint32 token files
    "diagnostics.shadow": [],  # from before what-if statistics
    "diagnostics.shadow_attention": False,  # from before what-if statistics of attention
    "precision.eval": [],  # from before evaluation precisions: validation in the training precision only
    "precision.accumulate": "exact",  # from before modelled accumulation: fp32 GEMMs
    # a rule's accumulate: null (precision.accumulate), QuantRule's default, written only where set (as_tree)
    # attention's forward_accumulate, backward_accumulate: null (precision.accumulate), AttentionRecipe's defaults
}
# Keys spelled otherwise by older checkpoints: precision.fp8 (torchao's float8 recipe) became a
# format on precision.kernel=native.
OLDER_FP8: dict[str, dict[str, Any]] = {
    "tensorwise": {"precision.format": "fp8_e4m3", "precision.recipe.grad_format": "fp8_e5m2"},
    "rowwise": {"precision.format": "fp8_e4m3_row", "precision.recipe.grad_format": None},
}
# Keys whose change does nothing while another key is 0 on both sides: which tensors get no weight
# decay, when nothing decays (then there is one param group either way).
MOOT_WHILE_ZERO = {"optim.no_decay": "optim.weight_decay"}


def implied() -> dict[str, object]:
    from halfprec.numerics.attention import AttentionRecipe
    from halfprec.numerics.quantized import Recipe  # imports torch, as reading a checkpoint does anyway

    recipe = {f"precision.recipe.{f.name}": f.default for f in fields(Recipe)}
    attention = {f"precision.attention.{f.name}": f.default for f in fields(AttentionRecipe)}
    return {**IMPLIED_BY_OLDER_CHECKPOINTS, **recipe, **attention}


def respelled(precision: dict[str, Any]) -> dict[str, Any]:
    """The keys an older checkpoint's precision.fp8 (popped from `precision`) stands for today."""
    fp8 = precision.pop("fp8", None)
    if fp8 not in OLDER_FP8:
        return {}
    # precision=fp8 precision.fp8=rowwise is precision=fp8_row now
    name = "fp8_row" if fp8 == "rowwise" and precision.get("name") == "fp8" else precision.get("name")
    return {**OLDER_FP8[fp8], "precision.kernel": "native", "precision.name": name}


def from_saved(saved: dict) -> schema.Config:
    """A checkpoint's config as the typed Config, in today's keys: each key added since it was saved
    set to the value its run behaved as (a model's or a dataset's own keys are left to its factory,
    since only some take them)."""
    tree = copy.deepcopy(saved)
    for key, value in respelled(tree.get("precision", {})).items():
        put(tree, key, value)
    for key, value in implied().items():
        if not key.startswith(("model.", "data.")):
            put(tree, key, value, only_new=True)
    if tree["sched"]["name"] == "cosine":  # from before sched.total_steps: over trainer.max_steps
        tree["sched"].setdefault("total_steps", tree["trainer"]["max_steps"])
    return from_tree(tree)


def put(tree: dict[str, Any], key: str, value: Any, only_new: bool = False) -> None:
    """Set a dotted key in a nested tree (`only_new`: unless it is there)."""
    *parents, leaf = key.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    if not (only_new and leaf in tree):
        tree[leaf] = value


def changes(old: schema.Config, new: schema.Config) -> dict[str, tuple[Any, Any]]:
    """The saved keys whose value differs between two configs, as (old, new); a key the older one's
    version lacked counts as the value it behaved as."""
    now = flat_keys(saved(new))
    was = {k: v for k, v in implied().items() if k in now} | flat_keys(saved(old))
    moot = [key for key, zero in MOOT_WHILE_ZERO.items() if not was.get(zero) and not now.get(zero)]
    return {
        k: (was.get(k), now.get(k))
        for k in sorted(was.keys() | now.keys())
        if was.get(k) != now.get(k) and k not in moot
    }


def as_tree(config: schema.Config) -> dict[str, Any]:
    """The config as the composed tree it came from (from_tree's inverse), with what the run filled
    in since (trainer.threads, sched.total_steps)."""
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
            value["rules"] = [given_rule(rule) for rule in config.precision.rules]
        tree[f.name] = value
    return tree


def given(phase: schema.Phase) -> dict[str, Any]:
    """A schedule phase as a config writes it: the keys away from their defaults (a phase names one
    start and what it changes; gemms defaults to all three)."""
    default = schema.Phase(format=phase.format)
    return {k: v for k, v in asdict(phase).items() if k == "format" or v != getattr(default, k)}


def given_rule(rule: schema.QuantRule) -> dict[str, Any]:
    """A rule as a config writes it: match and format, and accumulate where it names one (a rule
    saved before the key existed reads back the same)."""
    return {k: v for k, v in asdict(rule).items() if k != "accumulate" or v is not None}


SECRET_KEY = re.compile(r"(api_?key|token|secret|password)", re.IGNORECASE)
URL_PASSWORD = re.compile(r"(://[^/@\s:]*:)[^/@\s]+@")  # scheme://user:password@host (an MLflow store's URI)


def redact(tree: Any) -> Any:
    """Values under secret-looking keys, and any value equal to $WANDB_API_KEY (e.g. interpolated by
    ${oc.env:...}), become '***'; so does the password of a URL (logger.mlflow.tracking_uri)."""
    key = os.environ.get("WANDB_API_KEY")
    if isinstance(tree, dict):
        return {k: "***" if SECRET_KEY.search(str(k)) else redact(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [redact(v) for v in tree]
    if not isinstance(tree, str):
        return tree
    return "***" if key and key in tree else URL_PASSWORD.sub(r"\1***@", tree)


def saved(config: schema.Config) -> dict:
    """The resolved config as W&B, the other loggers and checkpoints keep it: redacted."""
    return redact(as_tree(config))
