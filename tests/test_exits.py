"""How runs and sweeps end: exit codes, one-line messages, errors that cross process boundaries."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

from halfprec.errors import ConfigError, InitError, PrecisionMismatch, Preempted, TrainingAborted
from halfprec.launch import exits

from helpers import TRAIN


@pytest.mark.parametrize(
    "err,code,line",
    [
        (ConfigError("accum", 0, "must be >= 1"), 2, "error: accum=0: must be >= 1"),
        (InitError("no residual branches"), 2, "error: no residual branches"),
        (TrainingAborted("step 7: a skip storm"), 3, "error: training stopped: step 7: a skip storm"),
        (PrecisionMismatch("fc computed in float32"), 3, "error: training stopped: fc computed in float32"),
        (Preempted("Ctrl-C at step 9: saved x"), 4, "stopped: Ctrl-C at step 9: saved x"),
    ],
)
def test_each_user_facing_error_has_its_exit_code_and_one_line(err, code, line):
    assert exits.failure_line(err) == (code, line)


def test_anything_else_is_a_bug():
    assert exits.failure_line(KeyError("x")) is None


@pytest.mark.parametrize(
    "err", [ConfigError("optim.lr", -1, "must be >= 0"), TrainingAborted("diverged"), Preempted("SIGTERM at step 3")]
)
def test_errors_survive_pickling_with_their_message(err):
    """Launchers that run jobs in other processes (submitit, joblib) send the job's exception back."""
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err) and exits.failure_line(back) == exits.failure_line(err)


def test_an_unknown_option_names_the_closest_one_and_all_of_them():
    line = exits.unknown_option("precision", "bf-16", ["bf16", "fp16", "fp32"])
    assert (
        line
        == "precision=bf-16: no such option in conf/precision/; did you mean precision=bf16? options: bf16, fp16, fp32"
    )
    assert "did you mean" not in exits.unknown_option("precision", "zzz", ["bf16", "fp16"])


def test_an_override_hydra_cannot_parse_is_one_line_naming_it(tmp_path):
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    with pytest.raises(OverrideParseException) as info:
        OverridesParser.create().parse_overrides(["hydra.run.dir=/tmp/a=b"])
    code, line = exits.hydra_error_line(info.value, tmp_path, [])
    assert code == 2 and "\n" not in line
    assert line.startswith("error: hydra.run.dir=/tmp/a=b: not an override Hydra can read (mismatched input '='")
    assert line.endswith("""quote a value that holds '=', spaces or brackets: 'key="a value"'""")


def test_a_sweep_that_cannot_launch_its_next_job_says_so_in_one_line(tmp_path):
    """One job ran, then the next one's config did not compose (each batch is composed as it
    launches): the error was printed nowhere and Hydra's dump ended the sweep with exit 1."""
    args = ["-m", "precision=bf16,nosuch", "hydra.sweeper.max_batch_size=1", "trainer.max_steps=2", "logger=none",
            "model.hidden=[8]", f"hydra.sweep.dir={tmp_path / 'sweep'}"]  # fmt: skip
    result = subprocess.run(
        [sys.executable, str(TRAIN), *args], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith(("error", "sweep:"))]
    assert lines[0].startswith("error: precision=nosuch: no such option in conf/precision/")
    assert lines[0].endswith("; the sweep stopped: the jobs after those recorded did not run")
    assert lines[1] == f"sweep: 1 completed; {tmp_path / 'sweep' / 'sweep.jsonl'} (exit 2)"
    assert "Config search path" not in result.stderr
