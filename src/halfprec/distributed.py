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


def any_rank(flag: torch.Tensor) -> bool:
    """True on every rank if `flag` is true on any (ranks must agree on skipping a step). Reduced
    on the flag's device before the one host read, so DDP adds no second sync to the step."""
    if dist.is_initialized():
        flag = flag.float()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag)


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """The mean of a per-rank scalar on the device (the loss of each rank's slice); itself without DDP."""
    if not dist.is_initialized():
        return value
    total = value.detach().float().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


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
