"""update_lost: the share of an update that rounding to nearest loses in bf16/fp16 weights without
fp32 masters (LowPrecisionParams), on hand-computable steps; logged in pure modes alone; neutral."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from halfprec.config import schema
from halfprec.numerics.params import LowPrecisionParams
from halfprec.numerics.rounding import (
    KahanRounding,
    RemainderRounding,
    RoundingRule,
    RoundToNearest,
    StochasticRounding,
)
from halfprec.training.diagnostics import Diagnostics

from helpers import batch, build_from, flat_params, same_bits

DIAG = schema.Diagnostics(every=1, activations=False, skips=False, shadow=[])


class Two(nn.Module):
    """Two bias-free Linear layers and a LayerNorm, which keep_norm_fp32 would leave in fp32."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.a = nn.Linear(4, 1, bias=False).to(dtype)
        self.b = nn.Linear(4, 1, bias=False).to(dtype)
        self.norm = nn.LayerNorm(4)  # fp32


def stepped(model: nn.Module, rule: type[RoundingRule], optimizer, grads: dict[str, torch.Tensor]) -> dict:
    """One optimizer step of `model`'s weights through LowPrecisionParams with the gradients given,
    watched as a diagnostics step is; the row's update_lost keys."""
    params = LowPrecisionParams(model, rule)
    diag = Diagnostics(DIAG, model, params)
    opt = optimizer(params)
    for name, p in model.named_parameters():
        p.grad = grads.get(name, torch.zeros_like(p))
    with diag.watch_updates():
        params.unscale_(1.0)
        opt.step()
        params.finish_(stepped=True)
    assert params.lost is None  # armed for the watched step alone
    return {k: v for k, v in diag.collect().items() if "update_lost" in k}


# (dtype, an update below half an ulp of 1.0, one above it, one below half an ulp of 256)
CASES = {torch.bfloat16: (2.0**-9, 2.0**-7, 0.5), torch.float16: (2.0**-12, 2.0**-10, 2.0**-4)}


@pytest.mark.parametrize(
    "rule, dtype",
    [
        (RoundToNearest, torch.bfloat16),
        (RoundToNearest, torch.float16),
        (KahanRounding, torch.bfloat16),
        (StochasticRounding, torch.bfloat16),
        (RemainderRounding, torch.bfloat16),
    ],
)
def test_share_of_sgd_updates_below_half_an_ulp(rule, dtype):
    # SGD at lr 1: the update is -grad. Layer a's weights [1, 1, 1, 256] get updates [small, big,
    # 0, small at 256]: three move, two of them by less than half an ulp. Every rule reports what
    # rounding to nearest loses (Kahan, stochastic rounding and remainders keep it: that is the point).
    small, big, small_256 = CASES[dtype]
    model = Two(dtype)
    with torch.no_grad():
        model.a.weight.copy_(torch.tensor([[1.0, 1.0, 1.0, 256.0]]))
        model.b.weight.fill_(1.0)
    grads = {"a.weight": -torch.tensor([[small, big, 0.0, small_256]], dtype=dtype)}
    row = stepped(model, rule, lambda p: torch.optim.SGD(p.params, lr=1.0), grads)
    # b's weights do not move at all (zero gradient, no decay): a share of 0, not of 0/0; the
    # fp32 LayerNorm is not rounded, so it has no key
    assert row == {"diag/update_lost": 2 / 3, "update_lost/a": 2 / 3, "update_lost/b": 0.0}
    if rule is RoundToNearest:  # the lost updates are really lost; the big one is not
        expected = torch.tensor([[1.0, 1.0 + big, 1.0, 256.0]], dtype=dtype)
        assert torch.equal(model.a.weight, expected) and model.a.weight.dtype == dtype


