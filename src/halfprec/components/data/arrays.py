"""Datasets small enough to live in memory as two tensors: scikit-learn's digits, and synthetic
Gaussian clusters of any shape. Their batches are index gathers on the device (batches.py, `Batches`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import numpy as np
import torch

from halfprec.components.data import Dataset, Split, register_dataset
from halfprec.spec import Spec


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(1797 x 64 pixels in 0..16, labels), read from the file scikit-learn ships without importing
    scikit-learn, a slow import."""
    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if path is None or not path.is_file():  # a scikit-learn that keeps it elsewhere: its own loader
        from sklearn.datasets import load_digits as sk_load_digits

        raw = sk_load_digits()
        return raw.data, raw.target
    table = np.loadtxt(path, delimiter=",")  # as sklearn.datasets.load_digits reads it
    return table[:, :-1], table[:, -1].astype(np.int64)


@register_dataset("digits")
def load_digits(
    val_size: Annotated[int, Spec(low=1, high=1796, doc="validation samples of the 1,797")] = 397,
    seed: Annotated[int, Spec(low=0, doc="the train/val split's seed")] = 0,
) -> Dataset:
    """The 1,797 8x8 digit images that ship with scikit-learn, as 1x8x8, standardized by train stats."""
    pixels, labels = _digits_arrays()
    x = torch.tensor(pixels, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    y = torch.tensor(labels, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    val, train = order[:val_size], order[val_size:]
    mean, std = x[train].mean(), x[train].std()
    x = (x - mean) / std
    return Dataset(Split(x[train], y[train]), Split(x[val], y[val]), (1, 8, 8), 10)


@register_dataset("synthetic")
def make_synthetic(
    shape: Annotated[Sequence[int], Spec(low=1, nonempty=True, doc="one sample's shape, e.g. [3, 32, 32]")] = (1, 8, 8),
    num_classes: Annotated[int, Spec(low=2)] = 10,
    num_train: Annotated[int, Spec(low=1, doc="training samples")] = 1024,
    num_val: Annotated[int, Spec(low=1, doc="validation samples")] = 256,
    noise: Annotated[float, Spec(low=0, doc="the std of the noise around each class's prototype")] = 1.0,
    seed: Annotated[int, Spec(low=0)] = 0,
) -> Dataset:
    """Gaussian clusters around one random prototype per class: learnable, any shape."""
    g = torch.Generator().manual_seed(seed)
    prototypes = torch.randn(num_classes, *shape, generator=g)

    def split(n: int) -> Split:
        y = torch.randint(0, num_classes, (n,), generator=g)
        return Split(prototypes[y] + noise * torch.randn(n, *shape, generator=g), y)

    return Dataset(split(num_train), split(num_val), tuple(shape), num_classes)
