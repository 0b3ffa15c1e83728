"""Progress display: a rich bar on a terminal, plain periodic lines in logs (SLURM, CI, pipes)."""

from __future__ import annotations

import math
import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress


def fmt(value: float | None) -> str:
    """A metric in a few characters: 0.1234, and 6.3e+35 for a diverging loss rather than 36 digits."""
    if value is None:
        return "-"
    if not math.isfinite(value):
        return str(value)
    if value != 0 and not 1e-3 <= abs(value) < 1e5:
        return f"{value:.2g}" if abs(value) >= 1e5 else f"{value:.2e}"
    return f"{value:.4f}"


def fmt_scale(scale: float) -> str:
    """A loss scale: 65536 as is, 2^24 rather than 1.67772e+07 (scales are powers of two)."""
    if scale == int(scale) and scale < 1e6:
        return f"{scale:g}"
    exponent = math.log2(scale) if scale > 0 else 0.5
    return f"2^{int(exponent)}" if exponent == int(exponent) else f"{scale:.3g}"


def status_text(metrics: dict, scaler, shown: str = "val/acc") -> str:
    """What the bar shows beside the step count, short enough for an 80-column terminal: the train
    loss and the validation metric `shown` (the task's objective: val/acc, val/loss as `val`)."""
    text = f"loss {fmt(metrics.get('train/loss'))}"
    if shown in metrics:
        label = "val" if shown == "val/loss" else shown.removeprefix("val/")
        value = metrics[shown]
        text += f" {label} {value:.3f}" if shown == "val/acc" else f" {label} {fmt(value)}"
    if scaler.kind != "none":
        text += f" scale {fmt_scale(scaler.scale)}"
    if scaler.skipped_steps:
        text += f" skip {scaler.skipped_steps}"
    return text


class Progress:
    def __init__(
        self,
        total: int,
        enabled: bool = True,
        plain_every: int = 10,
        console: Console | None = None,
        shown: str = "val/acc",
    ):
        self.total, self.shown = total, shown
        self.terminal = enabled and (console is not None or sys.stderr.isatty())
        self.plain = enabled and not self.terminal
        self.plain_every = max(1, total // plain_every)  # about ten lines per run in a log file
        self._next_plain = self.plain_every
        self._bar = None
        if self.terminal:
            console = console or Console(stderr=True)
            # the step count, the losses and both times come first; a bar only where there is room
            # for it (on 80 columns the status alone may need 60)
            bar = [BarColumn(bar_width=None)] if console.width >= 100 else []
            self._bar = RichProgress(
                MofNCompleteColumn(),
                *bar,
                TextColumn("{task.fields[status]}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=console,
                expand=bool(bar),
            )
            self._task = self._bar.add_task("train", total=total, status="")

    def __enter__(self) -> Progress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def update(self, step: int, metrics: dict, scaler) -> None:
        status = status_text(metrics, scaler, self.shown)
        if self._bar is not None:
            self._bar.update(self._task, completed=step, status=status)
        elif self.plain and (step >= self._next_plain or step == self.total):
            print(f"step {step}/{self.total}  {status}", file=sys.stderr, flush=True)
            self._next_plain = step + self.plain_every
