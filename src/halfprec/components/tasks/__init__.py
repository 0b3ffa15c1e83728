"""Tasks (`task=...`): what is learned. A task says what a batch holds, how the loss is computed
from the model's output, and which validation metrics it reports, so that the optimizer step and
the training loop know nothing about labels or accuracy (docs/design.md, "Tasks").

A new task is one module in this package, a `Task` subclass decorated with `@register_task`, and a
conf/task/<name>.yaml. Its `metrics` are the one list of its metric names: the objective a sweeper
optimizes, the columns of `halfprec report` and the values sweep.jsonl records all read it
(halfprec/metrics.py: what a Metric is, and the run-level values every task's runs have).
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TypeVar

import torch

from halfprec.components.data import Dataset
from halfprec.metrics import TRAIN_LOSS, VAL_LOSS, Metric
from halfprec.spec import Choice


class Evaluator:
    """Adds up a task's validation metrics over batches, on the device (no host sync per batch).
    `sums()` is one tensor that the ranks add together; `metrics(sums, n)` turns the sums over the
    whole validation split (n samples) into the logged values, `val/loss` among them (a run whose
    last val/loss is not finite diverged)."""

    def add(self, output: torch.Tensor, targets: torch.Tensor) -> None:
        raise NotImplementedError

    def sums(self) -> torch.Tensor:
        raise NotImplementedError

    def metrics(self, sums: list[float], n: int) -> dict[str, float]:
        raise NotImplementedError


class Task:
    """A batch is (inputs, targets); the model maps inputs to an output; the task scores it."""

    name = ""
    metrics: tuple[Metric, ...] = ()  # the val/* values its evaluator reports
    objective = VAL_LOSS.name  # what `objective: null` means: the metric a sweeper optimizes by default
    learns_from = "classes"  # the targets it needs: a registered dataset's `targets` (components/data/)

    @classmethod
    def metric(cls, name: str) -> Metric | None:
        """The metric called `name` (train/loss included); None if the task reports none by that name."""
        return next((m for m in (*cls.metrics, TRAIN_LOSS) if m.name == name), None)

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean training loss of a micro-batch, in fp32 whatever the model computed in."""
        raise NotImplementedError

    def evaluator(self, device: torch.device, data: Dataset) -> Evaluator:
        raise NotImplementedError

    def val_batch_size(self, batch_size: int) -> int:
        """Samples per validation forward, from the training micro-batch: at least 256, since
        without gradients a few large forwards are faster than many small ones."""
        return max(batch_size, 256)

    def throughput(self, samples_per_s: float, data: Dataset) -> dict[str, float]:
        """perf/* metrics in the task's own unit, beside perf/samples_per_s."""
        return {}


TASKS: dict[str, type[Task]] = {}
T = TypeVar("T", bound=type[Task])


def register_task(cls: T) -> T:
    """Makes `task.name=<cls.name>` choose this task."""
    TASKS[cls.name] = cls
    return cls


def task_metric(task: str, objective: str | None) -> Metric | None:
    """The Metric of task `task` that `objective` names (null: the task's own default); None for an
    unknown task or name (validate() says which)."""
    return TASKS[task].metric(objective or TASKS[task].objective) if task in TASKS else None


def build_task(task: Choice) -> Task:
    """The task `task.name` names; the other keys of the task group are its arguments."""
    return TASKS[task.name](**task.args)


# Registration happens on import: every module of this package is imported, so a new task is one
# file here (and its conf/task/ YAML), as a model is in components/models/.
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
