"""What a training step keeps in memory, per precision mode, counted from the built components.

`estimate_memory(c, batch)` adds up the parts a step holds: the model's parameters and buffers,
their gradients, the fp32 weights and gradients the optimizer steps where those are not the model's
own (master weights), the optimizer's state, Kahan compensation buffers, the input batch, and the
activations autograd saves for backward. `benchmarks/memory.py` compares it with measured peaks.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from halfprec.components.tasks import Task
from halfprec.components.tasks.classification import Classification
from halfprec.numerics.optimizers import LowPrecisionState
from halfprec.numerics.params import ParamStrategy, nbytes
from halfprec.numerics.policy import PrecisionPolicy
from halfprec.numerics.quantized import kept_bytes
from halfprec.training.distributed import is_sharded

if TYPE_CHECKING:  # train.py imports Hydra; this module needs only the components it is given
    from halfprec.training.build import Components

MB = 2**20

# Tensors of parameter size each optimizer keeps per parameter, from its param_group settings: the
# state appears only at the first step, so it is predicted. Exact classes only (a subclass may keep
# more); a class without a rule is measured (measured_state_bytes), which costs a copy of the
# parameters and a step.
STATE_TENSORS = {
    torch.optim.SGD: lambda group: 1 if group["momentum"] != 0 else 0,
    torch.optim.Adam: lambda group: 3 if group["amsgrad"] else 2,
    torch.optim.AdamW: lambda group: 3 if group["amsgrad"] else 2,
}
# torchao's low-bit AdamW (torchao.optim): each moment of a tensor of at least 4096 values, a multiple
# of the block, is stored as codes (bytes per value), an fp32 scale per block and a code book of
# fp32 values per tensor; smaller tensors keep fp32 moments.
TORCHAO_STATE = {"AdamW8bit": (1.0, 256), "AdamW4bit": (0.5, 16), "AdamWFp8": (1.0, 0)}  # bytes/value, code book
# Adam keeps a float32 `step` count per parameter; it sits with the parameters only when the update
# runs there (fused, capturable), otherwise on the host.
STEP_COUNTERS = (torch.optim.Adam, torch.optim.AdamW)


class UnknownOptimizer(ValueError):
    """estimate_memory has no rule for how much state this optimizer keeps."""


@dataclass
class MemoryEstimate:
    """Bytes a training step holds, by part. `total` is their plain sum: parts that never coexist
    are both counted (see estimate_memory), and workspaces and temporaries are not."""

    params: int  # model parameters at their storage dtype
    buffers: int  # model buffers (BatchNorm running statistics)
    grads: int  # the model's gradients, in each parameter's dtype
    master_weights: int  # fp32 weights the optimizer steps that are not the model's own
    master_grads: int  # fp32 gradients the optimizer steps that are not the model's own
    optimizer_state: int
    compensation: int  # a rounding rule's buffers: Kahan's, or precision.master=remainder's int16 remainders
    inputs: int  # the batch, as the caller holds it
    activations: int  # tensors autograd saves for backward, beyond parameters and inputs

    @property
    def total(self) -> int:
        return sum(self.parts().values())

    def parts(self) -> dict[str, int]:
        return asdict(self)

    def megabytes(self) -> dict[str, float]:
        """Every part and the total in MiB, for tables."""
        return {name: n / MB for name, n in {**self.parts(), "total": self.total}.items()}


@dataclass
class BytesPerParam:
    """A MemoryEstimate per trainable parameter, split by how long each part lives: the bytes per
    parameter a precision mode is quoted by ("16 for mixed-precision Adam": 2 + 2 + 4 + 8) in
    `total`, the update's fp32 temporaries beside it, and the per-step rest. The fields add up to
    the estimate's total / params."""

    params: int  # trainable parameters (tied weights once): the divisor
    weights: float  # the model's parameters and buffers, at their storage dtype
    master: float  # persistent fp32 master weights (master modes); 0 where the update upcasts instead
    grads: float  # the model's gradients, in each parameter's dtype
    optimizer_state: float
    compensation: float  # a rounding rule's buffers: Kahan's, the int16 remainders
    update: float  # fp32 tensors held from unscale to the end of the update only (not in `total`)
    batch_activations: float  # the batch and the saved activations: they scale with the batch, not the model

    @property
    def total(self) -> float:
        """Weights, master weights, gradients, optimizer state and compensation: what the mode holds
        per parameter outside the update and the forward."""
        return self.weights + self.master + self.grads + self.optimizer_state + self.compensation


