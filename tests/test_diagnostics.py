"""Gradient diagnostics: fp16 underflow/overflow fractions, log2 histograms, and skip sources."""

from __future__ import annotations

import pytest
import torch

from halfprec.config import validate
from halfprec.errors import ConfigError
from halfprec.loggers import Histogram
from halfprec.training.diagnostics import FP16_TINY, LOG2_RANGE, Diagnostics

import wandb_records
from helpers import batch, build_from, compose_cfg

# The loss_scaling experiment's simulated small gradients (loss x 2^-18, lr x 2^18), one step
SMALL_GRADS = [
    "model.hidden=[64,64,64,64]",
    "data.batch_size=256",
    "optim.lr=26214.4",
    "optim.weight_decay=0",
    "trainer.loss_weight=3.814697265625e-06",
    "trainer.max_steps=1",
    "diagnostics=grads",
]


def diagnostics_for(*overrides: str):
    c, cfg = build_from("model.hidden=[8,8]", "diagnostics=grads", *overrides)
    return c, Diagnostics(cfg.diagnostics, c.model, c.stepper.params)


def test_fractions_and_histogram_of_a_crafted_gradient():
    c, diag = diagnostics_for()
    layers = dict(c.model.named_children())
    assert list(diag.layers) == ["fc1", "fc2", "head"]  # the three Linear layers, in model order
    for p in c.model.parameters():
        p.grad = torch.ones_like(p)  # 1.0 = 2^0: representable, nonzero
    # fc1 (weight 8x64 = 512 values, bias 8): 128 zeros, 64 below fp16's smallest subnormal,
    # 32 above its max, 16 inf, the rest 1.0
    g = layers["fc1"].weight.grad.view(-1)
    g[:128] = 0.0
    g[128:192] = 2.0**-30
    g[192:224] = 1e5
    g[224:240] = float("inf")
    diag.inspect_gradients(c.stepper.params)
    row = diag.collect()
    n1 = 512 + 8
    assert row["grad_zero/fc1"] == pytest.approx(128 / n1)
    assert row["grad_underflow/fc1"] == pytest.approx(64 / n1)
    assert row["grad_overflow/fc1"] == pytest.approx(48 / n1)  # inf counts as overflow
    assert row["grad_underflow/fc2"] == row["grad_overflow/fc2"] == row["grad_zero/fc2"] == 0.0
    total = sum(p.numel() for p in c.model.parameters())
    assert row["diag/grad_underflow"] == pytest.approx(64 / total)
    assert row["diag/grad_overflow"] == pytest.approx(48 / total)
    # one bin per power of two: 2^-30 lands in bin -30, 1.0 in bin 0, 1e5 (~2^16.6) in bin 16; inf is left out
    hist = row["grad_log2/fc1"]
    assert isinstance(hist, Histogram) and hist.edges[0] == LOG2_RANGE[0] and len(hist.edges) == len(hist.counts) + 1
    low = LOG2_RANGE[0]
    assert hist.counts[-30 - low] == 64 and hist.counts[16 - low] == 32 and hist.counts[0 - low] == n1 - 240
    assert sum(hist.counts) == n1 - 128 - 16
    assert FP16_TINY == torch.finfo(torch.float16).smallest_normal * 2.0**-10  # the smallest subnormal


def test_skip_source_names_the_layer_where_the_overflow_entered_the_backward():
    # inf injected into the gradient of the middle Linear's output: that layer's and every earlier
    # layer's parameter gradients become inf/NaN, the last layer's stay finite
    c, diag = diagnostics_for("precision=fp16")

    def poison(module, args, out) -> None:
        out.register_hook(lambda g: g * float("inf"))

    handle = c.model.get_submodule("fc2").register_forward_hook(poison)
    try:
        result = c.stepper.step([batch(16)])
    finally:
        handle.remove()
    assert result.skipped
    assert diag.skip_source(result.loss, result.culprit) == "fc2 (Linear)"
    # the first layer is non-finite too: naming the first layer in model order would blame it
    grads = {name: p.grad for name, p in c.model.named_parameters()}
    assert not torch.isfinite(grads["fc1.weight"]).all() and torch.isfinite(grads["head.weight"]).all()


