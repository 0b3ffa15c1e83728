"""What `diagnostics=grads` costs per optimizer step, measured side by side in one process.

    python benchmarks/diagnostics_overhead.py [--steps 60] [--repeats 5] [override ...]

For each model, the same built components run steps in alternation: the plain step (what
`diagnostics=none` runs), a step with gradient diagnostics, and one with gradient and activation
diagnostics. Printed: median ms/step of each and the ratio to the plain step. A diagnostics step
every N steps costs (ratio - 1) / N on average; `diagnostics.every=50` is the grads default.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import torch

from halfprec.config import compose
from halfprec.training.build import build
from halfprec.training.diagnostics import Diagnostics

CONF = Path(__file__).resolve().parents[1] / "conf"
MODELS = {
    "mlp 64-256-256-10, batch 64": ["model=mlp"],
    "fixup_resnet (3x2 blocks, 8x8), batch 64": ["model=fixup_resnet", "init=fixup", "model.blocks_per_stage=2"],
}


def time_steps(c, diag: Diagnostics, batch: tuple, steps: int, grads: bool, acts: bool) -> float:
    """Mean ms/step of `steps` optimizer steps with the chosen diagnostics on."""
    start = time.perf_counter()
    for _ in range(steps):
        watch = diag.watch_activation_gradients(c.stepper.scaler.scale) if acts else contextlib.nullcontext()
        with watch:
            inspect = diag.inspect_gradients if grads else None
            c.stepper.step([batch], inspect=inspect)
        if grads or acts:
            diag.collect()  # includes the host read and the histogram objects
    return 1000 * (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="steps per timed block")
    parser.add_argument("--repeats", type=int, default=5, help="alternating blocks per variant")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. precision=bf16")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, {args.repeats} x {args.steps} steps per variant, median ms/step")
    print("| model | plain step | + grads | ratio | + grads + activations | ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    variants = {"plain": (False, False), "grads": (True, False), "acts": (True, True)}
    for name, model_overrides in MODELS.items():
        cfg = compose(["logger=none", "diagnostics=grads", *model_overrides, *args.overrides], CONF)
        c = build(cfg)
        diag = Diagnostics(cfg.diagnostics, c.model, c.stepper.params)
        x, y = next(c.data.train_batches(cfg.data.batch_size, cfg.seed, c.device))  # one digits batch, reused
        time_steps(c, diag, (x, y), args.steps, True, True)  # warm-up
        times: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(args.repeats):  # alternate, so that machine noise hits every variant alike
            for v, flags in variants.items():
                times[v].append(time_steps(c, diag, (x, y), args.steps, *flags))
        med = {v: statistics.median(t) for v, t in times.items()}
        print(
            f"| {name} | {med['plain']:.2f} | {med['grads']:.2f} | {med['grads'] / med['plain']:.2f}x "
            f"| {med['acts']:.2f} | {med['acts'] / med['plain']:.2f}x |"
        )


if __name__ == "__main__":
    main()
