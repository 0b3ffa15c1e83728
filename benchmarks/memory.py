"""Peak memory of halfprec's training step per precision mode, against halfprec.tools.memory's estimate.

    python benchmarks/memory.py [--device cpu|cuda] [--models mlp-small,...] [--precisions fp32,bf16,...]
                                [--modes fp32-adamw,bf16_pure-remainder,...] [--per-param]
                                [--steps N] [--override KEY=VALUE ...] [--quick] [--json OUT.json]
                                [--markdown OUT.md]

See docs/benchmarks.md for what is measured how, and measured tables.

For each (model, precision mode): `halfprec.training.build.build(cfg)` builds the components, then
steps of its `stepper` run on fresh synthetic batches of the workload's size (the workloads
of compare_loops.py), one batch alive at a time, until --steps (3) of them have updated the weights
(fp16's first loss scales may overflow: skipped steps, at most MAX_SKIPS, come on top). Measured
is the peak of allocated memory over the build and the steps, above what was allocated before the build:

  cuda  torch.cuda.max_memory_allocated() after reset_peak_memory_stats(), minus memory_allocated()
        before the build (the previous row's tensors freed and the caching allocator emptied first)
  cpu   the CPU allocator has no such counters: torch.profiler with profile_memory=True records every
        allocation and free, and the peak of their running sum in time order is the peak; the synthetic
        dataset build() makes (the steps never read it) is subtracted

Estimated is `halfprec.tools.memory.estimate_memory` on the built components and the last batch: parameters,
buffers, gradients, master weights and gradients, optimizer state, Kahan buffers, the batch, and the
activations autograd saves in one forward. The table shows each part, their sum, the measured peak and
measured / estimate.

--modes names rows by label (MODES: a precision option and the overrides that make an optimizer or
master-weight variant, fp32-adamw8bit) or by precision option. --per-param adds a second table: the
estimate's parts per trainable parameter (halfprec.tools.memory.bytes_per_param), the measured peak
per parameter and measured / estimate; its default rows are PER_PARAM_MODES on PER_PARAM_MODEL.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
from compare_loops import CONF, WORKLOADS, Workload, choose_rows, compose_cfg, machine, synthetic_batches
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from halfprec.errors import ConfigError
from halfprec.tools.memory import MB, bytes_per_param, estimate_memory
from halfprec.training.build import Components, build

DEFAULT_MODELS = {"cpu": ["mlp-small", "mlp-big", "fixup-resnet"], "cuda": ["resnet50", "vit-b16"]}
# fp16 autocast on a CPU runs ~6x slower than bf16 (compare_loops): the CPU defaults leave it out
DEFAULT_PRECISIONS = {
    "cpu": ["fp32", "bf16", "bf16_pure", "bf16_pure_master"],
    "cuda": ["fp32", "tf32", "fp16", "bf16", "fp16_pure", "bf16_pure", "bf16_pure_master", "fp8"],
}
QUICK_PRECISIONS = ["fp32", "bf16", "bf16_pure_kahan", "bf16_pure_master"]  # every part of the estimate nonzero
PARTS = {  # MemoryEstimate field: column header
    "params": "params",
    "buffers": "buffers",
    "grads": "grads",
    "master_weights": "master w",
    "master_grads": "master g",
    "optimizer_state": "optim state",
    "compensation": "compensation",
    "inputs": "batch",
    "activations": "activations",
}
# --modes labels: (precision option, overrides). A variant is named by what it changes; every one
# steps AdamW, so that the bytes-per-parameter rows differ in one thing each.
MODES: dict[str, tuple[str, tuple[str, ...]]] = {
    "fp32-adamw": ("fp32", ("optim=adamw",)),
    "bf16-adamw": ("bf16", ("optim=adamw",)),
    "bf16_pure-nearest": ("bf16_pure", ("optim=adamw",)),
    "bf16_pure-master": ("bf16_pure_master", ("optim=adamw",)),
    "bf16_pure-remainder": ("bf16_pure", ("precision.master=remainder", "optim=adamw")),
    "bf16_pure-kahan": ("bf16_pure_kahan", ("optim=adamw",)),
    "bf16_pure-stochastic": ("bf16_pure_stochastic", ("optim=adamw",)),
    "fp32-adamw-bf16state": ("fp32", ("optim=adamw", "optim.state_dtype=bfloat16")),
    "fp32-adamw8bit": ("fp32", ("optim=adamw8bit",)),
    "fp32-adamw4bit": ("fp32", ("optim=adamw4bit",)),
    "fp32-adamw_fp8": ("fp32", ("optim=adamw_fp8",)),
}
PER_PARAM_MODES = [
    "fp32-adamw",
    "bf16-adamw",
    "bf16_pure-master",
    "bf16_pure-remainder",
    "bf16_pure-kahan",
    "bf16_pure-stochastic",
    "fp32-adamw-bf16state",
    "fp32-adamw8bit",
    "fp32-adamw4bit",
]
# 6.3 M parameters in 6 tensors, 99.6% of them in the two big weights: per-tensor overheads (step counts,
# torchao's code books) and the fp32 moments torchao keeps for the biases (under 4096 values) add less
# than 0.01 bytes per parameter. Its largest tensor holds 2/3 of the parameters, so the update's
# per-tensor temporaries weigh more in its peak than in a model of many similar tensors.
PER_PARAM_MODEL = "mlp-big"
# BytesPerParam's fields and totals in the per-parameter table: column header
PER_PARAM = {
    "weights": "weights",
    "master": "master",
    "grads": "grads",
    "optimizer_state": "optim state",
    "compensation": "compensation",
    "total": "total",
    "update": "update (transient)",
    "batch_activations": "batch + activations",
    "estimate": "estimate",
    "measured": "measured",
}
MAX_SKIPS = 16  # overflowed fp16 steps a row may take on top of --steps (the scale halves each time)
T = TypeVar("T")


@dataclass
class Row:
    model: str
    label: str  # the --modes label (the precision option where --precisions named the row)
    precision: str
    overrides: list[str]  # the label's overrides, beside the workload's
    mode: (
        str  # how the optimizer reaches the weights: fp32 | master | lowp (halfprec.numerics.params.ParamStrategy.kind)
    )
    batch_size: int
    estimate_mb: dict[str, float]  # every part of the estimate, and "total"
    measured_mb: float
    ratio: float  # measured / estimated total
    params: int  # trainable parameters
    per_param: dict[str, float]  # bytes per trainable parameter: PER_PARAM's keys
    dataset_mb: float  # CPU: the synthetic dataset build() made, subtracted from the measured peak
    seconds: float
    note: str


def peak_bytes(device: torch.device, work: Callable[[], T]) -> tuple[int, T]:
    """Run `work()`; return the peak of the memory it allocated on `device`, in bytes, and its result."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = work()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before, result
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = work()
    # "[memory]" events carry +bytes on allocation and -bytes on free
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    running = peak = 0
    for e in sorted((e for e in events if e.device_type() == DeviceType.CPU), key=lambda e: e.start_ns()):
        running += e.nbytes()
        peak = max(peak, running)
    return peak, result


