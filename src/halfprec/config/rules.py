"""The rules that span keys: combinations of valid values that cannot work together, and what the
machine must offer (a GPU, torchao, a launcher). Each raises one ConfigError line."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, cast

from omegaconf import DictConfig, OmegaConf

from halfprec.config.schema import Config, Phase, Precision
from halfprec.config.typed import precision_of
from halfprec.errors import ConfigError
from halfprec.machine import cpu_flags, launcher, native_bf16
from halfprec.numerics.settings import HIGH

if TYPE_CHECKING:
    import torch


def check_precision(p: DictConfig, distributed: str) -> None:
    """The precision group's keys together, and with trainer.distributed."""
    if p.autocast and p.param_dtype != "float32":
        raise ConfigError("precision.autocast", p.autocast, "autocast needs fp32 parameters; use null in pure modes")
    master = master_kind(p)
    key = "precision.master" if p.get("master") else "precision.master_weights"
    if master != "none" and p.param_dtype == "float32":
        raise ConfigError(key, p.get("master") or True, f"precision={p.name} keeps fp32 weights already; use null")
    if master != "none" and p["update"] != "nearest":  # p.update would be DictConfig.update()
        raise ConfigError(
            "precision.update", p["update"], f"applies to low-precision weights without master weights ({key} "
            "keeps them); set precision.update=nearest",
        )  # fmt: skip
    if master == "remainder" and p.param_dtype != "bfloat16":
        raise ConfigError(
            "precision.master", "remainder", f"splits fp32 masters into bf16 weights and 16-bit remainders, "
            f"not {p.param_dtype} ones: use precision=bf16_pure",
        )  # fmt: skip
    if p["update"] in ("stochastic", "remainder") and p.param_dtype != "bfloat16":
        raise ConfigError(
            "precision.update",
            p["update"],
            f"implemented for bfloat16 weights, not {p.param_dtype}",
        )
    check_layer_formats(p)
    if distributed == "fsdp" and p.param_dtype != "float32":
        raise ConfigError(
            "precision",
            p.name,
            "trainer=fsdp keeps fp32 weight shards (the master weights) and computes in precision.autocast's "
            "dtype through its MixedPrecisionPolicy: use precision=bf16 or fp16 instead of a pure mode",
        )
    if distributed == "fsdp" and p.get("eval"):
        raise ConfigError(
            "precision.eval", list(p["eval"]), "is not supported with trainer=fsdp (FSDP2 gathers the weights into the "
            "modules it wrapped, which the evaluation swaps): use trainer=ddp or one process, or halfprec evaluate "
            "on the run's checkpoint",
        )  # fmt: skip
    if distributed != "fsdp" and p.reduce_dtype != "float32":
        raise ConfigError(
            "precision.reduce_dtype",
            p.reduce_dtype,
            "applies to trainer=fsdp only (DDP and one process reduce in fp32)",
        )


def master_kind(p: DictConfig) -> str:
    """none, fp32 (copies: precision.master=fp32 or master_weights=true) or remainder."""
    return p.get("master") or ("fp32" if p.master_weights else "none")


def quantizes(p: DictConfig) -> bool:
    """Whether any layer is quantized: a format, or a rule naming one; or attention (precision.attention)."""
    linears = p.format or any(r.format != HIGH for r in p.rules) or any(s.format != HIGH for s in p.schedule)
    return bool(linears or p.attention.format)


def check_layer_formats(p: DictConfig) -> None:
    """The high blocks apply to quantized layers (the recipe too: check_formats)."""
    quantized = quantizes(p)
    for key in ("high_first", "high_last"):
        if p[key] and not quantized:
            raise ConfigError(
                f"precision.{key}", p[key], "keeps blocks high while the others are quantized: name a format too, "
                "e.g. precision=mxfp4 or precision.format=nvfp4",
            )  # fmt: skip


