"""Precision policy: the dtype the forward computes in, the dtype parameters are stored in,
which modules stay fp32, and how an optimizer update reaches low-precision parameters."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from halfprec.errors import PrecisionMismatch
from halfprec.numerics.attention import attention_label
from halfprec.numerics.converters import CONVERTERS, Conversion, layer_format
from halfprec.numerics.evaluation import EvalPrecision, eval_note, eval_precisions
from halfprec.numerics.layers import attention_cores, plan_precision, recipe_reach
from halfprec.numerics.quantized import gemm_label
from halfprec.numerics.schedule import PrecisionSchedule, build_schedule
from halfprec.numerics.settings import HIGH, PrecisionSettings

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Normalization statistics are sums of many squares: in fp16 they overflow or lose the mean.
# apex O2 and fairseq keep them in fp32; so do we (`precision.keep_norm_fp32`).
NORM_TYPES = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm, nn.RMSNorm)
COMPUTE_TYPES = (nn.Linear, nn.modules.conv._ConvNd)


@dataclass
class PrecisionPolicy:
    """precision.* as a run computes with it: `config`, as given, and what it resolves to on this
    device (from_config): the torch dtypes, whether fp32 master weights exist, the update rule; then
    the plan of layers once swapped."""

    config: PrecisionSettings
    autocast_dtype: torch.dtype | None  # None: no autocast
    param_dtype: torch.dtype
    master_weights: bool  # fp32 copies for the optimizer (pure modes only)
    update: str  # a rule of numerics/rounding.py: how an update is rounded into low-precision weights
    device_type: str
    reduce_dtype: torch.dtype  # trainer=fsdp: dtype gradients are reduce-scattered in
    steps: int | None = None  # trainer.max_steps: where a schedule's fractions fall (None: a tool's few steps)
    layers: dict[str, str] = field(default_factory=dict)  # Linear layer -> its formats (gemm_label) or high
    attention: dict[str, str] = field(default_factory=dict)  # attention core -> its formats (attention_label) or high
    notes: list[str] = field(default_factory=list)  # what the start of a run says of the plan (recipe_reach)
    schedule: PrecisionSchedule | None = None  # precision.schedule's phases over the swapped layers
    evals: list[EvalPrecision] = field(default_factory=list)  # precision.eval planned on the model

    @classmethod
    def from_config(cls, p: PrecisionSettings, device_type: str, steps: int | None = None) -> PrecisionPolicy:
        """The policy of precision.* on `device_type`, for a run of `steps`."""
        return cls(
            config=p,
            autocast_dtype=DTYPES[p.autocast] if p.autocast else None,
            param_dtype=DTYPES[p.param_dtype],
            # precision.master=fp32 is master_weights=true; remainder is the rounding rule that keeps
            # the 16 bits bf16 drops (numerics/rounding.py), so that the update is exact
            master_weights=p.master == "fp32" or (p.master is None and p.master_weights),
            update="remainder" if p.master == "remainder" else p.update,
            device_type=device_type,
            reduce_dtype=DTYPES[p.reduce_dtype],
            steps=steps,
        )

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.autocast_dtype or self.param_dtype

    @property
    def is_pure(self) -> bool:
        return self.param_dtype != torch.float32

    @property
    def uses_fp16(self) -> bool:
        return torch.float16 in (self.autocast_dtype, self.param_dtype)

    def apply_backend_flags(self) -> None:
        """TF32 is process-wide in torch; set it explicitly so fp32 really means fp32."""
        if self.device_type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = self.config.tf32
            torch.backends.cudnn.allow_tf32 = self.config.tf32

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def cast_input(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_pure and x.is_floating_point():
            return x.to(self.param_dtype)
        return x

    def prepare_model(self, model: nn.Module) -> list[nn.Module]:
        """Cast the model to the parameter dtype; return the modules kept in fp32."""
        if not self.is_pure:
            return []
        model.to(self.param_dtype)
        kept: list[nn.Module] = []
        if self.config.keep_norm_fp32:
            for module in model.modules():
                if isinstance(module, NORM_TYPES):
                    module.float()
                    module.register_forward_pre_hook(_inputs_to_fp32)
                    module.register_forward_hook(_output_to(self.param_dtype))
                    kept.append(module)
        return kept

    def quantize_layers(self, model: nn.Module, seed: int = 0, rank: int = 0) -> dict[str, str]:
        """Swap the Linear layers the plan gives a format (numerics/layers.py), or a precision.schedule
        phase does, for the quantized ones of the converter precision.kernel names (numerics/
        converters), before any wrapping (DDP, FSDP2, torch.compile). Return the plan: each Linear's
        format or high."""
        p = self.config
        if not (p.format or any(r.format != HIGH for r in p.rules) or p.schedule or p.attention.format):
            return {}
        converter = CONVERTERS[p.kernel]
        plan, warnings = plan_precision(model, p, converter.fits, converter.unfit)
        converted = plan
        cores = set(attention_cores(model))
        if p.schedule:
            converted, self.schedule = build_schedule(plan, p.schedule, p.recipe, self.steps or 0, p.attention, cores)
        linears = list(dict.fromkeys(f for n, f in converted.items() if f != HIGH and n not in cores))
        attention = [p.attention.gemms(f) for n, f in converted.items() if f != HIGH and n in cores]
        reach = recipe_reach(linears, p.recipe, attention)
        how = Conversion(p, seed, rank, self.device_type, self.steps)
        self.notes = [*warnings, *reach, *converter.convert(model, converted, how)]
        for name, f in plan.items():
            if name in cores:
                self.attention[name] = HIGH if f == HIGH else attention_label(p.attention.gemms(f))
            else:
                self.layers[name] = HIGH if f == HIGH else gemm_label(p.recipe.gemms(f))
        if self.schedule is not None:
            self.enter_phase(model, 0)
        return converted

    def plan_evaluations(self, model: nn.Module) -> None:
        """precision.eval's entries planned on the model as built (numerics/evaluation.py), so that an
        entry that quantizes nothing says so before the first step."""
        p = self.config
        if p.eval:
            self.evals = eval_precisions(model, p.eval, p.recipe, p.rules, p.high_first, p.high_last, p.attention,
                                         p.accumulate)  # fmt: skip
            self.notes.append(eval_note(self.evals))

    def enter_phase(self, model: nn.Module, phase: int) -> None:
        """The schedule's formats once `phase` phases have begun, in the layers and in the plan the
        first-step check and the switch rows compare them with."""
        assert self.schedule is not None
        self.schedule.apply(model, phase)
        for name, label in self.schedule.labels(phase).items():
            (self.attention if name in self.attention else self.layers)[name] = label

    def check(self, model: nn.Module, observed: set[torch.dtype], master: list[torch.Tensor]) -> dict:
        """Compare what the first step really did against the policy; raise on a mismatch."""
        expected = self.compute_dtype
        if observed != {expected}:
            got = ", ".join(sorted(_name(d) for d in observed)) or "nothing (no Linear/Conv layer ran)"
            raise PrecisionMismatch(
                f"precision={self.name}: Linear/Conv layers computed in {got}, expected {_name(expected)}; "
                "a module may disable autocast or cast its own inputs"
            )
        weights = {m.weight.dtype for m in model.modules() if isinstance(m, COMPUTE_TYPES)}
        if weights and weights != {self.param_dtype}:
            raise PrecisionMismatch(
                f"precision={self.name}: Linear/Conv weights are stored in "
                f"{', '.join(sorted(_name(d) for d in weights))}, expected {_name(self.param_dtype)}"
            )
        master_dtypes = {t.dtype for t in master}
        if self.master_weights and master_dtypes != {torch.float32}:
            raise PrecisionMismatch(f"precision={self.name}: master weights are not fp32")
        kind = "fp32" if self.master_weights else "remainder" if self.update == "remainder" else "none"
        dtypes: dict[str, str | int] = {
            "precision/compute_dtype": _name(expected),
            "precision/param_dtype": _name(self.param_dtype),
            "precision/master_dtype": "float32" if kind != "none" or not self.is_pure else "none",
            "precision/master": kind,  # remainder: exact fp32 masters rebuilt from bf16 + int16
        }
        return dtypes | self.check_layers(model)

    def check_layers(self, model: nn.Module) -> dict[str, str | int]:
        """Each Linear layer still computes in its planned format at the first step (nothing swapped
        it back or wrapped it away); the counts per format, `precision/layers/<format>`, and what
        computes them, `precision/kernel`: emulated (QuantizedLinear) or torchao (Float8Linear)."""
        kernel = CONVERTERS[self.config.kernel].reports_as
        counts: dict[str, str | int] = {"precision/kernel": kernel} if self.layers or self.attention else {}
        for kind, plan in (("layers", self.layers), ("attention", self.attention)):
            for name, planned in plan.items():
                found = layer_format(model.get_submodule(name))
                if found != planned:
                    mismatch = f"layer {name} computes in {found}, expected {planned}"
                    raise PrecisionMismatch(f"precision={self.name}: {mismatch}")
                key = f"precision/{kind}/{planned}"
                counts[key] = int(counts.get(key, 0)) + 1
        return counts


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _inputs_to_fp32(module: nn.Module, args: tuple) -> tuple:
    return tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def _output_to(dtype: torch.dtype):
    def hook(module: nn.Module, args: tuple, output):
        return output.to(dtype) if torch.is_tensor(output) else output

    return hook


@contextlib.contextmanager
def observe_compute_dtypes(model: nn.Module) -> Iterator[set[torch.dtype]]:
    """Collect the output dtypes of every Linear/Conv layer that runs inside the block."""
    seen: set[torch.dtype] = set()
    handles = [
        m.register_forward_hook(lambda mod, args, out: seen.add(out.dtype))
        for m in model.modules()
        if isinstance(m, COMPUTE_TYPES)
    ]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()
