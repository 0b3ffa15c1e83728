"""Fast paths: trainer.compile, trainer.channels_last and fused optimizers give the same numbers;
--help and config errors answer without importing torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import TRAIN

from halfprec.training.build import use_channels_last

from helpers import batch, build_from, flat_params, step


def test_channels_last_trains_like_the_default_layout():
    losses = {}
    for choice in ("false", "true"):
        c, _ = build_from(
            "model=fixup_resnet", "init=fixup", "model.blocks_per_stage=1", f"trainer.channels_last={choice}"
        )
        conv = next(m for m in c.model.blocks.modules() if isinstance(m, torch.nn.Conv2d))  # C > 1: unambiguous
        assert conv.weight.is_contiguous(memory_format=torch.channels_last) == (choice == "true")
        losses[choice] = [float(step(c, [batch(16, seed=i)]).loss) for i in range(3)]
    assert losses["true"] == pytest.approx(losses["false"], rel=1e-5)


def test_channels_last_auto_is_for_conv_nets_on_cuda():
    conv, mlp = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3)), torch.nn.Sequential(torch.nn.Linear(2, 2))
    assert use_channels_last("auto", conv, torch.device("cuda"))
    assert not use_channels_last("auto", conv, torch.device("cpu"))
    assert not use_channels_last("auto", mlp, torch.device("cuda"))


@pytest.mark.slow
def test_compiled_model_logs_the_eager_losses_and_saves_plain_keys(cli):
    # ~25 s: inductor compiles the MLP's forward and backward on the CPU
    overrides = [
        "logger=none",
        "trainer.max_steps=6",
        "trainer.log_every=2",
        "diagnostics=grads",
        "diagnostics.every=4",
    ]
    compiled = cli.submit(*overrides, "trainer.compile=true", cheap=False)
    eager = cli.run(*overrides, cheap=False).check()
    compiled = compiled.result().check()
    rows_c, rows_e = compiled.metrics(), eager.metrics()
    assert rows_c[0]["precision/compute_dtype"] == "float32"  # step 1 runs eagerly, so the dtype check sees it
    assert [r.get("train/loss") for r in rows_c] == pytest.approx([r.get("train/loss") for r in rows_e], rel=1e-5)
    ckpt = torch.load(compiled.run_dir / "checkpoints" / "step-00000006.pt", weights_only=False)
    assert not any("_orig_mod" in k for k in ckpt["model"])


def test_fused_adamw_skips_exactly_like_the_default_implementation():
    # the skip is decided before optimizer.step(), so the fused kernel never sees a skipped window
    final = {}
    for fused in ("false", "true"):
        c, _ = build_from("optim=adamw", f"optim.fused={fused}", "precision=fp16", "model.hidden=[32]")
        for i in range(4):
            x, y = batch(16, seed=i)
            if i == 1:
                x[0, 0, 0, 0] = float("inf")  # this window overflows and is skipped
            assert step(c, [(x, y)]).skipped == (i == 1)
        final[fused] = flat_params(c.model)
        assert c.stepper.optimizer.state[c.stepper.params.params[0]]["step"] == 3  # the skipped window left no trace
    torch.testing.assert_close(final["true"], final["false"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("args", [["--help"], ["accum=0"], ["trainer.compile=maybe"]])
def test_help_and_config_errors_do_not_import_torch(args, tmp_path):
    result = subprocess.run(
        [sys.executable, "-X", "importtime", str(TRAIN), *args], cwd=tmp_path, capture_output=True, text=True
    )
    assert result.returncode in (0, 2), result.stderr[-2000:]
    imported = {
        line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time")
    }
    assert "torch" not in imported and "hydra" in imported
