"""run(cfg): build everything from the config, train, evaluate, log. Returns the final metrics."""

from __future__ import annotations

import contextlib
import json
import math
import random
import shlex
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, open_dict
from torch import nn

from halfprec.components.data import Dataset, TrainBatches, build_dataset
from halfprec.components.init import apply_init
from halfprec.components.models import create_model
from halfprec.components.tasks import Task, build_task
from halfprec.config import resolve_device, validate, validate_optimizer
from halfprec.errors import ConfigError, Preempted
from halfprec.machine import torch_threads
from halfprec.numerics.params import ParamStrategy, build_params
from halfprec.numerics.policy import COMPUTE_TYPES, PrecisionPolicy, observe_compute_dtypes
from halfprec.numerics.scaling import DIVERGING, LossScaler, TrainingAborted, build_scaler
from halfprec.training import distributed
from halfprec.training.checkpoint import (
    StopSignals,
    check_resume_config,
    checkpoint_files,
    find_resume_checkpoint,
    load_checkpoint,
    rng_state,
    save_atomic,
    save_checkpoint,
    set_rng_state,
)
from halfprec.training.diagnostics import Diagnostics
from halfprec.training.distributed import World
from halfprec.training.perf import math_kind, peak_tflops
from halfprec.training.progress import Progress, fmt
from halfprec.training.step import Stepper
from halfprec.training.tracking import Tracker, build_tracker, saved_config


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def build_optimizer(cfg: DictConfig, params: ParamStrategy, model: nn.Module) -> torch.optim.Optimizer:
    """`optim._target_` over the optimizer's tensors. With Fixup, biases and scales get
    lr * init.scalar_lr_scale, chosen by name as in the authors' code (the classifier bias too)."""
    kwargs = {k: v for k, v in cfg.optim.items() if k != "clip_grad_norm"}
    lr_scale = cfg.init.get("scalar_lr_scale")
    slow = set()
    if lr_scale:
        slow = {n for n, _ in params.named() if "bias" in n.rsplit(".", 1)[-1] or "scale" in n.rsplit(".", 1)[-1]}
    groups = [{"params": [p for n, p in params.named() if n not in slow]}]
    if slow:
        groups.append({"params": [p for n, p in params.named() if n in slow], "lr": cfg.optim.lr * lr_scale})
    try:
        return instantiate(kwargs, groups, _convert_="all")
    except Exception as err:  # torch's own argument checks ("Invalid weight_decay value: -1")
        cause = err.__cause__ or err
        raise ConfigError("optim", cfg.optim._target_, f"{type(cause).__name__}: {cause}") from None


