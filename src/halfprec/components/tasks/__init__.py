"""Tasks (`task=...`): what is learned. A task says what a batch holds, how the loss is computed
from the model's output, and which validation metrics it reports, so that the optimizer step and
the training loop know nothing about labels or accuracy (docs/design.md, "Tasks").

A new task is a class with `loss` and `evaluator`, registered in TASKS, and a conf/task/ YAML.
"""

from __future__ import annotations

import math
from typing import Annotated

import torch
import torch.nn.functional as F

from halfprec.components.data import IGNORE_LABEL, Dataset  # IGNORE_LABEL: the padding that evens out ranks' shares
from halfprec.spec import Spec


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
    metrics: tuple[str, ...] = ()  # the val/* names its evaluator reports
    needs_tokens = False  # a task over token sequences (the datasets of components/text.py)

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean training loss of a micro-batch, in fp32 whatever the model computed in."""
        raise NotImplementedError

    def evaluator(self, device: torch.device, data: Dataset) -> Evaluator:
        raise NotImplementedError

    def throughput(self, samples_per_s: float, data: Dataset) -> dict[str, float]:
        """perf/* metrics in the task's own unit, beside perf/samples_per_s."""
        return {}


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
    metrics = ("val/loss", "val/acc")

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.float(), targets)

    def evaluator(self, device: torch.device, data: Dataset) -> Evaluator:
        return ClassificationEvaluator(device)


class LanguageModellingEvaluator(Evaluator):
    def __init__(self, device: torch.device, bytes_per_token: float | None):
        self.bytes_per_token = bytes_per_token
        self.loss_sum = torch.zeros((), device=device, dtype=torch.float64)
        self.tokens = torch.zeros((), device=device, dtype=torch.int64)

    def add(self, output: torch.Tensor, targets: torch.Tensor) -> None:
        logits, targets = output.float().flatten(0, -2), targets.flatten()
        self.loss_sum += F.cross_entropy(logits, targets, reduction="sum", ignore_index=IGNORE_LABEL)
        self.tokens += (targets != IGNORE_LABEL).sum()

    def sums(self) -> torch.Tensor:
        return torch.stack([self.loss_sum, self.tokens.double()])

    def metrics(self, sums: list[float], n: int) -> dict[str, float]:
        loss = sums[0] / sums[1]  # nats per token
        out = {"val/loss": loss, "val/ppl": math.exp(loss) if loss < 700 else math.inf}
        if self.bytes_per_token:  # bits per byte: comparable across tokenizers
            out["val/bpb"] = loss / math.log(2) / self.bytes_per_token
        return out


class LanguageModelling(Task):
    """Next-token prediction: the output is (batch, time, vocabulary) logits, the targets the next
    tokens. Cross-entropy in fp32, averaged over the micro-batch's tokens (every micro-batch has the
    same number, so dividing by accum averages over the window's tokens), plus the optional z-loss;
    val/loss (nats per token, without the z-loss), val/ppl, val/bpb."""

    name = "lm"
    metrics = ("val/loss", "val/ppl", "val/bpb")  # val/bpb where the dataset knows its bytes per token
    needs_tokens = True

    def __init__(
        self,
        z_loss: Annotated[float, Spec(low=0, doc="weight of PaLM's auxiliary loss log(Z)^2; 0 = off")] = 0.0,
    ):
        self.z_loss = z_loss

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = output.float().flatten(0, -2)
        loss = F.cross_entropy(logits, targets.flatten())
        if self.z_loss:  # Chowdhery et al. 2022: keeps log Z, the softmax normaliser, near 0
            loss = loss + self.z_loss * torch.logsumexp(logits, dim=-1).pow(2).mean()
        return loss

    def evaluator(self, device: torch.device, data: Dataset) -> Evaluator:
        return LanguageModellingEvaluator(device, data.bytes_per_token)

    def throughput(self, samples_per_s: float, data: Dataset) -> dict[str, float]:
        return {"perf/tokens_per_s": samples_per_s * data.input_shape[0]}


TASKS: dict[str, type[Task]] = {"classification": Classification, "lm": LanguageModelling}


def build_task(cfg) -> Task:
    """The task `task.name` names; the other keys of the task group are its arguments."""
    kwargs = {k: v for k, v in cfg.items() if k != "name"}
    return TASKS[cfg.name](**kwargs)
