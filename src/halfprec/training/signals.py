"""Stop signals: SIGTERM, SIGUSR1 (SLURM's warning before preemption or a time limit) and the first
Ctrl-C stop the run at a step boundary, with a checkpoint and the command that continues it."""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import NoReturn

from halfprec.errors import Preempted
from halfprec.training import distributed
from halfprec.training.distributed import World


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

    def agreed(self, world: World) -> bool:
        """Whether any rank got a signal: it reaches each rank at its own moment (or only some of
        them), and all of them must stop at the same step."""
        return distributed.any_rank_on_host(world, self.received is not None)

    def stop(self, world: World, step: int, saved: Path, run_dir: Path) -> NoReturn:
        """After the checkpoint: wait for every rank (none exits, and gets the job torn down, before
        the save), hand the signal on (under submitit: requeue), and end the run as resumable."""
        distributed.barrier(world)
        self.forward()
        raise Preempted(
            f"{signal_name(self.received)} at step {step}: saved {saved}; continue with: "
            f"{resume_command(run_dir, world)}"
        )


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
