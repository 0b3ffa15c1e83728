"""What the emulated number formats cost per optimizer step of the task=lm GPT, against bf16, side by side.

    python benchmarks/formats.py [--device cpu|cuda] [--precisions mxfp8,mxfp6,mxfp4,nvfp4,fp8_block]
                                 [--steps N] [--repeats R] [--warmup W] [--threads T]
                                 [--model gpt2|llama] [--model-overrides KEY=VALUE ...] [--quick]
                                 [--quantizer compiled|eager] [--json OUT.json] [--markdown OUT.md] [--no-malloc-tuning]

See docs/benchmarks.md for what is measured how.

Every mode is `halfprec.training.build.build(cfg)` of `task=lm precision=<mode>` (the same seed, so
the same initial weights), stepped by its `stepper` on the same training micro-batches in the same
order: precision=bf16 is the reference, each format option swaps the GPT's Linear layers for
QuantizedLinear, whose GEMMs quantize their operands in the format, emulated (the values' products
with fp32 accumulation: bf16 operands on a GPU and on a CPU with bf16 units). --model gpt2 (or llama)
times the ~124M models at batch 8 x 1024 (data.batch_size=8 unless --model-overrides sets it). The
quantizers are compiled (precision.quantizer=compiled, what a run of 1000 steps or more gets on a
CPU, and any run on a GPU; the warm-up steps compile them) unless --quantizer eager (--quick's default).

Measured: each mode warms up, then the modes take turns running blocks of --steps steps, the order
rotating every round, so that machine noise hits all of them alike; the table shows the median over
--repeats blocks of the mean ms/step in a block, and the median over the rounds of each round's
ratio to bf16. Then one extra step per format runs with `QuantizedLinear.quantize` wrapped in a
timer: the share of that step spent inside quantization, and the number of quantized layers.

The glibc malloc thresholds are fixed as in compare_loops.py (large CPU tensors are otherwise
mmapped and unmapped every step): the script re-executes itself with GLIBC_TUNABLES set unless it
is already set or --no-malloc-tuning is given.
"""

from __future__ import annotations

from malloc_tuning import reexec_with_malloc_tuning

if __name__ == "__main__":
    reexec_with_malloc_tuning()

# The imports below come after the re-exec on purpose (importing torch takes ~1.5 s).
import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator, Sequence  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from compare_loops import CONF, fmt, machine, sync  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from halfprec.config import validate  # noqa: E402
from halfprec.errors import ConfigError  # noqa: E402
from halfprec.launch.resolvers import register_resolvers  # noqa: E402
from halfprec.machine import cpu_flags, native_bf16  # noqa: E402
from halfprec.numerics.quantized import QuantizedLinear  # noqa: E402
from halfprec.training.build import Components, build  # noqa: E402

# the reference per --high: what the layers a format leaves alone compute in (bf16 autocast, the
# format options' own; or fp32, with precision.autocast=null, for a CPU without bf16 units)
REFERENCES = {"bf16": ("bf16", []), "fp32": ("fp32", ["precision.autocast=null"])}
DEFAULT_PRECISIONS = ["mxfp8", "mxfp6", "mxfp4", "nvfp4", "fp8_block"]
# a GPT small enough for the test: one block of width 32, 4 x 32 tokens per micro-batch
QUICK_OVERRIDES = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=32", "data.batch_size=4"]
# (steps per block, blocks per mode, warm-up steps). The emulated formats run several times slower
# than bf16 on a CPU (quantizing is many elementwise fp32 ops per GEMM operand), hence few steps.
DEFAULT_SCHEDULE = {"cpu": (5, 7, 2), "cuda": (20, 5, 3), "quick": (2, 2, 1)}
N_BATCHES = 8  # distinct micro-batches, taken once and cycled: every mode sees the same ones in order

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class Row:
    """One precision mode's results (JSON: one object per row)."""

    precision: str
    quantized_layers: int = 0
    block_ms: list[float] = field(default_factory=list)  # mean ms/step of every timed block, in order
    ratios: list[float] = field(default_factory=list)  # each round's block_ms over bf16's in that round
    median_ms: float | None = None
    best_ms: float | None = None
    ratio: float | None = None  # median of `ratios`: to the reference (env's "reference")
    tokens_per_s: float | None = None  # the batch's tokens over median_ms
    profiled_step_ms: float | None = None  # the extra step with the quantize timer (formats only)
    quantize_ms: float | None = None  # time inside QuantizedLinear.quantize during that step
    quantize_share: float | None = None  # quantize_ms / profiled_step_ms
    quantize_calls: int | None = None
    quantize_gb_s: float | None = None  # QuantizeClock.bytes over quantize_ms: against the memory's bandwidth
    peak_mib: float | None = None  # a GPU's peak allocated memory over the mode's warm-up steps
    steps: int = 0
    final_loss: float | None = None
    note: str = ""


