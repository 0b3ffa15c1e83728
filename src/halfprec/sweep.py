"""Hydra callback: one line per finished multirun job in `<sweep dir>/sweep.jsonl`."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

RECORDED = ("train/loss", "val/loss", "val/acc", "scaler/skipped_steps", "scaler/min_scale", "scaler/final_scale")


class SweepRecord(Callback):
    """Records overrides, final metrics, skipped steps, status and wall time of every job.

    Written with one O_APPEND write per line, so jobs finishing at once (parallel launchers)
    do not interleave. A failed job gets a line too, with its error; with `fail_fast=true` in the
    job's config the sweep then stops (exit 1) instead of going on with the other jobs.
    """

    def __init__(self) -> None:
        self._started: dict[int, float] = {}

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._started[os.getpid()] = time.time()

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        hydra = config.hydra
        if hydra.mode is None or hydra.mode.name != "MULTIRUN":
            return
        run_dir = Path(hydra.runtime.output_dir)
        summary_file = run_dir / "summary.json"
        summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
        line = {
            "job": hydra.job.num,
            "overrides": list(hydra.overrides.task),
            "status": "completed" if job_return.status == JobStatus.COMPLETED else "failed",
            "wall_s": round(time.time() - self._started.pop(os.getpid(), time.time()), 3),
            "dir": str(run_dir),
            **{k: summary.get(k) for k in RECORDED},
        }
        if job_return.status != JobStatus.COMPLETED:
            err = job_return._return_value  # Hydra keeps the job's exception there
            line["error"] = f"{type(err).__name__}: {err}"
        path = Path(hydra.sweep.dir) / "sweep.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, (json.dumps(line) + "\n").encode())
        finally:
            os.close(fd)
        if "error" in line and config.get("fail_fast"):
            # SystemExit, not an exception: Hydra logs and swallows callback exceptions
            raise SystemExit(f"fail_fast=true: job {line['job']} failed ({line['error']}); the sweep stops here")
