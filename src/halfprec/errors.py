"""The errors a user sees (train.py maps each to an exit code). Kept free of torch, so that
`python train.py --help` and a config error answer without importing it."""

from __future__ import annotations


class InitError(ValueError):
    """The init scheme cannot be applied to this model."""


class TrainingAborted(RuntimeError):
    """Training cannot usefully continue; the message says why and what to try."""

    culprit: str | None = None  # set by the optimizer step: where the non-finite gradients start


class PrecisionMismatch(RuntimeError):
    """The model did not compute, or store its weights, in the dtype the config asked for."""


class Preempted(Exception):
    """A stop signal (SIGTERM, SIGUSR1) arrived; a checkpoint was saved. The message says how to resume."""
