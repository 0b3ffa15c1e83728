"""Is a change numerically neutral? Run a fixed set of tiny training commands, one or more per config
group whose numbers matter, on the working tree and on a git commit, and compare every metrics.jsonl
row (and summary.json) bit for bit.

    python scripts/neutral.py                      # the working tree against HEAD
    python scripts/neutral.py --against main~3     # ... against another commit
    python scripts/neutral.py --only fp32 gpt      # a subset of the commands
    python scripts/neutral.py --list               # the commands, as train.py command lines
    python scripts/neutral.py --keep               # keep the run dirs (printed) to look at

A refactor must log the same rows: the same number of rows, the same keys, and every value equal to
the last bit (-0.0 is not 0.0, 1 is not 1.0), except the keys that measure time (TIMING_KEYS). The
commit is checked out into a temporary `git worktree add --detach`, removed afterwards; each tree
runs its own train.py with its own src/ alone on PYTHONPATH, on one CPU thread, two runs at a time.
It prints a line per command (rows compared, OK or the first difference) and the total time, and
exits 1 if any command differs or fails in either tree. About 3.5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Every command is tiny (startup dominates: 3-8 s each) and logs a row at every step, validates
# twice, and stops at step 8: a few optimizer steps, enough for overflows and growth. Two warmup
# steps, not the schedules' 20 or 40: with the lr near 0 the weights would hardly move, and a Fixup
# net (its classifier zero at init) would log ln(10) at every step.
COMMON = [
    "logger=none", "trainer.progress=false", "trainer.threads=1",
    "trainer.max_steps=8", "trainer.log_every=1", "trainer.val_every=4", "sched.warmup_steps=2",
]  # fmt: skip
MLP = ["model.hidden=[16]", "data.batch_size=16"]  # data=digits, the default
RESNET = ["model=fixup_resnet", "model.blocks_per_stage=1", "model.widths=[4,8,8]", "data.batch_size=16"]
GPT = [
    "task=lm", "model.n_layer=1", "model.n_embd=16", "model.n_head=2", "model.block_size=16",
    "data.batch_size=4",
]  # fmt: skip
# Two overflowing steps in a row: a static scale skips both, a dynamic one backs off (DeepSpeed's
# hysteresis=2 only at the second), and growth_interval=2 lets it grow again before step 8.
OVERFLOW = ["trainer.inject_nonfinite_at=[3,4]"]
FP16 = ["precision=fp16", *OVERFLOW]
GROW = ["scaler.growth_interval=2"]

COMMANDS: dict[str, list[str]] = {
    "fp32": [*MLP],
    "kaiming_constant": [*MLP, "init=kaiming", "sched=constant"],
    "fp16_static": [*MLP, *FP16, "scaler=static", "scaler.scale=128"],
    "fp16_dynamic": [*MLP, *FP16, "scaler=dynamic", *GROW],
    "fp16_deepspeed": [*MLP, *FP16, "scaler=deepspeed", *GROW],
    "fp16_fairseq": [*MLP, *FP16, "scaler=fairseq", *GROW],
    "fp16_none": [*MLP, *FP16, "scaler=none"],  # skipped on inf/NaN (trainer.nonfinite=skip), no scale
    "fp16_diagnostics": [*MLP, *FP16, "diagnostics=grads", "diagnostics.every=2"],  # diag/* rows, skip sources
    "fp16_pure": [*MLP, "precision=fp16_pure", "scaler=static", "scaler.scale=128", *OVERFLOW],
    "accum2_fp16": [*MLP, *FP16, "accum=2", *GROW],  # the scaler unscales the sum of two micro-batches
    "bf16": [*MLP, "precision=bf16"],
    "bf16_pure": [*MLP, "precision=bf16_pure"],  # update=nearest
    "bf16_pure_kahan": [*MLP, "precision=bf16_pure_kahan"],
    "bf16_pure_stochastic": [*MLP, "precision=bf16_pure_stochastic"],
    "bf16_pure_master": [*MLP, "precision=bf16_pure_master"],
    "bf16_pure_remainder": [*MLP, "precision=bf16_pure_remainder"],
    "adamw_bf16": [*MLP, "optim=adamw_bf16", "optim.lr=0.01"],  # bf16 moments, rounded to nearest
    "adamw_bf16_stochastic": [*MLP, "optim=adamw_bf16", "optim.lr=0.01", "optim.state_rounding=stochastic"],
    "fixup_fp16": [*RESNET, "init=fixup", *FP16],
    "gpt": [*GPT],  # AdamW, clipping at 1.0, cosine_tenth (conf/task_optim/lm_adamw.yaml)
    "gpt_nvfp4": [*GPT, "precision=nvfp4"],  # stochastic gradient rounding, Hadamard, 2D weight blocks
    # a precision schedule: the backward's GEMMs go high at step 5 (the phase's row and layer counts)
    "gpt_mxfp8_schedule": [
        *GPT,
        "precision=mxfp8",
        "precision.schedule=[{format:high,gemms:[dgrad,wgrad],from_step:5}]",
    ],  # fmt: skip
}


def is_timing(key: str) -> bool:
    """Keys that measure the wall clock, not the numbers (training/metrics.py's MetricsWindow.row):
    perf/samples_per_s, perf/tokens_per_s, perf/step_ms, perf/tflops and perf/mfu divide by a
    perf_counter interval; perf/max_mem_mb (CUDA only) is the allocator's peak, not a result.
    summary.json's wall_s is the run's duration. Everything else was identical in two runs of
    every command at one commit."""
    return key.startswith("perf/") or key == "wall_s"


def exact(value: object) -> str:
    """A value as its JSON text: json writes a float as its shortest round-trip repr, one text per
    double, so equal texts are equal bits (-0.0 and 0.0 differ, as do 1 and 1.0); a non-finite
    float is already null in the files."""
    return json.dumps(value, sort_keys=True)


def first_difference(old: list[dict], new: list[dict], ignore: Callable[[str], bool] = is_timing) -> str | None:
    """The first row and key where `new` differs from `old` (keys `ignore` names aside), or None."""
    for i, (before, now) in enumerate(zip(old, new)):
        where = f"step {before.get('step', now.get('step', f'? (row {i + 1})'))}"
        for key in sorted(k for k in before.keys() | now.keys() if not ignore(k)):
            if key not in now:
                return f"{where}: {key} missing (was {exact(before[key])})"
            if key not in before:
                return f"{where}: {key} new ({exact(now[key])})"
            if exact(before[key]) != exact(now[key]):
                return f"{where}: {key} {exact(before[key])} -> {exact(now[key])}"
    if len(old) != len(new):
        extra = new[len(old)] if len(new) > len(old) else old[len(new)]
        return f"{len(old)} rows before, {len(new)} now (from step {extra.get('step')})"
    return None


def read_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def read_summary(run_dir: Path) -> dict:
    """summary.json, its checkpoint path without the run dir (each run has its own)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    if "checkpoint" in summary:
        summary["checkpoint"] = "/".join(Path(summary["checkpoint"]).parts[-2:])  # checkpoints/step-N.pt
    return summary


def tree_env(tree: Path) -> dict[str, str]:
    # PYTHONPATH alone puts the tree's src/ ahead of the editable install's .pth entry; W&B stays
    # out even if a command forgot logger=none
    return {**os.environ, "PYTHONPATH": str(tree / "src"), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}


def check_imports_from(tree: Path) -> None:
    """Refuse to compare a tree with itself by accident: an install that shadowed PYTHONPATH (an
    editable install's import hook) would run one package for both trees and pass every command."""
    code = "import importlib.util; print(importlib.util.find_spec('halfprec').origin)"
    origin = subprocess.run([sys.executable, "-c", code], env=tree_env(tree), capture_output=True, text=True)
    if not Path(origin.stdout.strip()).resolve().is_relative_to((tree / "src").resolve()):
        sys.exit(f"error: with PYTHONPATH={tree / 'src'}, halfprec is imported from {origin.stdout.strip()!r}")


def run_all(tree: Path, out: Path, names: list[str]) -> dict[str, subprocess.CompletedProcess]:
    """Every command on `tree`'s own train.py and src/, two at a time (one thread each: 2 cores)."""
    check_imports_from(tree)
    out.mkdir(parents=True)

    def one(name: str) -> subprocess.CompletedProcess:
        args = [sys.executable, str(tree / "train.py"), *COMMON, *COMMANDS[name], f"hydra.run.dir={out / name}"]
        return subprocess.run(args, cwd=out, env=tree_env(tree), capture_output=True, text=True)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(names, pool.map(one, names)))


