"""sweep.jsonl: one line per finished multirun job (its overrides, final metrics, status, error, wall
time), written by the sweep callback (halfprec.launch.sweep) and read by the end-of-sweep line and
`halfprec report`. Torch- and Hydra-free."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

STATUSES = ("completed", "failed", "diverged", "stopped")  # in the order the end-of-sweep line counts them

launched: Path | None = None  # the sweep.jsonl of the multirun this process launched (set by the callback)
continue_with: str | None = None  # the command that continues that sweep (halfprec.launch.continuing)
printed: set[int] = set()  # the jobs whose failure this process has printed (it ran them itself)
printed_errors: set[int] = set()  # and the id() of their exceptions


def append(path: Path, line: dict) -> None:
    """One O_APPEND write per line, so jobs finishing at once (parallel launchers) do not interleave."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (json.dumps(line) + "\n").encode())
    finally:
        os.close(fd)


def read_lines(path: Path) -> dict[int, dict]:
    """sweep.jsonl by job number; a job run again in the same sweep dir keeps its latest line."""
    if not path.is_file():
        return {}
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {line["job"]: line for line in lines if "job" in line}


def failure_message(line: dict, text: str) -> str:
    """The line a user reads about a job that did not complete: its number, overrides and error."""
    return f"job {line['job']} ({' '.join(line['overrides']) or 'defaults'}): {text}"


def unprinted_failures() -> list[str]:
    """The failure lines of this process's sweep that were not printed as their job ended: jobs a
    launcher ran in other processes (joblib, submitit), in job order."""
    if launched is None:
        return []
    lines = read_lines(launched)
    return [lines[job]["message"] for job in sorted(lines) if "message" in lines[job] and job not in printed]


def jobs_recorded() -> bool:
    return launched is not None and bool(read_lines(launched))


def error_text(err: BaseException) -> str:
    """A job's error as its sweep.jsonl line records it ("error")."""
    return f"{type(err).__name__}: {err}"


def records_error(err: BaseException) -> bool:
    """Whether a job's line holds this error: False for one raised while a job was being launched
    (Hydra composing its config), which no job line records."""
    text = error_text(err)
    return launched is not None and any(line.get("error") == text for line in read_lines(launched).values())


def status_counts() -> tuple[Path, dict[str, int]] | None:
    """(sweep.jsonl, jobs per status) for the multirun this process launched; None after a single run."""
    if launched is None:
        return None
    counts = Counter(line.get("status", "failed") for line in read_lines(launched).values())
    return launched, {status: counts[status] for status in (*STATUSES, *sorted(counts)) if counts[status]}
