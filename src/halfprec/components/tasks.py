"""Tasks (`task=...`): what is learned. A task says what a batch holds, how the loss is computed
from the model's output, and which validation metrics it reports, so that the optimizer step and
the training loop know nothing about labels or accuracy (docs/design.md, "Tasks").

A new task is a class with `loss` and `evaluator`, registered in TASKS, and a conf/task/ YAML.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from halfprec.components.data import IGNORE_LABEL  # the label of the padding that evens out ranks' shares


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

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean training loss of a micro-batch, in fp32 whatever the model computed in."""
        raise NotImplementedError

    def evaluator(self, device: torch.device) -> Evaluator:
        raise NotImplementedError


class ClassificationEvaluator(Evaluator):
    def __init__(self, device: torch.device):
        self.loss_sum = torch.zeros((), device=device)
        self.correct = torch.zeros((), device=device, dtype=torch.int64)

    def add(self, output: torch.Tensor, targets: torch.Tensor) -> None:
        logits = output.float()
        self.loss_sum += F.cross_entropy(logits, targets, reduction="sum", ignore_index=IGNORE_LABEL)  # padding adds 0
        self.correct += (logits.argmax(1) == targets).sum()

    def sums(self) -> torch.Tensor:
        return torch.stack([self.loss_sum.double(), self.correct.double()])

    def metrics(self, sums: list[float], n: int) -> dict[str, float]:
        loss_sum, correct = sums
        return {"val/loss": loss_sum / n, "val/acc": correct / n}


class Classification(Task):
    """Class labels; cross-entropy on the logits; val/loss and val/acc."""

    name = "classification"

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.float(), targets)

    def evaluator(self, device: torch.device) -> Evaluator:
        return ClassificationEvaluator(device)


TASKS: dict[str, type[Task]] = {"classification": Classification}


def build_task(cfg) -> Task:
    """The task `task.name` names; the other keys of the task group are its arguments."""
    kwargs = {k: v for k, v in cfg.items() if k != "name"}
    return TASKS[cfg.name](**kwargs)
