"""The config: schemas (schema.py), the rules that span keys (rules.py), validation, the typed form
the code reads (typed.py) and the saved tree loggers and checkpoints keep (saved.py)."""

from halfprec.config.rules import config_warnings, resolve_device
from halfprec.config.saved import changes, from_saved, saved
from halfprec.config.schema import Config
from halfprec.config.typed import as_config, checked, compose, fail_fast_of
from halfprec.config.validate import validate, validate_optimizer

__all__ = [
    "Config",
    "as_config",
    "changes",
    "checked",
    "compose",
    "config_warnings",
    "fail_fast_of",
    "from_saved",
    "resolve_device",
    "saved",
    "validate",
    "validate_optimizer",
]