def build_scheduler(cfg: DictConfig, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    # Plain floats, read once: LambdaLR calls `factor` every step, and each DictConfig lookup costs
    # ~10 us (measured: the lookups were a tenth of a 1 ms MLP step).
    warmup, total, name = cfg.sched.warmup_steps, cfg.trainer.max_steps, cfg.sched.name
    low = cfg.sched.get("min_lr_ratio", 0.0)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if name == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return low + (1 - low) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@torch.no_grad()
def evaluate(
    model: nn.Module, data: Dataset, task: Task, policy: PrecisionPolicy, batch_size: int, device, world=None
) -> dict:
    """The task's validation metrics over the whole validation split. Under DDP/FSDP each rank takes
    its share of the samples and the sums are added over ranks."""
    world = world or World()
    model.eval()
    if world.size > 1:
        distributed.broadcast_buffers(model)  # BatchNorm statistics: rank 0's, the ones its checkpoint holds
    evaluator = task.evaluator(device)
    for inputs, targets in data.val_batches(max(batch_size, 256), device, world.rank, world.size):
        with policy.autocast():
            evaluator.add(model(policy.cast_input(inputs)), targets)
    model.train()
    sums = evaluator.sums()
    return evaluator.metrics((distributed.sum_over_ranks(sums) if world.size > 1 else sums).tolist(), len(data.val))


@dataclass
class Components:
    """Everything a training run is built from; `build(cfg)` makes it, tests and forks reuse it."""

    model: nn.Module
    data: Dataset
    task: Task
    policy: PrecisionPolicy
    params: ParamStrategy
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: LossScaler
    device: torch.device
    stepper: Stepper  # the optimizer step over the parts above
    world: World = field(default_factory=World)
    compiled: nn.Module | None = None  # torch.compile(stepper.net) when trainer.compile=true


def build(cfg: DictConfig, world: World | None = None) -> Components:
    """Validate `cfg`, seed, and build model, precision policy, optimizer, schedule and scaler."""
    validate(cfg)
    validate_optimizer(cfg)
    world = world or World()
    device = resolve_device(cfg)
    if device.type == "cuda" and world.enabled:
        device = torch.device("cuda", world.local_rank)
    seed_everything(cfg.seed, cfg.trainer.deterministic)
    data = build_dataset(cfg.data)
    model = create_model(cfg.model, data.input_shape, data.num_classes)
    apply_init(model, cfg.init)
    model.to(device)
    policy = PrecisionPolicy.from_config(cfg.precision, device.type)
    policy.apply_backend_flags()
    policy.prepare_model(model)
    policy.apply_fp8(model)
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
    compiled = torch.compile(net) if cfg.trainer.compile else None
    return Components(model, data, task, policy, params, optimizer, scheduler, scaler, device, stepper, world, compiled)


def use_channels_last(choice: str | bool, model: nn.Module, device: torch.device) -> bool:
    """trainer.channels_last: auto = for conv nets on CUDA, where NHWC convolutions are faster."""
    if choice == "auto":
        return device.type == "cuda" and any(isinstance(m, nn.Conv2d) for m in model.modules())
    return bool(choice)


def count_flops() -> contextlib.AbstractContextManager:
    """torch's FLOP counter (matmuls, convolutions, attention; from shapes, no host sync), for the
    first step only: it sees every op through Python dispatch, which would slow every step."""
    from torch.utils.flop_counter import FlopCounterMode  # 0.2 s of imports; not for --help or a config error

    return FlopCounterMode(display=False)


def inject_nonfinite_grad(model: nn.Module, accum: int):
    """Make the window's last micro-batch produce inf gradients in the first Linear/Conv layer, for
    checking the skip path end to end. Through a hook on that layer's output gradient, so the
    forward (and BatchNorm statistics) stay finite, and it works the same on a sharded model."""
    layer = next(m for m in model.modules() if isinstance(m, COMPUTE_TYPES))
    calls = [0]

    def forward_hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        calls[0] += 1
        if calls[0] == accum and out.requires_grad:
            out.register_hook(lambda grad: grad * float("inf"))

    return layer.register_forward_hook(forward_hook)


@dataclass
class LoopState:
    """What the loop carries between steps; checkpointed so a resumed run logs identical rows."""

    step: int = 0
    last_row_step: int = 0
    skipped_before: int = 0  # scaler.skipped_steps at the last row
    clean_loss_sum: float = 0.0  # sum of non-skipped step losses since the last row
    clean_steps: int = 0
    final: dict = field(default_factory=dict)


def checkpoint_state(
    cfg: DictConfig, c: Components, batches: TrainBatches, loop: LoopState, tracker, weights: tuple[dict, dict]
) -> dict:
    model_state, optimizer_state = weights
    return {
        "step": loop.step,
        "model": model_state,
        "params": c.params.state_dict(),
        "optimizer": optimizer_state,
        "scheduler": c.scheduler.state_dict(),
        "scaler": c.scaler.state_dict(),
        "rng": rng_state(),
        "data": batches.state_dict(),
        "loop": asdict(loop),
        "config": saved_config(cfg),
        "wandb_id": tracker.wandb_id,
        "world_size": c.world.size,
    }


def restore(ckpt: dict, c: Components, batches: TrainBatches) -> LoopState:
    if distributed.is_sharded(c.model):
        distributed.load_full_state(c.model, c.optimizer, ckpt["model"], ckpt["optimizer"])
    else:
        c.model.load_state_dict(ckpt["model"])
        c.params.load_optimizer_state(c.optimizer, ckpt["optimizer"])
    c.params.load_state_dict(ckpt["params"])
    c.scheduler.load_state_dict(ckpt["scheduler"])
    c.scaler.load_state_dict(ckpt["scaler"])
    batches.load_state_dict(ckpt["data"])
    set_rng_state(ckpt["rng"])
    return LoopState(**ckpt["loop"])


def run(cfg: DictConfig, run_dir: str | Path) -> dict:
    """Train as `cfg` says, writing metrics and checkpoints under `run_dir`. Returns the final metrics."""
    set_threads(cfg)
    world = distributed.init(cfg.trainer.distributed, resolve_device(cfg).type)
    try:
        summary = _run(cfg, distributed.shared_run_dir(world, Path(run_dir)), world)
    except BaseException:
        distributed.finish(world, completed=False)
        raise
    distributed.finish(world, completed=True)
    return summary


def set_threads(cfg: DictConfig) -> None:
    """torch's CPU threads from trainer.threads (auto: see halfprec.machine), set before anything is
    built; the number is written back into the config, so W&B and checkpoints record it."""
    threads = torch_threads(cfg.trainer.threads)
    torch.set_num_threads(threads)
    with open_dict(cfg):
        cfg.trainer.threads = threads


def resume_checkpoint(cfg: DictConfig, run_dir: Path, world: World) -> tuple[Path | None, dict | None]:
    """The checkpoint `resume` names (None: a fresh start), loaded and checked against this config."""
    path = find_resume_checkpoint(cfg.resume, run_dir / "checkpoints") if cfg.resume is not None else None
    if path is None:
        return None, None
    ckpt = load_checkpoint(path)
    for note in check_resume_config(ckpt["config"], saved_config(cfg), path):
        print(f"resume: {note}", file=sys.stderr)
    if world.is_main and ckpt.get("world_size", 1) != world.size:
        print(
            f"resume: world size {ckpt.get('world_size', 1)} -> {world.size}: the effective batch becomes "
            f"{cfg.data.batch_size * cfg.accum * world.size} and the sample order differs from the first run",
            file=sys.stderr,
        )
    return path, ckpt


def say_where(cfg: DictConfig, run_dir: Path, resumed_from: Path | None, step: int) -> None:
    """Once everything is built: where this run writes, and where it continues from."""
    print(f"run dir: {run_dir}", file=sys.stderr)
    if resumed_from is not None:
        print(f"resume: from {resumed_from} at step {step} of {cfg.trainer.max_steps}", file=sys.stderr)
    elif cfg.resume is not None:
        print(
            f"resume={cfg.resume}: no checkpoint in {run_dir / 'checkpoints'} yet; starting at step 0", file=sys.stderr
        )


def _run(cfg: DictConfig, run_dir: Path, world: World) -> dict:
    path, ckpt = resume_checkpoint(cfg, run_dir, world)
    c = build(cfg, world)
    batches = c.data.train_batches(cfg.data.batch_size, cfg.seed, c.device, world.rank, world.size)
    loop = restore(ckpt, c, batches) if ckpt else LoopState()
    if world.is_main:
        say_where(cfg, run_dir, path, loop.step)
        resume_step = loop.step if ckpt else None
        tracker = build_tracker(cfg, run_dir, resume_step=resume_step, wandb_id=ckpt and ckpt["wandb_id"])
    else:
        tracker = Tracker([])  # rank 0 alone writes metrics and owns the W&B run
    summary: dict = {"exit_code": 1}
    start = time.perf_counter()
    try:
        summary = train_loop(cfg, c, batches, tracker, loop, run_dir / "checkpoints")
    except (TrainingAborted, Preempted) as err:
        # how far it got, with the counters of the moment it stopped (sweep.jsonl, halfprec report)
        status, code = ("stopped", 4) if isinstance(err, Preempted) else ("diverged", 3)  # stopped: resumable
        summary = end_summary(cfg, c, loop, status, code, time.perf_counter() - start)
        summary["error"] = str(err).splitlines()[0]
        raise
    finally:
        if world.is_main and summary.get("status"):
            write_summary(run_dir / "summary.json", summary)
        tracker.finish(summary)
    return summary


def end_summary(cfg: DictConfig, c: Components, loop: LoopState, status: str, exit_code: int, wall_s: float) -> dict:
    """summary.json and the W&B summary: how the run ended and its final numbers."""
    final, scaler = loop.final, c.scaler
    return {
        "status": status,
        "train/loss": final.get("train/loss"),
        "val/loss": final.get("val/loss"),
        "val/acc": final.get("val/acc"),
        "scaler/skipped_steps": scaler.skipped_steps,
        "scaler/min_scale": scaler.min_seen,
        "scaler/max_scale": scaler.max_seen,
        "scaler/final_scale": scaler.scale,
        **{k: v for k, v in final.items() if k.startswith("precision/")},
        "steps": loop.step,
        "effective_batch": cfg.data.batch_size * cfg.accum * c.world.size,
        "world_size": c.world.size,
        "threads": cfg.trainer.threads,
        "wall_s": wall_s,
        "exit_code": exit_code,
    }


def write_summary(path: Path, summary: dict) -> None:
    # strict JSON, as metrics.jsonl: a non-finite number (a diverged loss) is written as null
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in summary.items()}
    path.write_text(json.dumps(clean, indent=1, allow_nan=False) + "\n")


