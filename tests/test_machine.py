"""CPU threads and DataLoader workers chosen from the machine (trainer.threads, data.num_workers)."""

from __future__ import annotations

import pytest
import torch

from halfprec import machine
from halfprec.training.checkpoint import checkpoint_files, load_checkpoint
from halfprec.training.run import run

from helpers import compose_cfg


@pytest.fixture
def cores(monkeypatch):
    """Pretend this process may run on `n` cores, with no OMP_NUM_THREADS or torchrun around."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)

    def set_cores(n: int) -> None:
        monkeypatch.setattr(machine, "usable_cores", lambda: n)

    return set_cores


@pytest.mark.parametrize("n,threads", [(1, 1), (2, 1), (3, 1), (8, 4), (64, 32)])
def test_auto_threads_leave_half_the_cores_to_the_rest_of_the_machine(cores, n, threads):
    cores(n)
    assert machine.torch_threads("auto") == threads


def test_omp_num_threads_wins_over_auto_and_an_explicit_number_wins_over_both(cores, monkeypatch):
    cores(16)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert machine.torch_threads("auto") == 3
    assert machine.torch_threads(5) == 5


def test_processes_on_one_node_share_its_cores(cores, monkeypatch):
    cores(16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun --nproc_per_node=4 (without its OMP_NUM_THREADS=1)
    assert machine.torch_threads("auto") == 2
    assert machine.loader_workers("auto") == 3


@pytest.mark.parametrize("n,most,workers", [(2, 4, 1), (1, 4, 1), (4, 4, 3), (32, 4, 4), (32, 8, 8)])
def test_auto_workers_are_the_cores_less_the_training_process_within_bounds(cores, n, most, workers):
    cores(n)
    assert machine.loader_workers("auto", most=most) == workers
    assert machine.loader_workers(0) == 0


def test_the_run_trains_with_the_threads_it_was_given_and_records_the_number(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    seen = []
    monkeypatch.setattr(torch, "set_num_threads", seen.append)  # the test process keeps its own threads
    summary = run(compose_cfg("trainer.threads=3", "trainer.max_steps=2"), tmp_path)
    assert seen == [3] and summary["threads"] == 3
    ckpt = load_checkpoint(checkpoint_files(tmp_path / "checkpoints")[-1])
    assert ckpt["config"]["trainer"]["threads"] == 3


def test_auto_threads_on_this_machine_are_recorded_as_a_number(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    summary = run(compose_cfg("trainer.max_steps=2"), tmp_path)
    assert summary["threads"] == max(1, machine.usable_cores() // 2)


def test_the_cpus_flags_say_whether_it_has_bf16_units(tmp_path):
    """/proc/cpuinfo as x86 and Arm Linux write it; a system without the file gives no answer."""
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse2 avx2 fma\n\nprocessor\t: 1\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\nCPU implementer\t: 0x41\n")
    assert machine.cpu_flags(x86) == {"fpu", "sse2", "avx2", "fma"}
    assert machine.native_bf16(machine.cpu_flags(x86)) is False
    assert machine.native_bf16(machine.cpu_flags(arm)) is True
    assert machine.native_bf16({"avx512f", "amx_bf16"}) is True
    assert machine.cpu_flags(tmp_path / "missing") is None and machine.native_bf16(None) is None
