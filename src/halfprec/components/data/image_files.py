"""Image datasets read from disk through torchvision: CIFAR-10's python version, and any ImageFolder
tree (ImageNet, or a subset). Their samples are loaded, transformed (components/vision.py) and
collated by a torch DataLoader (batches.py, `LoaderBatches`), with the sample order, rank slices and
resumable position of the in-memory datasets.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from halfprec.components.data import Dataset, NumWorkers, PersistentWorkers, Root, Workers, register_dataset
from halfprec.components.torchvision_import import import_torchvision
from halfprec.errors import ConfigError
from halfprec.machine import loader_workers
from halfprec.spec import Spec

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar.html"
CIFAR10_FILES = [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch", "batches.meta"]


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
    import_torchvision("data", "cifar10")
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
    import_torchvision("data", "imagefolder")
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
