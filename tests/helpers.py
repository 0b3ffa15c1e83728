"""In-process helpers: compose the real config and build the real components, as train.py does."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from halfprec.config import Config, validate
from halfprec.config import compose as compose_typed
from halfprec.config.resolvers import register_resolvers
from halfprec.training.build import Components, build

CONF = Path(__file__).resolve().parents[1] / "conf"
TRAIN = CONF.parent / "train.py"
TINY = ["trainer.max_steps=4", "trainer.log_every=1", "trainer.val_every=0", "model.hidden=[32]"]


def compose_cfg(*overrides: str):
    register_resolvers()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("train", overrides=["logger=none", "trainer.progress=false", *overrides])


def typed_cfg(*overrides: str) -> Config:
    """The config a run reads: composed as compose_cfg does, validated and typed."""
    return compose_typed(["logger=none", "trainer.progress=false", *overrides], CONF)


def build_from(*overrides: str) -> tuple[Components, object]:
    cfg = compose_cfg(*overrides)
    validate(cfg)
    return build(cfg), cfg


def step(c: Components, micro, clip=None, compute_norm=True):
    """One optimizer step of the built components, with clipping at `clip` (None: off)."""
    return replace(c.stepper, clip_grad_norm=clip).step(micro, compute_norm=compute_norm)


def flops_per_step(row: dict) -> float:
    """The FLOPs per optimizer step behind a metric row's perf/tflops (perf/step_ms, from the same
    clock readings, gives the time per step)."""
    return row["perf/tflops"] * 1e12 * row["perf/step_ms"] / 1000


def own_session() -> None:
    """Popen's preexec_fn for a run a test signals: a session of its own (Ctrl-C, sent to the group,
    reaches it as a terminal's would), with SIGINT at its default. A process started as a background
    job of a script ignores SIGINT and hands that on, and train.py leaves an ignored SIGINT ignored
    (as under nohup), so pytest run that way would otherwise see every Ctrl-C test hang."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def signalled(args: list[str], **popen_kwargs) -> Iterator[subprocess.Popen]:
    """A run started for a test to signal (own_session); killed with its group on the way out,
    so that a failed assertion does not leave it training."""
    proc = subprocess.Popen(args, preexec_fn=own_session, **popen_kwargs)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """fp32 tensors equal bit for bit (signed zeros included), NaN where NaN: a NaN's sign and payload
    are not values (x86 gives inf/inf a negative NaN, and which of two NaN operands a multiply returns
    is the compiler's choice of operand order)."""
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    return torch.equal(a.view(torch.int32)[~nan], b.view(torch.int32)[~nan])


def batch(n: int, seed: int = 0, shape=(1, 8, 8), classes: int = 10):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=g), torch.randint(0, classes, (n,), generator=g)


# The dtypes each precision option must really compute in and store Linear/Conv weights in.
# An option not listed here is held to what its own config says.
DTYPES = {
    "fp32": ("float32", "float32"),
    "tf32": ("float32", "float32"),
    "O0": ("float32", "float32"),
    "fp16": ("float16", "float32"),
    "O1": ("float16", "float32"),
    "bf16": ("bfloat16", "float32"),
    "fp16_pure": ("float16", "float16"),
    "O2": ("float16", "float16"),
    "O3": ("float16", "float16"),
    "bf16_pure": ("bfloat16", "bfloat16"),
    "bf16_pure_kahan": ("bfloat16", "bfloat16"),
    "bf16_pure_stochastic": ("bfloat16", "bfloat16"),
    "bf16_pure_master": ("bfloat16", "bfloat16"),
}


def torchrun(
    cwd, *overrides: str, nproc: int = 2, tiny: bool = True, timeout: float = 300
) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node=N train.py ...` as a user launches it; nproc=0 runs plain `python train.py ...`."""
    args = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone"]
    if nproc == 0:
        args = [sys.executable]
    args += [str(TRAIN), *(TINY if tiny else []), *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # SIGTERM first: torchrun then stops its workers, which run in sessions of their own, so a
        # SIGKILL to it alone would leave them running (on a GPU, holding it for what comes next)
        proc.terminate()
        try:
            proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        raise
    return subprocess.CompletedProcess(args, proc.returncode, out, err)
