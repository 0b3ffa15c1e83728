"""The composed config: schemas (schema.py), the rules that span keys (rules.py), validation."""

from halfprec.config.rules import resolve_device, warnings
from halfprec.config.validate import validate, validate_optimizer

__all__ = ["resolve_device", "validate", "validate_optimizer", "warnings"]
