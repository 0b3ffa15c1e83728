"""torchrun DDP on CPU (gloo), two processes, as a user launches it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import read_jsonl

import wandb_records
from helpers import TINY, TRAIN, flops_per_step, own_session, torchrun, typed_cfg

pytestmark = pytest.mark.distributed


def final_weights(run_dir):
    ckpt = torch.load(run_dir / "checkpoints" / "step-00000004.pt", weights_only=False)
    return ckpt["model"]


def step_flops(rows: list[dict]) -> set[int]:
    """The FLOPs per optimizer step behind the rows' perf/tflops, one value if every row agrees."""
    return {round(flops_per_step(r)) for r in rows if "perf/tflops" in r}


def test_two_process_ddp_equals_one_process_with_twice_the_batch(tmp_path):
    ddp = torchrun(tmp_path, "trainer=ddp", "data.batch_size=8", "accum=2", f"hydra.run.dir={tmp_path / 'ddp'}")
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    one = torchrun(
        tmp_path, "data.batch_size=16", "accum=2", "logger=none", f"hydra.run.dir={tmp_path / 'one'}", nproc=0
    )
    assert one.returncode == 0, one.stderr[-3000:]

    a, b = final_weights(tmp_path / "ddp"), final_weights(tmp_path / "one")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6)
    rows_ddp, rows_one = read_jsonl(tmp_path / "ddp" / "metrics.jsonl"), read_jsonl(tmp_path / "one" / "metrics.jsonl")
    assert [r["train/loss"] for r in rows_ddp] == pytest.approx([r["train/loss"] for r in rows_one], abs=1e-6)
    summary = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    assert summary["effective_batch"] == 8 * 2 * 2 and summary["world_size"] == 2  # micro-batch x accum x world
    assert [r["samples"] for r in rows_ddp] == [r["samples"] for r in rows_one]
    assert step_flops(rows_ddp) == {step_flops(rows_one).pop() // 2}  # perf/tflops is per process
    # each rank evaluated its share of the validation set; the sums over ranks are the whole set's
    assert rows_ddp[-1]["val/loss"] == pytest.approx(rows_one[-1]["val/loss"], abs=1e-6)
    assert rows_ddp[-1]["val/acc"] == rows_one[-1]["val/acc"]

    # rank 0 alone made a run dir (nothing else in the launch dir) and owns the one W&B run
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ddp", "one"]
    (run_file,) = wandb_records.run_files(tmp_path / "ddp")
    assert wandb_records.exit_codes(run_file) == [0]
    assert wandb_records.summary(run_file)["world_size"] == 2


@pytest.mark.parametrize("trainer", ["ddp", "fsdp"])
def test_a_gpt_on_two_processes_equals_one_process_with_twice_the_batch(tmp_path, trainer):
    """task=lm: each rank's sequences, the validation tokens shared out with whole padded sequences."""
    gpt = ["task=lm", "model.n_layer=1", "model.n_embd=16", "model.n_head=2", "model.block_size=16", "logger=none",
           "trainer.max_steps=4", "trainer.log_every=1", "trainer.val_every=4", "sched=constant"]  # fmt: skip
    two = torchrun(tmp_path, f"trainer={trainer}", "data.batch_size=4", *gpt, f"hydra.run.dir={tmp_path / 'two'}",
                   tiny=False)  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    one = torchrun(tmp_path, "data.batch_size=8", *gpt, f"hydra.run.dir={tmp_path / 'one'}", nproc=0, tiny=False)
    assert one.returncode == 0, one.stderr[-3000:]
    a, b = final_weights(tmp_path / "two"), final_weights(tmp_path / "one")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-5)
    rows_two, rows_one = (read_jsonl(tmp_path / run / "metrics.jsonl") for run in ("two", "one"))
    assert [r["train/loss"] for r in rows_two] == pytest.approx([r["train/loss"] for r in rows_one], abs=1e-5)
    for key in ("val/loss", "val/bpb"):
        assert rows_two[-1][key] == pytest.approx(rows_one[-1][key], abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["ddp", "fsdp"])
