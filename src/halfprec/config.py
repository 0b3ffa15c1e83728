"""Validation of the composed config, before anything heavy is built.

Hydra already rejects unknown group options and keys that are not in the composed config
(struct mode). What it cannot know is ranges and cross-field rules; those are here, each a
one-line error that names the key, the value and what would work.
"""

from __future__ import annotations

import difflib
import inspect
import os
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from halfprec.errors import ConfigError, show_value

# `${div:256,${accum}}` in a config: a micro-batch that keeps the effective batch fixed across accum
OmegaConf.register_new_resolver("div", lambda a, b: int(a) // int(b), replace=True)

PRECISIONS = (
    "fp32", "tf32", "fp16", "bf16", "fp16_pure", "bf16_pure", "bf16_pure_kahan", "bf16_pure_stochastic",
    "bf16_pure_master", "fp8", "O0", "O1", "O2", "O3",
)  # fmt: skip
SCALERS = ("auto", "none", "static", "dynamic")
INITS = ("default", "kaiming", "xavier", "fixup")
SCHEDULES = ("constant", "cosine")
DEVICES = ("auto", "cpu", "cuda")
DTYPE_NAMES = ("float32", "float16", "bfloat16")

# The keys each group (or each kind within a group) takes. Hydra's struct mode rejects a typo in
# `key=value`, but `+key=value` adds any key: this catches those instead of ignoring them.
# Model, data, optimizer and init keys are checked against their functions' signatures.
TOP_KEYS = (
    "task",
    "accum",
    "seed",
    "resume",
    "precision",
    "scaler",
    "init",
    "model",
    "data",
    "optim",
    "sched",
    "logger",
    "trainer",
    "diagnostics",
    "objective",
    "fail_fast",
)
DIAGNOSTICS_KEYS = ("every", "activations", "skips")
OBJECTIVES = ("val/acc", "val/loss", "train/loss")
PRECISION_KEYS = (
    "name", "autocast", "param_dtype", "master_weights", "update", "keep_norm_fp32", "tf32", "reduce_dtype", "fp8",
    "fp8_emulate"
)  # fmt: skip
SCALER_KEYS = {
    "none": ("kind", "max_consecutive_skips", "max_overflow_rate"),
    "static": ("kind", "scale", "max_consecutive_skips", "max_overflow_rate"),
    "dynamic": ("kind", "init_scale", "growth_factor", "backoff_factor", "growth_interval", "hysteresis",
                "min_scale", "max_consecutive_skips", "max_overflow_rate"),
}  # fmt: skip
SCALER_KEYS["auto"] = SCALER_KEYS["dynamic"]
SCHED_KEYS = {"constant": ("name", "warmup_steps"), "cosine": ("name", "warmup_steps", "min_lr_ratio")}
LOGGER_KEYS = {"none": ("kind",), "wandb": ("kind", "mode", "project", "entity", "job_type", "tags", "group")}
TRAINER_KEYS = ("max_steps", "val_every", "log_every", "ckpt_every", "ckpt_keep", "device", "threads", "nonfinite",
                "deterministic", "progress", "inject_nonfinite_at", "loss_weight", "distributed", "compile",
                "channels_last", "count_flops")  # fmt: skip


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _positive_int_list(v: Any) -> bool:
    return isinstance(v, ListConfig) and len(v) > 0 and all(_is_int(i) and i >= 1 for i in v)


def _need(cfg: DictConfig, key: str, ok: Callable[[Any], bool], fix: str) -> Any:
    value = OmegaConf.select(cfg, key, default=None)
    if not ok(value):
        raise ConfigError(key, value, fix)
    return value


def _one_of(cfg: DictConfig, key: str, choices: tuple, what: str = "") -> Any:
    return _need(cfg, key, lambda v: v in choices, f"must be one of {', '.join(map(show_value, choices))}{what}")


def _int_at_least(cfg: DictConfig, key: str, low: int, meaning: str) -> int:
    return _need(cfg, key, lambda v: _is_int(v) and v >= low, f"must be an integer >= {low} ({meaning})")


def _positive(cfg: DictConfig, key: str, meaning: str, optional: bool = False) -> Any:
    fix = f"must be a number > 0 ({meaning})" + (", or null" if optional else "")
    return _need(cfg, key, lambda v: (optional and v is None) or (_is_num(v) and v > 0), fix)


def _known_keys(cfg: DictConfig, group: str, allowed, owner: str) -> None:
    node = cfg[group] if group else cfg
    for key in node:
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ConfigError(
                f"{group}.{key}" if group else key,
                node[key],
                f"unknown key for {owner}; {hint}it takes: {', '.join(allowed)}",
            )


def validate(cfg: DictConfig) -> None:
    """Raise ConfigError on the first value that cannot work."""
    _known_keys(cfg, "", TOP_KEYS, "the top level")
    _int_at_least(cfg, "accum", 1, "micro-batches per optimizer step, e.g. accum=4")
    _need(cfg, "seed", lambda v: _is_int(v) and 0 <= v < 2**32, "must be an integer in [0, 2^32)")
    _need(cfg, "resume", lambda v: v is None or isinstance(v, str), "must be null, auto or a checkpoint path")
    _one_of(cfg, "objective", OBJECTIVES)
    _need(cfg, "fail_fast", lambda v: isinstance(v, bool), "must be true or false")

    # precision
    _known_keys(cfg, "precision", PRECISION_KEYS, "precision")
    _one_of(cfg, "precision.name", PRECISIONS)
    _one_of(cfg, "precision.autocast", (None, "float16", "bfloat16"))
    param_dtype = _one_of(cfg, "precision.param_dtype", DTYPE_NAMES)
    update = _one_of(cfg, "precision.update", ("nearest", "kahan", "stochastic"))
    if cfg.precision.autocast and param_dtype != "float32":
        raise ConfigError(
            "precision.autocast", cfg.precision.autocast, "autocast needs fp32 parameters; use null in pure modes"
        )
    if cfg.precision.master_weights and param_dtype == "float32":
        raise ConfigError(
            "precision.master_weights", True, f"precision={cfg.precision.name} keeps fp32 weights already; use false"
        )
    if cfg.precision.master_weights and update != "nearest":
        raise ConfigError(
            "precision.update", update, "applies to low-precision weights without master weights; "
            "set precision.master_weights=false or precision.update=nearest",
        )  # fmt: skip
    if update == "stochastic" and param_dtype != "bfloat16":
        raise ConfigError(
            "precision.update", update, f"stochastic rounding is implemented for bfloat16 weights, not {param_dtype}"
        )
    reduce_dtype = _one_of(cfg, "precision.reduce_dtype", DTYPE_NAMES)
    fp8 = _one_of(cfg, "precision.fp8", (None, "tensorwise", "rowwise"), " (torchao float8 recipes; null = off)")
    _need(cfg, "precision.fp8_emulate", lambda v: isinstance(v, bool), "must be true or false")
    if fp8 and (cfg.precision.autocast != "bfloat16" or param_dtype != "float32"):
        raise ConfigError(
            "precision.fp8", fp8, "float8 Linear layers run inside bf16 autocast on fp32 weights: use precision=fp8"
        )

    # scaler
    kind = _one_of(cfg, "scaler.kind", SCALERS)
    _known_keys(cfg, "scaler", SCALER_KEYS[kind], f"scaler.kind={kind}")
    if kind == "static":
        _positive(cfg, "scaler.scale", "the fixed loss scale, e.g. 128")
    if kind in ("auto", "dynamic"):
        _positive(cfg, "scaler.init_scale", "the first loss scale, e.g. 65536")
        _need(cfg, "scaler.growth_factor", lambda v: _is_num(v) and v > 1, "must be a number > 1, e.g. 2")
        _need(cfg, "scaler.backoff_factor", lambda v: _is_num(v) and 0 < v < 1, "must be in (0, 1), e.g. 0.5")
        _int_at_least(cfg, "scaler.growth_interval", 1, "clean steps before the scale grows")
        _int_at_least(cfg, "scaler.hysteresis", 1, "overflows tolerated before backing off; 1 = torch's rule")
        _positive(cfg, "scaler.min_scale", "the scale floor", optional=True)
    _need(
        cfg,
        "scaler.max_consecutive_skips",
        lambda v: v is None or (_is_int(v) and v >= 1),
        "must be an integer >= 1 or null (never stop)",
    )
    _need(
        cfg,
        "scaler.max_overflow_rate",
        lambda v: v is None or (_is_num(v) and 0 < v <= 1),
        "must be a fraction in (0, 1] of the last 100 steps, or null (never stop), e.g. 0.5",
    )

    # optimizer and schedule
    _need(cfg, "optim._target_", lambda v: isinstance(v, str) and "." in v, "must name an optimizer class")
    _need(cfg, "optim.lr", lambda v: _is_num(v) and v >= 0, "must be a number >= 0 (the peak learning rate)")
    _positive(cfg, "optim.clip_grad_norm", "max global grad norm", optional=True)
    _known_keys(cfg, "sched", SCHED_KEYS[_one_of(cfg, "sched.name", SCHEDULES)], f"sched={cfg.sched.name}")
    _int_at_least(cfg, "sched.warmup_steps", 0, "linear warmup steps")
    if cfg.sched.name == "cosine":
        _need(cfg, "sched.min_lr_ratio", lambda v: _is_num(v) and 0 <= v <= 1, "must be in [0, 1]")

    # logger and trainer
    _known_keys(cfg, "logger", LOGGER_KEYS[_one_of(cfg, "logger.kind", tuple(LOGGER_KEYS))], "logger")
    if cfg.logger.kind == "wandb":
        _one_of(cfg, "logger.mode", ("offline", "online", "disabled"), " (or set WANDB_MODE)")
    _known_keys(cfg, "trainer", TRAINER_KEYS, "trainer")
    _int_at_least(cfg, "trainer.max_steps", 1, "optimizer steps to run")
    _int_at_least(cfg, "trainer.log_every", 1, "optimizer steps between metric rows")
    _int_at_least(cfg, "trainer.val_every", 0, "optimizer steps between validations; 0 = only at the end")
    _int_at_least(cfg, "trainer.ckpt_every", 0, "optimizer steps between checkpoints; 0 = only at the end")
    _int_at_least(cfg, "trainer.ckpt_keep", 1, "checkpoints kept in <run dir>/checkpoints")
    _one_of(cfg, "trainer.device", DEVICES)
    _need(
        cfg,
        "trainer.threads",
        lambda v: v == "auto" or (_is_int(v) and v >= 1),
        "must be auto or an integer >= 1 (torch's CPU threads)",
    )
    mode = _one_of(cfg, "trainer.distributed", ("none", "ddp", "fsdp"))
    _check_launch(mode)
    if mode == "fsdp" and param_dtype != "float32":
        raise ConfigError(
            "precision",
            cfg.precision.name,
            "trainer=fsdp keeps fp32 weight shards (the master weights) and computes in precision.autocast's "
            "dtype through its MixedPrecisionPolicy: use precision=bf16 or fp16 instead of a pure mode",
        )
    if mode != "fsdp" and reduce_dtype != "float32":
        raise ConfigError(
            "precision.reduce_dtype", reduce_dtype, "applies to trainer=fsdp only (DDP and one process reduce in fp32)"
        )
    _need(cfg, "trainer.compile", lambda v: isinstance(v, bool), "must be true or false (torch.compile the model)")
    _need(cfg, "trainer.count_flops", lambda v: isinstance(v, bool), "must be true or false (perf/tflops, perf/mfu)")
    _one_of(cfg, "trainer.channels_last", ("auto", True, False), " (auto: conv nets on CUDA)")
    _need(cfg, "trainer.loss_weight", lambda v: _is_num(v) and v > 0, "must be a number > 0 (1.0 = the plain loss)")
    _one_of(cfg, "trainer.nonfinite", ("skip", "abort"), " (what a non-finite step does when nothing scales the loss)")
    _need(
        cfg,
        "trainer.inject_nonfinite_at",
        lambda v: isinstance(v, ListConfig) and all(_is_int(s) and s >= 1 for s in v),
        "must be a list of optimizer steps (1-based), e.g. [3]",
    )
    _validate_diagnostics(cfg)

    # model, init and data come last: their keys are checked against the registered factories'
    # signatures, which imports torch; every error above answers without it (~1.5 s sooner)
    from halfprec.components.models import MODELS  # light: factories import timm lazily

    arch = _one_of(cfg, "model.arch", tuple(MODELS), " (models registered in halfprec.components.models)")
    _known_keys(cfg, "model", ["arch", *MODELS[arch].arguments()], f"model.arch={arch}")
    for key in ("hidden", "widths"):
        if key in cfg.model:
            _need(
                cfg, f"model.{key}", _positive_int_list, "must be a non-empty list of positive integers, e.g. [64, 64]"
            )
    if "blocks_per_stage" in cfg.model:
        _int_at_least(cfg, "model.blocks_per_stage", 1, "residual blocks per stage")
    scheme = _one_of(cfg, "init.scheme", INITS)
    from halfprec.components.init import INIT_SCHEMES

    init_args = [a for a in inspect.signature(INIT_SCHEMES[scheme]).parameters if a != "model"]
    extra = ["scalar_lr_scale"] if scheme == "fixup" else []
    _known_keys(cfg, "init", ["scheme", *init_args, *extra], f"init={scheme}")
    if scheme == "fixup" and not MODELS[arch].residual:
        residual = ", ".join(f"model={name}" for name, entry in MODELS.items() if entry.residual)
        raise ConfigError("init", "fixup", f"model={arch} has no residual branches; Fixup supports {residual}")
    if scheme == "kaiming":
        if cfg.init.zero_init_last and arch != "timm" and not MODELS[arch].residual:
            raise ConfigError("init.zero_init_last", True, f"model={arch} has no residual branches to zero")
        _one_of(cfg, "init.conv_mode", ("fan_in", "fan_out"))
        _one_of(cfg, "init.linear_mode", ("fan_in", "fan_out"))
        _one_of(cfg, "init.distribution", ("normal", "uniform"))
    if scheme == "xavier":
        _one_of(cfg, "init.distribution", ("normal", "uniform"))
    if scheme == "fixup":
        _positive(cfg, "init.scalar_lr_scale", "lr multiplier of Fixup's scalar biases", optional=True)

    from halfprec.components.tasks import TASKS

    task = _one_of(cfg, "task.name", tuple(TASKS), " (tasks registered in halfprec.components.tasks)")
    _known_keys(cfg, "task", ["name", *inspect.signature(TASKS[task]).parameters], f"task={task}")

    # data
    from halfprec.components.data import DATASETS  # light: sklearn is imported inside load_digits

    name = _one_of(cfg, "data.name", tuple(DATASETS))
    batch = _int_at_least(cfg, "data.batch_size", 1, "the micro-batch size; effective batch = batch_size * accum")
    loader_args = inspect.signature(DATASETS[name]).parameters
    _known_keys(cfg, "data", ["name", "batch_size", *loader_args], f"data={name}")
    limit = None
    if name == "digits":
        _need(cfg, "data.val_size", lambda v: _is_int(v) and 1 <= v < 1797, "must be an integer in [1, 1796]")
        limit = 1797 - cfg.data.val_size
    elif name == "synthetic":
        limit = _int_at_least(cfg, "data.num_train", 1, "training samples")
        _int_at_least(cfg, "data.num_val", 1, "validation samples")
    if limit is not None and batch > limit:
        raise ConfigError("data.batch_size", batch, f"must be <= the {limit} training samples")
    _check_disk_data(cfg)


def _validate_diagnostics(cfg: DictConfig) -> None:
    _known_keys(cfg, "diagnostics", DIAGNOSTICS_KEYS, "diagnostics")
    every = _int_at_least(cfg, "diagnostics.every", 0, "optimizer steps between diagnostics rows; 0 = never")
    for key in ("activations", "skips"):
        _need(cfg, f"diagnostics.{key}", lambda v: isinstance(v, bool), "must be true or false")
    if cfg.diagnostics.activations and every == 0:
        raise ConfigError(
            "diagnostics.activations", True, "needs diagnostics.every > 0 (or diagnostics=grads) to take effect"
        )


def _check_disk_data(cfg: DictConfig) -> None:
    """The keys of datasets read from disk (cifar10, imagefolder). Whether data.root holds the data is
    checked when the dataset is built, by the loader that knows its files."""
    data = cfg.data
    if "root" in data:
        _need(cfg, "data.root", lambda v: isinstance(v, str) and v != "", "must be the dataset's directory")
    for key in ("download", "verify", "pin_memory"):
        if key in data:
            _need(cfg, f"data.{key}", lambda v: isinstance(v, bool), "must be true or false")
    if "image_size" in data:
        _int_at_least(cfg, "data.image_size", 1, "the side of the square crops the model sees, e.g. 224")
    if "num_workers" in data:
        workers = _need(
            cfg,
            "data.num_workers",
            lambda v: v == "auto" or (_is_int(v) and v >= 0),
            "must be auto or an integer >= 0 (DataLoader processes; 0 = load in the training process)",
        )
        persistent = _need(
            cfg,
            "data.persistent_workers",
            lambda v: v is None or isinstance(v, bool),
            "must be true, false or null (null: true when data.num_workers > 0)",
        )
        if persistent and workers == 0:
            raise ConfigError(
                "data.persistent_workers",
                True,
                "keeps DataLoader worker processes between epochs, but data.num_workers=0 starts none: "
                "set data.num_workers >= 1 (e.g. 4), or data.persistent_workers=null",
            )


def validate_optimizer(cfg: DictConfig) -> None:
    """Check optim.* against the optimizer's own signature (imports torch)."""
    from hydra.utils import get_class

    try:
        cls = get_class(cfg.optim._target_)
    except Exception:
        raise ConfigError("optim._target_", cfg.optim._target_, "no such class; e.g. torch.optim.SGD") from None
    import torch

    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(
            "optim._target_",
            cfg.optim._target_,
            "must be a torch.optim.Optimizer subclass: master weights, skipped steps and checkpoints "
            "rely on its param_groups and state_dict",
        )
    allowed = ["_target_", "clip_grad_norm", *(p for p in inspect.signature(cls).parameters if p != "params")]
    _known_keys(cfg, "optim", allowed, cls.__name__)


def _check_launch(mode: str) -> None:
    """trainer.distributed and the launcher must agree; either mismatch would train wrongly in silence."""
    torchrun = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    if mode != "none" and not torchrun:
        raise ConfigError(
            "trainer.distributed", mode, f"start it with torchrun: torchrun --nproc_per_node=2 train.py trainer={mode}"
        )
    if mode == "none" and torchrun and int(os.environ["WORLD_SIZE"]) > 1:
        raise ConfigError(
            "trainer.distributed",
            mode,
            f"started by torchrun with WORLD_SIZE={os.environ['WORLD_SIZE']}, every process would train alone: "
            "add trainer=ddp (or trainer=fsdp)",
        )


def resolve_device(cfg: DictConfig):
    """The torch.device to train on, after checking that the precision mode works there."""
    import torch

    want = cfg.trainer.device
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device", want, "no CUDA GPU is visible here; use trainer.device=auto or cpu")
    device = torch.device("cuda" if want == "auto" and torch.cuda.is_available() else want.replace("auto", "cpu"))
    p = cfg.precision
    if p.tf32 and device.type != "cuda":
        raise ConfigError(
            "precision", p.name, "TF32 is a CUDA (Ampere+) matmul mode; on CPU it would silently be fp32: use fp32"
        )
    if p.fp8:
        _check_fp8(p, device)
    uses_bf16 = "bfloat16" in (p.autocast, p.param_dtype)
    if uses_bf16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("precision", p.name, "this GPU has no bfloat16 support; use fp16 or fp16_pure")
    return device


def _check_fp8(p: DictConfig, device) -> None:
    """float8 matmuls need torchao and, unless emulated, fp8 tensor cores: say which is missing."""
    import importlib.util

    import torch

    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("precision", p.name, 'needs torchao: pip install -e ".[fp8]"')
    if p.fp8_emulate:
        return
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        where = torch.cuda.get_device_name(device) if device.type == "cuda" else "a CPU"
        raise ConfigError(
            "precision",
            p.name,
            f"float8 matmuls need a CUDA GPU of compute capability 8.9+ (H100, H200, L4, RTX 4090); this is {where}: "
            "use precision=bf16, or precision.fp8_emulate=true to check the numerics (slowly)",
        )
