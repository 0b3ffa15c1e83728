"""Ctrl-C in train.py's process. Outside the training steps it quits at once (KeyboardInterrupt);
the steps defer the first one to a step's end (halfprec.training.signals). Once a quit or a stop is
under way, any further Ctrl-C is ignored until the process exits: a KeyboardInterrupt in the ending
(summary.json, the loggers, the line that says how the run ended, Hydra, the interpreter's shutdown)
would tear it apart, print a traceback, or kill the process with a code other than the run's.
Kept free of torch: halfprec.launch.exits uses it."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import NoReturn


def quit_once(signum: int, frame: object) -> NoReturn:
    """train.py's Ctrl-C handler: quit at once, and ignore every Ctrl-C after this one."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


@contextlib.contextmanager
def quits_once() -> Iterator[None]:
    """Around a command: Ctrl-C quits, once (a Ctrl-C ignored at the start, as under nohup, stays
    ignored); however the command ends, Ctrl-C is ignored from then on. Python's own handler would
    raise in torch's exit hooks, and after them SIGINT's default action would kill the process."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, quit_once)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
