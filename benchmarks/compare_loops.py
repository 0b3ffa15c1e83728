"""halfprec's optimizer step against a hand-written loop, PyTorch Lightning and Accelerate, side by side.

    python benchmarks/compare_loops.py [--device cpu|cuda] [--steps N] [--repeats R] [--quick]
                                       [--models mlp-small,...] [--precisions fp32,bf16,...]
                                       [--clip-grad-norm X] [--threads T] [--json OUT.json]
                                       [--markdown OUT.md] [--no-malloc-tuning]

See docs/benchmarks.md for what is measured how, and measured tables.

Every contender trains the same model (one build, deep-copied), on the same batches, with the same
optimizer and hyperparameters, in the same precision mode:

  halfprec    `halfprec.training.build.build(cfg)` and its `stepper.step(...)`, what train.py runs per step
  raw         a hand-written torch loop (nanoGPT style): zero_grad, autocast, GradScaler (fp16 only), backward,
              unscale_/clip when clipping, scaler.step, scaler.update, scheduler.step
  lightning   a LightningModule in `lightning.Trainer(precision=...)`
  accelerate  `accelerate.Accelerator(mixed_precision=...)`: prepare, accelerator.backward, step, zero_grad

Measured: each contender warms up, then the contenders take turns running blocks of steps (about
1 s of the raw loop each, or --steps; the order rotates every round, so machine noise hits all of
them alike); the table shows the median over --repeats blocks of the mean ms/step in a block, and
the ratio to the raw loop. CPU runs use 1 thread unless --threads says otherwise. The dtype every
Linear/Conv layer really computed in is observed with forward hooks during the warm-up, and a contender
that ran in another precision than asked is flagged ("runs bfloat16, asked float16"). After the
timed steps, the contenders that took the same steps as raw are compared with it parameter by
parameter (fp32: halfprec and raw do the same math, so they must agree to ~1e-5).

The glibc malloc thresholds are fixed (docs/design.md, "Measured facts behind the defaults": large CPU
tensors are mmapped and unmapped every step and page faults take 12-36% of a step): the script
re-executes itself with GLIBC_TUNABLES set unless it is already set or --no-malloc-tuning is given.
"""

from __future__ import annotations

from malloc_tuning import reexec_with_malloc_tuning

if __name__ == "__main__":
    reexec_with_malloc_tuning()

# The imports below come after the re-exec on purpose (importing torch takes ~1.5 s).
import argparse  # noqa: E402
import contextlib  # noqa: E402
import copy  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import importlib.metadata  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable, Iterable, Iterator  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from halfprec.components.models import create_model  # noqa: E402
from halfprec.config import Config, compose  # noqa: E402
from halfprec.errors import ConfigError  # noqa: E402
from halfprec.numerics.policy import PrecisionPolicy, observe_compute_dtypes  # noqa: E402
from halfprec.spec import Choice  # noqa: E402
from halfprec.training.build import Components, build  # noqa: E402
from halfprec.training.perf import math_kind, peak_tflops  # noqa: E402

CONF = Path(__file__).resolve().parents[1] / "conf"
CONTENDERS = ("halfprec", "raw", "lightning", "accelerate")
FRAMEWORKS = CONTENDERS[2:]
OptimizerFactory = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]  # parameters in model order


@dataclass(frozen=True)
class Workload:
    """A model and its synthetic data: what every contender trains."""

    label: str
    overrides: tuple[str, ...]  # Hydra overrides choosing the model (and its optimizer)
    input_shape: tuple[int, ...]  # (C, H, W) images, or (block_size,) tokens
    num_classes: int  # classes, or the vocabulary
    batch_size: int
    n_batches: int = 16  # distinct batches, cycled
    channels_last: bool = False
    tokens: bool = False  # task=lm: token sequences in, next-token logits out


