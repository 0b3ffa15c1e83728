"""Sweeps as users launch them: Optuna, fail-fast, the loss-scaling experiment, W&B sweep commands."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import CHEAP, REPO, TRAIN, read_jsonl

import wandb_records
from helpers import signalled

SWEEPS = sorted((REPO / "sweeps").glob("*.yaml"))


@pytest.fixture(scope="module")
def started(cli):
    """The slow sweeps of this module, started together on the 2-worker pool."""
    return {
        "optuna": cli.submit(
            "hparams_search=optuna", "hydra.sweeper.n_trials=3", "logger=none", "model.hidden=[16]", multirun=True
        ),
        "optuna_diverging": cli.submit(
            "hparams_search=optuna",
            "hydra.sweeper.n_trials=4",
            "optim.lr=choice(1e6,0.1)",
            "accum=1",
            "precision=fp32",
            "scaler.init_scale=1024",
            "logger=none",
            "trainer.max_steps=100",
            "trainer.progress=false",
            cheap=False,
            multirun=True,
        ),
        "diverging": cli.submit(
            "optim.lr=1e6,0.1",
            "logger=none",
            "trainer.max_steps=100",
            "trainer.progress=false",
            cheap=False,
            multirun=True,
        ),
        "loss_scaling": cli.submit(
            "+experiment=loss_scaling",
            "hydra.sweeper.params.precision=fp16",
            "hydra.sweeper.params.seed=0",
            "logger=none",
            "trainer.max_steps=150",
            "data.batch_size=256",
            multirun=True,
        ),
    }


def test_optuna_search_runs_trials_and_reports_the_best(started):
    result = started["optuna"].result()
    result.check()
    # Optuna's and its storage layer's start-up chatter is quieted (the sweeper logs the study itself)
    assert "A new study created" not in result.output and "setup plugin" not in result.output
    lines = read_jsonl(result.sweep_dir / "sweep.jsonl")
    assert len(lines) == 3 and {line["status"] for line in lines} == {"completed"}
    # every trial sampled all four searched keys
    for line in lines:
        keys = {o.split("=", 1)[0] for o in line["overrides"]}
        assert {"optim.lr", "scaler.init_scale", "accum", "precision"} <= keys
    best = yaml.safe_load((result.sweep_dir / "optimization_results.yaml").read_text())
    assert set(best["best_params"]) == {"optim.lr", "scaler.init_scale", "accum", "precision"}
    # the value Optuna optimized is what train.py's main returned: each job's final val/acc
    assert best["best_value"] == pytest.approx(max(line["val/acc"] for line in lines))
    assert 0.003 <= best["best_params"]["optim.lr"] <= 1.0


def test_a_diverged_trial_is_a_result_for_the_search_not_a_reason_to_stop_it(started):
    """The search runs all its trials and writes its results; a diverged trial is recorded as
    diverged, told to Optuna as the worst value, and its error is printed once."""
    result = started["optuna_diverging"].result()
    assert result.returncode == 5, result.output[-3000:]
    lines = read_jsonl(result.sweep_dir / "sweep.jsonl")
    diverged = [line for line in lines if line["status"] == "diverged"]
    assert len(lines) == 4 and diverged and len(diverged) < 4, [line["status"] for line in lines]
    assert all("optim.lr=1000000.0" in line["overrides"] for line in diverged)
    best = yaml.safe_load((result.sweep_dir / "optimization_results.yaml").read_text())
    assert best["best_params"] == {"optim.lr": 0.1}  # accum, precision, init_scale were fixed
    assert best["best_value"] == pytest.approx(max(line["val/acc"] for line in lines if line["status"] == "completed"))
    # one line per diverged job (the sweeper's own "Failed ..." lines are not repeated), no traceback
    assert result.stderr.count("error: training stopped: step 58") == len(diverged)
    assert "Failed" not in result.output and "Traceback" not in result.output
    assert "Error executing job" not in result.output
    completed = len(lines) - len(diverged)
    end = f"sweep: {completed} completed, {len(diverged)} diverged; {result.sweep_dir / 'sweep.jsonl'} (exit 5)"
    assert result.stderr.splitlines()[-1] == end


def test_the_search_optimizes_the_objective_the_way_it_wants(tmp_path):
    """val/acc is maximized, val/loss and train/loss minimized, without setting the direction;
    objective=null is the task's own (val/acc for classification, val/loss for task=lm)."""
    from hydra import compose, initialize_config_dir

    from halfprec.components.tasks import task_metric
    from halfprec.config.resolvers import register_resolvers

    register_resolvers()
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        for overrides, objective, direction in [
            ([], "val/acc", "maximize"),
            (["task=lm"], "val/loss", "minimize"),
            (["objective=train/loss"], "train/loss", "minimize"),
            (["task=lm", "objective=val/bpb"], "val/bpb", "minimize"),
        ]:
            cfg = compose("train", overrides=["hparams_search=optuna", *overrides], return_hydra_config=True)
            metric = task_metric(cfg.task.name, cfg.objective)
            assert (metric.name, cfg.hydra.sweeper.direction) == (objective, direction), overrides


