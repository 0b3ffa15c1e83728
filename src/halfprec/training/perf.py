"""Throughput against the hardware: a training step's FLOPs, counted by torch, and the chip's
dense peak, for the perf/tflops and perf/mfu metrics (and the benchmarks' MFU column)."""

from __future__ import annotations

import torch

from halfprec.numerics.policy import PrecisionPolicy

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