def train_loop(cfg: DictConfig, c: Components, batches: TrainBatches, tracker, loop: LoopState, ckpt_dir: Path) -> dict:
    model, policy, params, scaler = c.model, c.policy, c.params, c.scaler
    t = cfg.trainer
    per_step = cfg.data.batch_size * cfg.accum * c.world.size  # the effective batch
    main = c.world.is_main
    inject = set(t.inject_nonfinite_at)
    start = last_time = time.perf_counter()
    first = loop.step + 1
    model.train()
    abort_on_nonfinite = t.nonfinite == "abort" and scaler.kind == "none"
    diag = Diagnostics(cfg.diagnostics, model, params)
    step_flops = 0  # this rank's forward + backward FLOPs per optimizer step, counted on the first step
    peak = peak_tflops(c.device, math_kind(policy))  # None on a CPU or a chip not in the table

    def save(name: str | None = None) -> Path:
        if torch.is_tensor(loop.clean_loss_sum):
            loop.clean_loss_sum = loop.clean_loss_sum.item()
        weights = distributed.full_state(c.model, c.optimizer)  # FSDP: every rank takes part
        if not main:  # the ranks hold the same state (FSDP: gathered to rank 0); rank 0 writes it
            return ckpt_dir / (name or f"step-{loop.step:08d}.pt")
        state = checkpoint_state(cfg, c, batches, loop, tracker, weights)
        if name:  # a crash checkpoint: never picked by resume=auto
            save_atomic(state, ckpt_dir / name)
            return ckpt_dir / name
        return save_checkpoint(state, ckpt_dir, loop.step, t.ckpt_keep)

    def crash(err: Exception, culprit: str | None) -> TrainingAborted:
        path = save(f"crash-step-{loop.step:08d}.pt")
        # the counters of the step that stopped the run: the last row is what reports read
        row = {"step": loop.step, "samples": loop.step * per_step, **scaler.metrics()}
        tracker.log({**row, "scaler/skipped": scaler.skipped_steps - loop.skipped_before})
        loop.final.update(row)
        where = f"non-finite gradients start at: {culprit}" if culprit else "no non-finite gradient found"
        return TrainingAborted(
            f"step {loop.step}: {err}\n  {where}\n  scale history (step:scale, ! = overflow): "
            f"{scaler.history_tail()}\n  the weights are finite (the step was skipped); crash checkpoint: {path}"
        )

    with Progress(t.max_steps, enabled=t.progress and main) as progress, StopSignals() as stop:
        for step in range(first, t.max_steps + 1):
            loop.step = step
            micro = [next(batches) for _ in range(cfg.accum)]
            lr = c.optimizer.param_groups[0]["lr"]  # the lr this step uses
            # under DDP on rank 0 only: the other ranks must skip the step all the same
            injected = inject_nonfinite_grad(model, cfg.accum) if step in inject and main else None
            watch = observe_compute_dtypes(model) if step == first else contextlib.nullcontext()
            flops = count_flops() if step == first and t.count_flops else contextlib.nullcontext()
            due = diag.due(step)
            acts = diag.watch_activation_gradients(scaler.scale) if due and diag.activations else None
            scale_before = scaler.scale
            log_due = step == 1 or step % t.log_every == 0 or step == t.max_steps
            # steps that hook into layers run eagerly: a hook added to a compiled model recompiles it
            hooked = step == first or injected is not None or acts is not None
            net = c.compiled if c.compiled is not None and not hooked else None  # None: the stepper's own
            try:
                with watch as seen, acts or contextlib.nullcontext(), flops as counter:
                    result = c.stepper.step(
                        micro,
                        net=net,
                        inspect=diag.inspect_gradients if due else None,
                        compute_norm=log_due,  # the grad norm is logged on these steps only
                    )
            except TrainingAborted as err:
                raise crash(err, err.culprit) from None
            finally:
                if injected is not None:
                    injected.remove()
            if result.skipped and abort_on_nonfinite:
                raise crash(Exception("non-finite gradients and trainer.nonfinite=abort"), result.culprit)
            if counter is not None:
                step_flops = counter.get_total_flops()
            row = {}
            if step == first:  # never silently train in another precision than asked (also on resume)
                dtypes = policy.check(model, seen, params.master)
                if step == 1:
                    row.update(dtypes)
            if due:
                row.update(diag.collect())
            if result.skipped and diag.skips:  # the loss is read back only on skipped steps
                source = diag.skip_source(result.loss, result.culprit)
                row["diag/skip_source"] = source
                if main:
                    print(
                        f"step {step}: skipped, inf/NaN gradients from {source}; "
                        f"scale {scale_before:g} -> {scaler.scale:g}",
                        file=sys.stderr,
                        flush=True,
                    )
            if not result.skipped:  # a skipped step's loss is often inf: keep it out of the mean
                # accumulate on the device; the host reads it back only when a row is logged
                loop.clean_loss_sum = result.loss + loop.clean_loss_sum
                loop.clean_steps += 1

            if log_due:
                now = time.perf_counter()
                n = step - loop.last_row_step
                loss = loop.clean_loss_sum / loop.clean_steps if loop.clean_steps else result.loss
                loss = distributed.mean_over_ranks(loss)  # DDP: each rank saw its own slice of the batch
                row.update(
                    {
                        "train/loss": float(loss),
                        "train/lr": lr,
                        "train/grad_norm": result.grad_norm.item(),
                        "scaler/skipped": scaler.skipped_steps - loop.skipped_before,
                        **scaler.metrics(),
                        "perf/samples_per_s": n * per_step / (now - last_time),
                        "perf/step_ms": 1000 * (now - last_time) / n,
                    }
                )
                if step_flops:  # matmuls, convolutions, attention; not the optimizer's elementwise math
                    row["perf/tflops"] = step_flops * n / (now - last_time) / 1e12
                    if peak is not None:
                        row["perf/mfu"] = row["perf/tflops"] / peak[1]
                if c.device.type == "cuda":
                    row["perf/max_mem_mb"] = torch.cuda.max_memory_allocated() / 2**20
                loop.clean_loss_sum, loop.clean_steps = 0.0, 0
                loop.last_row_step, loop.skipped_before, last_time = step, scaler.skipped_steps, now
            if (t.val_every and step % t.val_every == 0) or step == t.max_steps:
                row.update(evaluate(model, c.data, c.task, policy, cfg.data.batch_size, c.device, c.world))
                last_time = time.perf_counter()  # keep validation out of perf/step_ms
            if row:
                row = {"step": step, "samples": step * per_step, **row}
                tracker.log(row)
                loop.final.update(row)
                progress.update(step, loop.final, scaler)
            # DDP/FSDP: a signal reaches each rank at its own moment; all of them stop at this step
            stopping = distributed.any_rank_on_host(c.world, stop.received is not None)
            if (t.ckpt_every and step % t.ckpt_every == 0) or step == t.max_steps or stopping:
                path = save()
            if stopping and step < t.max_steps:
                distributed.barrier(c.world)  # no rank exits (and gets the job torn down) before the save
                stop.forward()  # under submitit: requeue this job (it resumes with resume=auto)
                raise Preempted(
                    f"{signal_name(stop.received)} at step {step}: saved {path}; continue with: "
                    f"{resume_command(ckpt_dir.parent, c.world)}"
                )
    distributed.check_ranks_agree(model, scaler.scale, scaler.skipped_steps)
    check_finite(loop.final, t.max_steps)
    summary = end_summary(cfg, c, loop, "completed", 0, time.perf_counter() - start)
    summary["checkpoint"] = str(checkpoint_files(ckpt_dir)[-1])
    if main:
        print(done_line(summary, t.max_steps - first + 1, scaler, ckpt_dir.parent), file=sys.stderr)
    return summary


