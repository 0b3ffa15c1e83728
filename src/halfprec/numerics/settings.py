"""What numerics reads of precision.*: the Protocols config/schema.py's Precision, QuantRule and Phase
satisfy (numerics imports no config; mypy checks each call that hands one over), and `high`.
Imports no torch: config/rules.py spells `high` with it before torch is loaded."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from halfprec.numerics.attention import AttentionRecipe
    from halfprec.numerics.quantized import Recipe

HIGH = "high"  # not quantized: a layer, or one of its GEMMs, computes in the run's autocast or parameter dtype


class RuleSettings(Protocol):
    """One of precision.rules: the first whose glob matches a layer's name gives its format (and, where
    it names one, how its GEMMs sum)."""

    @property
    def match(self) -> str: ...
    @property
    def format(self) -> str: ...  # a format of numerics/formats, or high
    # how its layers' GEMMs sum: a preset of numerics/accumulate.py; None = precision.accumulate
    @property
    def accumulate(self) -> str | None: ...


class PhaseSettings(Protocol):
    """One of precision.schedule (numerics/schedule.py)."""

    @property
    def format(self) -> str: ...
    @property
    def gemms(self) -> Sequence[str]: ...
    @property
    def match(self) -> str | None: ...
    @property
    def when(self) -> str | None: ...  # a trigger of schedule.TRIGGERS
    def start(self, max_steps: int) -> int | None: ...  # None: a trigger's, when it fires


class PrecisionSettings(Protocol):
    """precision.*, read-only. The keys a single converter reads are its own: numerics/converters/
    emulated.py reads `quantizer`, torchao_float8.py `fp8_emulate`; the others are the policy's and
    the plan's."""

    @property
    def name(self) -> str: ...
    @property
    def autocast(self) -> str | None: ...
    @property
    def param_dtype(self) -> str: ...
    @property
    def master_weights(self) -> bool: ...
    @property
    def master(self) -> str | None: ...
    @property
    def update(self) -> str: ...
    @property
    def keep_norm_fp32(self) -> bool: ...
    @property
    def tf32(self) -> bool: ...
    @property
    def reduce_dtype(self) -> str: ...
    @property
    def format(self) -> str | None: ...
    @property
    def recipe(self) -> Recipe: ...
    @property
    def rules(self) -> Sequence[RuleSettings]: ...
    @property
    def high_first(self) -> int: ...
    @property
    def high_last(self) -> int: ...
    @property
    def schedule(self) -> Sequence[PhaseSettings]: ...
    @property
    def kernel(self) -> str: ...
    @property
    def quantizer(self) -> str: ...
    @property
    def fp8_emulate(self) -> bool: ...
    @property
    def eval(self) -> Sequence[str]: ...  # evaluation precisions: high or formats (numerics/evaluation.py)
    # precision.accumulate: how the quantized layers' tensor cores sum (numerics/accumulate.py)
    @property
    def accumulate(self) -> str: ...
    @property
    def attention(self) -> AttentionRecipe: ...
