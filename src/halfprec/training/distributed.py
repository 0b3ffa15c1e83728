"""torchrun DDP and FSDP2: process group, rank-0 ownership of the run dir, sharding, full-state
checkpoints, and the checks that keep ranks in step."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from halfprec.numerics.grads import full
from halfprec.numerics.policy import PrecisionPolicy

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    control: Any = None  # a gloo group for host-side agreements on CUDA; None: the default group

    @property
    def enabled(self) -> bool:
        return self.size > 1 or dist.is_initialized()

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init(mode: str, device_type: str) -> World:
    """Join the process group torchrun (or a submitit job's tasks, see halfprec.launch.cluster) set up
    (gloo on CPU, nccl on CUDA); a no-op without DDP.
    (config.validate has checked that trainer.distributed and the launcher agree.)"""
    if mode == "none":
        return World()
    world = World(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))
    if device_type == "cuda":
        # the local rank's GPU; a process that sees one GPU only (SLURM binding a GPU to each task) uses it
        torch.cuda.set_device(world.local_rank if torch.cuda.device_count() > 1 else 0)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    if device_type == "cuda":  # host flags (stop signals) must not wait on the GPU's stream
        world = World(world.rank, world.size, world.local_rank, dist.new_group(backend="gloo"))
    return world


def shared_run_dir(world: World, run_dir: Path) -> Path:
    """Rank 0's run dir, for every rank: it alone writes metrics, checkpoints and the W&B run."""
    if not world.enabled:
        return run_dir
    box = [str(run_dir)]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def wrap(model: nn.Module, world: World, device: torch.device, mode: str, policy: PrecisionPolicy) -> nn.Module:
    """The module the step runs forward/backward through: the DDP wrapper, the model sharded in
    place by FSDP2 (before the optimizer sees its parameters: they become DTensors), or the model."""
    if not world.enabled or mode == "none":
        return model
    if mode == "fsdp":
        return shard(model, policy)
    ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids)


def shard(model: nn.Module, policy: PrecisionPolicy) -> nn.Module:
    """FSDP2: each top-level child that holds parameters is one unit (all-gathered for its own
    forward/backward, then freed), the items of a ModuleList each (a transformer's blocks), and the
    root takes the rest. Weights stay fp32 shards (the master weights); the units compute in the
    precision group's autocast dtype and reduce gradients in precision.reduce_dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=policy.autocast_dtype, reduce_dtype=policy.reduce_dtype)
    for unit in shard_units(model):
        fully_shard(unit, mp_policy=mp)
    fully_shard(model, mp_policy=mp)  # in place: it returns `model` itself, typed as FSDPModule
    return model


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules sharded on their own. A module whose parameter another module uses too (tied
    embeddings: a GPT's head) stays with the root, which is gathered for the whole forward."""
    candidates = [m for child in model.children() for m in (child if isinstance(child, nn.ModuleList) else [child])]
    users: dict[int, int] = {}
    for module in candidates:
        for p in module.parameters():
            users[id(p)] = users.get(id(p), 0) + 1
    return [
        m
        for m in candidates
        if any(p.requires_grad for p in m.parameters()) and all(users[id(p)] == 1 for p in m.parameters())
    ]


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def grad_sync(model: nn.Module, sync: bool):
    """DDP all-reduces (FSDP reduce-scatters) gradients in the backward; for all but the window's
    last micro-batch that is skipped, and the gradients accumulate locally."""
    if sync:
        return contextlib.nullcontext()
    # the casts: what the hasattr found (nn.Module's __getattr__ would type it as a Tensor or Module)
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        return _fsdp_no_sync(cast("FSDPModule", model))
    if hasattr(model, "no_sync"):  # DDP
        return cast(nn.parallel.DistributedDataParallel, model).no_sync()
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(model: FSDPModule):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Model and optimizer state for a checkpoint. Under FSDP a collective (every rank calls it):
    the full, unsharded state gathered to rank 0's CPU (other ranks get {}), keyed by parameter
    name, so it loads at any world size and its "model" entry into the plain model."""
    if not is_sharded(model):
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=opts), get_optimizer_state_dict(model, optimizer, options=opts)


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optim_state: dict) -> None:
    """Shard a full checkpoint (loaded on every rank) back into the FSDP model and optimizer."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=opts)
    set_optimizer_state_dict(model, optimizer, optim_state, options=opts)


