"""The `halfprec sensitivity` command: check the arguments, measure with a progress display, print,
write (the parser is in tools/cli.py)."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from pathlib import Path

from halfprec.config.rules import slow_on_cpu
from halfprec.numerics.attention import AttentionRecipe
from halfprec.numerics.layers import attention_cores
from halfprec.tools.sensitivity.measure import (
    SIGNIFICANT,
    Measured,
    Row,
    SensitivityError,
    candidates,
    load_run,
    measure,
    parse_formats,
    parse_recipe,
    passes,
)
from halfprec.tools.sensitivity.output import Summary, damage_table, describe, writable, write
from halfprec.tools.sensitivity.rules import keep_high, ranked, suggested_override


def check_arguments(args: argparse.Namespace) -> None:
    """Every argument that can be judged before the (slow) measurement, one line each."""
    if args.batches < 1:
        raise SensitivityError(f"--batches {args.batches}: measure at least 1 validation batch (2 or more give each "
                               "damage a standard error, which a suggested rule needs)")  # fmt: skip
    if not 0 <= args.keep <= 1:
        raise SensitivityError(f"--keep {args.keep:g}: a share between 0 and 1 (0.15: 15% may stay high)")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SensitivityError("--device cuda: no CUDA GPU is visible here; use --device cpu")
    if args.out is not None:
        writable(args.out, "--out")


def attention_recipe(flag: bool | None, run_attention: AttentionRecipe) -> AttentionRecipe | None:
    """--attention / --no-attention, by default whether the run quantized attention: the cores are
    measured with the run's precision.attention.hadamard, their GEMMs in each measured format."""
    if not (run_attention.format is not None if flag is None else flag):
        return None
    return AttentionRecipe(hadamard=run_attention.hadamard)


def default_formats(run_format: str | None) -> str:
    """--formats when not given: the run's own format first (the suggested rules are for it), then
    the block-scaled formats of the registry (numerics/formats)."""
    from halfprec.numerics.formats import BLOCK_SCALED

    first = [run_format] if run_format else []
    return ",".join(dict.fromkeys([*first, *BLOCK_SCALED]))


def suggestion(fmt: str, args: argparse.Namespace, measured: Measured, candidates: list[Row]) -> list[str]:
    """What to add to a run in `fmt`: the rules keeping its most damaged layers high, or why none."""
    chosen = keep_high(candidates, args.keep, args.keep_by, Measured.significant)
    noisy = sum(not Measured.significant(r) for r in candidates)
    if not chosen:
        why = (
            f"no layer's damage exceeds {SIGNIFICANT:g} standard errors over {measured.batches} batch(es)"
            if noisy == len(candidates)
            else f"--keep {args.keep:g} of its {len(candidates)} layers (--keep-by {args.keep_by}) holds none"
        )
        return [f"No rule suggested for {fmt}: {why}; more --batches narrow the errors, a larger --keep allows more."]
    share = f"{args.keep:g} of the {'layers' if args.keep_by == 'layers' else 'parameters'}"
    cores = ", with attention in it: a rule naming an attention core needs precision.attention.format" if any(
        r.core for r in chosen) else ""  # fmt: skip
    return [
        f"Suggested for {fmt}: {len(chosen)} of its {len(candidates)} layers high, the most damaged within {share} "
        f"(--keep {args.keep:g} --keep-by {args.keep_by}), among those whose damage exceeds {SIGNIFICANT:g} "
        f"standard errors; add to a run in {fmt} (precision=<its option> or precision.format={fmt}){cores}:",
        "",
        f"    {suggested_override(chosen, fmt)}",
    ]


class Passes:
    """Progress over the forward-backward passes: a bar on a terminal, a line every tenth in a log."""

    def __init__(self, total: int):
        self.total, self.done, self.start = total, 0, time.perf_counter()
        self.bar = None
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import Progress

            self.bar = Progress(console=Console(stderr=True), transient=True)
            self.task = self.bar.add_task("", total=total)
            self.bar.start()

    def advance(self, what: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.update(self.task, advance=1, description=what)
        elif self.done * 10 // self.total > (self.done - 1) * 10 // self.total:
            elapsed = time.perf_counter() - self.start
            print(f"{self.done}/{self.total} passes ({what}), {elapsed:.0f} s", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def sensitivity(args: argparse.Namespace) -> int:
    """The command: measure, print the table and the suggested rules, write the files."""
    check_arguments(args)
    run = load_run(args.path, args.device)
    formats = parse_formats(args.formats or default_formats(run.config.precision.format))
    recipe = parse_recipe(args.recipe, run.config.precision.recipe)
    out = args.out or (args.path if args.path.is_dir() else args.path.parent)
    writable(out, "--out")
    attention = attention_recipe(args.attention, run.config.precision.attention)
    layers, _ = candidates(run, formats, attention is not None)  # nothing to measure: said before any pass
    cores = len(attention_cores(run.model)) if attention else 0
    what = f"{len(layers) - cores} Linear layer(s)" + (f" and {cores} attention core(s)" if attention else "")
    total = passes(len(layers), len(formats), args.batches)
    print(f"measuring {run.checkpoint} (step {run.step}): {what} x {len(formats)} format(s) "
          f"on up to {args.batches} validation batch(es): {total} forward-backward passes",
          file=sys.stderr)  # fmt: skip
    slow = slow_on_cpu(run.config.precision) if run.device.type == "cpu" else None
    if slow:  # as train.py warns at its start
        print(f"warning: the measurement computes as the run did: {slow}", file=sys.stderr)
    progress = Passes(total)
    try:
        measured = measure(run, formats, args.batches, recipe, run.config.seed if args.seed is None else args.seed,
                           progress.advance, attention)  # fmt: skip
    finally:
        progress.close()
    fmt = formats[0]
    said = suggestion(fmt, args, measured, ranked(measured, fmt))
    switches = {**asdict(recipe), **({"attention.hadamard": True} if attention and attention.hadamard else {})}
    summary = Summary.of(str(args.path), run.step, run.config.precision.name, switches, measured, formats)
    print("\n".join([*describe(summary), "", *damage_table(summary), "", *said]))
    paths = write(summary, Path(out), ["## Suggested rules", "", *said])
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0
