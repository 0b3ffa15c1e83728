"""Does a layer's damage in a format early in a bf16 run predict the sensitivity tool's ranking at its
end? Reads a sweep of `python train.py -m +experiment=shadow` (bf16 runs with diagnostics.shadow) and
compares, per format and seed, each diagnostics step's what-if relative error per layer with
`halfprec sensitivity`'s damage (the loss added by that layer alone in the format) on the run's last
checkpoint.

    python benchmarks/shadow_check.py --sweep DIR [--batches 8] [--early-step N] [--out DIR]

1. `halfprec sensitivity <job> --formats <the shadow formats> --batches B` on each finished job that
   has no sensitivity.json yet (it writes sensitivity.md/.json/.png beside the run);
2. per format and diagnostics step: Spearman's rank correlation, over the Linear layers the tool
   measured (the output head included; not its whole-model row), between the end damage and the
   step's shadow relative error of each operand (input, weight, grad_output) and of their mean; and
   in how many seeds the step's worst layer (by the mean) is the tool's first;
3. with --early-step N, the tool on each job's step-N checkpoint too (<job>/sensitivity_stepN/, where
   missing), and the rank correlation of that damage with the end's: the tool's own early answer;
4. the tables (mean +- std over seeds) to stdout and <out>/shadow_check.md (+ .json), and
   <out>/shadow_check.png: the correlation of the mean against step, per format.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from scipy.stats import spearmanr  # noqa: E402

from halfprec.config import from_saved  # noqa: E402
from halfprec.tools.report.runs import Job, find_jobs  # noqa: E402
from halfprec.tools.sensitivity.measure import WHOLE, find_checkpoint  # noqa: E402
from halfprec.training.checkpoint import load_checkpoint  # noqa: E402

OPERANDS = ("input", "weight", "grad_output")
SCORES = (*OPERANDS, "mean")


def run_sensitivity(target: Path, formats: list[str], batches: int, out: Path) -> dict:
    """`halfprec sensitivity` of a run dir or checkpoint, writing into `out`; its sensitivity.json, read
    back without measuring again when `out` holds one already."""
    path = out / "sensitivity.json"
    if not path.exists():
        command = ["halfprec", "sensitivity", str(target), "--formats", ",".join(formats), f"--batches={batches}"]
        subprocess.run([*command, "--out", str(out)], check=True)
    return json.loads(path.read_text())


def measure(job: Job, formats: list[str], batches: int) -> dict:
    """The tool on the job's newest checkpoint, beside the run (sensitivity.md/.json/.png in its dir)."""
    return run_sensitivity(job.dir, formats, batches, job.dir)


def shadow_scores(job: Job, fmt: str, layers: list[str]) -> dict[int, dict[str, list[float]]]:
    """Per diagnostics step: each score (an operand's relative error, or their mean) per layer, in `layers` order."""
    steps: dict[int, dict[str, list[float]]] = {}
    for row in job.rows:
        keys = [f"shadow/{fmt}/{layer}/{op}/rel_err" for layer in layers for op in OPERANDS]
        if not all(key in row for key in keys):
            continue
        by_op = {op: [float(row[f"shadow/{fmt}/{layer}/{op}/rel_err"]) for layer in layers] for op in OPERANDS}
        by_op["mean"] = [statistics.fmean(values) for values in zip(*(by_op[op] for op in OPERANDS))]
        steps[int(row["step"])] = by_op
    return steps


def layer_damage(sensitivity: dict, fmt: str) -> dict[str, float]:
    """The loss each Linear layer alone in `fmt` adds (the tool's rows, less its whole-model one)."""
    return {r["layer"]: r["damage"] for r in sensitivity["rows"] if r["format"] == fmt and r["layer"] != WHOLE}


def compare(job: Job, sensitivity: dict, fmt: str) -> dict[int, dict[str, float]]:
    """Per diagnostics step: Spearman's rho of each score with the end damage, and whether the worst layers agree."""
    damage = layer_damage(sensitivity, fmt)
    layers = sorted(damage)
    first = max(layers, key=damage.__getitem__)
    out: dict[int, dict[str, float]] = {}
    for step, scores in shadow_scores(job, fmt, layers).items():
        rho = {name: float(spearmanr(scores[name], [damage[layer] for layer in layers]).statistic) for name in SCORES}
        worst = layers[max(range(len(layers)), key=scores["mean"].__getitem__)]
        out[step] = {**rho, "top1": float(worst == first)}
    return out


def mean_std(values: list[float]) -> str:
    spread = f" +- {statistics.stdev(values):.2f}" if len(values) > 1 else ""
    return f"{statistics.fmean(values):.2f}{spread}"


