"""Shared fixtures: run `train.py` the way users do, with outputs in a tmp dir and W&B offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
TRAIN = REPO / "train.py"

# Overrides that make any run cheap without changing what it exercises. Model-specific sizes
# (model.hidden=...) are not here: they are only valid for their own model.
CHEAP = ["trainer.max_steps=3", "trainer.val_every=0", "trainer.log_every=1", "data.batch_size=16"]

# W&B in tests: offline, quiet, and without the probes (git, code, requirements, system metrics)
# that cost start-up time and read the machine.
WANDB_ENV = {
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "WANDB_CONSOLE": "off",
    "WANDB_DISABLE_GIT": "true",
    "WANDB_DISABLE_CODE": "true",
    "WANDB_X_DISABLE_STATS": "true",
    "WANDB_X_DISABLE_META": "true",
    "WANDB_X_DISABLE_MACHINE_INFO": "true",
    "WANDB_X_SAVE_REQUIREMENTS": "false",
}


@pytest.fixture(scope="session", autouse=True)
def wandb_offline(tmp_path_factory):
    """Every test, in-process or subprocess, talks to W&B offline, with W&B's own files in a tmp dir,
    and to an MLflow store in that dir."""
    home = tmp_path_factory.mktemp("wandb_home")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in WANDB_ENV.items():
            mp.setenv(key, value)
        for key in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
            mp.setenv(key, str(home / key.lower()))
        mp.delenv("WANDB_API_KEY", raising=False)
        # logger=mlflow's default store is outputs/mlflow.db under the launch dir: the tests' own instead
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{home / 'mlflow.db'}")
        mp.delenv("HYDRA_FULL_ERROR", raising=False)  # tests check the messages users see
        yield


def read_jsonl(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


@dataclass
class CliResult:
    """One `python train.py ...` process: its exit status, output, and where it wrote."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    cwd: Path
    run_dir: Path  # hydra.run.dir (single runs)
    sweep_dir: Path  # hydra.sweep.dir (multiruns)

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def metrics(self) -> list[dict]:
        return read_jsonl(self.run_dir / "metrics.jsonl")

    def job_dirs(self) -> list[Path]:
        """The multirun's job dirs, by job number."""
        dirs = [p for p in self.sweep_dir.iterdir() if p.is_dir() and p.name.split("_", 1)[0].isdigit()]
        return sorted(dirs, key=lambda p: int(p.name.split("_", 1)[0]))

    def check(self) -> CliResult:
        assert self.returncode == 0, f"`{' '.join(self.args)}` exited {self.returncode}:\n{self.output[-4000:]}"
        return self


class Cli:
    """Runs `python <repo>/train.py <overrides>` in a fresh tmp cwd, so nothing lands in the repo.

    `run(...)` waits; `submit(...)` starts it on a 2-worker pool (the dev machine has 2 cores)
    and returns a Future, so a test module can start its slow subprocesses together up front.
    """

    def __init__(self, tmp_path_factory: pytest.TempPathFactory):
        self._tmp = tmp_path_factory
        self._pool = ThreadPoolExecutor(max_workers=2)

    def run(self, *overrides: str, multirun: bool = False, cheap: bool = True, timeout: float = 300) -> CliResult:
        cwd = self._tmp.mktemp("cli")
        run_dir, sweep_dir = cwd / "run", cwd / "multi"
        # CHEAP goes first: for a key given twice Hydra keeps the last value, so the test's own wins.
        args = [sys.executable, str(TRAIN), *(["-m"] if multirun else []), *(CHEAP if cheap else []), *overrides]
        args += [f"hydra.run.dir={run_dir}", f"hydra.sweep.dir={sweep_dir}"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # two runs at a time on 2 cores: no oversubscription
        proc = subprocess.run(
            args, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
        )
        shown = ["python", "train.py", *args[2:]]
        return CliResult(shown, proc.returncode, proc.stdout, proc.stderr, cwd, run_dir, sweep_dir)

    def submit(self, *overrides: str, **kwargs) -> Future[CliResult]:
        return self._pool.submit(self.run, *overrides, **kwargs)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="session")
def cli(tmp_path_factory, wandb_offline):
    runner = Cli(tmp_path_factory)
    yield runner
    runner.close()
