"""The `halfprec` console script: `halfprec report PATH`, and room for more subcommands.

Kept light so that `halfprec --help` answers at once: each command imports what it needs
(matplotlib, wandb) when it runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="halfprec", description="Tools around halfprec runs and sweeps.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    report = commands.add_parser(
        "report",
        help="table and plots of a run or a multirun sweep",
        description="Print a markdown table of a run or multirun sweep (one row per job: the overrides that vary, "
        "final losses and accuracy, skipped steps, loss scale, samples/s, status; with repeated seeds, a table "
        "per configuration first) and write report.md and the plots: loss.png (train/loss against step), "
        "scale.png (the loss scale, when a job has a loss scaler), sweep.png (final val/loss against a swept "
        "number such as optim.lr), for a transformer with diagnostics=grads attn_logits.png and logz.png, and "
        "for a number format with diagnostics=grads quant_err.png and quant_heatmap_<job>.png.",
    )
    report.add_argument("path", type=Path, metavar="PATH", help="a run dir, a multirun sweep dir, or a dir of them")
    report.add_argument(
        "--out", type=Path, metavar="DIR", help="where to write report.md and the plots (default: PATH)"
    )
    report.add_argument(
        "--wandb",
        action="store_true",
        help="also log the table and plots to a new W&B run (job_type report; $WANDB_MODE, offline by default)",
    )
    report.set_defaults(handler=run_report)
    return parser


def run_report(args: argparse.Namespace) -> int:
    from halfprec.tools.report import ReportError, write_report

    try:
        return write_report(args.path, args.out, args.wandb)
    except ReportError as err:
        print(f"halfprec report: error: {err}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
