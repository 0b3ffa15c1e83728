"""`halfprec sensitivity RUN_DIR`: what computing each Linear layer in a number format does to a
trained model, measured on its validation batches (docs/design.md, "Number formats").

For every Linear layer L and format f, one pass with L alone a QuantizedLinear of f (its three GEMMs
in f, the other layers as the run computed them) against one pass of the run's own precision with
every Linear layer high:

    damage          the loss on the batches with L in f, minus the reference's (L's forward GEMM
                    is the only one that changes a loss)
    weight grad     cosine and relative error ||g_f - g|| / ||g|| of L's own GEMM's weight
                    gradient (the forward's change and L's backward GEMMs both reach it)
    input grad      the same for the gradient L passes back to its input (none for a first layer
                    whose inputs are data)

both accumulated over the micro-batches (sums of products, then one cosine: a batch's gradient is
what an optimizer step sees). The whole model in f, planned as precision=<f> would plan it, is the
reference row. Stochastic rounding of gradients draws from the layer's seed and the batch number, so
the numbers are the same on every call.

With `attention` (an AttentionRecipe: `--attention`, the default for a run that quantized
attention), each attention core (the GPT's blocks.N.attn.core) is measured as a layer too: alone a
QuantizedAttention of f (its six GEMMs in f), its input gradient that of its queries, keys and values
together, no weight gradient and no parameters; the whole model's row then has the cores in f as
well, as precision=<f> precision.attention.format=<f> would plan it.
"""

from __future__ import annotations

import itertools
import math
import shlex
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from halfprec.components.data import Dataset, build_dataset
from halfprec.components.models import create_model
from halfprec.components.tasks import Task, build_task
from halfprec.config import Config, from_saved, resolve_device
from halfprec.errors import ConfigError
from halfprec.numerics.attention import AttentionRecipe, QuantizedAttention, ScaledDotProduct
from halfprec.numerics.converters.emulated import swap_emulated
from halfprec.numerics.formats import FORMATS
from halfprec.numerics.layers import attention_cores, linear_layers, plan_layers
from halfprec.numerics.policy import PrecisionPolicy
from halfprec.numerics.quantized import RECIPE_SWITCHES, QuantizedLinear, Recipe
from halfprec.numerics.settings import HIGH
from halfprec.training.checkpoint import checkpoint_files, load_checkpoint

WHOLE = "(whole model)"  # the row of every planned layer in the format at once
# Standard errors a damage must exceed to count: about 95% one-sided for the batch means' normal
# approximation, so that a layer at +0.0002 +- 0.0003 is not ranked as damaged (nor made a rule).
SIGNIFICANT = 2.0


class SensitivityError(Exception):
    """A run the tool cannot measure: one line for the user."""


@dataclass
class Run:
    """A trained model as its run computed it, and what scores it."""

    config: Config  # its checkpoint's, the keys added since as its version behaved
    checkpoint: Path
    step: int
    model: nn.Module
    data: Dataset
    task: Task
    policy: PrecisionPolicy
    device: torch.device


def find_checkpoint(path: Path) -> Path:
    """A checkpoint file as given, else the newest step-*.pt of a run dir (or of its checkpoints/)."""
    if path.is_file():
        return path
    if not path.is_dir():
        raise SensitivityError(f"{path}: no such run dir or checkpoint file")
    found = checkpoint_files(path / "checkpoints") or checkpoint_files(path)
    jobs = sorted((d for d in path.iterdir() if d.is_dir() and checkpoint_files(d / "checkpoints")), key=job_number)
    if not found and jobs:  # a sweep dir: its jobs are the runs
        raise SensitivityError(
            f"{path} is a sweep dir, not a run's: pass one of its job dirs, e.g. halfprec sensitivity "
            f"{shlex.quote(str(jobs[0]))} ({len(jobs)} of them have a checkpoint)"
        )
    if not found:
        raise SensitivityError(
            f"{path} holds no checkpoint (checkpoints/step-*.pt): the tool measures a trained model; a run "
            "saves one every trainer.ckpt_every steps and at its end"
        )
    return found[-1]


def job_number(job_dir: Path) -> tuple[int, str]:
    """A multirun job dir's number (`12_seed=1`: 12), for listing job 2 before job 10."""
    number = job_dir.name.split("_", 1)[0]
    return (int(number) if number.isdigit() else -1, job_dir.name)