def bytes_per_param(estimate: MemoryEstimate, params: ParamStrategy) -> BytesPerParam:
    """`estimate`'s parts per trainable parameter of `params`, the strategy it was made from.

    `master_weights` is persistent only where the strategy keeps master copies (`params.master`);
    without them it is the fp32 upcast of each low-precision weight for the update, which goes with
    the fp32 master gradients into `update` (the low-precision gradients are freed as those are
    made, so `grads` and `update` do not coexist in full). Buffers count as weights."""
    n = sum(p.numel() for p in {id(p): p for p in params.model_params}.values())
    if n == 0:  # a frozen model: nothing to divide by, and no update to count
        raise ValueError("bytes_per_param: the model has no trainable parameters")
    master = estimate.master_weights if params.master else 0
    return BytesPerParam(
        params=n,
        weights=(estimate.params + estimate.buffers) / n,
        master=master / n,
        grads=estimate.grads / n,
        optimizer_state=estimate.optimizer_state / n,
        compensation=estimate.compensation / n,
        update=(estimate.master_weights - master + estimate.master_grads) / n,
        batch_activations=(estimate.inputs + estimate.activations) / n,
    )


def estimate_memory(c: Components, batch: tuple[torch.Tensor, torch.Tensor]) -> MemoryEstimate:
    """Bytes that one optimizer step on `batch` holds, for one process without FSDP, part by part
    (what each part counts and leaves out: docs/benchmarks.md, "memory.py"). The state is counted
    from parameter counts and dtypes (the parameter strategy's `update_bytes` for the update's
    copies); activations are counted in one forward of `batch` with saved_tensors_hooks, which
    leaves buffers and the RNG as they were. `total` sums the parts, though not all coexist."""
    if is_sharded(c.model):
        raise ValueError("estimate_memory counts one process's unsharded model; FSDP shards are not supported")
    step = c.stepper
    master_weights, master_grads = step.params.update_bytes()
    return MemoryEstimate(
        params=nbytes(c.model.parameters()),
        buffers=nbytes(c.model.buffers()),
        grads=nbytes(step.params.model_params),
        master_weights=master_weights,
        master_grads=master_grads,
        optimizer_state=optimizer_state_bytes(step.optimizer, step.params, c.device),
        compensation=nbytes(step.params.compensation),
        inputs=nbytes(batch),
        activations=activation_bytes(c.model, step.policy, batch, step.task),
    )


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, params: ParamStrategy, device: torch.device) -> int:
    """The state `optimizer` will hold once it has stepped every parameter, in bytes on `device`:
    from a rule for the classes it knows, measured by one step of a copy for the others."""
    if isinstance(optimizer, LowPrecisionState):  # it says what it keeps
        return low_precision_state_bytes(optimizer, device)
    if type(optimizer).__module__.startswith("torchao.optim") and type(optimizer).__name__ in TORCHAO_STATE:
        return torchao_state_bytes(optimizer)
    rule = STATE_TENSORS.get(type(optimizer))
    if rule is None:
        return measured_state_bytes(optimizer, params, device)
    total = 0
    for group in optimizer.param_groups:
        on_device = device.type == "cpu" or group.get("fused") or group.get("capturable")
        step_count = torch.float32.itemsize if isinstance(optimizer, STEP_COUNTERS) and on_device else 0
        for t in group["params"]:
            total += rule(group) * t.numel() * params.optimizer_dtype(t).itemsize + step_count
    return total


def measured_state_bytes(optimizer: torch.optim.Optimizer, params: ParamStrategy, device: torch.device) -> int:
    """The state of an optimizer without a rule, measured: a new instance of its class, built from
    its param groups and defaults over zero tensors of the parameters' shapes in the dtype it steps
    them in (params.optimizer_dtype: the fp32 upcasts of bf16 weights), takes one step on zero
    gradients; then the distinct storages of every tensor in its state on `device` count, scalars
    (step counts) included. `optimizer` and the model are not touched, and the copies are freed
    on return. Raises UnknownOptimizer, with the error, where the instance cannot be built or the
    step fails (an optimizer that needs a closure)."""
    copies = {id(t): _zero_copy(t, params.optimizer_dtype(t)) for g in optimizer.param_groups for t in g["params"]}
    groups: list[dict] = []
    devices = [device] if device.type != "cpu" else []
    probe: torch.optim.Optimizer | None = None
    stage, failure = "building a new instance", ""
    storages: dict[tuple[int, int], int] = {}
    try:
        for group in optimizer.param_groups:  # the settings deep-copied too: a step may change them in place
            settings = copy.deepcopy({k: v for k, v in group.items() if k != "params"})
            groups.append({**settings, "params": [copies[id(t)] for t in group["params"]]})
        # the step may draw random numbers (stochastic rounding): the run's stream stays as it was
        with torch.random.fork_rng(devices=devices, device_type=device.type):
            probe = type(optimizer)(groups, **copy.deepcopy(optimizer.defaults))
            stage = "one step on zero gradients"
            probe.step()
        for t in _tensors(probe.state):
            if t.device.type == device.type:  # as the rules: memory on `device` only
                storages[_storage_key(t)] = t.untyped_storage().nbytes()
    except Exception as err:  # whatever the class raises is reported, by its type and first line
        lines = str(err).strip().splitlines()
        failure = type(err).__name__ + (f": {lines[0]}" if lines else "")
    finally:
        # the copies and the state go now, even where something (a reference cycle, the traceback
        # of UnknownOptimizer below) still holds the instance or this frame
        if probe is not None:
            probe.state.clear()
            probe.param_groups.clear()
        copies.clear()
        groups.clear()
    if failure:
        known = ", ".join(cls.__name__ for cls in STATE_TENSORS)
        raise UnknownOptimizer(
            f"no memory rule for {type(optimizer).__module__}.{type(optimizer).__qualname__}, and its state "
            f"cannot be measured: {stage} raised {failure} (known: {known}; add it to "
            "halfprec.tools.memory.STATE_TENSORS)"
        )
    return sum(storages.values())


