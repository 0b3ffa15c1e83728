"""Dataset registry: `data.name` names a loader; the other `data.*` keys (but batch_size) are its
keyword arguments, checked against its annotated signature.

A loader returns a `Dataset`: the train and val splits (in-memory `Split`s, or map-style torch
datasets read from disk), the input shape and classes a model is built for. How its splits become
batches, in the same order whichever kind they are, is batches.py. Add a dataset: a loader in a
module of this package, decorated with `@register_dataset("name")` (its `inputs` and `targets`
if its samples are not images and class labels), and `conf/data/name.yaml` with `name: name`,
`batch_size` and the loader's arguments.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Annotated, Literal, TypeVar

import torch
from torch.utils.data import DataLoader
from torch.utils.data import Dataset as TorchDataset

from halfprec.components.data.batches import (
    Batches,
    LoaderBatches,
    RankShare,
    Split,
    Workers,
    eval_batches,
)
from halfprec.spec import Choice, Spec


@dataclass
class Dataset:
    """What a loader function returns: the splits, and the input shape and classes a model is built for.

    `train` and `val` are in-memory Splits, or map-style torch datasets of (image tensor, label).
    """

    train: Split | TorchDataset
    val: Split | TorchDataset
    input_shape: tuple[int, ...]
    num_classes: int  # classes, or the vocabulary of a token dataset
    workers: Workers = field(default_factory=Workers)
    bytes_per_token: float | None = None  # token datasets: text bytes per token, for val/bpb (1 for bytes)
    _val_loader: tuple[tuple[int, int, int], DataLoader] | None = field(default=None, init=False, repr=False)

    def train_batches(
        self, batch_size: int, seed: int, device: torch.device, rank: int = 0, world_size: int = 1
    ) -> Batches | LoaderBatches:
        """Endless training micro-batches for this rank: see `Batches`."""
        if isinstance(self.train, Split):
            return Batches(self.train, batch_size, seed, device, rank, world_size)
        return LoaderBatches(self.train, batch_size, seed, device, rank, world_size, self.workers)

    def val_batches(
        self, batch_size: int, device: torch.device, rank: int = 0, world_size: int = 1
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One pass, in order, over this rank's share of the validation split: samples rank,
        rank + world_size, ... Every rank gets the same number of samples, hence of forwards (FSDP's
        forward is a collective): the short ones are padded with sample 0 labelled IGNORE_LABEL."""
        if isinstance(self.val, Split):
            return eval_batches(self.val, batch_size, device, rank, world_size)
        key = (batch_size, rank, world_size)
        if self._val_loader is None or self._val_loader[0] != key:
            # kept between evaluations, so that persistent workers persist
            share = self.val if world_size == 1 else RankShare(self.val, rank, world_size)
            self._val_loader = key, DataLoader(share, batch_size, **self.workers.loader_args(device))
        loader = self._val_loader[1]
        return ((x.to(device, non_blocking=True), y.to(device, non_blocking=True)) for x, y in loader)


@dataclass(frozen=True)
class DatasetEntry:
    """A registered dataset: its loader, and what its samples hold, which the model and the task
    must fit (config/rules.py, check_fit): `inputs` "tensors" (images, feature vectors) or "tokens"
    (token ids), `targets` "classes" (a class index per sample) or "tokens" (the next token at each
    position). A fork's dataset of another kind names its own ("values", ...)."""

    load: Callable[..., Dataset]
    inputs: str = "tensors"
    targets: str = "classes"


# `data.name` -> its entry. The loaders register themselves when their module is imported (below).
DATASETS: dict[str, DatasetEntry] = {}
Loader = TypeVar("Loader", bound=Callable[..., Dataset])


def register_dataset(name: str, inputs: str = "tensors", targets: str = "classes") -> Callable[[Loader], Loader]:
    """Makes `data.name=<name>` choose the decorated loader; `inputs` and `targets` as in DatasetEntry."""

    def add(load: Loader) -> Loader:
        DATASETS[name] = DatasetEntry(load, inputs, targets)
        return load

    return add


def build_dataset(data: Choice) -> Dataset:
    """The dataset `data.name` names, loaded with the other `data.*` keys (batch_size aside)."""
    return DATASETS[data.name].load(**data.args)


# The arguments the loaders of datasets read from disk share: their directory, their DataLoader's.
Root = Annotated[str, Spec(nonempty=True, doc="the dataset's directory")]
NumWorkers = Annotated[Literal["auto"] | int, Spec(low=0, doc="DataLoader processes; 0 = load in the training process")]
PersistentWorkers = Annotated[bool | None, Spec(doc="null: true when data.num_workers > 0")]


# Registration happens on import: every module of this package is imported (in name order, which is
# the order `data=` choices are listed in), so a new dataset is one file here (and its conf/data/
# YAML). None imports anything heavy at module level (scikit-learn, torchvision: when a loader runs).
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