def check_formats(p: DictConfig, formats: dict[str, Any]) -> None:
    """The format names against the registry (`formats`: numerics/formats' FORMATS), the one check of
    them; then what the converter precision.kernel names says of precision.*, typed (numerics/converters)."""
    from halfprec.numerics.converters import CONVERTERS
    from halfprec.numerics.quantized import Recipe

    off = Recipe()
    switched = {k: v for k, v in p.recipe.items() if v != getattr(off, str(k))}  # away from its off value
    if switched and not quantizes(p):
        key, value = next(iter(switched.items()))
        raise ConfigError(
            f"precision.recipe.{key}", value, "applies to precision.format's layers; no layer is quantized"
        )

    gemms = ("forward", "dgrad", "wgrad")
    all_high = all(p.recipe[g] == HIGH for g in gemms) and all(s.format == HIGH for s in p.schedule)
    if quantizes(p) and all_high and not p.attention.format:
        raise ConfigError(
            "precision.recipe.forward/dgrad/wgrad", HIGH, "keeps all three GEMMs of every layer high, so nothing "
            "is quantized: set one of them to null (the layer's format), or use precision=bf16 for no quantized layer",
        )  # fmt: skip
    names = ", ".join(formats)
    for key in ("format", "recipe.grad_format"):
        value = p.format if key == "format" else p.recipe.grad_format
        if value is not None and value not in formats:
            raise ConfigError(f"precision.{key}", value, f"no such number format; they are {names}")
    for gemm in ("forward", "dgrad", "wgrad"):
        value = p.recipe[gemm]
        if value is not None and value not in (HIGH, *formats):
            raise ConfigError(f"precision.recipe.{gemm}", value, f"null (the layer's format), high, or a format "
                              f"({names})")  # fmt: skip
    for i, rule in enumerate(p.rules):
        if rule.format not in (HIGH, *formats):
            raise ConfigError(f"precision.rules[{i}].format", rule.format, f"a format ({names}) or high")
    for i, phase in enumerate(p.schedule):
        if phase.format not in (HIGH, *formats):
            raise ConfigError(f"precision.schedule[{i}].format", phase.format, f"a format ({names}) or high")
    check_eval(p["eval"], formats)
    check_attention_formats(p.attention, formats)
    precision = precision_of(cast(dict, OmegaConf.to_container(p, resolve=True)))  # a mapping: check_node
    CONVERTERS[precision.kernel].check_config(precision)


def check_eval(entries: Any, formats: dict[str, Any]) -> None:
    """precision.eval: high or format names, each once (a key per entry). Every kernel takes them: the
    evaluation's layers are emulated (numerics/evaluation.py), on native float8 layers' weights too."""
    for entry in entries:
        if entry not in (HIGH, *formats) or list(entries).count(entry) > 1:
            again = " once each" if entry in (HIGH, *formats) else ""
            raise ConfigError("precision.eval", entry, f"a list of high and formats{again}, e.g. [high, mxfp4, "
                              f"nvfp4] (the formats: {', '.join(formats)})")  # fmt: skip


def check_attention_formats(a: DictConfig, formats: dict[str, Any]) -> None:
    """precision.attention's format names, and its other keys only where its format turns it on."""
    names = ", ".join(formats)
    if a.format is not None and a.format not in formats:
        raise ConfigError("precision.attention.format", a.format, f"no such number format; they are {names}")
    for gemm in ("forward", "backward"):
        if a[gemm] is not None and a[gemm] not in (HIGH, *formats):
            raise ConfigError(f"precision.attention.{gemm}", a[gemm], f"null (precision.attention.format), high, or "
                              f"a format ({names})")  # fmt: skip
    switched = [k for k, off in (("forward", None), ("backward", None), ("hadamard", False)) if a[k] != off]
    if switched and a.format is None:
        raise ConfigError(f"precision.attention.{switched[0]}", a[switched[0]], "applies to quantized attention: set "
                          "precision.attention.format too (null keeps torch's fused attention)")  # fmt: skip
    if a.forward == HIGH and a.backward == HIGH:
        raise ConfigError("precision.attention.forward/backward", HIGH, "keeps every attention GEMM high, so nothing "
                          "is quantized: set one to null, or precision.attention.format=null")  # fmt: skip


def check_scaler(s: DictConfig) -> None:
    """A dynamic scaler's floor must be at most its first scale (it would start below its floor)."""
    floor, first = s.get("min_scale"), s.get("init_scale")
    if floor is not None and first is not None and floor > first:
        raise ConfigError(
            "scaler.min_scale",
            floor,
            f"above scaler.init_scale={first:g}: the floor must be at most the first scale",
        )


def config_warnings(cfg: Config, device_type: str = "cpu") -> list[str]:
    """Settings that work but rarely do what was meant, or much slower than a user would guess: one
    line each, printed as the run starts."""
    found = [slow] if (slow := slow_on_cpu(cfg.precision)) and device_type == "cpu" else []
    warmup, steps = cfg.sched.warmup_steps, cfg.trainer.max_steps
    if warmup > steps:
        found.append(
            f"sched.warmup_steps={warmup} is beyond trainer.max_steps={steps}: the run ends during the warmup, "
            f"at {steps / warmup:.0%} of optim.lr"
        )
    if cfg.trainer.val_every == 0:
        found.append("trainer.val_every=0: validation runs once, after the last step")
    if cfg.diagnostics.every == 0 and cfg.diagnostics.skips:  # diagnostics=grads diagnostics.every=0
        found.append(
            "diagnostics.every=0: no diagnostics rows (per-layer gradients, update_lost, ...), only the layer each "
            "skipped step's inf/NaN came from (diagnostics.skips): set diagnostics.every > 0 for the rows"
        )
    for i, phase in enumerate(cfg.precision.schedule):
        start = getattr(phase, "from_step", None)  # from_fraction is below 1: always within the run
        if start is not None and start > steps:
            found.append(
                f"precision.schedule[{i}].from_step={start} is beyond trainer.max_steps={steps}: the phase never "
                f"begins in this run (resumed with trainer.max_steps >= {start}, it would)"
            )
    return found


