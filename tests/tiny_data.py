"""Tiny datasets in the real on-disk formats, for the loaders that read from disk.

CIFAR-10's python version (pickled dicts of uint8 rows in cifar-10-batches-py/) and an ImageFolder
tree of PNGs, written by the tests so that torchvision's own readers parse them. The md5 sums are
not the originals', so CIFAR-10 runs on these need `data.verify=false`.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
from PIL import Image

CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def write_cifar10(root: Path, per_batch: int = 8, test: int = 16, seed: int = 0) -> Path:
    """root/cifar-10-batches-py/ with data_batch_1..5 (per_batch images each), test_batch and batches.meta.

    The keys are str, as the original Python 2 pickles load in Python 3 with encoding="latin1", which is
    what torchvision does (with encoding="bytes" they read b"data", b"labels"). Image i of a file has label
    i % 10 and random pixels, except the red channel's pixel (0, 0), which holds the image's number within
    its split (mod 256): the tests can tell images apart after loading.
    """
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)

    def write(name: str, first: int, n: int) -> None:
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)  # rows: 1024 red, 1024 green, 1024 blue
        data[:, 0] = np.arange(first, first + n) % 256
        batch = {"batch_label": name, "labels": [i % 10 for i in range(n)], "data": data}
        batch["filenames"] = [f"{name}_{i}.png" for i in range(n)]
        (folder / name).write_bytes(pickle.dumps(batch))

    for i in range(5):
        write(f"data_batch_{i + 1}", i * per_batch, per_batch)
    write("test_batch", 0, test)
    meta = {"label_names": CIFAR10_CLASSES, "num_cases_per_batch": per_batch, "num_vis": 3072}
    (folder / "batches.meta").write_bytes(pickle.dumps(meta))
    return root


def write_imagefolder(
    root: Path, classes: tuple[str, ...] = ("cat", "dog", "fox"), train: int = 8, val: int = 3, size: int = 40
) -> Path:
    """root/{train,val}/<class>/<n>.png: random RGB images of size x size."""
    rng = np.random.default_rng(0)
    for split, n in (("train", train), ("val", val)):
        for name in classes:
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")
    return root