def test_an_nvfp4_gpt_trains_on_two_processes(tmp_path, trainer):
    """The emulated layers under DDP and FSDP2: each rank rounds its own gradients stochastically
    (no equality with one process: the blocks along the tokens hold other tokens)."""
    gpt = ["task=lm", "model.n_layer=1", "model.n_embd=16", "model.n_head=2", "model.block_size=16", "logger=none",
           "trainer.max_steps=4", "trainer.log_every=1", "precision=nvfp4", "data.batch_size=4"]  # fmt: skip
    two = torchrun(tmp_path, f"trainer={trainer}", *gpt, f"hydra.run.dir={tmp_path / 'two'}", tiny=False)
    assert two.returncode == 0, two.stderr[-3000:]
    rows = read_jsonl(tmp_path / "two" / "metrics.jsonl")
    assert rows[0]["precision/layers/nvfp4"] == 4 and rows[0]["precision/layers/high"] == 1
    assert len(rows) == 4 and all(r["train/loss"] < 6 for r in rows) and rows[-1]["val/loss"] < 6


@pytest.mark.slow
@pytest.mark.parametrize("trainer, optim", [("ddp", "adamw_bf16"), ("fsdp", "adamw_bf16"), ("fsdp", "adamw8bit")])
def test_low_precision_optimizer_state_trains_on_two_processes(tmp_path, trainer, optim):
    """bf16 moments (halfprec's AdamW) and torchao's 8-bit AdamW under DDP and FSDP2 (sharded
    parameters: DTensors): the run completes, and rank 0's checkpoint holds the state they keep."""
    gpt = ["task=lm", "model.n_layer=1", "model.n_embd=64", "model.n_head=2", "model.block_size=64", "logger=none",
           "trainer.max_steps=3", "data.batch_size=4", f"optim={optim}"]  # fmt: skip
    two = torchrun(tmp_path, f"trainer={trainer}", *gpt, f"hydra.run.dir={tmp_path / 'two'}", tiny=False)
    assert two.returncode == 0, two.stderr[-3000:]
    rows = read_jsonl(tmp_path / "two" / "metrics.jsonl")
    assert rows[-1]["step"] == 3 and all(r["train/loss"] < 6 for r in rows if "train/loss" in r)


def test_overflow_injected_on_one_rank_skips_the_step_on_both(tmp_path):
    # the inf goes into rank 0's gradients only; the run ends with a check that both ranks hold
    # identical weights, scale and skip count, which fails loudly if rank 1 had stepped
    result = torchrun(
        tmp_path,
        "trainer=ddp",
        "precision=fp16",
        "logger=none",
        "data.batch_size=8",
        "trainer.inject_nonfinite_at=[2]",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["scaler/skipped"] for r in rows] == [0, 1, 0, 0]
    assert rows[1]["scaler/scale"] == rows[0]["scaler/scale"] / 2


def test_a_window_of_skipped_steps_after_a_checkpoint_logs_the_mean_loss_over_ranks(tmp_path):
    """A checkpoint takes the window's loss sum to the host; if every later step of the window is
    skipped, the row's loss is that float, still averaged over ranks: the same as one process."""
    common = ["logger=none", "trainer.max_steps=5", "trainer.log_every=5", "trainer.ckpt_every=3",
              "trainer.inject_nonfinite_at=[4,5]"]  # fmt: skip
    ddp = torchrun(tmp_path, "trainer=ddp", "data.batch_size=8", *common, f"hydra.run.dir={tmp_path / 'ddp'}")
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    one = torchrun(tmp_path, "data.batch_size=16", *common, f"hydra.run.dir={tmp_path / 'one'}", nproc=0)
    assert one.returncode == 0, one.stderr[-3000:]
    (last_ddp,), (last_one,) = (
        [r for r in read_jsonl(tmp_path / run / "metrics.jsonl") if r["step"] == 5] for run in ("ddp", "one")
    )
    assert last_ddp["scaler/skipped"] == 2 and last_ddp["train/loss"] == pytest.approx(last_one["train/loss"], rel=1e-5)


def test_ddp_without_torchrun_is_a_config_error(cli):
    result = cli.run("trainer=ddp", "logger=none")
    assert result.returncode == 2
    assert "trainer.distributed=ddp: start it as several processes: torchrun --nproc_per_node=2" in result.output


