"""Preemption, non-finite policy and crash reports, corrupt checkpoints, W&B failures, secrets."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import read_jsonl
from test_resume import FP32, TRAIN, UNTIL_STOPPED, train_cmd, without_perf

from halfprec.errors import ConfigError
from halfprec.numerics.scaling import TrainingAborted
from halfprec.training.checkpoint import checkpoint_files, load_checkpoint
from halfprec.training.run import run

import wandb_records
from helpers import compose_cfg, own_session, signalled


def wait_for_rows(metrics, proc: subprocess.Popen, rows: int) -> None:
    """Until metrics.jsonl has more than `rows` rows; the run (trainer.max_steps=100000) is still going."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) > rows):
        time.sleep(0.005)
    assert proc.poll() is None, "the run ended before the signal"


@pytest.mark.parametrize(
    "signum",
    [
        pytest.param(signal.SIGTERM, marks=pytest.mark.slow, id="SIGTERM"),  # ~14 s each, one code path:
        pytest.param(signal.SIGUSR1, marks=pytest.mark.slow, id="SIGUSR1"),  # Ctrl-C's runs by default
        pytest.param(signal.SIGINT, id="Ctrl-C"),
    ],
)
def test_stop_signal_saves_a_checkpoint_and_the_resumed_run_is_exact(tmp_path, signum):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    subprocess.run(train_cmd(straight, *FP32), check=True, capture_output=True)
    # a session of its own: Ctrl-C in a terminal signals the whole foreground process group
    with signalled(train_cmd(stopped, *FP32, *UNTIL_STOPPED), stderr=subprocess.PIPE, text=True) as proc:
        wait_for_rows(stopped / "metrics.jsonl", proc, 2)  # two rows: the loop runs, with its handlers
        os.killpg(proc.pid, signum)
        _, err = proc.communicate(timeout=60)

    assert proc.returncode == 4, err
    assert err.splitlines()[0] == f"run dir: {stopped}"  # logger=none too
    name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    assert f"stopped: {name} at step" in err and "Traceback" not in err
    if signum == signal.SIGINT:
        assert "Ctrl-C: stopping after this step with a checkpoint; Ctrl-C again to quit now" in err
    metrics = stopped / "metrics.jsonl"
    stopped_at = load_checkpoint(checkpoint_files(stopped / "checkpoints")[-1])["step"]
    last_row = read_jsonl(metrics)[-1]["step"]
    assert last_row <= stopped_at < last_row + 5  # saved at the step it stopped (rows every 5)
    # the exact command it printed continues the run (to the straight run's end: the last max_steps wins)
    command = shlex.split(err.split("continue with: ", 1)[1].splitlines()[0])
    assert command == ["python", "train.py", *train_cmd(stopped, *FP32, *UNTIL_STOPPED)[2:], "resume=auto"]
    resumed = subprocess.run([sys.executable, str(TRAIN), *command[2:], "trainer.max_steps=400"], capture_output=True,
                             text=True)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert f"resume: from {stopped / 'checkpoints' / f'step-{stopped_at:08d}.pt'} at step {stopped_at} of 400" in (
        resumed.stderr
    )
    assert without_perf(read_jsonl(metrics)) == without_perf(read_jsonl(straight / "metrics.jsonl"))


# Steps of ~0.1 s or more: a second Ctrl-C arrives while the first one waits for its step to end.
LONG_STEPS = ["model.hidden=[2048,2048]", "data.batch_size=1024", "trainer.max_steps=100000"]


def test_a_second_ctrl_c_quits_at_once_and_says_what_is_on_disk(tmp_path):
    with signalled(train_cmd(tmp_path, *LONG_STEPS), stderr=subprocess.PIPE, text=True) as proc:
        wait_for_rows(tmp_path / "metrics.jsonl", proc, 0)
        os.killpg(proc.pid, signal.SIGINT)
        lines = []
        for line in proc.stderr:  # the first Ctrl-C is acknowledged at once, mid-step
            lines.append(line)
            if "Ctrl-C again to quit now" in line:
                break
        os.killpg(proc.pid, signal.SIGINT)
        err = "".join(lines) + proc.stderr.read()
        proc.wait(timeout=60)
    assert proc.returncode == 130, err
    assert err.count("Ctrl-C again to quit now") == 1 and "Traceback" not in err
    assert_says_what_is_on_disk(err, tmp_path)


