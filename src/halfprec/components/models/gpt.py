"""A small GPT: token and position embeddings, pre-norm blocks of causal self-attention (through
torch's scaled_dot_product_attention) and an MLP, a final norm, and an output head tied to the
token embedding. Written for reading: each module is a few lines."""

from __future__ import annotations

import math
from typing import Annotated, Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from halfprec.components.models import register_model
from halfprec.errors import ConfigError
from halfprec.spec import Spec


def create_norm(kind: str, width: int) -> nn.Module:
    """layernorm (without a bias, as in recent GPTs) or rmsnorm."""
    return nn.LayerNorm(width, bias=False) if kind == "layernorm" else nn.RMSNorm(width)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, qk_norm: bool, norm: str):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.proj = nn.Linear(n_embd, n_embd, bias=False)  # into the residual stream
        head = n_embd // n_head
        # qk-norm (Dehghani et al. 2023): bounded attention logits, whatever the weights grow to
        self.q_norm = create_norm(norm, head) if qk_norm else nn.Identity()
        self.k_norm = create_norm(norm, head) if qk_norm else nn.Identity()
        self.resid_drop = nn.Dropout(dropout)
        # diagnostics=grads turns this on for its steps: the largest attention logit is then kept
        self.record_logits = False
        self.logit_max: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = (t.view(batch, time, self.n_head, -1).transpose(1, 2) for t in self.qkv(x).split(width, dim=2))
        q, k = self.q_norm(q), self.k_norm(k)
        if self.record_logits:
            self.keep_logit_max(q, k)
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
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
    """GELU (GPT-2) or SwiGLU (LLaMA); SwiGLU's hidden width is 8/3 of the model's, rounded up to a
    multiple of 16 so that float8 matmuls can take it."""

    def __init__(self, n_embd: int, kind: str, dropout: float):
        super().__init__()
        hidden = 4 * n_embd if kind == "gelu" else 16 * math.ceil(8 * n_embd / 3 / 16)
        self.fc = nn.Linear(n_embd, hidden, bias=False)
        self.gate = nn.Linear(n_embd, hidden, bias=False) if kind == "swiglu" else None
        self.proj = nn.Linear(hidden, n_embd, bias=False)  # into the residual stream
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc(x)) if self.gate is None else F.silu(self.gate(x)) * self.fc(x)
        return self.drop(self.proj(h))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, qk_norm: bool, norm: str, mlp: str):
        super().__init__()
        self.norm1 = create_norm(norm, n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, qk_norm, norm)
        self.norm2 = create_norm(norm, n_embd)
        self.mlp = MLP(n_embd, mlp, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    keep_high = ("lm_head",)  # quantized formats leave the output head (tied to the embedding) high

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, dropout: float,
                 qk_norm: bool, norm: str, mlp: str):  # fmt: skip
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, qk_norm, norm, mlp) for _ in range(n_layer))
        self.norm = create_norm(norm, n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one matrix embeds and reads out tokens

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(positions))
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
    mlp: Literal["gelu", "swiglu"] = "gelu",
    proj_init: Annotated[
        Literal["gpt2", "zero", "plain"],
        Spec(doc="residual projections at init: std 0.02/sqrt(2 n_layer) (GPT-2), zero, or 0.02 as the rest"),
    ] = "gpt2",
) -> nn.Module:
    """`num_classes` is the vocabulary; `input_shape` is (block_size,) from the token data."""
    if len(input_shape) != 1:
        raise ConfigError("model", "gpt", f"reads token sequences, not {input_shape} inputs: use task=lm")
    if n_embd % n_head:
        raise ConfigError("model.n_head", n_head, f"must divide model.n_embd={n_embd}")
    if input_shape[0] > block_size:
        raise ConfigError("data.block_size", input_shape[0], f"must be <= model.block_size={block_size}")
    model = GPT(num_classes, block_size, n_layer, n_head, n_embd, dropout, qk_norm, norm, mlp)
    init_gpt(model, proj_init)
    return model


def init_gpt(model: GPT, proj_init: str) -> None:
    """GPT-2's init: weights normal(0, 0.02), norms (1, 0); the residual projections per proj_init."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
    for layer in model.residual_projections():
        if proj_init == "zero":
            nn.init.zeros_(layer.weight)
        elif proj_init == "gpt2":
            nn.init.normal_(layer.weight, std=0.02 / math.sqrt(2 * len(model.blocks)))