def dataset_bytes(c: Components) -> int:
    """The synthetic dataset build() makes, in host memory; the steps use their own batches."""
    return sum(t.untyped_storage().nbytes() for t in (c.data.train.x, c.data.train.y, c.data.val.x, c.data.val.y))


def resolve(mode: str) -> tuple[str, tuple[str, ...]]:
    """A --modes label's precision option and overrides; a precision option stands for itself."""
    return MODES.get(mode, (mode, ()))


def measure(work: Workload, mode: str, device: torch.device, steps: int) -> Row:
    start = time.perf_counter()
    precision, overrides = resolve(mode)
    # trainer.channels_last as compare_loops: the workload decides, batches follow
    cfg = compose_cfg(dataclasses.replace(work, overrides=(*work.overrides, *overrides)), precision, device, None)
    channels_last = cfg.trainer.channels_last

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = synthetic_batches(dataclasses.replace(work, n_batches=1), device, cfg.seed + i)[0]
        return (x.contiguous(memory_format=torch.channels_last) if channels_last else x), y

    def train() -> tuple[Components, tuple[torch.Tensor, torch.Tensor], int]:
        c = build(cfg)
        # `steps` steps that update the weights: fp16's first scales may overflow, and a skipped
        # step makes no optimizer state, so a peak over skipped steps alone would miss it
        taken = tries = 0
        while taken < steps and tries < steps + MAX_SKIPS:
            micro = batch(tries)  # made here, so the peak holds one batch, as the estimate counts
            tries += 1
            taken += not c.stepper.step([micro]).skipped
        return c, micro, taken

    peak, (c, last, taken) = peak_bytes(device, train)
    dataset = dataset_bytes(c) if device.type == "cpu" else 0
    estimate = estimate_memory(c, last)
    measured = peak - dataset
    per_param = bytes_per_param(estimate, c.stepper.params)
    return Row(
        model=work.label,
        label=mode,
        precision=precision,
        overrides=list(overrides),
        mode=c.stepper.params.kind,
        batch_size=work.batch_size,
        estimate_mb=estimate.megabytes(),
        measured_mb=measured / MB,
        ratio=measured / estimate.total,
        params=per_param.params,
        per_param={
            **{k: v for k, v in dataclasses.asdict(per_param).items() if k != "params"},
            "total": per_param.total,
            "estimate": estimate.total / per_param.params,
            "measured": measured / per_param.params,
        },
        dataset_mb=dataset / MB,
        seconds=time.perf_counter() - start,
        note=note(c, steps, taken),
    )