GPT_SMALL = ("model.n_layer=4", "model.n_embd=128", "model.n_head=4", "model.block_size=128")
GPT2_SIZED = ("model.n_layer=12", "model.n_embd=768", "model.n_head=12", "model.block_size=1024")
WORKLOADS = {
    "gpt-small": Workload("gpt 4x128, 128 bytes", GPT_SMALL, (128,), 256, 16, tokens=True),
    "gpt2-sized": Workload(
        "gpt 12x768 (GPT-2 small), 1024 bytes", GPT2_SIZED, (1024,), 256, 16, n_batches=4, tokens=True
    ),
    "mlp-small": Workload("mlp 64-256-256-10", ("model=mlp", "model.hidden=[256,256]"), (1, 8, 8), 10, 64),
    "mlp-big": Workload("mlp 1024-2048-2048-10", ("model=mlp", "model.hidden=[2048,2048]"), (1, 32, 32), 10, 256),
    "fixup-resnet": Workload(
        "fixup_resnet 3x2 blocks, 3x32x32",
        ("model=fixup_resnet", "init=fixup", "model.blocks_per_stage=2"),
        (3, 32, 32),
        10,
        64,
    ),
    "resnet50": Workload(
        "timm resnet50, 224x224",
        ("model=timm", "model.name=resnet50"),
        (3, 224, 224),
        1000,
        256,
        n_batches=2,
        channels_last=True,  # tensor-core convs want NHWC; applied to every contender alike
    ),
    "vit-b16": Workload(
        "timm vit_base_patch16_224",
        ("model=timm", "model.name=vit_base_patch16_224", "optim=adamw"),
        (3, 224, 224),
        1000,
        128,
        n_batches=2,
    ),
}
DEFAULT_MODELS = {
    "cpu": ["mlp-small", "mlp-big", "fixup-resnet", "gpt-small"],
    "cuda": ["resnet50", "vit-b16", "gpt2-sized"],
}
# Rows run precision by precision, each on every model, in this order: the modes most asked about
# first, plain fp32 (no TF32) last, so that a GPU run cut short by its time limit loses the least.
DEFAULT_PRECISIONS = {"cpu": ["fp32"], "cuda": ["bf16", "fp16", "fp8", "tf32", "bf16_pure", "fp16_pure", "fp32"]}
# (seconds per timed block, blocks per contender, warm-up steps). Steps per block follow from the raw
# loop's step time, so a 0.5 ms MLP and a 100 ms ResNet get blocks of about the same length.
DEFAULT_SCHEDULE = {"cpu": (1.0, 11, 5), "cuda": (0.75, 3, 3), "quick": (0.2, 3, 3)}

# How each framework spells a halfprec precision mode; a mode missing here it cannot express
# (pure fp16/bf16 weights), so that contender sits the row out. TF32 is a process-wide torch flag,
# not a framework mode: it is set by halfprec's policy before every block, for every contender.
LIGHTNING_PRECISION = {"fp32": "32-true", "tf32": "32-true", "fp16": "16-mixed", "bf16": "bf16-mixed"}
ACCELERATE_PRECISION = {"fp32": "no", "tf32": "no", "fp16": "fp16", "bf16": "bf16"}

# ---------------------------------------------------------------- the contenders


class Loop:
    """One contender: a model, an optimizer and a way to take optimizer steps on the shared batches."""

    name = ""
    model: nn.Module  # the module whose Linear/Conv layers compute (hooks and comparisons look here)
    optimizer: torch.optim.Optimizer

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device):
        self.batches = batches
        self.device = device
        self.steps_taken = 0
        self.last_loss: torch.Tensor | None = None  # stays on the device: reading it would sync
        self.note = ""

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batches[self.steps_taken % len(self.batches)]
        self.steps_taken += 1
        return batch

    def step(self) -> None:
        raise NotImplementedError

    def run(self, n: int) -> float:
        """Take `n` optimizer steps; return the seconds they took."""
        sync(self.device)
        start = time.perf_counter()
        for _ in range(n):
            self.step()
        sync(self.device)
        return time.perf_counter() - start

    def extra_tensors(self) -> Iterable[torch.Tensor]:
        """Tensors the loop keeps besides the model and the optimizer state (compensation buffers)."""
        return ()

    def resident_tensors(self) -> Iterator[torch.Tensor]:
        """Everything this contender keeps between steps: weights, grads, buffers, optimizer state
        (and the optimizer's own parameters: fp32 master weights in pure modes)."""
        yield from self.model.parameters()
        yield from (p.grad for p in self.model.parameters() if p.grad is not None)
        yield from self.model.buffers()
        for group in self.optimizer.param_groups:
            yield from group["params"]
            yield from (p.grad for p in group["params"] if p.grad is not None)
        for state in self.optimizer.state.values():
            yield from (v for v in state.values() if torch.is_tensor(v))
        yield from self.extra_tensors()


