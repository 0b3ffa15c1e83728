"""Gradients as a whole: their global norm, one inf/NaN check for all of them, and a sharded
(FSDP) tensor made whole so that every rank sees the same values."""

from __future__ import annotations

import torch


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank: a DTensor (FSDP's sharded grads and their norm) gathered; others as they are."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all gradients together; one device and dtype (the usual case) skips
    get_total_norm's per-call grouping."""
    if _one_device_and_dtype(grads):
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    return torch.nn.utils.get_total_norm(grads)


def any_nonfinite(grads: list[torch.Tensor]) -> torch.Tensor:
    """1 if any gradient holds an inf/NaN, else 0, on the gradients' device, without a host read.
    torch's fused AMP check reads (and, multiplying by an inverse scale of 1, rewrites) each
    gradient once; its CUDA kernel takes fp32/fp16 lists on one device. Other lists (bf16, several
    devices: no halfprec mode makes them) are checked tensor by tensor. FSDP: each rank checks its
    own shards, and the caller reduces over ranks. `grads` must not be empty."""
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    first = local[0]
    if first.dtype in (torch.float32, torch.float16) and _one_device_and_dtype(local):
        found = torch.zeros(1, dtype=torch.float32, device=first.device)
        one = torch.ones(1, dtype=torch.float32, device=first.device)
        torch._amp_foreach_non_finite_check_and_unscale_(local, found, one)
        return found
    return torch.stack([~torch.isfinite(g).all().to(first.device) for g in local]).any()


def _one_device_and_dtype(tensors: list[torch.Tensor]) -> bool:
    """What torch's foreach kernels want in one call (otherwise they group, or refuse on CUDA)."""
    first = tensors[0]
    return all(t.device == first.device and t.dtype == first.dtype for t in tensors)