def test_skip_source_of_a_forward_overflow():
    c, diag = diagnostics_for()
    x, y = batch(16)
    x[0, 0, 0, 0] = float("inf")
    result = c.stepper.step([(x, y)])
    assert result.skipped
    assert diag.skip_source(result.loss, result.culprit).startswith("the forward pass")


def test_activation_gradients_are_counted_unscaled():
    c, diag = diagnostics_for("precision=fp16")
    with diag.watch_activation_gradients(c.stepper.scaler.scale):
        c.stepper.step([batch(16)])
    row = diag.collect()
    assert {k for k in row if k.startswith("act_zero/")} == {"act_zero/fc1", "act_zero/fc2", "act_zero/head"}
    assert 0.0 <= row["diag/act_underflow"] < 0.01 and row["diag/act_overflow"] == 0.0
    # forward hooks are gone after the step
    assert all(not m._forward_hooks for m in c.model.modules())


def test_diagnostics_show_what_fp16_without_a_scaler_loses(cli):
    # fp32 with simulated small gradients: most true gradient values are below 2^-24 (fp16 would
    # lose them); fp16 without a scaler: they are all exactly zero; with a dynamic scaler: as fp32
    fp32 = cli.submit("precision=fp32", "scaler=none", *SMALL_GRADS, "logger=none", cheap=False)
    fp16 = cli.submit("precision=fp16", "scaler=none", *SMALL_GRADS, "logger=none", cheap=False)
    dyn = cli.run("precision=fp16", "scaler=dynamic", *SMALL_GRADS, "logger=none", cheap=False).check()
    r32, r16, rdyn = fp32.result().check().metrics()[0], fp16.result().check().metrics()[0], dyn.metrics()[0]
    assert r32["diag/grad_underflow"] > 0.5 and r32["diag/grad_zero"] < 0.3
    assert r16["diag/grad_zero"] > 0.95 and r16["diag/grad_underflow"] == 0.0
    assert rdyn["diag/grad_underflow"] == pytest.approx(r32["diag/grad_underflow"], abs=0.01)


def test_cli_logs_fractions_histograms_and_skip_sources(cli):
    result = cli.run(
        "precision=fp16",
        "diagnostics=grads",
        "diagnostics.every=4",
        "trainer.max_steps=8",
        "trainer.log_every=8",
        "trainer.inject_nonfinite_at=[3]",
    ).check()
    assert "step 3: skipped, inf/NaN gradients from fc1 (Linear); scale 65536 -> 32768" in result.stderr
    rows = result.metrics()
    assert [r["step"] for r in rows] == [1, 3, 4, 8]
    assert rows[1] == {"step": 3, "samples": 48, "diag/skip_source": "fc1 (Linear)"}
    assert all("diag/grad_underflow" in r and "grad_overflow/fc1" in r for r in (rows[0], rows[2], rows[3]))
    assert not any(k.startswith("grad_log2/") for r in rows for k in r)  # histograms go to W&B only
    (run_file,) = wandb_records.run_files(result.run_dir)
    history = wandb_records.history(run_file)
    hist = next(h for h in history if "grad_log2/fc1._type" in h)  # W&B stores it as nested keys
    assert hist["grad_log2/fc1._type"] == "histogram"
    assert len(hist["grad_log2/fc1.bins"]) == len(hist["grad_log2/fc1.values"]) + 1


def test_diagnostics_off_adds_nothing(cli):
    rows = cli.run("precision=fp16", "trainer.inject_nonfinite_at=[2]", "logger=none").check().metrics()
    assert not any(k.startswith(("diag/", "grad_", "act_")) for r in rows for k in r)


def test_activation_diagnostics_without_a_schedule_is_a_config_error():
    with pytest.raises(ConfigError, match=r"diagnostics.activations=true: needs diagnostics.every > 0"):
        validate(compose_cfg("diagnostics.activations=true"))