def note(c: Components, steps: int, taken: int) -> str:
    notes, step = [], c.stepper
    if taken < steps:  # out of skips: the peak may lack the optimizer state
        notes.append(f"only {taken} of {steps} steps updated the weights ({step.scaler.skipped_steps} skipped)")
    elif step.scaler.skipped_steps:  # fp16's first scales can overflow: those steps come on top
        notes.append(f"{step.scaler.skipped_steps} skipped steps besides the {steps} taken")
    if step.policy.autocast_dtype is not None:
        notes.append(
            f"activations hold autocast's {str(step.policy.autocast_dtype).removeprefix('torch.')} weight copies"
        )
    if step.params.kind == "master":
        notes.append("fp32 master weights; master grads replace the model's during the update")
    if step.params.kind == "lowp":
        notes.append("master w/g: fp32 upcasts during the update only")
        if step.policy.update != "nearest":  # finish_ rounds through fp32 temporaries of each weight
            notes.append(f"{step.policy.update} rounding's fp32 temporaries not in the estimate")
    return "; ".join(notes)


# ---------------------------------------------------------------- output


def environment(device: torch.device, args: argparse.Namespace) -> dict:
    return {
        **machine(device),
        "steps": args.steps,
        "overrides": args.override,
        "measured_by": "torch.cuda.max_memory_allocated" if device.type == "cuda" else "torch.profiler memory events",
        "not_run": [],  # (model, mode) pairs the config rejects, with the reason
    }


def header(env: dict) -> str:
    parts = " | ".join(PARTS.values())
    return "\n".join(
        [
            f"{env['date']}, {env['device_name']}, torch {env['torch']}, {env['steps']} optimizer steps per row, "
            f"peak by {env['measured_by']}. `{env['command']}`",
            "MiB; the estimate's parts, their sum, and the measured peak above the memory before the build.",
            "",
            f"| model | mode | batch | {parts} | estimate | measured | measured / estimate | s | note |",
            "|---|---|---:|" + "---:|" * (len(PARTS) + 4) + "---|",
        ]
    )


def table_row(r: Row) -> str:
    parts = " | ".join(f"{r.estimate_mb[name]:,.2f}" for name in PARTS)
    return (
        f"| {r.model} | {r.label} | {r.batch_size} | {parts} | {r.estimate_mb['total']:,.2f} | "
        f"{r.measured_mb:,.2f} | {r.ratio:.2f} | {r.seconds:.1f} | {r.note} |"
    )


def per_param_table(rows: list[Row]) -> str:
    """The second table (--per-param): every row's bytes per trainable parameter."""
    columns = " | ".join(PER_PARAM.values())
    lines = [
        "Bytes per trainable parameter. total = weights (buffers included) + master + grads + optim state + "
        "compensation; update: fp32 tensors held during the update only (master grads; without master copies "
        "each weight's fp32 upcast and gradient); batch + activations: per step. estimate = the sum of all, "
        "measured = the peak, both per parameter.",
        "",
        f"| model | params | mode | {columns} | measured / estimate |",
        "|---|---:|---|" + "---:|" * (len(PER_PARAM) + 1),
    ]
    for r in rows:
        values = " | ".join(f"{r.per_param[key]:.2f}" for key in PER_PARAM)
        lines.append(f"| {r.model} | {r.params:,} | {r.label} | {values} | {r.ratio:.2f} |")
    return "\n".join(lines)