@pytest.mark.slow  # ~4 s; the Ctrl-C path itself runs by default in the test above
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="sees pending signals through /proc")
def test_two_quick_ctrl_c_after_a_checkpoint_quit_and_name_it(tmp_path):
    """Two presses in a row, as a user who means it: Python may run one handler for both."""
    cmd = train_cmd(tmp_path, *LONG_STEPS, "trainer.ckpt_every=2")
    with signalled(cmd, stderr=subprocess.PIPE, text=True) as proc:
        deadline = time.monotonic() + 120
        while not checkpoint_files(tmp_path / "checkpoints"):
            assert time.monotonic() < deadline and proc.poll() is None, "no checkpoint was written"
            time.sleep(0.005)
        delivered(proc, signal.SIGINT)  # taken by its C-level handler, not yet by Python's: the kernel
        os.killpg(proc.pid, signal.SIGINT)  # would merge a second signal with a still pending one
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert_says_what_is_on_disk(err, tmp_path)


# train.py with its Ctrl-C pressed from inside: the first press (for a quit, two) after the first
# metrics row, one more as the run's ending enters `window`: where a press may land under load, made sure.
PRESSES = r"""
import atexit, signal, sys

_, ending, window, *sys.argv = sys.argv  # sys.argv: train.py and its overrides
pressed = []


def press(times=1):
    for _ in range(times):
        pressed.append(1)
        signal.raise_signal(signal.SIGINT)  # Python runs its handler as this call returns


def pressing(function):
    def pressed_in(*args, **kwargs):
        if pressed:
            press()
        return function(*args, **kwargs)
    return pressed_in


def first_row(log):
    def logged(self, row):
        log(self, row)
        if not pressed:
            press(1 if ending == "stop" else 2)
    return logged


if window == "exit":  # registered first: runs last of the exit hooks, after torch's
    atexit.register(press)
import runpy
from halfprec.launch import exits
from halfprec.training import run, signals, tracking

tracking.Tracker.log = first_row(tracking.Tracker.log)
where = {"stop": (signals.StopSignals, "stop"), "summary": (run, "write_summary"),
         "loggers": (tracking.Tracker, "finish"), "line": (exits, "failure_line")}
if window in where:
    owner, name = where[window]
    setattr(owner, name, pressing(getattr(owner, name)))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize(
    "ending, window",
    [
        ("stop", "exit"),  # the interpreter's exit hooks (torch's), then SIGINT's default action
        pytest.param("stop", "stop", marks=pytest.mark.slow),  # after the checkpoint, before the stop: a quit
        pytest.param("stop", "summary", marks=pytest.mark.slow),  # the same rule as "exit", in other places
        pytest.param("stop", "loggers", marks=pytest.mark.slow),
        pytest.param("stop", "line", marks=pytest.mark.slow),  # while the line that reports the stop is made
        pytest.param("quit", "summary", marks=pytest.mark.slow),  # a third press, in the quit's ending
        pytest.param("quit", "loggers", marks=pytest.mark.slow),
        ("quit", "exit"),
    ],
)
def test_ctrl_c_in_the_ending_leaves_it_whole(tmp_path, ending, window):
    """Once the stop or the quit is under way, one more Ctrl-C, wherever it lands, is ignored: the
    run ends as it began to (4 and the stop's line, 130 and the quit's), without a traceback."""
    cmd = train_cmd(tmp_path, "model.hidden=[64]", "trainer.log_every=1", *UNTIL_STOPPED)
    done = subprocess.run([cmd[0], "-c", PRESSES, ending, window, *cmd[1:]], capture_output=True, text=True,
                          timeout=300, preexec_fn=own_session)  # fmt: skip
    err = done.stderr
    assert "Traceback" not in err and "Exception ignored" not in err, err
    if ending == "stop" and window != "stop":
        assert done.returncode == 4, err
        assert err.strip().splitlines()[-1].startswith("stopped: Ctrl-C at step "), err
        summary = json.loads((tmp_path / "summary.json").read_text())
        assert (summary["status"], summary["exit_code"]) == ("stopped", 4)
    else:
        assert done.returncode == 130, err
        assert_says_what_is_on_disk(err, tmp_path)
        assert window != "stop" or " after saving " in err  # the stop's checkpoint is the one to resume from


def delivered(proc: subprocess.Popen, signum: int) -> None:
    """Send `signum` to the process and wait until it is no longer pending (/proc/<pid>/status)."""
    os.killpg(proc.pid, signum)
    bit, deadline = 1 << (signum - 1), time.monotonic() + 60
    status = Path(f"/proc/{proc.pid}/status")
    while any(int(line.split()[1], 16) & bit for line in status.read_text().splitlines() if "Pnd:" in line):
        assert time.monotonic() < deadline, "the signal stayed pending"
        time.sleep(0.001)


def assert_says_what_is_on_disk(err: str, run_dir) -> None:
    """The quit's line names the checkpoint a resume would take (or says there is none), no
    half-written file is left, and summary.json records the run as interrupted."""
    (line,) = [line for line in err.splitlines() if line.startswith("interrupted: ")]
    saved = checkpoint_files(run_dir / "checkpoints")
    if not saved:
        assert line.endswith("no checkpoint was saved yet: nothing to resume from"), line
    else:
        step = load_checkpoint(saved[-1])["step"]
        assert f"saving {saved[-1]}; " in line or f"the last checkpoint is {saved[-1]} (step {step}); " in line, line
        assert "; continue from it with: python train.py " in line and line.endswith(" resume=auto"), line
    assert [p.name for p in run_dir.glob("checkpoints/.*")] == []  # no temp file of a torn save
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["status"], summary["exit_code"]) == ("interrupted", 130)


def test_nonfinite_abort_without_a_scaler_saves_a_crash_checkpoint_and_names_the_culprit(tmp_path):
    cfg = compose_cfg("trainer.max_steps=20", "trainer.nonfinite=abort", "trainer.inject_nonfinite_at=[7]")
    with pytest.raises(TrainingAborted) as info:
        run(cfg, tmp_path)
    message = str(info.value)
    assert "step 7" in message and "non-finite gradients start at: fc1.bias" in message  # backward order: bias first
    assert "7:1!" in message  # the scale history tail marks the overflowed step
    crash = load_checkpoint(tmp_path / "checkpoints" / "crash-step-00000007.pt")
    assert all(t.isfinite().all() for t in crash["model"].values())  # never NaN weights
    assert checkpoint_files(tmp_path / "checkpoints") == []  # resume=auto does not pick a crash file


def test_a_run_that_ends_with_a_nonfinite_loss_diverged(tmp_path):
    """Without the skip limits a diverging run trains to its last step; a NaN loss there is no result."""
    cfg = compose_cfg("optim.lr=1e6", "trainer.max_steps=30", "scaler.max_consecutive_skips=null",
                      "scaler.max_overflow_rate=null")  # fmt: skip
    with pytest.raises(TrainingAborted, match=r"step 30: the run ended with val/loss = nan; the run is diverging"):
        run(cfg, tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["status"], summary["exit_code"], summary["steps"]) == ("diverged", 3, 30)
    assert summary["val/loss"] is None  # strict JSON: NaN is written as null
    assert checkpoint_files(tmp_path / "checkpoints")[-1].name == "step-00000030.pt"


def test_a_stopped_run_is_recorded_as_stopped_and_its_wandb_run_as_resumable(tmp_path, monkeypatch):
    from halfprec.errors import Preempted
    from halfprec.training.step import Stepper

    def step_then_signal(self, *args, **kwargs):  # SIGTERM arrives during step 3
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        calls.append(1)
        return real_step(self, *args, **kwargs)

    calls, real_step = [], Stepper.step
    monkeypatch.setattr(Stepper, "step", step_then_signal)
    with pytest.raises(Preempted, match="SIGTERM at step 3"):
        run(compose_cfg("logger=wandb", "trainer.max_steps=10"), tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["status"], summary["steps"], summary["exit_code"]) == ("stopped", 3, 4)
    (run_file,) = wandb_records.run_files(tmp_path)
    assert wandb_records.exit_codes(run_file) == [0]  # preempted, not failed: it resumes
    assert checkpoint_files(tmp_path / "checkpoints")[-1].name == "step-00000003.pt"


def test_nonfinite_skip_is_the_default(tmp_path):
    summary = run(compose_cfg("trainer.max_steps=10", "trainer.inject_nonfinite_at=[3,4]"), tmp_path)
    assert summary["scaler/skipped_steps"] == 2 and summary["exit_code"] == 0


def test_skip_storm_abort_reports_the_scale_history(tmp_path):
    cfg = compose_cfg("precision=fp16", "model.hidden=[16]", "trainer.max_steps=20",
                      "scaler.max_consecutive_skips=3", "trainer.inject_nonfinite_at=[5,6,7]")  # fmt: skip
    with pytest.raises(TrainingAborted, match=r"3 optimizer steps in a row[\s\S]*5:32768!, 6:16384!, 7:8192!"):
        run(cfg, tmp_path)
    assert (tmp_path / "checkpoints" / "crash-step-00000007.pt").exists()


@pytest.mark.parametrize("content", [b"", b"not a checkpoint", None], ids=["empty", "garbage", "foreign"])
def test_corrupt_checkpoint_is_a_clear_error(tmp_path, content):
    import torch

    ckpt = tmp_path / "checkpoints" / "step-00000010.pt"
    ckpt.parent.mkdir()
    if content is None:
        torch.save({"weights": torch.zeros(2)}, ckpt)
    else:
        ckpt.write_bytes(content)
    with pytest.raises(ConfigError, match=r"resume=.*(unreadable checkpoint|not a halfprec checkpoint)"):
        run(compose_cfg("resume=auto"), tmp_path)


def test_wandb_init_failure_keeps_training(tmp_path, monkeypatch, capsys):
    import wandb

    def broken(*args, **kwargs):
        raise RuntimeError("no route to host")

    monkeypatch.setattr(wandb, "init", broken)
    summary = run(compose_cfg("logger=wandb", "trainer.max_steps=5"), tmp_path)
    assert summary["exit_code"] == 0
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "train/loss" in r] == [1, 5]
    assert "W&B could not start (RuntimeError: no route to host)" in capsys.readouterr().err


def test_unwritable_wandb_dir_keeps_training(tmp_path, capsys):
    (tmp_path / "wandb").write_text("a file where W&B wants its directory")
    summary = run(compose_cfg("logger=wandb", "trainer.max_steps=5"), tmp_path)
    assert summary["exit_code"] == 0 and (tmp_path / "metrics.jsonl").exists()
    assert "warning:" in capsys.readouterr().err


def test_wandb_failing_midway_is_dropped_with_a_warning(tmp_path, monkeypatch, capsys):
    from halfprec.loggers.wandb import WandbSink

    calls = []

    def flaky(self, row):
        calls.append(row["step"])
        if len(calls) == 2:
            raise OSError("disk full")

    monkeypatch.setattr(WandbSink, "log", flaky)
    summary = run(compose_cfg("logger=wandb", "trainer.max_steps=30"), tmp_path)
    assert summary["exit_code"] == 0 and calls == [1, 10]  # dropped after the failure, training went on
    assert len([r for r in read_jsonl(tmp_path / "metrics.jsonl") if "train/loss" in r]) == 4
    assert "WandbSink.log failed (OSError: disk full)" in capsys.readouterr().err


def test_api_key_never_reaches_saved_files(tmp_path, monkeypatch, capsys):
    secret = "local-0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv("WANDB_API_KEY", secret)
    run(compose_cfg("logger=wandb", "trainer.max_steps=5", "trainer.ckpt_every=2"), tmp_path)
    assert wandb_records.run_files(tmp_path), capsys.readouterr().err
    for path in tmp_path.rglob("*"):  # metrics, checkpoints, the W&B run files
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path


def test_saved_configs_are_redacted(monkeypatch):
    from halfprec.config.saved import redact

    monkeypatch.setenv("WANDB_API_KEY", "s3cr3t-key")
    config = {"logger": {"note": "key=s3cr3t-key", "api_key": "other"}, "tags": ["s3cr3t-key", "ok"], "lr": 0.1}
    assert redact(config) == {"logger": {"note": "***", "api_key": "***"}, "tags": ["***", "ok"], "lr": 0.1}
    store = {"tracking_uri": "postgresql://bob:hunter2@db:5432/mlflow"}  # from $MLFLOW_TRACKING_URI
    assert redact(store) == {"tracking_uri": "postgresql://bob:***@db:5432/mlflow"}
    assert redact({"u": "http://db:5000/x", "s": "sqlite:///outputs/mlflow.db"}) == {
        "u": "http://db:5000/x",
        "s": "sqlite:///outputs/mlflow.db",
    }


REQUEUE_SCRIPT = """
import signal, sys
from pathlib import Path
from hydra import compose, initialize_config_dir

