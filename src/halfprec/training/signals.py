"""Stop signals: SIGTERM, SIGUSR1 and SIGUSR2 (SLURM's warning before preemption or a time limit:
submitit asks for USR2) and the first Ctrl-C stop the run at a step boundary, with a checkpoint and
the command that continues it."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

from halfprec.ctrl_c import quit_once
from halfprec.errors import Preempted
from halfprec.machine import launcher
from halfprec.training import distributed
from halfprec.training.distributed import World


class StopSignals:
    """Turns SIGTERM, SIGUSR1, SIGUSR2 (SLURM's warning before preemption or time limit; submitit
    sends USR2 unless $SUBMITIT_PREEMPT_SIGNAL says otherwise) and the first Ctrl-C (SIGINT) into a
    flag the loop checks after each step, so it stops at a step boundary with a checkpoint. A second
    Ctrl-C quits at once (KeyboardInterrupt: exit 130, nothing more saved); one that comes while a
    checkpoint is being written quits as soon as that file is complete (`holding`). Once the quit or
    the stop is under way, Ctrl-C is ignored: under train.py to the process's exit (halfprec.ctrl_c)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)

    def __init__(self) -> None:
        self.received: int | None = None  # the signal this process got
        self.on_some_rank = 0  # a signal some rank got (the largest number, if several), once agreed
        self._previous: dict = {}
        self._ctrl_c = 0  # Ctrl-C presses: handler calls, or bytes in the wakeup socket if more
        self._ctrl_c_bytes = 0
        self._wakeup: tuple[socket.socket, socket.socket] | None = None
        self._previous_wakeup = -1
        self._holding = False  # a checkpoint is being written: a quit waits for it
        self._quitting = False
        self._ending = False  # the quit or the stop is under way: a signal now is ignored

    def _handle(self, signum: int, frame: object) -> None:
        if self._ending:  # one more Ctrl-C would tear apart the ending that reports the quit or the stop
            return
        first = self.received is None
        # Recorded before anything is printed: a second Ctrl-C may arrive during the print, and
        # Python then runs its handler in the middle of this one.
        self.received = signum
        if signum != signal.SIGINT:
            return
        self._ctrl_c = max(self._ctrl_c + 1, self._presses())
        if first and self._ctrl_c == 1:
            if os.environ.get("RANK", "0") == "0":  # torchrun hands the Ctrl-C to every rank: one says so
                say("\nCtrl-C: stopping after this step with a checkpoint; Ctrl-C again to quit now")
            return
        self._quitting = self._ending = True  # a second Ctrl-C, or one after another stop signal
        if self._holding:
            say("\nCtrl-C again: quitting as soon as the checkpoint being written is complete")
        else:
            raise KeyboardInterrupt

    def _presses(self) -> int:
        """The Ctrl-C presses delivered so far, counted at the C level. Python runs one handler for
        signals that arrive before it gets to run it (during one long torch op), so two quick presses
        would count as one; the wakeup socket gets a byte per signal delivered."""
        if self._wakeup is not None:
            try:
                self._ctrl_c_bytes += self._wakeup[0].recv(4096).count(bytes([signal.SIGINT]))
            except BlockingIOError:
                pass
        return self._ctrl_c_bytes

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """While a checkpoint is written: a second Ctrl-C waits for the file to be complete instead
        of tearing torch.save apart, and the quit follows right after it."""
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
        if self._quitting:
            raise KeyboardInterrupt

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
            self._wakeup = socket.socketpair()
            for end in self._wakeup:
                end.setblocking(False)
            self._previous_wakeup = signal.set_wakeup_fd(self._wakeup[1].fileno(), warn_on_full_buffer=False)
            self._previous = {s: signal.signal(s, self._handle) for s in wanted}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            if handler is quit_once and self._ending:  # train.py's, which would quit in the ending
                handler = signal.SIG_IGN
            signal.signal(s, handler)
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._previous_wakeup)
            for end in self._wakeup:
                end.close()
            self._wakeup = None

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
        stopped = Preempted(
            f"{signal_name(self.received)} at step {step}: saved {saved}; continue with: "
            f"{resume_command(run_dir, world)}"
        )
        self._ending = True  # from here on a Ctrl-C would cut short the stop's ending, not the training
        raise stopped


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


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
