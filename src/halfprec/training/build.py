"""build(config): every component of a run, from the typed config (docs/design.md, "Layers")."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from torch import nn

from halfprec.components.data import DATASETS, Dataset, Split, build_dataset
from halfprec.components.init import apply_init
from halfprec.components.models import MODELS, create_model
from halfprec.components.tasks import build_task
from halfprec.config import Config, as_config, resolve_device
from halfprec.config.schema import CosineSchedule, Optim
from halfprec.errors import ConfigError, show_value
from halfprec.numerics.optimizers import optimizer_arguments
from halfprec.numerics.param_groups import param_groups, without_decay
from halfprec.numerics.params import ParamStrategy, build_params
from halfprec.numerics.policy import PrecisionPolicy
from halfprec.numerics.quantized import keep_eager
from halfprec.numerics.scaling import build_scaler
from halfprec.training import distributed
from halfprec.training.distributed import World
from halfprec.training.step import Stepper


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def build_optimizer(cfg: Config, params: ParamStrategy, model: nn.Module) -> torch.optim.Optimizer:
    """`optim._target_` (or, with optim.state_dtype=bfloat16, halfprec's class that keeps its state
    low: numerics/optimizers.py) over param groups (numerics/param_groups.py): no weight decay for
    what `optim.no_decay` names; with Fixup, biases and scales at lr * init.scalar_lr_scale, chosen
    by name as in the authors' code (the classifier bias too)."""
    o = cfg.optim
    kwargs = optimizer_arguments({"_target_": o._target_, "lr": o.lr, **o.args}, o.state_dtype, o.state_rounding)
    named = params.named()
    lr_scale = cfg.init.args.get("scalar_lr_scale")  # init=fixup's key alone (config/validate.py)
    last = {n: n.rsplit(".", 1)[-1] for n, _ in named}
    slow = frozenset(n for n in last if lr_scale and ("bias" in last[n] or "scale" in last[n]))
    exempt = without_decay(named, model, list(cfg.optim.no_decay), params.model_params)
    # an optimizer without a weight_decay argument decays nothing
    groups = param_groups(named, exempt, o.args.get("weight_decay", 0.0), slow, o.lr * (lr_scale or 1))
    try:
        optimizer = instantiate(kwargs, groups, _convert_="all")
    except Exception as err:  # torch's own argument checks ("Invalid weight_decay value: -1")
        cause = err.__cause__ or err
        raise ConfigError("optim", cfg.optim._target_, f"{type(cause).__name__}: {cause}") from None
    check_low_bit(optimizer, [t for _, t in named], cfg.optim._target_)
    return optimizer


def optimizer_line(optim: Optim) -> str:
    """The optimizer and the values it runs with, for the start of a run: a task's values reach only
    the optimizers conf/task_optim/ has a file for (task=lm optim=sgd runs on SGD's own), so they are
    worth seeing."""
    shown = {"lr": optim.lr, "clip_grad_norm": optim.clip_grad_norm, **optim.args}
    if optim.state_dtype != "float32":
        shown |= {"state_dtype": optim.state_dtype, "state_rounding": optim.state_rounding}
    values = " ".join(f"{k}={show_value(v)}" for k, v in shown.items() if v is not None)
    name = str(optim._target_).rsplit(".", 1)[-1]
    return f"optim: {name} {values}"


def check_low_bit(optimizer: torch.optim.Optimizer, tensors: list[torch.Tensor], target: str) -> None:
    """torchao's low-bit AdamW quantizes the moments of tensors of at least 4096 values, a multiple
    of its block, and keeps fp32 moments for the rest: with none it would silently be plain AdamW."""
    block = getattr(optimizer, "block_size", None)
    if not target.startswith("torchao.optim.") or block is None:
        return
    if not any(t.numel() >= 4096 and t.numel() % block == 0 for t in tensors):
        raise ConfigError(
            "optim._target_", target, f"no parameter of this model has 4096 or more values in whole blocks of "
            f"{block}, so every moment would stay fp32: use optim=adamw (or a larger model)",
        )  # fmt: skip


def lr_factor(step: int, name: str, warmup: int, total: int, low: float) -> float:
    """The lr over optim.lr at scheduler step `step`: linear warmup, then constant, or a cosine from
    1 down to `low` (sched.min_lr_ratio) at step `total` (sched.total_steps), and `low` after it."""
    if step < warmup:
        return (step + 1) / warmup
    if name == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return low + (1 - low) * 0.5 * (1 + math.cos(math.pi * progress))


def schedule_args(cfg: Config) -> tuple[str, int, int, float]:
    """lr_factor's arguments from the config (sched.total_steps: null is trainer.max_steps; run()
    fills it in, from the checkpoint on resume). A constant schedule has no horizon or end value."""
    sched = cfg.sched
    if not isinstance(sched, CosineSchedule):
        return sched.name, sched.warmup_steps, cfg.trainer.max_steps, 1.0
    return sched.name, sched.warmup_steps, sched.total_steps or cfg.trainer.max_steps, sched.min_lr_ratio


