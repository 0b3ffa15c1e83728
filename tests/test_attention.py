"""Attention's GEMMs in a number format (numerics/attention.py): the explicit attention against torch's
fused one, each quantized GEMM against the product written out by hand with fake_quantize, the
gradients against finite differences, the Hadamard transform of Q and K."""

from __future__ import annotations

import math

import pytest
import torch

from halfprec.numerics import quantized
from halfprec.numerics.attention import AttentionRecipe, QuantizedAttention, ScaledDotProduct
from halfprec.numerics.formats import fake_quantize as fq
from halfprec.numerics.quantized import Recipe

HIGH_GEMMS = AttentionRecipe(format="mxfp8", forward="high", backward="high")


@pytest.fixture(autouse=True)
def fp32_gemms(monkeypatch):
    """The references here are fp32 or fp64 products; so are the core's (test_quantized.py's fixture)."""
    monkeypatch.setattr(quantized, "cpu_bf16", lambda: False)


def qkv(shape=(2, 3, 40, 32), dtype=torch.float32, seed=0, outlier=1.0):
    """Queries, keys and values (batch, heads, tokens, d) that need gradients; `outlier`: a channel
    of q that many times the others."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(shape, generator=gen, dtype=dtype) for _ in range(3))
    q[..., 3] *= outlier
    return [t.requires_grad_() for t in (q, k, v)]


def attend(core: torch.nn.Module, q, k, v, seed=1):
    """The core's output and the gradients of q, k, v for a random output gradient."""
    out = core(q, k, v)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return out.detach(), grads, dout


def core(fmt="mxfp8", **kwargs) -> QuantizedAttention:
    return QuantizedAttention(fmt, AttentionRecipe(format=fmt, **kwargs), Recipe(), seed=5)


def test_the_explicit_attention_in_high_precision_equals_torchs_fused_one():
    q, k, v = qkv()
    out, grads, _ = attend(QuantizedAttention("mxfp8", HIGH_GEMMS, Recipe(), 0), q, k, v)
    want, want_grads, _ = attend(ScaledDotProduct(), q, k, v)
    torch.testing.assert_close(out, want)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected)


def reference(q, k, v, dout, fmt):
    """Each GEMM written out: its operands quantized by hand along the dimension it contracts
    (fake_quantize, the outer scales included), multiplied in fp64; softmax and scaling explicit."""
    q, k, v = (t.detach() for t in (q, k, v))
    scale = 1 / math.sqrt(q.shape[-1])
    s = fq(q, fmt, -1).double() @ fq(k, fmt, -1).double().transpose(-2, -1)
    causal = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
    p = torch.softmax((s.float() * scale).masked_fill(~causal, float("-inf")), -1)
    o = fq(p, fmt, -1).double() @ fq(v, fmt, -2).double()
    dv = fq(p, fmt, -2).double().transpose(-2, -1) @ fq(dout, fmt, -2).double()
    dp = fq(dout, fmt, -1).double() @ fq(v, fmt, -1).double().transpose(-2, -1)
    ds = p * (dp.float() - (dout * o.float()).sum(-1, keepdim=True)) * scale
    dq = fq(ds, fmt, -1).double() @ fq(k, fmt, -2).double()
    dk = fq(ds, fmt, -2).double().transpose(-2, -1) @ fq(q, fmt, -2).double()
    return o.float(), (dq.float(), dk.float(), dv.float())


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4", "fp8_e4m3_row", "fp8_block"])
def test_each_quantized_gemm_equals_its_operands_quantized_by_hand(fmt):
    q, k, v = qkv()
    out, grads, dout = attend(core(fmt), q, k, v)
    want, want_grads = reference(q, k, v, dout, fmt)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_blocking_p_and_v_along_another_axis_would_give_other_values():
    """The reference can fail: P and V blocked along the queries and d instead of the keys."""
    q, k, v = (t.detach() for t in qkv())
    out = core("mxfp4")(q, k, v)
    s = fq(q, "mxfp4", -1) @ fq(k, "mxfp4", -1).transpose(-2, -1) / math.sqrt(q.shape[-1])
    p = torch.softmax(s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf")), -1)
    torch.testing.assert_close(out, fq(p, "mxfp4", -1) @ fq(v, "mxfp4", -2), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, fq(p, "mxfp4", -2) @ fq(v, "mxfp4", -1), atol=1e-3)


def test_the_gradients_are_the_derivatives_of_the_forward_in_fp64():
    """Finite differences check the hand-written backward (softmax's, the scaling, the transposes)
    where it is differentiable: with the GEMMs high (a format's rounding is piecewise constant, and
    its backward passes gradients straight through it, as the hardware's does)."""
    q, k, v = qkv(shape=(1, 2, 6, 4), dtype=torch.float64)
    attention = QuantizedAttention("mxfp8", HIGH_GEMMS, Recipe(), 0)
    assert torch.autograd.gradcheck(lambda q, k, v: attention(q, k, v), (q, k, v))


def test_a_forward_or_backward_alone_quantized():
    """forward=high keeps S and O exact; backward=high keeps the four gradient GEMMs exact."""
    q, k, v = qkv()
    want, want_grads, _ = attend(ScaledDotProduct(), q, k, v)
    out, grads, _ = attend(core(forward="high"), q, k, v)
    torch.testing.assert_close(out, want)
    assert not torch.allclose(grads[0], want_grads[0], rtol=1e-3)
    out, grads, dout = attend(core(backward="high"), q, k, v)
    assert not torch.allclose(out, want, rtol=1e-3)


def test_the_hadamard_leaves_qk_unchanged_and_changes_the_quantized_attention():
    q, k, v = qkv(outlier=20.0)
    rotating = core(hadamard=True)
    qr, kr = rotating.rotated(q.detach(), k.detach())
    assert not torch.allclose(qr, q)
    torch.testing.assert_close(qr @ kr.transpose(-2, -1), q @ k.transpose(-2, -1), rtol=1e-5, atol=1e-4)
    plain, _, _ = attend(core(), q, k, v)
    rotated, _, _ = attend(rotating, q, k, v)
    assert not torch.equal(plain, rotated)
    # spread over the head, the outlier channel costs the other values of its blocks less: the
    # logits' quantization error is smaller
    q, k = q.detach(), k.detach()
    exact = q @ k.transpose(-2, -1)
    error = (fq(q, "mxfp8", -1) @ fq(k, "mxfp8", -1).transpose(-2, -1) - exact).norm()
    assert (fq(qr, "mxfp8", -1) @ fq(kr, "mxfp8", -1).transpose(-2, -1) - exact).norm() < error


def test_the_output_comes_in_the_autocast_dtype_and_gradients_in_the_inputs():
    q, k, v = qkv(shape=(1, 2, 8, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = core()(q, k, v)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert q.grad is not None and q.grad.dtype == torch.float32