def test_loss_scaling_experiment_reproduces_underflow_stall(started):
    result = started["loss_scaling"].result()
    result.check()
    by_scaler = {}
    for line in read_jsonl(result.sweep_dir / "sweep.jsonl"):
        scaler = next(o.split("=")[1] for o in line["overrides"] if o.startswith("scaler="))
        by_scaler[scaler] = line
    assert set(by_scaler) == {"none", "static", "dynamic"}
    # fp16 without a scale: gradients flush to zero, the loss stays at ln(10), chance accuracy
    assert by_scaler["none"]["train/loss"] == pytest.approx(math.log(10), abs=0.01)
    assert by_scaler["none"]["val/acc"] < 0.2
    for scaled in ("static", "dynamic"):
        assert by_scaler[scaled]["val/acc"] > 0.85, by_scaler[scaled]
        assert by_scaler[scaled]["scaler/skipped_steps"] == 0


def test_fail_fast_stops_the_sweep_at_the_first_failed_job(cli):
    result = cli.run("logger=none", "optim.lr=-1,0.1", "fail_fast=true", multirun=True)
    assert result.returncode == 5 and "Traceback" not in result.output
    assert "fail_fast=true: job 0 failed" in result.output
    lines = read_jsonl(result.sweep_dir / "sweep.jsonl")
    assert [(line["job"], line["status"]) for line in lines] == [(0, "failed")]
    assert result.stderr.splitlines()[-1] == f"sweep: 1 failed; {result.sweep_dir / 'sweep.jsonl'} (exit 5)"


def test_a_diverging_job_is_recorded_as_diverged_with_the_counts_of_the_step_that_stopped_it(started):
    """lr=1e6 skips most steps without 50 in a row: more than half of the last 100 skipped stops it
    (exit 3 alone, "diverged" in the sweep); sweep.jsonl, summary.json, metrics.jsonl and the report
    agree on the skipped steps at that moment; the sweep ends with one line and exit 5."""
    from halfprec.tools.report.columns import job_metrics
    from halfprec.tools.report.runs import find_jobs

    result = started["diverging"].result()
    assert result.returncode == 5 and "Traceback" not in result.output, result.output[-3000:]
    diverged, done = (read_jsonl(result.sweep_dir / "sweep.jsonl")[i] for i in (0, 1))
    assert (diverged["status"], done["status"]) == ("diverged", "completed")
    assert diverged["error"].startswith("TrainingAborted: step 58: 51 of the last 100 optimizer steps had inf/NaN")
    rows = read_jsonl(Path(diverged["dir"]) / "metrics.jsonl")
    assert rows[-1]["step"] == 58 and rows[-1]["scaler/skipped_steps"] == diverged["scaler/skipped_steps"] == 51
    summary = json.loads((Path(diverged["dir"]) / "summary.json").read_text())
    assert (summary["status"], summary["steps"], summary["exit_code"]) == ("diverged", 58, 3)
    jobs = find_jobs(result.sweep_dir)
    assert [job.status for job in jobs] == ["diverged", "completed"]
    assert job_metrics(jobs[0].rows, jobs[0].summary)["skipped steps"] == 51
    lines = result.stderr.strip().splitlines()
    assert any(line.startswith("job 0 (optim.lr=1000000.0 ") and "error: training stopped: step 58: 51 of" in line
               for line in lines)  # fmt: skip
    assert lines[-1] == f"sweep: 1 completed, 1 diverged; {result.sweep_dir / 'sweep.jsonl'} (exit 5)"
    assert lines[0] == f"sweep dir: {result.sweep_dir}"


