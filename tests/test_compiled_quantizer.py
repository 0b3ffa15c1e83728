"""The quantizer through torch.compile (precision.quantizer=compiled, the default on a GPU): the same
values as the eager quantizer, bit for bit, stochastic draws included, in one fused kernel whatever
the tensor's size. On a CPU inductor writes C++; tests/test_gpu.py holds the same on a GPU (Triton),
and tests/triton_interpreter.py runs those Triton kernels on a CPU, in Triton's interpreter."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from halfprec.numerics.converters.emulated import quantizer_for
from halfprec.numerics.formats import FORMATS, compiled_quantizer, quantize
from halfprec.numerics.quantized import QuantizedLinear, Recipe
from halfprec.training.build import build

from helpers import compose_cfg, same_bits


def awkward(shape: tuple[int, int], seed: int = 0) -> torch.Tensor:
    """Values over twelve decades, a zero block's worth of zeros, an inf and a NaN: every branch of
    the quantizer (E8M0 extremes, NVFP4's scale underflow, non-finite blocks), on an odd shape that
    pads along either axis."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-6, 6, shape[1])
    x[:, :32] = 0.0
    x[1, 40], x[-1, -1] = float("inf"), float("nan")
    return x


def check_both_ways(x: torch.Tensor, name: str, axis: int, tile: bool, rounding: str, rule: str = "floor") -> None:
    """The compiled and the eager quantizer on `x`, from generators in the same state, as a layer calls
    them (the scale its GEMM applies to the output split off)."""
    eager, compiled = (
        quantize(x, name, axis, rounding, torch.Generator().manual_seed(7), tile, rule, True, c, split=True)
        for c in (False, True)
    )
    assert same_bits(compiled.values, eager.values), (name, axis, tile, rounding)
    assert (compiled.factor is None and eager.factor is None) or same_bits(compiled.factor, eager.factor)
    assert torch.equal(compiled.saturated, eager.saturated), (name, axis, tile, rounding)


@pytest.mark.parametrize(
    "name, axis, tile, rounding", [("mxfp4", 0, False, "stochastic"), ("nvfp4", -1, True, "stochastic")]
)
def test_the_compiled_quantizer_gives_the_eager_values_bit_for_bit(name, axis, tile, rounding):
    check_both_ways(awkward((70, 200)), name, axis, tile, rounding)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FORMATS))
def test_every_format_compiled_gives_the_eager_values_bit_for_bit(name):
    for tile in [False, True] if FORMATS[name].tile else [False]:
        for axis in (-1, 0):
            for rounding in ("nearest", "stochastic"):
                check_both_ways(awkward((70, 200), seed=axis + 2), name, axis, tile, rounding)


@pytest.mark.slow
@pytest.mark.parametrize("name, rounding", [("mxfp8", "nearest"), ("mxfp4", "stochastic")])
def test_rceils_saturation_near_fp32s_largest_value_compiles_to_the_same_values(name, rounding):
    """rceil's blocks near fp32's largest value saturate below 2^128 (scales.e8m0_limit) the same way
    compiled, with the awkward tensor's every other branch."""
    x = awkward((70, 200), seed=4)
    x[:8] = torch.finfo(torch.float32).max * (1 - torch.rand(8, 200, generator=torch.Generator().manual_seed(1)) ** 8)
    assert not quantize(x, name, 0, scale_rule="rceil").values[:8].isinf().any()
    check_both_ways(x, name, 0, False, rounding, "rceil")


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (its interpreter)")
def test_the_gpus_triton_kernels_run_by_tritons_interpreter_give_the_eager_values():
    """tests/triton_interpreter.py: inductor's Triton kernels for the quantizer's GPU path, each
    format's in one graph, run on a CPU by Triton's interpreter: the eager values bit for bit."""
    script = Path(__file__).parent / "triton_interpreter.py"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, result.stderr[-3000:]
    cases = json.loads(result.stdout.splitlines()[-1])
    assert cases and all(all(same.values()) for same in cases.values()), cases


