"""torchrun DDP: process group, rank-0 ownership of the run dir, and the checks that keep ranks in step."""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.size > 1 or dist.is_initialized()

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init(mode: str, device_type: str) -> World:
    """Join the process group torchrun set up (gloo on CPU, nccl on CUDA); a no-op without DDP.
    (config.validate has checked that trainer.distributed and the launcher agree.)"""
    if mode == "none":
        return World()
    world = World(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))
    if device_type == "cuda":
        torch.cuda.set_device(world.local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    return world


def shared_run_dir(world: World, run_dir: Path) -> Path:
    """Rank 0's run dir, for every rank: it alone writes metrics, checkpoints and the W&B run."""
    if not world.enabled:
        return run_dir
    box = [str(run_dir)]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def wrap(model: nn.Module, world: World, device: torch.device) -> nn.Module:
    """The module the step runs forward/backward through: DDP under torchrun, the model itself otherwise."""
    if not world.enabled:
        return model
    ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids)


def grad_sync(model: nn.Module, sync: bool):
    """DDP all-reduces gradients in the backward; `no_sync` skips it for all but the window's last micro-batch."""
    if sync or not hasattr(model, "no_sync"):
        return contextlib.nullcontext()
    return model.no_sync()


def any_rank(flag: bool) -> bool:
    """True on every rank if it is true on any: ranks must agree on skipping a step."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor(float(flag), device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def mean_over_ranks(value: torch.Tensor | float) -> torch.Tensor | float:
    """The mean of a per-rank scalar (the loss of each rank's slice); the value itself without DDP."""
    if not dist.is_initialized():
        return value
    t = torch.as_tensor(value, dtype=torch.float32).detach().clone()
    t = t.cuda() if dist.get_backend() == "nccl" else t.cpu()
    dist.all_reduce(t)
    return t / dist.get_world_size()


def check_ranks_agree(model: nn.Module, scale: float, skipped: int) -> None:
    """At the end of a DDP run: identical weights, scale and skip count on every rank, or an error."""
    if not dist.is_initialized():
        return
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    mine = (digest.hexdigest(), scale, skipped)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if any(other != every[0] for other in every):
        raise RuntimeError(f"DDP ranks diverged (weights sha256, scale, skipped steps per rank): {every}")


def finish() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
