"""The `halfprec sensitivity` command: measure, print, write (the parser is in tools/cli.py)."""

from __future__ import annotations

import argparse
from dataclasses import asdict

from omegaconf import OmegaConf

from halfprec.numerics.layers import linear_layers
from halfprec.tools.sensitivity.measure import (
    SensitivityError,
    load_run,
    measure,
    parse_formats,
    parse_recipe,
    passes,
)
from halfprec.tools.sensitivity.output import Summary, damage_table, describe, write
from halfprec.tools.sensitivity.rules import keep_high, ranked, rules_override


def suggestion(fmt: str, keep: float, by: str, chosen: int, of: int) -> str:
    """The line before the suggested rules: what they keep high, and how they were chosen."""
    share = f"{keep:g} of the {'layers' if by == 'layers' else 'parameters'}"
    return (
        f"Suggested for {fmt}: {chosen} of its {of} layers high, the most damaged within {share} (--keep {keep:g} "
        f"--keep-by {by}); add to a run in {fmt} (precision=<its option> or precision.format={fmt}):"
    )


def sensitivity(args: argparse.Namespace) -> int:
    """The command: measure, print the table and the suggested rules, write the files."""
    from rich.progress import Progress

    formats = parse_formats(args.formats)
    if not 0 <= args.keep <= 1:
        raise SensitivityError(f"--keep {args.keep:g}: a share between 0 and 1 (0.15: 15% may stay high)")
    run = load_run(args.path, args.device)
    recipe = parse_recipe(args.recipe, run.cfg.precision.get("recipe") or OmegaConf.create())  # older runs: none
    total = passes(len(linear_layers(run.model)), len(formats), args.batches)
    with Progress(transient=True) as bar:
        task = bar.add_task("forward-backward passes", total=total)
        measured = measure(run, formats, args.batches, recipe, run.cfg.seed if args.seed is None else args.seed,
                           lambda: bar.advance(task))  # fmt: skip
    fmt = formats[0]
    candidates = ranked(measured, fmt)
    chosen = keep_high(candidates, args.keep, args.keep_by)
    rules = rules_override([r.layer for r in chosen])
    summary = Summary.of(str(args.path), run.step, run.cfg.precision.name, asdict(recipe), measured, formats)
    said = suggestion(fmt, args.keep, args.keep_by, len(chosen), len(candidates))
    print("\n".join([*describe(summary), "", *damage_table(summary), "", said, "", f"    {rules}"]))
    out = args.out or (args.path if args.path.is_dir() else args.path.parent)
    paths = write(summary, out, ["## Suggested rules", "", said, "", "```", rules, "```"])
    print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0