def test_ctrl_c_stops_the_sweep_after_the_running_jobs_checkpoint(tmp_path):
    """Ctrl-C in a multirun: the running job saves and says how to continue it, the sweep ends (exit 4),
    the jobs after it do not start."""
    sweep_dir = tmp_path / "multi"
    cmd = [sys.executable, str(TRAIN), "-m", "seed=0,1", "logger=none", "trainer.max_steps=100000",
           "trainer.progress=false", f"hydra.sweep.dir={sweep_dir}"]  # fmt: skip
    with signalled(cmd, cwd=tmp_path, stderr=subprocess.PIPE, text=True) as proc:
        deadline = time.monotonic() + 120
        # a logged row: the loop is running, with its handlers (metrics.jsonl is opened just before it)
        while not any(path.read_text() for path in sweep_dir.glob("0_*/metrics.jsonl")):
            assert time.monotonic() < deadline and proc.poll() is None, "job 0 did not start"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)

    assert proc.returncode == 4, err[-3000:]
    assert "Traceback" not in err
    (line,) = read_jsonl(sweep_dir / "sweep.jsonl")
    assert (line["job"], line["status"]) == (0, "stopped") and line["error"].startswith("Preempted: Ctrl-C at step")
    assert not list(sweep_dir.glob("1_*"))
    job_dir = Path(line["dir"])
    (ckpt,) = (job_dir / "checkpoints").glob("step-*.pt")
    command = "python train.py seed=0 logger=none trainer.max_steps=100000 trainer.progress=False"  # as Hydra keeps it
    assert f"saved {ckpt}; continue with: {command} {shlex.quote(f'hydra.run.dir={job_dir}')} resume=auto" in err
    lines = err.strip().splitlines()
    assert lines[-3] == "sweep stopped at job 0: the jobs after it did not run"
    assert lines[-2] == (
        "continue the sweep with: python train.py -m seed=0,1 logger=none trainer.max_steps=100000 "
        f"trainer.progress=false {shlex.quote(f'hydra.sweep.dir={sweep_dir}')} resume=auto"
    )
    assert lines[-1] == f"sweep: 1 stopped; {sweep_dir / 'sweep.jsonl'} (exit 4)"


def pasted(line: str) -> list[str]:
    """The command a `continue ... with: python train.py ...` line prints, as this test's python runs it."""
    args = shlex.split(line.split(": ", 1)[1])
    assert args[:2] == ["python", "train.py"], line
    return [sys.executable, str(TRAIN), *args[2:]]


def stop_during_job(cmd: list[str], sweep_dir: Path, job: int, cwd: Path) -> str:
    """Start a sweep, Ctrl-C it once job `job` has logged a row; its stderr (exit 4 checked)."""
    with signalled(cmd, cwd=cwd, stderr=subprocess.PIPE, text=True) as proc:
        deadline = time.monotonic() + 300
        while not any(path.read_text() for path in sweep_dir.glob(f"{job}_*/metrics.jsonl")):
            assert time.monotonic() < deadline and proc.poll() is None, f"job {job} did not start"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 4, err[-3000:]
    return err


