"""precision.recipe.backward_source (numerics/quantized.py): the backward GEMMs' x and W quantized from
the high-precision tensors (high) or re-quantized from the forward's quantized copies (forward), each
against the product written out by hand; what the memory estimate counts for those copies; the CLI."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from halfprec.config import validate
from halfprec.errors import ConfigError
from halfprec.numerics import quantized
from halfprec.numerics.attention import AttentionRecipe, QuantizedAttention
from halfprec.numerics.formats import fake_quantize as fq
from halfprec.numerics.formats import quantize
from halfprec.numerics.formats.hadamard import random_hadamard, rotate
from halfprec.numerics.quantized import QuantizedLinear, Recipe, held_bytes
from halfprec.tools.memory import activation_bytes

from helpers import batch, build_from, compose_cfg

SOURCES = ("high", "forward")


@pytest.fixture(autouse=True)
def fp32_gemms(monkeypatch):
    """The products written out here are fp32 GEMMs; so are the layer's (test_quantized.py's fixture)."""
    monkeypatch.setattr(quantized, "cpu_bf16", lambda: False)


def sq(t: torch.Tensor, name: str, axis: int, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """t's values in `name`, the scale a GEMM applies to its output split off, and that scale (1: none)."""
    q = quantize(t, name, axis, split=True, **kwargs)
    return q.values, torch.ones(()) if q.factor is None else q.factor


def grads(fmt: str, recipe: Recipe, autocast: bool = False):
    """A 32 -> 48 QuantizedLinear (no bias) forward and backward on 24 tokens, x and W with outliers
    along `in`: its x, W, dy (as the layer got it), y, dx and dW."""
    torch.manual_seed(0)
    linear = nn.Linear(32, 48, bias=False)
    linear.weight.data.mul_(torch.logspace(-1, 1, 32))
    layer = QuantizedLinear.from_linear(linear, fmt, recipe, seed=7)
    x = (torch.randn(24, 32) * torch.logspace(-2, 2, 32)).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = layer(x)
    dy = torch.randn_like(y)  # bf16 under autocast
    y.backward(dy)
    return x.detach(), linear.weight.detach(), dy.float(), y.detach(), x.grad, linear.weight.grad


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4", "fp8_e4m3_row"])
@pytest.mark.parametrize("source", SOURCES)
def test_the_backward_quantizes_x_and_w_from_the_tensors_or_from_the_forwards_copies(fmt, source):
    """forward: x (for dW, along the tokens) and W (for dx, along `out`) are fake_quantize applied twice:
    along `in` as the forward took them, then along the backward GEMM's axis; dy as with high, and
    the forward untouched. high: the tensors quantized once, as before the switch."""
    x, w, dy, y, dx, dw = grads(fmt, Recipe(backward_source=source))
    twice = source == "forward"
    x_src, w_src = (fq(x, fmt, -1), fq(w, fmt, -1)) if twice else (x, w)
    (vdy, fdy), (vw, fw) = sq(dy, fmt, -1), sq(w_src, fmt, 0)
    assert torch.equal(dx, (vdy @ vw) * (fdy * fw))
    (vdy0, fdy0), (vx0, fx0) = sq(dy, fmt, 0), sq(x_src, fmt, 0)
    assert torch.equal(dw, (vdy0.T @ vx0) * (fdy0.t() * fx0))
    (vx, fx), (vwf, fwf) = sq(x, fmt, -1), sq(w, fmt, -1)
    assert torch.equal(y, (vx @ vwf.T) * (fx * fwf.t()))
    other = grads(fmt, Recipe(backward_source="forward" if source == "high" else "high"))
    assert torch.equal(other[3], y)  # the same forward
    # double quantization shows: x's and W's small columns lost bits to the large ones' scales along `in`
    assert not torch.equal(other[4], dx) and not torch.equal(other[5], dw)


def test_square_weight_blocks_make_the_forwards_weight_the_backwards():
    """weight_2d: the forward's 16x16-tiled W is dx's operand as it is (tiles blocked along `in` or
    `out` hold the same values), so dx is high's bit for bit; x is re-quantized for dW."""
    w = torch.randn(48, 32)
    assert all(torch.equal(a, b) for a, b in zip(sq(w, "nvfp4", -1, tile=True), sq(w, "nvfp4", 0, tile=True)))
    high = grads("nvfp4", Recipe(weight_2d=True))
    x, w, dy, y, dx, dw = grads("nvfp4", Recipe(weight_2d=True, backward_source="forward"))
    assert torch.equal(dx, high[4]) and torch.equal(y, high[3])
    (vdy0, fdy0), (vx0, fx0) = sq(dy, "nvfp4", 0), sq(fq(x, "nvfp4", -1), "nvfp4", 0)
    assert torch.equal(dw, (vdy0.T @ vx0) * (fdy0.t() * fx0)) and not torch.equal(dw, high[5])
    # with dgrad in another format the tiled copy is not its operand: W is re-quantized from it
    got = grads("nvfp4", Recipe(weight_2d=True, dgrad="mxfp8", backward_source="forward"))
    assert torch.equal(got[4], fq(dy, "mxfp8", -1) @ fq(fq(w, "nvfp4", -1, tile=True), "mxfp8", 0))