def nonfinite_on_any_rank(value: torch.Tensor) -> bool:
    """True on every rank if `value` (a scalar) is inf/NaN on any: ranks must agree on skipping a
    step. Reduced on the value's device before the one host read, so DDP adds no second sync."""
    if dist.is_initialized():
        return any_rank(~torch.isfinite(value))
    return not math.isfinite(value.item())


def any_rank(flag: torch.Tensor) -> bool:
    """True on every rank if the device scalar `flag` is nonzero on any; one host read."""
    if dist.is_initialized():
        flag = flag.float()  # isfinite gives a bool tensor; reduce a float with MAX
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag)


def max_on_host(world: World, value: int) -> int:
    """The largest of the ranks' `value`s, on every rank, reduced on the host (gloo): no device sync.
    For stop signals, which reach each rank at its own moment: all ranks must stop at one step."""
    if not world.enabled:
        return value
    t = torch.tensor([value])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=world.control)
    return int(t.item())


def gather_on_host(world: World, value: float) -> list[float]:
    """Every rank's `value`, in rank order, on every rank (exact: float64, over the host group)."""
    if not world.enabled:
        return [value]
    mine = torch.tensor([value], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(world.size)]
    dist.all_gather(every, mine, group=world.control)
    return [t.item() for t in every]


def barrier(world: World) -> None:
    """Wait for every rank (on the host): e.g. until rank 0 has written a checkpoint."""
    if world.enabled:
        dist.barrier(group=world.control)


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """The mean of a per-rank scalar on the device (the loss of each rank's slice); itself without DDP."""
    if not dist.is_initialized():
        return value
    return sum_over_ranks(value.detach().float().clone()) / dist.get_world_size()


def sum_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of a per-rank tensor on the device, in place; itself without DDP/FSDP."""
    if dist.is_initialized():
        dist.all_reduce(value)
    return value


def broadcast_buffers(model: nn.Module) -> None:
    """Rank 0's buffers (BatchNorm running statistics) on every rank. DDP's forward does this before
    each training step, FSDP never does; ranks that evaluate shares of one validation set must
    agree on them."""
    if dist.is_initialized():
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)


def check_ranks_agree(model: nn.Module, scale: float, skipped: int) -> None:
    """At the end of a DDP/FSDP run: identical weights, scale and skip count on every rank, or an error."""
    if not dist.is_initialized():
        return
    digest = hashlib.sha256()
    for p in model.parameters():  # under FSDP: gathered, so the ranks compare whole weights
        digest.update(full(p.detach()).cpu().contiguous().view(torch.uint8).numpy().tobytes())
    mine = (digest.hexdigest(), scale, skipped)
    every: list[tuple[str, float, int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if any(other != every[0] for other in every):
        raise RuntimeError(f"ranks diverged (weights sha256, scale, skipped steps per rank): {every}")


def finish(world: World, completed: bool) -> None:
    """Tear the process groups down. Without the barrier and collection below, 2-rank FSDP2 runs on
    CPU (gloo) that had finished their work aborted at interpreter exit in 3 of 16 runs ("terminate
    called without an active exception", rank 0, while rank 1 had torn down and left earlier). So
    a completed run waits for every rank, and the objects that may hold communication work are
    collected while the interpreter is alive. A failed run cannot wait: a rank may never arrive."""
    if not dist.is_initialized():
        return
    gc.collect()
    if completed:
        barrier(world)
    dist.destroy_process_group()
