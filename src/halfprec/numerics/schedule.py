"""Precision schedules (precision.schedule, docs/design.md "Number formats"): phases that, from a
step on, give some GEMMs of some layers another format or high.

    precision.schedule=[{from_fraction: 0.9, gemms: [forward], format: high}]

Phases begin in the order listed, each at its step (from_step, or from_fraction of
trainer.max_steps: 0.9 of 400 steps begins at step 361), or for a trigger (`when`) at the step after
a diagnostics step on which its condition held, and never before the phase listed before it. Each
applies on top of the ones begun before it: the formats at a step are the recipe's, then every begun
phase's in order. A phase's layers are those its `match` glob names, else those precision.format
and the rules quantize; every layer some phase quantizes is a QuantizedLinear from the start (its
GEMMs high until then). Quantized attention cores (precision.attention) are such layers too: a
phase's `forward` is attention's forward GEMMs, `dgrad` or `wgrad` its backward ones. The steps
phases began are the schedule's state, kept in checkpoints: a resumed run has the formats, and logs
the switches, of an unbroken one.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from torch import nn

from halfprec.errors import ConfigError
from halfprec.numerics.attention import ATTENTION_GEMMS, AttentionRecipe, QuantizedAttention, attention_label
from halfprec.numerics.quantized import GEMMS, QuantizedLinear, Recipe, gemm_label
from halfprec.numerics.settings import HIGH, PhaseSettings

# a trigger: the diagnostics row's key it reads, and the value below which the phase begins. The
# gradient-to-noise ratio of "FP4 All the Way" (Chmiel et al. 2025, section 4): quantized training
# stops helping once the weight gradient's norm is below about sqrt(3) times its quantization noise's.
TRIGGERS = {"grad_noise_below_sqrt3": ("diag/grad_noise", math.sqrt(3))}


@dataclass
class PrecisionSchedule:
    """The phases over a plan's layers: `base`, each converted layer's GEMM formats before any phase;
    `targets`, the layers each phase changes."""

    phases: Sequence[PhaseSettings]
    base: dict[str, dict[str, str]]
    targets: list[list[str]]
    max_steps: int
    began: list[int] = field(default_factory=list)  # the step each begun phase began, in order

    def start(self, i: int) -> int | None:
        """The step phase `i` is set to begin at (None: a trigger's, when it fires)."""
        return self.phases[i].start(self.max_steps)

    def phase_at(self, step: int) -> int:
        """How many phases have begun by `step` (0: the recipe's formats)."""
        return sum(1 for began in self.began if began <= step)

    def gemms_at(self, phase: int) -> dict[str, dict[str, str]]:
        """Each converted layer's GEMM formats once `phase` phases have begun."""
        gemms = {name: dict(formats) for name, formats in self.base.items()}
        for spec, names in zip(self.phases[:phase], self.targets):
            for name in names:
                gemms[name].update(dict.fromkeys(own_gemms(spec.gemms, gemms[name]), spec.format))
        return gemms

    def labels(self, phase: int) -> dict[str, str]:
        """Each converted layer's formats in one word (quantized.gemm_label, attention_label), as the
        logs show them."""
        return {name: label(formats) for name, formats in self.gemms_at(phase).items()}

    def advance(self, step: int) -> bool:
        """Begin the phases set to begin by `step` (a trigger's begins when it fires: fire); True when
        the formats at `step` differ from the step before's."""
        while len(self.began) < len(self.phases):
            start = self.start(len(self.began))
            if start is None or start > step:
                break
            self.began.append(step)
        return step in self.began

    def pending_trigger(self) -> tuple[str, float] | None:
        """The (key, threshold) the next phase waits for, if it is a trigger's and none is set."""
        if len(self.began) == len(self.phases) or self.start(len(self.began)) is not None:
            return None
        when = self.phases[len(self.began)].when
        return TRIGGERS[when] if when is not None else None

    def fire(self, step: int) -> None:
        """The trigger the next phase waits for held at `step`: it begins at the step after."""
        self.began.append(step + 1)

    def apply(self, model: nn.Module, phase: int) -> None:
        """Set each converted layer's GEMMs to their formats once `phase` phases have begun."""
        for name, formats in self.gemms_at(phase).items():
            layer = model.get_submodule(name)
            assert isinstance(layer, (QuantizedLinear, QuantizedAttention))
            layer.gemms = formats

    def describe(self, i: int) -> str:
        """Phase `i` in words, for the line a run prints as it begins."""
        spec, names = self.phases[i], self.targets[i]
        when = f"trigger {spec.when}" if spec.when else f"from step {self.start(i)}"
        return f"precision phase {i + 1} ({when}): {', '.join(spec.gemms)} -> {spec.format} on {len(names)} layers"

    def lines(self) -> list[str]:
        """The phases, as the start of a run lists them (those begun with their step)."""
        began = [f" (began at step {self.began[i]})" if i < len(self.began) else "" for i in range(len(self.phases))]
        return [f"{'schedule:':10}{self.describe(i)}{began[i]}" for i in range(len(self.phases))]

    def state_dict(self) -> dict:
        return {"began": list(self.began)}

    def load_state_dict(self, state: dict) -> None:
        self.began = [int(step) for step in state["began"]]


def own_gemms(gemms: Sequence[str], formats: dict[str, str]) -> list[str]:
    """A phase's GEMMs (a Linear layer's) as a layer with `formats` names them: an attention core's
    forward for the forward, its backward for dgrad or wgrad."""
    if "backward" not in formats:
        return list(gemms)
    return list(dict.fromkeys("forward" if g == "forward" else "backward" for g in gemms))


def label(formats: dict[str, str]) -> str:
    return attention_label(formats) if "backward" in formats else gemm_label(formats)


def conversion_plan(plan: dict[str, str], phases: Sequence[PhaseSettings]) -> tuple[dict[str, str], list[list[str]]]:
    """The layers to convert (the plan's quantized ones, and those a phase gives a format, in the
    first such phase's format) and each phase's layers."""
    quantized = [name for name, fmt in plan.items() if fmt != HIGH]
    converted = dict(plan)
    targets = []
    for i, phase in enumerate(phases):
        names = [n for n in plan if fnmatchcase(n, phase.match)] if phase.match else quantized
        if not names:
            what = f"matches no Linear layer; they are {', '.join(list(plan)[:8])}" if phase.match else (
                "has no layers: precision.format quantizes none; name them with a match glob")  # fmt: skip
            raise ConfigError(f"precision.schedule[{i}].match", phase.match, what)
        for name in names:
            if converted[name] == HIGH and phase.format != HIGH:
                converted[name] = phase.format
        targets.append(names)
    # a layer no phase quantizes stays a plain Linear, high throughout: a phase of such layers alone does nothing
    targets = [[n for n in names if converted[n] != HIGH] for names in targets]
    for i, names in enumerate(targets):
        if not names:
            raise ConfigError(f"precision.schedule[{i}].match", phases[i].match, "names only layers that are high "
                              "throughout: the phase would change nothing")  # fmt: skip
    return converted, targets


def build_schedule(plan: dict[str, str], phases: Sequence[PhaseSettings], recipe: Recipe, max_steps: int,
                   attention: AttentionRecipe | None = None,
                   cores: Collection[str] = ()) -> tuple[dict[str, str], PrecisionSchedule]:  # fmt: skip
    """The layers to convert and the schedule over them, from `plan` (numerics/layers.py's): a layer
    the plan keeps high has every GEMM high until a phase says otherwise. `cores`: the plan's
    attention cores, whose GEMMs `attention` (precision.attention) gives."""
    converted, targets = conversion_plan(plan, phases)
    base = {}
    for name, fmt in converted.items():
        if fmt == HIGH:
            continue
        core = name in cores and attention is not None
        if plan[name] == HIGH:
            base[name] = dict.fromkeys(ATTENTION_GEMMS if core else GEMMS, HIGH)
        else:
            base[name] = attention.gemms(plan[name]) if core and attention else recipe.gemms(plan[name])
    return converted, PrecisionSchedule(phases, base, targets, max_steps)
