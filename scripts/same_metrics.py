"""Does a change leave the numbers alone? Run a fixed set of training commands on the working tree
and on a git revision, side by side, and compare their metrics.jsonl rows bit for bit.

    python scripts/same_metrics.py              # the working tree against HEAD
    python scripts/same_metrics.py main~3       # ... against another revision
    python scripts/same_metrics.py --list       # the commands

A refactor must log the same rows: every key but perf/* (times, throughput) must be equal, value
for value, in every row. The revision is checked out into a temporary git worktree; each tree runs
its own train.py with its own src/ first on PYTHONPATH, on one CPU thread. Exit code 0 when every
command logged identical rows, 1 otherwise (the first difference of each is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The precision setups whose numbers matter most, each small enough for a CPU (~1 min in all).
COMMANDS: dict[str, list[str]] = {
    "fp32 default": [],
    "fp16, injected overflows": ["precision=fp16", "trainer.inject_nonfinite_at=[3,4,40]", "trainer.max_steps=100"],
    "bf16, accum=4": ["precision=bf16", "accum=4", "trainer.max_steps=100"],
    "pure bf16 kahan, AdamW, clipping": [
        "precision=bf16_pure_kahan", "optim=adamw", "optim.lr=0.003", "optim.clip_grad_norm=1.0",
        "trainer.max_steps=100",
    ],
    "pure fp16, static scale": ["precision=fp16_pure", "scaler=static", "scaler.scale=128", "trainer.max_steps=100"],
    "fixup_resnet, fp16": ["model=fixup_resnet", "init=fixup", "precision=fp16", "trainer.max_steps=20"],
    "kaiming, constant schedule": ["init=kaiming", "sched=constant", "trainer.max_steps=100"],
}  # fmt: skip
COMMON = ["logger=none", "trainer.progress=false", "trainer.threads=1", "trainer.log_every=1", "trainer.val_every=25"]


def run_all(tree: Path, out: Path) -> dict[str, subprocess.CompletedProcess]:
    """Every command on `tree`'s own code; two at a time (one thread each)."""
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}

    def one(name: str) -> subprocess.CompletedProcess:
        run_dir = out / run_name(name)
        args = [sys.executable, str(tree / "train.py"), *COMMON, *COMMANDS[name], f"hydra.run.dir={run_dir}"]
        return subprocess.run(args, cwd=out, env=env, capture_output=True, text=True)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(COMMANDS, pool.map(one, COMMANDS)))


def run_name(command: str) -> str:
    """A dir name Hydra reads back as a plain value: letters, digits and underscores."""
    return "".join(c if c.isalnum() else "_" for c in command)


def rows_without_perf(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")} for line in lines]


def first_difference(old: list[dict], new: list[dict]) -> str | None:
    if len(old) != len(new):
        return f"{len(old)} rows before, {len(new)} now"
    for before, now in zip(old, new):
        for key in sorted(before.keys() | now.keys()):
            if before.get(key, "<absent>") != now.get(key, "<absent>"):
                return (
                    f"step {before.get('step')}: {key} {before.get(key, '<absent>')!r} -> {now.get(key, '<absent>')!r}"
                )
    return None


def compare(rev: str) -> int:
    with tempfile.TemporaryDirectory(prefix="same-metrics-") as tmp:
        old_tree = Path(tmp) / "rev"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(old_tree), rev], cwd=ROOT, check=True)
        try:
            (Path(tmp) / "old").mkdir()
            (Path(tmp) / "new").mkdir()
            old = run_all(old_tree, Path(tmp) / "old")
            new = run_all(ROOT, Path(tmp) / "new")
            return report(rev, old, new, Path(tmp))
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old_tree)], cwd=ROOT, check=False)


def report(rev: str, old: dict, new: dict, tmp: Path) -> int:
    failed = 0
    print(f"{'command':34} rows  {rev} vs the working tree")
    for name in COMMANDS:
        for label, proc in ((rev, old[name]), ("working tree", new[name])):
            if proc.returncode != 0:
                print(f"{name:34} -     {label} exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
                failed += 1
        if old[name].returncode or new[name].returncode:
            continue
        run = run_name(name)
        before, now = rows_without_perf(tmp / "old" / run), rows_without_perf(tmp / "new" / run)
        difference = first_difference(before, now)
        print(f"{name:34} {len(now):4}  {'identical' if difference is None else 'DIFFERENT: ' + difference}")
        failed += difference is not None
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev", nargs="?", default="HEAD", help="the git revision to compare with (default HEAD)")
    parser.add_argument("--list", action="store_true", help="print the commands and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, overrides in COMMANDS.items():
            print(f"{name:34} python train.py {' '.join(COMMON + overrides)}")
        return 0
    return compare(args.rev)


if __name__ == "__main__":
    sys.exit(main())