def requeue(signum, frame):  # stands in for submitit's handler: requeue, then exit
    Path(sys.argv[2], "requeued").write_text(str(signum))
    sys.exit(0)

signal.signal(signal.SIGUSR1, requeue)
from halfprec.config.resolvers import register_resolvers
from halfprec.training.run import run
register_resolvers()
with initialize_config_dir(sys.argv[1], version_base="1.3"):
    cfg = compose("train", overrides=["logger=none", "trainer.progress=false", "model.hidden=[512,512]",
                                      "trainer.max_steps=100000", "trainer.log_every=5", "trainer.ckpt_every=500"])
run(cfg, sys.argv[2])
"""


def test_stop_signal_is_handed_on_to_the_launcher_after_the_checkpoint(tmp_path):
    """Under submitit, SIGUSR1's own handler requeues the job: it must still run, after our save."""
    from helpers import CONF

    proc = subprocess.Popen([sys.executable, "-c", REQUEUE_SCRIPT, str(CONF), str(tmp_path)], stderr=subprocess.PIPE)
    metrics, deadline = tmp_path / "metrics.jsonl", time.monotonic() + 120
    while time.monotonic() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) > 10):
        time.sleep(0.005)
    assert proc.poll() is None, "the run ended before the signal"
    os.kill(proc.pid, signal.SIGUSR1)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()
    assert (tmp_path / "requeued").read_text() == str(int(signal.SIGUSR1))
    (ckpt,) = checkpoint_files(tmp_path / "checkpoints")
    last_row = read_jsonl(metrics)[-1]["step"]
    assert last_row <= load_checkpoint(ckpt)["step"] < last_row + 5  # saved at the stop, not at step 500


def test_resume_continues_the_same_wandb_run(tmp_path):
    run(compose_cfg("logger=wandb", "trainer.max_steps=10", "trainer.ckpt_every=5"), tmp_path)
    run(compose_cfg("logger=wandb", "trainer.max_steps=20", "resume=auto"), tmp_path)
    first, second = wandb_records.run_files(tmp_path)
    assert wandb_records.run_info(first)["id"] == wandb_records.run_info(second)["id"]
    steps = [h["step"] for h in wandb_records.history(second) if "train/loss" in h]
    assert steps and min(steps) > 10  # the resumed run logs only what comes after the checkpoint


def test_wandb_disabled_mode_trains(tmp_path):
    summary = run(compose_cfg("logger=wandb", "logger.wandb.mode=disabled", "trainer.max_steps=5"), tmp_path)
    assert summary["exit_code"] == 0 and wandb_records.run_files(tmp_path) == []


def test_optimizer_that_is_not_a_torch_optimizer_is_refused():
    from halfprec.config import validate_optimizer

    with pytest.raises(ConfigError, match="torch.optim.Optimizer subclass"):
        validate_optimizer(compose_cfg("optim._target_=collections.OrderedDict"))
