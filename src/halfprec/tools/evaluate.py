"""`halfprec evaluate RUN_DIR`: a trained run's validation metrics in other precisions, from its
checkpoint: `high` (every Linear layer unquantized, in the run's autocast or parameter dtype) and
formats (post-training quantization of the layers the run's plan would quantize; numerics/
evaluation.py, as precision.eval computes them during a run). Prints a table and writes
evaluate.json and evaluate.csv (the parser is in tools/cli.py)."""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from pathlib import Path

from halfprec.config.schema import QuantRule
from halfprec.errors import ConfigError
from halfprec.numerics.evaluation import eval_precisions, layers_in
from halfprec.numerics.formats import FORMATS
from halfprec.numerics.settings import HIGH
from halfprec.tools.sensitivity.measure import Run, SensitivityError, load_run
from halfprec.tools.sensitivity.output import writable
from halfprec.training.metrics import evaluate

DEFAULT_FORMATS = ("mxfp8", "mxfp4", "nvfp4")


class EvaluateError(Exception):
    """A run or an argument the command cannot take: one line for the user."""


def parse_entries(text: str) -> list[str]:
    """--eval: high and format names, comma-separated, each once."""
    entries = [e.strip() for e in text.split(",") if e.strip()]
    unknown = [e for e in entries if e not in (HIGH, *FORMATS)]
    if unknown or not entries or len(set(entries)) < len(entries):
        what = f"unknown {', '.join(unknown)}" if unknown else "each once" if entries else "none given"
        raise EvaluateError(f"--eval {text}: {what}; high or a format ({', '.join(FORMATS)}), comma-separated")
    return entries


def parse_rules(text: str) -> list[QuantRule]:
    """--rules: `none`, or GLOB=FORMAT pairs (FORMAT a format or high), comma-separated, first match wins."""
    if text.strip() == "none":
        return []
    rules = []
    for pair in filter(None, (p.strip() for p in text.split(","))):
        match, _, fmt = pair.partition("=")
        if not match or fmt not in (HIGH, *FORMATS):
            raise EvaluateError(f"--rules {text}: {pair!r} is not GLOB=FORMAT (FORMAT high or a format, e.g. "
                                "'blocks.0.*=high,head=high'), nor none")  # fmt: skip
        rules.append(QuantRule(match, fmt))
    return rules


def default_entries(run: Run) -> str:
    """--eval when not given: the run's precision.eval, else high, its own format and MXFP8, MXFP4, NVFP4."""
    p = run.config.precision
    if p.eval:
        return ",".join(p.eval)
    return ",".join(dict.fromkeys([HIGH, *([p.format] if p.format else []), *DEFAULT_FORMATS]))


def measure(run: Run, entries: list[str], rules: list[QuantRule], given: bool = False) -> list[dict]:
    """One row per entry: the precision, the Linear layers it quantizes, the task's val/* metrics;
    `given`: the rules came from --rules (an error names it)."""
    p = run.config.precision
    try:
        precisions = eval_precisions(run.model, entries, p.recipe, rules, p.high_first, p.high_last, p.attention,
                                     p.accumulate)  # fmt: skip
    except ConfigError as err:  # a rule's glob, a format that quantizes nothing
        line = str(err).replace("precision.eval", "--eval")
        raise EvaluateError(line.replace("precision.rules", "--rules") if given else line) from None
    rows = []
    for precision in precisions:
        with layers_in(run.model, precision):
            metrics = evaluate(run.model, run.data, run.task, run.policy, run.config.data.batch_size, run.device)
        rows.append({"precision": precision.entry, "quantized_layers": precision.quantized, **metrics})
    return rows


def table(rows: list[dict]) -> list[str]:
    """The rows as a markdown table, each metric in its own column."""
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for row in rows:
        cells = [f"{v:.4f}" if isinstance(v, float) and math.isfinite(v) else str(v) for v in row.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def write(rows: list[dict], head: dict, out: Path) -> list[Path]:
    """evaluate.json (what was evaluated, and every row) and evaluate.csv (the rows) into `out`."""
    paths = [out / "evaluate.json", out / "evaluate.csv"]
    clean = [{k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in r.items()} for r in rows]
    paths[0].write_text(json.dumps({**head, "rows": clean}, indent=1) + "\n")
    with open(paths[1], "w", newline="", encoding="utf-8") as file:
        writer = csv.DictWriter(file, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return paths


def evaluate_command(args: argparse.Namespace) -> int:
    """The command: load the checkpoint, evaluate each entry, print the table, write the files."""
    if args.out is not None:
        writable(args.out, "--out")
    run = load_run(args.path, args.device)
    entries = parse_entries(args.eval or default_entries(run))
    rules = list(run.config.precision.rules) if args.rules is None else parse_rules(args.rules)
    out = args.out or (args.path if args.path.is_dir() else args.path.parent)
    writable(out, "--out")
    rows = measure(run, entries, rules, args.rules is not None)
    head = {"checkpoint": str(run.checkpoint), "step": run.step, "precision": run.config.precision.name,
            "rules": [{"match": r.match, "format": r.format} for r in rules]}  # fmt: skip
    print(f"{run.checkpoint} (step {run.step}, trained in precision={run.config.precision.name}), the validation "
          "split in each precision:")  # fmt: skip
    print("\n".join(table(rows)))
    print(f"wrote {', '.join(str(p) for p in write(rows, head, Path(out)))}")
    return 0


def run_evaluate(args: argparse.Namespace) -> int:
    try:
        return evaluate_command(args)
    except (EvaluateError, SensitivityError) as err:
        print(f"halfprec evaluate: error: {err}", file=sys.stderr)
        return 2
