"""The `halfprec` console script: `halfprec report PATH`, `halfprec sensitivity RUN_DIR`,
`halfprec evaluate RUN_DIR`.

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
        "for a number format with diagnostics=grads quant_err.png, grad_noise.png and quant_heatmap_<job>.png, with "
        "diagnostics.shadow shadow_<format>_<job>.png (each layer's error in that format over steps), and for a "
        "run `halfprec sensitivity` measured sensitivity_<job>.png; runs with precision.eval get a val/loss@<entry> "
        "column per evaluation precision and eval_gap_<entry>.png (that val/loss above the run's own, against step).",
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
    add_sensitivity(commands)
    add_evaluate(commands)
    return parser


def run_report(args: argparse.Namespace) -> int:
    from halfprec.tools.report import ReportError, write_report

    try:
        return write_report(args.path, args.out, args.wandb)
    except ReportError as err:
        print(f"halfprec report: error: {err}", file=sys.stderr)
        return 2


def add_sensitivity(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "sensitivity",
        help="per layer and number format, the loss and gradient damage of a trained run; suggested precision.rules",
        description="Rebuild a run's model from its last checkpoint and, on a few validation batches, measure for "
        "every Linear layer (with --attention, every attention core) and each format: the loss increase with that "
        "layer alone in the format, and the cosine and relative error of its weight and input gradients; the whole "
        "model in the format as a reference row. "
        "Writes sensitivity.md, sensitivity.json and sensitivity.png, prints the table and a precision.rules list "
        "keeping high the most damaged layers (those whose damage exceeds twice its standard error) within --keep.",
    )
    parser.add_argument("path", type=Path, metavar="RUN_DIR", help="a run dir (its newest checkpoint) or a step-*.pt")
    parser.add_argument("--formats", help="comma-separated; the first is the one the suggested rules are for "
                        "(default: the run's precision.format, then every block-scaled format of "
                        "halfprec/numerics/formats: MX, NVFP4, fp8_block)")  # fmt: skip
    parser.add_argument("--batches", type=int, default=4, help="validation batches measured (default: %(default)s)")
    parser.add_argument("--keep", type=float, default=0.15, help="the share that may stay high (default: %(default)s)")
    parser.add_argument("--keep-by", choices=["layers", "params"], default="layers", help="a share of what")
    parser.add_argument("--recipe", default="run", help="run (the run's precision.recipe), none, or switches: "
                        "stochastic_grads,hadamard,weight_2d")  # fmt: skip
    parser.add_argument("--seed", type=int, help="stochastic rounding's seed (default: the run's)")
    parser.add_argument("--attention", action=argparse.BooleanOptionalAction, help="measure the attention cores "
                        "(the GPT's blocks.N.attn.core) too, each alone with its six GEMMs in the format: one more "
                        "pass per core, format and batch; rules naming a core need precision.attention.format "
                        "(default: on for a run that set precision.attention.format, else off)")  # fmt: skip
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: the run's trainer.device")
    parser.add_argument("--out", type=Path, metavar="DIR", help="where to write the files (default: the run dir)")
    parser.set_defaults(handler=run_sensitivity)


def run_sensitivity(args: argparse.Namespace) -> int:
    from halfprec.tools.sensitivity.command import sensitivity
    from halfprec.tools.sensitivity.measure import SensitivityError

    try:
        return sensitivity(args)
    except SensitivityError as err:
        print(f"halfprec sensitivity: error: {err}", file=sys.stderr)
        return 2


def add_evaluate(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "evaluate",
        help="a trained run's validation metrics in high precision and in number formats (post-training quantization)",
        description="Rebuild a run's model from its last checkpoint and evaluate the whole validation split in each "
        "precision of --eval: high (every Linear layer unquantized, in the run's autocast or parameter dtype) or a "
        "format (post-training quantization of the weights and activations of the Linear layers the run's plan "
        "would quantize: precision.rules, high_first and high_last apply, the output head stays high; the forward "
        "GEMM emulated, rounded to nearest), as precision.eval does at each validation of a run. Prints a table and "
        "writes evaluate.json and evaluate.csv.",
    )
    parser.add_argument("path", type=Path, metavar="RUN_DIR", help="a run dir (its newest checkpoint) or a step-*.pt")
    parser.add_argument("--eval", metavar="LIST", help="comma-separated: high and formats, e.g. high,mxfp4,nvfp4 "
                        "(default: the run's precision.eval, else high, the run's format, mxfp8, mxfp4, "
                        "nvfp4)")  # fmt: skip
    parser.add_argument("--rules", metavar="RULES", help="which layers the formats reach, instead of the run's "
                        "precision.rules: GLOB=FORMAT pairs, comma-separated, first match wins (a format or high, "
                        "e.g. 'blocks.0.*=high'), or none")  # fmt: skip
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: the run's trainer.device")
    parser.add_argument("--out", type=Path, metavar="DIR", help="where to write the files (default: the run dir)")
    parser.set_defaults(handler=run_evaluate)


def run_evaluate(args: argparse.Namespace) -> int:
    from halfprec.tools.evaluate import run_evaluate

    return run_evaluate(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
