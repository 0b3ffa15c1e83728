"""How long the docs' runnable commands take at full length, on this machine.

    python benchmarks/showcases.py [--page README.md] [--only 0,3] [--replace OLD NEW] [--list]

Runs the code blocks a page marks `<!-- quick ... -->` (README.md by default; the convention is in
tests/test_docs_commands.py's docstring) as the docs test does: each block in a fresh temporary
directory, `python train.py` this interpreter and the repository's train.py, `halfprec` as
`python -m halfprec.tools.cli`, W&B offline. Unlike the test, a marker's max_steps is ignored: every
command runs as a reader would run it. `--replace precision=bf16 precision=fp32` edits every command
first (to time another choice). Prints a markdown table, a row per command as it ends: the block
(page:line), the command, wall seconds, CPU seconds (user + system of the command's processes) and
its exit status; above it the CPU, whether it has bf16 units, torch's version and the load average.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from test_docs_commands import ENV, parse_page, rewrite  # noqa: E402  (the docs test's parser)

from halfprec.machine import cpu_flags, native_bf16  # noqa: E402


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def header() -> None:
    import torch

    bf16 = {True: "yes", False: "no (torch emulates bf16)", None: "unknown"}[native_bf16(cpu_flags())]
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; bf16 units: {bf16}; torch {torch.__version__}")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    print("| block | command | wall s | CPU s | exit |\n|---|---|---|---|---|", flush=True)


def run(page: str, blocks: list, replace: list[list[str]]) -> None:
    env = {**os.environ, **ENV}
    for block in blocks:
        with tempfile.TemporaryDirectory(prefix="showcase-") as tmp:
            for command in block.commands:
                text = command.text
                for old, new in replace:
                    text = text.replace(old, new)
                cpu, start = children_cpu_s(), time.perf_counter()
                proc = subprocess.run(
                    rewrite(text),
                    shell=True,
                    cwd=tmp,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                wall, cpu = time.perf_counter() - start, children_cpu_s() - cpu
                print(f"| {page}:{block.line} | `{text}` | {wall:.0f} | {cpu:.0f} | {proc.returncode} |", flush=True)
                if proc.returncode != 0:
                    print("\n".join(proc.stderr.splitlines()[-10:]), file=sys.stderr)
    print(f"\nload average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--page", default="README.md", help="a markdown page, relative to the repository root")
    parser.add_argument("--only", default="", help="block indices (see --list), comma-separated")
    parser.add_argument("--replace", nargs=2, action="append", default=[], metavar=("OLD", "NEW"))
    parser.add_argument("--list", action="store_true", help="list the page's blocks and commands, run nothing")
    args = parser.parse_args()
    path = REPO / args.page
    blocks, errors = parse_page(path.read_text(encoding="utf-8"), args.page)
    if errors:
        sys.exit("\n".join(errors))
    if args.list:
        for i, block in enumerate(blocks):
            print(f"{i}  {args.page}:{block.line}")
            for command in block.commands:
                print(f"     {command.text}")
        return
    if args.only:
        blocks = [blocks[int(i)] for i in args.only.split(",")]
    header()
    run(args.page, blocks, args.replace)


if __name__ == "__main__":
    main()