def _zero_copy(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Zeros like the parameter `t` in `dtype`, as a parameter with a zero gradient: what a step updates."""
    zero = torch.zeros_like(t, dtype=dtype).requires_grad_()
    zero.grad = torch.zeros_like(zero)
    return zero


def _tensors(value: object) -> Iterator[torch.Tensor]:
    """The tensors in an optimizer's state: in dicts, lists and tuples, at any depth."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def low_precision_state_bytes(optimizer: LowPrecisionState, device: torch.device) -> int:
    """The state of halfprec's own optimizers, from their `state_layout`, plus AdamW's `step` count
    (a float32 scalar per parameter, on the host: counted on a CPU, as torch's)."""
    total = 0
    counts = device.type == "cpu" and "exp_avg" in optimizer.STATE_KEYS
    for group in optimizer.param_groups:
        per_value = sum(dtype.itemsize for dtype in optimizer.state_layout(group))
        total += sum(per_value * t.numel() + (torch.float32.itemsize if counts else 0) for t in group["params"])
    return total


def torchao_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """torchao's low-bit AdamW: two moments per parameter (TORCHAO_STATE) and a float32 step count,
    which it keeps beside the parameter."""
    per_value, book = TORCHAO_STATE[type(optimizer).__name__]
    total = 0
    for group in optimizer.param_groups:
        block = optimizer.block_size  # type: ignore[attr-defined]
        for t in group["params"]:
            n = t.numel()
            quantized = n >= 4096 and n % block == 0
            moment = int(n * per_value + 4 * (n // block + book)) if quantized else 4 * n
            total += 2 * moment + torch.float32.itemsize
    return total


def activation_bytes(
    model: nn.Module, policy: PrecisionPolicy, batch: tuple[torch.Tensor, torch.Tensor], task: Task | None = None
) -> int:
    """Bytes of the distinct storages autograd saves in one training forward of `batch` (model in
    train mode, the task's loss included: classification's by default), other than the parameters' and the batch's.
    A quantized layer's forward copies (precision.recipe.backward_source=forward) count as a kernel holds
    them, in their format's bits (elements and scales), not as the fp32 tensors the emulation keeps."""
    x, y = batch
    known = {_storage_key(t) for t in [*model.parameters(), x, y]}
    saved: dict[tuple[int, int], int] = {}
    copies: dict[tuple[int, int], int] = {}  # the forward copies, by storage: what a kernel holds

    def pack(t: torch.Tensor) -> torch.Tensor:
        key, held = _storage_key(t), kept_bytes(t)
        if held is not None and t.device == x.device:
            copies[key] = held
        elif key not in known and t.device == x.device:
            saved[key] = key[1]
        return t  # the graph holds it until the end of the count, so no storage is reused meanwhile

    was_training = model.training
    buffers = [b.clone() for b in model.buffers()]
    devices = [x.device] if x.device.type != "cpu" else []
    try:
        with torch.random.fork_rng(devices=devices, device_type=x.device.type), torch.enable_grad():
            model.train()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                with policy.autocast():
                    logits = model(policy.cast_input(x))
                loss = (task or Classification()).loss(logits, y)
            del logits, loss
    finally:
        model.train(was_training)
        with torch.no_grad():
            for b, kept in zip(model.buffers(), buffers):
                b.copy_(kept)
    return sum(n for key, n in saved.items() if key not in copies) + sum(copies.values())


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()