def test_the_hadamard_transform_rotates_the_forwards_copy_of_x():
    """NVFP4's recipe (random Hadamard on both dW operands, 16x16 weight blocks): dW from dy and the
    dequantized forward copy of x, both rotated along the tokens, then quantized along them."""
    recipe = Recipe(hadamard=True, weight_2d=True, backward_source="forward")
    x, w, dy, y, dx, dw = grads("nvfp4", recipe)
    h = random_hadamard(16, torch.Generator().manual_seed(7))
    pad = torch.zeros(8, 48), torch.zeros(8, 32)  # 24 tokens padded to 32
    a, b = rotate(torch.cat([dy, pad[0]]), h, 0), rotate(torch.cat([fq(x, "nvfp4", -1), pad[1]]), h, 0)
    (va, fa), (vb, fb) = sq(a, "nvfp4", 0), sq(b, "nvfp4", 0)
    assert torch.equal(dw, (va.T @ vb) * (fa * fb))


def test_fp8_per_tensor_scales_re_quantize_exactly():
    """A per-tensor copy is on the grid the backward's quantizer rounds to (the same largest value,
    so the same scale): forward and high give the same gradients (precision=fp8's recipe, emulated)."""
    recipe = Recipe(grad_format="fp8_e5m2")
    high, forward = (
        grads("fp8_e4m3", recipe),
        grads("fp8_e4m3", Recipe(grad_format="fp8_e5m2", backward_source="forward")),
    )
    assert all(torch.equal(a, b) for a, b in zip(high, forward))


def test_a_high_forward_hands_the_backward_its_bf16_operands():
    """recipe.forward=high under bf16 autocast: the forward's copies are x and W in bf16, so the
    backward quantizes those (high: the fp32 tensors)."""
    x, w, dy, y, dx, dw = grads("mxfp4", Recipe(forward="high", backward_source="forward"), autocast=True)
    assert torch.equal(dx, fq(dy, "mxfp4", -1) @ fq(w.bfloat16().float(), "mxfp4", 0))
    assert torch.equal(dw, fq(dy, "mxfp4", 0).T @ fq(x.bfloat16().float(), "mxfp4", 0))
    high = grads("mxfp4", Recipe(forward="high"), autocast=True)
    assert torch.equal(high[4], fq(dy, "mxfp4", -1) @ fq(w, "mxfp4", 0)) and not torch.equal(high[4], dx)


def test_statistics_stay_the_forwards_and_the_weight_gradient_noise_includes_the_re_quantization():
    """The operands' statistics are where each is first quantized (the forward: the same as high's);
    the exact dW of the gradient-to-noise ratio is dy^T x with x as it came, its noise the quantized
    dW's difference from it, double quantization included."""
    kept = {}
    for source in ("high", "forward"):
        torch.manual_seed(0)
        layer = QuantizedLinear.from_linear(nn.Linear(32, 48), "mxfp4", Recipe(backward_source=source), seed=7)
        layer.stats = {}
        x = torch.randn(24, 32, requires_grad=True)
        layer(x).square().sum().backward()
        kept[source] = layer.stats
    assert set(kept["high"]) == set(kept["forward"])
    for key in (*quantized.OPERANDS, "wgrad_exact"):
        assert torch.equal(kept["high"][key], kept["forward"][key]), key
    assert not torch.equal(kept["high"]["wgrad_noise"], kept["forward"]["wgrad_noise"])


def test_held_bytes_count_elements_and_scales():
    """By hand: 16x64 in nvfp4 is 1024 4-bit elements (512 bytes), 64 E4M3 block scales and an fp32
    tensor scale; in 16x16 tiles, 4 scales; mxfp8 16x64: 1024 bytes and 32 E8M0 scales; fp8 rowwise
    16x64: 1024 bytes and 16 fp32 scales; mxfp6 16x64: 768 bytes and 32 scales."""
    shape = torch.Size([16, 64])
    assert held_bytes("nvfp4", shape, False) == 512 + 64 + 4
    assert held_bytes("nvfp4", shape, True) == 512 + 4 + 4
    assert held_bytes("mxfp8", shape, False) == 1024 + 32
    assert held_bytes("fp8_e4m3_row", shape, False) == 1024 + 16 * 4
    assert held_bytes("mxfp6_e2m3", shape, False) == 768 + 32


