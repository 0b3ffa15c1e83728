"""Atomic checkpoints and exact resume.

A checkpoint holds everything the next step depends on: model, fp32 master weights (and Kahan
buffers), optimizer, scheduler, loss-scaler state and counters, RNG states, the data position,
the step, the resolved config and the W&B run id. Files are written to a temp name, fsynced and
renamed, so a kill during a save leaves the previous checkpoints intact and no torn file under
a checkpoint name.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from halfprec.components.data.batches import TrainBatches
from halfprec.config import Config, changes, saved
from halfprec.errors import ConfigError, naming, show_value
from halfprec.training import distributed
from halfprec.training.build import Components
from halfprec.training.metrics import LoopState

CKPT_RE = re.compile(r"^step-(\d+)\.pt$")

# Config keys that may differ on resume: they change how long or how visibly the run goes on,
# not what a step computes. Anything else (model, precision, data, optimizer, ...) is an error.
# sched.total_steps is the exception: allowed, and run() says what the lr then does.
RESUMABLE_CHANGES = ("resume", "trainer.max_steps", "trainer.val_every", "trainer.log_every", "trainer.progress",
                     "trainer.ckpt_every", "trainer.ckpt_keep", "trainer.compile", "trainer.channels_last",
                     "trainer.threads", "data.num_workers", "scaler.max_consecutive_skips",
                     "scaler.max_overflow_rate", "logger", "objective", "fail_fast", "sched.total_steps",
                     "precision.quantizer", "diagnostics.shadow", "diagnostics.shadow_attention")  # fmt: skip
# What a run is. A checkpoint that differs in any of them is another run's: said first, all at once,
# rather than the first detail that differs (data.batch_size of a language model's checkpoint).
IDENTITY = ("task.name", "model.arch", "data.name", "precision.name", "optim._target_")


def checkpoint_files(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoints in `ckpt_dir`, oldest first (temp files of an interrupted save are ignored)."""
    if not ckpt_dir.is_dir():
        return []
    return sorted((p for p in ckpt_dir.iterdir() if CKPT_RE.match(p.name)), key=checkpoint_step)


def checkpoint_step(path: Path) -> int:
    """The step of a `step-N.pt` file, from its name."""
    found = CKPT_RE.match(path.name)
    assert found, path
    return int(found.group(1))


