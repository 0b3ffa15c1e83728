"""task=classification: class labels, cross-entropy on the logits, val/loss and val/acc."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from halfprec.components.data import Dataset
from halfprec.components.data.batches import IGNORE_LABEL  # the padding that evens out ranks' shares
from halfprec.components.tasks import VAL_LOSS, Evaluator, Metric, Task, register_task


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


@register_task
class Classification(Task):
    """Class labels; cross-entropy on the logits; val/loss and val/acc."""

    name = "classification"
    metrics = (VAL_LOSS, Metric("val/acc", higher_is_better=True))
    objective = "val/acc"

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.float(), targets)

    def evaluator(self, device: torch.device, data: Dataset) -> Evaluator:
        return ClassificationEvaluator(device)
