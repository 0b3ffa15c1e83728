"""task=lm: next-token prediction over token sequences; val/loss (nats per token), val/ppl, val/bpb."""

from __future__ import annotations

import math
from typing import Annotated

import torch
import torch.nn.functional as F

from halfprec.components.data import Dataset
from halfprec.components.data.batches import IGNORE_LABEL
from halfprec.components.tasks import VAL_LOSS, Evaluator, Metric, Task, register_task
from halfprec.spec import Spec


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


@register_task
class LanguageModelling(Task):
    """Next-token prediction: the output is (batch, time, vocabulary) logits, the targets the next
    tokens. Cross-entropy in fp32, averaged over the micro-batch's tokens (every micro-batch has the
    same number, so dividing by accum averages over the window's tokens), plus the optional z-loss;
    val/loss (nats per token, without the z-loss), val/ppl, val/bpb."""

    name = "lm"
    # val/bpb where the dataset knows its bytes per token; val/ppl is val/loss again, exponentiated
    metrics = (VAL_LOSS, Metric("val/bpb"), Metric("val/ppl", fmt=".4g", column=False))
    learns_from = "tokens"

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

    def val_batch_size(self, batch_size: int) -> int:
        # the micro-batch: the logits are (batch, block, vocabulary), too large for many blocks at once
        return batch_size

    def throughput(self, samples_per_s: float, data: Dataset) -> dict[str, float]:
        return {"perf/tokens_per_s": samples_per_s * data.input_shape[0]}