def slow_on_cpu(p: Precision) -> str | None:
    """The precision modes a CPU computes exactly but far slower than fp32 (docs/benchmarks.md has the
    figures)."""
    dtypes = {p.autocast, p.param_dtype}
    advice = "exact, so fine for checking numerics; for speed use precision=fp32 here, or a GPU"
    if "float16" in dtypes:
        return (f"precision={p.name} computes in fp16, which torch's CPU kernels (convolutions above all) run "
                f"far slower than fp32: {advice}")  # fmt: skip
    if "bfloat16" in dtypes and native_bf16(cpu_flags()) is False:
        if p.format and p.autocast == "bfloat16":  # the format's layers are fp32 arithmetic already
            advice = "precision.autocast=null keeps the other layers in fp32 here (then compare with precision=fp32)"
        return (f"precision={p.name} computes in bf16 and this CPU has no bf16 units (AVX512-BF16, AMX): torch "
                f"emulates it, about 10x slower than fp32: {advice}")  # fmt: skip
    return None


def check_schedule(p: DictConfig, every: int, max_steps: int) -> None:
    """precision.schedule's phases begin in the order listed (numerics/schedule.py): a phase set to begin
    before the one listed above it is an error, not a silent wait; a trigger reads diagnostics rows."""
    last = 0
    for i, node in enumerate(p.schedule):
        key, phase = f"precision.schedule[{i}]", Phase(**node)
        if phase.when is not None and every == 0:
            raise ConfigError(f"{key}.when", phase.when, "reads the diagnostics rows: add diagnostics=grads")
        start = phase.start(max_steps)
        if start is not None and start < last:
            raise ConfigError(f"{key}.from_{'step' if phase.from_step else 'fraction'}", phase.from_step or
                              phase.from_fraction, f"begins at step {start}, before the phase above it (step {last}): "
                              "phases begin in the order listed")  # fmt: skip
        last = max(last, start or 0)


def check_diagnostics(d: DictConfig) -> None:
    """Diagnostics that would never be due or do nothing (the format names of diagnostics.shadow: check_shadow)."""
    for key, value in (("activations", d.activations), ("shadow", d.shadow)):
        if value and d.every == 0:
            raise ConfigError(
                f"diagnostics.{key}", value, "needs diagnostics.every > 0 (or diagnostics=grads) to take effect"
            )
    if d.shadow_attention and not d.shadow:
        raise ConfigError("diagnostics.shadow_attention", True, "needs formats in diagnostics.shadow, e.g. [mxfp4]")


def check_shadow(d: DictConfig, formats: dict[str, Any]) -> None:
    """diagnostics.shadow's format names against the registry (`formats`: numerics/formats' FORMATS)."""
    for i, name in enumerate(d.shadow):
        if name not in formats:
            raise ConfigError(f"diagnostics.shadow[{i}]", name, f"no such number format; they are {', '.join(formats)}")


def check_residual(init: DictConfig, arch: str, models: dict[str, Any]) -> None:
    """Fixup, and kaiming's zero_init_last, act on residual branches: the model must have them."""
    if init.scheme == "fixup" and not models[arch].residual:
        residual = ", ".join(f"model={name}" for name, entry in models.items() if entry.residual)
        raise ConfigError("init", "fixup", f"model={arch} has no residual branches; Fixup supports {residual}")
    if init.scheme == "kaiming" and init.zero_init_last and arch != "timm" and not models[arch].residual:
        raise ConfigError("init.zero_init_last", True, f"model={arch} has no residual branches to zero")


# What a dataset's samples hold, as the fit errors say it (a fork's own kinds print as they are named).
KINDS = {"tensors": "images or vectors", "tokens": "token sequences", "classes": "class labels"}