@pytest.mark.parametrize(
    "precision, copies",
    [
        # the digits MLP: fc1 (64 -> 256) and fc2 (256 -> 256) quantized, batch 16; x1 16x64, W1 256x64,
        # x2 16x256, W2 256x256, each elements + an E8M0 scale per 32 values
        ("mxfp8", (1024 + 32) + (16384 + 512) + (4096 + 128) + (65536 + 2048)),
        # 4-bit elements, an E4M3 scale per 16 values (weights: per 16x16 tile), an fp32 tensor scale each
        ("nvfp4", (512 + 64 + 4) + (8192 + 64 + 4) + (2048 + 256 + 4) + (32768 + 256 + 4)),
    ],
)
def test_the_estimate_counts_the_forward_copies_in_their_formats_bits(precision, copies):
    """backward_source=forward adds the forward's copies of each quantized layer's x and W, in the
    format's bits. Here nothing is dropped: fc1's x is the batch (not an activation) and fc2's the
    ReLU's output, which the ReLU keeps for its own backward."""
    sizes = {}
    for source in ("high", "forward"):
        c, _ = build_from(f"precision={precision}", f"precision.recipe.backward_source={source}")
        sizes[source] = activation_bytes(c.model, c.stepper.policy, batch(16), c.stepper.task)
    assert sizes["forward"] - sizes["high"] == copies


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["precision.recipe.backward_source=saved"], "precision.recipe.backward_source=saved: must be high or forward"),
        # torchao's float8 layers save x and W in high precision and quantize them again
        (["precision=fp8"], "float8 kernel has no precision.recipe.backward_source=forward: use precision.kernel=emul"),
        (["precision=bf16"], "precision.recipe.backward_source=forward: applies to precision.format.s layers"),
    ],
)
def test_backward_source_config_errors_name_the_key(overrides, message):
    forward = [] if "saved" in overrides[0] else ["precision.recipe.backward_source=forward"]
    with pytest.raises(ConfigError, match=message):
        validate(compose_cfg("precision=nvfp4", *overrides, *forward))


TINY_GPT = ["task=lm", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=32",
            "data.batch_size=4", "trainer.max_steps=2"]  # fmt: skip


@pytest.mark.slow
def test_nvfp4_with_the_forwards_copies_trains_close_to_high(cli):
    """python train.py task=lm precision=nvfp4 precision.recipe.backward_source=forward: two steps whose
    second loss differs from high's (the first is before any update) but stays close."""
    runs = {
        s: cli.submit(*TINY_GPT, "precision=nvfp4", f"precision.recipe.backward_source={s}")
        for s in ("high", "forward")
    }
    losses = {
        s: [r["train/loss"] for r in run.result().check().metrics() if "train/loss" in r] for s, run in runs.items()
    }
    assert len(losses["forward"]) == 2 and losses["forward"][0] == losses["high"][0]
    assert losses["forward"][1] != losses["high"][1]
    assert abs(losses["forward"][1] - losses["high"][1]) < 0.01 * losses["high"][1]


# attention's GEMMs (precision.attention): Q, K and V as the forward's copies; P from its fp32 values