def save_atomic(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:  # a full disk, a kill of the save: no half-written file stays behind
        tmp.unlink(missing_ok=True)
        raise naming(err, path) from None
    dir_fd = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_checkpoint(state: dict, ckpt_dir: Path, step: int, keep: int) -> Path:
    """Write `step-<step>.pt` atomically, then delete all but the newest `keep` checkpoints."""
    path = ckpt_dir / f"step-{step:08d}.pt"
    save_atomic(state, path)
    for old in checkpoint_files(ckpt_dir)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


CHECKPOINT_KEYS = ("step", "model", "params", "optimizer", "scheduler", "scaler", "rng", "data", "loop", "config")


def load_checkpoint(path: Path) -> dict:
    """Load a checkpoint written by save_checkpoint; a torn or foreign file is a ConfigError."""
    try:
        # weights_only=False: the checkpoint holds RNG states and the config, which are not
        # tensors; only load checkpoints you wrote.
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:
        raise ConfigError(
            "resume",
            str(path),
            f"unreadable checkpoint ({type(err).__name__}); delete it or resume=<an older step-*.pt>",
        ) from None
    missing = [k for k in CHECKPOINT_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise ConfigError("resume", str(path), f"not a halfprec checkpoint (missing {', '.join(missing)})")
    return state


def find_resume_checkpoint(resume: str, ckpt_dir: Path) -> Path | None:
    """`resume=auto`: the newest checkpoint in this run's dir, or None (a fresh start) if there is
    none yet, so the same command serves the first start and every requeue; otherwise a given
    checkpoint file or dir, which must exist."""
    if resume == "auto":
        found = checkpoint_files(ckpt_dir)
        return found[-1] if found else None
    path = Path(resume)
    if path.is_dir():
        found = checkpoint_files(path) or checkpoint_files(path / "checkpoints")
        if not found:
            raise ConfigError("resume", resume, "no step-*.pt checkpoint in that directory")
        return found[-1]
    if not path.is_file():
        raise ConfigError("resume", resume, "no such file; use resume=auto or the path of a step-*.pt checkpoint")
    return path


def check_resume_config(old: Config, new: Config, path: Path) -> list[str]:
    """Raise on a config change that breaks continuation; return notes on the harmless ones."""
    changed = changes(old, new)
    other = [key for key in IDENTITY if key in changed]
    if other:
        was = ", ".join(f"{key}={show_value(changed[key][0])}" for key in other)
        now = ", ".join(f"{key}={show_value(changed[key][1])}" for key in other)
        fix = f"a checkpoint of another run: trained with {was}, where this run has {now}"
        raise ConfigError("resume", str(path), f"{fix}; resume with the overrides it was started with")
    notes = []
    for key, (before, after) in changed.items():
        if not any(key == k or key.startswith(k + ".") for k in RESUMABLE_CHANGES):
            raise ConfigError(key, after, f"{path} was trained with {key}={before!r}; resume with the same value")
        if key != "resume":
            notes.append(f"{key}: {before!r} -> {after!r} (allowed)")
    return notes


def checkpoint_state(
    cfg: Config,
    c: Components,
    batches: TrainBatches,
    loop: LoopState,
    tracker,
    weights: tuple[dict, dict],
    rank_loss_sums: list[float],
) -> dict:
    model_state, optimizer_state = weights
    return {
        "step": loop.step,
        "model": model_state,
        "params": c.stepper.params.state_dict(),
        "optimizer": optimizer_state,
        "scheduler": c.stepper.scheduler.state_dict(),
        "scaler": c.stepper.scaler.state_dict(),
        "rng": rng_state(),
        "data": batches.state_dict(),
        "loop": asdict(loop),
        "rank_loss_sums": rank_loss_sums,  # each rank's loss sum since the last row (LoopState's is rank 0's)
        "config": saved(cfg),
        "loggers": tracker.state(),  # each logger's own (W&B's run id, MLflow's): a resume continues them
        "world_size": c.world.size,
        # the steps precision.schedule's phases began (a trigger's cannot be recomputed from the step)
        "precision_schedule": None if c.stepper.policy.schedule is None else c.stepper.policy.schedule.state_dict(),
    }


def logger_states(ckpt: dict) -> dict[str, dict]:
    """What each logger kept in the checkpoint; one from before the loggers group kept W&B's run id alone."""
    if "loggers" in ckpt:
        return ckpt["loggers"]
    return {"wandb": {"id": ckpt["wandb_id"]}} if ckpt.get("wandb_id") else {}


def restore(ckpt: dict, c: Components, batches: TrainBatches) -> LoopState:
    stepper = c.stepper
    if distributed.is_sharded(c.model):
        distributed.load_full_state(c.model, stepper.optimizer, ckpt["model"], ckpt["optimizer"])
    else:
        c.model.load_state_dict(ckpt["model"])
        stepper.params.load_optimizer_state(stepper.optimizer, ckpt["optimizer"])
    stepper.params.load_state_dict(ckpt["params"])
    stepper.scheduler.load_state_dict(ckpt["scheduler"])
    # the lr of the next step from this run's schedule, not the one the optimizer's state saved: they
    # differ when sched.total_steps changed (the same number otherwise)
    scheduler = stepper.scheduler
    assert isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR)  # build_scheduler's
    for group, base, factor in zip(stepper.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(scheduler.last_epoch)
    stepper.scaler.load_state_dict(ckpt["scaler"])
    batches.load_state_dict(ckpt["data"])
    set_rng_state(ckpt["rng"])
    loop = LoopState(**ckpt["loop"])
    if stepper.policy.schedule is not None:  # the layers as the phases begun by the checkpoint's step left them
        stepper.policy.schedule.load_state_dict(ckpt["precision_schedule"])
        stepper.policy.enter_phase(c.model, stepper.policy.schedule.phase_at(loop.step))
    sums = ckpt.get("rank_loss_sums")  # each rank's own part of the logging window, at the same world size
    if sums is not None and len(sums) == c.world.size:
        loop.clean_loss_sum = sums[c.world.rank]
    return loop


class Checkpointer:
    """Saves the run every trainer.ckpt_every steps (0: only at the end), at the last step and when
    it stops; crash checkpoints (never picked by resume=auto) when training cannot go on."""

    def __init__(
        self,
        cfg: Config,
        c: Components,
        batches: TrainBatches,
        loop: LoopState,
        tracker,
        ckpt_dir: Path,
        hold: Callable[[], AbstractContextManager] = contextlib.nullcontext,
    ):
        self.cfg, self.c, self.batches, self.loop, self.tracker, self.dir = cfg, c, batches, loop, tracker, ckpt_dir
        self.every, self.keep, self.max_steps = cfg.trainer.ckpt_every, cfg.trainer.ckpt_keep, cfg.trainer.max_steps
        self.hold = hold  # StopSignals.holding: a second Ctrl-C waits for the file being written

    def due(self, step: int) -> bool:
        return bool(self.every and step % self.every == 0) or step == self.max_steps

    def save(self, name: str | None = None) -> Path:
        loop = self.loop
        if torch.is_tensor(loop.clean_loss_sum):
            loop.clean_loss_sum = loop.clean_loss_sum.item()
        # The ranks differ in one thing: the losses of their slices summed since the last row. Saved
        # for each, a run stopped between two rows logs the next one as an uninterrupted run would.
        rank_loss_sums = distributed.gather_on_host(self.c.world, float(loop.clean_loss_sum))
        weights = distributed.full_state(self.c.model, self.c.stepper.optimizer)  # FSDP: every rank takes part
        if not self.c.world.is_main:  # the ranks hold the same state (FSDP: gathered to rank 0); rank 0 writes it
            return self.dir / (name or f"step-{loop.step:08d}.pt")
        state = checkpoint_state(self.cfg, self.c, self.batches, loop, self.tracker, weights, rank_loss_sums)
        with self.hold():
            if name:  # a crash checkpoint: never picked by resume=auto
                save_atomic(state, self.dir / name)
                return self.dir / name
            return save_checkpoint(state, self.dir, loop.step, self.keep)
