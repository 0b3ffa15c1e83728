"""A small GPT: token embeddings and positions (learned embeddings, GPT-2, or rotary ones, LLaMA),
pre-norm blocks of causal self-attention (torch's scaled_dot_product_attention, in a core module
that precision.attention may swap for a quantized one) and an MLP, a final norm, and an output
head, tied to the token embedding or not. One code for model=gpt, gpt2 and llama (conf/model/).
Written for reading: each module is a few lines."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from halfprec.components.models import register_model
from halfprec.errors import ConfigError
from halfprec.numerics.attention import ScaledDotProduct
from halfprec.spec import Spec


def create_norm(kind: str, width: int, eps: float | None, bias: bool) -> nn.Module:
    """layernorm (with a bias as GPT-2's, or without as recent GPTs') or rmsnorm (no bias). eps None:
    torch's defaults, LayerNorm's 1e-5 and RMSNorm's machine epsilon of the input's dtype."""
    if kind == "layernorm":
        return nn.LayerNorm(width, eps=1e-5 if eps is None else eps, bias=bias)
    return nn.RMSNorm(width, eps=eps)


class Rotary(nn.Module):
    """Rotary position embeddings (RoPE, Su et al. 2021): a head's values are pairs (x_i, x_i+d/2),
    and the pair i of the token at position p is rotated by the angle p * base^(-2i/d). A rotation
    by angle a for the query and b for the key leaves q.k a function of a - b: attention sees the
    positions' difference alone. The pairs are the halves of the head (GPT-NeoX's and Hugging
    Face's LLaMA layout; Meta's code pairs neighbours, an equivalent permutation of the weights)."""

    cos: torch.Tensor  # (block_size, head/2): buffers, typed for the type checker
    sin: torch.Tensor

    def __init__(self, head: int, block_size: int, base: float):
        super().__init__()
        # in float64 then fp32: an angle p * freq is exact to fp32's precision at every position
        freqs = base ** (-torch.arange(0, head, 2, dtype=torch.float64) / head)  # (head/2,)
        angles = torch.outer(torch.arange(block_size, dtype=torch.float64), freqs)  # (block_size, head/2)
        # computed once per model for its whole context; not in the state dict (derived, not learned),
        # so a checkpoint holds the same keys as one without them
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (batch, heads, time, head), rotated in fp32 (one rounding, at the end) and returned in
        x's dtype, so the attention computes in the dtype the mode gave q and k."""
        time = x.shape[-2]
        cos, sin = self.cos[:time].float(), self.sin[:time].float()
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


@dataclass(frozen=True)
class Layout:
    """What every block shares: its norm (kind, eps), its MLP's kind, and biases or none."""

    norm: str
    norm_eps: float | None
    mlp: str
    bias: bool

    def create_norm(self, width: int) -> nn.Module:
        return create_norm(self.norm, width, self.norm_eps, self.bias)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, qk_norm: bool, layout: Layout,
                 rope: Rotary | None = None):  # fmt: skip
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=layout.bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=layout.bias)  # into the residual stream
        head = n_embd // n_head
        # qk-norm (Dehghani et al. 2023): bounded attention logits, whatever the weights grow to
        self.q_norm = layout.create_norm(head) if qk_norm else nn.Identity()
        self.k_norm = layout.create_norm(head) if qk_norm else nn.Identity()
        self.rope = rope  # the model's one Rotary, shared by every block (its buffers are no parameters)
        # torch's fused attention, a module of its own: rules name it (blocks.N.attn.core) and
        # precision.attention swaps it for one whose GEMMs compute in a format
        self.core = ScaledDotProduct(dropout)
        self.resid_drop = nn.Dropout(dropout)
        # diagnostics=grads turns this on for its steps: the largest attention logit is then kept
        self.record_logits = False
        self.logit_max: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = (t.view(batch, time, self.n_head, -1).transpose(1, 2) for t in self.qkv(x).split(width, dim=2))
        q, k = self.q_norm(q), self.k_norm(k)
        # RoPE after qk-norm: the norm's per-value gains, applied to rotated pairs, would scale a
        # pair's two values unequally and q.k would no longer depend on the relative position alone
        if self.rope is not None:
            q, k = self.rope(q), self.rope(k)
        if self.record_logits:
            self.keep_logit_max(q, k)
        y = self.core(q, k, v)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(batch, time, width)))

    @torch.no_grad()
    def keep_logit_max(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """The largest of the logits q.k/sqrt(d) that the causal mask keeps (the fused attention
        never shows them); over the step's micro-batches."""
        time = q.shape[-2]
        logits = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.shape[-1])
        causal = torch.ones(time, time, dtype=torch.bool, device=q.device).tril()
        top = logits.masked_fill(~causal, float("-inf")).amax()
        self.logit_max = top if self.logit_max is None else torch.maximum(self.logit_max, top)


