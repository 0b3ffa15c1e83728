"""The sensitivity heatmap of each run that `halfprec sensitivity` measured (its sensitivity.json)."""

from __future__ import annotations

from pathlib import Path

from halfprec.tools.report.runs import Job, file_id


def sensitivity_name(job: Job) -> str:
    return f"sensitivity_{file_id(job)}.png"


def write_sensitivity_plots(jobs: list[Job], out: Path) -> list[Path]:
    """A heatmap (layers x formats, coloured by the loss increase) per job with a sensitivity.json."""
    measured = [job for job in jobs if (job.dir / "sensitivity.json").is_file()]
    if not measured:
        return []
    from halfprec.tools.sensitivity.output import DAMAGE_LABEL, Summary, heatmap  # torch, matplotlib

    images = []
    for job in measured:
        summary = Summary.read(job.dir / "sensitivity.json")
        title = f"job {job.id}, step {summary.step}: {DAMAGE_LABEL}"
        heatmap(summary, title).savefig(out / sensitivity_name(job), dpi=100)
        images.append(out / sensitivity_name(job))
    return images
