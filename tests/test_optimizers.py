"""Optimizer state in low precision (numerics/optimizers.py, `optim.state_dtype`): the update is
torch's, the state is what its dtype and rounding say, after a step, a skipped step and a resume."""

from __future__ import annotations

import copy

import pytest
import torch

from halfprec.config import validate
from halfprec.errors import ConfigError
from halfprec.numerics import optimizers
from halfprec.tools.memory import optimizer_state_bytes
from halfprec.training.build import build

from helpers import compose_cfg

GPT = ["task=lm", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=32", "data.batch_size=4"]


def train(opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: int, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


def two_groups(*shapes: tuple[int, ...]) -> tuple[list[torch.Tensor], list[dict]]:
    torch.manual_seed(0)
    params = [torch.randn(s) for s in shapes]
    return params, [{"params": params[:1]}, {"params": params[1:], "lr": 0.05, "weight_decay": 0.0}]


@pytest.mark.parametrize(
    "ours, theirs, kwargs",
    [
        (optimizers.AdamW, torch.optim.AdamW, {"lr": 0.01, "betas": (0.9, 0.95), "weight_decay": 0.1}),
        (optimizers.SGD, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-3, "dampening": 0.1}),
        (optimizers.SGD, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    ],
)
def test_with_float32_state_the_update_is_torchs_bit_for_bit(ours, theirs, kwargs):
    a, groups_a = two_groups((5, 3), (7,))
    b, groups_b = copy.deepcopy((a, groups_a))
    mine = ours(groups_a, state_dtype="float32", **kwargs)
    torchs = theirs(groups_b, foreach=False, **kwargs)
    train(mine, a, 20)
    train(torchs, b, 20)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_bf16_moments_are_the_fp32_moments_rounded():
    params, groups = two_groups((4, 4), (3,))
    opt = optimizers.AdamW(groups, lr=0.01, betas=(0.9, 0.95))
    grads = [torch.randn(p.shape) for p in params]
    for p, g in zip(params, grads):
        p.grad = g
    opt.step()
    for p, g in zip(params, grads):
        state = opt.state[p]
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.bfloat16
        assert torch.equal(state["exp_avg"], torch.zeros_like(g).lerp_(g, 0.1).bfloat16())
        assert torch.equal(state["exp_avg_sq"], (g * g * (1 - 0.95)).bfloat16())


def test_stochastic_rounding_of_the_state_is_unbiased():
    """SGD's first momentum buffer is the gradient: rounded stochastically, its mean over many
    draws is the fp32 gradient, where rounding to nearest is off by up to half a bf16 step."""
    g = torch.full((20_000,), 1.0 + 2**-9)  # a quarter of the way from 1 to the next bf16 value, 1 + 2^-7
    p = torch.zeros_like(g)
    opt = optimizers.SGD([p], lr=0.1, momentum=0.9, state_rounding="stochastic")
    p.grad = g
    torch.manual_seed(0)
    opt.step()
    stored = opt.state[p]["momentum_buffer"].float()
    assert set(stored.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert stored.mean().item() == pytest.approx(1.0 + 2**-9, abs=3 * 2**-7 * (0.25 * 0.75 / 20_000) ** 0.5)
    nearest = optimizers.SGD([p], lr=0.1, momentum=0.9)
    nearest.step()
    assert nearest.state[p]["momentum_buffer"].unique().tolist() == [1.0]


def test_bf16_state_resumes_bitwise_and_stays_bf16():
    params, groups = two_groups((6, 2), (2,))
    first = optimizers.AdamW(groups, lr=0.01)
    train(first, params, 3)
    saved, weights = copy.deepcopy(first.state_dict()), [p.clone() for p in params]
    again_params = [w.clone() for w in weights]
    again = optimizers.AdamW([{"params": again_params[:1]}, {"params": again_params[1:], "lr": 0.05,
                              "weight_decay": 0.0}], lr=0.01)  # fmt: skip
    again.load_state_dict(saved)
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in again.state.values())
    train(first, params, 4, seed=1)
    train(again, again_params, 4, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(params, again_params))


@pytest.mark.parametrize("model, cls", [(GPT, optimizers.AdamW), (["optim=sgd"], optimizers.SGD)])  # the GPT, the MLP
def test_a_skipped_step_leaves_every_state_byte_unchanged(model, cls):
    overrides = ["optim.state_dtype=bfloat16", "optim.state_rounding=stochastic", "trainer.nonfinite=skip"]
    cfg = compose_cfg(*model, *overrides)
    c = build(cfg)
    batches = c.data.train_batches(cfg.data.batch_size, 0, c.device, 0, 1)
    assert type(c.stepper.optimizer) is cls
    c.stepper.step([next(batches)])
    before = snapshot(c.stepper.optimizer)
    loss = c.stepper.task.loss
    c.stepper.task.loss = lambda out, y: loss(out, y) * float("nan")  # type: ignore[method-assign]
    assert c.stepper.step([next(batches)]).skipped
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(c.stepper.optimizer), strict=True))


def test_the_memory_estimate_asks_the_optimizer():
    c = build(compose_cfg(*GPT, "optim.state_dtype=bfloat16"))
    n = sum(p.numel() for p in c.stepper.params.params)
    count = len(c.stepper.params.params)
    state = optimizer_state_bytes(c.stepper.optimizer, c.stepper.params, c.device)
    assert state == n * 2 * 2 + count * 4  # 2 bf16 moments, a step


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["optim.state_dtype=float16"], "optim.state_dtype=float16: must be float32 or bfloat16"),
        (["optim.state_dtype=bfloat16", "optim._target_=torch.optim.Adam"], "torch.optim.Adam keeps its own state"),
        (["optim.state_dtype=bfloat16", "optim.fused=true"], "optim.fused=true: with optim.state_dtype=bfloat16"),
    ],
)
def test_state_dtype_config_errors(overrides, message):
    cfg = compose_cfg(*GPT, *overrides)
    with pytest.raises(ConfigError, match=message):
        validate(cfg)
        build(cfg)