@dataclass
class Mode:
    """A precision mode's built components and where it is in the shared batch list."""

    row: Row
    c: Components
    cfg: DictConfig
    steps_taken: int = 0

    def run(self, batches: Sequence[Batch], n: int) -> float:
        """Take `n` optimizer steps; return the seconds they took (synchronized on a GPU)."""
        if n == 0:  # --warmup 0
            return 0.0
        sync(self.c.device)
        start = time.perf_counter()
        for _ in range(n):
            result = self.c.stepper.step([batches[self.steps_taken % len(batches)]])
            self.steps_taken += 1
        sync(self.c.device)
        seconds = time.perf_counter() - start
        # read after the clock stopped: .item() would synchronize inside the block
        self.row.final_loss, self.row.steps = float(result.loss), self.steps_taken
        return seconds


def compose_cfg(precision: str, device: torch.device, overrides: Sequence[str]) -> DictConfig:
    """`train.py task=lm precision=<precision>` as train.py would compose it, without logging or
    progress output; `overrides` (the model's, --quick's) come last, so they win."""
    base = ["logger=none", "trainer.progress=false", f"trainer.device={device.type}", "task=lm"]
    register_resolvers()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("train", overrides=[*base, f"precision={precision}", *overrides])


def make_mode(precision: str, device: torch.device, overrides: Sequence[str]) -> Mode:
    cfg = compose_cfg(precision, device, overrides)
    validate(cfg)
    c = build(cfg)
    layers = sum(isinstance(m, QuantizedLinear) for m in c.model.modules())
    return Mode(Row(precision, quantized_layers=layers), c, cfg)


def model_label(cfg: DictConfig) -> str:
    m = cfg.model
    return f"{m.n_layer}x{m.n_embd}, {m.n_head} heads, batch {cfg.data.batch_size} x {m.block_size} tokens"


@dataclass
class QuantizeClock:
    seconds: float = 0.0
    calls: int = 0
    bytes: int = 0  # each operand read once and its fp32 values written once: the least traffic


