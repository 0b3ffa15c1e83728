"""One run on processes that something other than `torchrun --standalone` starts: the tasks of a
submitit job (hydra/launcher=submitit_local runs them as SLURM would, as local processes), and
torchrun on two "nodes" of one machine that meet at a rendezvous. CPU, gloo, as a user launches them."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import read_jsonl

import wandb_records
from helpers import TINY, TRAIN, torchrun

pytestmark = pytest.mark.distributed

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def submitit_sweep(tmp_path: Path, *overrides: str, tasks: int = 2) -> subprocess.Popen:
    """`python train.py -m hydra/launcher=submitit_local hydra.launcher.tasks_per_node=N ...`, started."""
    args = [sys.executable, str(TRAIN), "-m", "hydra/launcher=submitit_local", f"hydra.launcher.tasks_per_node={tasks}"]
    args += [*overrides, f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    # its own session: a failing test takes the submitit controller and its tasks down with it
    return subprocess.Popen(args, cwd=tmp_path, env=ENV, stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 300) -> str:
    """Wait for the sweep; its stderr. Whatever is left of its process group is killed."""
    try:
        return proc.communicate(timeout=timeout)[1]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def the_job(tmp_path: Path) -> tuple[dict, Path]:
    """The sweep's one job: its sweep.jsonl line (one, whatever its task count) and its dir."""
    (line,) = read_jsonl(tmp_path / "sweep" / "sweep.jsonl")
    return line, Path(line["dir"])


def weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / f"step-{step:08d}.pt", weights_only=False)["model"]


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=atol)


