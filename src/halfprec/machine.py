"""What this machine offers a run: CPU cores for torch's threads and for DataLoader workers, and
whether its CPU computes in bf16 natively.

torch's default (a thread per core) is fastest on an idle machine and worst on a busy one: OpenMP
threads that wait for a core another process holds stall every op. Both defaults leave room for the
rest of the machine.
"""

from __future__ import annotations

import os
from pathlib import Path


def usable_cores() -> int:
    """The cores this process may run on (a SLURM or taskset limit included)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def processes_on_this_node() -> int:
    """Training processes sharing this machine's cores: LOCAL_WORLD_SIZE (torchrun's, or a submitit job's
    tasks per node, see halfprec.launch.cluster), else 1."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def launcher() -> str:
    """What started this process: "submitit" (a Hydra submitit job, on SLURM or local), "torchrun", or
    "python". Messages name the launcher the user would fix or continue with."""
    if "SUBMITIT_EXECUTOR" in os.environ:
        return "submitit"
    return "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "python"


def torch_threads(choice: int | str) -> int:
    """trainer.threads: an integer, or auto: $OMP_NUM_THREADS when it is set (torchrun sets 1), else
    half of this process's share of the cores, at least 1."""
    if choice != "auto":
        return int(choice)
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, usable_cores() // processes_on_this_node() // 2)


def loader_workers(choice: int | str, most: int = 8) -> int:
    """data.num_workers: an integer, or auto: this process's share of the cores less the one it
    trains on, at most `most`, at least 1 (torch warns about more workers than cores)."""
    if choice != "auto":
        return int(choice)
    return max(1, min(most, usable_cores() // processes_on_this_node() - 1))


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str] | None:
    """The CPU's feature flags (x86's `flags`, Arm's `Features` line of /proc/cpuinfo); None where
    the system does not say (macOS, Windows)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return None


def native_bf16(flags: set[str] | None) -> bool | None:
    """Whether the CPU has bf16 arithmetic (x86: AVX512-BF16 or AMX-BF16; Arm: the bf16 extension),
    which torch's bf16 matmuls need to be fast; None: unknown. Without it torch emulates bf16,
    exactly but slowly."""
    return None if flags is None else bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
