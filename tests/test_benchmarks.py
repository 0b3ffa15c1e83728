"""benchmarks/compare_loops.py runs end to end and compares like with like."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "compare_loops.py"


@pytest.mark.slow
def test_compare_loops_quick(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--device", "cpu", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["env"]["glibc_tunables"].startswith("glibc.malloc.mmap_threshold=")  # the re-exec fixed it
    rows = {r["contender"]: r for r in report["rows"]}

    # CI installs only .[dev]: without the bench extra the frameworks are skipped with a note, not a crash
    expected = ["halfprec", "raw"] + [n for n in ("lightning", "accelerate") if importlib.util.find_spec(n)]
    for name in expected:
        assert rows[name]["median_ms"] > 0, rows[name]
        assert rows[name]["computed_dtype"] == "float32", rows[name]
    for name in {"lightning", "accelerate"} - set(expected):
        assert rows[name]["median_ms"] is None and rows[name]["note"].startswith("skipped")

    # fp32: halfprec's step and the hand-written loop do the same math on the same batches
    halfprec, raw = rows["halfprec"], rows["raw"]
    assert halfprec["steps"] == raw["steps"]
    assert halfprec["max_param_diff_vs_raw"] <= 1e-5
    assert halfprec["final_loss"] == pytest.approx(raw["final_loss"], rel=1e-4, abs=1e-6)


@pytest.mark.slow
def test_compare_loops_fp8_against_the_raw_loop(tmp_path):
    """fp8 (torchao's emulation on a CPU): the raw loop trains the same Float8Linear layers and ends at
    halfprec's weights; --frameworks none leaves Lightning and Accelerate out of the run."""
    pytest.importorskip("torchao")
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--device", "cpu", "--precisions", "fp8", "--frameworks", "none"]
    proc = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["contender"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"halfprec", "raw"}
    assert rows["raw"]["note"].startswith("torchao float8 fp8_e4m3")  # precision=fp8: tensorwise scales
    assert all(r["computed_dtype"] == "bfloat16" for r in rows.values())
    assert rows["halfprec"]["steps"] == rows["raw"]["steps"]
    assert rows["halfprec"]["max_param_diff_vs_raw"] <= 1e-5


@pytest.mark.slow
def test_compare_loops_gpt_does_the_hand_written_loops_math_and_counts_tokens(tmp_path):
    """The GPT workload: halfprec's step (task=lm) and a nanoGPT-style loop take the same steps on the
    same token batches to the same weights; the table reports tokens/s beside sequences/s."""
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--device", "cpu", "--models", "gpt-small", "--frameworks", "none"]
    proc = subprocess.run(
        [*cmd, "--json", str(out), "--markdown", str(md)], capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["contender"]: r for r in json.loads(out.read_text())["rows"]}
    halfprec, raw = rows["halfprec"], rows["raw"]
    assert halfprec["steps"] == raw["steps"] > 0
    assert halfprec["max_param_diff_vs_raw"] <= 1e-5
    assert halfprec["final_loss"] == pytest.approx(raw["final_loss"], rel=1e-5)
    assert raw["tokens_per_s"] == pytest.approx(raw["images_per_s"] * 128)  # 128-byte blocks
    assert f"({raw['tokens_per_s']:,.0f})" in md.read_text()


def test_gpu_script_skips_cleanly_without_a_gpu(tmp_path):
    """benchmarks/gpu.sh on a machine without CUDA: exit 0, and it says so in its output directory."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: gpu.sh would run the real thing")
    script = SCRIPT.parent / "gpu.sh"
    proc = subprocess.run(["bash", str(script), str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "no CUDA GPU visible here" in (tmp_path / "out" / "SKIPPED.md").read_text()
    assert "skipped" in proc.stdout


# Stands in for python3 in gpu.sh: the loop comparison becomes a part that overruns any limit (how
# long the real one takes depends on the machine and on which frameworks are installed).
SLOW_COMPARE_LOOPS = """#!/usr/bin/env bash
case " $* " in *compare_loops.py*) exec sleep 600 ;; esac
exec {python} "$@"
"""


@pytest.mark.slow
def test_gpu_script_rehearsal_keeps_its_budget_and_marks_a_part_cut_short(tmp_path):
    """GPU_SH_REHEARSAL=1 runs gpu.sh's steps on the CPU. With a 60 s budget every part gets the
    10 s floor; the loop comparison, made to overrun, must be cut there, its markdown must say so
    and the script exit 1, the whole within the budget (plus the kill grace), the files in the
    caller's (relative) OUT_DIR and no more of them than the device tool brings back (8)."""
    python = tmp_path / "python-with-a-slow-part"
    python.write_text(SLOW_COMPARE_LOOPS.format(python=sys.executable))
    python.chmod(0o755)
    env = {**os.environ, "GPU_SH_REHEARSAL": "1", "GPU_SH_BUDGET_S": "60", "PYTHON": str(python)}
    start = time.monotonic()
    proc = subprocess.run(
        ["bash", str(SCRIPT.parent / "gpu.sh"), "out"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    elapsed = time.monotonic() - start
    out = tmp_path / "out"
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert elapsed < 60 + 3 * 10 + 15  # the budget, each part's kill grace, start-up
    assert (out / "compare_loops.md").read_text().splitlines()[-1].startswith("gpu.sh: cut short at its 10 s limit")
    assert {"env.txt", "gpu_tests.log", "bench.log"} <= {p.name for p in out.iterdir()} and len(
        list(out.iterdir())
    ) <= 8
    assert "gpu.sh: compare_loops.py, limit 10 s" in (out / "bench.log").read_text()


@pytest.mark.slow
def test_compare_loops_lists_a_mode_the_model_cannot_run_and_goes_on(tmp_path):
    """A (model, precision) pair the config rejects (fp8 without a Linear fit for float8, as on
    resnet50) is a "not run" row with the reason; the next row is measured (a GPU run keeps them)."""
    pytest.importorskip("torchao")
    out = tmp_path / "r.json"
    code = f"""
import dataclasses, sys
sys.path.insert(0, {str(SCRIPT.parent)!r})
import compare_loops as cl
cl.WORKLOADS["mlp-odd"] = dataclasses.replace(cl.WORKLOADS["mlp-small"], overrides=("model=mlp", "model.hidden=[20]"))
cl.main(["--device", "cpu", "--models", "mlp-odd", "--precisions", "fp8,fp32", "--quick", "--frameworks", "none",
         "--json", {str(out)!r}])
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    expected = [("fp8", "halfprec"), ("fp32", "halfprec"), ("fp32", "raw")]
    assert [(r["precision"], r["contender"]) for r in rows] == expected
    assert rows[0]["note"].startswith("not run: precision=fp8") and rows[0]["median_ms"] is None
    assert rows[1]["max_param_diff_vs_raw"] <= 1e-5


def test_formats_quick_times_each_format_against_bf16(tmp_path):
    """benchmarks/formats.py --quick (a 1-block GPT of width 32, ~5 s): a bf16 row and one row per
    format asked for, each with its ms/step and ratio to bf16; the formats' rows count their
    quantized layers and the share of a step spent quantizing."""
    out = tmp_path / "formats.json"
    script = SCRIPT.parent / "formats.py"
    cmd = [sys.executable, str(script), "--quick", "--device", "cpu", "--precisions", "mxfp4,nvfp4"]
    table = tmp_path / "formats.md"
    cmd += ["--json", str(out), "--markdown", str(table)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert table.read_text() in proc.stdout and "| tokens/s |" in table.read_text()
    assert report["env"]["glibc_tunables"].startswith("glibc.malloc.mmap_threshold=")  # the re-exec fixed it
    rows = {r["precision"]: r for r in report["rows"]}
    assert list(rows) == ["bf16", "mxfp4", "nvfp4"]
    for row in rows.values():
        assert row["median_ms"] > 0 and row["ratio"] > 0, row
        assert row["tokens_per_s"] == pytest.approx(4 * 32 / (row["median_ms"] / 1000)), row  # --quick: 4 x 32
        assert len(row["block_ms"]) == len(row["ratios"]) == report["env"]["blocks"]
    assert rows["bf16"]["ratio"] == 1.0 and rows["bf16"]["quantized_layers"] == 0
    for name in ("mxfp4", "nvfp4"):
        row = rows[name]
        assert row["quantized_layers"] > 0, row
        assert row["quantize_calls"] > 0 and 0 < row["quantize_share"] < 1, row
        assert row["quantize_gb_s"] > 0 and row["peak_mib"] is None, row  # peak memory: a GPU's
    assert "| nvfp4 |" in proc.stdout  # the markdown table


def test_formats_high_fp32_compares_with_fp32(tmp_path):
    """--high fp32 (a CPU without bf16 units): the reference row is precision=fp32, the formats keep
    their other layers in fp32, and the table says so."""
    out = tmp_path / "formats.json"
    cmd = [sys.executable, str(SCRIPT.parent / "formats.py"), "--quick", "--device", "cpu", "--precisions", "mxfp4"]
    proc = subprocess.run([*cmd, "--high", "fp32", "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["env"]["reference"] == "fp32" and "| ratio to fp32 |" in proc.stdout
    # --quick's quantizers are eager (no compile in a smoke run); a timed run's are compiled
    assert report["env"]["format_overrides"] == ["precision.autocast=null", "precision.quantizer=eager"]
    assert [(r["precision"], r["ratio"] > 0) for r in report["rows"]] == [("fp32", True), ("mxfp4", True)]


NANOGPT = SCRIPT.parent / "nanogpt_compare.py"


def run_nanogpt_compare(tmp_path: Path, *extra: str) -> tuple[dict, str]:
    out = tmp_path / "nanogpt.json"
    cmd = [sys.executable, str(NANOGPT), "--quick", "--json", str(out), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # trainer.threads=auto reads it: one thread, as on a busy CPU
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def test_nanogpt_compare_quick_trains_both_recipes_and_splits_decay_as_nanogpt(tmp_path):
    """benchmarks/nanogpt_compare.py --quick (a 1-block GPT of width 32, 10 steps, ~5 s): halfprec's run
    and the nanoGPT-style loop both learn (byte-level: below ln 256 + 0.5 nats after a few steps), and
    the loop's AdamW groups are nanoGPT's: the 2D tensors decay (the tied embedding once), the norm
    gains do not; its lr follows nanoGPT's get_lr (warmup over warmup_iters + 1, cosine to lr/10)."""
    report, stdout = run_nanogpt_compare(tmp_path)
    [seed] = report["seeds"]
    for side in ("halfprec", "nanogpt"):
        assert math.isfinite(seed[side]["val_loss"]) and seed[side]["val_loss"] < math.log(256) + 0.5, seed
    # the tiny GPT: vocabulary 256, context 32, width 32 (MLP 4 x 32), one block; no biases (gpt.py)
    width, decay, no_decay = 32, seed["nanogpt"]["groups"]["decay"], seed["nanogpt"]["groups"]["no_decay"]
    matrices = {
        "wte.weight": 256 * width,  # the output head is tied to it: one tensor, listed once
        "wpe.weight": 32 * width,
        "blocks.0.attn.qkv.weight": 3 * width * width,
        "blocks.0.attn.proj.weight": width * width,
        "blocks.0.mlp.fc.weight": 4 * width * width,
        "blocks.0.mlp.proj.weight": 4 * width * width,
    }
    gains = ["blocks.0.norm1.weight", "blocks.0.norm2.weight", "norm.weight"]
    assert sorted(decay["names"]) == sorted(matrices) and decay["numel"] == sum(matrices.values())
    assert sorted(no_decay["names"]) == sorted(gains) and no_decay["numel"] == 3 * width
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    lr, min_lr, warmup, steps = 3e-3, 3e-4, 2, 10
    assert seed["nanogpt"]["first_lr"] == pytest.approx(lr * 1 / (warmup + 1))
    last = min_lr + 0.5 * (1 + math.cos(math.pi * (steps - 1 - warmup) / (steps - warmup))) * (lr - min_lr)
    assert seed["nanogpt"]["last_lr"] == pytest.approx(last)
    assert "| 0 |" in stdout and "nanoGPT loop lr: get_lr" in stdout  # the table and the recipes in words


@pytest.mark.slow
def test_nanogpt_compare_control_lands_on_halfprecs_val_loss(tmp_path):
    """--control gives the loop halfprec's decay split and schedule: with the same model, batches and
    evaluation it must land on halfprec's val/loss (fp32 on a CPU: the same bits), which shows that
    what differs without it is the recipe, not the wiring."""
    report, _ = run_nanogpt_compare(tmp_path, "--control")
    [seed] = report["seeds"]
    assert seed["nanogpt"]["val_loss"] == pytest.approx(seed["halfprec"]["val_loss"], rel=1e-6, abs=1e-7)
    assert seed["nanogpt"]["last_lr"] == pytest.approx(seed["halfprec"]["last_lr"], rel=1e-9)
