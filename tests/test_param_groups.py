"""The optimizer's parameter groups (numerics/param_groups.py): which tensors get weight decay, Fixup's
scaled-lr scalars, and resuming checkpoints from before the groups."""

from __future__ import annotations

from pathlib import Path

import pytest

from halfprec.config import from_saved, saved, validate
from halfprec.errors import ConfigError
from halfprec.training.build import build
from halfprec.training.checkpoint import check_resume_config

from helpers import compose_cfg, typed_cfg

GPT = ["task=lm", "model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=32"]
NORMS = ["blocks.0.norm1.weight", "blocks.0.norm2.weight", "blocks.1.norm1.weight", "blocks.1.norm2.weight",
         "norm.weight"]  # fmt: skip


def groups(*overrides: str) -> dict[str, tuple[list[str], dict]]:
    """Each param group of the built optimizer: its parameters' names and its other settings."""
    c = build(compose_cfg(*overrides))
    names = {id(t): n for n, t in c.stepper.params.named()}
    return {
        g["name"]: ([names[id(p)] for p in g["params"]], {k: v for k, v in g.items() if k not in ("params", "name")})
        for g in c.stepper.optimizer.param_groups
    }


def test_norms_and_biases_get_no_weight_decay_by_default_as_in_nanogpt():
    found = groups(*GPT)
    assert list(found) == ["decay", "no_decay"]
    assert found["no_decay"][0] == NORMS and found["no_decay"][1]["weight_decay"] == 0.0
    decayed, settings = found["decay"]
    assert settings["weight_decay"] == 0.1 and "wte.weight" in decayed and "wpe.weight" in decayed
    assert len(decayed) == 2 + 2 * 4  # the embeddings (the head is tied to wte) and 4 Linear weights a block


def test_embeddings_and_globs_can_be_exempted_too():
    found = groups(*GPT, "optim.no_decay=[low_dim,embeddings,'blocks.1.attn.*']")
    exempt = set(found["no_decay"][0])
    assert exempt == {*NORMS, "wte.weight", "wpe.weight", "blocks.1.attn.qkv.weight", "blocks.1.attn.proj.weight"}
    assert set(groups(*GPT, "optim.no_decay=[]")) == {"decay"}  # the behaviour before groups


def test_without_weight_decay_there_is_one_group_and_fixup_keeps_its_scaled_lr():
    assert list(groups()) == ["all"]  # the digits MLP's SGD has weight_decay 0
    fixup_cfg = ["model=fixup_resnet", "init=fixup", "optim.weight_decay=5e-4", "model.blocks_per_stage=1"]
    fixup = groups(*fixup_cfg)
    cfg = compose_cfg(*fixup_cfg)
    assert list(fixup) == ["decay", "slow_no_decay"]  # Fixup's biases and scales are scalars: no decay
    slow_names, slow = fixup["slow_no_decay"]
    assert all("bias" in n.rsplit(".", 1)[-1] or "scale" in n.rsplit(".", 1)[-1] for n in slow_names)
    assert slow["weight_decay"] == 0.0 and slow["initial_lr"] == pytest.approx(cfg.optim.lr * cfg.init.scalar_lr_scale)
    assert cfg.init.scalar_lr_scale != 1


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["optim.no_decay=['*.gain']"], r"optim.no_decay\[0\]=\*.gain: matches no parameter \(they are wte.weight"),
        (["optim.no_decay=low_dim"], "optim.no_decay=low_dim: must be a list of strings"),
    ],
)
def test_bad_no_decay_entries_are_one_line(overrides, message):
    cfg = compose_cfg(*GPT, *overrides)
    with pytest.raises(ConfigError, match=message):
        validate(cfg)
        build(cfg)


def test_a_checkpoint_from_before_the_groups_resumes_only_where_nothing_changes():
    """Older checkpoints decayed every tensor: resuming one that used weight decay with no_decay's
    default would change the update (and the optimizer's groups), so it is an error naming the key."""
    new = typed_cfg(*GPT)
    old = from_saved(without(saved(new), "optim", "no_decay"))
    with pytest.raises(ConfigError, match=r"optim.no_decay=\['low_dim'\]: .* was trained with optim.no_decay=\[\]"):
        check_resume_config(old, new, Path("step-00000004.pt"))
    sgd = typed_cfg()  # weight decay 0: one group either way
    old_sgd = from_saved(without(saved(sgd), "optim", "no_decay"))
    assert check_resume_config(old_sgd, sgd, Path("step-00000004.pt")) == []


def without(tree: dict, group: str, key: str) -> dict:
    """A saved config from before `group.key`."""
    return {**tree, group: {k: v for k, v in tree[group].items() if k != key}}