@pytest.mark.slow
def test_the_same_command_with_resume_auto_continues_a_stopped_sweep(tmp_path):
    """Ctrl-C during job 1 of 3, then the command the sweep printed: job 0 is skipped, job 1 resumes
    from its checkpoint, job 2 runs; every job ends completed, in the dirs of the first launch."""
    sweep_dir = tmp_path / "multi"
    overrides = ["seed=0,1,2", "logger=none", "trainer.max_steps=300", "trainer.progress=false", "model.hidden=[16]"]
    cmd = [sys.executable, str(TRAIN), "-m", *overrides, f"hydra.sweep.dir={sweep_dir}"]
    err = stop_during_job(cmd, sweep_dir, 1, tmp_path)
    before = {line["job"]: line for line in read_jsonl(sweep_dir / "sweep.jsonl")}
    assert [before[j]["status"] for j in sorted(before)] == ["completed", "stopped"]
    job_dirs = {j: Path(line["dir"]) for j, line in before.items()}

    again = subprocess.run(pasted(err.strip().splitlines()[-2]), cwd=tmp_path, capture_output=True, text=True,
                           timeout=600)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    lines = read_jsonl(sweep_dir / "sweep.jsonl")
    latest = {line["job"]: line for line in lines}
    assert [latest[j]["status"] for j in range(3)] == ["completed"] * 3
    assert {j: Path(latest[j]["dir"]) for j in (0, 1)} == job_dirs  # the same dirs: resume=auto is not in their names
    assert sorted(p.name.split("_", 1)[0] for p in sweep_dir.iterdir() if p.is_dir()) == ["0", "1", "2"]
    assert f"resume=auto: {job_dirs[0]} completed before, at step 300: skipped" in again.stderr
    step, ckpt = re.search(r"Ctrl-C at step (\d+): saved (\S+);", before[1]["error"]).groups()
    assert f"resume: from {ckpt} at step {step} of 300" in again.stderr
    steps = [row["step"] for row in read_jsonl(job_dirs[1] / "metrics.jsonl") if "train/loss" in row]
    assert steps == sorted(set(steps)) and steps[-1] == 300  # one unbroken run, each row once
    assert again.stderr.strip().splitlines()[-1] == f"sweep: 3 completed; {sweep_dir / 'sweep.jsonl'} (exit 0)"


@pytest.mark.slow
def test_a_stopped_optuna_search_continues_with_the_same_trials(tmp_path):
    """The continued search replays the study (the sampler is seeded; finished trials return their
    recorded value without training): trials 0 and 1 get the same values and dirs, 1 resumes, 2 runs."""
    sweep_dir = tmp_path / "multi"
    overrides = ["hparams_search=optuna", "hydra.sweeper.n_trials=3", "logger=none", "model.hidden=[16]",
                 "trainer.max_steps=300", "trainer.progress=false"]  # fmt: skip
    err = stop_during_job([sys.executable, str(TRAIN), "-m", *overrides, f"hydra.sweep.dir={sweep_dir}"], sweep_dir,
                          1, tmp_path)  # fmt: skip
    before = {line["job"]: line for line in read_jsonl(sweep_dir / "sweep.jsonl")}
    again = subprocess.run(pasted(err.strip().splitlines()[-2]), cwd=tmp_path, capture_output=True, text=True,
                           timeout=600)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    latest = {line["job"]: line for line in read_jsonl(sweep_dir / "sweep.jsonl")}
    assert [latest[j]["status"] for j in range(3)] == ["completed"] * 3
    for job in (0, 1):
        assert latest[job]["overrides"] == [*before[job]["overrides"], "resume=auto"]
        assert latest[job]["dir"] == before[job]["dir"]
    assert latest[0]["val/acc"] == before[0]["val/acc"] and "skipped" in again.stderr
    best = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    assert best["best_value"] == max(latest[j]["val/acc"] for j in range(3))


