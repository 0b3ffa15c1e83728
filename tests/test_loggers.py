"""logger=[...]: TensorBoard, MLflow and CSV get every row metrics.jsonl gets, read back through
each library's own reader; several at once; a resume continues each; a missing package is one line."""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path

import pytest
from conftest import read_jsonl

from halfprec.config import validate
from halfprec.errors import ConfigError
from halfprec.loggers import LOGGERS, LoggerEntry
from halfprec.training.checkpoint import checkpoint_files
from halfprec.training.run import run

from helpers import compose_cfg

ALL = "logger=[tensorboard,mlflow,csv]"
RUN = ["trainer.log_every=1", "trainer.val_every=4", "trainer.ckpt_every=4", "diagnostics=grads", "diagnostics.every=4"]


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar as TensorBoard shows it: (step, value), a purged step's old events dropped."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def tensorboard_tags(run_dir: Path) -> dict[str, list[str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return acc.Tags()


def mlflow_run(run_id: str):
    from mlflow import MlflowClient

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    return client, client.get_run(run_id)


def numeric(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl's numbers per key, as (step, value); null (a non-finite value) left out."""
    out: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for key, value in row.items():
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                out.setdefault(key, []).append((row["step"], float(value)))
    return out


def close(a: list[tuple[int, float]], b: list[tuple[int, float]]) -> bool:
    """TensorBoard keeps float32 values: equal to float32 precision, at the same steps."""
    return [s for s, _ in a] == [s for s, _ in b] and all(
        math.isclose(x, y, rel_tol=1e-6) for (_, x), (_, y) in zip(a, b)
    )


@pytest.fixture(scope="module")
def three(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("three")
    run(compose_cfg(ALL, *RUN, "trainer.max_steps=8"), run_dir)
    return run_dir


def test_tensorboard_gets_every_metric_histograms_and_the_config(three):
    expected = numeric(read_jsonl(three / "metrics.jsonl"))
    scalars = tensorboard_scalars(three)
    assert {"train/loss", "scaler/scale", "scaler/skipped_steps", "val/acc"} <= set(expected)
    assert set(scalars) == set(expected)
    assert all(close(scalars[key], expected[key]) for key in expected), "values or steps differ"
    tags = tensorboard_tags(three)
    assert tags["histograms"], "diagnostics=grads histograms"
    assert {"config/text_summary", "run/text_summary", "summary/text_summary"} <= set(tags["tensors"])


def test_mlflow_gets_every_metric_the_config_and_the_end(three):
    from halfprec.training.checkpoint import load_checkpoint

    run_id = load_checkpoint(checkpoint_files(three / "checkpoints")[-1])["loggers"]["mlflow"]["run_id"]
    client, found = mlflow_run(run_id)
    expected = numeric(read_jsonl(three / "metrics.jsonl"))
    assert set(found.data.metrics) == set(expected)
    for key in ("train/loss", "scaler/scale", "scaler/skipped_steps", "val/acc"):
        history = [(m.step, m.value) for m in client.get_metric_history(run_id, key)]
        assert history == expected[key], key  # float64 in MLflow's store: exact
    assert found.data.params["precision.name"] == "fp32" and found.data.params["trainer.max_steps"] == "8"
    assert found.info.status == "FINISHED" and found.data.tags["summary.status"] == "completed"


def test_csv_holds_every_row_of_metrics_jsonl(three):
    rows = read_jsonl(three / "metrics.jsonl")
    with open(three / "metrics.csv", newline="") as file:
        table = list(csv.DictReader(file))
    assert len(table) == len(rows)
    for row, line in zip(rows, table):
        for key, value in row.items():
            assert line[key] == ("" if value is None else str(value)), (row["step"], key)
        assert all(line[k] == "" for k in set(line) - set(row))  # a key the row lacks is an empty cell


def test_a_resumed_run_continues_each_logger_without_repeating_a_step(tmp_path):
    """Killed after step 6 with its last checkpoint at 4: steps 5-6 are logged again on resume."""
    run(compose_cfg(ALL, *RUN, "trainer.max_steps=6"), tmp_path)
    (tmp_path / "checkpoints" / "step-00000006.pt").unlink()  # as if killed before that checkpoint
    run(compose_cfg(ALL, *RUN, "trainer.max_steps=8", "resume=auto"), tmp_path)
    once = numeric(read_jsonl(tmp_path / "metrics.jsonl"))
    assert [s for s, _ in once["train/loss"]] == list(range(1, 9))
    scalars = tensorboard_scalars(tmp_path)
    assert close(scalars["train/loss"], once["train/loss"]) and close(scalars["val/loss"], once["val/loss"])
    from halfprec.training.checkpoint import load_checkpoint

    states = [load_checkpoint(p)["loggers"] for p in checkpoint_files(tmp_path / "checkpoints")]
    assert len({s["mlflow"]["run_id"] for s in states}) == 1, "the same MLflow run throughout"
    client, found = mlflow_run(states[0]["mlflow"]["run_id"])
    history = [(m.step, m.value) for m in client.get_metric_history(found.info.run_id, "train/loss")]
    assert sorted(history) == once["train/loss"] and found.info.status == "FINISHED"
    with open(tmp_path / "metrics.csv", newline="") as file:
        assert [int(r["step"]) for r in csv.DictReader(file) if r["train/loss"]] == list(range(1, 9))


def test_a_sweep_groups_its_runs_in_mlflow(cli):
    result = cli.run("logger=mlflow", "seed=0,1", multirun=True).check()
    from mlflow import MlflowClient

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    group = f"{result.sweep_dir.parent.name}_{result.sweep_dir.name}"
    runs = client.search_runs([client.get_experiment_by_name("halfprec").experiment_id], f"tags.group = '{group}'")
    names = sorted(r.info.run_name for r in runs)  # the job's number and overrides, as W&B names them
    assert len(names) == 2 and all(n.startswith(f"{i}_") and f"seed={i}" in n for i, n in enumerate(names))
    assert all(r.data.tags["precision"] == "fp32" and r.info.status == "FINISHED" for r in runs)  # options as tags


def test_a_logger_whose_package_is_missing_is_a_one_line_error(monkeypatch):
    entry = LOGGERS["mlflow"]
    monkeypatch.setitem(LOGGERS, "mlflow", LoggerEntry(entry.cls, entry.title, "no_such_package", entry.install))
    with pytest.raises(ConfigError, match=r"logger=mlflow: needs the no_such_package package.*pip install mlflow"):
        validate(compose_cfg("logger=[wandb,mlflow]"))


def test_an_unknown_logger_names_the_loggers():
    with pytest.raises(ConfigError, match="logger.tensorbord.*did you mean tensorboard"):
        validate(compose_cfg("+logger.tensorbord.flush_secs=1"))


def test_a_checkpoint_from_before_the_loggers_group_resumes_its_wandb_run():
    from halfprec.training.checkpoint import logger_states

    assert logger_states({"wandb_id": "abc12345"}) == {"wandb": {"id": "abc12345"}}
    assert logger_states({"wandb_id": None}) == {}
    assert logger_states({"loggers": {"mlflow": {"run_id": "r"}}}) == {"mlflow": {"run_id": "r"}}


def test_a_logger_added_key_by_key_without_its_option_is_a_config_error():
    with pytest.raises(ConfigError, match=r"logger.wandb=.*lacks mode, .*: turn it on with logger=wandb"):
        validate(compose_cfg("logger=none", "+logger.wandb.project=x"))


def test_a_logger_whose_close_fails_too_is_dropped_and_training_goes_on(tmp_path, capsys):
    """A full disk fails the write and the close after it: one warning, the run goes on."""
    from halfprec.loggers.jsonl import JsonlSink
    from halfprec.training.tracking import Tracker

    class Broken:
        def log(self, row):
            raise OSError("No space left on device")

        def abandon(self):
            raise OSError("No space left on device")

    tracker = Tracker([JsonlSink(tmp_path / "metrics.jsonl"), Broken()], ["jsonl", "broken"])
    tracker.log({"step": 1, "train/loss": 2.0})
    tracker.log({"step": 2, "train/loss": 1.0})
    assert len(tracker.sinks) == 1 and read_jsonl(tmp_path / "metrics.jsonl")[-1]["step"] == 2
    assert capsys.readouterr().err.count("Broken.log failed (OSError: No space left on device)") == 1