def load_run(path: Path, device: str | None = None) -> Run:
    """Rebuild the run's model from the config its checkpoint saved, every Linear layer plain
    (a run that trained quantized layers is measured against its own high precision), with the
    checkpoint's weights, in eval mode."""
    ckpt_path = find_checkpoint(path)
    try:
        ckpt = load_checkpoint(ckpt_path)
    except ConfigError as err:  # its advice is resume's: keep what it says of the file
        raise SensitivityError(f"{ckpt_path}: {err.fix.split(';')[0]}") from None
    config = from_saved(ckpt["config"])
    try:
        target = resolve_device(device or config.trainer.device, config.precision)  # it must work here
        data = build_dataset(config.data)  # its data must be where the run read it
        model = create_model(config.model, data.input_shape, data.num_classes)
    except ConfigError as err:
        raise SensitivityError(f"{ckpt_path}: {err}") from None
    policy = PrecisionPolicy.from_config(config.precision, target.type)
    policy.prepare_model(model)
    # QuantizedLinear keeps its count of backward passes as extra state: not a weight
    weights = {k: v for k, v in ckpt["model"].items() if not k.endswith("_extra_state")}
    model.load_state_dict(weights)
    model.to(target).eval()
    for core in (m for m in model.modules() if isinstance(m, ScaledDotProduct)):
        core.dropout = 0.0  # eval mode drops nothing; a quantized core refuses a dropout
    task = build_task(config.task)
    return Run(config, ckpt_path, int(ckpt["step"]), model, data, task, policy, target)


def parse_recipe(text: str, run_recipe: Recipe) -> Recipe:
    """--recipe: `run` (the run's precision.recipe switches), `none`, or switches joined by commas."""
    if text == "run":
        chosen = [s for s in RECIPE_SWITCHES if getattr(run_recipe, s)]
    elif text == "none":
        chosen = []
    else:
        chosen = [s.strip() for s in text.split(",") if s.strip()]
        unknown = [s for s in chosen if s not in RECIPE_SWITCHES]
        if unknown:
            raise SensitivityError(
                f"--recipe: unknown {', '.join(unknown)}; use run, none, or {', '.join(RECIPE_SWITCHES)}"
            )
    # the run's E8M0 rule; the gradients in the measured format itself
    switches: dict[str, Any] = {s: s in chosen for s in RECIPE_SWITCHES}
    return Recipe(scale_rule=run_recipe.scale_rule, **switches)


def parse_formats(text: str) -> list[str]:
    formats = [f.strip() for f in text.split(",") if f.strip()]
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise SensitivityError(f"--formats: unknown {', '.join(unknown) or '(none)'}; known: {', '.join(FORMATS)}")
    return formats


@dataclass
class Agreement:
    """How close gradients computed in a format are to the reference's, over micro-batches."""

    dot: float = 0.0
    test_sq: float = 0.0
    ref_sq: float = 0.0
    diff_sq: float = 0.0

    def add(self, test: torch.Tensor, ref: torch.Tensor) -> None:
        t, r = test.double(), ref.double()
        self.dot += float((t * r).sum())
        self.test_sq += float(t.square().sum())
        self.ref_sq += float(r.square().sum())
        self.diff_sq += float((t - r).square().sum())

    @property
    def cosine(self) -> float:
        norms = math.sqrt(self.test_sq * self.ref_sq)
        return self.dot / norms if norms else (1.0 if self.diff_sq == 0 else 0.0)

    @property
    def rel_err(self) -> float:
        return math.sqrt(self.diff_sq / self.ref_sq) if self.ref_sq else (0.0 if self.diff_sq == 0 else math.inf)


@dataclass
class Row:
    """One layer (or WHOLE) in one format; an attention core (`core`) has no weight gradient."""

    layer: str
    format: str
    params: int
    diffs: list[float] = field(default_factory=list)  # each batch's loss minus the reference's
    weight_grad: Agreement | None = field(default_factory=Agreement)
    input_grad: Agreement | None = None
    core: bool = False


@dataclass
class Pass:
    """What one forward and backward gave: the loss, and the gradients asked for."""

    loss: float
    weight_grads: dict[str, torch.Tensor]
    input_grads: dict[str, tuple[torch.Tensor, ...]]  # a Linear's input; a core's queries, keys, values


