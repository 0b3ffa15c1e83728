"""Metric sinks: metrics.jsonl in the run dir (always) and a W&B run (when the logger is on)."""

from __future__ import annotations

import json
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf


@dataclass
class Histogram:
    """A histogram in a metric row (diagnostics): drawn by W&B, left out of metrics.jsonl."""

    counts: list[int]
    edges: list[float]  # len(counts) + 1 bin edges


class JsonlSink:
    """One JSON object per line, flushed per row so a crash loses nothing already logged."""

    def __init__(self, path: Path, resume_step: int | None = None):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        if resume_step is not None and path.exists():
            # rows logged after the checkpoint (before a kill) are logged again by the resumed run;
            # a kill mid-write can leave a torn last line, which is dropped too
            kept = [line for line in path.read_text().splitlines() if _row_step(line) <= resume_step]
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            tmp.replace(path)
        self._file = open(path, "a", encoding="utf-8")

    def log(self, row: dict[str, Any]) -> None:
        # strict JSON (jq, JavaScript): a non-finite number is written as null
        clean = {
            k: None if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in row.items()
            if not isinstance(v, Histogram)
        }
        self._file.write(json.dumps(clean, allow_nan=False) + "\n")
        self._file.flush()

    def finish(self, summary: dict[str, Any]) -> None:
        self._file.close()


SECRET_KEY = re.compile(r"(api_?key|token|secret|password)", re.IGNORECASE)


def redact(tree: Any) -> Any:
    """The config as saved to W&B and checkpoints: values under secret-looking keys, and any value
    equal to $WANDB_API_KEY (e.g. interpolated by ${oc.env:...}), become '***'."""
    key = os.environ.get("WANDB_API_KEY")
    if isinstance(tree, dict):
        return {k: "***" if SECRET_KEY.search(str(k)) else redact(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [redact(v) for v in tree]
    return "***" if key and isinstance(tree, str) and key in tree else tree


def saved_config(cfg: DictConfig) -> dict:
    """The resolved config as it is written to W&B and into checkpoints: redacted."""
    return redact(OmegaConf.to_container(cfg, resolve=True))


def _row_step(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")


class WandbSink:
    """A W&B run under `<run dir>/wandb/`, carrying the resolved config, finished exactly once."""

    def __init__(
        self, cfg: DictConfig, run_dir: Path, name: str, group: str | None, tags: list[str], run_id: str | None
    ):
        import wandb  # only when the logger is on

        self.run = wandb.init(
            id=run_id,
            resume="allow" if run_id else None,
            reinit="finish_previous",  # one run per multirun job, even after a job that failed
            project=cfg.logger.project,
            entity=cfg.logger.entity,
            mode=cfg.logger.mode,
            dir=str(run_dir),
            name=name,
            group=group,
            job_type=cfg.logger.job_type,
            tags=[*tags, *cfg.logger.tags],
            config=saved_config(cfg),
            settings=wandb.Settings(console="off", x_disable_stats=True, quiet=True),
        )
        # `step` is the x-axis of every chart. Logging it as a metric (rather than log(step=))
        # commits each row at once, so the summary written at the end is the last word.
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, row: dict[str, Any]) -> None:
        import wandb

        self.run.log(
            {
                # wandb annotates np_histogram as two ndarrays; it takes lists too (it calls .tolist() if there)
                k: wandb.Histogram(np_histogram=(v.counts, v.edges)) if isinstance(v, Histogram) else v  # type: ignore[arg-type]
                for k, v in row.items()
            }
        )

    def abandon(self) -> None:
        """Close a run that failed, so that the next wandb.init in this process starts afresh."""
        try:
            self.run.finish(exit_code=1)
        except Exception:  # it already failed once; this is best effort
            pass

    def finish(self, summary: dict[str, Any]) -> None:
        stopped = summary.get("status") == "stopped"  # a stop signal after a checkpoint: resumable, not failed
        if stopped:
            self.run.mark_preempting()
        self.run.summary.update(summary)
        self.run.finish(exit_code=0 if stopped else summary.get("exit_code", 0))


class Tracker:
    """Fans rows out to the sinks. A sink that fails (W&B down, disk full under wandb/) is dropped
    with a warning; metrics.jsonl failing is a real error, since then nothing would be kept."""

    def __init__(self, sinks: list):
        self.sinks = sinks

    def _guarded(self, method: str, arg: dict) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, method)(arg)
            except Exception as err:  # any logger failure but metrics.jsonl's must not stop training
                if isinstance(sink, JsonlSink):
                    raise
                warn(f"{type(sink).__name__}.{method} failed ({type(err).__name__}: {err}); continuing without it")
                self.sinks.remove(sink)
                sink.abandon()

    @property
    def wandb_id(self) -> str | None:
        return next((s.run.id for s in self.sinks if isinstance(s, WandbSink)), None)

    def log(self, row: dict[str, Any]) -> None:
        self._guarded("log", row)

    def finish(self, summary: dict[str, Any]) -> None:
        self._guarded("finish", summary)


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def run_identity(cfg: DictConfig, run_dir: Path) -> tuple[str, str | None, list[str]]:
    """W&B name, group and tags from Hydra: named by the job's overrides, grouped by the sweep
    (`logger.group` overrides), tagged with every chosen group option (`precision:bf16`)."""
    group = cfg.logger.get("group")
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
    except ValueError:  # run() called outside Hydra (tests, notebooks)
        return run_dir.name, group, []
    name = hc.job.override_dirname or "defaults"
    if hc.mode == RunMode.MULTIRUN:
        sweep = Path(hc.sweep.dir)
        group = group or f"{sweep.parent.name}_{sweep.name}"  # e.g. 2026-12-02_14-40-00.123456
        name = f"{hc.job.num}_{name}"
    tags = [f"{k}:{v}" for k, v in sorted(hc.runtime.choices.items()) if v and not k.startswith("hydra")]
    return name, group, tags


def build_tracker(
    cfg: DictConfig, run_dir: Path, resume_step: int | None = None, wandb_id: str | None = None
) -> Tracker:
    """metrics.jsonl always, W&B when on; on resume, continue both from `resume_step`."""
    sinks: list = [JsonlSink(run_dir / "metrics.jsonl", resume_step)]
    if cfg.logger.kind == "wandb":
        name, group, tags = run_identity(cfg, run_dir)
        try:
            sinks.append(WandbSink(cfg, run_dir, name, group, tags, wandb_id))
        except Exception as err:  # no account, no network, broken install: train anyway
            warn(f"W&B could not start ({type(err).__name__}: {err}); metrics go to metrics.jsonl only")
    return Tracker(sinks)
