"""perf/tflops and perf/mfu: the first step's FLOPs, counted by torch, against the chip's peak."""

from __future__ import annotations

import pytest
import torch
from conftest import read_jsonl
from omegaconf import open_dict

import halfprec.training.metrics
from halfprec.errors import ConfigError
from halfprec.numerics.policy import PrecisionPolicy
from halfprec.training.perf import math_kind, peak_tflops
from halfprec.training.run import run

from helpers import compose_cfg, flops_per_step, typed_cfg

B, ACCUM = 16, 2
LAYERS = [(64, 32), (32, 16), (16, 10)]  # digits (1x8x8, flattened) through model.hidden=[32,16]


def mlp_step_flops() -> int:
    """By hand: 2*m*n*k per matmul. Forward and weight gradients in every layer; input gradients in
    all but the first (the images need none); for each of the window's micro-batches."""
    forward = sum(2 * B * i * o for i, o in LAYERS)
    input_grads = sum(2 * B * i * o for i, o in LAYERS[1:])
    return ACCUM * (2 * forward + input_grads)


def perf_rows(tmp_path, *overrides: str) -> list[dict]:
    cfg = compose_cfg(
        "model.hidden=[32,16]", f"data.batch_size={B}", f"accum={ACCUM}", "trainer.max_steps=6",
        "trainer.log_every=2", "trainer.val_every=0", *overrides,
    )  # fmt: skip
    run(cfg, tmp_path)
    return [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "perf/step_ms" in r]


def test_tflops_are_the_steps_model_flops_over_its_time(tmp_path):
    rows = perf_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 4, 6]
    for r in rows:
        assert flops_per_step(r) == pytest.approx(mlp_step_flops(), rel=1e-9), r
    assert not any("perf/mfu" in r for r in rows)  # a CPU has no peak in the table


def test_mfu_is_the_tflops_over_the_peak_of_the_modes_math(tmp_path, monkeypatch):
    asked = []

    def fake_peak(device: torch.device, kind: str) -> tuple[str, float]:
        asked.append(kind)
        return "test chip", 0.004

    monkeypatch.setattr(halfprec.training.metrics, "peak_tflops", fake_peak)
    rows = perf_rows(tmp_path, "precision=bf16")
    assert asked == ["half"]
    for r in rows:
        assert r["perf/mfu"] == pytest.approx(r["perf/tflops"] / 0.004, rel=1e-12)


def test_count_flops_false_logs_neither_and_a_non_bool_is_rejected(tmp_path):
    rows = perf_rows(tmp_path, "trainer.count_flops=false")
    assert rows and not any({"perf/tflops", "perf/mfu"} & r.keys() for r in rows)
    cfg = compose_cfg()
    with open_dict(cfg):
        cfg.trainer.count_flops = "yes"
    with pytest.raises(ConfigError, match="trainer.count_flops"):
        run(cfg, tmp_path / "bad")


@pytest.mark.parametrize(
    "precision, kind",
    [("fp32", "fp32"), ("O0", "fp32"), ("tf32", "tf32"), ("bf16", "half"), ("fp16", "half"),
     ("fp16_pure", "half"), ("bf16_pure_master", "half"), ("fp8", "half")],
)  # fmt: skip
def test_each_mode_is_measured_against_the_peak_its_matmuls_run_at(precision, kind):
    policy = PrecisionPolicy.from_config(typed_cfg(f"precision={precision}").precision, "cuda")
    assert math_kind(policy) == kind


@pytest.mark.parametrize(
    "name, expected",
    [
        ("NVIDIA H200", ("H200", 989.4)),
        ("NVIDIA H100 80GB HBM3", ("H100", 989.4)),
        ("NVIDIA H100 PCIe", ("H100 PCIe", 756.0)),
        ("NVIDIA A100-SXM4-80GB", ("A100", 312.0)),
        ("NVIDIA H200 NVL", None),  # lower clocks than the SXM part: no figure rather than a wrong one
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_the_chip_is_found_by_its_device_name(monkeypatch, name, expected):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_tflops(torch.device("cuda"), "half") == expected
    assert peak_tflops(torch.device("cpu"), "half") is None
    if expected:
        assert peak_tflops(torch.device("cuda"), "fp32")[1] < peak_tflops(torch.device("cuda"), "tf32")[1]
