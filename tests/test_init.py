"""Init schemes: weight statistics against theory, Fixup's structure, and Fixup's reason to exist."""

import math

import pytest
import torch
from torch import nn

from halfprec.components.init import InitError, apply_init, init_fixup
from halfprec.components.models import create_model
from halfprec.numerics.scaling import TrainingAborted
from halfprec.training.build import build
from halfprec.training.run import run

from helpers import compose_cfg, typed_cfg


def wide_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(64, 128, 3), nn.Flatten(), nn.Linear(512, 256))


def init_with(*overrides) -> nn.Module:
    torch.manual_seed(0)
    model = wide_net()
    apply_init(model, typed_cfg(*overrides).init)
    return model


def test_kaiming_std_matches_he():
    conv, _, lin = init_with("init=kaiming")
    # conv: fan_out = 128 * 3 * 3; linear: fan_in = 512; gain sqrt(2) for relu
    assert conv.weight.std().item() == pytest.approx(math.sqrt(2 / (128 * 9)), rel=0.03)
    assert lin.weight.std().item() == pytest.approx(math.sqrt(2 / 512), rel=0.03)
    assert abs(conv.weight.mean().item()) < 3 * conv.weight.std().item() / math.sqrt(conv.weight.numel())
    assert torch.count_nonzero(conv.bias) == 0 and torch.count_nonzero(lin.bias) == 0


def test_kaiming_modes_are_configurable():
    conv, _, _ = init_with("init=kaiming", "init.conv_mode=fan_in")
    assert conv.weight.std().item() == pytest.approx(math.sqrt(2 / (64 * 9)), rel=0.03)


@pytest.mark.parametrize("distribution", ["uniform", "normal"])
def test_xavier_std_matches_glorot(distribution):
    conv, _, lin = init_with("init=xavier", f"init.distribution={distribution}")
    assert conv.weight.std().item() == pytest.approx(math.sqrt(2 / (64 * 9 + 128 * 9)), rel=0.03)
    assert lin.weight.std().item() == pytest.approx(math.sqrt(2 / (512 + 256)), rel=0.03)
    bound = math.sqrt(6 / (512 + 256))
    if distribution == "uniform":
        assert lin.weight.abs().max().item() <= bound
    assert torch.count_nonzero(lin.bias) == 0


def fixup_model(blocks_per_stage: int = 4):
    cfg = typed_cfg("model=fixup_resnet", f"model.blocks_per_stage={blocks_per_stage}", "init=fixup")
    torch.manual_seed(0)
    model = create_model(cfg.model, (1, 8, 8), 10)
    apply_init(model, cfg.init)
    return model, cfg


def test_fixup_branches_output_zero_and_the_net_is_its_trunk():
    model, _ = fixup_model()
    x = torch.randn(16, 1, 8, 8)
    h = torch.relu(model.stem(x) + model.bias1)
    trunk = h
    for block in model.residual_blocks():
        assert torch.count_nonzero(block.branch(trunk)) == 0
        trunk = block.shortcut(trunk)  # relu is the identity on the non-negative trunk
    assert torch.equal(model.blocks(h), trunk)
    assert torch.count_nonzero(model(x)) == 0  # zero classifier
    assert h.abs().sum() > 0  # the stem is left at its default init


def test_fixup_scales_branch_layers_by_depth():
    model, _ = fixup_model(blocks_per_stage=6)  # L = 18, m = 2: factor L^-1/2
    depth = len(model.residual_blocks())
    w = torch.cat([b.conv1.weight.flatten() for b in model.residual_blocks()[-6:]])  # last stage: 32x32x3x3
    assert w.std().item() == pytest.approx(math.sqrt(2 / (32 * 9)) / math.sqrt(depth), rel=0.05)
    assert all(torch.count_nonzero(b.conv2.weight) == 0 for b in model.residual_blocks())
    assert all(b.scale.item() == 1.0 and b.bias2b.item() == 0.0 for b in model.residual_blocks())


def test_fixup_biases_and_scales_get_a_tenth_of_the_lr():
    """As in the authors' code: every parameter named *bias* or *scale* (the classifier bias too)."""
    c = build(compose_cfg("model=fixup_resnet", "init=fixup", "optim.lr=0.2", "sched=constant"))
    lrs = [g["lr"] for g in c.stepper.optimizer.param_groups]
    assert lrs == pytest.approx([0.2, 0.02])
    slow = {id(p) for p in c.stepper.optimizer.param_groups[1]["params"]}
    names = {n for n, p in c.model.named_parameters() if id(p) in slow}
    assert "classifier.bias" in names and "blocks.0.scale" in names and "blocks.0.bias1a" in names
    assert not any(n.endswith("weight") for n in names)


def test_fixup_downsampling_shortcut_sees_bias1a_identity_does_not():
    model, _ = fixup_model(blocks_per_stage=1)
    first, down = model.residual_blocks()[0], model.residual_blocks()[1]
    with torch.no_grad():
        for block in (first, down):
            block.bias1a.fill_(0.5)
            block.conv2.weight.zero_()  # branch output = bias2b = 0: the block is its shortcut
    x = torch.rand(2, 8, 8, 8)
    assert torch.equal(first(x), x)
    y = torch.rand(2, 8, 8, 8)
    assert torch.allclose(down(y)[:, :8], y[:, :, ::2, ::2] + 0.5)


def test_fixup_refuses_a_model_without_residual_branches():
    with pytest.raises(InitError, match="residual branches"):
        init_fixup(nn.Sequential(nn.Linear(4, 4)))


def test_kaiming_zero_init_last_zeroes_branches():
    cfg = typed_cfg("model=fixup_resnet", "init=kaiming", "init.zero_init_last=true")
    model = create_model(cfg.model, (1, 8, 8), 10)
    apply_init(model, cfg.init)
    assert all(b.scale.item() == 0.0 for b in model.residual_blocks())
    x = torch.relu(torch.randn(4, 8, 8, 8))
    assert torch.count_nonzero(model.residual_blocks()[0].branch(x)) == 0


DEEP = ["model=fixup_resnet", "model.blocks_per_stage=7", "precision=fp16", "data.batch_size=32",
        "sched=constant", "trainer.max_steps=100", "trainer.val_every=0", "trainer.log_every=10"]  # fmt: skip


@pytest.mark.slow  # ~45 s on 2 cores: 4 runs of 100 steps on an 18-block ResNet
def test_deep_norm_free_net_trains_in_fp16_with_fixup_but_not_with_kaiming(tmp_path):
    """21 residual blocks, no normalization, fp16 autocast + dynamic scaling (Zhang et al. 2019).

    He init without branch rescaling: activations grow ~1.25x per block, gradients overflow at
    every scale and the scaler hits its floor. Fixup: trains, nearly without a skipped step.
    """
    with pytest.raises(TrainingAborted, match="floor|in a row"):
        run(compose_cfg(*DEEP, "init=kaiming"), tmp_path / "kaiming")
    fixup = run(compose_cfg(*DEEP, "init=fixup"), tmp_path / "fixup")
    assert fixup["val/acc"] > 0.5  # chance is 0.1; 0.71 measured at 100 steps
    assert fixup["scaler/skipped_steps"] <= 3