def table(fmt: str, per_job: list[dict[int, dict[str, float]]], steps: list[int]) -> list[str]:
    lines = [
        f"**{fmt}** (Spearman's rho with the end damage, mean +- std over {len(per_job)} seeds)",
        "",
        "| step | input | weight | grad_output | mean of the three | worst layer = tool's first |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for step in steps:
        cells = [mean_std([job[step][name] for job in per_job]) for name in SCORES]
        hits = sum(int(job[step]["top1"]) for job in per_job)
        lines.append(f"| {step} | {' | '.join(cells)} | {hits} of {len(per_job)} |")
    return [*lines, ""]


def tool_firsts(sensitivity: list[dict], fmt: str) -> str:
    firsts = []
    for measured in sensitivity:
        (first, most), (_, next_most) = sorted(layer_damage(measured, fmt).items(), key=lambda kv: -kv[1])[:2]
        firsts.append(f"{first} ({most:.4f}; next {next_most:.4f})")
    return f"the tool's first layer per seed: {'; '.join(firsts)}"


def shadow_worsts(jobs: list[Job], sensitivity: list[dict], fmt: str, step: int) -> str:
    """Each seed's worst layer by the mean error at `step`, against the error of the tool's first: how far
    apart the layers' errors are."""
    worsts = []
    for job, measured in zip(jobs, sensitivity):
        damage = layer_damage(measured, fmt)
        layers = sorted(damage)
        mean = shadow_scores(job, fmt, layers)[step]["mean"]
        worst = max(range(len(layers)), key=mean.__getitem__)
        first = layers.index(max(layers, key=damage.__getitem__))
        worsts.append(f"{layers[worst]} ({mean[worst]:.3f}; the tool's first {mean[first]:.3f}, least {min(mean):.3f})")
    return f"the shadow's worst layer per seed at step {step} (mean error): {'; '.join(worsts)}"


def measure_early(job: Job, formats: list[str], batches: int, step: int) -> dict:
    """The tool's measurement of the job's step-`step` checkpoint (in <job>/sensitivity_step<step>/)."""
    out = job.dir / f"sensitivity_step{step}"
    checkpoint = job.dir / "checkpoints" / f"step-{step:08d}.pt"
    if not (out / "sensitivity.json").exists() and not checkpoint.exists():
        sys.exit(f"shadow_check: --early-step {step}: no {checkpoint} (trainer.ckpt_every, ckpt_keep keep which)")
    return run_sensitivity(checkpoint, formats, batches, out)


def early_lines(early: list[dict], end: list[dict], step: int) -> list[str]:
    """Per format the early measurement holds: Spearman's rho of the tool's damage at `step` with its
    damage at the end, and what the end's first layer added then and at the end."""
    lines = [f"**The tool itself at step {step}** (its damage then against its damage at the end):", ""]
    for fmt in early[0]["formats"]:
        rho, firsts = [], []
        for then, last in zip(early, end):
            before, after = layer_damage(then, fmt), layer_damage(last, fmt)
            layers = sorted(after)
            rho.append(float(spearmanr([before[k] for k in layers], [after[k] for k in layers]).statistic))
            first = max(layers, key=after.__getitem__)
            top = max(layers, key=before.__getitem__)
            firsts.append(f"{first} {before[first]:.4f} -> {after[first]:.4f} (first then: {top} {before[top]:.4f})")
        lines += [f"- {fmt}: rho {mean_std(rho)}; the end's first layer per seed: {'; '.join(firsts)}", ""]
    return lines


def plot(results: dict[str, list[dict[int, dict[str, float]]]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for fmt, per_job in results.items():
        steps = sorted(set.intersection(*(set(job) for job in per_job)))
        rho = [[job[s]["mean"] for job in per_job] for s in steps]
        mean = [statistics.fmean(r) for r in rho]
        ax.plot(steps, mean, marker="o", markersize=3, label=fmt)
        ax.fill_between(steps, [min(r) for r in rho], [max(r) for r in rho], alpha=0.15)
    ax.set(xlabel="step of the bf16 run", ylabel="Spearman's rho", ylim=(-1, 1))
    ax.set_title("shadow error per layer at a step vs the sensitivity tool's damage at the end", fontsize="medium")
    ax.axhline(0, color="grey", linewidth=0.5)
    ax.legend(title="format (seed mean; band: min-max)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", type=Path, required=True, help="a sweep of +experiment=shadow")
    parser.add_argument("--batches", type=int, default=8, help="validation batches the sensitivity tool measures")
    parser.add_argument("--early-step", type=int, default=None, help="also measure this step's checkpoint")
    parser.add_argument("--out", type=Path, default=None, help="where the tables and the plot go (default: --sweep)")
    args = parser.parse_args()
    out = args.out or args.sweep
    out.mkdir(parents=True, exist_ok=True)
    jobs = [job for job in find_jobs(args.sweep) if job.status == "completed"]
    if not jobs:
        sys.exit(f"shadow_check: no finished job in {args.sweep}")
    formats = from_saved(load_checkpoint(find_checkpoint(jobs[0].dir))["config"]).diagnostics.shadow
    measured = [measure(job, formats, args.batches) for job in jobs]
    results = {fmt: [compare(job, m, fmt) for job, m in zip(jobs, measured)] for fmt in formats}
    lines = [f"{len(jobs)} runs of {args.sweep}; the sensitivity tool on step {measured[0]['step']}", ""]
    for fmt, per_job in results.items():
        steps = sorted(set.intersection(*(set(job) for job in per_job)))
        lines += [*table(fmt, per_job, steps), tool_firsts(measured, fmt), ""]
        lines += [shadow_worsts(jobs, measured, fmt, steps[min(1, len(steps) - 1)]), ""]
        lines += [shadow_worsts(jobs, measured, fmt, steps[-1]), ""]
    if args.early_step is not None:
        early = [measure_early(job, formats, args.batches, args.early_step) for job in jobs]
        lines += early_lines(early, measured, args.early_step)
    text = "\n".join(lines)
    print(text)
    (out / "shadow_check.md").write_text(text + "\n")
    (out / "shadow_check.json").write_text(json.dumps({f: [{str(s): v for s, v in j.items()} for j in r]
                                                       for f, r in results.items()}, indent=1))  # fmt: skip
    plot(results, out / "shadow_check.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
