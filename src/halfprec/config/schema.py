"""The types, ranges and allowed values of the config groups whose keys are fixed (halfprec/spec.py
checks them). Defaults live in conf/; a new option of a group is a YAML file that sets these keys,
with no code change. The groups whose keys depend on a choice (model, data, init, task, scaler) take
their schema from the chosen component's own annotated arguments; optim from the optimizer's signature."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from halfprec.spec import Choice, Spec

Dtype = Literal["float32", "float16", "bfloat16"]


@dataclass
class Top:
    """The top-level keys; the groups below are checked by their own schemas."""

    accum: Annotated[int, Spec(low=1, doc="micro-batches per optimizer step, e.g. accum=4")]
    seed: Annotated[int, Spec(low=0, below=2**32, doc="seeds python, numpy and torch")]
    resume: Annotated[str | None, Spec(doc="null, auto or a checkpoint path")]
    # which names a task reports is the task's own list (config/rules.py checks it)
    objective: Annotated[str | None, Spec(doc="null (the task's default), a val/* metric of the task, or train/loss")]
    fail_fast: bool
    task: Any
    precision: Any
    scaler: Any
    init: Any
    model: Any
    data: Any
    optim: Any
    sched: Any
    logger: Any
    trainer: Any
    diagnostics: Any


@dataclass
class Precision:
    name: Annotated[str, Spec(doc="the option's name, in logs and errors")]
    autocast: Dtype | None  # the forward's autocast dtype; null: no autocast (fp32 and pure modes)
    param_dtype: Dtype  # the dtype the weights are stored in
    master_weights: bool  # pure modes: fp32 copies for the optimizer
    master: Annotated[
        Literal["fp32", "remainder"] | None, Spec(doc="how master weights are kept; null: as master_weights says")
    ]
    update: Annotated[str, Spec(doc="a rounding rule of halfprec/numerics/rounding.py: nearest, kahan, stochastic")]
    keep_norm_fp32: bool
    tf32: bool
    reduce_dtype: Dtype  # trainer=fsdp: the dtype gradients are reduce-scattered in
    fp8_emulate: Annotated[bool, Spec(doc="precision.kernel=native: torchao's float8 casts in emulation (any device)")]
    # the names of halfprec/numerics/formats and each rule's keys: config/validate.py, with the registry
    format: Annotated[str | None, Spec(doc="a number format of halfprec/numerics/formats, e.g. mxfp8; null = none")]
    recipe: Any  # numerics/quantized.Recipe (config/validate.py: check_recipe)
    rules: Annotated[
        list[Any], Spec(doc="[{match: <glob on module names>, format: <format> | high, accumulate: <preset>}, ...]")
    ]
    high_first: Annotated[int, Spec(low=0, doc="the first N transformer blocks stay high")]
    high_last: Annotated[int, Spec(low=0, doc="the last N transformer blocks stay high")]
    schedule: Annotated[list[Any], Spec(doc="phases changing GEMMs' formats over the run (numerics/schedule.py)")]
    # a converter of halfprec/numerics/converters
    kernel: Annotated[Literal["emulated", "native"], Spec(doc="how quantized layers compute (numerics/converters)")]
    quantizer: Annotated[
        Literal["auto", "eager", "compiled"],
        Spec(doc="emulated layers' quantizers; auto: compiled on a GPU, and on a CPU from 1000 steps"),
    ]
    # validation in other precisions too (numerics/evaluation.py); the names: config/rules.py check_formats
    eval: Annotated[list[str], Spec(doc="[] or entries high | <format>: val/<metric>@<entry> beside val/*")]
    attention: Any  # numerics/attention.AttentionRecipe (config/validate.py: check_attention)
    # how the quantized layers' GEMMs sum (numerics/accumulate.py's presets; checked with the registry)
    accumulate: Annotated[
        str, Spec(doc="the tensor cores' sums modelled: exact | hopper | hopper_promoted | ampere | ada | blackwell")
    ] = "exact"


@dataclass
class QuantRule:
    match: Annotated[str, Spec(nonempty=True, doc="a glob on module names, e.g. 'blocks.3.*'")]
    format: Annotated[str, Spec(doc="a number format of halfprec/numerics/formats, or high")]
    # how its layers' GEMMs sum (numerics/accumulate.py's presets; checked with the registry)
    accumulate: Annotated[
        str | None, Spec(doc="an accumulation preset for its layers, e.g. hopper_promoted; null = precision.accumulate")
    ] = None


@dataclass
class Phase:
    """One entry of precision.schedule (numerics/schedule.py): when it begins (one of from_step,
    from_fraction, when), and what it changes."""

    format: Annotated[str, Spec(doc="what the GEMMs compute in from then on: a format, or high")]
    gemms: Annotated[
        list[Literal["forward", "dgrad", "wgrad"]], Spec(nonempty=True, doc="the GEMMs it changes (default: all three)")
    ] = field(default_factory=lambda: ["forward", "dgrad", "wgrad"])
    match: Annotated[str | None, Spec(nonempty=True, doc="a glob on module names; null = the quantized layers")] = None
    from_step: Annotated[int | None, Spec(low=1, doc="the step it begins at")] = None
    from_fraction: Annotated[
        float | None, Spec(above=0, below=1, doc="begins after this share of trainer.max_steps (0.9: the last 10%)")
    ] = None
    when: Annotated[
        Literal["grad_noise_below_sqrt3"] | None,
        Spec(doc="a trigger: begins the step after a diagnostics step where diag/grad_noise < sqrt(3)"),
    ] = None

    def start(self, max_steps: int) -> int | None:
        """The step it is set to begin at (0.9 of 400 steps: 361); None: a trigger's, when it fires."""
        if self.from_fraction is not None:
            return math.floor(self.from_fraction * max_steps) + 1
        return self.from_step


