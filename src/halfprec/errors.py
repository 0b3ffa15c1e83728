"""The errors a user sees (halfprec.launch.exits maps each to an exit code and one line). Kept free of
torch, so that `python train.py --help` and a config error answer without importing it.

Each error pickles with its message: launchers that run jobs in other processes (submitit, joblib)
send a job's exception back to the sweep, which must print the same line and exit code.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf


def show_value(value: Any) -> str:
    """A config value as the user would write it on the command line."""
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str) and reads_as_other_type(value):
        return f'"{value}"'  # accum="4" is a string: shown as 4, the line would contradict itself
    return str(value)


def reads_as_other_type(text: str) -> bool:
    """Whether a string, written unquoted on the command line, would be read as a number, a bool or null."""
    if text.strip().lower() in ("true", "false", "null"):
        return True
    try:
        float(text)
    except ValueError:
        return False
    return True


class ConfigError(ValueError):
    """A config value that cannot work. `str()` is the one line shown to the user."""

    def __init__(self, key: str, value: Any, fix: str):
        self.key, self.value, self.fix = key, value, fix
        super().__init__(f"{key}={show_value(value)}: {fix}")

    def __reduce__(self) -> tuple:
        return type(self), (self.key, self.value, self.fix)


class InitError(ValueError):
    """The init scheme cannot be applied to this model."""


class TrainingAborted(RuntimeError):
    """Training cannot usefully continue; the message says why and what to try."""

    culprit: str | None = None  # set by the optimizer step: where the non-finite gradients start


class PrecisionMismatch(RuntimeError):
    """The model did not compute, or store its weights, in the dtype the config asked for."""


class Preempted(Exception):
    """A stop signal (SIGTERM, SIGUSR1, the first Ctrl-C) arrived and a checkpoint was saved.
    The message says how to resume."""


class Interrupted(KeyboardInterrupt):
    """A second Ctrl-C quit the run at once. The message says what is on disk and how to go on."""


def naming(err: BaseException, path: Any) -> BaseException:
    """A failed write as the OSError a user reads (halfprec.launch.exits prints one line and exits 6):
    with the path it was writing, which an OSError from write() or close() lacks, and found under
    torch.save's RuntimeError, which wraps it. Anything that is no OSError is returned as it was."""
    found = err if isinstance(err, OSError) else err.__context__
    if not isinstance(found, OSError) or found.errno is None:
        return err
    if found.filename is not None:
        return found
    return OSError(found.errno, found.strerror, str(path))
