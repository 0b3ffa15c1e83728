"""Rounding rules (`precision.update`): how an update computed in fp32 reaches weights stored in
bf16 or fp16 when there are no fp32 master weights. One class per rule; a new rule is a class here
and an entry in ROUNDING_RULES, and then `precision.update=<name>` selects it."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class RoundingRule:
    """Rounds parameter i's updated fp32 value back to its storage dtype. `before` is the stored
    value from before the step; rules that carry state between steps keep it in `buffers`, which
    checkpoints hold and the memory estimate counts."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.buffers: list[torch.Tensor] = []

    def round(self, i: int, before: torch.Tensor, updated: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def upcast(self, i: int, stored: torch.Tensor) -> torch.Tensor:
        """Parameter i's fp32 value for the optimizer to step, from what the weight stores."""
        return stored.float()

    def lost_to_nearest(self, i: int, before: torch.Tensor, updated: torch.Tensor) -> torch.Tensor:
        """[elements whose fp32 update is non-zero, those of them that rounding to nearest leaves at
        the old weight], int64 on the device: what `.half()`-style rounding loses of this update
        (|update| below half an ulp), whatever this rule then does with it (the diagnostics'
        `update_lost`). Called before `round`, which may work in place on `updated` (Kahan), and
        changes no state: the step's numerics are the same with or without it."""
        changed = updated != before  # compared in fp32: bf16/fp16 values promote exactly, no copy
        moved = changed.sum()
        lost = changed.logical_and_(updated.to(before.dtype) == before).sum()
        return torch.stack([moved, lost])


class RoundToNearest(RoundingRule):
    """What `.half()` training does: an update smaller than half a step of the stored dtype vanishes."""

    def round(self, i: int, before: torch.Tensor, updated: torch.Tensor) -> torch.Tensor:
        return updated.to(before.dtype)


class KahanRounding(RoundingRule):
    """Kahan summation: each step adds the update less the error the last rounding dropped, and
    remembers what this rounding drops, in a buffer of the weight's own dtype."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.buffers = [torch.zeros_like(p) for p in params]

    def round(self, i: int, before: torch.Tensor, updated: torch.Tensor) -> torch.Tensor:
        # In place on the fp32 upcast, which is dropped after: two fp32 temporaries of the weight
        # instead of four at once.
        start = before.float()
        y = updated.sub_(start).sub_(self.buffers[i])  # the update, less the carried error
        total = start + y
        rounded = total.to(before.dtype)
        self.buffers[i].copy_(total.copy_(rounded).sub_(start).sub_(y))  # what rounding dropped
        return rounded


class StochasticRounding(RoundingRule):
    """Unbiased: up or down with probability proportional to the distance (bf16 weights only)."""

    def round(self, i: int, before: torch.Tensor, updated: torch.Tensor) -> torch.Tensor:
        return stochastic_round_to_bf16(updated)


class RemainderRounding(RoundingRule):
    """Exact fp32 master weights in 2 bytes (`precision.master=remainder`; Megatron's
    store_param_remainders): an fp32 value is a bf16 (its high 16 bits) and 16 low bits, kept here
    as an int16 remainder, from which the optimizer's fp32 value is rebuilt bit for bit each step.

    The bf16 copy cannot be rounded to nearest with ties to even: at an exact tie the two fp32
    values that round to one bf16 would need 2^16 + 1 remainders. It rounds to nearest with ties
    away from zero instead (the bit pattern plus half of the low 16 bits, truncated), so the
    remainder fits in [-2^15, 2^15): the weights differ from master=fp32's RNE copy at exact ties
    only (tests/test_remainder.py)."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.buffers = [torch.zeros_like(p, dtype=torch.int16) for p in params]

    def upcast(self, i: int, stored: torch.Tensor) -> torch.Tensor:
        if stored.dtype != torch.bfloat16:  # a module kept in fp32 (norms) is its own master
            return stored.float()
        high = stored.view(torch.int16).int() << 16
        return high.add_(self.buffers[i].int()).view(torch.float32)

    def round(self, i: int, before: torch.Tensor, updated: torch.Tensor) -> torch.Tensor:
        rounded, self.buffers[i] = split_bf16(updated)
        return rounded

    def lost_to_nearest(self, i: int, before: torch.Tensor, updated: torch.Tensor) -> torch.Tensor:
        """The optimizer stepped the exact master (bf16 + remainder), not the bf16 weight: its update
        is the change from that master, applied to the bf16 weight as a run without remainders would."""
        start = self.upcast(i, before)  # the remainder is still this step's: `round` replaces it after
        changed = updated != start
        moved = changed.sum()
        alone = updated.sub(start).add_(before)  # the bf16 weight plus this update, in fp32
        lost = changed.logical_and_(alone.to(before.dtype) == before).sum()
        return torch.stack([moved, lost])


def split_bf16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 -> (bf16 rounded to nearest with ties away from zero, the int16 remainder), such that
    the fp32 bit pattern is (bf16 bits << 16) + remainder exactly."""
    bits = x.contiguous().view(torch.int32)
    high = (bits + 0x8000) >> 16  # arithmetic shift: the sign-magnitude pattern's rounding, ties away from 0
    remainder = (bits - (high << 16)).to(torch.int16)
    return high.to(torch.int16).view(torch.bfloat16), remainder


def stochastic_round_to_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16, up or down with probability proportional to the distance: uniform noise added to
    the 16 bits bf16 drops, then truncated."""
    bits = x.float().contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device)
    # in place on the noise: one int32 temporary of the weight's size, not three
    return noise.add_(bits).bitwise_and_(-65536).view(torch.float32).to(torch.bfloat16)


ROUNDING_RULES: dict[str, type[RoundingRule]] = {
    "nearest": RoundToNearest,
    "kahan": KahanRounding,
    "stochastic": StochasticRounding,
    "remainder": RemainderRounding,  # what precision.master=remainder selects
}
