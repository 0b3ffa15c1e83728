"""model=gpt2 and model=llama against forwards written here from the papers' definitions (GPT-2:
Radford et al. 2019 and its released code's tanh GELU and biases; LLaMA: Touvron et al. 2023, RMSNorm
with eps 1e-6, SwiGLU, rotary positions), on weights laid out and named as published checkpoints
are (Hugging Face's names; GPT-2's Conv1D matrices stored (in, out)). Each set is converted to
halfprec's names and loaded strictly, so a checkpoint's every tensor has a place of its shape, and
the logits must match the reference's. Tiny sizes, float64."""

from __future__ import annotations

import math

import torch

from halfprec.components.models import create_model

from helpers import typed_cfg

VOCAB, CONTEXT, LAYERS, HEADS, WIDTH = 32, 8, 2, 2, 16
SWIGLU_WIDTH = 48  # 8/3 x 16, rounded up to a multiple of 16, as the model does


def layer_norm(x, gain, bias, eps):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * gain + bias


def rms_norm(x, gain, eps):
    return x / torch.sqrt((x**2).mean(-1, keepdim=True) + eps) * gain


def gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def gelu_exact(x):
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def silu(x):
    return x * torch.sigmoid(x)


def heads(x):
    batch, time, width = x.shape
    return x.view(batch, time, HEADS, width // HEADS).transpose(1, 2)


def causal_attention(q, k, v):
    """softmax(q k^T / sqrt(d)) v over (batch, heads, time, d), each position seeing itself and the past."""
    time = q.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~torch.ones(time, time, dtype=torch.bool).tril(), float("-inf"))
    y = scores.softmax(-1) @ v
    return y.transpose(1, 2).flatten(2)


def rope(x, base=10000.0):
    """Position p turns the pair (x_i, x_{i+d/2}) by p * base^(-2i/d) (the halves layout of
    Hugging Face's LLaMA checkpoints)."""
    d, time = x.shape[-1], x.shape[-2]
    angle = torch.arange(time, dtype=torch.float64)[:, None] * base ** (-torch.arange(0, d, 2) / d)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * angle.cos() - x2 * angle.sin(), x1 * angle.sin() + x2 * angle.cos()], -1)


def gpt2_logits(w, idx, act=gelu_tanh, eps=1e-5):
    """Conv1D layers: x @ W + b, W stored (in, out). The head is the token embedding."""
    x = w["wte.weight"][idx] + w["wpe.weight"][: idx.shape[1]]
    for i in range(LAYERS):
        p = f"h.{i}."
        h = layer_norm(x, w[p + "ln_1.weight"], w[p + "ln_1.bias"], eps)
        q, k, v = (h @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]).split(WIDTH, -1)
        x = x + causal_attention(heads(q), heads(k), heads(v)) @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
        h = layer_norm(x, w[p + "ln_2.weight"], w[p + "ln_2.bias"], eps)
        h = act(h @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"])
        x = x + h @ w[p + "mlp.c_proj.weight"] + w[p + "mlp.c_proj.bias"]
    return layer_norm(x, w["ln_f.weight"], w["ln_f.bias"], eps) @ w["wte.weight"].T


def llama_logits(w, idx, eps=1e-6):
    """Linear layers: x @ W^T, W stored (out, in). The head tied to the embedding, as model=llama's."""
    x = w["embed_tokens.weight"][idx]
    for i in range(LAYERS):
        p = f"layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q, k, v = (heads(h @ w[p + f"self_attn.{n}_proj.weight"].T) for n in "qkv")
        x = x + causal_attention(rope(q), rope(k), v) @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        h = silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)
        x = x + h @ w[p + "mlp.down_proj.weight"].T
    return rms_norm(x, w["norm.weight"], eps) @ w["embed_tokens.weight"].T


class Draw:
    """Seeded float64 tensors: matrices at 1.5/sqrt(fan_in) (activations of order 1, where the two
    GELUs differ), gains near 1, biases near 0; embeddings as the caller says."""

    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(seed)

    def __call__(self, *shape: int, std: float, mean: float = 0.0) -> torch.Tensor:
        return mean + std * torch.randn(*shape, generator=self.g, dtype=torch.float64)

    def matrix(self, fan_in: int, fan_out: int, stored_in_out: bool) -> torch.Tensor:
        shape = (fan_in, fan_out) if stored_in_out else (fan_out, fan_in)
        return self(*shape, std=1.5 / math.sqrt(fan_in))


def gpt2_checkpoint(draw: Draw) -> dict[str, torch.Tensor]:
    shapes = {"attn.c_attn": (WIDTH, 3 * WIDTH), "attn.c_proj": (WIDTH, WIDTH), "mlp.c_fc": (WIDTH, 4 * WIDTH),
              "mlp.c_proj": (4 * WIDTH, WIDTH)}  # fmt: skip
    w = {"wte.weight": draw(VOCAB, WIDTH, std=0.5), "wpe.weight": draw(CONTEXT, WIDTH, std=0.5)}
    for i in range(LAYERS):
        for name in ("ln_1", "ln_2"):
            w[f"h.{i}.{name}.weight"], w[f"h.{i}.{name}.bias"] = draw(WIDTH, mean=1, std=0.1), draw(WIDTH, std=0.1)
        for name, (fan_in, fan_out) in shapes.items():
            w[f"h.{i}.{name}.weight"] = draw.matrix(fan_in, fan_out, stored_in_out=True)
            w[f"h.{i}.{name}.bias"] = draw(fan_out, std=0.1)
    w["ln_f.weight"], w["ln_f.bias"] = draw(WIDTH, mean=1, std=0.1), draw(WIDTH, std=0.1)
    return w