class HalfprecLoop(Loop):
    """What train.py runs per step: the Stepper of the components `build(cfg)` made."""

    name = "halfprec"

    def __init__(self, c: Components, clip: float | None, log_every: int, batches: list, device: torch.device):
        super().__init__(batches, device)
        self.c, self.log_every = c, log_every
        self.stepper = dataclasses.replace(c.stepper, clip_grad_norm=clip)
        self.model, self.optimizer = c.model, c.stepper.optimizer

    def step(self) -> None:
        # train.py computes the grad norm on the steps that log it (every trainer.log_every) only
        result = self.stepper.step([self.next_batch()], compute_norm=self.steps_taken % self.log_every == 0)
        self.last_loss = result.loss

    def extra_tensors(self) -> Iterable[torch.Tensor]:
        return self.c.stepper.params.compensation


class RawLoop(Loop):
    """The loop one writes by hand (nanoGPT style). Pure fp16: fp32 master weights that the
    optimizer and GradScaler work on (GradScaler refuses fp16 grads); pure bf16: the optimizer
    steps the bf16 weights directly (so its state is bf16 too; halfprec's update math is fp32);
    fp8: its copy of halfprec's model keeps the torchao Float8Linear layers, in bf16 autocast."""

    name = "raw"

    def __init__(
        self,
        model: nn.Module,
        new_optimizer: OptimizerFactory,
        policy: PrecisionPolicy,
        clip: float | None,
        batches: list,
        device: torch.device,
    ):
        super().__init__(batches, device)
        self.model, self.clip = model, clip
        self.autocast_dtype = policy.autocast_dtype
        self.input_dtype = policy.param_dtype if policy.is_pure else None
        self.master = []
        if policy.is_pure and policy.master_weights:
            self.master = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
            self.note = "fp32 master weights"
        elif policy.is_pure:
            self.note = f"optimizer steps the {dtype_name(policy.param_dtype)} weights directly"
        elif policy.config.kernel == "native":  # its model copy has torchao's Float8Linear layers
            self.note = f"torchao float8 {policy.config.format} layers, bf16 autocast"
        self.params = self.master or list(model.parameters())  # what the optimizer steps
        self.optimizer = new_optimizer(self.params)
        self.scheduler = constant_schedule(self.optimizer)
        self.scaler = torch.amp.GradScaler(device.type, enabled=policy.uses_fp16)

    def step(self) -> None:
        x, y = self.next_batch()
        self.model.zero_grad(set_to_none=True)
        if self.input_dtype is not None:
            x = x.to(self.input_dtype)
        autocast = (
            torch.autocast(self.device.type, self.autocast_dtype) if self.autocast_dtype else contextlib.nullcontext()
        )
        with autocast:
            logits = self.model(x)
        loss = cross_entropy(logits, y)
        self.scaler.scale(loss).backward()
        if self.master:
            for m, p in zip(self.master, self.model.parameters()):
                m.grad = p.grad.float()
        if self.clip is not None:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        if self.master:
            with torch.no_grad():
                torch._foreach_copy_(list(self.model.parameters()), self.master)
        self.last_loss = loss.detach()


class AccelerateLoop(Loop):
    """Hugging Face Accelerate's loop: prepare, accelerator.backward, optimizer.step, zero_grad."""

    name = "accelerate"

    def __init__(
        self, model: nn.Module, new_optimizer: OptimizerFactory, mixed: str, clip: float | None, batches: list, device
    ):
        super().__init__(batches, device)
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState

        # Accelerate keeps one global state per process and refuses a second Accelerator with another
        # mixed_precision; reset it (accelerate's own tests do) so that each row gets the mode it asks.
        AcceleratorState._reset_state(reset_partial_state=True)
        self.accelerator = Accelerator(mixed_precision=mixed, cpu=device.type == "cpu")
        optimizer = new_optimizer(model.parameters())
        self.model, self.clip = model, clip
        self.net, self.optimizer, self.scheduler = self.accelerator.prepare(
            model, optimizer, constant_schedule(optimizer)
        )

    def step(self) -> None:
        x, y = self.next_batch()
        self.optimizer.zero_grad(set_to_none=True)
        loss = cross_entropy(self.net(x), y)
        self.accelerator.backward(loss)
        if self.clip is not None:
            self.accelerator.clip_grad_norm_(self.net.parameters(), self.clip)
        self.optimizer.step()
        self.scheduler.step()
        self.last_loss = loss.detach()