@contextlib.contextmanager
def timed_quantize(device: torch.device) -> Iterator[QuantizeClock]:
    """Wrap QuantizedLinear.quantize (the class's, so every layer's) with a timer while inside. On a
    GPU every call is synchronized before and after, or the clock would time the kernel launches only."""
    original = QuantizedLinear.quantize
    clock = QuantizeClock()

    def timed(self: QuantizedLinear, t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        clock.bytes += t.numel() * (t.element_size() + 4)
        sync(device)
        start = time.perf_counter()
        try:
            return original(self, t, *args, **kwargs)
        finally:
            sync(device)
            clock.seconds += time.perf_counter() - start
            clock.calls += 1

    setattr(QuantizedLinear, "quantize", timed)  # noqa: B010 (mypy refuses assigning to a method)
    try:
        yield clock
    finally:
        setattr(QuantizedLinear, "quantize", original)  # noqa: B010


def profile_quantization(mode: Mode, batches: Sequence[Batch]) -> None:
    """One extra step with the quantize timer: the share of the step spent quantizing. Its own step,
    not a timed one, because the timer's synchronizations (GPU) slow the step it measures."""
    with timed_quantize(mode.c.device) as clock:
        seconds = mode.run(batches, 1)
    r = mode.row
    r.profiled_step_ms, r.quantize_ms, r.quantize_calls = 1000 * seconds, 1000 * clock.seconds, clock.calls
    r.quantize_share = clock.seconds / seconds
    r.quantize_gb_s = clock.bytes / clock.seconds / 1e9 if clock.seconds else None


def take_batches(mode: Mode) -> list[Batch]:
    """N_BATCHES training micro-batches (pydoc bytes, or what --model-overrides' data gives), on the device."""
    batches = mode.c.data.train_batches(mode.cfg.data.batch_size, mode.cfg.seed, mode.c.device, 0, 1)
    return list(itertools.islice(batches, N_BATCHES))


def build_modes(args: argparse.Namespace, device: torch.device) -> tuple[list[Mode], list[Row]]:
    """The reference first, then the formats; a format the model cannot take (a ConfigError: e.g.
    a width the format's blocks cannot tile) becomes a "not run" row, and the others go on."""
    modes: list[Mode] = []
    not_run: list[Row] = []
    reference = args.reference
    for precision in [reference, *args.precisions]:
        extra = [] if precision == reference else args.format_overrides
        try:
            modes.append(make_mode(precision, device, [*args.overrides, *extra]))
        except ConfigError as err:
            if precision == reference:  # nothing to compare with: say why, without a traceback
                sys.exit(f"formats.py: the {reference} reference does not run with these overrides: {err}")
            not_run.append(Row(precision, note=f"not run: {err}"))
    return modes, not_run


def measure(modes: list[Mode], args: argparse.Namespace) -> None:
    """Warm up every mode, time interleaved blocks, then the profiled step of each format."""
    batches = take_batches(modes[0])
    for mode in modes:  # the first steps allocate, and draw each layer's Hadamard matrix
        if mode.c.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(mode.c.device)
        mode.run(batches, args.warmup)
        if mode.c.device.type == "cuda" and args.warmup:
            mode.row.peak_mib = torch.cuda.max_memory_allocated(mode.c.device) / 2**20
    for round_ in range(args.repeats):
        shift = round_ % len(modes)
        for mode in modes[shift:] + modes[:shift]:  # rotate: no mode always runs first (or after bf16)
            mode.row.block_ms.append(1000 * mode.run(batches, args.steps) / args.steps)
        reference_ms = modes[0].row.block_ms[-1]
        for mode in modes:  # a ratio within one round: drift between rounds cancels out
            mode.row.ratios.append(mode.row.block_ms[-1] / reference_ms)
        print(f"round {round_ + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    for mode in modes[1:]:
        if mode.row.quantized_layers:  # a mode without a format (--precisions fp32) has nothing to time
            profile_quantization(mode, batches)
    for mode in modes:
        r = mode.row
        r.median_ms, r.best_ms = statistics.median(r.block_ms), min(r.block_ms)
        r.ratio = statistics.median(r.ratios)
        tokens = mode.cfg.data.batch_size * mode.cfg.model.block_size  # one micro-batch per step here
        r.tokens_per_s = tokens / (r.median_ms / 1000)


# ---------------------------------------------------------------- output


def environment(device: torch.device, args: argparse.Namespace, cfg: DictConfig) -> dict:
    return {
        **machine(device),
        "python": platform.python_version(),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", "unset (glibc defaults)"),
        "model": f"model={args.model or 'gpt'} " + model_label(cfg),
        "reference": args.reference,
        "format_overrides": args.format_overrides,  # what every format mode adds (not the reference)
        "quantizer": args.quantizer,
        # whether the ratios hold on a CPU with bf16 units (the reference's bf16 GEMMs, the formats')
        "cpu_bf16_units": native_bf16(cpu_flags()) if device.type == "cpu" else None,
        "overrides": list(args.overrides),
        "steps_per_block": args.steps,
        "blocks": args.repeats,
        "warmup_steps": args.warmup,
    }


def bf16_units(env: dict) -> str:
    units = env.get("cpu_bf16_units")
    return "" if units is None else (" (bf16 units)" if units else " (no bf16 units: bf16 emulated)")


def markdown(env: dict, rows: list[Row]) -> str:
    lines = [
        f"{env['date']}, {env['device_name']}{bf16_units(env)}, torch {env['torch']}, threads: {env['threads']}, "
        f"GLIBC_TUNABLES={env['glibc_tunables']}",
        f"{env['model']}: {env['blocks']} interleaved blocks of {env['steps_per_block']} steps per mode after "
        f"{env['warmup_steps']} warm-up steps; median over blocks, ratio: median of the per-round ratios; "
        f"quantize share: of one extra step; {env['quantizer']} quantizers. `{env['command']}`",
        "",
        f"| precision | median ms/step | tokens/s | ratio to {env['reference']} | quantize share | quantize GB/s "
        "| peak MiB | quantized layers | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        share = "-" if r.quantize_share is None else f"{100 * r.quantize_share:.0f}%"
        ratio = fmt(r.ratio, ".2f") + ("x" if r.ratio is not None else "")
        layers = "-" if r.median_ms is None else str(r.quantized_layers)
        speed = fmt(r.tokens_per_s, ",.0f")
        ms = fmt(r.median_ms, ".2f")
        gbs, peak = fmt(r.quantize_gb_s, ".1f"), fmt(r.peak_mib, ",.0f")
        lines.append(f"| {r.precision} | {ms} | {speed} | {ratio} | {share} | {gbs} | {peak} | {layers} | {r.note} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available")
    parser.add_argument("--precisions", default=None, help=f"comma-separated (default: {','.join(DEFAULT_PRECISIONS)})")
    parser.add_argument("--steps", type=int, default=None, help="steps per timed block")
    parser.add_argument("--repeats", type=int, default=None, help="timed blocks per mode (median over them)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps per mode before the blocks")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: 1 on CPU)")
    parser.add_argument(
        "--high",
        choices=list(REFERENCES),
        default="bf16",
        help="what the layers a format leaves alone compute in, and the reference row: bf16 (autocast, the "
        "formats' own) or fp32 (precision.autocast=null: for a CPU without bf16 units, where bf16 is emulated)",
    )
    parser.add_argument("--model", choices=["gpt", "gpt2", "llama"], default=None, help="model= (default: gpt)")
    parser.add_argument(
        "--model-overrides",
        dest="overrides",
        nargs="+",
        action="extend",
        default=[],
        help="Hydra overrides for every mode, e.g. model.n_layer=8 model.n_embd=256 (after --quick's)",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: a 1-block GPT of width 32, 2 x 2 steps")
    parser.add_argument(
        "--quantizer",
        choices=["compiled", "eager"],
        default=None,
        help="the formats' precision.quantizer (default: compiled, as a long run's; eager with --quick)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the table as markdown")
    parser.add_argument("--no-malloc-tuning", action="store_true", help="keep glibc's default malloc thresholds")
    args = parser.parse_args(argv)

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible here")
    steps, repeats, warmup = DEFAULT_SCHEDULE["quick" if args.quick else args.device]
    args.steps, args.repeats = args.steps or steps, args.repeats or repeats
    args.warmup = warmup if args.warmup is None else args.warmup
    if args.steps < 1 or args.repeats < 1 or args.warmup < 0:
        parser.error("--steps and --repeats: at least 1; --warmup: at least 0")
    args.precisions = [p for p in (args.precisions.split(",") if args.precisions else DEFAULT_PRECISIONS) if p]
    unknown = [p for p in args.precisions if not (CONF / "precision" / f"{p}.yaml").is_file()]
    if unknown:
        parser.error(f"--precisions {','.join(unknown)}: no such precision option in conf/precision/")
    args.reference, args.format_overrides = REFERENCES[args.high]
    args.quantizer = args.quantizer or ("eager" if args.quick else "compiled")
    args.format_overrides = [*args.format_overrides, f"precision.quantizer={args.quantizer}"]
    args.precisions = [p for p in dict.fromkeys(args.precisions) if p != args.reference]  # it runs first
    model = [] if args.model is None else [f"model={args.model}"]
    if args.model in ("gpt2", "llama") and not any(o.startswith("data.batch_size=") for o in args.overrides):
        model.append("data.batch_size=8")  # the ~124M models at 8 x 1024 tokens a step
    args.overrides = [*model, *(QUICK_OVERRIDES if args.quick else []), *args.overrides]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # One CPU thread by default (as compare_loops.py): on a shared 2-core machine a second OpenMP
    # thread waiting for a busy core measures the neighbour, not the step.
    if args.threads or args.device == "cpu":
        torch.set_num_threads(args.threads or 1)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    modes, not_run = build_modes(args, device)
    env = environment(device, args, modes[0].cfg)
    print(f"torch {env['torch']} | {env['device_name']} | threads: {env['threads']}")
    print(f"GLIBC_TUNABLES={env['glibc_tunables']} | {env['model']}", flush=True)
    measure(modes, args)
    order = [args.reference, *args.precisions]
    rows = sorted([m.row for m in modes] + not_run, key=lambda r: order.index(r.precision))
    if args.json:
        report = {"env": env, "rows": [dataclasses.asdict(r) for r in rows]}
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    table = markdown(env, rows)
    if args.markdown:
        args.markdown.write_text(table)
    print(table)


if __name__ == "__main__":
    main()