@dataclass
class ConstantSchedule:
    name: Literal["constant", "cosine"]
    warmup_steps: Annotated[int, Spec(low=0, doc="linear warmup steps")]


@dataclass
class CosineSchedule(ConstantSchedule):
    min_lr_ratio: Annotated[float, Spec(low=0, high=1, doc="the final lr over the peak lr")]
    total_steps: Annotated[
        int | None, Spec(low=1, doc="the steps the cosine decays over; null: trainer.max_steps (on resume: as before)")
    ]


SCHEDULES: dict[str, type] = {"constant": ConstantSchedule, "cosine": CosineSchedule}


@dataclass
class Trainer:
    max_steps: Annotated[int, Spec(low=1, doc="optimizer steps to run")]
    val_every: Annotated[int, Spec(low=0, doc="optimizer steps between validations; 0 = only at the end")]
    log_every: Annotated[int, Spec(low=1, doc="optimizer steps between metric rows")]
    ckpt_every: Annotated[int, Spec(low=0, doc="optimizer steps between checkpoints; 0 = only at the end")]
    ckpt_keep: Annotated[int, Spec(low=1, doc="checkpoints kept in <run dir>/checkpoints")]
    device: Literal["auto", "cpu", "cuda"]
    threads: Annotated[Literal["auto"] | int, Spec(low=1, doc="torch's CPU threads")]
    nonfinite: Annotated[Literal["skip", "abort"], Spec(doc="what a non-finite step does when nothing scales the loss")]
    deterministic: bool
    progress: bool
    inject_nonfinite_at: Annotated[list[int], Spec(low=1, doc="optimizer steps (1-based), e.g. [3]")]
    loss_weight: Annotated[float, Spec(above=0, doc="1.0 = the plain loss")]
    distributed: Literal["none", "ddp", "fsdp"]
    compile: Annotated[bool, Spec(doc="torch.compile the model")]
    channels_last: Annotated[Literal["auto", True, False], Spec(doc="auto: conv nets on CUDA")]
    count_flops: Annotated[bool, Spec(doc="perf/tflops, perf/mfu")]


@dataclass
class Diagnostics:
    every: Annotated[int, Spec(low=0, doc="optimizer steps between diagnostics rows; 0 = never")]
    activations: bool
    skips: bool
    shadow: Annotated[
        list[str], Spec(doc="number formats whose statistics every Linear layer would have, e.g. [mxfp4,nvfp4]")
    ]
    shadow_attention: Annotated[
        bool, Spec(doc="diagnostics.shadow covers the attention cores' operands too (Q, K, V, P, dO, dS)")
    ] = False


@dataclass
class Optim:
    """The keys every optimizer config has; the others are the optimizer's own arguments."""

    _target_: Annotated[str, Spec(doc="an optimizer class, e.g. torch.optim.SGD")]
    lr: Annotated[float, Spec(low=0, doc="the peak learning rate")]
    clip_grad_norm: Annotated[float | None, Spec(above=0, doc="max global grad norm; null = off")]
    no_decay: Annotated[
        list[str], Spec(nonempty=False, doc="what gets no weight decay: low_dim, embeddings, name globs; [] = none")
    ]
    state_dtype: Annotated[Literal["float32", "bfloat16"], Spec(doc="the dtype optimizer state is stored in")]
    state_rounding: Annotated[Literal["nearest", "stochastic"], Spec(doc="how state is rounded to state_dtype")]
    args: dict[str, Any]  # the optimizer's own arguments: optim's other keys (lr aside)


@dataclass
class Data(Choice):
    batch_size: int  # the micro-batch (config/validate.py checks it, with the loader's arguments)


@dataclass
class Config(Top):
    """The run's config as the code reads it (config/typed.py builds it once validate() has passed):
    the fixed groups as their dataclasses, the components as their choice and arguments, and each
    logger's keys. config/saved.py dumps it as composed (W&B, checkpoints) and reads a checkpoint's
    back. Nothing outside config/ reads the composed DictConfig."""

    task: Choice
    precision: Precision  # with recipe a numerics/quantized.Recipe and rules QuantRules
    scaler: Choice  # scaler.kind and its class's arguments (numerics/scaling.py)
    init: Choice
    model: Choice
    data: Data
    optim: Optim
    sched: ConstantSchedule  # or CosineSchedule
    logger: dict[str, dict[str, Any]]  # each chosen logger's keys (halfprec/loggers)
    trainer: Trainer
    diagnostics: Diagnostics