def check_fit(cfg: DictConfig, task: Any, datasets: dict[str, Any], tasks: dict[str, Any], models: dict[str, Any]):
    """The dataset must give what the task learns from and what the model reads (a mismatch would
    end in a shape or dtype error deep in the first step), and the objective be one of the task's metrics."""
    name, arch = cfg.data.name, cfg.model.arch
    data, model = datasets[name], models[arch]
    if data.targets != task.learns_from:
        fits = [n for n, entry in datasets.items() if entry.targets == task.learns_from]
        other = [n for n, t in tasks.items() if t.learns_from == data.targets]
        fix = f"use data={or_list(fits)}" if fits else "no registered dataset gives them"
        fix += f", or task={or_list(other)}" if other else ""
        gives = f"gives {kind(data.targets)} and task={task.name} learns from {kind(task.learns_from)}"
        raise ConfigError("data", name, f"{gives}: {fix}")
    if data.inputs != model.reads:
        choices, given = command_line()
        fix = model_fix(cfg, "task" in given, datasets, tasks, models)
        what = f"reads {kind(model.reads)}, and data={name} gives {kind(data.inputs)}"
        raise ConfigError("model", choices.get("model") or arch, f"{what}: {fix}")  # the preset (gpt2), not its arch
    if cfg.objective is not None and task.metric(cfg.objective) is None:
        names = ", ".join(m.name for m in task.metrics)
        raise ConfigError(
            "objective", cfg.objective, f"task={task.name} reports {names} and train/loss (null: {task.objective})"
        )


def model_fix(cfg: DictConfig, task_given: bool, datasets: dict[str, Any], tasks: dict[str, Any],
              models: dict[str, Any]) -> str:  # fmt: skip
    """For a model that does not read what the data gives: where the command line named no task, the
    task whose datasets the model reads (model=gpt2 alone wants task=lm); else a model that reads them."""
    data, reads = cfg.data.name, models[cfg.model.arch].reads
    fits = [n for n, entry in models.items() if entry.reads == datasets[data].inputs]
    use_model = f"model={or_list(fits)}" if fits else ""
    targets = {entry.targets for entry in datasets.values() if entry.inputs == reads}
    others = [n for n, t in tasks.items() if n != cfg.task.name and t.learns_from in targets]
    if task_given or not others:
        return f"use {use_model}" if use_model else "no registered model reads them"
    return f"add task={or_list(others)}" + (f" (or, for data={data}, {use_model})" if use_model else "")


def command_line() -> tuple[dict[str, str], set[str]]:
    """The option each config group got (model: gpt2) and the keys the command line set, where Hydra
    composed the config (train.py); none where code did (Hydra's compose API, the tests)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return {}, set()
    hydra_cfg = HydraConfig.get()
    return dict(hydra_cfg.runtime.choices), {o.split("=", 1)[0].lstrip("+~") for o in hydra_cfg.overrides.task}


def kind(name: str) -> str:
    return KINDS.get(name, name)


def or_list(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def check_workers(data: DictConfig) -> None:
    if data.get("persistent_workers") and data.get("num_workers") == 0:
        raise ConfigError(
            "data.persistent_workers",
            True,
            "keeps DataLoader worker processes between epochs, but data.num_workers=0 starts none: "
            "set data.num_workers >= 1 (e.g. 4), or data.persistent_workers=null",
        )


def check_launch(mode: str) -> None:
    """trainer.distributed and the launcher must agree; either mismatch would train wrongly in silence."""
    several = "WORLD_SIZE" in os.environ and "RANK" in os.environ  # torchrun, or a submitit job's tasks
    if mode != "none" and not several:
        raise ConfigError(
            "trainer.distributed",
            mode,
            f"start it as several processes: torchrun --nproc_per_node=2 train.py trainer={mode}, or in a sweep "
            f"python train.py -m hydra/launcher=submitit_local hydra.launcher.tasks_per_node=2 trainer={mode}",
        )
    if mode == "none" and several and int(os.environ["WORLD_SIZE"]) > 1:
        tasks = "the launcher's tasks (hydra.launcher.tasks_per_node, nodes)"
        started_by = "torchrun" if launcher() == "torchrun" else tasks
        raise ConfigError(
            "trainer.distributed",
            mode,
            f"started as {os.environ['WORLD_SIZE']} processes by {started_by}, every process would train "
            "alone: add trainer=ddp (or trainer=fsdp)",
        )


def resolve_device(want: str, p: Precision) -> torch.device:
    """The torch.device to train on (`want`: trainer.device), after checking that the precision mode
    works there."""
    import torch

    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device", want, "no CUDA GPU is visible here; use trainer.device=auto or cpu")
    device = torch.device("cuda" if want == "auto" and torch.cuda.is_available() else want.replace("auto", "cpu"))
    if p.tf32 and device.type != "cuda":
        raise ConfigError(
            "precision", p.name, "TF32 is a CUDA (Ampere+) matmul mode; on CPU it would silently be fp32: use fp32"
        )
    from halfprec.numerics.converters import CONVERTERS

    CONVERTERS[p.kernel].check_device(p, device)  # the converter's library, the chip it needs
    uses_bf16 = "bfloat16" in (p.autocast, p.param_dtype)
    if uses_bf16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("precision", p.name, "this GPU has no bfloat16 support; use fp16 or fp16_pure")
    return device
