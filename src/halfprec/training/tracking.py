"""The tracker: every metric row to metrics.jsonl and to each logger the config turns on
(halfprec/loggers), with the run's name, sweep group, tags and redacted config."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from halfprec.config import Config, saved
from halfprec.loggers import LOGGERS, LoggerUnavailable, RunInfo, one_line
from halfprec.loggers.jsonl import JsonlSink


class Tracker:
    """Fans rows out to the loggers. A logger that fails (W&B down, disk full under wandb/) is
    dropped with a warning; metrics.jsonl failing is a real error, since then nothing would be kept."""

    def __init__(self, sinks: list, names: list[str] | None = None):
        self.sinks = sinks
        self.names = names or [type(s).__name__ for s in sinks]  # each sink's option name (logger=...)

    def _guarded(self, method: str, arg: dict) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, method)(arg)
            except Exception as err:  # any logger failure but metrics.jsonl's must not stop training
                if isinstance(sink, JsonlSink):
                    raise
                if isinstance(err, LoggerUnavailable):
                    warn(str(err))
                else:
                    warn(f"{type(sink).__name__}.{method} failed ({type(err).__name__}: {err}); continuing without it")
                i = self.sinks.index(sink)
                del self.sinks[i], self.names[i]
                try:
                    sink.abandon()
                except Exception:  # it failed once already (a full disk, a store gone): best effort
                    pass

    def state(self) -> dict[str, dict]:
        """Each logger's own state (W&B's run id, MLflow's), for checkpoints: a resume continues them."""
        return {name: sink.state() for sink, name in zip(self.sinks, self.names) if not isinstance(sink, JsonlSink)}

    def log(self, row: dict[str, Any]) -> None:
        self._guarded("log", row)

    def finish(self, summary: dict[str, Any]) -> None:
        self._guarded("finish", summary)


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def run_identity(run_dir: Path) -> tuple[str, str | None, list[str]]:
    """Loggers' run name, group and tags from Hydra: named by the job's overrides, grouped by the
    sweep (a multirun's dir, or the W&B sweep whose agent started this run), tagged with every chosen
    group option (`precision:bf16`)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
    except ValueError:  # run() called outside Hydra (tests, notebooks)
        return run_dir.name, None, []
    name, group = hc.job.override_dirname or "defaults", None
    if hc.mode == RunMode.MULTIRUN:
        sweep = Path(hc.sweep.dir)
        group = f"{sweep.parent.name}_{sweep.name}"  # e.g. 2026-12-02_14-40-00.123456
        name = f"{hc.job.num}_{name}"
    elif os.environ.get("WANDB_SWEEP_ID"):  # `wandb agent` starts each run of its sweep as a single Hydra run
        group = os.environ["WANDB_SWEEP_ID"]
    tags = [f"{k}:{v}" for k, v in sorted(hc.runtime.choices.items()) if v and not k.startswith("hydra")]
    return name, group, tags


def build_tracker(
    cfg: Config, run_dir: Path, resume_step: int | None = None, states: dict[str, dict] | None = None
) -> Tracker:
    """metrics.jsonl always, and each logger of `cfg.logger`; on resume, continue them from
    `resume_step` with the state each kept in the checkpoint (`states`)."""
    sinks: list = [JsonlSink(run_dir / "metrics.jsonl", resume_step)]
    names = ["jsonl"]
    if cfg.logger:
        name, group, tags = run_identity(run_dir)
        config = saved(cfg)
    for option, options in (cfg.logger or {}).items():
        info = RunInfo(run_dir, name, group, tags, config, resume_step, dict((states or {}).get(option) or {}))
        try:
            sinks.append(LOGGERS[option].cls(info, **options))
            names.append(option)
        except LoggerUnavailable as err:
            warn(str(err))
        except Exception as err:  # no account, no network, broken install: train anyway
            title = LOGGERS[option].title
            warn(f"{title} could not start ({type(err).__name__}: {one_line(err)}); metrics go to metrics.jsonl only")
    return Tracker(sinks, names)
