"""precision=fp8: torchao's float8 Linear layers inside bf16 autocast, checked in emulation on the
CPU (tests/test_gpu.py runs them for real on an fp8 GPU)."""

from __future__ import annotations

import pytest
import torch

from halfprec.config import resolve_device, validate
from halfprec.config.typed import typed
from halfprec.errors import ConfigError
from halfprec.training.build import build
from halfprec.training.run import run

from helpers import compose_cfg, typed_cfg

EMULATED = ["precision=fp8", "precision.fp8_emulate=true"]


@pytest.mark.parametrize("option, fmt", [("fp8", "fp8_e4m3"), ("fp8_row", "fp8_e4m3_row")])
def test_emulated_fp8_trains_like_bf16(option, fmt, tmp_path):
    steps = ["trainer.max_steps=150", "trainer.log_every=50", "trainer.val_every=0"]
    fp8 = run(compose_cfg(f"precision={option}", "precision.fp8_emulate=true", *steps), tmp_path / "fp8")
    bf16 = run(compose_cfg("precision=bf16", *steps), tmp_path / "bf16")
    # the two hidden Linear layers (64->256, 256->256) compute in float8; the 256->10 classifier cannot
    assert fp8[f"precision/layers/{fmt}"] == 2 and fp8["precision/compute_dtype"] == "bfloat16"
    assert fp8["precision/kernel"] == "torchao"
    assert fp8["train/loss"] == pytest.approx(bf16["train/loss"], abs=0.05)
    assert fp8["val/acc"] > 0.9 and abs(fp8["val/acc"] - bf16["val/acc"]) < 0.03


def test_fp8_layers_are_torchao_float8_linear():
    c = build(compose_cfg(*EMULATED))
    kinds = {name: type(m).__name__ for name, m in c.model.named_children()}
    assert kinds == {"flatten": "Flatten", "fc1": "Float8Linear", "act1": "ReLU", "fc2": "Float8Linear", "act2": "ReLU",
                     "head": "Linear"}  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["precision=fp8"], "float8 matmuls need a CUDA GPU of compute capability 8.9+"),
        (["precision=fp8", "precision.autocast=float16"], "float8 layers run inside bf16 autocast on fp32 weights"),
        ([*EMULATED, "model.hidden=[10]"], "no Linear layer of this model has in and out features divisible by 16"),
        (["precision=fp8", "precision.format=fp8_block"], "torchao has no training kernel for format=fp8_block"),
    ],
)
def test_fp8_config_errors(overrides, message):
    import torch

    if overrides == ["precision=fp8"] and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("this GPU has fp8 tensor cores")
    cfg = compose_cfg(*overrides)
    with pytest.raises(ConfigError) as info:
        validate(cfg)
        config = typed(cfg)
        resolve_device(config.trainer.device, config.precision)
        build(cfg)
    assert message in str(info.value)


GPT = ["task=lm", "model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=32", "data.batch_size=8"]


def test_the_gpts_linear_layers_go_float8_and_its_tied_head_stays():
    c = build(compose_cfg(*GPT, *EMULATED))
    kinds = {name: type(m).__name__ for name, m in c.model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert kinds.pop("lm_head") == "Linear" and set(kinds.values()) == {"Float8Linear"} and len(kinds) == 8
    assert c.model.lm_head.weight is c.model.wte.weight  # still tied


def test_an_emulated_fp8_gpt_trains_like_bf16(tmp_path):
    steps = ["trainer.max_steps=300", "trainer.log_every=50", "trainer.val_every=0", "sched.warmup_steps=30"]
    fp8 = run(compose_cfg(*GPT, *EMULATED, *steps), tmp_path / "fp8")
    bf16 = run(compose_cfg(*GPT, "precision=bf16", *steps), tmp_path / "bf16")
    assert fp8["precision/layers/fp8_e4m3"] == 8
    assert fp8["val/loss"] < 3.2  # well below a uniform byte's ln 256 = 5.5 nats: it learned
    assert fp8["val/loss"] == pytest.approx(bf16["val/loss"], rel=0.05)  # measured: 2.82 vs 2.89


@pytest.mark.parametrize("option, recipe", [("fp8", "tensorwise"), ("fp8_row", "rowwise")])
def test_a_checkpoint_from_before_the_converters_resumes_as_the_fp8_run_it_was(option, recipe):
    """Checkpoints from before precision=fp8 became a format on precision.kernel=native were
    precision=fp8 with precision.fp8=<torchao recipe>, no format and the emulated kernel (rowwise
    is precision=fp8_row now)."""
    from pathlib import Path

    from halfprec.config import from_saved, saved
    from halfprec.training.checkpoint import check_resume_config

    new = typed_cfg(f"precision={option}")
    tree = saved(new)
    p = {**tree["precision"], "name": "fp8", "fp8": recipe, "format": None, "kernel": "emulated"}
    old = from_saved({**tree, "precision": {**p, "recipe": {**p["recipe"], "grad_format": None}}})
    assert check_resume_config(old, new, Path("step-00000004.pt")) == []
    emulated = typed_cfg(f"precision={option}", "precision.kernel=emulated")
    with pytest.raises(ConfigError, match="was trained with precision.kernel='native'"):  # torchao's layers
        check_resume_config(old, emulated, Path("step-00000004.pt"))