def gpt2_to_halfprec(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    names = {"ln_1": "norm1", "ln_2": "norm2", "attn.c_attn": "attn.qkv", "attn.c_proj": "attn.proj",
             "mlp.c_fc": "mlp.fc", "mlp.c_proj": "mlp.proj"}  # fmt: skip
    out = {"wte.weight": w["wte.weight"], "wpe.weight": w["wpe.weight"], "lm_head.weight": w["wte.weight"],
           "norm.weight": w["ln_f.weight"], "norm.bias": w["ln_f.bias"]}  # fmt: skip
    for i in range(LAYERS):
        for theirs, ours in names.items():
            conv1d = not theirs.startswith("ln")
            weight = w[f"h.{i}.{theirs}.weight"]
            out[f"blocks.{i}.{ours}.weight"] = weight.T if conv1d else weight
            out[f"blocks.{i}.{ours}.bias"] = w[f"h.{i}.{theirs}.bias"]
    return out


def llama_checkpoint(draw: Draw) -> dict[str, torch.Tensor]:
    # small embeddings: the first norm's inputs small enough that its eps matters
    w = {"embed_tokens.weight": draw(VOCAB, WIDTH, std=0.01), "norm.weight": draw(WIDTH, mean=1, std=0.1)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        for name in ("input_layernorm", "post_attention_layernorm"):
            w[p + f"{name}.weight"] = draw(WIDTH, mean=1, std=0.1)
        for name in "qkvo":
            w[p + f"self_attn.{name}_proj.weight"] = draw.matrix(WIDTH, WIDTH, stored_in_out=False)
        w[p + "mlp.gate_proj.weight"] = draw.matrix(WIDTH, SWIGLU_WIDTH, stored_in_out=False)
        w[p + "mlp.up_proj.weight"] = draw.matrix(WIDTH, SWIGLU_WIDTH, stored_in_out=False)
        w[p + "mlp.down_proj.weight"] = draw.matrix(SWIGLU_WIDTH, WIDTH, stored_in_out=False)
    return w


def llama_to_halfprec(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {"wte.weight": w["embed_tokens.weight"], "lm_head.weight": w["embed_tokens.weight"],
           "norm.weight": w["norm.weight"]}  # fmt: skip
    for i in range(LAYERS):
        theirs, ours = f"layers.{i}.", f"blocks.{i}."
        out[ours + "norm1.weight"] = w[theirs + "input_layernorm.weight"]
        out[ours + "attn.qkv.weight"] = torch.cat([w[theirs + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        out[ours + "attn.proj.weight"] = w[theirs + "self_attn.o_proj.weight"]
        out[ours + "norm2.weight"] = w[theirs + "post_attention_layernorm.weight"]
        out[ours + "mlp.gate.weight"] = w[theirs + "mlp.gate_proj.weight"]
        out[ours + "mlp.fc.weight"] = w[theirs + "mlp.up_proj.weight"]
        out[ours + "mlp.proj.weight"] = w[theirs + "mlp.down_proj.weight"]
    return out


def preset(name: str) -> torch.nn.Module:
    """The preset as a run builds it, at the tiny size, in float64."""
    size = [f"model.n_layer={LAYERS}", f"model.n_head={HEADS}", f"model.n_embd={WIDTH}", f"model.block_size={CONTEXT}"]
    cfg = typed_cfg("task=lm", f"model={name}", *size)
    return create_model(cfg.model, (CONTEXT,), VOCAB).double().eval()


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, CONTEXT), generator=torch.Generator().manual_seed(1))


def test_gpt2_computes_what_gpt2s_definition_does_with_a_gpt2_checkpoints_weights():
    checkpoint = gpt2_checkpoint(Draw(0))
    model = preset("gpt2")
    model.load_state_dict(gpt2_to_halfprec(checkpoint), strict=True)  # every tensor, biases too, has its place
    with torch.no_grad():
        logits = model(tokens())
    expected = gpt2_logits(checkpoint, tokens())
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-12)
    # what the test tells apart: the exact GELU would miss by far more
    assert (gpt2_logits(checkpoint, tokens(), act=gelu_exact) - expected).abs().max() > 1e-4


def test_llama_computes_what_llamas_definition_does_with_a_llama_checkpoints_weights():
    checkpoint = llama_checkpoint(Draw(0))
    model = preset("llama")
    model.load_state_dict(llama_to_halfprec(checkpoint), strict=True)
    with torch.no_grad():
        logits = model(tokens())
    expected = llama_logits(checkpoint, tokens())
    # RoPE rotates in fp32 whatever the model's dtype (gpt.py's Rotary): fp32's precision, not float64's
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)
    fp32_machine_eps = torch.finfo(torch.float32).eps  # torch's RMSNorm default on fp32 inputs
    assert (llama_logits(checkpoint, tokens(), eps=fp32_machine_eps) - expected).abs().max() > 1e-4
