"""A format's trip through the code: run `python train.py precision=<format>` for one step of a tiny
GPT under sys.setprofile, and list the src/halfprec files whose functions are given the precision
config (the composed node, the saved dict or the typed Precision) or the format's name as an
argument, with those functions, and how often each such file is entered from another (each distinct
caller and function: the revisits); then every entry into numerics/layers.py.

    python scripts/format_trip.py                  # precision=mxfp4
    python scripts/format_trip.py --format nvfp4   # another format's option

The fewer files and entries, the fewer places a reader (or a forker adding a format) follows.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import runpy
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = str(ROOT / "src" / "halfprec") + os.sep
TINY_GPT = [
    "task=lm", "model.n_layer=1", "model.n_embd=16", "model.n_head=2", "model.block_size=16", "data.batch_size=4",
    "logger=none", "trainer.progress=false", "trainer.threads=1", "trainer.max_steps=1", "trainer.val_every=0",
]  # fmt: skip


def is_precision(value: object, fmt: str) -> bool:
    """The format's name (alone, in a list, or in a plan's values), or the precision config in any
    form (it has both `format` and `kernel`)."""
    if isinstance(value, str):
        return value == fmt
    if isinstance(value, list | tuple):
        return fmt in value
    if isinstance(value, dict) or type(value).__name__ == "DictConfig":
        with contextlib.suppress(Exception):
            return ("format" in value and "kernel" in value) or fmt in value.values()  # type: ignore[operator, union-attr]
        return False
    return hasattr(type(value), "__dataclass_fields__") and {"format", "kernel"} <= set(value.__dataclass_fields__)


def trace(fmt: str, run_dir: str) -> tuple[dict[str, set[str]], dict[str, set[str]], set[tuple[str, str]]]:
    given: dict[str, set[str]] = defaultdict(set)  # file -> its functions given the precision or the name
    entered: dict[str, set[str]] = defaultdict(set)  # file -> "caller -> function" of those calls from another file
    entries: set[tuple[str, str]] = set()  # (caller, function of numerics/layers.py) across files

    def profile(frame, event, arg):  # noqa: ANN001 (sys.setprofile's hook)
        if event != "call" or not frame.f_code.co_filename.startswith(SRC):
            return
        code, file = frame.f_code, frame.f_code.co_filename.removeprefix(SRC)
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        caller = frame.f_back
        across = caller is not None and caller.f_code.co_filename != code.co_filename
        if any(is_precision(frame.f_locals.get(n), fmt) for n in names):
            given[file].add(code.co_name)
            if across and caller is not None:
                entered[file].add(f"{caller.f_code.co_filename.removeprefix(SRC)}:{caller.f_code.co_name}")
        if file == "numerics/layers.py" and caller is not None and across and code.co_name != "<module>":
            entries.add((f"{caller.f_code.co_filename.removeprefix(SRC)}:{caller.f_code.co_name}", code.co_name))

    sys.argv = ["train.py", f"precision={fmt}", *TINY_GPT, f"hydra.run.dir={run_dir}"]
    sys.setprofile(profile)
    try:
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    except SystemExit as done:
        if done.code:
            raise
    finally:
        sys.setprofile(None)
    return given, entered, entries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--format", default="mxfp4", help="the precision option (its format's name)")
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")
    with tempfile.TemporaryDirectory() as run_dir:
        given, entered, entries = trace(args.format, run_dir)
    visits = sum(len(callers) for callers in entered.values())
    print(f"{len(given)} files are given precision={args.format}'s config or its name, entered {visits} times:")
    for file in sorted(given):
        print(f"  {file:34} {len(entered[file]):2}  {', '.join(sorted(given[file]))}")
        for caller in sorted(entered[file]):
            print(f"  {'':38}from {caller}")
    print(f"{len(entries)} entries into numerics/layers.py from another file:")
    for caller, function in sorted(entries):
        print(f"  {caller} -> {function}")


if __name__ == "__main__":
    main()
