"""The files a run writes: a full disk or a run dir that cannot be made is one line and exit 6, no
temporary file stays, the last good checkpoint is kept; a config error leaves no run dir."""

import json
import os
import resource
import subprocess
import sys

import pytest
import torch

from halfprec.training.checkpoint import checkpoint_files, load_checkpoint
from halfprec.training.run import run

from helpers import TRAIN, compose_cfg


def train(run_dir, *overrides: str, file_limit: int | None = None) -> subprocess.CompletedProcess:
    """`python train.py` as a user runs it; with `file_limit`, no file it writes may grow past that
    many bytes (RLIMIT_FSIZE: the write fails with EFBIG, as a full disk fails with ENOSPC)."""

    def limit() -> None:
        if file_limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))

    args = [sys.executable, str(TRAIN), "logger=none", "trainer.progress=false", *overrides, f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(args, env=env, capture_output=True, text=True, preexec_fn=limit, timeout=300)


def test_a_checkpoint_the_disk_refuses_is_one_line_and_leaves_no_temporary_file(tmp_path):
    """model.hidden=[512,512]: a checkpoint of about 2.4 MB, past a 1 MB limit on file sizes."""
    result = train(tmp_path, "model.hidden=[512,512]", "trainer.max_steps=20", "trainer.ckpt_every=10",
                   file_limit=1_000_000)  # fmt: skip
    assert result.returncode == 6, result.stderr
    ckpt = tmp_path / "checkpoints" / "step-00000010.pt"
    lines = result.stderr.strip().splitlines()
    assert [line.split(" ", 1)[0] for line in lines[:3]] == ["run", "model:", "optim:"]  # the start's own lines
    assert lines[3:] == [f"error: {ckpt}: File too large; free some space, or set hydra.run.dir to another disk"]
    assert list((tmp_path / "checkpoints").iterdir()) == []  # no .step-*.pt.tmp-* left
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["status"], summary["exit_code"], summary["steps"]) == ("failed", 6, 10)


def test_a_failed_save_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    real_save, saves = torch.save, []

    def disk_full_on_the_second(obj, f, *args, **kwargs):
        saves.append(1)
        if len(saves) == 2:
            f.write(b"half a checkpoint")
            raise OSError(28, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_full_on_the_second)
    with pytest.raises(OSError) as info:
        run(compose_cfg("trainer.max_steps=30", "trainer.ckpt_every=10"), tmp_path)
    assert info.value.filename == str(tmp_path / "checkpoints" / "step-00000020.pt")
    (kept,) = checkpoint_files(tmp_path / "checkpoints")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [kept.name] == ["step-00000010.pt"]
    assert load_checkpoint(kept)["step"] == 10


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_a_run_dir_that_cannot_be_made_is_one_line(tmp_path, where):
    (tmp_path / "afile").write_text("not a directory")
    run_dir = tmp_path / "afile" if where == "a file" else tmp_path / "afile" / "run"
    result = train(run_dir, "trainer.max_steps=2")
    assert result.returncode == 6, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {run_dir}") and "Traceback" not in result.stderr, line


def test_a_config_error_leaves_no_run_dir_but_keeps_one_that_holds_a_run(tmp_path):
    fresh = train(tmp_path / "day" / "run", "accum=0")
    assert fresh.returncode == 2 and list(tmp_path.glob("day/*")) == []
    assert train(tmp_path / "kept", "trainer.max_steps=2").returncode == 0
    again = train(tmp_path / "kept", "accum=0", "resume=auto")
    assert again.returncode == 2 and (tmp_path / "kept" / "checkpoints").is_dir()


@pytest.mark.slow  # the checkpoint's test above takes the same path; this one, metrics.jsonl's
def test_a_metrics_row_the_disk_refuses_names_metrics_jsonl(tmp_path):
    """Rows are small: a 30 kB limit on file sizes lets the first rows through, then refuses one."""
    result = train(tmp_path, "trainer.max_steps=300", "trainer.log_every=1", "trainer.ckpt_every=0",
                   file_limit=30_000)  # fmt: skip
    assert result.returncode == 6, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path / 'metrics.jsonl'}: File too large; free some space, or set hydra.run.dir to another disk"
    )
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"