@pytest.mark.parametrize("trainer", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_a_submitit_job_of_two_tasks_is_one_run_like_one_process_with_twice_the_batch(tmp_path, trainer):
    common = [*TINY, "accum=2", "optim=adamw", "optim.clip_grad_norm=0.05"]
    sweep = submitit_sweep(tmp_path, f"trainer={trainer}", "data.batch_size=8", *common)
    stderr = finish(sweep)
    assert sweep.returncode == 0, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == f"sweep: 1 completed; {tmp_path / 'sweep'}/sweep.jsonl (exit 0)"
    line, job = the_job(tmp_path)
    assert line["status"] == "completed"

    one = torchrun(tmp_path, "data.batch_size=16", *common, "logger=none", f"hydra.run.dir={tmp_path / 'one'}", nproc=0)
    assert one.returncode == 0, one.stderr[-3000:]
    assert_same_weights(weights(job, 4), weights(tmp_path / "one", 4), atol=1e-6)
    rows, rows_one = read_jsonl(job / "metrics.jsonl"), read_jsonl(tmp_path / "one" / "metrics.jsonl")
    assert [r["train/loss"] for r in rows] == pytest.approx([r["train/loss"] for r in rows_one], abs=1e-6)
    assert [r["samples"] for r in rows] == [r["samples"] for r in rows_one]

    summary = wandb_records.summary(wandb_records.run_files(job)[0])  # rank 0's, the one W&B run
    assert (summary["world_size"], summary["effective_batch"]) == (2, 8 * 2 * 2)
    assert len(wandb_records.run_files(job)) == 1


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the task through /proc")
def test_a_preempted_submitit_job_stops_every_task_at_one_step_and_its_requeue_resumes_bitwise(tmp_path):
    """SLURM warns a job with USR2 before it preempts it (submitit asks for USR2). Here it reaches
    task 1 alone: task 0 must still stop at the same step, save, and have submitit requeue the job,
    whose tasks continue from the checkpoint (resume=auto) to what an uninterrupted run computes."""
    common = ["trainer=ddp", "model.hidden=[256,256]", "data.batch_size=32", "trainer.max_steps=1500",
              "trainer.log_every=5", "trainer.val_every=0", "trainer.ckpt_every=0", "logger=none"]  # fmt: skip
    sweep = submitit_sweep(tmp_path, *common, "resume=auto")
    try:
        metrics, deadline = None, time.monotonic() + 120
        while metrics is None or not metrics.exists() or len(metrics.read_text().splitlines()) < 4:
            assert time.monotonic() < deadline and sweep.poll() is None, "the job did not start"
            jobs = list((tmp_path / "sweep").glob("0_*"))
            metrics = jobs[0] / "metrics.jsonl" if jobs else None
            time.sleep(0.005)
        os.kill(task_pid(tmp_path, rank=1), signal.SIGUSR2)
    finally:
        stderr = finish(sweep)
    assert sweep.returncode == 0, stderr[-3000:]
    line, job = the_job(tmp_path)
    assert line["status"] == "completed"

    log = (tmp_path / "sweep" / ".submitit").glob("*/*_0_log.err")
    text = "".join(path.read_text() for path in log)
    assert text.count("run dir: ") == 2, text[-3000:]  # task 0 started twice: the requeue
    stopped_at = int(text.split("resume: from ")[1].split(" at step ")[1].split()[0])
    assert 15 <= stopped_at < 1500  # after the 4th logged row (step 15), before the end
    assert (job / "checkpoints" / f"step-{stopped_at:08d}.pt").exists()  # saved at the stop

    straight = torchrun(tmp_path, *common, f"hydra.run.dir={tmp_path / 'straight'}", tiny=False)
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert_same_weights(weights(job, 1500), weights(tmp_path / "straight", 1500), atol=0)
    logged = [(r["step"], r["train/loss"]) for r in read_jsonl(job / "metrics.jsonl")]
    assert logged == [(r["step"], r["train/loss"]) for r in read_jsonl(tmp_path / "straight" / "metrics.jsonl")]


def task_pid(tmp_path: Path, rank: int) -> int:
    """The pid of the submitit task with global rank `rank` of the sweep under tmp_path (from /proc)."""
    for entry in Path("/proc").iterdir():
        try:
            env = (entry / "environ").read_bytes().split(b"\0") if entry.name.isdigit() else []
        except OSError:
            continue  # exited meanwhile, or not ours to read
        if f"SUBMITIT_LOCAL_GLOBALID={rank}".encode() in env and any(str(tmp_path).encode() in e for e in env):
            return int(entry.name)
    raise AssertionError(f"no submitit task with rank {rank} under {tmp_path}")


def test_a_failed_submitit_job_is_one_line_and_one_record_in_the_sweep(tmp_path):
    """The tasks' exception crosses back to the sweep (pickled): the same line and exit code as in
    one process, no traceback, one sweep.jsonl line for the job of two tasks."""
    sweep = submitit_sweep(tmp_path, *TINY, "trainer=ddp", "init=fixup", "logger=none")
    stderr = finish(sweep)
    assert sweep.returncode == 5 and "Traceback" not in stderr, stderr[-3000:]
    line, _ = the_job(tmp_path)
    assert line["status"] == "failed" and line["error"].startswith("ConfigError: init=fixup")
    shown = stderr.strip().splitlines()[-2:]
    assert shown == [line["message"], f"sweep: 1 failed; {tmp_path / 'sweep'}/sweep.jsonl (exit 5)"]
    assert shown[0].startswith("job 0 (") and "error: init=fixup: model=mlp has no residual branches" in shown[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("rendezvous", ["c10d", pytest.param("static", marks=pytest.mark.slow)])
def test_two_torchrun_nodes_train_like_two_ranks_of_one_node(tmp_path, rendezvous):
    """Two torchrun agents of one process each, as on two machines (--nnodes=2), meet at a c10d
    rendezvous endpoint (or a static master address with --node-rank); the run equals
    `torchrun --standalone --nproc_per_node=2` bit for bit."""
    port = free_port()
    meet = ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=halfprec-test"]
    overrides = [*TINY, "trainer=ddp", "logger=none", "data.batch_size=8"]
    nodes = []
    for node_rank in (0, 1):
        if rendezvous == "static":
            meet = [f"--node-rank={node_rank}", "--master-addr=127.0.0.1", f"--master-port={port}"]
        args = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", *meet, str(TRAIN)]
        args += [*overrides, f"hydra.run.dir={tmp_path / 'nodes'}"]
        cwd = tmp_path / f"node{node_rank}"  # each "machine" starts in a dir of its own
        cwd.mkdir()
        nodes.append(subprocess.Popen(args, cwd=cwd, env=ENV, stderr=subprocess.PIPE, text=True))
    errors = [node.communicate(timeout=300)[1] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(e[-2000:] for e in errors)

    local = torchrun(tmp_path, *overrides, f"hydra.run.dir={tmp_path / 'local'}", tiny=False)
    assert local.returncode == 0, local.stderr[-3000:]
    assert_same_weights(weights(tmp_path / "nodes", 4), weights(tmp_path / "local", 4), atol=0)
    rows = read_jsonl(tmp_path / "nodes" / "metrics.jsonl")
    assert [r["train/loss"] for r in rows] == [
        r["train/loss"] for r in read_jsonl(tmp_path / "local" / "metrics.jsonl")
    ]
    assert [p.name for p in (tmp_path / "node1").iterdir()] == []  # the other node's rank made no run dir