class LightningLoop(Loop):
    """PyTorch Lightning. Timing: every block is one `Trainer.fit()` of FIT_WARMUP + n + 1 steps, and a
    Callback reads the clock at the start of batch FIT_WARMUP and of batch FIT_WARMUP + n, so a block
    measures n whole steady-state periods of Lightning's loop (data fetch, hooks, closure, step) and
    none of fit()'s set-up and tear-down, which a long run pays once. The module hands every fit()
    the same optimizer, so its state carries over from block to block as in the other loops; the
    extra untimed steps mean Lightning ends at other weights than raw, so it is not compared."""

    name = "lightning"
    FIT_WARMUP = 2  # the first steps of a fit() pay for its set-up: never timed

    def __init__(
        self,
        model: nn.Module,
        new_optimizer: OptimizerFactory,
        precision: str,
        clip: float | None,
        batches: list,
        device,
    ):
        super().__init__(batches, device)
        import lightning as L

        quiet_lightning()
        if device.type == "cuda":
            keep_cuda_cache_across_fits()
        self.L, self.precision, self.clip = L, precision, clip
        self.model = model
        self.optimizer = new_optimizer(model.parameters())
        self.module = _lightning_module_class(L)(model, self.optimizer, constant_schedule(self.optimizer))

    def run(self, n: int) -> float:
        device = self.device
        first, last = self.FIT_WARMUP, self.FIT_WARMUP + n
        clock = _lightning_clock_class(self.L)(first, last, lambda: sync(device))
        trainer = self.L.Trainer(
            max_steps=last + 1,
            precision=self.precision,
            accelerator="gpu" if device.type == "cuda" else "cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            gradient_clip_val=self.clip,
            callbacks=[clock],
        )
        data = torch.utils.data.DataLoader(CycledBatches(self.batches, last + 1), batch_size=None)
        with contextlib.redirect_stdout(io.StringIO()):  # its banners ("GPU available: ...", tips)
            trainer.fit(self.module, data)
        self.steps_taken += last + 1
        self.last_loss = self.module.last_loss
        return clock.times[last] - clock.times[first]


def _lightning_module_class(L):
    class Module(L.LightningModule):
        def __init__(self, model: nn.Module, optimizer, scheduler):
            super().__init__()
            self.model, self.opt, self.sched = model, optimizer, scheduler
            self.last_loss = None

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = cross_entropy(self.model(x), y)
            self.last_loss = loss.detach()
            return loss

        def configure_optimizers(self):
            # the same objects on every fit(): the optimizer state carries over between blocks
            return {"optimizer": self.opt, "lr_scheduler": {"scheduler": self.sched, "interval": "step"}}

    return Module


def _lightning_clock_class(L):
    class Clock(L.Callback):
        def __init__(self, first: int, last: int, sync_device: Callable[[], None]):
            self.marks, self.sync, self.times = {first, last}, sync_device, {}

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx in self.marks:
                self.sync()
                self.times[batch_idx] = time.perf_counter()

    return Clock


class CycledBatches(torch.utils.data.Dataset):
    """The shared batches as a map-style dataset of whole batches (a DataLoader with batch_size=None)."""

    def __init__(self, batches: list, length: int):
        self.batches, self.length = batches, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        return self.batches[i % len(self.batches)]


def quiet_lightning() -> None:
    """Lightning logs banners at INFO and warns about things that do not apply to a benchmark."""
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module=r"lightning(\..*)?")
    warnings.filterwarnings("ignore", message=".*(does not have many workers|LeafSpec|precision=).*")


# ---------------------------------------------------------------- shared pieces


def keep_cuda_cache_across_fits() -> None:
    """Every Lightning block is a whole fit(), and fit() starts and ends by emptying the CUDA caching
    allocator and cuBLAS's workspaces: a long run pays that once, but here the contender after
    Lightning would pay it in every timed block (its first step re-allocating all its memory).
    Lightning still moves the model to the CPU and back around each fit, outside the timed steps."""
    import lightning.pytorch.accelerators.cuda as lightning_cuda

    if hasattr(lightning_cuda, "_clear_cuda_memory"):
        lightning_cuda._clear_cuda_memory = lambda: None