def test_adamw_weight_decay_vanishes_in_bf16():
    # Zero gradients: AdamW's only update is its decoupled decay, w * lr * wd. At lr 1e-3, wd 0.1 it
    # is 1e-4 of a weight 1.0, below half an ulp (2^-9 under 1.0): every value of layer a is lost.
    # Layer b at lr 1: 0.1, kept. The whole-model share counts the values that moved in both.
    model = Two(torch.bfloat16)
    with torch.no_grad():
        model.a.weight.fill_(1.0)
        model.b.weight.fill_(1.0)

    def adamw(params: LowPrecisionParams) -> torch.optim.Optimizer:
        a, b, norm_w, norm_b = params.params
        groups = [{"params": [a], "lr": 1e-3}, {"params": [b, norm_w, norm_b], "lr": 1.0}]
        return torch.optim.AdamW(groups, weight_decay=0.1)

    row = stepped(model, RoundToNearest, adamw, {})
    assert row == {"diag/update_lost": 0.5, "update_lost/a": 1.0, "update_lost/b": 0.0}
    assert bool((model.a.weight == 1.0).all()) and bool((model.b.weight == 0.8984375).all())  # 0.9 in bf16


def test_a_skipped_step_counts_nothing():
    model = Two(torch.bfloat16)
    params = LowPrecisionParams(model, RoundToNearest)
    diag = Diagnostics(DIAG, model, params)
    with diag.watch_updates():
        params.unscale_(1.0)
        params.finish_(stepped=False)
    assert not any("update_lost" in k for k in diag.collect())


def run(precision: str, watched: bool, steps: int = 3) -> tuple[list[torch.Tensor], torch.Tensor, list[dict]]:
    """`steps` steps of the digits MLP in `precision`, each a diagnostics step (gradients inspected,
    updates watched) or none: the losses, the weights and the rows."""
    c, cfg = build_from(f"precision={precision}", "model.hidden=[16]", "optim=adamw", "diagnostics=grads")
    diag = Diagnostics(cfg.diagnostics, c.model, c.stepper.params)
    torch.manual_seed(1)  # stochastic rounding draws from the global generator
    losses, rows = [], []
    for i in range(steps):
        micro = [batch(16, seed=i)]
        if watched:
            with diag.watch_updates():
                losses.append(c.stepper.step(micro, inspect=diag.inspect_gradients).loss)
            rows.append(diag.collect())
        else:
            losses.append(c.stepper.step(micro).loss)
    return losses, flat_params(c.model), rows


@pytest.mark.parametrize("precision", ["bf16_pure", "bf16_pure_kahan", "bf16_pure_stochastic", "bf16_pure_remainder"])
def test_watching_updates_changes_no_bit_of_the_training(precision):
    watched_losses, watched_weights, rows = run(precision, watched=True)
    losses, weights, _ = run(precision, watched=False)
    assert all(same_bits(a.float(), b.float()) for a, b in zip(watched_losses, losses))
    assert same_bits(watched_weights, weights)
    assert all(0.0 <= row["diag/update_lost"] <= 1.0 and "update_lost/head" in row for row in rows)


def test_cli_logs_update_lost_in_pure_bf16_only(cli):
    common = ("trainer.max_steps=4", "diagnostics.every=2", "logger=none")
    pure = cli.submit("precision=bf16_pure", "diagnostics=grads", *common)
    plain = cli.submit("precision=bf16_pure", "diagnostics=none", *common)
    amp = cli.run("precision=bf16", "diagnostics=grads", *common).check().metrics()
    rows, plain_rows = pure.result().check().metrics(), plain.result().check().metrics()
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    watched = [r for r in rows if "diag/update_lost" in r]
    assert [r["step"] for r in watched] == [1, 2, 4]  # the diagnostics steps
    # SGD's (lr 0.1) first steps: many of the moves, not all, are below half an ulp of a bf16 weight
    assert all(0.0 < r["diag/update_lost"] < 1.0 and 0.0 < r["update_lost/fc1"] <= 1.0 for r in watched)
    # the same training with diagnostics off: the same losses, bit for bit (JSON's text of them)
    assert [r["train/loss"] for r in rows] == [r["train/loss"] for r in plain_rows]
    # fp32 weights under autocast: nothing rounds an update, no key
    assert "diag/grad_zero" in amp[0] and not any("update_lost" in k for r in amp for k in r)