def test_a_sweep_dir_keeps_one_sweep(cli, tmp_path):
    """A second sweep into the same dir is refused (its jobs would be numbered from 0 again, and the
    report and sweep.jsonl would mix them); the same sweep again needs resume=auto, which skips
    what finished."""
    first = cli.run("seed=0,1", "logger=none", "model.hidden=[16]", multirun=True).check()
    sweep_dir = first.sweep_dir

    def launch(seeds: str, *extra: str) -> subprocess.CompletedProcess:
        args = [sys.executable, str(TRAIN), "-m", *CHEAP, seeds, "logger=none", "model.hidden=[16]"]
        args += [f"hydra.sweep.dir={sweep_dir}", *extra]
        return subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=300)

    other = launch("seed=0,2")
    assert other.returncode == 2
    assert other.stderr.strip() == (
        f"error: hydra.sweep.dir={sweep_dir}: holds another sweep ({' '.join(first.args[3:-2])}): one dir keeps one "
        "sweep, so that its report and sweep.jsonl mix no other: choose a new hydra.sweep.dir, or continue that "
        "sweep with its own overrides, in the same order, and resume=auto"
    )
    same = launch("seed=0,1")
    assert same.returncode == 2
    assert same.stderr.strip() == (
        f"error: hydra.sweep.dir={sweep_dir}: holds this sweep's jobs already: add resume=auto to continue it "
        "(finished jobs are skipped, stopped ones resume from their checkpoints), or choose a new hydra.sweep.dir"
    )
    assert len(read_jsonl(sweep_dir / "sweep.jsonl")) == 2  # neither launch ran a job
    resumed = launch("seed=0,1", "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stderr.count("completed before, at step 3: skipped") == 2
    assert [p.name for p in sorted(sweep_dir.iterdir()) if p.is_dir()] == [p.name for p in first.job_dirs()]


def test_bad_objective_names_the_choices(cli):
    result = cli.run("objective=val/accuracy")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: objective=val/accuracy: task=classification reports val/loss, val/acc and train/loss (null: val/acc)"
    )


def sweep_values(spec: dict) -> list:
    """The values a W&B sweep parameter can take that a test can try: each of `values`, `value`, or
    a distribution's two ends."""
    if "values" in spec:
        return list(spec["values"])
    return [spec["value"]] if "value" in spec else [spec["min"], spec["max"]]


def agent_command(sweep: dict, program: str, args: dict) -> list[str]:
    """The command line `wandb agent` runs for one run of `sweep`, built by the agent's own code
    (wandb.wandb_agent.Agent._command_run): ${args_no_hyphens} becomes Hydra's key=value overrides."""
    from wandb.sdk.launch.sweeps import utils as sweep_utils

    macros = sweep_utils.create_sweep_command_args({"args": {k: {"value": v} for k, v in args.items()}})
    macros |= {"env": ["/usr/bin/env"], "interpreter": ["python"], "program": [program]}
    command = []
    for part in sweep_utils.create_sweep_command(list(sweep["command"])):
        is_macro = part.startswith("${") and part.endswith("}")
        command += macros.get(part[2:-1], []) if is_macro else [part]
    return command


