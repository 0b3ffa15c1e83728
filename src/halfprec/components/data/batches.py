"""How a dataset's splits become batches: endless shuffled training micro-batches, one pass in order
for validation, each rank's share of both, and the position a resumed run starts from.

An in-memory `Split` is small enough to live on the device as two tensors, so its batches are index
gathers (`Batches`) rather than a DataLoader collating single samples (which would dominate a tiny
model's step). A map-style dataset read from disk goes through a torch DataLoader (`LoaderBatches`,
with `Workers` its settings), with the same sample order, rank slices and resumable position.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from dataclasses import dataclass
from typing import cast

import torch
from torch.utils.data import DataLoader, Sampler
from torch.utils.data import Dataset as TorchDataset

from halfprec.errors import ConfigError


@dataclass
class Split:
    """A split held in memory as two tensors, one row per sample: images and their labels, or token
    blocks and their next tokens (components/data/text.py)."""

    x: torch.Tensor  # (N, C, H, W) float32
    y: torch.Tensor  # (N,) int64

    def __len__(self) -> int:
        return len(self.y)


@dataclass
class Workers:
    """torch DataLoader settings for the datasets read from disk (`data.num_workers`, ...)."""

    num_workers: int = 0
    pin_memory: bool = False
    persistent_workers: bool | None = None  # None: keep the workers between epochs whenever there are any

    def loader_args(self, device: torch.device) -> dict:
        persistent = self.num_workers > 0 if self.persistent_workers is None else self.persistent_workers
        return {
            "num_workers": self.num_workers,
            "pin_memory": self.pin_memory and device.type == "cuda",  # it only speeds up copies to a GPU
            "persistent_workers": persistent,
            # its own generator: starting an epoch then takes no number from the global RNG, which
            # dropout draws from and checkpoints restore
            "generator": torch.Generator().manual_seed(0),
        }


def num_samples(dataset: Split | TorchDataset) -> int:
    """len() of a split: torch's Dataset declares no __len__, but the map-style ones used here
    (torchvision's, ours) all have one."""
    return len(cast(Sized, dataset))


def check_batch_size(batch_size: int, world_size: int, n: int) -> None:
    """A global batch (over all ranks) must fit in the training split: the last partial one is dropped."""
    if batch_size * world_size > n:
        ranks = f" over {world_size} processes" if world_size > 1 else ""
        fix = f"must be <= {n // world_size}: the {n} training samples make no full batch{ranks}"
        raise ConfigError("data.batch_size", batch_size, fix)


class Batches:
    """Endless shuffled micro-batches over a split, reshuffled every epoch, last partial batch dropped.

    The position (epoch, index) and the seed fully determine the next batch. Under DDP every rank
    walks the same order of global batches (batch_size * world_size) and takes its own slice, so
    N ranks with micro-batch b see what one process with batch N*b sees.
    """

    def __init__(
        self, split: Split, batch_size: int, seed: int, device: torch.device, rank: int = 0, world_size: int = 1
    ):
        check_batch_size(batch_size, world_size, len(split))
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


class _EpochOrder(Sampler):
    """This rank's samples for the rest of an epoch, as (index, seed) keys, from global position `start`.

    The order is Batches' (a permutation seeded by seed + epoch; each rank takes its slice of every
    global batch), and every position gets its own augmentation seed. Starting at `start` skips the
    samples before it without loading them: that is how a resumed run finds its place.
    """

    def __init__(self, n: int, batch_size: int, seed: int, rank: int, world_size: int):
        self.n, self.batch_size, self.global_batch = n, batch_size, batch_size * world_size
        self.seed, self.rank = seed, rank
        self.epoch, self.start = 0, 0

    def __len__(self) -> int:
        return (self.n - self.start) // self.global_batch * self.batch_size

    def __iter__(self) -> Iterator[tuple[int, int]]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.n, generator=g)
        seeds = torch.randint(2**62, (self.n,), generator=g)
        batches = (self.n - self.start) // self.global_batch  # the last partial batch is dropped
        positions = torch.arange(self.start, self.start + batches * self.global_batch).view(batches, -1)
        mine = positions[:, self.rank * self.batch_size : (self.rank + 1) * self.batch_size].flatten()
        return zip(order[mine].tolist(), seeds[mine].tolist())


