"""Loggers: where metric rows go besides metrics.jsonl (always written, jsonl.py).

`logger=[wandb,tensorboard]` turns on several; each option is a class registered here with
`@register_logger("name")`, whose keyword arguments are the keys of `conf/logger/<name>.yaml`
(checked against their annotations, like a model's). A new logger is one file in this package and
its YAML. Every logger is told the same things (RunInfo): the run's dir, name, sweep group, tags
and resolved config, and on resume the step it continues from and the state it kept in the
checkpoint. The packages behind them (wandb, tensorboard, mlflow) are imported when a run starts
one, never here: a config error answers without them.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


@dataclass
class Histogram:
    """A histogram in a metric row (diagnostics): drawn by W&B and TensorBoard, left out of the files."""

    counts: list[int]
    edges: list[float]  # len(counts) + 1 bin edges


@dataclass
class RunInfo:
    """What every logger is told about the run it logs."""

    dir: Path  # the run dir
    name: str  # from the job's overrides (`precision=bf16,seed=1`), or the run dir's name
    group: str | None  # the multirun sweep the run belongs to; None for a single run
    tags: list[str]  # every chosen group option, `precision:bf16`
    config: dict  # the resolved config, secrets redacted
    resume_step: int | None = None  # a resumed run: the checkpoint's step (rows after it are logged again)
    state: dict = field(default_factory=dict)  # a resumed run: what this logger's state() returned


class Logger(Protocol):
    """A metric sink. A failure in any method drops the logger with a warning; training goes on."""

    def log(self, row: dict[str, Any]) -> None: ...  # one metric row: `step` and its values

    def finish(self, summary: dict[str, Any]) -> None: ...  # the end: summary.json's contents

    def abandon(self) -> None: ...  # after a failure: close what can be closed, never wait

    def state(self) -> dict[str, Any]: ...  # kept in checkpoints, handed back on resume


class LoggerUnavailable(Exception):
    """A logger that could not start; its message is the whole warning."""


@dataclass(frozen=True)
class LoggerEntry:
    cls: type
    title: str  # its name in messages: W&B, TensorBoard
    package: str  # the module it needs
    install: str  # the pip command that installs it


LOGGERS: dict[str, LoggerEntry] = {}


def register_logger(name: str, title: str, package: str, install: str):
    """Register a logger class as the option `logger=<name>`; `package` is what it imports."""

    def add(cls: type) -> type:
        LOGGERS[name] = LoggerEntry(cls, title, package, install)
        return cls

    return add


def one_line(err: BaseException) -> str:
    """An error's first line: wandb's CommError goes on with advice over two more."""
    return (str(err).strip().splitlines() or [""])[0]


# Registration happens on import, as for models: a new logger is one file here and its YAML.
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