def optimizer_like(c: Components) -> OptimizerFactory:
    """Make optimizers like halfprec's over another copy of the model's parameters (given in model
    order): the same class, hyperparameters and param groups. The groups matter: with init=fixup,
    halfprec gives the scalar biases and scales lr * init.scalar_lr_scale, and a loop with one lr
    for all would not do the same math."""
    reference = c.stepper.optimizer
    position = {id(p): i for i, p in enumerate(c.stepper.params.params)}
    layout = [[position[id(p)] for p in group["params"]] for group in reference.param_groups]
    settings = [{k: v for k, v in g.items() if k not in ("params", "initial_lr")} for g in reference.param_groups]

    def make(params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
        params = list(params)
        return type(reference)([{**s, "params": [params[i] for i in idx]} for s, idx in zip(settings, layout)])

    return make


def constant_schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """halfprec's `sched=constant` (a LambdaLR at factor 1): every contender steps one every step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cuda_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct CUDA storages behind `tensors`."""
    storages = {}
    for t in tensors:
        if t.is_cuda:
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    return max(
        (pa.detach().float().cpu() - pb.detach().float().cpu()).abs().max().item()
        for pa, pb in zip(a.parameters(), b.parameters())
    )


def cross_entropy(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss every contender computes, in fp32: over classes, or over every next token."""
    return F.cross_entropy(logits.float().flatten(0, -2), y.flatten())


def flops_per_image(model_cfg: Choice, work: Workload, device: torch.device) -> float:
    """Forward + backward FLOPs per image (per sequence), counted by torch on a fresh fp32 copy (2 of them)."""
    model = create_model(model_cfg, work.input_shape, work.num_classes).to(device)
    x = inputs(work, 2, device, torch.Generator(device).manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(x).float().sum().backward()
    return counter.get_total_flops() / 2


def compose_cfg(work: Workload, precision: str, device: torch.device, clip: float | None) -> Config:
    """The workload's config; trainer.channels_last as the workload says (its batches follow)."""
    shape = ",".join(str(d) for d in work.input_shape)
    # build() needs a dataset; the steps use synthetic_batches(). task=lm warms its lr up, which the
    # other contenders' constant schedule does not.
    data = ["task=lm", "data=pydoc", "sched.warmup_steps=0"] if work.tokens else [
        "data=synthetic", f"data.shape=[{shape}]", f"data.num_classes={work.num_classes}",
        f"data.num_train={work.batch_size}", "data.num_val=1",
    ]  # fmt: skip
    overrides = [
        "logger=none",
        "trainer.progress=false",
        f"trainer.device={device.type}",
        *data,
        f"data.batch_size={work.batch_size}",
        f"precision={precision}",
        "sched=constant",
        f"trainer.channels_last={str(work.channels_last and device.type == 'cuda').lower()}",
        *work.overrides,
    ]
    if clip is not None:
        overrides.append(f"optim.clip_grad_norm={clip}")
    if precision == "fp8" and device.type == "cpu":  # no fp8 tensor cores: torchao's emulation, to try the path
        overrides.append("precision.fp8_emulate=true")
    return compose(overrides, CONF)


def synthetic_batches(work: Workload, device: torch.device, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Gaussian images with random labels, made on the device. There is nothing to learn but the
    samples by heart, so the loss stays well above 0 while the benchmark runs: on data the model
    fits perfectly, the softmax tails underflow and CPU steps slow down on denormal numbers."""
    g = torch.Generator(device).manual_seed(seed)
    targets = (work.batch_size, *work.input_shape) if work.tokens else (work.batch_size,)
    return [
        (
            inputs(work, work.batch_size, device, g),
            torch.randint(0, work.num_classes, targets, generator=g, device=device),
        )
        for _ in range(work.n_batches)
    ]


def inputs(work: Workload, n: int, device: torch.device, g: torch.Generator) -> torch.Tensor:
    """n Gaussian images, or n sequences of random tokens."""
    if work.tokens:
        return torch.randint(0, work.num_classes, (n, *work.input_shape), generator=g, device=device)
    return torch.randn((n, *work.input_shape), generator=g, device=device)


# ---------------------------------------------------------------- one row of the table


@dataclass
class Result:
    model: str
    precision: str
    contender: str
    asked_dtype: str
    computed_dtype: str = "-"
    median_ms: float | None = None
    block_ms: list[float] = field(default_factory=list)
    best_ms: float | None = None  # the fastest block: less exposed to a noisy machine than the median
    ratio_to_raw: float | None = None
    images_per_s: float | None = None  # samples: images, or sequences
    tokens_per_s: float | None = None  # token workloads
    mfu: float | None = None
    peak_mem_mb: float | None = None
    steps: int = 0  # taken in all, warm-up included
    steps_per_block: int = 0
    final_loss: float | None = None
    max_param_diff_vs_raw: float | None = None
    note: str = ""


def make_loops(
    work: Workload,
    precision: str,
    device: torch.device,
    clip: float | None,
    frameworks: Iterable[str] = FRAMEWORKS,
) -> tuple[list[Loop], dict[str, str], Components, Config]:
    """Build halfprec's components, then each other contender from a deep copy of the same model."""
    cfg = compose_cfg(work, precision, device, clip)
    c = build(cfg)
    batches = synthetic_batches(work, c.device, cfg.seed)
    if cfg.trainer.channels_last:  # the workload decides, for every contender alike
        batches = [(x.contiguous(memory_format=torch.channels_last), y) for x, y in batches]
    initial = copy.deepcopy(c.model)  # before any step: every contender starts from these weights
    new_optimizer = optimizer_like(c)
    loops: list[Loop] = [
        HalfprecLoop(c, clip, cfg.trainer.log_every, batches, device),
        RawLoop(copy.deepcopy(initial), new_optimizer, c.stepper.policy, clip, batches, device),
    ]
    skipped: dict[str, str] = {}
    contenders = [
        ("lightning", LIGHTNING_PRECISION, LightningLoop),
        ("accelerate", ACCELERATE_PRECISION, AccelerateLoop),
    ]
    for name, spelling, make in contenders:
        if name not in frameworks:
            continue
        if precision not in spelling:
            skipped[name] = "fp8 not set up for it" if precision == "fp8" else "no pure low-precision mode"
            continue
        try:
            loops.append(make(copy.deepcopy(initial), new_optimizer, spelling[precision], clip, batches, device))
        except ImportError as err:
            skipped[name] = f"skipped: {err} (pip install -e '.[bench]')"
    return loops, skipped, c, cfg


def measure(
    work: Workload, precision: str, device: torch.device, args: argparse.Namespace, flops: float | None
) -> list[Result]:
    """Warm up every contender, time interleaved blocks, and compare them with raw."""
    loops, skipped, c, _ = make_loops(work, precision, device, args.clip_grad_norm, args.frameworks)
    asked = dtype_name(c.stepper.policy.compute_dtype)
    results = {loop.name: Result(work.label, precision, loop.name, asked, note=loop.note) for loop in loops}

    warmup_s = {}
    for loop in list(loops):  # warm-up; also where the compute dtype is observed
        c.stepper.policy.apply_backend_flags()  # TF32 is process-wide: every contender runs the row's setting
        try:
            with observe_compute_dtypes(loop.model) as seen:
                warmup_s[loop.name] = loop.run(args.warmup)
        except Exception as err:  # a framework that cannot run this mode here: report it, go on
            if loop.name in ("halfprec", "raw"):
                raise
            loops.remove(loop)
            skipped[loop.name] = f"failed: {type(err).__name__}: {str(err).splitlines()[0][:120]}"
            continue
        r = results[loop.name]
        r.computed_dtype = "+".join(sorted(dtype_name(d) for d in seen)) or "-"
        if r.computed_dtype != asked:
            r.note = join_notes(f"runs {r.computed_dtype}, asked {asked}", r.note)

    peak_bytes = {loop.name: 0 for loop in loops}
    steps = args.steps or steps_for(warmup_s["raw"] / args.warmup, args.block_s)
    for round_ in range(args.repeats):
        shift = round_ % len(loops)
        for loop in loops[shift:] + loops[:shift]:  # rotate: no contender always runs first
            c.stepper.policy.apply_backend_flags()
            if device.type == "cuda":
                # this contender's own memory: its resident tensors plus what its steps add on top
                others = torch.cuda.memory_allocated(device) - cuda_bytes(loop.resident_tensors())
                torch.cuda.reset_peak_memory_stats(device)
            seconds = loop.run(steps)
            results[loop.name].block_ms.append(1000 * seconds / steps)
            if device.type == "cuda":
                peak_bytes[loop.name] = max(peak_bytes[loop.name], torch.cuda.max_memory_allocated(device) - others)

    raw = raw_loop(loops)
    peak = peak_tflops(device, math_kind(c.stepper.policy))
    for loop in loops:
        r = results[loop.name]
        r.median_ms, r.best_ms = statistics.median(r.block_ms), min(r.block_ms)
        r.images_per_s = 1000 * work.batch_size / r.median_ms
        r.tokens_per_s = r.images_per_s * work.input_shape[0] if work.tokens else None
        r.steps, r.steps_per_block = loop.steps_taken, steps
        r.final_loss = float(loop.last_loss) if loop.last_loss is not None else None
        if device.type == "cuda":
            r.peak_mem_mb = peak_bytes[loop.name] / 2**20
        if peak and flops:
            r.mfu = flops * r.images_per_s / (peak[1] * 1e12)
        r.ratio_to_raw = r.median_ms / statistics.median(results["raw"].block_ms)
        if loop.steps_taken == raw.steps_taken:
            r.max_param_diff_vs_raw = max_param_diff(loop.model, raw.model)
    rows = [results[loop.name] for loop in loops]
    rows += [Result(work.label, precision, name, asked, note=why) for name, why in skipped.items()]
    return sorted(rows, key=lambda r: CONTENDERS.index(r.contender))


def raw_loop(loops: list[Loop]) -> Loop:
    return next(loop for loop in loops if loop.name == "raw")


def steps_for(raw_step_s: float, block_s: float) -> int:
    """Steps per timed block: about `block_s` seconds of the raw loop (as timed in its warm-up), 5 to 1000.
    The warm-up's first step is slower than the rest, so blocks come out a little shorter: harmless."""
    return max(5, min(1000, round(block_s / raw_step_s)))


def join_notes(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


# ---------------------------------------------------------------- output


def environment(device: torch.device, args: argparse.Namespace) -> dict:
    def version(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return {
        **machine(device),
        "lightning": version("lightning"),
        "accelerate": version("accelerate"),
        "python": platform.python_version(),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", "unset (glibc defaults)"),
        "steps_per_block": args.steps,  # None: sized per row to about block_seconds of the raw loop
        "block_seconds": None if args.steps else args.block_s,
        "blocks": args.repeats,
        "warmup_steps": args.warmup,
        "clip_grad_norm": args.clip_grad_norm,
    }


def block_size(env: dict) -> str:
    if env["steps_per_block"]:
        return f"{env['steps_per_block']} steps each"
    return f"each ~{env['block_seconds']:g} s of raw steps; steps/block in the second table"


def machine(device: torch.device) -> dict:
    """What every benchmark's JSON starts with: when, how it was started, and on what."""
    return {
        "date": datetime.date.today().isoformat(),
        "command": shlex.join(["python", *sys.argv]),
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model_name(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def cpu_model_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def markdown(env: dict, rows: list[Result]) -> str:
    lines = [
        f"{env['date']}, {env['device_name']}, torch {env['torch']}, lightning {env['lightning']}, "
        f"accelerate {env['accelerate']}, threads: {env['threads']}, GLIBC_TUNABLES={env['glibc_tunables']}",
        f"{env['blocks']} interleaved blocks per contender ({block_size(env)}) after {env['warmup_steps']} "
        f"warm-up steps; median over blocks. `{env['command']}`",
        "",
        "| model | precision | contender | median ms/step | ratio to raw | samples/s (tokens/s) | MFU | peak mem MB "
        "| note |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        mfu = fmt(None if r.mfu is None else 100 * r.mfu, ".1f") + ("%" if r.mfu is not None else "")
        lines.append(
            f"| {r.model} | {r.precision} | {r.contender} | {fmt(r.median_ms, '.3f')} | "
            f"{fmt(r.ratio_to_raw, '.3f')}{'x' if r.ratio_to_raw else ''} | {fmt(r.images_per_s, ',.0f')}"
            f"{f' ({r.tokens_per_s:,.0f})' if r.tokens_per_s else ''} | "
            f"{mfu} | {fmt(r.peak_mem_mb, ',.0f')} | {r.note} |"
        )
    lines += [
        "",
        "Details: the fastest block, and the same math? (final loss and weights after the last timed step;",
        "lightning takes extra untimed steps per fit, so it is not compared)",
        "",
        "| model | precision | contender | computes in | steps/block | best ms/step | best vs raw's best | steps | "
        "final loss | max abs Δparam vs raw |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    best_raw = {(r.model, r.precision): r.best_ms for r in rows if r.contender == "raw"}
    for r in rows:
        if r.median_ms is None:
            continue
        lines.append(
            f"| {r.model} | {r.precision} | {r.contender} | {r.computed_dtype} | {r.steps_per_block} | "
            f"{fmt(r.best_ms, '.3f')} | {fmt(r.best_ms / best_raw[r.model, r.precision], '.3f')}x | {r.steps} | "
            f"{fmt(r.final_loss, '.4g')} | {fmt(r.max_param_diff_vs_raw, '.2e')} |"
        )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available")
    parser.add_argument("--steps", type=int, default=None, help="steps per timed block (default: ~1 s of raw)")
    parser.add_argument("--repeats", type=int, default=None, help="timed blocks per contender (median over them)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per contender before the blocks")
    parser.add_argument("--models", default=None, help=f"comma-separated, of: {', '.join(WORKLOADS)}")
    parser.add_argument("--precisions", default=None, help="comma-separated halfprec precision options")
    parser.add_argument("--clip-grad-norm", type=float, default=None, help="clip every contender's gradients")
    parser.add_argument(
        "--frameworks",
        type=lambda s: [] if s == "none" else s.split(","),
        default=list(FRAMEWORKS),
        help="framework contenders besides halfprec and raw: lightning,accelerate (default) or none",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: 1 on CPU)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: mlp-small, few steps (< 1 min on CPU)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the table as markdown")
    parser.add_argument("--no-malloc-tuning", action="store_true", help="keep glibc's default malloc thresholds")
    args = parser.parse_args(argv)

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible here")
    args.block_s, repeats, warmup = DEFAULT_SCHEDULE["quick" if args.quick else args.device]
    args.repeats = args.repeats or repeats
    args.warmup = args.warmup if args.warmup is not None else warmup
    if args.warmup < 1:
        parser.error("--warmup: at least 1 (the warm-up also observes the compute dtype and sizes the blocks)")
    quick_precisions = ["fp32"] if args.device == "cpu" else ["fp32", "bf16", "fp16"]
    default_precisions = quick_precisions if args.quick else DEFAULT_PRECISIONS[args.device]
    choose_rows(parser, args, DEFAULT_MODELS[args.device], default_precisions)
    unknown = [f for f in args.frameworks if f not in FRAMEWORKS]
    if unknown:
        parser.error(f"--frameworks {','.join(unknown)}: unknown; choose from {', '.join(FRAMEWORKS)}, or none")
    return args


def choose_rows(
    parser: argparse.ArgumentParser, args: argparse.Namespace, models: list[str], precisions: list[str]
) -> None:
    """--models and --precisions as lists (the defaults given where absent; --quick: mlp-small);
    an unknown model is a usage error. The other benchmark scripts share it."""
    args.models = args.models.split(",") if args.models else (["mlp-small"] if args.quick else models)
    args.precisions = args.precisions.split(",") if args.precisions else precisions
    unknown = [m for m in args.models if m not in WORKLOADS]
    if unknown:
        parser.error(f"--models {','.join(unknown)}: unknown; choose from {', '.join(WORKLOADS)}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # One CPU thread by default: on a shared 2-core machine a second OpenMP thread that waits for a
    # busy core turned a 1 ms MLP step into 130 ms (measured); one thread measures the loops, not that.
    if args.threads or args.device == "cpu":
        torch.set_num_threads(args.threads or 1)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # process-wide, so every contender gets the fastest convs
    # LambdaLR warns when a GradScaler skipped the first optimizer step (fp16's initial scale overflows)
    warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
    env = environment(device, args)
    print(f"torch {env['torch']} | lightning {env['lightning']} | accelerate {env['accelerate']}")
    print(f"{env['device_name']} | threads: {env['threads']} | GLIBC_TUNABLES={env['glibc_tunables']}", flush=True)

    rows: list[Result] = []
    flops = {}
    for key in args.models:
        work = WORKLOADS[key]
        flops[key] = flops_per_image(compose_cfg(work, "fp32", device, None).model, work, device)
    model_order = {WORKLOADS[key].label: i for i, key in enumerate(args.models)}
    for precision in args.precisions:  # precision-major: see DEFAULT_PRECISIONS
        for key in args.models:
            work = WORKLOADS[key]
            start = time.perf_counter()
            try:
                rows += measure(work, precision, device, args, flops[key])
            except ConfigError as err:  # a mode this model cannot run (fp8 on resnet50: no eligible Linear)
                rows.append(Result(work.label, precision, "halfprec", "-", note=f"not run: {err}"))
                print(f"{work.label}, {precision}: not run: {err}", file=sys.stderr, flush=True)
            else:
                print(f"{work.label}, {precision}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
            # after every row: a run cut short by a timeout keeps what it measured; grouped by model
            rows.sort(key=lambda r: model_order[r.model])
            write_outputs(args, env, rows)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(markdown(env, rows))


def write_outputs(args: argparse.Namespace, env: dict, rows: list[Result]) -> None:
    if args.markdown:
        args.markdown.write_text(markdown(env, rows))
    if args.json:
        args.json.write_text(json.dumps({"env": env, "rows": [dataclasses.asdict(r) for r in rows]}, indent=1) + "\n")


if __name__ == "__main__":
    main()