def test_a_run_with_stochastically_rounded_bf16_state_resumes_exactly(tmp_path):
    from conftest import read_jsonl

    from halfprec.training.run import run

    common = [*GPT, "optim.state_dtype=bfloat16", "optim.state_rounding=stochastic", "trainer.log_every=1",
              "trainer.val_every=0", "sched.total_steps=6", "sched.warmup_steps=1"]  # fmt: skip
    run(compose_cfg(*common, "trainer.max_steps=6"), tmp_path / "whole")
    run(compose_cfg(*common, "trainer.max_steps=3"), tmp_path / "parts")
    run(compose_cfg(*common, "trainer.max_steps=6", "resume=auto"), tmp_path / "parts")
    losses = [[r["train/loss"] for r in read_jsonl(tmp_path / d / "metrics.jsonl")] for d in ("whole", "parts")]
    assert losses[0] == losses[1] and len(losses[0]) == 6


def state_bytes(value: torch.Tensor) -> int:
    """Bytes a state tensor holds: torchao's quantized moments are codes, block scales and a code book."""
    parts = [getattr(value, a) for a in ("codes", "scale", "qmap") if hasattr(value, a)] or [value]
    return sum(p.numel() * p.element_size() for p in parts)


@pytest.mark.parametrize("optim", ["adamw8bit", pytest.param("adamw4bit", marks=pytest.mark.slow), "adamw_fp8"])
def test_torchaos_low_bit_adamw_trains_skips_untouched_and_is_estimated_exactly(optim):
    """torchao compiles its step (seconds per new shape on a CPU); the first step's FLOP count runs
    around forward and backward only, since a compiled update cannot run under its dispatch mode."""
    cfg = compose_cfg(*GPT, f"optim={optim}", "trainer.nonfinite=skip")
    c = build(cfg)
    estimate = optimizer_state_bytes(c.stepper.optimizer, c.stepper.params, c.device)
    batches = c.data.train_batches(cfg.data.batch_size, 0, c.device, 0, 1)
    c.stepper.step([next(batches)])
    kinds = {type(s["exp_avg"]).__name__ for s in c.stepper.optimizer.state.values()}
    assert kinds == {
        "Tensor",
        {"adamw8bit": "OptimState8bit", "adamw4bit": "OptimState4bit"}.get(optim, "OptimStateFp8"),
    }
    assert estimate == sum(state_bytes(v) for s in c.stepper.optimizer.state.values() for v in s.values())
    before = snapshot(c.stepper.optimizer)
    loss = c.stepper.task.loss
    c.stepper.task.loss = lambda out, y: loss(out, y) * float("nan")  # type: ignore[method-assign]
    assert c.stepper.step([next(batches)]).skipped
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(c.stepper.optimizer), strict=True))


def snapshot(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Copies of every state tensor, a quantized moment's codes, scales and code book included."""
    tensors = []
    for state in optimizer.state.values():
        for value in state.values():
            parts = [getattr(value, a) for a in ("codes", "scale", "qmap") if hasattr(value, a)] or [value]
            tensors += [p.clone() for p in parts]
    return tensors


def test_a_run_with_adamw8bit_resumes_exactly(tmp_path):
    from conftest import read_jsonl

    from halfprec.training.run import run

    common = [*GPT, "optim=adamw8bit", "trainer.log_every=1", "trainer.val_every=0", "sched.total_steps=4",
              "sched.warmup_steps=1"]  # fmt: skip
    run(compose_cfg(*common, "trainer.max_steps=4"), tmp_path / "whole")
    run(compose_cfg(*common, "trainer.max_steps=2"), tmp_path / "parts")
    run(compose_cfg(*common, "trainer.max_steps=4", "resume=auto"), tmp_path / "parts")
    losses = [[r["train/loss"] for r in read_jsonl(tmp_path / d / "metrics.jsonl")] for d in ("whole", "parts")]
    assert losses[0] == losses[1] and len(losses[0]) == 4


@pytest.mark.parametrize("optim", ["adamw_bf16", pytest.param("adamw8bit", marks=pytest.mark.slow)])
def test_low_precision_state_under_fp16_loss_scaling_and_accumulation(tmp_path, optim):
    """fp16 autocast with its dynamic loss scale, two micro-batches a step and an injected overflow:
    the skip is taken before the optimizer, whose state then trains on as usual."""
    from halfprec.training.run import run

    cfg = compose_cfg("precision=fp16", f"optim={optim}", "optim.lr=3e-3", "accum=2", "trainer.max_steps=60",
                      "trainer.inject_nonfinite_at=[5]", "model.hidden=[64,4096]")  # fmt: skip
    summary = run(cfg, tmp_path)
    assert summary["scaler/skipped_steps"] == 1 and summary["val/acc"] > 0.85


def test_a_low_bit_adamw_with_nothing_to_quantize_is_a_config_error():
    cfg = compose_cfg("optim=adamw8bit", "model.hidden=[16]")  # 64x16 and 16x10: under 4096 values each
    with pytest.raises(ConfigError, match="optim._target_=torchao.optim.AdamW8bit: no parameter of this model has"):
        build(cfg)
