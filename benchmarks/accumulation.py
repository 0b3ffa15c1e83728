"""The error of an FP8 GEMM's sums against K, as each precision.accumulate preset sums them.

    python benchmarks/accumulation.py [--sizes 256,1024,4096,16384] [--rows 16] [--seed 0] [--device cpu]

Operands: M x K activations and K x N weights drawn N(0, 1), then a constant 0.5 added to the
activations (a post-GELU-like positive mean, so the sum grows with K as a GEMM's running sum does),
quantized to E4M3 per tensor and per row (halfprec's fp8_e4m3 and fp8_e4m3_row). The error is the
sums' alone: each preset's output against the exact (fp64) product of the same quantized values,
as ||Y - Y_exact|| / ||Y_exact|| and the largest |y - y_exact| / |y_exact|. DeepSeek-V3 (arXiv
2412.19437, 3.3.2) reports a largest relative error of nearly 2% at K = 4096 on H800 without
promotion (their data: a GEMM of their model; not this distribution).
"""

from __future__ import annotations

import argparse

import torch

from halfprec.numerics.accumulate import PRESETS
from halfprec.numerics.formats import quantize
from halfprec.numerics.quantized import Operand, gemm

PRESET_NAMES = ("hopper", "hopper_promoted", "blackwell")


def errors(k: int, fmt: str, rows: int, seed: int, device: str) -> dict[str, tuple[float, float]]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, k, generator=g) + 0.5).to(device)
    w = torch.randn(rows, k, generator=g).to(device)
    qx, qw = quantize(x, fmt, -1, split=True), quantize(w, fmt, -1, split=True)
    a = Operand(qx.values, qx.factor, True, element="e4m3")
    b = Operand(qw.values, qw.factor, True, element="e4m3").t()
    exact = gemm(a._replace(values=a.values.double(), factor=None), b._replace(values=b.values.double(), factor=None))
    exact = exact * (qx.factor.double() * qw.factor.double().t())
    out = {}
    for name in PRESET_NAMES:
        y = gemm(a, b, PRESETS[name]).double()
        diff = (y - exact).abs()
        out[name] = ((diff.norm() / exact.norm()).item(), (diff / exact.abs()).max().item())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="256,512,1024,2048,4096,8192,16384")
    parser.add_argument("--rows", type=int, default=16, help="M = N")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    print("FP8 E4M3 GEMM, sums' relative error against the exact product of the quantized values")
    print(f"data: x ~ N(0,1) + 0.5, w ~ N(0,1), M = N = {args.rows}, seed {args.seed}; cells: norm-wise / largest")
    print("DeepSeek-V3 (H800, K = 4096, no promotion): largest relative error nearly 2%\n")
    header = "| scaling | K | " + " | ".join(PRESET_NAMES) + " |"
    print(header)
    print("|" + "---|" * (len(PRESET_NAMES) + 2))
    for fmt in ("fp8_e4m3", "fp8_e4m3_row"):
        for k in map(int, args.sizes.split(",")):
            cells = errors(k, fmt, args.rows, args.seed, args.device)
            shown = " | ".join(f"{n:.2e} / {m:.2e}" for n, m in cells.values())
            print(f"| {'tensor' if fmt == 'fp8_e4m3' else 'row'} | {k} | {shown} |")


if __name__ == "__main__":
    main()