def write_outputs(args: argparse.Namespace, env: dict, rows: list[Row]) -> None:
    if args.markdown:
        not_run = [f"Not run: {line}" for line in env["not_run"]]
        per_param = ["", per_param_table(rows)] if args.per_param else []
        text = "\n".join([header(env), *map(table_row, rows), *per_param, "", *not_run])
        args.markdown.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps({"env": env, "rows": [dataclasses.asdict(r) for r in rows]}, indent=1) + "\n")


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available")
    parser.add_argument("--models", default=None, help=f"comma-separated, of: {', '.join(WORKLOADS)}")
    parser.add_argument("--precisions", default=None, help="comma-separated halfprec precision options")
    parser.add_argument(
        "--modes",
        default=None,
        help=f"instead of --precisions: comma-separated labels, of {', '.join(MODES)}, or precision options",
    )
    parser.add_argument(
        "--per-param",
        action="store_true",
        help="also print the bytes per trainable parameter; unless given (or --quick), the models are "
        f"{PER_PARAM_MODEL} and the modes {', '.join(PER_PARAM_MODES)}",
    )
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per row (the state appears at the 1st)")
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a Hydra override for every row (optim=adamw)",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: mlp-small in four modes (seconds on CPU)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the table as markdown")
    args = parser.parse_args(argv)

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is visible here")
    if args.steps < 2:
        parser.error("--steps: at least 2 (the optimizer state appears during the first)")
    choose_modes(parser, args)
    return args


def choose_modes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """args.models and args.modes as lists: --modes, else --precisions, else the defaults (with
    --per-param and without --quick: PER_PARAM_MODEL, PER_PARAM_MODES). A label neither in MODES nor
    a precision option is a usage error here, not a Hydra error after the rows before it have run."""
    if args.modes and args.precisions:
        parser.error("--modes replaces --precisions: give one of them")
    if args.per_param and not args.quick:
        args.models = args.models or PER_PARAM_MODEL
        args.modes = args.modes or (None if args.precisions else ",".join(PER_PARAM_MODES))
    default_precisions = QUICK_PRECISIONS if args.quick else DEFAULT_PRECISIONS[args.device]
    choose_rows(parser, args, DEFAULT_MODELS[args.device], default_precisions)
    args.modes = args.modes.split(",") if args.modes else args.precisions
    unknown = [m for m in args.modes if m not in MODES and not (CONF / "precision" / f"{m}.yaml").exists()]
    if unknown:
        parser.error(f"--modes {','.join(unknown)}: unknown; choose from {', '.join(MODES)} or a precision option")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # as compare_loops: a second thread on a shared 2-core machine measures the neighbour
    else:
        # cuBLAS and cuBLASLt (matmuls with a bias) make their workspaces at the first call and keep
        # them: make them before the first row's baseline, so that no row counts them.
        # cudnn.benchmark stays off: trying every algorithm would put the largest workspace in the peak.
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            a = torch.ones(64, 64, device=device, dtype=dtype)
            (a @ a + torch.nn.functional.linear(a, a, a[0])).sum().item()
    env = environment(device, args)
    print(header(env), flush=True)
    rows: list[Row] = []
    for key in args.models:
        work = WORKLOADS[key]
        if args.override:  # the rows name what changed: the same model with AdamW is another row
            label = f"{work.label} ({' '.join(args.override)})"
            work = dataclasses.replace(work, label=label, overrides=(*work.overrides, *args.override))
        for mode in args.modes:
            try:
                rows.append(measure(work, mode, device, args.steps))
            except ConfigError as err:  # a mode this model cannot run (fp8 on resnet50: no eligible Linear)
                env["not_run"].append(f"{work.label}, {mode}: {err}")
                print(f"{work.label}, {mode}: not run: {err}", file=sys.stderr, flush=True)
                write_outputs(args, env, rows)
                continue
            print(table_row(rows[-1]), flush=True)
            print(f"{rows[-1].model}, {mode}: {rows[-1].seconds:.1f} s", file=sys.stderr, flush=True)
            write_outputs(args, env, rows)  # after every row: a run cut short keeps what it measured
            gc.collect()  # the row's components are garbage now: free them before the next baseline
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.per_param:  # after the last row: the rows above stream, this table sums them up
        print("\n" + per_param_table(rows), flush=True)


if __name__ == "__main__":
    main()
