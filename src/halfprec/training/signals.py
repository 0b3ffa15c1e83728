"""Stop signals: SIGTERM, SIGUSR1 and SIGUSR2 (SLURM's warning before preemption or a time limit:
submitit asks for USR2) and the first Ctrl-C stop the run at a step boundary, with a checkpoint and
the command that continues it."""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import NoReturn

from halfprec.errors import Preempted
from halfprec.machine import launcher
from halfprec.training import distributed
from halfprec.training.distributed import World


class StopSignals:
    """Turns SIGTERM, SIGUSR1, SIGUSR2 (SLURM's warning before preemption or time limit; submitit
    sends USR2 unless $SUBMITIT_PREEMPT_SIGNAL says otherwise) and the first Ctrl-C (SIGINT) into a
    flag the loop checks after each step, so it stops at a step boundary with a checkpoint. A second
    Ctrl-C quits at once (KeyboardInterrupt: exit 130, nothing more saved)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)

    def __init__(self) -> None:
        self.received: int | None = None  # the signal this process got
        self.on_some_rank = 0  # a signal some rank got (the largest number, if several), once agreed
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
        Under submitit that one requeues the job and exits (on rank 0; it returns on the other
        tasks); otherwise nothing happens. Never for Ctrl-C, whose default handler would raise
        KeyboardInterrupt after all."""
        # Under submitit the signal may have reached another task first; rank 0 still requeues the job.
        signum = self.received or self.on_some_rank
        previous = self._previous.get(signum)
        if callable(previous) and signum != signal.SIGINT:
            previous(signum, None)

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
        self.on_some_rank = distributed.max_on_host(world, self.received or 0)
        return self.on_some_rank > 0

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
    if launcher() == "submitit":
        return "the same job, which submitit requeues (with resume=auto in its overrides it continues from here)"
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith(("resume=", "hydra.run.dir="))]
    except ValueError:  # run() called outside Hydra (tests, notebooks)
        return f"the same overrides plus hydra.run.dir={shlex.quote(str(run_dir))} resume=auto"
    where = shlex.quote(f"hydra.run.dir={run_dir}")
    return " ".join([torchrun(world), *map(shlex.quote, overrides), where, "resume=auto"])


def torchrun(world: World) -> str:
    """How this run was started: python, torchrun on one node, or torchrun on several (their rendezvous)."""
    if world.size == 1:
        return "python train.py"
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", 1))  # torchrun's agents, one per node
    if nodes == 1:
        return f"torchrun --nproc_per_node={world.size} train.py"
    per_node = os.environ.get("LOCAL_WORLD_SIZE", world.size // nodes)
    return f"torchrun --nnodes={nodes} --nproc_per_node={per_node} <the same rendezvous options> train.py"
