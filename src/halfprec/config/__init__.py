"""The composed config: schemas (schema.py), the rules that span keys (rules.py), validation."""

from halfprec.config.rules import config_warnings, resolve_device
from halfprec.config.validate import validate, validate_optimizer

__all__ = ["config_warnings", "resolve_device", "validate", "validate_optimizer"]
