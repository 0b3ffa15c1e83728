"""W&B starts in the background: training never waits for wandb.init, and W&B catches up."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import CHEAP, read_jsonl

from halfprec.loggers.wandb import WandbSink, new_run_id
from halfprec.training import tracking
from halfprec.training.checkpoint import checkpoint_files, load_checkpoint
from halfprec.training.run import run

import wandb_records
from helpers import CONF, TRAIN, compose_cfg, typed_cfg


def gate_wandb_init(monkeypatch, until: Callable[[], bool], wait_s: float = 20.0) -> list[bool]:
    """wandb.init waits (up to `wait_s`) until `until()` holds, then starts the run as usual.
    Returns, per call, whether `until()` held: it cannot while wandb.init holds training up."""
    import wandb

    real, held = wandb.init, []

    def gated(*args, **kwargs):
        deadline = time.monotonic() + wait_s
        while not until() and time.monotonic() < deadline:
            time.sleep(0.01)
        held.append(until())
        return real(*args, **kwargs)

    monkeypatch.setattr(wandb, "init", gated)
    return held


def rows_written(metrics: Path) -> int:
    return metrics.read_text().count("\n") if metrics.exists() else 0


def test_training_does_not_wait_for_wandb_and_every_row_reaches_it_in_order(tmp_path, monkeypatch):
    metrics = tmp_path / "metrics.jsonl"
    held = gate_wandb_init(monkeypatch, lambda: rows_written(metrics) >= 5)
    run(compose_cfg("logger=wandb", "trainer.max_steps=5", "trainer.log_every=1"), tmp_path)
    assert held == [True]  # all 5 steps were trained and logged while wandb.init was still going
    (run_file,) = wandb_records.run_files(tmp_path)
    # the rows kept meanwhile were sent once the run was up, in order, each once
    assert [h["step"] for h in wandb_records.history(run_file)] == [r["step"] for r in read_jsonl(metrics)]
    assert wandb_records.exit_codes(run_file) == [0]
    assert wandb_records.summary(run_file)["status"] == "completed"


def test_a_checkpoint_records_the_wandb_run_id_before_wandb_is_up(tmp_path, monkeypatch):
    ckpts = tmp_path / "checkpoints"
    held = gate_wandb_init(monkeypatch, lambda: bool(checkpoint_files(ckpts)))
    run(compose_cfg("logger=wandb", "trainer.max_steps=4", "trainer.ckpt_every=2"), tmp_path)
    assert held == [True]
    (run_file,) = wandb_records.run_files(tmp_path)
    first = load_checkpoint(checkpoint_files(ckpts)[0])
    # the id a resume continues
    assert first["step"] == 2 and first["loggers"]["wandb"]["id"] == wandb_records.run_info(run_file)["id"]


NEVER_ANSWERS = """
import sys, threading
import wandb
from hydra import compose, initialize_config_dir
from halfprec.config.resolvers import register_resolvers
from halfprec.loggers.wandb import WandbSink
from halfprec.training.run import run

wandb.init = lambda *args, **kwargs: threading.Event().wait()  # no answer, no timeout: never returns
WandbSink._left_s = lambda self: 1.0  # finish gives up after 1 s, not W&B's timeout
register_resolvers()
with initialize_config_dir(sys.argv[1], version_base="1.3"):
    cfg = compose("train", overrides=["logger=wandb", "trainer.progress=false", *sys.argv[3:]])