@pytest.mark.parametrize("sweep_file", SWEEPS, ids=[p.stem for p in SWEEPS])
def test_every_value_of_a_wandb_sweep_composes_and_validates(sweep_file, monkeypatch):
    """Each value of each parameter (the others at their first), as the agent's command line gives it
    to train.py, composes and passes the checks train.py makes before it trains: a bad value or an
    experiment that sweeps a key the W&B sweep does not set fails here, not in the agent's runs."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from halfprec.config import validate
    from halfprec.config.resolvers import register_resolvers
    from halfprec.launch.exits import check_not_a_lone_sweep

    sweep = yaml.safe_load(sweep_file.read_text())
    assert sweep["program"] == "train.py" and "${args_no_hyphens}" in sweep["command"]
    assert sweep["metric"]["name"] in ("val/acc", "val/loss", "train/loss")
    first = {name: sweep_values(spec)[0] for name, spec in sweep["parameters"].items()}
    runs = [first | {name: value} for name, spec in sweep["parameters"].items() for value in sweep_values(spec)]
    monkeypatch.setenv("WANDB_SWEEP_ID", "testsweep")
    monkeypatch.setenv("WANDB_RUN_ID", "sweeprun1")
    monkeypatch.setattr(HydraConfig.instance(), "cfg", None)  # set below, as train.py's Hydra would; restored after
    register_resolvers()
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        for args in runs:
            command = agent_command(sweep, "train.py", args)
            assert command[:3] == ["/usr/bin/env", "python", "train.py"]
            cfg = compose("train", overrides=command[3:], return_hydra_config=True)
            HydraConfig.instance().set_config(cfg)
            check_not_a_lone_sweep()
            assert cfg.hydra.run.dir == "outputs/wandb_sweeps/testsweep/sweeprun1"
            with open_dict(cfg):
                del cfg["hydra"]  # what train.py's main gets
            validate(cfg)
            assert cfg.resume == "auto"


@pytest.mark.slow  # a run of train.py with W&B: ~12-20 s on the loaded 2-core machine
@pytest.mark.parametrize("sweep_file", SWEEPS, ids=[p.stem for p in SWEEPS])
def test_wandb_sweep_command_runs_train_py_with_hydra_overrides(sweep_file, tmp_path, monkeypatch):
    """Run the command line that `wandb agent` builds from the sweep file, through the agent's own
    code, for the first value of every parameter (offline: no server, no network). The run lands in
    the sweep's dir, named by its id; its W&B run is grouped by the sweep and named by its overrides."""
    from wandb.wandb_agent import Agent

    sweep = yaml.safe_load(sweep_file.read_text())
    args = {name: {"value": sweep_values(spec)[0]} for name, spec in sweep["parameters"].items()}
    # keep it tiny: extra overrides the way a user would append them to the sweep's parameters
    tiny = {
        "trainer.max_steps": 3,
        "trainer.val_every": 0,
        "trainer.log_every": 1,
        "model.hidden": "[16]",
        "data.batch_size": 16,
    }
    args.update({k: {"value": v} for k, v in tiny.items()})

    for key in ("WANDB_RUN_ID", "WANDB_SWEEP_PARAM_PATH"):
        monkeypatch.setenv(key, "")  # the agent sets them in os.environ; monkeypatch restores them
    monkeypatch.setenv("WANDB_SWEEP_ID", "testsweep")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    agent = Agent.__new__(Agent)  # only the command-building part of the agent; no API client
    agent._sweep_command, agent._function, agent._in_jupyter = list(sweep["command"]), None, False
    agent._run_processes, agent._forward_signals = {}, False
    agent._command_run({"run_id": "sweeprun1", "program": str(TRAIN), "args": args})
    popen = agent._run_processes["sweeprun1"]._popen
    assert popen.wait(timeout=300) == 0
    assert popen.args[:3] == ["/usr/bin/env", "python", str(TRAIN)]
    assert all(f"{name}={spec['value']}" in popen.args for name, spec in args.items())  # Hydra overrides
    run_dir = tmp_path / "outputs" / "wandb_sweeps" / "testsweep" / "sweeprun1"
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3]
    # W&B got the run under the agent's run id, grouped by the sweep, named by the overrides as a
    # multirun's job is (less its number: the agent's runs have none)
    (wandb_file,) = wandb_records.run_files(run_dir)
    info = wandb_records.run_info(wandb_file)
    overrides = [a for a in popen.args[3:] if not a.startswith(("hydra.", "resume="))]
    assert (info["id"], info["group"], info["name"]) == ("sweeprun1", "testsweep", ",".join(sorted(overrides)))
    config = wandb_records.config(wandb_file)
    # W&B locks swept keys to the sweep's value (a group key then holds the option name, e.g.
    # precision: fp16); the rest of the resolved config is there in full
    for name in sweep["parameters"]:
        node = config.get(name)
        if node is None:  # a dotted key the sweep did not lock: look it up in the nested config
            node = config
            for part in name.split("."):
                node = node[part]
        assert node == args[name]["value"], (name, node)
    assert config["trainer"]["max_steps"] == 3 and config["data"]["batch_size"] == 16


def test_a_job_dir_name_stays_short_and_distinct():
    """A sweep over long values (precision.rules lists) got "File name too long" from Hydra's job dir
    names: past 128 bytes the name is its start and a hash of the whole."""
    from halfprec.config.resolvers import DIRNAME_MAX, dirname

    short = "optim.lr=0.001,seed=1"
    assert dirname(short) == short
    rules = [f'precision.rules=[{{match:"blocks.{i}.attn.qkv",format:high}}]' * 5 + ",seed=0" for i in range(2)]
    names = [dirname(r) for r in rules]
    assert names[0] != names[1] and all(len(n.encode()) == DIRNAME_MAX for n in names)
    assert names[0].startswith(rules[0][:100]) and dirname(rules[0]) == names[0]  # the same every time
