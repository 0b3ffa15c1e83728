"""The optimizer's parameter groups (docs/design.md, "Optimizer"): which tensors get weight decay
(`optim.no_decay`) and which a scaled learning rate (Fixup's scalars).

Weight decay pulls a tensor toward zero. On a norm's gain or a bias that is no regularizer but a
drift away from the identity (a LayerNorm gain decayed toward 0 shrinks every activation), so
nanoGPT and timm leave every tensor of fewer than 2 dimensions out of it; halfprec does the same by
default (`no_decay: [low_dim]`). Entries of `optim.no_decay`:

    low_dim      tensors of fewer than 2 dimensions: norm gains, biases, Fixup's scalars
    embeddings   the weights of nn.Embedding layers (and what is tied to them: a GPT's output head)
    <glob>       parameter names, e.g. '*.bias' or 'blocks.*.attn.*'

A glob that matches no parameter is a config error. With weight decay 0 there is nothing to split
and the optimizer gets one group, as before groups existed (older checkpoints resume).
"""

from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatchcase

import torch
from torch import nn

from halfprec.errors import ConfigError

NO_DECAY_KINDS = ("low_dim", "embeddings")


def embedding_params(model: nn.Module) -> set[int]:
    """The ids of nn.Embedding weights (a tied output head shares the tensor, so it is one of them)."""
    return {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}


def without_decay(
    named: Sequence[tuple[str, torch.Tensor]], model: nn.Module, no_decay: Sequence[str], owner: Sequence[torch.Tensor]
) -> set[str]:
    """The names of the parameters `no_decay` exempts. `owner`: the model's parameters in the order
    of `named` (the optimizer may step fp32 copies of them: master weights), for the kinds that ask
    the model (embeddings)."""
    embeddings = embedding_params(model) if "embeddings" in no_decay else set()
    for i, entry in enumerate(no_decay):
        if entry not in NO_DECAY_KINDS and not any(fnmatchcase(name, entry) for name, _ in named):
            shown = ", ".join(name for name, _ in named[:6]) + (", ..." if len(named) > 6 else "")
            raise ConfigError(
                f"optim.no_decay[{i}]", entry, f"matches no parameter (they are {shown}); "
                f"the kinds are {', '.join(NO_DECAY_KINDS)}",
            )  # fmt: skip
    exempt = set()
    for (name, tensor), param in zip(named, owner):
        if (
            ("low_dim" in no_decay and tensor.dim() < 2)
            or id(param) in embeddings
            or any(fnmatchcase(name, entry) for entry in no_decay if entry not in NO_DECAY_KINDS)
        ):
            exempt.add(name)
    return exempt


def param_groups(
    named: Sequence[tuple[str, torch.Tensor]],
    exempt: set[str],
    weight_decay: float,
    slow: frozenset[str] = frozenset(),
    slow_lr: float | None = None,
) -> list[dict]:
    """torch param groups, each named (a group dict may hold any key): `decay`, and `no_decay` for
    the `exempt` names (weight decay 0); with Fixup, the `slow` names at `slow_lr` in `slow_decay`
    and `slow_no_decay`. With weight decay 0 nothing is split (`all`, `slow_all`: the groups of the
    checkpoints from before no_decay). Empty groups are left out."""
    groups: dict[str, dict] = {}
    for name, tensor in named:
        kind = "all" if weight_decay == 0 else "no_decay" if name in exempt else "decay"
        key = f"slow_{kind}" if name in slow else kind
        group = groups.setdefault(key, {"params": [], "name": key})
        if kind == "no_decay":
            group["weight_decay"] = 0.0
        if name in slow:
            group["lr"] = slow_lr
        group["params"].append(tensor)
    order = [f"{speed}{kind}" for speed in ("", "slow_") for kind in ("all", "decay", "no_decay")]
    return [groups[key] for key in order if key in groups]