class _SeededSamples(TorchDataset):
    """Loads (index, seed) keys with each sample's random augmentation drawn from its own seed, so a
    sample comes out the same in whichever process loads it: batches do not depend on num_workers,
    the world size, or where a run was resumed."""

    def __init__(self, dataset: TorchDataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return num_samples(self.dataset)

    def __getitem__(self, key: tuple[int, int]):
        index, seed = key
        with torch.random.fork_rng(devices=[]):  # with num_workers=0 this is the training process's RNG
            torch.manual_seed(seed)
            return self.dataset[index]


class LoaderBatches:
    """`Batches` for datasets on disk: the same order, rank slices, state and resume, loaded by a DataLoader."""

    def __init__(
        self,
        dataset: TorchDataset,
        batch_size: int,
        seed: int,
        device: torch.device,
        rank: int = 0,
        world_size: int = 1,
        workers: Workers | None = None,
    ):
        self.n, self.global_batch, self.device = num_samples(dataset), batch_size * world_size, device
        check_batch_size(batch_size, world_size, self.n)
        self.seed, self.epoch, self.index = seed, 0, 0
        self.sampler = _EpochOrder(self.n, batch_size, seed, rank, world_size)
        args = (workers or Workers()).loader_args(device)
        self.loader = DataLoader(_SeededSamples(dataset), batch_size, sampler=self.sampler, **args)
        # this epoch's DataLoader iterator, started by the first next()
        self._batches: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.epoch, self.index = state["seed"], state["epoch"], state["index"]
        self.sampler.seed = self.seed
        self._batches = None  # the next batch starts the epoch's iterator at the restored position

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.index + self.global_batch > self.n:
            self.epoch, self.index, self._batches = self.epoch + 1, 0, None
        if self._batches is None:
            self.sampler.epoch, self.sampler.start = self.epoch, self.index
            self._batches = iter(self.loader)
        x, y = next(self._batches)
        self.index += self.global_batch
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)


TrainBatches = Batches | LoaderBatches  # what Dataset.train_batches returns; the loop needs next() and state_dict()


# cross_entropy's default ignore_index: a padded sample adds nothing to a summed loss, and no
# prediction equals it, so it adds nothing to the count of correct ones either
IGNORE_LABEL = -100


def rank_share(n: int, rank: int, world_size: int) -> torch.Tensor:
    """Indices of this rank's validation samples: rank, rank + world_size, ... < n, then -1 (padding)
    up to ceil(n / world_size), the same length on every rank."""
    share = torch.arange(rank, -(-n // world_size) * world_size, world_size)
    return torch.where(share < n, share, -1)


def eval_batches(
    split: Split, batch_size: int, device: torch.device, rank: int = 0, world_size: int = 1
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    x, y = split.x, split.y
    if world_size > 1:
        share = rank_share(len(y), rank, world_size)
        index = share.clamp(min=0)  # padding (-1) reads sample 0, and gets the ignored label
        keep = (share >= 0).view(-1, *[1] * (y.dim() - 1))  # a sample's label, or each of its tokens
        x, y = x[index], torch.where(keep, y[index], IGNORE_LABEL)
    for i in range(0, len(y), batch_size):
        yield x[i : i + batch_size].to(device), y[i : i + batch_size].to(device)


class RankShare(TorchDataset):
    """A rank's share of a map-style validation set (see `rank_share`)."""

    def __init__(self, dataset: TorchDataset, rank: int, world_size: int):
        self.dataset, self.share = dataset, rank_share(num_samples(dataset), rank, world_size).tolist()

    def __len__(self) -> int:
        return len(self.share)

    def __getitem__(self, i: int):
        if self.share[i] >= 0:
            return self.dataset[self.share[i]]
        x, y = self.dataset[0]  # the padding's label has the type of the others: the batches collate
        return x, torch.full_like(y, IGNORE_LABEL) if torch.is_tensor(y) else IGNORE_LABEL