class MLP(nn.Module):
    """GELU, exact (gelu) or as GPT-2 computes it, with tanh (gelu_tanh), or SwiGLU (LLaMA);
    SwiGLU's hidden width is 8/3 of the model's, rounded up to a multiple of 16 so that float8
    matmuls can take it."""

    def __init__(self, n_embd: int, layout: Layout, dropout: float):
        super().__init__()
        swiglu = layout.mlp == "swiglu"
        hidden = 16 * math.ceil(8 * n_embd / 3 / 16) if swiglu else 4 * n_embd
        self.fc = nn.Linear(n_embd, hidden, bias=layout.bias)
        self.gate = nn.Linear(n_embd, hidden, bias=layout.bias) if swiglu else None
        self.proj = nn.Linear(hidden, n_embd, bias=layout.bias)  # into the residual stream
        self.drop = nn.Dropout(dropout)
        self.approximate = "tanh" if layout.mlp == "gelu_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is None:
            h = F.gelu(self.fc(x), approximate=self.approximate)
        else:
            h = F.silu(self.gate(x)) * self.fc(x)
        return self.drop(self.proj(h))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, qk_norm: bool, layout: Layout, rope: Rotary | None):
        super().__init__()
        self.norm1 = layout.create_norm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, qk_norm, layout, rope)
        self.norm2 = layout.create_norm(n_embd)
        self.mlp = MLP(n_embd, layout, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    keep_high = ("lm_head",)  # quantized formats leave the output head high, tied to the embedding or not

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, dropout: float,
                 qk_norm: bool, layout: Layout, pos: str = "learned", rope_base: float = 10000.0,
                 tie_embeddings: bool = True):  # fmt: skip
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        # learned: a vector per position added to the input (GPT-2); rope: positions rotate q and k
        self.wpe = nn.Embedding(block_size, n_embd) if pos == "learned" else None
        self.rope = Rotary(n_embd // n_head, block_size, rope_base) if pos == "rope" else None  # one per model
        self.drop = nn.Dropout(dropout)
        blocks = (Block(n_embd, n_head, dropout, qk_norm, layout, self.rope) for _ in range(n_layer))
        self.blocks = nn.ModuleList(blocks)
        self.norm = layout.create_norm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)  # no bias, as GPT-2's
        if tie_embeddings:
            self.lm_head.weight = self.wte.weight  # one matrix embeds and reads out tokens

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))

    def residual_projections(self) -> list[nn.Linear]:
        """The layers that write into the residual stream: scaled (GPT-2) or zeroed at init."""
        blocks = cast(list[Block], list(self.blocks))  # a ModuleList holds Modules, to a type checker
        return [layer for block in blocks for layer in (block.attn.proj, block.mlp.proj)]