def weight(model: nn.Module, name: str) -> torch.Tensor | None:
    """A Linear layer's weight; None for an attention core, which has none."""
    layer = model.get_submodule(name)
    if isinstance(layer, ScaledDotProduct):
        return None
    assert isinstance(layer, nn.Linear)
    return layer.weight


def inputs_of(module: nn.Module, args: tuple) -> tuple[torch.Tensor, ...]:
    """What a layer's input gradient is taken of: a core's q, k and v, a Linear layer's input."""
    return tuple(args[:3]) if isinstance(module, ScaledDotProduct) else (args[0],)


def run_pass(run: Run, inputs: torch.Tensor, targets: torch.Tensor, layers: list[str]) -> Pass:
    """The loss of one batch and, for each of `layers`, the weight gradient of its own GEMM (an
    alias of its weight, so that a tied weight's other use is not counted; none for a core) and its
    input gradient."""
    weights = {n: weight(run.model, n) for n in layers}
    aliases = {n: w.detach().requires_grad_() for n, w in weights.items() if w is not None}
    seen: dict[str, tuple[torch.Tensor, ...]] = {}
    hooks = [
        run.model.get_submodule(n).register_forward_pre_hook(lambda m, a, n=n: seen.__setitem__(n, inputs_of(m, a)))
        for n in layers
    ]
    try:
        with run.policy.autocast():
            params = {f"{n}.weight": a for n, a in aliases.items()}
            output = torch.func.functional_call(run.model, params, (run.policy.cast_input(inputs),), tie_weights=False)
        loss = run.task.loss(output, targets)
    finally:
        for hook in hooks:
            hook.remove()
    xs = {n: x for n, x in seen.items() if all(t.requires_grad for t in x)}
    wanted = [*aliases.values(), *(t for x in xs.values() for t in x)]
    grads = torch.autograd.grad(loss, wanted)
    weight_grads = dict(zip(aliases, grads[: len(aliases)]))
    rest = iter(grads[len(aliases) :])
    return Pass(float(loss.detach()), weight_grads, {n: tuple(next(rest) for _ in x) for n, x in xs.items()})


@contextmanager
def quantized(run: Run, plan: dict[str, str], recipe: Recipe, seed: int, batch: int,
              attention: AttentionRecipe | None = None) -> Iterator[None]:  # fmt: skip
    """The planned layers as QuantizedLinear (cores as QuantizedAttention of `attention`) while
    inside, then the plain ones back; stochastic rounding seeded by the layer and the batch number
    (as the run's layers are by their backward pass)."""
    originals = {n: run.model.get_submodule(n) for n, f in plan.items() if f != HIGH}
    swap_emulated(run.model, plan, recipe, seed, rank=0, attention=attention)
    for name in originals:
        layer = run.model.get_submodule(name)
        assert isinstance(layer, (QuantizedLinear, QuantizedAttention))
        layer.backward_passes = batch
    try:
        yield
    finally:
        for name, module in originals.items():
            run.model.set_submodule(name, module)


def add_pass(row: Row, got: Pass, ref: Pass) -> None:
    row.diffs.append(got.loss - ref.loss)
    for name, grad in got.weight_grads.items():
        assert row.weight_grad is not None  # a core's pass asks for no weight gradient
        row.weight_grad.add(grad, ref.weight_grads[name])
    if row.layer in got.input_grads:
        row.input_grad = row.input_grad or Agreement()
        for test, reference in zip(got.input_grads[row.layer], ref.input_grads[row.layer]):
            row.input_grad.add(test, reference)  # q, k and v as one vector


@dataclass
class Measured:
    """Every row, and the reference: the run's own precision with every Linear layer high."""

    reference_loss: float
    rows: list[Row]
    plans: dict[str, dict[str, str]]  # each format's plan as precision=<format> would make it
    batches: int

    @staticmethod
    def damage(row: Row) -> float:
        return sum(row.diffs) / len(row.diffs)

    @staticmethod
    def damage_se(row: Row) -> float:
        """The standard error of the damage over the batches: below it, an order is noise."""
        n, mean = len(row.diffs), Measured.damage(row)
        return math.sqrt(sum((d - mean) ** 2 for d in row.diffs) / (n - 1) / n) if n > 1 else math.nan

    @staticmethod
    def significant(row: Row) -> bool:
        """A loss increase beyond SIGNIFICANT standard errors (none with one batch: no error known)."""
        se = Measured.damage_se(row)
        return math.isfinite(se) and Measured.damage(row) > SIGNIFICANT * se


