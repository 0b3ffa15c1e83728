"""How long `python train.py` takes to answer, against `python -c "import torch"`, side by side.

    python benchmarks/startup.py [--repeats 5] [--to-exit]

Measures, as a user launches them (fresh processes, run in alternation, median wall time):
`import torch` alone; `train.py --help`; a config error (`accum=0`); the time from launch to
the first optimizer step of the default run (the moment its step-1 row reaches metrics.jsonl),
with W&B off and with W&B offline; and, with --to-exit, the whole default run (500 steps) from
launch to exit, both ways. W&B starts in a background thread, so the first step does not wait
for it; the exit rows show what W&B still costs in all.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRAIN = Path(__file__).resolve().parents[1] / "train.py"


def wall(args: list[str], env: dict) -> float:
    start = time.perf_counter()
    subprocess.run(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.perf_counter() - start


def to_first_step(overrides: list[str], env: dict) -> float:
    """Seconds from launch until the step-1 row is in metrics.jsonl (the process is then stopped)."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        args = [sys.executable, str(TRAIN), *overrides, "trainer.progress=false", f"hydra.run.dir={tmp}"]
        start = time.perf_counter()
        proc = subprocess.Popen(args, env=env, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            while not (metrics.exists() and metrics.read_text().strip()):
                if proc.poll() is not None:
                    raise RuntimeError(f"train.py exited {proc.returncode} before its first step")
                time.sleep(0.005)
            return time.perf_counter() - start
        finally:
            proc.kill()
            proc.wait()


def to_exit(overrides: list[str], env: dict) -> float:
    """Seconds from launch to exit of the whole run (W&B offline: its run is finished too)."""
    with tempfile.TemporaryDirectory() as tmp:
        args = [sys.executable, str(TRAIN), *overrides, "trainer.progress=false", f"hydra.run.dir={tmp}"]
        start = time.perf_counter()
        done = subprocess.run(args, env=env, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if done.returncode != 0:
            raise RuntimeError(f"train.py exited {done.returncode}")
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--to-exit", action="store_true", help="also time the default run to its exit")
    args = parser.parse_args()
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    cases = {
        'python -c "import torch"': lambda: wall([sys.executable, "-c", "import torch"], env),
        "python train.py --help": lambda: wall([sys.executable, str(TRAIN), "--help"], env),
        "python train.py accum=0 (config error)": lambda: wall([sys.executable, str(TRAIN), "accum=0"], env),
        "python train.py logger=none: first step": lambda: to_first_step(["logger=none"], env),
        "python train.py (W&B offline): first step": lambda: to_first_step([], env),
    }
    if args.to_exit:
        cases["python train.py logger=none: exit"] = lambda: to_exit(["logger=none"], env)
        cases["python train.py (W&B offline): exit"] = lambda: to_exit([], env)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for case in cases.values():
        case()  # warm the file cache
    for _ in range(args.repeats):  # alternate, so that machine noise hits every case alike
        for name, case in cases.items():
            times[name].append(case())
    base = statistics.median(times['python -c "import torch"'])
    print(f"{args.repeats} runs each, median wall seconds; x = relative to import torch")
    print("| command | seconds | x import torch |")
    print("|---|---:|---:|")
    for name, t in times.items():
        print(f"| `{name}` | {statistics.median(t):.2f} | {statistics.median(t) / base:.2f} |")


if __name__ == "__main__":
    main()
