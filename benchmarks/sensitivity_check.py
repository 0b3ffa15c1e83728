"""Does `halfprec sensitivity`'s ranking predict training? Trains the GPT in a number format with the
same number of Linear layers kept high, chosen four ways, and compares the final val/loss.

    python benchmarks/sensitivity_check.py [--precision mxfp4] [--keep 0.25] [--seeds 0,1,2]
        [--steps 400] [--batches 8] [--jobs 2] [--run RUN_DIR] [--out DIR]

1. a bf16 reference run of `task=lm` (seed 0, --steps steps) in <out>/reference, unless --run names one;
2. the sensitivity tool's measurement of it in --precision's format and recipe (--batches validation
   batches; sensitivity.md/.json/.png beside the run), and the k = --keep x (the layers the format
   would quantize) layers it would keep high;
3. `python train.py -m task=lm precision=<P>` with k layers high (precision.rules), chosen as:
   suggested (the tool's), random (random.Random(0).sample), first (the first k in model order: the
   first blocks) and last (the last k: the last blocks, the NVFP4 paper's choice); choices that name
   the same layers train once; --seeds each, --jobs at a time (joblib), one CPU thread each;
4. val/loss mean +- std (over seeds) per choice, to stdout and <out>/sensitivity_check.md (+ .json).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

import yaml
from hydra import compose, initialize_config_dir

from halfprec.launch.resolvers import register_resolvers
from halfprec.tools.sensitivity.measure import load_run, measure, parse_recipe
from halfprec.tools.sensitivity.output import Summary, write
from halfprec.tools.sensitivity.rules import keep_high, ranked, rules_list

REPO = Path(__file__).resolve().parents[1]
TRAIN = [sys.executable, str(REPO / "train.py")]
COMMON = ["task=lm", "logger=none", "trainer.threads=1"]


def reference_run(out: Path, steps: int) -> Path:
    run_dir = out / "reference"
    if not (run_dir / "summary.json").exists():
        overrides = ["precision=bf16", "seed=0", f"trainer.max_steps={steps}", f"hydra.run.dir={run_dir}"]
        subprocess.run([*TRAIN, *COMMON, *overrides], check=True)
    return run_dir


def choices(run_dir: Path, precision: str, keep: float, batches: int) -> tuple[dict[str, list[str]], list[str]]:
    """Each way of choosing the layers kept high -> their names; and the markdown of the measurement."""
    register_resolvers()
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        preset = compose("train", overrides=[f"precision={precision}"]).precision
    run = load_run(run_dir)
    recipe = parse_recipe("run", preset.recipe)
    measured = measure(run, [preset.format], batches, recipe, seed=0)
    candidates = ranked(measured, preset.format)
    k = len(keep_high(candidates, keep, "layers"))
    names = {r.layer for r in candidates}
    in_order = [name for name in measured.plans[preset.format] if name in names]  # model order
    picked = {
        "suggested": [r.layer for r in candidates[:k]],
        "random": random.Random(0).sample(in_order, k),
        "first": in_order[:k],
        "last": in_order[len(in_order) - k :],
    }
    summary = Summary.of(str(run_dir), run.step, run.precision.name, vars(recipe), measured, [preset.format])
    write(summary, run_dir, [])
    lines = [f"{name}: {', '.join(layers)}" for name, layers in picked.items()]
    return picked, [f"{k} of {len(candidates)} layers high in {preset.format}:", "", *lines]


def train_choices(out: Path, precision: str, picked: dict[str, list[str]], args: argparse.Namespace) -> Path:
    sweep = out / "sweep"
    distinct = list({tuple(sorted(v)): v for v in picked.values()}.values())
    rules = ",".join(rules_list(layers) for layers in distinct)
    overrides = [f"precision={precision}", f"seed={args.seeds}", f"precision.rules=choice({rules})",
                 f"trainer.max_steps={args.steps}", "hydra/launcher=joblib", f"hydra.launcher.n_jobs={args.jobs}",
                 f"hydra.sweep.dir={sweep}"]  # fmt: skip
    subprocess.run([*TRAIN, "-m", *COMMON, *overrides], check=True)
    return sweep


def results(sweep: Path, picked: dict[str, list[str]]) -> dict[str, list[float]]:
    """val/loss of each choice's jobs, found by the layers their rules name."""
    losses: dict[str, list[float]] = {name: [] for name in picked}
    for job in sorted(p for p in sweep.iterdir() if (p / "summary.json").exists()):
        config = yaml.safe_load((job / ".hydra" / "config.yaml").read_text())
        names = sorted(rule["match"] for rule in config["precision"]["rules"])
        loss = json.loads((job / "summary.json").read_text())["val/loss"]
        for name, chosen in picked.items():
            if sorted(chosen) == names:
                losses[name].append(loss)
    return losses


def table(losses: dict[str, list[float]], picked: dict[str, list[str]]) -> list[str]:
    rows = ["| layers kept high | val/loss (mean +- std) | seeds |", "|---|---|---|"]
    for name, values in losses.items():
        same = [other for other in picked if other != name and sorted(picked[other]) == sorted(picked[name])]
        label = name + (f" (= {', '.join(same)})" if same else "")
        spread = f" +- {statistics.stdev(values):.3f}" if len(values) > 1 else ""
        rows.append(f"| {label} | {statistics.fmean(values):.3f}{spread} | {len(values)} |")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", default="mxfp4", help="a precision option with a format")
    parser.add_argument("--keep", type=float, default=0.25)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--run", type=Path, help="a trained run to measure instead of a new bf16 one")
    parser.add_argument("--out", type=Path, default=Path("outputs/sensitivity_check"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    run_dir = args.run or reference_run(args.out, args.steps)
    picked, described = choices(run_dir, args.precision, args.keep, args.batches)
    print("\n".join(described), flush=True)
    losses = results(train_choices(args.out, args.precision, picked, args), picked)
    text = [*described, "", *table(losses, picked)]
    print("\n".join(text))
    (args.out / "sensitivity_check.md").write_text("\n".join(text) + "\n")
    (args.out / "sensitivity_check.json").write_text(json.dumps({"picked": picked, "val/loss": losses}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
