"""MLflow: runs in a local store, by default the SQLite file `outputs/mlflow.db` that every run
and sweep launched from here shares (no server): `mlflow ui --backend-store-uri
sqlite:///outputs/mlflow.db`. A sweep's runs carry its name in the tag `group`."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import Annotated, Any

from halfprec.loggers import RunInfo, register_logger
from halfprec.spec import Spec, flat_keys

# how summary.json's status ends an MLflow run; anything else (diverged, failed) is FAILED
END_STATUS = {"completed": "FINISHED", "stopped": "KILLED", "interrupted": "KILLED"}


def metric_key(key: str) -> str:
    """A row's key as MLflow takes it: its names allow no @, so precision.eval's val/loss@mxfp4 is
    val/loss:mxfp4 there."""
    return key.replace("@", ":")


@register_logger("mlflow", "MLflow", package="mlflow", install="pip install mlflow")
class MlflowSink:
    """Every numeric value of a row as a metric at its step, the flattened config as params, the
    run's tags and summary as tags. A resumed run continues the same MLflow run, by the id its
    checkpoint kept; MLflow keeps a metric's every value, so rows the first attempt already logged
    (after the checkpoint, before it was killed) are not logged twice."""

    def __init__(
        self,
        run: RunInfo,
        *,
        tracking_uri: Annotated[str, Spec(nonempty=True, doc="an MLflow store, e.g. sqlite:///outputs/mlflow.db")],
        experiment: Annotated[str, Spec(nonempty=True, doc="the MLflow experiment the runs go under")],
    ):
        from mlflow import MlflowClient

        logging.getLogger("mlflow").setLevel(logging.WARNING)  # its store announces each table it creates
        if tracking_uri.startswith("sqlite:///"):  # SQLite creates the file, not the dir it goes in
            Path(tracking_uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        self.client = client = MlflowClient(tracking_uri)
        self.run_id: str = run.state.get("run_id") or ""
        self.logged: dict[str, int] = {}  # a resumed run: each metric's last step already in the store
        self.pending: list[Any] = []  # the rows being written in MLflow's background thread
        if self.run_id:
            client.update_run(self.run_id, status="RUNNING")
            self.logged = {m.key: m.step for m in client.get_run(self.run_id).data._metric_objs}
            return
        choices = {re.sub(r"[^\w\-. /]", "_", key): value for key, value in (t.split(":", 1) for t in run.tags)}
        tags = {"group": run.group or "", "run_dir": str(run.dir), **choices}
        self.run_id = client.create_run(experiment_id(client, experiment), run_name=run.name, tags=tags).info.run_id
        self._log_params(run.config)

    def _log_params(self, config: dict) -> None:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

        params = [Param(k, str(v)[:MAX_PARAM_VAL_LENGTH]) for k, v in flat_keys(config).items()]
        self.client.log_batch(self.run_id, params=params)

    def log(self, row: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        step, now = row["step"], int(time.time() * 1000)
        metrics = [
            Metric(metric_key(key), float(value), now, step)
            for key, value in row.items()
            if key != "step" and isinstance(value, bool | int | float) and step > self.logged.get(metric_key(key), -1)
        ]
        if metrics:  # in MLflow's own thread: a SQLite write per row would hold the step up
            self.pending.append(self.client.log_batch(self.run_id, metrics=metrics, synchronous=False))
        if len(self.pending) >= 100:  # what is written is let go of, a hundred rows at a time
            self._wait()

    def _wait(self) -> None:
        for written in self.pending:
            written.wait()
        self.pending.clear()

    def finish(self, summary: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        self._wait()
        tags = [RunTag(f"summary.{metric_key(k)}", str(v)) for k, v in summary.items()]
        self.client.log_batch(self.run_id, tags=tags)
        self.client.set_terminated(self.run_id, END_STATUS.get(summary.get("status", ""), "FAILED"))

    def abandon(self) -> None:
        if self.run_id:
            self.client.set_terminated(self.run_id, "FAILED")

    def state(self) -> dict[str, Any]:
        return {"run_id": self.run_id}


def experiment_id(client: Any, name: str) -> str:
    """The experiment's id, created by the first run that logs to it (or by a sweep's job beside this one)."""
    found = client.get_experiment_by_name(name)
    if found is None:
        try:
            return client.create_experiment(name)
        except Exception:  # created meanwhile by a job running in parallel
            found = client.get_experiment_by_name(name)
            if found is None:
                raise
    return found.experiment_id
