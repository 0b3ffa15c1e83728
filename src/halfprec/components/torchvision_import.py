"""torchvision, imported where a disk dataset or a timm model needs it, with one line when it does not
match torch: a torchvision built for another torch release fails on import with "operator
torchvision::nms does not exist" (e.g. PyTorch's CPU wheel of torch installed beside PyPI's torchvision)."""

from __future__ import annotations

from importlib import metadata
from types import ModuleType

from halfprec.errors import ConfigError


def import_torchvision(key: str, value: str) -> ModuleType:
    """`import torchvision`; a torchvision that does not match torch is a ConfigError on `key`=`value`
    (the option that needs it) naming both versions and the pip command that installs the match."""
    try:
        import torchvision
    except RuntimeError as err:
        if "torchvision::" not in str(err):
            raise
        import torch

        fix = f"torch {torch.__version__} and torchvision {metadata.version('torchvision')} do not match ({err}); "
        raise ConfigError(key, value, fix + reinstall_command(torch.__version__)) from None
    return torchvision


def reinstall_command(torch_version: str) -> str:
    """The pip command that installs the torchvision built for `torch_version`, from the index its
    local tag names (`2.6.0+cpu`: PyTorch's CPU wheels); since torch 2.0, torch 2.N pairs with 0.(N+15)."""
    release, _, local = torch_version.partition("+")
    major, minor = (int(part) for part in release.split(".")[:2])
    if major != 2:
        return f"install the torchvision release made for torch {release} (pytorch.org/get-started/previous-versions)"
    index = f" --index-url https://download.pytorch.org/whl/{local}" if local else ""
    return f'pip install "torchvision==0.{minor + 15}.*"{index}'
