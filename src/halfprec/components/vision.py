"""The torchvision side of the datasets read from disk: transforms, and CIFAR-10 without md5 checks.

A module of its own so that the in-memory datasets (digits, synthetic) do not pay torchvision's
slow import: `halfprec.components.data.image_files` imports this only when a disk dataset is built.
"""

from __future__ import annotations

from torchvision import datasets
from torchvision import transforms as T

# Per-channel mean/std of the CIFAR-10 training images (the often-copied std 0.2023, 0.1994, 0.2010
# is not it), and ImageNet's, which pretrained timm and torchvision models expect.
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def cifar10_transforms() -> tuple[T.Compose, T.Compose]:
    """(train, val): random 32x32 crops of the 4-pixel zero-padded image and horizontal flips for training."""
    to_tensor = [T.ToTensor(), T.Normalize(CIFAR10_MEAN, CIFAR10_STD)]
    return T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), *to_tensor]), T.Compose(to_tensor)


def imagenet_transforms(size: int) -> tuple[T.Compose, T.Compose]:
    """(train, val): random resized crops and flips; for validation the short side resized to size * 256/224,
    then the center size x size crop (the usual 0.875 crop ratio)."""
    to_tensor = [T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    train = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), *to_tensor])
    return train, T.Compose([T.Resize(int(size * 256 / 224)), T.CenterCrop(size), *to_tensor])


class UnverifiedCIFAR10(datasets.CIFAR10):
    """torchvision's CIFAR10 checking only that its files exist (torchvision skips an md5 given as None):
    for files that are not the original ones, such as the tests' tiny copies (`data.verify=false`)."""

    train_list = [[name, None] for name, _md5 in datasets.CIFAR10.train_list]
    test_list = [[name, None] for name, _md5 in datasets.CIFAR10.test_list]
    meta = {**datasets.CIFAR10.meta, "md5": None}
