"""The typed config (config/typed.py): what validation passed becomes the dataclasses the code reads,
and back, unchanged, for W&B and checkpoints (config/saved.py); a checkpoint's reads back as typed."""

from __future__ import annotations

from inspect import signature
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from test_cli import NEEDS, OPTIONS

from halfprec.config import Config, from_saved, saved, schema
from halfprec.config.saved import as_tree
from halfprec.config.typed import typed
from halfprec.numerics.quantized import Recipe
from halfprec.numerics.scaling import StaticLossScaler
from halfprec.spec import Choice

from helpers import compose_cfg, typed_cfg

OLD_CHECKPOINT = Path(__file__).parent / "data" / "checkpoint-80b0cad-bf16_pure_kahan.pt"


@pytest.mark.parametrize("option", [o for o in OPTIONS if not o.startswith("+experiment")])
def test_every_option_types_and_comes_back_as_composed(option):
    cfg = compose_cfg(option, *NEEDS.get(option, []), *(["task=lm"] if option.startswith("ablation") else []))
    config = typed(cfg)
    assert as_tree(config) == OmegaConf.to_container(cfg, resolve=True)
    assert from_saved(as_tree(config)) == config


def test_the_groups_are_their_dataclasses():
    config = typed_cfg("precision=nvfp4", "task=lm", "scaler=static", "logger=[csv]", "init=default")
    assert isinstance(config, Config) and isinstance(config.precision, schema.Precision)
    assert isinstance(config.precision.recipe, Recipe) and config.precision.recipe.hadamard
    assert config.scaler.name == "static" and set(config.scaler.args) == set(signature(StaticLossScaler).parameters)
    assert isinstance(config.sched, schema.CosineSchedule)
    assert (
        config.model == Choice("gpt", {k: v for k, v in config.model.args.items()}) and "n_layer" in config.model.args
    )
    assert isinstance(config.data, schema.Data) and config.data.name == "pydoc" and config.data.batch_size > 0
    assert (
        config.optim._target_ == "torch.optim.AdamW" and "betas" in config.optim.args and "lr" not in config.optim.args
    )
    assert config.logger == {"csv": {}}


def test_what_a_run_fills_in_is_saved():
    config = typed_cfg("trainer.threads=auto")
    config.trainer.threads = 2
    assert saved(config)["trainer"]["threads"] == 2


def test_a_checkpoint_from_an_older_version_reads_as_the_run_it_was():
    """tests/data's checkpoint predates task=, the formats, the recipe and sched.total_steps."""
    import torch

    old = torch.load(OLD_CHECKPOINT, weights_only=False)["config"]
    config = from_saved(old)
    assert (config.task.name, config.precision.name, config.precision.format) == (
        "classification",
        "bf16_pure_kahan",
        None,
    )
    assert config.precision.recipe == Recipe() and config.precision.kernel == "emulated"
    assert isinstance(config.sched, schema.CosineSchedule) and config.sched.total_steps == config.trainer.max_steps == 4
    assert config.model == Choice("mlp", {"hidden": [16]}) and config.optim.no_decay == []
