"""Jobs as configurations: the overrides that tell jobs apart, the groups of jobs that differ in
the seed alone (one configuration run several times), and a group's statistics over its completed
jobs (Spread) and status counts."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from halfprec.launch.sweep_log import STATUSES
from halfprec.tools.report.runs import Job

# Overrides that pick a replicate rather than a configuration ("+seed=1" as well as "seed=1").
SEED_KEYS = ("seed",)

# The status whose jobs a group's mean ± std is over. A failed or diverged job stopped early and a
# running one is still moving: averaging them in would mix final values with those of other steps.
# They stay in the per-job table and are drawn as lines of their own; the group's status cell counts them.
COUNTED = "completed"

STATUS_ORDER = (*STATUSES, "running")  # others follow, by first appearance


def shown_overrides(jobs: list[Job]) -> list[str]:
    """The override keys whose value differs between jobs (or is missing in some), in command-line order.
    A lone run shows all of its overrides: there is nothing to tell it apart from."""
    keys = list(dict.fromkeys(key for job in jobs for key in job.overrides))
    if len(jobs) == 1:
        return keys
    return [key for key in keys if len({job.overrides.get(key) for job in jobs}) > 1]


def is_seed(key: str) -> bool:
    return key.lstrip("+~") in SEED_KEYS


@dataclass
class Group:
    """Jobs whose overrides differ in the seed alone, or not at all: one configuration run several times."""

    overrides: dict[str, str]  # the non-seed overrides its jobs share
    jobs: list[Job]

    @property
    def counted(self) -> list[Job]:
        """The jobs its statistics are over (see COUNTED)."""
        return [job for job in self.jobs if job.status == COUNTED]


def group_jobs(jobs: list[Job], leave_out: tuple[str, ...] = ()) -> list[Group]:
    """The jobs' groups, in the order of each group's first job; overrides in `leave_out` (a plot's
    x-axis) do not tell groups apart, as the seed does not."""
    groups: dict[tuple, Group] = {}
    for job in jobs:
        overrides = {key: value for key, value in job.overrides.items() if not is_seed(key) and key not in leave_out}
        groups.setdefault(tuple(sorted(overrides.items())), Group(overrides, [])).jobs.append(job)
    return list(groups.values())


@dataclass(frozen=True)
class Spread:
    """One metric over a group's counted jobs that logged it: n of them, their mean and sample std."""

    mean: float
    std: float | None  # None for a single value
    n: int


def spread(values: list[Any]) -> Spread | None:
    """None when no job logged it; a nan mean (and std) when one of them logged a non-finite value."""
    numbers = [float(value) for value in values if value is not None]
    if not numbers:
        return None
    if len(numbers) == 1:
        return Spread(numbers[0], None, 1)
    if not all(math.isfinite(number) for number in numbers):
        return Spread(math.nan, math.nan, len(numbers))
    return Spread(statistics.fmean(numbers), statistics.stdev(numbers), len(numbers))


def status_counts(jobs: list[Job]) -> str:
    """Each status the jobs have, with how many have it, known statuses first: "2 completed, 1 diverged"."""
    statuses = [*STATUS_ORDER, *dict.fromkeys(job.status for job in jobs)]
    counts = {status: sum(job.status == status for job in jobs) for status in dict.fromkeys(statuses)}
    return ", ".join(f"{n} {status}" for status, n in counts.items() if n)
