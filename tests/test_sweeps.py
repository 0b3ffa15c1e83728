"""Sweeps as users launch them: Optuna, fail-fast, the loss-scaling experiment, W&B sweep commands."""

from __future__ import annotations

import math

import pytest
import yaml
from conftest import REPO, TRAIN, read_jsonl

import wandb_records

SWEEPS = sorted((REPO / "sweeps").glob("*.yaml"))


@pytest.fixture(scope="module")
def started(cli):
    """The slow sweeps of this module, started together on the 2-worker pool."""
    return {
        "optuna": cli.submit(
            "hparams_search=optuna", "hydra.sweeper.n_trials=3", "logger=none", "model.hidden=[16]", multirun=True
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
    assert result.returncode == 1
    assert "fail_fast=true: job 0 failed" in result.output
    lines = read_jsonl(result.sweep_dir / "sweep.jsonl")
    assert [(line["job"], line["status"]) for line in lines] == [(0, "failed")]


def test_bad_objective_names_the_choices(cli):
    result = cli.run("objective=val/accuracy")
    assert result.returncode == 2
    assert "objective=val/accuracy: must be one of val/acc, val/loss, train/loss" in result.output


@pytest.mark.parametrize("sweep_file", SWEEPS, ids=[p.stem for p in SWEEPS])
def test_wandb_sweep_command_runs_train_py_with_hydra_overrides(sweep_file, tmp_path, monkeypatch):
    """Run the command line that `wandb agent` builds from the sweep file, through the agent's own
    code, for the first value of every parameter (offline: no server, no network)."""
    from wandb.wandb_agent import Agent

    sweep = yaml.safe_load(sweep_file.read_text())
    assert sweep["program"] == "train.py" and "${args_no_hyphens}" in sweep["command"]
    assert sweep["metric"]["name"] in ("val/acc", "val/loss", "train/loss")

    def first(spec: dict):
        return spec["values"][0] if "values" in spec else spec["min"]

    args = {name: {"value": first(spec)} for name, spec in sweep["parameters"].items()}
    # keep it tiny: extra overrides the way a user would append them to the sweep's parameters
    tiny = {
        "trainer.max_steps": 3,
        "trainer.val_every": 0,
        "trainer.log_every": 1,
        "model.hidden": "[16]",
        "data.batch_size": 16,
    }
    args.update({k: {"value": v} for k, v in tiny.items()})
    args["hydra.run.dir"] = {"value": str(tmp_path / "run")}

    for key in ("WANDB_RUN_ID", "WANDB_SWEEP_PARAM_PATH", "WANDB_SWEEP_ID"):
        monkeypatch.setenv(key, "")  # the agent sets them in os.environ; monkeypatch restores them
    monkeypatch.setenv("WANDB_SWEEP_ID", "testsweep")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    agent = Agent.__new__(Agent)  # only the command-building part of the agent; no API client
    agent._sweep_command, agent._function, agent._in_jupyter = sweep["command"], None, False
    agent._run_processes, agent._forward_signals = {}, False
    agent._command_run({"run_id": "sweeprun1", "program": str(TRAIN), "args": args})
    popen = agent._run_processes["sweeprun1"]._popen
    assert popen.wait(timeout=300) == 0
    assert popen.args[:3] == ["/usr/bin/env", "python", str(TRAIN)]
    assert all(f"{name}={spec['value']}" in popen.args for name, spec in args.items())  # Hydra overrides
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3]
    # the swept values reached the run: W&B got the run under the agent's run id
    (wandb_file,) = wandb_records.run_files(tmp_path / "run")
    assert wandb_records.run_info(wandb_file)["id"] == "sweeprun1"
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