def test_two_process_fsdp_equals_one_process_with_twice_the_batch(tmp_path):
    # fp32 FSDP: sharded weights and optimizer state, reduce-scattered grads, accumulation with the
    # gradient sync off for the first micro-batch; the full-state checkpoint loads as a plain model's
    # (AdamW with clipping: the clip uses the global norm of the sharded gradients)
    common = ["accum=2", "logger=none", "optim=adamw", "optim.clip_grad_norm=0.05"]
    fsdp = torchrun(tmp_path, "trainer=fsdp", "data.batch_size=8", *common, f"hydra.run.dir={tmp_path / 'fsdp'}")
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    one = torchrun(tmp_path, "data.batch_size=16", *common, f"hydra.run.dir={tmp_path / 'one'}", nproc=0)
    assert one.returncode == 0, one.stderr[-3000:]
    a, b = final_weights(tmp_path / "fsdp"), final_weights(tmp_path / "one")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6)
    rows_fsdp, rows_one = (
        read_jsonl(tmp_path / "fsdp" / "metrics.jsonl"),
        read_jsonl(tmp_path / "one" / "metrics.jsonl"),
    )
    assert [r["train/loss"] for r in rows_fsdp] == pytest.approx([r["train/loss"] for r in rows_one], abs=1e-6)
    assert rows_fsdp[-1]["val/loss"] == pytest.approx(rows_one[-1]["val/loss"], abs=1e-6)
    assert rows_fsdp[-1]["val/acc"] == rows_one[-1]["val/acc"]
    assert step_flops(rows_fsdp) == {step_flops(rows_one).pop() // 2}  # counted on the gathered weights


@pytest.mark.slow
def test_fsdp_bf16_policy_trains_skips_together_and_resumes_at_another_world_size(tmp_path):
    run_dir = tmp_path / "run"
    common = ["trainer=fsdp", "precision=bf16", "logger=none", "data.batch_size=8", "trainer.inject_nonfinite_at=[2]"]
    common += ["trainer.log_every=4", f"hydra.run.dir={run_dir}"]
    first = torchrun(tmp_path, *common, "trainer.max_steps=12")
    assert first.returncode == 0, first.stderr[-3000:]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    # FSDP's MixedPrecisionPolicy: Linear layers compute in bf16, the stored weight shards stay fp32
    assert rows[0]["precision/compute_dtype"] == "bfloat16" and rows[0]["precision/param_dtype"] == "float32"
    assert [r["scaler/skipped"] for r in rows] == [0, 1, 0, 0]  # inf on rank 0 only; both ranks skipped
    assert rows[-1]["train/loss"] < rows[0]["train/loss"] - 0.1
    ckpt = torch.load(run_dir / "checkpoints" / "step-00000012.pt", weights_only=False)
    assert ckpt["world_size"] == 2 and all(not hasattr(t, "placements") for t in ckpt["model"].values())

    resumed = torchrun(tmp_path, *common, "resume=auto", "trainer.max_steps=16", nproc=1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resume: world size 2 -> 1: the effective batch becomes 8" in resumed.stderr
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 4, 8, 12, 16] and rows[-1]["scaler/skipped_steps"] == 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer=fsdp", "precision=bf16_pure"], "precision=bf16_pure: trainer=fsdp keeps fp32 weight shards"),
        (
            ["trainer=ddp", "precision.reduce_dtype=bfloat16"],
            "precision.reduce_dtype=bfloat16: applies to trainer=fsdp only",
        ),
    ],
)
def test_fsdp_config_errors(monkeypatch, overrides, message):
    from halfprec.config import validate
    from halfprec.errors import ConfigError

    from helpers import compose_cfg

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError) as info:
        validate(compose_cfg(*overrides))
    assert message in str(info.value)


