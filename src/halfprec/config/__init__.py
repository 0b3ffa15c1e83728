"""The composed config: schemas (schema.py), the rules that span keys (rules.py), validation."""

from halfprec.config.rules import config_warnings, resolve_device
from halfprec.config.schema import Config
from halfprec.config.typed import as_config, fail_fast_of, objective_of, saved
from halfprec.config.validate import validate, validate_optimizer

__all__ = [
    "Config",
    "as_config",
    "config_warnings",
    "fail_fast_of",
    "objective_of",
    "resolve_device",
    "saved",
    "validate",
    "validate_optimizer",
]
