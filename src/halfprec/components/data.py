"""Datasets. Digits and synthetic images live in memory; CIFAR-10 and ImageFolder trees are read from disk.

The in-memory ones are small enough to live on the device as two tensors, so batches are index
gathers rather than a DataLoader collating single samples (which would dominate a tiny model's
step). The ones on disk use torchvision's datasets and transforms behind a torch DataLoader, with
the same sample order, rank slices and resumable position as the in-memory ones.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator, Sequence, Sized
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal, cast

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler
from torch.utils.data import Dataset as TorchDataset

from halfprec.errors import ConfigError
from halfprec.machine import loader_workers
from halfprec.spec import Spec

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar.html"
CIFAR10_FILES = [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "batches.meta"]


@dataclass
class Split:
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
            share = self.val if world_size == 1 else _RankShare(self.val, rank, world_size)
            self._val_loader = key, DataLoader(share, batch_size, **self.workers.loader_args(device))
        loader = self._val_loader[1]
        return ((x.to(device, non_blocking=True), y.to(device, non_blocking=True)) for x, y in loader)


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(1797 x 64 pixels in 0..16, labels). Read straight from the file scikit-learn ships, without
    importing scikit-learn: that import takes ~1.3 s, a fifth of the default run's start-up."""
    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz" if spec and spec.origin else None
    if path is None or not path.is_file():  # a scikit-learn that keeps it elsewhere: its own loader
        from sklearn.datasets import load_digits as sk_load_digits

        raw = sk_load_digits()
        return raw.data, raw.target
    table = np.loadtxt(path, delimiter=",")  # as sklearn.datasets.load_digits reads it
    return table[:, :-1], table[:, -1].astype(np.int64)


@dataclass(frozen=True)
class DatasetEntry:
    """A registered dataset: its loader, and what its samples hold, which the model and the task
    must fit (config/rules.py, check_fit): `inputs` "tensors" (images, feature vectors) or "tokens"
    (token ids), `targets` "classes" (a class index per sample) or "tokens" (the next token at each
    position). A fork's dataset of another kind names its own ("values", ...)."""

    load: Callable[..., Dataset]
    inputs: str = "tensors"
    targets: str = "classes"


# `data.name` -> its entry; the other `data.*` keys (but batch_size) are the loader's arguments.
# The loaders register themselves (register_dataset); components/__init__.py imports their modules.
DATASETS: dict[str, DatasetEntry] = {}


def register_dataset(name: str, inputs: str = "tensors", targets: str = "classes"):
    def add(load):
        DATASETS[name] = DatasetEntry(load, inputs, targets)
        return load

    return add


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


# The DataLoader's arguments of the datasets read from disk.
Root = Annotated[str, Spec(nonempty=True, doc="the dataset's directory")]
NumWorkers = Annotated[Literal["auto"] | int, Spec(low=0, doc="DataLoader processes; 0 = load in the training process")]
PersistentWorkers = Annotated[bool | None, Spec(doc="null: true when data.num_workers > 0")]