def measure(run: Run, formats: list[str], batches: int, recipe: Recipe, seed: int,
            advance: Callable[[str], None] = lambda what: None,
            attention: AttentionRecipe | None = None) -> Measured:  # fmt: skip
    """The rows of every Linear layer (with `attention`, every attention core too) and of WHOLE, in
    each format, over the first `batches` validation batches; `advance` is called after every pass
    with what it measured (a progress bar)."""
    layers, plans = candidates(run, formats, attention is not None)
    weights = {n: weight(run.model, n) for n in layers}
    size = {n: 0 if w is None else w.numel() for n, w in weights.items()}
    quantizable = {f: [n for n, g in plans[f].items() if g != HIGH] for f in formats}
    rows = {(n, f): core_row(n, f) if weights[n] is None else Row(n, f, size[n]) for f in formats for n in layers}
    whole = {f: Row(WHOLE, f, sum(size[n] for n in quantizable[f])) for f in formats}
    ref_sum, seen = 0.0, 0
    for b, (inputs, targets) in enumerate(validation_batches(run, batches)):
        ref = run_pass(run, inputs, targets, layers)
        ref_sum, seen = ref_sum + ref.loss, seen + 1
        advance(f"batch {b + 1}: the reference")
        for f in formats:
            for n in layers:
                with quantized(run, {n: f}, recipe, seed, b, attention):
                    add_pass(rows[n, f], run_pass(run, inputs, targets, [n]), ref)
                advance(f"batch {b + 1}: {n} in {f}")
            with quantized(run, plans[f], recipe, seed, b, attention):
                add_pass(whole[f], run_pass(run, inputs, targets, quantizable[f]), ref)
            advance(f"batch {b + 1}: the whole model in {f}")
    if not seen:
        raise SensitivityError(f"{run.checkpoint}: the run's data has no validation batch")
    return Measured(ref_sum / seen, [*rows.values(), *whole.values()], plans, seen)


def core_row(layer: str, fmt: str) -> Row:
    return Row(layer, fmt, 0, weight_grad=None, core=True)


def candidates(run: Run, formats: list[str], attention: bool = False) -> tuple[list[str], dict[str, dict[str, str]]]:
    """The model's Linear layers (`attention`: and its attention cores, in model order) and each
    format's plan as precision=<format> (precision.attention.format=<format>) would make it; a model
    whose plan quantizes nothing (no Linear layer, or only its output head), or with `attention` and
    no core, is one line."""
    model, name = run.model, type(run.model).__name__
    if attention and not attention_cores(model):
        raise SensitivityError(f"--attention: {name} has no attention core to measure (the GPT's blocks.N.attn.core, "
                               "torch's fused attention in a module of its own); leave it out")  # fmt: skip
    layers = linear_layers(model)
    if not layers:
        raise SensitivityError(f"{run.checkpoint}: {name} has no Linear layer to compute in a format (the tool "
                               "measures Linear layers; convolutions, embeddings and norms are not quantized)",
                               )  # fmt: skip
    plans = {f: plan_layers(model, f, [], attention=f if attention else None) for f in formats}
    if all(g == HIGH for plan in plans.values() for g in plan.values()):
        only = f"only Linear layer, {layers[0]}, is its output head" if len(layers) == 1 else (
            f"Linear layers ({', '.join(layers)}) are all output heads")  # fmt: skip
        raise SensitivityError(f"{run.checkpoint}: {name}'s {only}, which a plan keeps high: no layer to measure "
                               "(convolutions are not quantized)")  # fmt: skip
    return list(plans[formats[0]]), plans  # every plan names the same modules, in model order


def validation_batches(run: Run, count: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The first `count` validation batches (none for a count below 1: measure() then says so)."""
    size = run.task.val_batch_size(run.config.data.batch_size)
    return itertools.islice(run.data.val_batches(size, run.device), max(count, 0))


def passes(layers: int, formats: int, batches: int) -> int:
    """How many forward-backward passes measure() makes: for a progress bar's total."""
    return batches * (1 + formats * (layers + 1))
