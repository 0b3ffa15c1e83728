"""Hydra callback: one line per finished multirun job in `<sweep dir>/sweep.jsonl`, the job's
failure as one line when it ends, and the sweep's end (see halfprec.launch.exits)."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from halfprec.config import fail_fast_of
from halfprec.errors import ConfigError, Preempted, TrainingAborted
from halfprec.launch import sweep_log
from halfprec.launch.continuing import check_sweep_dir, continue_command
from halfprec.launch.exits import CONFIG, SIGNAL, SWEEP_FAILED, SweepStopped, failure_line
from halfprec.metrics import recorded

# The Optuna sweeper's own lines about failed trials ("Failed experiment: ...", "Failed [...] times
# out of ...") repeat the errors the jobs' lines have printed.
REPEATED = "Failed "


def job_status(err: BaseException | None, summary: dict) -> str:
    """completed; stopped (a stop signal: resumable); diverged (training stopped itself: in a sweep
    the job returns the worst objective instead of raising, and summary.json says so); failed."""
    if err is None:
        return summary.get("status", "completed")
    if isinstance(err, Preempted):
        return "stopped"
    return "diverged" if isinstance(err, TrainingAborted) else "failed"


class SweepRecord(Callback):
    """Records overrides, final metrics, skipped steps, status and wall time of every job.

    A failed job gets a line too, with its error. A stop signal (or Ctrl-C)
    ends the sweep after that job's checkpoint; with `fail_fast=true`, so does a failed job.
    """

    def __init__(self) -> None:
        self._started: dict[int, float] = {}
        # The sweep's own process. Launchers that run jobs elsewhere (joblib's workers, submitit's
        # tasks) take a pickled copy of this callback along; there the job's failure is recorded but
        # not printed (a submitit task's stderr is a log file): the sweep prints it when the job returns.
        self._sweep_pid = os.getpid()

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        overrides = config.hydra.overrides
        try:
            note = check_sweep_dir(sweep_dir, list(overrides.task), config.get("resume"))
        except ConfigError as err:
            raise SweepStopped(CONFIG, f"error: {err}") from None
        sweep_log.launched = sweep_dir / "sweep.jsonl"  # halfprec.launch.exits counts its lines at the end
        sweep_log.continue_with = continue_command(sweep_dir, list(overrides.task), list(overrides.hydra))
        print(f"sweep dir: {sweep_dir}", file=sys.stderr, flush=True)
        if note:
            print(note, file=sys.stderr, flush=True)
        if "optuna" in str(config.hydra.sweeper.get("_target_", "")).lower():
            import optuna  # before the sweeper does: its "new study created" line goes (the sweeper logs the study)

            optuna.logging.set_verbosity(logging.WARNING)
            sweeper_log = logging.getLogger("hydra_plugins.hydra_optuna_sweeper._impl")
            sweeper_log.addFilter(lambda record: not str(record.msg).startswith(REPEATED))

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._started[os.getpid()] = time.time()

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        hydra = config.hydra
        if hydra.mode is None or hydra.mode.name != "MULTIRUN":
            return
        if int(os.environ.get("RANK", 0)) > 0:  # one of a job's several tasks: rank 0 records the job
            return
        run_dir = Path(hydra.runtime.output_dir)
        summary_file = run_dir / "summary.json"
        summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
        err = job_return._return_value if job_return.status != JobStatus.COMPLETED else None  # the job's exception
        line = {
            "job": hydra.job.num,
            "overrides": list(hydra.overrides.task),
            "status": job_status(err, summary),
            "wall_s": round(time.time() - self._started.pop(os.getpid(), time.time()), 3),
            "dir": str(run_dir),
            **recorded(summary),
        }
        if err is None and line["status"] == "diverged":  # it returned the worst objective to the sweeper
            err = TrainingAborted(summary.get("error", "diverged"))
        known = failure_line(err) if err is not None else None
        if err is not None:
            line["error"] = sweep_log.error_text(err)
            line["message"] = sweep_log.failure_message(line, known[1] if known else line["error"])
        sweep_log.append(Path(hydra.sweep.dir) / "sweep.jsonl", line)
        if err is not None and os.getpid() == self._sweep_pid:
            self._job_failed(line, err, known is not None, fail_fast_of(config))

    @staticmethod
    def _job_failed(line: dict, err: BaseException, known: bool, fail_fast: bool) -> None:
        """Say how the job ended (a bug, not `known`, with its traceback); stop the sweep where that is asked for."""
        sweep_log.printed.add(line["job"])
        sweep_log.printed_errors.add(id(err))  # a sweeper that raises it again (Optuna) is not printed twice
        if known:
            print(line["message"], file=sys.stderr, flush=True)
        else:
            trace = "".join(traceback.format_exception(err)).rstrip()
            print(sweep_log.failure_message(line, trace), file=sys.stderr, flush=True)
        if isinstance(err, Preempted):  # the user (or the scheduler) wants the sweep to stop, not the next job
            raise SweepStopped(SIGNAL, f"sweep stopped at job {line['job']}: the jobs after it did not run")
        if fail_fast:
            raise SweepStopped(
                SWEEP_FAILED, f"fail_fast=true: job {line['job']} {line['status']}; the sweep stops here"
            )
