"""Datasets that need no download: scikit-learn's bundled digits, and synthetic images.

Both are small enough to live on the device as two tensors, so batches are index gathers
rather than a DataLoader collating single samples (which would dominate a tiny model's step).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass
class Split:
    x: torch.Tensor  # (N, C, H, W) float32
    y: torch.Tensor  # (N,) int64


@dataclass
class Dataset:
    train: Split
    val: Split
    input_shape: tuple[int, ...]
    num_classes: int


def load_digits(val_size: int = 397, seed: int = 0) -> Dataset:
    """The 1,797 8x8 digit images that ship with scikit-learn, as 1x8x8, standardized by train stats."""
    from sklearn.datasets import load_digits as sk_load_digits

    raw = sk_load_digits()
    x = torch.tensor(raw.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(raw.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    val, train = order[:val_size], order[val_size:]
    mean, std = x[train].mean(), x[train].std()
    x = (x - mean) / std
    return Dataset(Split(x[train], y[train]), Split(x[val], y[val]), (1, 8, 8), 10)


def make_synthetic(
    shape: list[int] = (1, 8, 8),
    num_classes: int = 10,
    num_train: int = 1024,
    num_val: int = 256,
    noise: float = 1.0,
    seed: int = 0,
) -> Dataset:
    """Gaussian clusters around one random prototype per class: learnable, any shape."""
    g = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(num_classes, *shape, generator=g)

    def split(n: int) -> Split:
        y = torch.randint(0, num_classes, (n,), generator=g)
        return Split(prototypes[y] + noise * torch.randn(n, *shape, generator=g), y)

    return Dataset(split(num_train), split(num_val), tuple(shape), num_classes)


# `data.name` -> loader; the other `data.*` keys (but batch_size) are the loader's arguments.
DATASETS = {"digits": load_digits, "synthetic": make_synthetic}


def build_dataset(cfg) -> Dataset:
    kwargs = {k: v for k, v in cfg.items() if k not in ("name", "batch_size")}
    return DATASETS[cfg.name](**kwargs)


class Batches:
    """Endless shuffled micro-batches over a split, reshuffled every epoch, last partial batch dropped.

    The position (epoch, index) and the seed fully determine the next batch. Under DDP every rank
    walks the same order of global batches (batch_size * world_size) and takes its own slice, so
    N ranks with micro-batch b see what one process with batch N*b sees.
    """

    def __init__(
        self, split: Split, batch_size: int, seed: int, device: torch.device, rank: int = 0, world_size: int = 1
    ):
        self.x, self.y = split.x.to(device), split.y.to(device)
        self.batch_size, self.seed = batch_size * world_size, seed
        self.shard = slice(rank * batch_size, (rank + 1) * batch_size)
        self.epoch, self.index = 0, 0
        self._order = self._shuffle()

    def _shuffle(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.y), generator=g).to(self.x.device)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.epoch, self.index = state["seed"], state["epoch"], state["index"]
        self._order = self._shuffle()

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.index + self.batch_size > len(self.y):
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._shuffle()
        idx = self._order[self.index : self.index + self.batch_size][self.shard]
        self.index += self.batch_size
        return self.x[idx], self.y[idx]


def eval_batches(split: Split, batch_size: int, device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for i in range(0, len(split.y), batch_size):
        yield split.x[i : i + batch_size].to(device), split.y[i : i + batch_size].to(device)
