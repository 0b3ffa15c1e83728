"""The glibc malloc setting the CPU benchmarks run under (docs/benchmarks.md, "The allocator
setting"): large CPU tensors are otherwise mmapped and unmapped every step, and page faults take
12-36% of a step. No torch here: a script re-executes itself before it imports torch."""

from __future__ import annotations

import os
import sys

MALLOC_TUNABLES = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=68719476736"


def reexec_with_malloc_tuning() -> None:
    """glibc reads GLIBC_TUNABLES only when a process starts, so set it and start again. This runs
    before torch is imported, so the first start costs almost nothing."""
    if "GLIBC_TUNABLES" in os.environ or "--no-malloc-tuning" in sys.argv:
        return
    env = {**os.environ, "GLIBC_TUNABLES": MALLOC_TUNABLES}
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
