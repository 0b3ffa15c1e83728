"""Checkpoints and exact resume: a run killed with SIGKILL and resumed equals an uninterrupted one."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import read_jsonl

from halfprec.errors import ConfigError
from halfprec.training.checkpoint import checkpoint_files, load_checkpoint, save_checkpoint
from halfprec.training.run import run

from helpers import compose_cfg

TRAIN = Path(__file__).resolve().parents[1] / "train.py"
FP32 = ["model.hidden=[512,512]", "trainer.max_steps=400", "sched.total_steps=400", "trainer.ckpt_every=25",
        "trainer.log_every=5", "trainer.val_every=50"]  # fmt: skip
LM_TINY = ["model.n_layer=1", "model.n_embd=16", "model.n_head=2", "model.block_size=16"]
FP16 = ["precision=fp16", "model.hidden=[64]", "trainer.max_steps=300", "sched.total_steps=300",
        "trainer.ckpt_every=25", "trainer.log_every=1", "scaler.growth_interval=7",
        "trainer.inject_nonfinite_at=[30,31,90,200]"]  # fmt: skip
# Appended to a run that a test stops or kills midway: it cannot end before the signal comes, however
# the machine schedules the test (a poller starved under load could see a 400-step run end first).
# The last value of a repeated override wins; the cosine keeps its horizon (sched.total_steps above),
# and trainer.max_steps may change on resume, so the run then resumes to the same end as a straight one.
UNTIL_STOPPED = ["trainer.max_steps=100000"]


def train_cmd(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, str(TRAIN), "logger=none", "trainer.progress=false", *overrides, f"hydra.run.dir={run_dir}"]


def kill_midway(run_dir: Path, overrides: list[str], after_step: int) -> int:
    """Start a run, SIGKILL it once metrics.jsonl shows `after_step`; return the last step it logged."""
    cmd = train_cmd(run_dir, *overrides, *UNTIL_STOPPED)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        rows = complete_rows(metrics)
        if rows and rows[-1]["step"] >= after_step:
            break
        time.sleep(0.002)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    return complete_rows(metrics)[-1]["step"]


def complete_rows(path: Path) -> list[dict]:
    """Rows of a metrics.jsonl being written (or killed mid-write): a torn last line is left out."""
    if not path.exists():
        return []
    lines = path.read_text().splitlines(keepends=True)
    return [json.loads(line) for line in lines if line.endswith("\n")]


def without_perf(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


@pytest.mark.parametrize(
    "overrides,kill_at",
    [pytest.param(FP32, 130, marks=pytest.mark.slow, id="fp32"), pytest.param(FP16, 110, id="fp16-dynamic")],
)
def test_sigkill_then_resume_equals_an_uninterrupted_run(tmp_path, overrides, kill_at):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    subprocess.run(train_cmd(straight, *overrides), check=True, capture_output=True)
    last = kill_midway(killed, overrides, kill_at)
    max_steps = int(next(o for o in overrides if o.startswith("trainer.max_steps=")).split("=")[1])
    assert last < max_steps
    resumed = subprocess.run(train_cmd(killed, *overrides, "resume=auto"), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr

    a, b = read_jsonl(straight / "metrics.jsonl"), read_jsonl(killed / "metrics.jsonl")
    assert [r["step"] for r in b] == [r["step"] for r in a]  # rows logged after the checkpoint were replaced
    assert without_perf(b) == without_perf(a)  # bitwise: floats compare exactly
    ca = load_checkpoint(checkpoint_files(straight / "checkpoints")[-1])
    cb = load_checkpoint(checkpoint_files(killed / "checkpoints")[-1])
    for name, tensor in ca["model"].items():
        assert torch.equal(cb["model"][name], tensor), name
    assert cb["scaler"] == ca["scaler"]
    if "precision=fp16" in overrides:
        scales = [r["scaler/scale"] for r in a]
        assert len(set(scales)) > 3 and ca["scaler"]["skipped_steps"] >= 4  # the scale really moved


def test_a_torn_last_metrics_line_is_dropped_on_resume(tmp_path):
    run(compose_cfg("trainer.max_steps=20", "trainer.ckpt_every=10", "trainer.log_every=5"), tmp_path)
    metrics = tmp_path / "metrics.jsonl"
    keep = "".join(line for line in metrics.read_text().splitlines(keepends=True) if json.loads(line)["step"] <= 10)
    metrics.write_text(keep + '{"step": 15, "train/lo')  # what a SIGKILL mid-write leaves
    (tmp_path / "checkpoints" / "step-00000020.pt").unlink()
    run(compose_cfg("trainer.max_steps=20", "trainer.ckpt_every=10", "trainer.log_every=5", "resume=auto"), tmp_path)
    assert [r["step"] for r in read_jsonl(metrics)] == [1, 5, 10, 15, 20]


def test_checkpoints_are_atomic_and_pruned(tmp_path):
    for step in (10, 20, 30, 40):
        save_checkpoint({"step": step}, tmp_path, step, keep=2)
    (tmp_path / ".step-00000050.pt.tmp-123").write_bytes(b"torn")  # a save killed midway
    assert [p.name for p in checkpoint_files(tmp_path)] == ["step-00000030.pt", "step-00000040.pt"]


def test_resume_refuses_a_different_model_and_allows_more_steps(tmp_path, capsys):
    run(compose_cfg("trainer.max_steps=20", "trainer.ckpt_every=10"), tmp_path)
    with pytest.raises(ConfigError, match=r"model.hidden=.*trained with"):
        run(compose_cfg("trainer.max_steps=30", "resume=auto", "model.hidden=[8]"), tmp_path)
    with pytest.raises(ConfigError, match=r"trainer.max_steps=15: .*step-00000020.pt is at step 20 already: set "):
        run(compose_cfg("trainer.max_steps=15", "resume=auto"), tmp_path)  # was "done: -5 steps", exit 0
    summary = run(compose_cfg("trainer.max_steps=30", "resume=auto"), tmp_path)
    assert "trainer.max_steps: 20 -> 30 (allowed)" in capsys.readouterr().err
    assert summary["steps"] == 30
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")][-1] == 30


def test_resume_auto_without_a_checkpoint_starts_fresh_and_a_missing_path_is_an_error(tmp_path, capsys):
    summary = run(compose_cfg("resume=auto", "trainer.max_steps=5"), tmp_path / "new")
    assert summary["steps"] == 5 and "no checkpoint in" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="no such file"):
        run(compose_cfg(f"resume={tmp_path}/nope.pt"), tmp_path / "other")


def test_resume_auto_in_a_new_run_dir_says_it_continues_nothing(tmp_path):
    """resume=auto without hydra.run.dir: Hydra makes a new dir, so the line says how to continue a run."""
    cmd = [sys.executable, str(TRAIN), "logger=none", "trainer.max_steps=2", "model.hidden=[16]", "resume=auto"]
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = (tmp_path / "outputs" / "runs").glob("*/*")
    assert (
        f"resume=auto: {run_dir} is a new run dir, with nothing to continue: training starts at step 0; to continue "
        "a run, add hydra.run.dir=<its dir> (its line 'run dir: ...')"
    ) in result.stderr.splitlines()


OLD_CHECKPOINT = Path(__file__).parent / "data" / "checkpoint-80b0cad-bf16_pure_kahan.pt"


def test_a_checkpoint_written_before_the_redesign_still_resumes(tmp_path, capsys):
    """tests/data/README.md says how it was made; its config lacks the keys added since (task,
    trainer.threads, scaler.max_overflow_rate), which resume as the older versions behaved."""
    overrides = ["model.hidden=[16]", "trainer.log_every=2", "trainer.val_every=0", "precision=bf16_pure_kahan"]
    summary = run(compose_cfg(*overrides, "trainer.max_steps=6", f"resume={OLD_CHECKPOINT}"), tmp_path)
    assert (summary["status"], summary["steps"]) == ("completed", 6)
    assert f"resume: from {OLD_CHECKPOINT} at step 4 of 6" in capsys.readouterr().err
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows if "train/loss" in r] == [6] and all(math.isfinite(r["train/loss"]) for r in rows)


def test_a_longer_run_keeps_the_schedules_horizon_and_says_what_the_lr_does(tmp_path, capsys):
    """Resuming with a larger trainer.max_steps used to restart the cosine (lr 4.7e-06 at the
    checkpoint, 0.050 ten steps later); the horizon now stays unless sched.total_steps says otherwise."""
    common = ["trainer.ckpt_every=20", "trainer.log_every=1", "sched.warmup_steps=0"]
    run(compose_cfg(*common, "trainer.max_steps=20"), tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    capsys.readouterr()

    run(compose_cfg(*common, "trainer.max_steps=30", "resume=auto"), tmp_path / "a")
    err = capsys.readouterr().err
    assert "resume: the cosine keeps its horizon of 20 steps: past them the lr stays at 0 (its end); " in err
    assert "add sched.total_steps=30 to decay over the new length" in err
    lrs = {r["step"]: r["train/lr"] for r in read_jsonl(tmp_path / "a" / "metrics.jsonl")}
    assert all(lrs[step] == 0.0 for step in range(21, 31)), lrs

    run(compose_cfg(*common, "trainer.max_steps=30", "sched.total_steps=30", "resume=auto"), tmp_path / "b")
    assert "resume: sched.total_steps 20 -> 30: the lr goes from" in capsys.readouterr().err
    lrs = {r["step"]: r["train/lr"] for r in read_jsonl(tmp_path / "b" / "metrics.jsonl")}
    lr = compose_cfg().optim.lr
    for step in range(21, 31):  # the lr of step s is the schedule's value after s - 1 scheduler steps
        assert lrs[step] == pytest.approx(lr * 0.5 * (1 + math.cos(math.pi * (step - 1) / 30)), rel=1e-6)


@pytest.mark.parametrize(
    "first, then, named",
    [
        (["task=lm", *LM_TINY], [], "trained with task.name=lm, model.arch=gpt, data.name=pydoc, "
         "optim._target_=torch.optim.AdamW, where this run has task.name=classification, model.arch=mlp, "
         "data.name=digits, optim._target_=torch.optim.SGD"),
        (["model.hidden=[16]"], ["model=fixup_resnet", "model.widths=[4,8,8]", "model.blocks_per_stage=1"],
         "trained with model.arch=mlp, where this run has model.arch=fixup_resnet"),
    ],
    ids=["an lm checkpoint", "another model"],
)  # fmt: skip
def test_a_checkpoint_of_another_run_is_named_as_such(tmp_path, first, then, named):
    run(compose_cfg(*first, "trainer.max_steps=2", "trainer.val_every=0"), tmp_path)
    ckpt = checkpoint_files(tmp_path / "checkpoints")[-1]
    with pytest.raises(ConfigError) as info:  # said before a max_steps below the checkpoint's step, which is moot
        run(compose_cfg(*then, "trainer.max_steps=1", f"resume={ckpt}"), tmp_path / "other")
    assert str(info.value) == (
        f"resume={ckpt}: a checkpoint of another run: {named}; resume with the overrides it was started with"
    )
