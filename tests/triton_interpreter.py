"""The compiled quantizer's Triton kernels (a GPU's, precision.quantizer=compiled) run by Triton's
interpreter (TRITON_INTERPRET=1) on a CPU, against the eager quantizer, bit for bit.

Inductor writes Triton for CPU tensors with `cpu_backend="triton"`; three stand-ins let it run here:
- a Triton driver reporting an sm_90 target: without a GPU Triton finds no active driver ("0 active
  drivers ([]). There should only be one.") and inductor cannot hash its kernels;
- numpy versions of the libdevice functions the kernels call (rint, floor, exp2, ...): the
  interpreter implements none (its extern_elementwise raises NotImplementedError, the libdevice
  stubs return None);
- the quantizer's GPU path (elements.float_only False: bit views; int16 random bits), which it
  takes for CUDA tensors.
The interpreter computes with numpy's IEEE fp32: this checks the kernels' indexing, masks, per-block
reductions, fusion and arithmetic as written, not the GPU's own (FMA contraction, approximate
libdevice, flushed subnormals), which tests/test_gpu.py checks on a GPU.

Run in a subprocess by tests/test_compiled_quantizer.py (the stand-ins are process-wide); prints one
JSON line, each case -> whether its kernels were Triton's and its values, factor and saturated
count the eager ones.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch
import torch._inductor.config
import triton.language as tl
from test_compiled_quantizer import awkward
from torch._inductor.utils import run_and_get_code
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.language.extra import libdevice
from triton.runtime.driver import driver
from triton.runtime.interpreter import TensorHandle

from halfprec.numerics.formats import FORMATS, elements, quantize_blocks, random_bits, scales

from helpers import same_bits

CASES = [  # (format, axis, tile, rounding, scale rule): every kind of scale, both axes, tiles
    ("mxfp8", -1, False, "nearest", "floor"),
    ("mxfp4", 0, False, "stochastic", "rceil"),
    ("mxint8", 0, False, "nearest", "floor"),
    ("nvfp4", -1, True, "stochastic", "floor"),
    ("fp8_block", -1, True, "nearest", "floor"),
    ("fp8_e4m3_row", 0, False, "stochastic", "floor"),
]


class StandInDriver(DriverBase):
    """Enough of a driver for inductor to write and hash Triton kernels: an H100's target."""

    @staticmethod
    def is_active() -> bool:
        return True

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_device_interface(self):
        return torch.cuda

    def get_benchmarker(self):
        raise NotImplementedError

    def map_python_to_cpp_type(self, ty):
        raise NotImplementedError

    def get_empty_cache_for_benchmark(self):
        raise NotImplementedError

    def clear_cache(self, cache) -> None:
        pass


NUMPY = {"fp32": np.float32, "fp64": np.float64, "int32": np.int32, "int1": np.bool_}


def on_numpy(fn, out=None):
    """A libdevice function for the interpreter: `fn` on the numpy arrays its tensors hold."""

    def op(*args):
        first = next(a for a in args if isinstance(a, tl.tensor))
        data = [a.handle.data if isinstance(a, tl.tensor) else np.asarray(getattr(a, "value", a)) for a in args]
        dtype = out or first.dtype
        result = np.asarray(fn(*data)).astype(NUMPY[dtype.name])
        shaped = tl.block_type(dtype, first.shape) if first.type.is_block() else dtype
        return tl.tensor(TensorHandle(result, dtype), shaped)

    op.__module__ = libdevice.__name__  # Triton's JIT skips its own stubs when it hashes a kernel
    return op


def ilogb(x: np.ndarray) -> np.ndarray:
    return np.frexp(x)[1] - 1


def stand_in() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    driver.set_active(StandInDriver())
    functions = {"exp2": np.exp2, "nearbyint": np.rint, "floor": np.floor, "copysign": np.copysign, "ilogb": ilogb}
    functions["ldexp"] = lambda x, e: np.ldexp(x, e.astype(np.int32))
    for name, fn in functions.items():
        setattr(libdevice, name, on_numpy(fn, tl.int32 if name == "ilogb" else None))
    libdevice.isinf, libdevice.isnan = on_numpy(np.isinf, tl.int1), on_numpy(np.isnan, tl.int1)
    elements.float_only = scales.float_only = lambda x: False  # the path a CUDA tensor takes
    torch._inductor.config.cpu_backend = "triton"


def check(name: str, axis: int, tile: bool, rounding: str, rule: str) -> dict[str, bool]:
    x = awkward((70, 200), seed=3)
    if rule == "rceil":  # blocks whose rceil scale saturates below 2^128 (scales.e8m0_limit)
        x[:8] = torch.finfo(torch.float32).max * (1 - torch.rand(8, 200, generator=torch.Generator().manual_seed(1)))
    bits = random_bits(x, torch.Generator().manual_seed(7)) if rounding == "stochastic" else None  # int16, as on a GPU
    fmt = FORMATS[name]
    args = (name, axis, fmt.tile if tile else fmt.block, tile, bits, rule, True, True)
    eager = quantize_blocks(x, *args)
    compiled, code = run_and_get_code(torch.compile(quantize_blocks, dynamic=False, fullgraph=True), x, *args)
    factor = (eager[1] is None and compiled[1] is None) or same_bits(eager[1], compiled[1])
    same = {"values": same_bits(eager[0], compiled[0]), "factor": factor, "saturated": bool(eager[2] == compiled[2])}
    return {"triton": "@triton.jit" in "\n".join(code), **same}


if __name__ == "__main__":
    stand_in()
    print(json.dumps({"/".join(map(str, case)): check(*case) for case in CASES}))
