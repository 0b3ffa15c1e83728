"""Throughput against the hardware: a training step's FLOPs, counted by torch, and the chip's
dense peak, for the perf/tflops and perf/mfu metrics (and the benchmarks' MFU column); the model's
size and a step's work, said as the run starts."""

from __future__ import annotations

import torch
from torch import nn

from halfprec.components.models import MODELS
from halfprec.config import Config
from halfprec.config.rules import command_line
from halfprec.numerics.policy import PrecisionPolicy

# A step's work (TFLOP) past which a CPU run warns before step 1. A threshold on work, not a time:
# task=lm's default step is 0.01 TFLOP, model=gpt2's at the same batch of 16 sequences 8.
CPU_WARN_TFLOP = 1.0

# Dense (no sparsity) peak TFLOP/s from NVIDIA's data sheets: (fp32, tf32, fp16/bf16 tensor cores).
# Matched against torch.cuda.get_device_name() in order: every word of the key must appear.
PEAK_TFLOPS = {
    "H200": (67.0, 494.7, 989.4),  # H200 SXM
    "H100 PCIe": (51.2, 378.0, 756.0),
    "H100": (67.0, 494.7, 989.4),  # H100 SXM
    "A100": (19.5, 156.0, 312.0),
}


def math_kind(policy: PrecisionPolicy) -> str:
    """Which peak a mode's matmuls run against: fp32, tf32 or half (fp16/bf16 tensor cores). fp8
    counts as half: only the eligible Linear layers compute in float8, the rest in bf16 (against the
    fp8 peak, twice the bf16 one, the figure would read half as high)."""
    if policy.compute_dtype == torch.float32:
        return "tf32" if policy.config.tf32 else "fp32"
    return "half"


def peak_tflops(device: torch.device, kind: str) -> tuple[str, float] | None:
    """(matched GPU, dense peak TFLOP/s for `kind`), or None where the chip is not in the table
    (every CPU; the NVL boards, whose peaks are lower than the SXM figures listed)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    if "NVL" in name:
        return None
    for key, (fp32, tf32, half) in PEAK_TFLOPS.items():
        if all(word in name for word in key.split()):
            return key, {"fp32": fp32, "tf32": tf32, "half": half}[kind]
    return None


def count_parameters(model: nn.Module) -> int:
    """Every parameter once: parameters() yields a tied tensor (a GPT's head and embedding) once."""
    return sum(p.numel() for p in model.parameters())


def model_lines(cfg: Config, model: nn.Module, input_shape: tuple[int, ...], device_type: str) -> list[str]:
    """The model's parameter count; on a CPU, for a model of tokens whose step is a long wait there,
    a warning with its work (about 6 x parameters x tokens: forward and backward, Kaplan et al. 2020)
    and the settings that make a step short enough to check a config."""
    params = count_parameters(model)
    preset = command_line()[0].get("model") or cfg.model.name  # model=gpt2 (arch gpt) where Hydra composed it
    lines = [f"model: {preset}, {params:,} parameters"]
    if device_type != "cpu" or MODELS[cfg.model.name].reads != "tokens":
        return lines
    tokens = cfg.data.batch_size * cfg.accum * input_shape[0]
    tflop = 6 * params * tokens / 1e12
    if tflop > CPU_WARN_TFLOP:
        lines.append(
            f"warning: a step is about {tflop:.1f} TFLOP (6 x {params:,} parameters x {tokens:,} tokens), long on "
            f"a CPU; data.batch_size=1 (and a smaller model.block_size) checks a config in shorter steps, a GPU "
            f"trains it"
        )
    return lines