def build_scheduler(cfg: Config, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    # plain values, read once: LambdaLR calls `factor` every step
    args = schedule_args(cfg)

    def factor(step: int) -> float:
        return lr_factor(step, *args)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@dataclass
class Components:
    """Everything a training run is built from; `build(cfg)` makes it, tests and forks reuse it. The
    parts the optimizer step works with (task, policy, params, optimizer, scheduler, scaler) are the
    stepper's: read them there (`c.stepper.scaler`)."""

    model: nn.Module
    data: Dataset
    device: torch.device
    stepper: Stepper
    world: World = field(default_factory=World)
    compiled: nn.Module | None = None  # torch.compile(stepper.net) when trainer.compile=true


def build(cfg: Config | DictConfig, world: World | None = None, device: torch.device | None = None) -> Components:
    """Seed, and build model, precision policy, optimizer, schedule and scaler from a validated config
    (run() validates first; a notebook or a test calls halfprec.config.validate(cfg) itself) on
    `device` (run() resolves it; None: resolve_device)."""
    cfg = as_config(cfg)
    world = world or World()
    device = device if device is not None else resolve_device(cfg.trainer.device, cfg.precision)
    if device.type == "cuda" and world.enabled:
        device = torch.device("cuda", torch.cuda.current_device())  # the GPU distributed.init chose
    seed_everything(cfg.seed, cfg.trainer.deterministic)
    data = build_dataset(cfg.data)
    model = create_model(cfg.model, data.input_shape, data.num_classes)
    apply_init(model, cfg.init)
    model.to(device)
    check_model_reads(model, cfg, data, device)
    policy = PrecisionPolicy.from_config(cfg.precision, device.type, cfg.trainer.max_steps)
    policy.apply_backend_flags()
    policy.prepare_model(model)
    policy.quantize_layers(model, cfg.seed, world.rank)
    policy.plan_evaluations(model)
    if use_channels_last(cfg.trainer.channels_last, model, device):
        model.to(memory_format=torch.channels_last)  # convs then pick NHWC kernels (faster with AMP on GPUs)
    # same seed, so the same weights on every rank (DDP also broadcasts rank 0's); FSDP shards
    # them in place, so this comes before the optimizer takes the parameters
    net = distributed.wrap(model, world, device, cfg.trainer.distributed, policy)
    params = build_params(model, policy)
    optimizer = build_optimizer(cfg, params, model)
    scheduler = build_scheduler(cfg, optimizer)
    scaler = build_scaler(cfg.scaler, policy.uses_fp16)
    task = build_task(cfg.task)
    clip, weight = cfg.optim.clip_grad_norm, cfg.trainer.loss_weight
    stepper = Stepper(net, task, policy, params, optimizer, scheduler, scaler, clip, weight)
    # the checkpoints keep saving `model` itself: no `_orig_mod.` prefixes in their keys
    # torch.compile types its result as a callable; given a Module it returns one (an OptimizedModule)
    compiled = None
    if cfg.trainer.compile:
        keep_eager(model)
        compiled = cast(nn.Module, torch.compile(net))
    return Components(model, data, device, stepper, world, compiled)


def check_model_reads(model: nn.Module, cfg: Config, data: Dataset, device: torch.device) -> None:
    """One validation sample through the model, in eval mode and without gradients (no state or
    random number changes): a model that cannot read the data's samples (a conv net given vectors,
    channels where it wants an image) is a config error naming both here, not a traceback in step 1."""
    sample = data.val.x[:1] if isinstance(data.val, Split) else data.val[0][0].unsqueeze(0)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(sample.to(device))
    except (RuntimeError, ValueError, AssertionError) as err:  # torch's shape checks, timm's asserts
        cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        fix = "set data.shape to one it reads ([C, H, W] for a conv net)"
        fix = fix if "shape" in cfg.data.args else "use a dataset whose samples it reads"
        mlp = MODELS.get("mlp")
        if mlp is not None and cfg.model.name != "mlp" and mlp.reads == DATASETS[cfg.data.name].inputs:
            fix += ", or model=mlp (it reads any shape)"
        raise ConfigError(
            "model", cfg.model.name, f"cannot read data={cfg.data.name}'s samples of shape {list(data.input_shape)} "
            f"(one sample's forward failed: {cause}): {fix}",
        ) from err  # fmt: skip
    finally:
        model.train(training)


def use_channels_last(choice: str | bool, model: nn.Module, device: torch.device) -> bool:
    """trainer.channels_last: auto = for conv nets on CUDA, where NHWC convolutions are faster."""
    if choice == "auto":
        return device.type == "cuda" and any(isinstance(m, nn.Conv2d) for m in model.modules())
    return bool(choice)
