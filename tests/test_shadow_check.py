"""benchmarks/shadow_check.py: the rank correlation of early what-if errors with the sensitivity
tool's end damage, by hand on three layers, and the script as a user runs it on a tiny shadow sweep."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from halfprec.tools.report.runs import Job

from helpers import TRAIN

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "shadow_check.py"
GPT = ["task=lm", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=32", "data.batch_size=4"]


def load_script():
    spec = importlib.util.spec_from_file_location("shadow_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def shadow_row(step: int, errors: dict[str, tuple[float, float, float]]) -> dict:
    row = {"step": step}
    for layer, values in errors.items():
        for op, value in zip(("input", "weight", "grad_output"), values):
            row[f"shadow/mxfp4/{layer}/{op}/rel_err"] = value
    return row


def test_compare_ranks_each_operand_and_their_mean_against_the_end_damage():
    check = load_script()
    damage = {"a": 0.05, "b": 0.002, "c": 0.001}  # a is the tool's first
    sensitivity = {"rows": [{"layer": k, "format": "mxfp4", "damage": v} for k, v in damage.items()]}
    rows = [
        # step 20: every operand ranks a > b > c, as the damage does
        shadow_row(20, {"a": (0.3, 0.2, 0.5), "b": (0.2, 0.1, 0.4), "c": (0.1, 0.0, 0.3)}),
        # step 40: inputs and output gradients reversed, weights as the damage; by the mean, c is worst
        shadow_row(40, {"a": (0.1, 0.3, 0.1), "b": (0.2, 0.2, 0.2), "c": (0.3, 0.1, 0.9)}),
        {"step": 30, "train/loss": 2.0},  # not a diagnostics step: left out
    ]
    job = Job("0", Path("."), {}, {}, rows, "completed")
    result = check.compare(job, sensitivity, "mxfp4")
    assert sorted(result) == [20, 40]
    assert result[20] == {"input": 1.0, "weight": 1.0, "grad_output": 1.0, "mean": 1.0, "top1": 1.0}
    assert result[40]["input"] == pytest.approx(-1.0) and result[40]["weight"] == pytest.approx(1.0)
    # means: a 0.167, b 0.2, c 0.433 -> the reverse of the damage; c, not a, is the worst layer
    assert result[40]["mean"] == pytest.approx(-1.0) and result[40]["top1"] == 0.0
    assert check.mean_std([0.5, 1.0, 1.5]) == "1.00 +- 0.50"


@pytest.mark.slow
def test_the_script_measures_a_tiny_shadow_sweep_and_writes_its_tables(tmp_path):
    sweep = tmp_path / "sweep"
    overrides = [*GPT, "trainer.max_steps=4", "trainer.val_every=0", "trainer.ckpt_every=2", "diagnostics.every=2",
                 "seed=0,1", "diagnostics.shadow=[mxfp4,nvfp4]", "logger=none", f"hydra.sweep.dir={sweep}"]  # fmt: skip
    trained = subprocess.run([sys.executable, str(TRAIN), "-m", "+experiment=shadow", *overrides], cwd=tmp_path,
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    out = tmp_path / "out"
    cmd = [sys.executable, str(SCRIPT), "--sweep", str(sweep), "--batches", "1", "--early-step", "2", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (out / "shadow_check.md").read_text()
    assert text.startswith("2 runs of ") and "the sensitivity tool on step 4" in text
    for fmt in ("mxfp4", "nvfp4"):
        table = text.split(f"**{fmt}**")[1].split("the tool's first layer per seed")[0]
        # diagnostics steps 1, 2 and 4, one row each, with the count of seeds whose worst layer is the tool's first
        assert [line.split(" | ")[0] for line in table.splitlines() if line[:3] in ("| 1", "| 2", "| 4")] == [
            "| 1", "| 2", "| 4"]  # fmt: skip
        assert all(line.endswith("of 2 |") for line in table.splitlines() if line[:3] in ("| 1", "| 2", "| 4"))
    assert all((job / "sensitivity.json").exists() for job in sweep.glob("*_*"))
    # --early-step 2: the tool on each job's step-2 checkpoint, against its own end ranking
    assert all((job / "sensitivity_step2" / "sensitivity.json").exists() for job in sweep.glob("*_*"))
    early = text.split("**The tool itself at step 2**")[1]
    assert "- mxfp4: rho " in early and "- nvfp4: rho " in early and "the end's first layer per seed" in early
    assert (out / "shadow_check.png").stat().st_size > 0 and (out / "shadow_check.json").exists()
