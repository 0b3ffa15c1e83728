"""The one module that imports torchao's prototype number formats (`torchao.prototype.mx_formats`,
a prototype API that moved between releases: pyproject.toml pins the torchao it was written for).

Element casts (round to nearest, ties to even, saturating) for the 4- and 6-bit elements, which
torch has no dtype for, and torchao's whole MX and NVFP4 quantizers, which the tests hold
halfprec's own scales against. The 8-bit elements are torch's own dtypes (formats/elements.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch


@contextlib.contextmanager
def quiet_import() -> Iterator[None]:
    """Around an import of torchao, which registers Enums that torch now supports natively: a
    deprecation line that would print before anything of the run's own (policy.py uses it too)."""
    logger = logging.getLogger("torch.utils._pytree")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def nearest_cast(element: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """fp32 -> the nearest value of a 4- or 6-bit element (ties to even; past the largest value:
    the largest), returned in fp32. NaN is not handled here (formats/__init__.py: a block with a
    non-finite value is NaN)."""
    with quiet_import():
        from torchao.prototype.mx_formats import kernels

    to_bits, from_bits = {
        "e2m1": (kernels.f32_to_f4_unpacked, kernels.f4_unpacked_to_f32),
        "e2m3": (kernels.f32_to_f6_e2m3_unpacked, kernels.f6_e2m3_unpacked_to_f32),
        "e3m2": (kernels.f32_to_f6_e3m2_unpacked, kernels.f6_e3m2_unpacked_to_f32),
    }[element]
    return lambda x: from_bits(to_bits(x.contiguous()))


def torchao_mx(x: torch.Tensor, element: str, block: int, rule: str) -> torch.Tensor:
    """torchao's MX quantizer, dequantized: a reference for halfprec's (blocks along the last dim)."""
    with quiet_import():
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.prototype.mx_formats.mx_tensor import MXTensor

    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "e2m1": torch.float4_e2m1fn_x2}
    elem = dtype.get(element, f"fp6_{element}")
    mode = ScaleCalculationMode.RCEIL if rule == "rceil" else ScaleCalculationMode.FLOOR
    return MXTensor.to_mx(x.float().contiguous(), elem, block, scaling_mode=mode).dequantize(torch.float32)


def torchao_nvfp4(x: torch.Tensor, tensor_scale: torch.Tensor) -> torch.Tensor:
    """torchao's NVFP4 quantizer (16-value blocks along the last dim), dequantized: a reference."""
    with quiet_import():
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

    q = NVFP4Tensor.to_nvfp4(x.float().contiguous(), per_tensor_scale=tensor_scale)
    return q.dequantize(torch.float32)