def signal_name(signum: int | None) -> str:
    if signum is None:
        return "a stop signal on another rank"
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def resume_command(run_dir: Path, world: World) -> str:
    """The command that continues this run: its own overrides (a sweep job's too), its run dir, resume=auto."""
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith(("resume=", "hydra.run.dir="))]
    except ValueError:  # run() called outside Hydra (tests, notebooks)
        return f"the same overrides plus hydra.run.dir={shlex.quote(str(run_dir))} resume=auto"
    launcher = f"torchrun --nproc_per_node={world.size} train.py" if world.size > 1 else "python train.py"
    return " ".join([launcher, *map(shlex.quote, overrides), shlex.quote(f"hydra.run.dir={run_dir}"), "resume=auto"])


def check_finite(final: dict, step: int) -> None:
    """A run whose last losses are inf/NaN diverged, however few of its steps were skipped."""
    for key in ("train/loss", "val/loss"):
        if not math.isfinite(final[key]):
            raise TrainingAborted(f"step {step}: the run ended with {key} = {final[key]}; {DIVERGING}")


def done_line(summary: dict, steps: int, scaler: LossScaler, run_dir: Path) -> str:
    return (
        f"done: {steps} steps in {summary['wall_s']:.1f}s | train/loss {fmt(summary['train/loss'])} | "
        f"val/acc {fmt(summary['val/acc'])} | skipped {scaler.skipped_steps} | scale {scaler.scale:g} "
        f"(min {scaler.min_seen:g}, max {scaler.max_seen:g}) | {run_dir}"
    )