run(cfg, sys.argv[2])
"""


@pytest.mark.parametrize(
    "overrides, code",
    [
        pytest.param(["trainer.max_steps=5"], 0, id="completed"),
        pytest.param(
            ["trainer.max_steps=5", "trainer.nonfinite=abort", "trainer.inject_nonfinite_at=[3]"],
            1,
            marks=pytest.mark.slow,
            id="crashed",
        ),
    ],
)
def test_a_wandb_init_that_never_returns_neither_holds_training_nor_keeps_the_process(tmp_path, overrides, code):
    args = [sys.executable, "-c", NEVER_ANSWERS, str(CONF), str(tmp_path), *overrides]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)  # before: blocked for ever
    assert proc.returncode == code, proc.stderr
    assert "warning: W&B could not start (no answer in " in proc.stderr
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "train/loss" in r][0] == 1


@pytest.mark.slow  # ~7 s: real wandb, waiting out its (shortened) init timeout
def test_wandb_online_without_network_trains_at_once_and_warns_in_one_line(tmp_path):
    env = {
        **os.environ,
        "WANDB_MODE": "online",
        "WANDB_API_KEY": "0" * 40,
        "WANDB_BASE_URL": "http://127.0.0.1:9",  # nothing listens: what no network looks like, quickly
        "WANDB_INIT_TIMEOUT": "3",  # the user's timeout wins over halfprec's
    }
    args = [sys.executable, str(TRAIN), *CHEAP, "trainer.progress=false", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    done = next(i for i, line in enumerate(lines) if line.startswith("done: 3 steps"))
    (warning,) = [i for i, line in enumerate(lines) if line.startswith("warning: W&B could not start (CommError: ")]
    assert done < warning  # training ran to its end while wandb.init waited for the server
    assert lines[warning].endswith("; metrics go to metrics.jsonl only")  # one line: no advice about init_timeout
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]


class StubRun:
    def __init__(self, id: str):
        self.id, self.rows, self.exit_codes = id, [], []
        self.summary: dict = {}

    def define_metric(self, *args, **kwargs) -> None:
        pass

    def log(self, row: dict) -> None:
        self.rows.append(row)

    def finish(self, exit_code: int = 0) -> None:
        self.exit_codes.append(exit_code)


def stub_wandb_init(monkeypatch, release: threading.Event) -> tuple[list[dict], list[StubRun]]:
    """wandb.init returns a StubRun once `release` is set: the keyword arguments of each call, the runs."""
    import wandb

    calls: list[dict] = []
    runs: list[StubRun] = []

    def init(**kwargs):
        calls.append(kwargs)
        release.wait(30)
        runs.append(StubRun(kwargs["id"] or os.environ["WANDB_RUN_ID"]))
        return runs[-1]

    monkeypatch.setattr(wandb, "init", init)
    return calls, runs


def test_a_sweep_agents_run_id_is_recorded_and_left_to_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_RUN_ID", "agentrun1")  # what `wandb agent` sets
    release = threading.Event()
    calls, runs = stub_wandb_init(monkeypatch, release)
    start = time.monotonic()
    tracker = tracking.build_tracker(typed_cfg("logger=wandb"), tmp_path)
    assert time.monotonic() - start < 10  # wandb.init waits for `release`, build_tracker does not
    assert tracker.state() == {"wandb": {"id": "agentrun1"}}  # what a checkpoint records before the run is up
    tracker.log({"step": 1, "train/loss": 2.0})
    release.set()
    tracker.finish({"status": "completed", "exit_code": 0})
    assert calls[0]["id"] is None  # wandb.init takes it from the environment (and warns about an id= in a sweep)
    assert runs[0].rows == [{"step": 1, "train/loss": 2.0}] and runs[0].exit_codes == [0]


def test_a_second_ctrl_c_does_not_wait_for_wandb_and_the_late_run_is_closed(tmp_path, monkeypatch, capsys):
    release = threading.Event()
    _, runs = stub_wandb_init(monkeypatch, release)
    start = time.monotonic()
    tracker = tracking.build_tracker(typed_cfg("logger=wandb"), tmp_path)
    tracker.log({"step": 1, "train/loss": 2.0})
    tracker.finish({"status": "interrupted", "exit_code": 130})
    assert time.monotonic() - start < 10  # a 2 s grace, not W&B's timeout
    assert "warning: W&B could not start (no answer in" in capsys.readouterr().err
    release.set()  # the run comes up after all: it is finished as failed, without the rows
    deadline = time.monotonic() + 10
    while not (runs and runs[0].exit_codes) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert runs[0].exit_codes == [1] and runs[0].rows == []


def test_the_next_wandb_run_in_the_process_waits_for_one_given_up_on(tmp_path, monkeypatch, capsys):
    """Multirun jobs share a process: job 2's wandb.init (reinit="finish_previous") must not
    start while job 1's late run is still coming up or finishing."""
    import wandb

    real, release, order = wandb.init, threading.Event(), []

    def init(**kwargs):
        job = kwargs["dir"].rsplit("/", 1)[-1]
        if job == "job1":
            release.wait(30)
        order.append(f"init {job}")
        return real(**kwargs)

    monkeypatch.setattr(wandb, "init", init)
    cfg = compose_cfg("logger=wandb", "trainer.max_steps=3", "trainer.log_every=1")
    with monkeypatch.context() as m:
        m.setattr(WandbSink, "_left_s", lambda self: 1.0)
        run(cfg, tmp_path / "job1")  # gives up on W&B after 1 s
    assert "warning: W&B could not start (no answer in" in capsys.readouterr().err
    release.set()
    run(cfg, tmp_path / "job2")
    assert order == ["init job1", "init job2"]
    (late,) = wandb_records.run_files(tmp_path / "job1")
    assert wandb_records.exit_codes(late) == [1] and wandb_records.history(late) == []  # rows: metrics.jsonl
    (second,) = wandb_records.run_files(tmp_path / "job2")
    assert wandb_records.exit_codes(second) == [0] and len(wandb_records.history(second)) == 3


def test_wandb_failing_to_start_is_one_warning_line(tmp_path, monkeypatch, capsys):
    import wandb

    def broken(**kwargs):
        raise wandb.errors.CommError("Timed out while retrying\nConsider increasing the init_timeout setting")

    monkeypatch.setattr(wandb, "init", broken)
    summary = run(compose_cfg("logger=wandb", "trainer.max_steps=4"), tmp_path)
    assert summary["exit_code"] == 0
    err = capsys.readouterr().err
    assert (
        "warning: W&B could not start (CommError: Timed out while retrying); metrics go to metrics.jsonl only\n" in err
    )


def test_new_run_ids_look_like_wandbs():
    ids = {new_run_id() for _ in range(100)}
    assert len(ids) == 100 and all(len(i) == 8 and i.isalnum() and i == i.lower() for i in ids)
