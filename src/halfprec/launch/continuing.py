"""Continuing what stopped with `resume=auto`: a sweep dir holds one sweep, which the same command
plus `resume=auto` continues (finished jobs skipped, the others resumed from their checkpoints), and
a single run continues in the run dir `hydra.run.dir` names.

A sweep dir never holds two sweeps: Hydra numbers every launch's jobs from 0, so a second sweep's
jobs would share numbers (and sweep.jsonl lines, and `halfprec report` groups) with the first's.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml

from halfprec.errors import ConfigError
from halfprec.launch.exits import in_sweep

# Hydra settings that name the sweep dir or the mode; the continue command gives its own.
NOT_REPEATED = ("hydra.sweep.dir=", "hydra.mode=")


def task_overrides(overrides: list[str]) -> list[str]:
    """A sweep's overrides as they decide its jobs: `resume=` aside, which job dirs leave out too
    (conf/hydra/default.yaml), so that a continued sweep finds its jobs' dirs."""
    return [o for o in overrides if not o.startswith("resume=")]


def earlier_sweep(sweep_dir: Path) -> list[str] | None:
    """The overrides of the sweep launched in `sweep_dir` before (its multirun.yaml); [] for jobs of
    unknown origin, None where no job ran."""
    has_jobs = (sweep_dir / "sweep.jsonl").is_file() or any(sweep_dir.glob("*/.hydra"))
    if not has_jobs:
        return None
    saved = sweep_dir / "multirun.yaml"
    if not saved.is_file():
        return []
    return task_overrides(list(yaml.safe_load(saved.read_text())["hydra"]["overrides"]["task"]))


def check_sweep_dir(sweep_dir: Path, overrides: list[str], resume: Any) -> str | None:
    """Before a sweep launches: refuse a dir that holds another sweep, or this one without
    `resume=auto` (its jobs would start again at step 0 over their own dirs); the line to print
    otherwise, if any."""
    before, now = earlier_sweep(sweep_dir), task_overrides(overrides)
    if before is None:
        if resume == "auto":
            return (
                f"resume=auto: {sweep_dir} is a new sweep dir: every job starts at step 0 (a requeued job goes on "
                f"from its checkpoint); to continue an earlier sweep, add hydra.sweep.dir=<its dir> (its first line, "
                f"'sweep dir: ...')"
            )
        return None
    if before and before != now:
        raise ConfigError(
            "hydra.sweep.dir", sweep_dir, f"holds another sweep ({' '.join(before)}): one dir keeps one sweep, "
            f"so that its report and sweep.jsonl mix no other: choose a new hydra.sweep.dir, or continue that "
            f"sweep with its own overrides, in the same order, and resume=auto",
        )  # fmt: skip
    if resume != "auto":
        raise ConfigError(
            "hydra.sweep.dir", sweep_dir, "holds this sweep's jobs already: add resume=auto to continue it "
            "(finished jobs are skipped, stopped ones resume from their checkpoints), or choose a new hydra.sweep.dir",
        )  # fmt: skip
    return f"resume=auto: continuing the sweep in {sweep_dir}: finished jobs are skipped, the others resume"


def continue_command(sweep_dir: Path, task: list[str], hydra: list[str]) -> str:
    """The command that continues a sweep: its overrides and Hydra settings, its dir, resume=auto."""
    kept = [*task_overrides(task), *(o for o in hydra if not o.startswith(NOT_REPEATED))]
    where = f"hydra.sweep.dir={sweep_dir}"
    return " ".join(["python train.py -m", *map(shlex.quote, kept), shlex.quote(where), "resume=auto"])


def finished_job(run_dir: Path, max_steps: int) -> dict | None:
    """In a sweep continued with resume=auto: the summary.json of a job that ran to max_steps, or
    diverged, before; it is not trained again (a longer max_steps trains on from its checkpoint)."""
    path = run_dir / "summary.json"
    summary = json.loads(path.read_text()) if path.is_file() else {}
    status = summary.get("status")
    if status == "diverged" or (status == "completed" and summary.get("steps", 0) >= max_steps):
        print(f"resume=auto: {run_dir} {status} before, at step {summary['steps']}: skipped", file=sys.stderr)
        return summary
    return None


def skipped_job(resume: str | None, max_steps: int) -> dict | None:
    """finished_job for this Hydra job when it is one of a sweep continued with resume=auto."""
    from hydra.core.hydra_config import HydraConfig

    if not in_sweep() or resume != "auto":
        return None
    return finished_job(Path(HydraConfig.get().runtime.output_dir), max_steps)


def say_if_new_run_dir(resume: str | None) -> None:
    """A single run with resume=auto and no hydra.run.dir gets a new, empty run dir: say so, since
    the user meant to continue an earlier run."""
    from hydra.core.hydra_config import HydraConfig

    if in_sweep() or resume != "auto":
        return
    hydra = HydraConfig.get()
    if not any(o.startswith("hydra.run.dir=") for o in hydra.overrides.hydra):
        print(
            f"resume=auto: {hydra.runtime.output_dir} is a new run dir, with nothing to continue: training starts "
            f"at step 0; to continue a run, add hydra.run.dir=<its dir> (its line 'run dir: ...')",
            file=sys.stderr,
        )
