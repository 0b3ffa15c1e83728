"""Progress display: a rich bar on a terminal, plain periodic lines in logs (SLURM, CI, pipes)."""

from __future__ import annotations

import sys

from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress


class Progress:
    def __init__(self, total: int, enabled: bool = True, plain_every: int = 10):
        self.total = total
        self.terminal = enabled and sys.stderr.isatty()
        self.plain = enabled and not self.terminal
        self.plain_every = max(1, total // plain_every)  # about ten lines per run in a log file
        self._next_plain = self.plain_every
        self._bar = None
        if self.terminal:
            self._bar = RichProgress(
                TextColumn("step"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("{task.fields[status]}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                transient=False,
            )
            self._task = self._bar.add_task("train", total=total, status="")

    def __enter__(self) -> Progress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def update(self, step: int, metrics: dict, scaler) -> None:
        status = (
            f"loss {metrics.get('train/loss', float('nan')):.4f}  scale {scaler.scale:g}  skips {scaler.skipped_steps}"
        )
        if "val/acc" in metrics:
            status += f"  val/acc {metrics['val/acc']:.3f}"
        if self._bar is not None:
            self._bar.update(self._task, completed=step, status=status)
        elif self.plain and (step >= self._next_plain or step == self.total):
            print(f"step {step}/{self.total}  {status}", file=sys.stderr, flush=True)
            self._next_plain = step + self.plain_every