@register_model("gpt", reads="tokens")
def create_gpt(
    input_shape: tuple[int, ...],
    num_classes: int,
    n_layer: Annotated[int, Spec(low=1, doc="transformer blocks")] = 4,
    n_head: Annotated[int, Spec(low=1, doc="attention heads; model.n_embd must be a multiple")] = 4,
    n_embd: Annotated[int, Spec(low=1, doc="the width of the residual stream")] = 128,
    block_size: Annotated[int, Spec(low=1, doc="the context in tokens; data.block_size follows it")] = 128,
    dropout: Annotated[float, Spec(low=0, below=1)] = 0.0,
    qk_norm: Annotated[bool, Spec(doc="normalise queries and keys per head")] = False,
    norm: Literal["layernorm", "rmsnorm"] = "layernorm",
    norm_eps: Annotated[
        float | None, Spec(above=0, doc="the norms' epsilon; null: torch's (LayerNorm 1e-5, RMSNorm the dtype's eps)")
    ] = None,
    mlp: Annotated[
        Literal["gelu", "gelu_tanh", "swiglu"], Spec(doc="GELU exact or tanh-approximated (GPT-2's), or SwiGLU")
    ] = "gelu",
    bias: Annotated[bool, Spec(doc="biases in the Linear layers (not the head) and LayerNorms, as GPT-2's")] = False,
    proj_init: Annotated[
        Literal["gpt2", "zero", "plain"],
        Spec(doc="residual projections at init: std 0.02/sqrt(2 n_layer) (GPT-2), zero, or 0.02 as the rest"),
    ] = "gpt2",
    pos: Annotated[
        Literal["learned", "rope"],
        Spec(doc="positions: a learned embedding added to the input (GPT-2) or rotary q and k (LLaMA)"),
    ] = "learned",
    rope_base: Annotated[float, Spec(above=1, doc="pos=rope: the base of the rotation frequencies")] = 10000.0,
    tie_embeddings: Annotated[bool, Spec(doc="the output head is the token embedding's matrix")] = True,
) -> nn.Module:
    """`num_classes` is the vocabulary; `input_shape` is (block_size,) from the token data."""
    if len(input_shape) != 1:
        raise ConfigError("model", "gpt", f"reads token sequences, not {input_shape} inputs: use task=lm")
    if n_embd % n_head:
        raise ConfigError("model.n_head", n_head, f"must divide model.n_embd={n_embd}")
    if pos == "rope":
        check_rope_heads(n_embd, n_head)
    if input_shape[0] > block_size:
        raise ConfigError("data.block_size", input_shape[0], f"must be <= model.block_size={block_size}")
    layout = Layout(norm, norm_eps, mlp, bias)
    model = GPT(num_classes, block_size, n_layer, n_head, n_embd, dropout, qk_norm, layout, pos, rope_base,
                tie_embeddings)  # fmt: skip
    init_gpt(model, proj_init)
    return model


def check_rope_heads(n_embd: int, n_head: int) -> None:
    """RoPE rotates pairs of a head's values: the head size n_embd / n_head must be even."""
    if (n_embd // n_head) % 2 == 0:
        return
    works = [h for h in range(1, n_embd // 2 + 1) if n_embd % (2 * h) == 0]  # n_embd / h is even
    closest = sorted(sorted(works, key=lambda h: abs(h - n_head))[:3])
    fix = f"model.n_head={' or '.join(map(str, closest))}" if works else "an even model.n_embd"
    head = f"gives heads of {n_embd // n_head} values (model.n_embd={n_embd})"
    raise ConfigError("model.n_head", n_head, f"{head} and pos=rope rotates pairs of them: use {fix}")


def init_gpt(model: GPT, proj_init: str) -> None:
    """GPT-2's init: weights normal(0, 0.02), biases 0, norms (1, 0); the residual projections per proj_init."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
    for layer in model.residual_projections():
        if proj_init == "zero":
            nn.init.zeros_(layer.weight)
        elif proj_init == "gpt2":
            nn.init.normal_(layer.weight, std=0.02 / math.sqrt(2 * len(model.blocks)))
