"""torchrun DDP on CPU (gloo), two processes, as a user launches it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import TRAIN, read_jsonl

import wandb_records

pytestmark = pytest.mark.distributed

TINY = ["trainer.max_steps=4", "trainer.log_every=1", "trainer.val_every=0", "model.hidden=[32]"]


def torchrun(cwd, *overrides: str, nproc: int = 2) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone"]
    if nproc == 1:
        args = [sys.executable]
    args += [str(TRAIN), *TINY, *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def final_weights(run_dir):
    ckpt = torch.load(run_dir / "checkpoints" / "step-00000004.pt", weights_only=False)
    return ckpt["model"]


def test_two_process_ddp_equals_one_process_with_twice_the_batch(tmp_path):
    ddp = torchrun(tmp_path, "trainer=ddp", "data.batch_size=8", "accum=2", f"hydra.run.dir={tmp_path / 'ddp'}")
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    one = torchrun(
        tmp_path, "data.batch_size=16", "accum=2", "logger=none", f"hydra.run.dir={tmp_path / 'one'}", nproc=1
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

    # rank 0 alone made a run dir (nothing else in the launch dir) and owns the one W&B run
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ddp", "one"]
    (run_file,) = wandb_records.run_files(tmp_path / "ddp")
    assert wandb_records.exit_codes(run_file) == [0]
    assert wandb_records.summary(run_file)["world_size"] == 2


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


def test_ddp_without_torchrun_is_a_config_error(cli):
    result = cli.run("trainer=ddp", "logger=none")
    assert result.returncode == 2
    assert "trainer.distributed=ddp: start it with torchrun: torchrun --nproc_per_node=2" in result.output
