"""run(cfg): build everything from the config, train, evaluate, log. Returns the final metrics."""

from __future__ import annotations

import contextlib
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn

from halfprec.config import resolve_device, validate, validate_optimizer
from halfprec.data import Batches, Dataset, build_dataset, eval_batches
from halfprec.init import apply_init
from halfprec.models import create_model
from halfprec.precision import OptimizerParams, PrecisionPolicy, observe_compute_dtypes
from halfprec.progress import Progress
from halfprec.scaling import LossScaler, build_scaler
from halfprec.step import optimizer_step
from halfprec.tracking import build_tracker


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def build_optimizer(cfg: DictConfig, params: OptimizerParams, model: nn.Module) -> torch.optim.Optimizer:
    """`optim._target_` over the optimizer's tensors; Fixup's scalar biases get lr * scalar_lr_scale."""
    kwargs = {k: v for k, v in cfg.optim.items() if k != "clip_grad_norm"}
    lr_scale = cfg.init.get("scalar_lr_scale")
    scalars = {n for n, p in model.named_parameters() if p.numel() == 1} if lr_scale else set()
    groups = [{"params": [p for n, p in params.named() if n not in scalars]}]
    if scalars:
        groups.append({"params": [p for n, p in params.named() if n in scalars], "lr": cfg.optim.lr * lr_scale})
    return instantiate(kwargs, groups, _convert_="all")


def build_scheduler(cfg: DictConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    warmup, total = cfg.sched.warmup_steps, cfg.trainer.max_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if cfg.sched.name == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        low = cfg.sched.min_lr_ratio
        return low + (1 - low) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@torch.no_grad()
def evaluate(model: nn.Module, data: Dataset, policy: PrecisionPolicy, batch_size: int, device) -> dict:
    model.eval()
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device, dtype=torch.int64)
    for x, y in eval_batches(data.val, max(batch_size, 256), device):
        with policy.autocast():
            logits = model(policy.cast_input(x)).float()
        loss_sum += F.cross_entropy(logits, y, reduction="sum")
        correct += (logits.argmax(1) == y).sum()
    model.train()
    n = len(data.val.y)
    return {"val/loss": loss_sum.item() / n, "val/acc": correct.item() / n}


@dataclass
class Components:
    """Everything a training run is built from; `build(cfg)` makes it, tests and forks reuse it."""

    model: nn.Module
    data: Dataset
    policy: PrecisionPolicy
    params: OptimizerParams
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: LossScaler
    device: torch.device


def build(cfg: DictConfig) -> Components:
    """Validate `cfg`, seed, and build model, precision policy, optimizer, schedule and scaler."""
    validate(cfg)
    validate_optimizer(cfg)
    device = resolve_device(cfg)
    seed_everything(cfg.seed, cfg.trainer.deterministic)
    data = build_dataset(cfg.data)
    model = create_model(cfg.model, data.input_shape, data.num_classes)
    apply_init(model, cfg.init)
    model.to(device)
    policy = PrecisionPolicy.from_config(cfg.precision, device.type)
    policy.apply_backend_flags()
    policy.prepare_model(model)
    params = OptimizerParams(model, policy)
    optimizer = build_optimizer(cfg, params, model)
    scheduler = build_scheduler(cfg, optimizer)
    scaler = build_scaler(cfg.scaler, policy.uses_fp16)
    return Components(model, data, policy, params, optimizer, scheduler, scaler, device)


def run(cfg: DictConfig, run_dir: str | Path) -> dict:
    """Train as `cfg` says, writing metrics under `run_dir`. Returns the final metrics."""
    c = build(cfg)
    batches = Batches(c.data.train, cfg.data.batch_size, cfg.seed, c.device)
    tracker = build_tracker(cfg, Path(run_dir))
    summary: dict = {"exit_code": 1}
    try:
        summary = train_loop(cfg, c, batches, tracker)
    finally:
        tracker.finish(summary)
    return summary


def train_loop(cfg: DictConfig, c: Components, batches: Batches, tracker) -> dict:
    model, policy, params, scaler = c.model, c.policy, c.params, c.scaler
    t = cfg.trainer
    per_step = cfg.data.batch_size * cfg.accum
    inject = set(t.inject_nonfinite_at)
    start = last_time = time.perf_counter()
    last_step, skipped_before, final = 0, 0, {}
    clean_loss_sum, clean_steps = torch.zeros((), device=c.device), 0
    model.train()
    with Progress(t.max_steps, enabled=t.progress) as progress:
        for step in range(1, t.max_steps + 1):
            micro = [next(batches) for _ in range(cfg.accum)]
            if step in inject:  # fault injection for checking the skip path end to end
                x, y = micro[-1]
                micro[-1] = (torch.full_like(x, float("inf")), y)
            watch = observe_compute_dtypes(model) if step == 1 else contextlib.nullcontext()
            with watch as seen:
                result = optimizer_step(
                    model, micro, c.optimizer, c.scheduler, scaler, policy, params, cfg.optim.clip_grad_norm
                )
            row = {}
            if step == 1:  # never silently train in another precision than asked
                row.update(policy.check(model, seen, params.master))
            if not result.skipped:  # a skipped step's loss is often inf: keep it out of the mean
                clean_loss_sum += result.loss
                clean_steps += 1

            if step == 1 or step % t.log_every == 0 or step == t.max_steps:
                now = time.perf_counter()
                n = step - last_step
                loss = clean_loss_sum / clean_steps if clean_steps else result.loss
                row.update(
                    {
                        "train/loss": loss.item(),
                        "train/lr": c.optimizer.param_groups[0]["lr"],
                        "train/grad_norm": result.grad_norm.item(),
                        "scaler/skipped": scaler.skipped_steps - skipped_before,
                        **scaler.metrics(),
                        "perf/samples_per_s": n * per_step / (now - last_time),
                        "perf/step_ms": 1000 * (now - last_time) / n,
                    }
                )
                if c.device.type == "cuda":
                    row["perf/max_mem_mb"] = torch.cuda.max_memory_allocated() / 2**20
                clean_loss_sum.zero_()
                clean_steps, last_step, last_time, skipped_before = 0, step, now, scaler.skipped_steps
            if (t.val_every and step % t.val_every == 0) or step == t.max_steps:
                row.update(evaluate(model, c.data, policy, cfg.data.batch_size, c.device))
            if row:
                row = {"step": step, "samples": step * per_step, **row}
                tracker.log(row)
                final.update(row)
                progress.update(step, final, scaler)
    elapsed = time.perf_counter() - start
    summary = {
        "train/loss": final["train/loss"],
        "val/loss": final["val/loss"],
        "val/acc": final["val/acc"],
        "scaler/skipped_steps": scaler.skipped_steps,
        "scaler/min_scale": scaler.min_seen,
        "scaler/max_scale": scaler.max_seen,
        "scaler/final_scale": scaler.scale,
        **{k: v for k, v in final.items() if k.startswith("precision/")},
        "steps": t.max_steps,
        "wall_s": elapsed,
        "exit_code": 0,
    }
    print(
        f"done: {t.max_steps} steps in {elapsed:.1f}s | train/loss {summary['train/loss']:.4f} | "
        f"val/acc {summary['val/acc']:.4f} | skipped {scaler.skipped_steps} | scale {scaler.scale:g} "
        f"(min {scaler.min_seen:g}, max {scaler.max_seen:g})",
        file=sys.stderr,
    )
    return summary
