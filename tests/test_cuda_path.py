"""The CUDA path without a GPU: CUDA tensors under FakeTensorMode (as torch.compile and FSDP2 trace
them) go through the quantizers and the quantized layer, and a TorchDispatchMode counts the ops a
GPU would launch. Their number must not grow with the tensor: on a GPU each op is a launch."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from halfprec.numerics import formats
from halfprec.numerics.formats import FORMATS, fake_quantize
from halfprec.numerics.quantized import QuantizedLinear, Recipe


class Ops(TorchDispatchMode):
    """Every op dispatched inside, with its tensor arguments' dtypes."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, list[torch.dtype]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append((str(func), [a.dtype for a in args if isinstance(a, torch.Tensor)]))
        return func(*args, **(kwargs or {}))


def quantize_ops(shape: tuple[int, int], name: str, rounding: str, tile: bool) -> int:
    with FakeTensorMode(), Ops() as ops:
        fake_quantize(torch.empty(shape, device="cuda"), name, rounding=rounding, tile=tile)
    return len(ops.seen)


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_quantize_on_a_gpu_launches_as_many_ops_whatever_the_tensors_size(name):
    """On main before this test, an 8192x3072 MXFP8 quantize dispatched 13,490 ops (a CPU's chunks
    of 2^16 values), 470 at 1024x768; whole tensors make it 85 at either size."""
    tiles = [False, True] if FORMATS[name].tile else [False]
    for rounding in ("nearest", "stochastic"):
        for tile in tiles:
            small, large = (
                quantize_ops((256, 512), name, rounding, tile),
                quantize_ops((8192, 3072), name, rounding, tile),
            )
            assert small == large <= 140, (rounding, tile, small, large)


def layer_ops(tokens: int, fmt: str = "nvfp4", recipe: Recipe | None = None) -> list[tuple[str, list[torch.dtype]]]:
    """A GPT-2-small MLP layer (768 -> 3072) in `fmt`, by default NVFP4 with its recipe's Hadamard
    transform and square weight blocks: forward, then the backward node called directly (the
    autograd engine wants a real device). Stochastic rounding is left out: its generator is a real
    CUDA object."""
    recipe = Recipe(hadamard=True, weight_2d=True) if recipe is None else recipe
    with FakeTensorMode():
        layer = QuantizedLinear(768, 3072, True, fmt, recipe, 1, device="cuda")
        x = torch.empty(tokens, 768, device="cuda", requires_grad=True)
        with Ops() as ops:
            y = layer(x)
            with torch.no_grad():
                y.grad_fn.apply(torch.empty_like(y))
    return ops.seen


def test_a_quantized_layers_forward_and_backward_launch_as_many_ops_at_any_batch():
    """36,461 ops at 8192 tokens on main before this test; now a few hundred, at any number of tokens."""
    small, large = layer_ops(256), layer_ops(8192)
    assert len(small) == len(large) < 800
    gemms = [op for op, _ in large if op in ("aten.mm.dtype", "aten.bmm.default")]
    assert gemms.count("aten.mm.dtype") == 3  # forward, dx, dW: bf16 operands, fp32 output
    assert gemms.count("aten.bmm.default") == 2  # the Hadamard rotation of dW's two operands, 16 tokens at a time


@pytest.mark.parametrize("name", ["mxfp8", "mxfp4", "nvfp4", "fp8_block", "fp8_e4m3_row"])
def test_the_cpus_chunks_give_the_values_of_the_whole_tensor_bit_for_bit(name, monkeypatch):
    """The CPU quantizes 2^16 values at a time (its cache), a GPU the whole tensor: the same values."""
    x = torch.randn(300, 1000, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 1000)
    assert len(formats.chunks(x.reshape(-1, 32, 1))) > 1  # 300,000 values: several chunks
    chunked = fake_quantize(x, name)
    monkeypatch.setattr(formats, "chunks", lambda blocks, values=formats.CHUNK: [slice(None)])
    assert torch.equal(fake_quantize(x, name), chunked)


def layer_gemms(fmt: str, prefix: str = "aten.mm") -> list[tuple[str, list[torch.dtype]]]:
    """The GEMMs of a 768 -> 3072 layer in `fmt` (its plain recipe) at 512 tokens, forward and backward."""
    return [(op, dtypes) for op, dtypes in layer_ops(512, fmt, Recipe()) if op.startswith(prefix)]


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "mxint8", "nvfp4", "fp8_e4m3", "fp8_e5m2_row"])
def test_a_layers_three_gemms_take_bf16_operands_on_a_gpu(fmt):
    """bf16 holds every GEMM operand value, the per-tensor and per-row scales split off
    (tests/test_formats.py): on a GPU the forward, dx and dW GEMMs run on bf16 operands with an fp32
    output (tensor cores), where fp32 operands took none."""
    assert layer_gemms(fmt) == [("aten.mm.dtype", [torch.bfloat16, torch.bfloat16])] * 3


def test_1x128_blocks_multiply_in_one_batched_gemm_of_bf16_operands():
    """fp8_block's fp32 scales per 128 values of the contraction are applied per chunk: one batched
    GEMM of 128-long chunks (6 for the 768 inputs, 24 for the 3072 outputs, 4 for 512 tokens)."""
    gemms = [(op, dtypes) for op, dtypes in layer_gemms("fp8_block", "aten.") if "mm" in op]
    assert gemms == [("aten.bmm.dtype", [torch.bfloat16, torch.bfloat16])] * 3