@register_dataset("cifar10")
def load_cifar10(
    root: Root = "data/cifar10",
    download: Annotated[bool, Spec(doc="let torchvision fetch the archive into data.root")] = False,
    verify: Annotated[bool, Spec(doc="check torchvision's md5 sums")] = True,
    num_workers: NumWorkers = "auto",
    pin_memory: bool = True,
    persistent_workers: PersistentWorkers = None,
) -> Dataset:
    """torchvision's CIFAR10 from `root`/cifar-10-batches-py: 50,000 training images, randomly cropped and
    flipped; validation on the 10,000 test images. `verify` checks the files against torchvision's md5 sums."""
    folder = Path(root) / "cifar-10-batches-py"
    missing = [name for name in CIFAR10_FILES if not (folder / name).is_file()]
    if missing and not download:
        raise ConfigError(
            "data.root",
            root,
            f"no CIFAR-10 here (expected {folder.resolve()}/ with data_batch_1..5, test_batch and batches.meta"
            f"{'; missing ' + ', '.join(missing) if folder.is_dir() else ''}): download the python version from "
            f"{CIFAR10_URL} and extract it into {Path(root).resolve()}, or set data.download=true",
        )
    from torchvision.datasets import CIFAR10

    from halfprec.components.vision import UnverifiedCIFAR10, cifar10_transforms

    cifar = CIFAR10 if verify else UnverifiedCIFAR10
    train_tf, val_tf = cifar10_transforms()
    try:
        train = cifar(root, train=True, transform=train_tf, download=download)
        val = cifar(root, train=False, transform=val_tf)
    except RuntimeError:  # torchvision's "Dataset not found or corrupted": the files exist, their md5s differ
        raise ConfigError(
            "data.root",
            root,
            "the CIFAR-10 files there do not match torchvision's md5 sums (an interrupted download, or other "
            "files): extract them again, or set data.verify=false to use them as they are",
        ) from None
    except OSError as err:  # no network (urllib's URLError), or root not writable
        if not download:
            raise
        raise ConfigError(
            "data.download",
            True,
            f"could not fetch CIFAR-10 into {Path(root).resolve()} ({err}): download the python version from "
            f"{CIFAR10_URL} where there is a network and extract it there",
        ) from None
    return Dataset(
        train,
        val,
        (3, 32, 32),
        len(train.classes),
        Workers(loader_workers(num_workers, most=4), pin_memory, persistent_workers),
    )


@register_dataset("imagefolder")
def load_imagefolder(
    root: Root = "data/imagenet",
    image_size: Annotated[int, Spec(low=1, doc="the side of the square crops the model sees, e.g. 224")] = 224,
    num_workers: NumWorkers = "auto",
    pin_memory: bool = True,
    persistent_workers: PersistentWorkers = None,
) -> Dataset:
    """torchvision's ImageFolder over `root`/train and `root`/val, one folder per class (labels are the
    sorted folder names' indices): random resized crops and flips for training, center crops for validation."""
    dirs = {split: Path(root) / split for split in ("train", "val")}
    missing = [f"{split}/" for split, path in dirs.items() if not path.is_dir()]
    if missing:
        where = Path(root).resolve()
        raise ConfigError(
            "data.root",
            root,
            f"no ImageFolder tree here (expected {where}/train/<class>/<image> and {where}/val/<class>/<image>; "
            f"missing {' and '.join(missing)}): put the images there, one folder per class (ImageNet: train/ and "
            "val/ sorted into its 1,000 class folders), or point data.root at such a tree",
        )
    from torchvision.datasets import ImageFolder

    from halfprec.components.vision import imagenet_transforms

    train_tf, val_tf = imagenet_transforms(image_size)
    try:
        train, val = ImageFolder(dirs["train"], train_tf), ImageFolder(dirs["val"], val_tf)
    except FileNotFoundError as err:  # no class folders, or a class folder without images
        raise ConfigError("data.root", root, f"not a usable ImageFolder tree: {err}") from None
    if train.classes != val.classes:
        # labels are indices into each split's sorted folder names: other folders would mislabel val
        only_train = sorted(set(train.classes) - set(val.classes))[:5]
        only_val = sorted(set(val.classes) - set(train.classes))[:5]
        raise ConfigError(
            "data.root",
            root,
            f"train/ and val/ must hold the same class folders (only in train/: {only_train}; only in val/: "
            f"{only_val})",
        )
    workers = Workers(loader_workers(num_workers, most=8), pin_memory, persistent_workers)
    return Dataset(train, val, (3, image_size, image_size), len(train.classes), workers)


def build_dataset(cfg) -> Dataset:
    kwargs = {k: v for k, v in cfg.items() if k not in ("name", "batch_size")}
    return DATASETS[cfg.name].load(**kwargs)


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


class _RankShare(TorchDataset):
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
