"""Loss scalers: none, static and dynamic (with hysteresis, a floor and a skip-storm stop).

The scale is a host-side float. The optimizer step already needs one host sync to decide
whether to skip, so keeping the state machine on the host costs nothing extra and makes it
readable, checkpointable and exactly testable. We do not wrap torch.amp.GradScaler because it
refuses fp16 gradients (pure fp16), has no hysteresis or floor, and exposes skips only through
private state.

Each scaler is a class registered under its `kind` (`@register_scaler`, the option `scaler.kind`);
its constructor's annotated arguments are the keys of conf/scaler/ (config/validate.py checks them,
scripts/config_reference.py documents them). Torch-free, so that a bad scaler key answers without it.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Annotated

from halfprec.errors import TrainingAborted
from halfprec.spec import Choice, Spec

if TYPE_CHECKING:
    import torch

DIVERGING = (
    "the run is diverging, not overflowing: lower optim.lr, set optim.clip_grad_norm, try init=fixup or precision=bf16"
)
WINDOW = 100  # the optimizer steps scaler/overflow_rate and max_overflow_rate count over

# every scaler's stops
MaxConsecutiveSkips = Annotated[int | None, Spec(low=1, doc="skipped steps in a row that stop the run; null = never")]
MaxOverflowRate = Annotated[
    float | None,
    Spec(above=0, high=1, doc=f"share of the last {WINDOW} steps skipped that stops the run; null = never"),
]

# scaler.kind -> its class
SCALERS: dict[str, type[LossScaler]] = {}


def register_scaler(cls: type[LossScaler]) -> type[LossScaler]:
    SCALERS[cls.kind] = cls
    return cls


@register_scaler
class LossScaler:
    """No scaling (scale 1). Still counts non-finite steps, which are skipped."""

    kind = "none"

    def __init__(self, max_consecutive_skips: MaxConsecutiveSkips = None, max_overflow_rate: MaxOverflowRate = None):
        self.scale = 1.0
        self.max_consecutive_skips = max_consecutive_skips
        self.max_overflow_rate = max_overflow_rate
        self.steps = 0
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.growths = 0
        self.backoffs = 0
        self.min_seen = self.scale
        self.max_seen = self.scale
        self.recent: deque[int] = deque(maxlen=WINDOW)  # 1 per overflowed step, for scaler/overflow_rate
        # (step, scale after the update, overflowed): for crash reports
        self.history: deque[tuple[int, float, bool]] = deque(maxlen=12)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scale == 1.0 else loss * self.scale

    def update(self, found_inf: bool) -> None:
        """Call exactly once per optimizer step, after the step was taken or skipped."""
        self.steps += 1
        self.recent.append(int(found_inf))
        if found_inf:
            self.skipped_steps += 1
            self.consecutive_skips += 1
        else:
            self.consecutive_skips = 0
        self._update_scale(found_inf)
        self.min_seen = min(self.min_seen, self.scale)
        self.max_seen = max(self.max_seen, self.scale)
        self.history.append((self.steps, self.scale, found_inf))
        limit = self.max_consecutive_skips
        if limit is not None and self.consecutive_skips >= limit:
            raise TrainingAborted(
                f"{self.consecutive_skips} optimizer steps in a row had inf/NaN gradients "
                f"(scaler.max_consecutive_skips={limit}, loss scale now {self.scale:g}); {DIVERGING}"
            )
        # Skips that come and go escape the limit above (a diverging run can skip 92 of 100 steps
        # with never 50 in a row). Counted against the whole window, so the limit is known to be
        # passed as soon as it is, and the few back-offs of a fresh dynamic scale never reach it.
        rate, window = self.max_overflow_rate, self.recent.maxlen
        assert window is not None  # `recent` is always made with a maxlen
        if rate is not None and sum(self.recent) > rate * window:
            raise TrainingAborted(
                f"{sum(self.recent)} of the last {window} optimizer steps had inf/NaN gradients "
                f"(scaler.max_overflow_rate={rate:g}, loss scale now {self.scale:g}); {DIVERGING}"
            )

    def _update_scale(self, found_inf: bool) -> None:
        pass

    def history_tail(self) -> str:
        return ", ".join(f"{s}:{scale:g}{'!' if inf else ''}" for s, scale, inf in self.history)

    @property
    def overflow_rate(self) -> float:
        return sum(self.recent) / len(self.recent) if self.recent else 0.0

    def metrics(self) -> dict:
        return {
            "scaler/scale": self.scale,
            "scaler/skipped_steps": self.skipped_steps,
            "scaler/growths": self.growths,
            "scaler/backoffs": self.backoffs,
            "scaler/overflow_rate": self.overflow_rate,
        }

    # What changes while training; the settings (init_scale, growth_interval, ...) come from the config.
    STATE: tuple[str, ...] = (
        "scale",
        "steps",
        "skipped_steps",
        "consecutive_skips",
        "growths",
        "backoffs",
        "min_seen",
        "max_seen",
    )

    def state_dict(self) -> dict:
        state = {k: getattr(self, k) for k in self.STATE}
        state["recent"] = list(self.recent)
        return state

    def load_state_dict(self, state: dict) -> None:
        for k in self.STATE:
            setattr(self, k, state[k])
        self.recent = deque(state["recent"], maxlen=self.recent.maxlen)


@register_scaler
class StaticLossScaler(LossScaler):
    """A fixed scale: overflowed steps are skipped and counted, the scale never moves."""

    kind = "static"

    def __init__(
        self,
        scale: Annotated[float, Spec(above=0, doc="the fixed loss scale, e.g. 128")] = 128.0,
        max_consecutive_skips: MaxConsecutiveSkips = None,
        max_overflow_rate: MaxOverflowRate = None,
    ):
        super().__init__(max_consecutive_skips, max_overflow_rate)
        self.scale = self.min_seen = self.max_seen = float(scale)


@register_scaler
class DynamicLossScaler(LossScaler):
    """torch.amp.GradScaler's rule, plus hysteresis and a floor.

    On an overflow the scale is multiplied by `backoff_factor`, but only once `hysteresis`
    overflows have happened since the scale last grew; after that, every overflow backs off
    until the scale grows again, which refills the allowance (Megatron's and DeepSpeed's rule;
    hysteresis=1 is torch's behaviour). After
    `growth_interval` clean steps in a row the scale is multiplied by `growth_factor`.
    A back-off never takes the scale below `min_scale`; an overflow while the scale is already
    at that floor stops the run, since such gradients are non-finite, not just large.
    """

    kind = "dynamic"
    STATE = (*LossScaler.STATE, "growth_tracker", "hysteresis_left")

    def __init__(
        self,
        init_scale: Annotated[float, Spec(above=0, doc="the first loss scale, e.g. 65536")] = 2.0**16,
        growth_factor: Annotated[float, Spec(above=1, doc="e.g. 2")] = 2.0,
        backoff_factor: Annotated[float, Spec(above=0, below=1, doc="e.g. 0.5")] = 0.5,
        growth_interval: Annotated[int, Spec(low=1, doc="clean steps before the scale grows")] = 2000,
        hysteresis: Annotated[int, Spec(low=1, doc="overflows tolerated before backing off; 1 = torch's rule")] = 1,
        min_scale: Annotated[float | None, Spec(above=0, doc="the scale floor; null = none")] = None,
        max_consecutive_skips: MaxConsecutiveSkips = None,
        max_overflow_rate: MaxOverflowRate = None,
    ):
        super().__init__(max_consecutive_skips, max_overflow_rate)
        self.scale = self.min_seen = self.max_seen = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.min_scale = min_scale
        self.growth_tracker = 0
        self.hysteresis_left = hysteresis

    def _update_scale(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left > 0:
                return
            if self.min_scale is not None and self.scale <= self.min_scale:
                raise TrainingAborted(
                    f"the loss scale is at its floor (scaler.min_scale={self.min_scale:g}) and step "
                    f"{self.steps} still overflowed: the gradients are non-finite at any scale; "
                    "lower optim.lr, set optim.clip_grad_norm, try init=fixup or precision=bf16"
                )
            self.scale *= self.backoff_factor
            if self.min_scale is not None:
                self.scale = max(self.scale, self.min_scale)
            self.backoffs += 1
            if self.scale == 0.0:
                raise TrainingAborted(
                    "the loss scale underflowed to 0 (no scaler.min_scale set): every gradient would be zero; "
                    "set scaler.min_scale, lower optim.lr or try precision=bf16"
                )
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.scale *= self.growth_factor
                self.growth_tracker = 0
                self.hysteresis_left = self.hysteresis
                self.growths += 1


# `auto` takes dynamic's keys: dynamic for fp16 modes, else none, which keeps only the stops of them
# (a scale of 1 has nothing to grow)
SCALERS["auto"] = DynamicLossScaler
STOPS = ("max_consecutive_skips", "max_overflow_rate")


def build_scaler(scaler: Choice, uses_fp16: bool) -> LossScaler:
    """The scaler scaler.kind names, given the group's other keys (`auto`: see SCALERS)."""
    if scaler.name == "auto" and not uses_fp16:
        return LossScaler(**{key: value for key, value in scaler.args.items() if key in STOPS})
    return SCALERS[scaler.name](**scaler.args)
