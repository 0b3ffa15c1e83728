"""A CIFAR-style ResNet without normalization, carrying what Fixup needs (Zhang et al. 2019).

Each basic block is `relu(conv1(x + b1a) + b1b)`, then `conv2(. + b2a) * scale + b2b`, then
`relu(branch + shortcut)`, with scalar biases starting at 0 and `scale` at 1, so with any init
other than Fixup this is a plain norm-free ResNet. Shortcuts are parameter-free (strided
subsampling plus zero channels, the paper's CIFAR choice), so when every branch outputs zero the
network is exactly its trunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, cast

import torch
import torch.nn.functional as F
from torch import nn

from halfprec.components.models import register_model
from halfprec.spec import Spec


def _scalar(value: float) -> nn.Parameter:
    return nn.Parameter(torch.full((1,), value))


class FixupBasicBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        self.bias1a, self.bias1b, self.bias2a, self.bias2b = (_scalar(0.0) for _ in range(4))
        self.scale = _scalar(1.0)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.stride = stride
        self.extra_channels = out_channels - in_channels

    @property
    def branch_layers(self) -> list[nn.Module]:
        """The branch's weight layers in order; Fixup zeroes the last and rescales the others."""
        return [self.conv1, self.conv2]

    def branch(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.conv1(x + self.bias1a) + self.bias1b)
        return self.conv2(out + self.bias2a) * self.scale + self.bias2b

    def shortcut(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride != 1:
            x = x[:, :, :: self.stride, :: self.stride]
        if self.extra_channels:
            x = F.pad(x, (0, 0, 0, 0, 0, self.extra_channels))
        return x

    def zero_init_last(self) -> None:
        """The norm-free counterpart of zeroing a branch's last norm: its output multiplier."""
        nn.init.zeros_(self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As in the authors' code, a downsampling shortcut also sees bias1a; an identity one does not.
        shortcut = self.shortcut(x + self.bias1a) if self.stride != 1 or self.extra_channels else x
        return F.relu(self.branch(x) + shortcut)


class FixupResNet(nn.Module):
    def __init__(self, in_channels: int, num_classes: int, blocks_per_stage: int, widths: list[int]):
        super().__init__()
        self.stem = nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False)
        self.bias1 = _scalar(0.0)
        blocks, width = [], widths[0]
        for i, out in enumerate(widths):
            for j in range(blocks_per_stage):
                stride = 2 if i > 0 and j == 0 else 1
                blocks.append(FixupBasicBlock(width, out, stride))
                width = out
        self.blocks = nn.Sequential(*blocks)
        self.bias2 = _scalar(0.0)
        self.classifier = nn.Linear(width, num_classes)

    def residual_blocks(self) -> list[FixupBasicBlock]:
        # nn.Sequential iterates as Modules; these are the FixupBasicBlocks built above
        return cast("list[FixupBasicBlock]", list(self.blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem(x) + self.bias1)
        x = self.blocks(x)
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
        return self.classifier(x + self.bias2)


@register_model("fixup_resnet", residual=True)
def create_fixup_resnet(
    input_shape: tuple[int, ...],
    num_classes: int,
    blocks_per_stage: Annotated[int, Spec(low=1, doc="residual blocks per stage; L = 3 * blocks_per_stage")] = 3,
    widths: Annotated[Sequence[int], Spec(low=1, nonempty=True, doc="channels per stage")] = (8, 16, 32),
) -> nn.Module:
    """3 stages of `blocks_per_stage` basic blocks (L = 3 * blocks_per_stage residual branches)."""
    return FixupResNet(input_shape[0], num_classes, blocks_per_stage, list(widths))
