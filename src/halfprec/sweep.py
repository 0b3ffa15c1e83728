"""Hydra callback: one line per finished multirun job in `<sweep dir>/sweep.jsonl`, the job's
failure as one line when it ends, and the sweep's end (see halfprec.exits)."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from halfprec.errors import Preempted, TrainingAborted
from halfprec.exits import SIGNAL, SWEEP_FAILED, SweepStopped, failure_line

RECORDED = ("train/loss", "val/loss", "val/acc", "scaler/skipped_steps", "scaler/min_scale", "scaler/final_scale")
STATUSES = ("completed", "failed", "diverged", "stopped")  # in the order the end-of-sweep line counts them

_sweep_dir: Path | None = None  # the multirun this process launched (set in the launching process only)


def job_status(err: BaseException | None) -> str:
    """completed; stopped (a stop signal: resumable); diverged (training stopped itself); failed."""
    if err is None:
        return "completed"
    if isinstance(err, Preempted):
        return "stopped"
    return "diverged" if isinstance(err, TrainingAborted) else "failed"


def read_lines(path: Path) -> dict[int, dict]:
    """sweep.jsonl by job number; a job run again in the same sweep dir keeps its latest line."""
    if not path.is_file():
        return {}
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {line["job"]: line for line in lines if "job" in line}


def jobs_recorded() -> bool:
    return _sweep_dir is not None and bool(read_lines(_sweep_dir / "sweep.jsonl"))


def status_counts() -> tuple[Path, dict[str, int]] | None:
    """(sweep.jsonl, jobs per status) for the multirun this process launched; None after a single run."""
    if _sweep_dir is None:
        return None
    path = _sweep_dir / "sweep.jsonl"
    counts = Counter(line.get("status", "failed") for line in read_lines(path).values())
    return path, {status: counts[status] for status in (*STATUSES, *sorted(counts)) if counts[status]}


class SweepRecord(Callback):
    """Records overrides, final metrics, skipped steps, status and wall time of every job.

    Written with one O_APPEND write per line, so jobs finishing at once (parallel launchers)
    do not interleave. A failed job gets a line too, with its error. A stop signal (or Ctrl-C)
    ends the sweep after that job's checkpoint; with `fail_fast=true`, so does a failed job.
    """

    def __init__(self) -> None:
        self._started: dict[int, float] = {}

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        global _sweep_dir
        _sweep_dir = Path(config.hydra.sweep.dir)
        print(f"sweep dir: {_sweep_dir}", file=sys.stderr, flush=True)
        if "optuna" in str(config.hydra.sweeper.get("_target_", "")).lower():
            import optuna  # before the sweeper does: its "new study created" line goes (the sweeper logs the study)

            optuna.logging.set_verbosity(logging.WARNING)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._started[os.getpid()] = time.time()

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        hydra = config.hydra
        if hydra.mode is None or hydra.mode.name != "MULTIRUN":
            return
        run_dir = Path(hydra.runtime.output_dir)
        summary_file = run_dir / "summary.json"
        summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
        err = job_return._return_value if job_return.status != JobStatus.COMPLETED else None  # the job's exception
        line = {
            "job": hydra.job.num,
            "overrides": list(hydra.overrides.task),
            "status": job_status(err),
            "wall_s": round(time.time() - self._started.pop(os.getpid(), time.time()), 3),
            "dir": str(run_dir),
            **{k: summary.get(k) for k in RECORDED},
        }
        if err is not None:
            line["error"] = f"{type(err).__name__}: {err}"
        path = Path(hydra.sweep.dir) / "sweep.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, (json.dumps(line) + "\n").encode())
        finally:
            os.close(fd)
        if err is not None:
            self._job_failed(line, err, bool(config.get("fail_fast")))

    @staticmethod
    def _job_failed(line: dict, err: BaseException, fail_fast: bool) -> None:
        """Say how the job ended (a bug with its traceback); stop the sweep where that is asked for."""
        known = failure_line(err)
        text = known[1] if known else "".join(traceback.format_exception(err)).rstrip()
        print(f"job {line['job']} ({' '.join(line['overrides']) or 'defaults'}): {text}", file=sys.stderr, flush=True)
        if isinstance(err, Preempted):  # the user (or the scheduler) wants the sweep to stop, not the next job
            raise SweepStopped(SIGNAL, f"sweep stopped at job {line['job']}: the jobs after it did not run")
        if fail_fast:
            raise SweepStopped(
                SWEEP_FAILED, f"fail_fast=true: job {line['job']} {line['status']}; the sweep stops here"
            )