def attention_grads(fmt: str, source: str, **attention):
    """A QuantizedAttention (batch 2, 2 heads, 40 tokens, d 32, q with an outlier channel) forward and
    backward: q, k, v, the output gradient, the output and the gradients of q, k, v."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 40, 32, generator=gen) for _ in range(3))
    q[..., 3] *= 30
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    recipe = AttentionRecipe(format=fmt, **attention)
    out = QuantizedAttention(fmt, recipe, Recipe(backward_source=source), seed=5)(q, k, v)
    dout = torch.randn(out.shape, generator=gen)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return q.detach(), k.detach(), v.detach(), dout, out.detach(), (dq, dk, dv)


def causal_probs(q: torch.Tensor, k: torch.Tensor, fmt: str) -> torch.Tensor:
    """P = softmax(s QK^T) under the causal mask, QK^T of Q and K quantized along d as the forward's."""
    s = fq(q, fmt, -1) @ fq(k, fmt, -1).transpose(-2, -1) / math.sqrt(q.shape[-1])
    causal = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
    return torch.softmax(s.masked_fill(~causal, float("-inf")), -1)


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("source", SOURCES)
def test_attentions_backward_quantizes_q_k_v_from_the_tensors_or_from_the_forwards_copies(fmt, source):
    """forward: Q and K (for dK and dQ, along the tokens) and V (for dP, along d) are fake_quantize
    applied twice, first along the axis the forward's GEMM took them (Q, K along d; V along the keys);
    P is quantized from its fp32 values with either, dO and dS as with high; the forward untouched."""
    q, k, v, dout, out, (dq, dk, dv) = attention_grads(fmt, source)
    p = causal_probs(q, k, fmt)
    if source == "forward":
        q, k, v = fq(q, fmt, -1), fq(k, fmt, -1), fq(v, fmt, -2)
    dp = fq(dout, fmt, -1) @ fq(v, fmt, -1).transpose(-2, -1)
    ds = p * (dp - (dout * out).sum(-1, keepdim=True)) / math.sqrt(q.shape[-1])
    close = {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(dv, fq(p, fmt, -2).transpose(-2, -1) @ fq(dout, fmt, -2), **close)
    torch.testing.assert_close(dq, fq(ds, fmt, -1) @ fq(k, fmt, -2), **close)
    torch.testing.assert_close(dk, fq(ds, fmt, -2).transpose(-2, -1) @ fq(q, fmt, -2), **close)
    other = attention_grads(fmt, "forward" if source == "high" else "high")
    assert torch.equal(other[4], out)  # the same forward
    # double quantization shows: Q's small channels lost bits to the outlier's scale along d
    assert not torch.allclose(other[5][1], dk, **close)


def test_attentions_copies_of_q_and_k_are_rotated_back_where_the_hadamard_turned_them():
    """With the Hadamard, the forward quantized QH and KH along d: the backward, which takes Q and K
    unrotated, re-quantizes q(QH) H^T and q(KH) H^T along the tokens."""
    q, k, v, dout, out, (dq, dk, dv) = attention_grads("mxfp4", "forward", hadamard=True)
    h = random_hadamard(32, torch.Generator().manual_seed(5))
    qc, kc = (rotate(fq(rotate(t, h, -1), "mxfp4", -1), h.T, -1) for t in (q, k))
    p = causal_probs(rotate(q, h, -1), rotate(k, h, -1), "mxfp4")
    dp = fq(dout, "mxfp4", -1) @ fq(fq(v, "mxfp4", -2), "mxfp4", -1).transpose(-2, -1)
    ds = p * (dp - (dout * out).sum(-1, keepdim=True)) / math.sqrt(q.shape[-1])
    torch.testing.assert_close(dk, fq(ds, "mxfp4", -2).transpose(-2, -1) @ fq(qc, "mxfp4", -2), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dq, fq(ds, "mxfp4", -1) @ fq(kc, "mxfp4", -2), rtol=1e-4, atol=1e-5)


def test_attentions_fp8_per_tensor_copies_re_quantize_exactly():
    """A per-tensor copy is on the grid the backward's quantizer rounds to: forward and high agree."""
    high, forward = attention_grads("fp8_e4m3", "high"), attention_grads("fp8_e4m3", "forward")
    assert all(torch.equal(a, b) for a, b in zip(high[5], forward[5]))


ATTENTION_GPT = ["task=lm", "model.n_layer=1", "model.n_embd=64", "model.n_head=2", "model.block_size=32",
                 "precision=bf16"]  # fmt: skip
B, H, T, D = 2, 2, 32, 32  # batch, heads, tokens, head size of a batch of 2 through ATTENTION_GPT


@pytest.mark.parametrize(
    "fmt, copy",
    [
        # Q, K blocked along d and V along the keys: 4 x 32 x 32 one-byte elements, an E8M0 scale per 32
        ("mxfp8", B * H * T * D + B * H * T),
        # half-byte elements, an E4M3 scale per 16 values and an fp32 tensor scale
        ("nvfp4", B * H * T * D // 2 + B * H * T * D // 16 + 4),
    ],
)
def test_the_estimate_counts_quantized_attentions_probabilities_and_copies(fmt, copy):
    """Against torch's fused attention, which keeps Q, K, V (views of the qkv layer's bf16 output),
    its bf16 output and a logsumexp per query (fp32): the explicit attention keeps P (fp32, T x T per
    head) instead of the logsumexp; backward_source=forward, the three copies in the format's bits
    instead of the qkv output (B x T x 3 x 64 bf16), which nothing else keeps."""
    tokens = torch.randint(0, 10, (B, T), generator=torch.Generator().manual_seed(0))
    sizes, quantized = {}, f"precision.attention.format={fmt}"
    for name, extra in [("fused", []), ("high", [quantized]),
                        ("forward", [quantized, "precision.recipe.backward_source=forward"])]:  # fmt: skip
        c, _ = build_from(*ATTENTION_GPT, *extra)
        sizes[name] = activation_bytes(c.model, c.stepper.policy, (tokens, tokens), c.stepper.task)
    probs, logsumexp = B * H * T * T * 4, B * H * T * 4
    assert sizes["high"] - sizes["fused"] == probs - logsumexp
    assert sizes["forward"] - sizes["high"] == 3 * copy - B * T * 3 * 64 * 2