def compare_run(name: str, old_dir: Path, new_dir: Path) -> tuple[int, str | None]:
    """(rows compared, the first difference in metrics.jsonl or else summary.json, or None)."""
    old, new = read_rows(old_dir / name), read_rows(new_dir / name)
    difference = first_difference(old, new)
    if difference is None:
        difference = first_difference([read_summary(old_dir / name)], [read_summary(new_dir / name)])
        difference = difference and "summary.json: " + difference.split(": ", 1)[1]
    return len(new), difference


def report(names: list[str], old: dict, new: dict, tmp: Path) -> int:
    """A line per command; the number of commands that differ or failed."""
    failed = 0
    for name in names:
        crashed = [(label, runs[name]) for label, runs in (("commit", old), ("working tree", new))]
        crashed = [(label, proc) for label, proc in crashed if proc.returncode != 0]
        for label, proc in crashed:
            last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            print(f"{name:22}    - FAILED in the {label} (exit {proc.returncode}): {last}")
        if crashed:
            failed += 1
            continue
        rows, difference = compare_run(name, tmp / "commit", tmp / "tree")
        print(f"{name:22} {rows:4} {'OK' if difference is None else 'DIFFERENT: ' + difference}", flush=True)
        failed += difference is not None
    return failed


def resolve(commit: str) -> str:
    args = ["git", "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"error: {commit!r} is not a commit of {ROOT}")
    return proc.stdout.strip()


def compare(commit: str, names: list[str], keep: bool) -> int:
    sha, start = resolve(commit), time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="neutral-"))
    old_tree = tmp / "checkout"
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(old_tree), sha], cwd=ROOT, check=True)
    try:
        print(f"{len(names)} commands: {commit} ({sha[:12]}) against the working tree {ROOT}", flush=True)
        old = run_all(old_tree, tmp / "commit", names)
        new = run_all(ROOT, tmp / "tree", names)
        failed = report(names, old, new, tmp)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(old_tree)], cwd=ROOT, check=False)
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)
    verdict = f"{failed} of {len(names)} differ" if failed else "all identical"
    kept = f"; run dirs in {tmp}/commit and {tmp}/tree" if keep else ""
    print(f"{verdict} ({time.perf_counter() - start:.0f} s){kept}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", default="HEAD", metavar="COMMIT", help="the commit to compare with (default HEAD)")
    parser.add_argument("--only", nargs="+", choices=list(COMMANDS), metavar="NAME", help="run these commands only")
    parser.add_argument("--keep", action="store_true", help="keep both trees' run dirs (the path is printed)")
    parser.add_argument("--list", action="store_true", help="print the commands and exit")
    args = parser.parse_args(argv)
    names = args.only or list(COMMANDS)
    if args.list:
        for name in names:
            print(f"{name:22} python train.py {' '.join(COMMON + COMMANDS[name])}")
        return 0
    return compare(args.against, names, args.keep)


if __name__ == "__main__":
    sys.exit(main())
