"""Atomic checkpoints and exact resume.

A checkpoint holds everything the next step depends on: model, fp32 master weights (and Kahan
buffers), optimizer, scheduler, loss-scaler state and counters, RNG states, the data position,
the step, the resolved config and the W&B run id. Files are written to a temp name, fsynced and
renamed, so a kill during a save leaves the previous checkpoints intact and no torn file under
a checkpoint name.
"""

from __future__ import annotations

import os
import random
import re
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

from halfprec.errors import ConfigError

CKPT_RE = re.compile(r"^step-(\d+)\.pt$")

# Config keys that may differ on resume: they change how long or how visibly the run goes on,
# not what a step computes. Anything else (model, precision, data, optimizer, ...) is an error.
RESUMABLE_CHANGES = ("resume", "trainer.max_steps", "trainer.val_every", "trainer.log_every", "trainer.progress",
                     "trainer.ckpt_every", "trainer.ckpt_keep", "trainer.compile", "trainer.channels_last",
                     "trainer.threads", "data.num_workers", "scaler.max_consecutive_skips",
                     "scaler.max_overflow_rate", "logger")  # fmt: skip
# Keys added after checkpoints were first written, with the value every older version behaved as:
# a checkpoint whose config lacks the key resumes when the run asks for that value.
IMPLIED_BY_OLDER_CHECKPOINTS = {"task.name": "classification"}


class StopSignals:
    """Turns SIGTERM, SIGUSR1 (SLURM's warning before preemption or time limit) and the first
    Ctrl-C (SIGINT) into a flag the loop checks after each step, so it stops at a step boundary with
    a checkpoint. A second Ctrl-C quits at once (KeyboardInterrupt: exit 130, nothing more saved)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict = {}

    def _handle(self, signum: int, frame: object) -> None:
        if signum == signal.SIGINT:
            if self.received is not None:
                raise KeyboardInterrupt
            if os.environ.get("RANK", "0") == "0":  # torchrun hands the Ctrl-C to every rank: one says so
                print("\nCtrl-C: stopping after this step with a checkpoint; Ctrl-C again to quit now", file=sys.stderr)
        self.received = signum

    def forward(self) -> None:
        """After the checkpoint: hand the signal to the handler we replaced, if it was a function.
        Under submitit that one requeues the job (and exits); otherwise nothing happens. Never for
        Ctrl-C, whose default handler would raise KeyboardInterrupt after all."""
        previous = self._previous.get(self.received)
        if callable(previous) and self.received != signal.SIGINT:
            previous(self.received, None)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # signal handlers live there only
            # a SIGINT ignored at start (`nohup`, a background job of a script) stays ignored
            wanted = [s for s in self.SIGNALS if not (s == signal.SIGINT and signal.getsignal(s) == signal.SIG_IGN)]
            self._previous = {s: signal.signal(s, self._handle) for s in wanted}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def checkpoint_files(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoints in `ckpt_dir`, oldest first (temp files of an interrupted save are ignored)."""
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := CKPT_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def save_atomic(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
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


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: tree}


def check_resume_config(saved: dict, current: dict, path: Path) -> list[str]:
    """Raise on a config change that breaks continuation; return notes on the harmless ones."""
    old, new = {**IMPLIED_BY_OLDER_CHECKPOINTS, **_flatten(saved)}, _flatten(current)
    notes = []
    for key in sorted(old.keys() | new.keys()):
        if old.get(key) == new.get(key):
            continue
        change = f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
        if not any(key == k or key.startswith(k + ".") for k in RESUMABLE_CHANGES):
            raise ConfigError(
                key, new.get(key), f"{path} was trained with {key}={old.get(key)!r}; resume with the same value"
            )
        if key != "resume":
            notes.append(f"{change} (allowed)")
    return notes