def kernels(shape: tuple[int, int], name: str, tile: bool) -> int:
    """How many kernels inductor wrote for one quantize of a tensor of `shape` (shapes are static:
    each size compiles anew)."""
    x = torch.randn(shape)
    args = (name, -1, FORMATS[name].block, tile, None, "floor", False, False)
    _, code = run_and_get_code(compiled_quantizer(), x, *args)
    return "\n".join(code).count('extern "C"')


@pytest.mark.parametrize("name, tile", [("mxfp8", False), ("nvfp4", True)])
def test_the_compiled_quantizer_is_one_or_two_kernels_whatever_the_size(name, tile):
    """The eager quantizer is ~85 ops (tests/test_cuda_path.py), each a launch on a GPU; compiled, the
    block amax, scale, rounding and write fuse (NVFP4's tensor-wide amax can take a second kernel)."""
    small, large = kernels((64, 256), name, tile), kernels((2048, 1024), name, tile)
    assert 1 <= small == large <= 2, (small, large)


@pytest.mark.parametrize("name, rounding", [("mxfp8", "nearest"), ("nvfp4", "stochastic")])
def test_the_compiled_cpu_quantizer_is_vectorized_throughout(name, rounding):
    """inductor's C++ leaves a float/int bit view and int16 arithmetic scalar, and the loop around
    them (a quantize 4-8x slower): compiled for a CPU, the quantizer rounds in float arithmetic alone
    (elements.float_only) and takes its random bits as int32."""
    x, gen = torch.randn(96, 160), torch.Generator().manual_seed(0)  # a shape no other test compiles
    _, code = run_and_get_code(lambda: quantize(x, name, 0, rounding, gen, compiled=True, split=True))
    text = "\n".join(code)
    assert 'extern "C"' in text and "bit_cast" not in text and "int16_t" not in text


def test_a_quantized_layer_with_compiled_quantizers_computes_what_the_eager_one_does():
    """NVFP4 with its whole recipe (stochastic gradients, the Hadamard transform, square weight
    blocks): forward, input and weight gradients equal bit for bit, and the next backward pass's
    stochastic draws too (the generator's count of passes is the same)."""
    torch.manual_seed(0)
    recipe = Recipe(stochastic_grads=True, hadamard=True, weight_2d=True)
    layers = [QuantizedLinear(64, 48, True, "nvfp4", recipe, seed=3, compiled=c) for c in (False, True)]
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(40, 64)
    results = []
    for layer in layers:
        for _ in range(2):
            xi = x.clone().requires_grad_()
            y = layer(xi)
            y.backward(torch.randn_like(y, generator=torch.Generator().manual_seed(1)))
            results.append((y.detach(), xi.grad, layer.weight.grad.clone(), layer.bias.grad.clone()))
            layer.weight.grad = layer.bias.grad = None
    for eager, compiled in zip(results[:2], results[2:]):
        assert all(same_bits(e, c) for e, c in zip(eager, compiled))
    assert not same_bits(results[0][1], results[1][1])  # the second pass drew other bits


def test_precision_quantizer_auto_compiles_on_a_gpu_or_for_a_long_run_and_reaches_every_layer():
    assert (quantizer_for("auto", "cuda"), quantizer_for("auto", "cpu")) == ("compiled", "eager")
    assert (quantizer_for("auto", "cpu", 999), quantizer_for("auto", "cpu", 1000)) == ("eager", "compiled")
    assert quantizer_for("compiled", "cpu") == "compiled"
    cfg = compose_cfg(
        "task=lm", "precision=mxfp8", "precision.quantizer=compiled", "precision.rules=[{match: '*.fc', format: mxfp4}]"
    )
    layers = [m for m in build(cfg).model.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(m.compiled for m in layers) and {m.format for m in layers} == {"mxfp8", "mxfp4"}
    eager = build(compose_cfg("task=lm", "precision=mxfp8")).model
    assert not any(m.compiled for m in eager.modules() if isinstance(m, QuantizedLinear))