def worker_pid(agent_pid: int, rank: int) -> int | None:
    """The pid of torchrun's worker with RANK=`rank` (from /proc: children of the agent, by environment)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
        if ppid == agent_pid and f"RANK={rank}".encode() in env:
            return int(entry.name)
    return None


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the worker through /proc")
@pytest.mark.parametrize("how", [pytest.param("SIGTERM to rank 1", marks=pytest.mark.slow), "Ctrl-C"])
def test_stop_signal_on_one_rank_stops_every_rank_at_the_same_step_with_a_checkpoint(tmp_path, how):
    # SIGTERM to rank 1 alone: without an agreement rank 0 would train on and hang in the next all-reduce.
    # Ctrl-C as a terminal sends it: to torchrun's process group; the workers have sessions of their
    # own, and torchrun hands the SIGINT on to each of them
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", str(TRAIN), *TINY]
    args += [
        "trainer=ddp",
        "logger=none",
        "trainer.max_steps=100000",
        "trainer.ckpt_every=0",
        f"hydra.run.dir={run_dir}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # its own process group, so that a failure here takes the workers down with the agent
    agent = subprocess.Popen(args, cwd=tmp_path, env=env, stderr=subprocess.PIPE, preexec_fn=own_session)
    try:
        deadline = time.monotonic() + 120
        metrics = run_dir / "metrics.jsonl"
        while not metrics.exists() or len(metrics.read_text().splitlines()) < 3:
            assert time.monotonic() < deadline and agent.poll() is None, "the run did not start"
            time.sleep(0.2)
        if how == "Ctrl-C":
            os.killpg(agent.pid, signal.SIGINT)
        else:
            pid = worker_pid(agent.pid, rank=1)
            assert pid is not None
            os.kill(pid, signal.SIGTERM)
        _, stderr = agent.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):  # nothing left of the group: all exited
            os.killpg(agent.pid, signal.SIGKILL)
    stderr = stderr.decode()
    assert agent.returncode == 1  # torchrun's own code when a worker exits non-zero (each worker: 4)
    (ckpt,) = (run_dir / "checkpoints").glob("step-*.pt")
    stopped_at = int(ckpt.stem.split("-")[1])
    if how == "Ctrl-C":
        # one per rank (the ranks share the pipe: a line may start inside another rank's)
        stops = re.findall(r"stopped: (Ctrl-C|a stop signal on another rank) at step (\d+): saved", stderr)
        assert len(stops) == 2 and {int(step) for _, step in stops} == {stopped_at}, stderr[-3000:]
        assert "Ctrl-C" in {how for how, _ in stops}
        assert stderr.count("Ctrl-C again to quit now") == 1  # rank 0 says so for the run
        return
    assert f"stopped: SIGTERM at step {stopped_at}" in stderr  # rank 1
    assert f"stopped: a stop signal on another rank at step {stopped_at}" in stderr  # rank 0, same step
    assert read_jsonl(run_dir / "metrics.jsonl")[-1]["step"] == stopped_at < 100000

    # and the run continues from it, on both ranks
    resumed = torchrun(tmp_path, "trainer=ddp", "logger=none", "resume=auto", f"trainer.max_steps={stopped_at + 2}",
                       f"hydra.run.dir={run_dir}")  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert read_jsonl(run_dir / "metrics.jsonl")[-1]["step"] == stopped_at + 2


def _bn_net() -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.Flatten()
    )
    return net.append(torch.nn.Linear(64, 10))


def _evaluate_on_rank(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    from halfprec.components.data.arrays import make_synthetic
    from halfprec.components.tasks.classification import Classification
    from halfprec.numerics.policy import PrecisionPolicy
    from halfprec.training.distributed import World
    from halfprec.training.metrics import evaluate

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    net = _bn_net()
    net[1].running_mean.fill_(3.0 * rank)  # the ranks' BatchNorm statistics differ, as after FSDP training
    policy = PrecisionPolicy.from_config(typed_cfg().precision, "cpu")
    data = make_synthetic(shape=[1, 4, 4], num_train=8, num_val=15)
    metrics = evaluate(net, data, Classification(), policy, 4, torch.device("cpu"), World(rank, 2))
    metrics["running_mean"] = net[1].running_mean.tolist()
    Path(out, f"rank{rank}.json").write_text(json.dumps(metrics))
    dist.destroy_process_group()


def test_ranks_evaluate_shares_of_the_validation_set_with_rank_0s_batchnorm_statistics(tmp_path):
    # 15 samples: rank 0 takes 8, rank 1 7 and one padding sample; the sums over both equal one
    # process's evaluation of the whole set with rank 0's model (statistics included)
    from halfprec.components.data.arrays import make_synthetic
    from halfprec.components.tasks.classification import Classification
    from halfprec.numerics.policy import PrecisionPolicy
    from halfprec.training.metrics import evaluate

    torch.multiprocessing.spawn(_evaluate_on_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]

    data = make_synthetic(shape=[1, 4, 4], num_train=8, num_val=15)
    policy = PrecisionPolicy.from_config(typed_cfg().precision, "cpu")
    net = _bn_net()
    alone = evaluate(net, data, Classification(), policy, 4, torch.device("cpu"))
    net[1].running_mean.fill_(3.0)
    with_rank_1_statistics = evaluate(net, data, Classification(), policy, 4, torch.device("cpu"))
    assert with_rank_1_statistics["val/loss"] != pytest.approx(alone["val/loss"], rel=1e-3)  # the test can tell
    for metrics in ranks:
        assert metrics["val/loss"] == pytest.approx(alone["val/loss"], rel=1e-6)
        assert metrics["val/acc"] == alone["val/acc"]
        assert metrics["running_mean"] == [0.0] * 4
