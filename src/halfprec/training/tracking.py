"""Metric sinks: metrics.jsonl in the run dir (always) and a W&B run (when the logger is on)."""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import string
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from halfprec.errors import naming


@dataclass
class Histogram:
    """A histogram in a metric row (diagnostics): drawn by W&B, left out of metrics.jsonl."""

    counts: list[int]
    edges: list[float]  # len(counts) + 1 bin edges


class JsonlSink:
    """One JSON object per line, flushed per row so a crash loses nothing already logged."""

    def __init__(self, path: Path, resume_step: int | None = None):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        if resume_step is not None and path.exists():
            # rows logged after the checkpoint (before a kill) are logged again by the resumed run;
            # a kill mid-write can leave a torn last line, which is dropped too
            kept = [line for line in path.read_text().splitlines() if _row_step(line) <= resume_step]
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            tmp.replace(path)
        self._file = open(path, "a", encoding="utf-8")

    def log(self, row: dict[str, Any]) -> None:
        # strict JSON (jq, JavaScript): a non-finite number is written as null
        clean = {
            k: None if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in row.items()
            if not isinstance(v, Histogram)
        }
        try:
            self._file.write(json.dumps(clean, allow_nan=False) + "\n")
            self._file.flush()
        except OSError as err:  # a full disk: the error names the file (exit 6, launch/exits.py)
            raise naming(err, self.path) from None

    def finish(self, summary: dict[str, Any]) -> None:
        try:
            self._file.close()  # after a refused write, the close flushes what is left of it again
        except OSError as err:
            raise naming(err, self.path) from None


SECRET_KEY = re.compile(r"(api_?key|token|secret|password)", re.IGNORECASE)


def redact(tree: Any) -> Any:
    """The config as saved to W&B and checkpoints: values under secret-looking keys, and any value
    equal to $WANDB_API_KEY (e.g. interpolated by ${oc.env:...}), become '***'."""
    key = os.environ.get("WANDB_API_KEY")
    if isinstance(tree, dict):
        return {k: "***" if SECRET_KEY.search(str(k)) else redact(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [redact(v) for v in tree]
    return "***" if key and isinstance(tree, str) and key in tree else tree


def saved_config(cfg: DictConfig) -> dict:
    """The resolved config as it is written to W&B and into checkpoints: redacted."""
    return redact(OmegaConf.to_container(cfg, resolve=True))


def _row_step(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")


# W&B's own wandb.init timeout is 90 s. It no longer holds training up (see WandbSink), but a run
# shorter than it that has no network still waits for it at the end, before its warning.
START_TIMEOUT_S = 30.0
START_GRACE_S = 15.0  # W&B's own 10 s beyond init_timeout, and `import wandb`
NOTICE_AFTER_S = 5.0  # finish says why it waits once the wait is longer than an offline start takes
QUIT_WAIT_S = 2.0  # after a second Ctrl-C: enough for an offline run that is nearly up
# wandb.init, or the finish of a run given up on, one at a time: consecutive multirun jobs share
# this process, and reinit="finish_previous" must see the previous job's run finished, not half up.
_START_LOCK = threading.Lock()


class WandbStartFailed(Exception):
    """wandb.init failed, or gave no answer in time: the sink has no run and is dropped."""


class WandbSink:
    """A W&B run under `<run dir>/wandb/`, carrying the resolved config, finished exactly once.

    `import wandb` and wandb.init take seconds (minutes without network), so they run in a
    background thread and training starts at once: rows logged meanwhile are kept, in order, and
    sent by the first log after the run is up. Only finish waits for it. The run id is chosen
    here, so a checkpoint can record it before the run is up."""

    def __init__(
        self, cfg: DictConfig, run_dir: Path, name: str, group: str | None, tags: list[str], run_id: str | None
    ):
        # a sweep agent passes its run's id in $WANDB_RUN_ID (wandb.init ignores id= in a sweep)
        env_id = os.environ.get("WANDB_RUN_ID")
        self.id = run_id or env_id or new_run_id()
        init_args = dict(
            id=run_id or (None if env_id else self.id),
            resume="allow" if run_id else None,
            reinit="finish_previous",  # one run per multirun job, even after a job that failed
            project=cfg.logger.project,
            entity=cfg.logger.entity,
            mode=cfg.logger.mode,
            dir=str(run_dir),
            name=name,
            group=group,
            job_type=cfg.logger.job_type,
            tags=[*tags, *cfg.logger.tags],
            config=saved_config(cfg),
        )
        self._pending: deque[dict[str, Any]] = deque()  # rows logged before the run is up
        self._run: Any = None
        self._error: BaseException | None = None
        self._given_up = False
        self._lock = threading.Lock()  # _run and _given_up: whichever comes second finishes the run
        self._ready = threading.Event()  # set when wandb.init has returned or failed
        self._t0 = time.monotonic()
        # a daemon: a crash or Ctrl-C during wandb.init does not keep the process alive
        self._thread = threading.Thread(target=self._start, args=(init_args,), name="wandb-init", daemon=True)
        self._thread.start()

    def _start(self, init_args: dict[str, Any]) -> None:
        try:
            import wandb  # only when the logger is on

            settings = wandb.Settings(console="off", x_disable_stats=True, quiet=True)
            if "WANDB_INIT_TIMEOUT" not in os.environ:  # the user's own timeout wins
                settings.init_timeout = START_TIMEOUT_S
            with _START_LOCK:
                run = wandb.init(**init_args, settings=settings)
                # `step` is the x-axis of every chart. Logging it as a metric (rather than log(step=))
                # commits each row at once, so the summary written at the end is the last word.
                run.define_metric("step")
                run.define_metric("*", step_metric="step")
                with self._lock:
                    self._run, given_up = run, self._given_up
                if given_up:  # finish gave up waiting, or a log failed meanwhile
                    run.finish(exit_code=1)
        except BaseException as err:  # reported by the next log or finish, in the main thread
            self._error = err
        finally:
            self._ready.set()

    def _started(self, wait_s: float = 0.0) -> Any:
        """The W&B run once it is up, None while wandb.init runs; raises WandbStartFailed if it failed."""
        if not self._ready.wait(wait_s):
            return None
        if self._run is None:
            err = self._error
            cause = f"{type(err).__name__}: {one_line(err)}" if err else "no run"
            raise WandbStartFailed(f"W&B could not start ({cause}); metrics go to metrics.jsonl only")
        return self._run

    def _left_s(self) -> float:
        """How long wandb.init may still take: its timeout, W&B's 10 s of grace beyond it, the import."""
        timeout = float(os.environ.get("WANDB_INIT_TIMEOUT", START_TIMEOUT_S))
        return max(self._t0 + timeout + START_GRACE_S - time.monotonic(), QUIT_WAIT_S)

    def _await_start(self, wait_s: float) -> Any:
        """The run, waiting up to `wait_s` for it (saying so when that is long: the run is over)."""
        run = self._started(min(wait_s, NOTICE_AFTER_S))
        if run is None and wait_s > NOTICE_AFTER_S:
            print(
                f"W&B is still starting; waiting up to {wait_s - NOTICE_AFTER_S:.0f} s more for it "
                "(Ctrl-C: quit without it; metrics.jsonl has every row)",
                file=sys.stderr,
                flush=True,
            )
            run = self._started(wait_s - NOTICE_AFTER_S)
        if run is None:
            waited = f"no answer in {time.monotonic() - self._t0:.0f} s"
            raise WandbStartFailed(f"W&B could not start ({waited}); metrics go to metrics.jsonl only")
        return run

    @property
    def run_id(self) -> str | None:
        """The id checkpoints record: the run's own once it is up, None if it never came up."""
        if not self._ready.is_set():
            return self.id
        return self._run.id if self._run is not None else None

    def log(self, row: dict[str, Any]) -> None:
        self._pending.append(row)
        run = self._started()
        if run is not None:
            self._send(run)

    def _send(self, run: Any) -> None:
        import wandb

        while self._pending:
            row = self._pending.popleft()
            run.log(
                {
                    # wandb annotates np_histogram as two ndarrays; it takes lists too (it calls .tolist() if there)
                    k: wandb.Histogram(np_histogram=(v.counts, v.edges)) if isinstance(v, Histogram) else v  # type: ignore[arg-type]
                    for k, v in row.items()
                }
            )

    def abandon(self) -> None:
        """Close a run that failed, so that the next wandb.init in this process starts afresh; a run
        still starting is closed by its thread once it is up. Never waits for wandb.init."""
        with self._lock:
            self._given_up, run = True, self._run
        if run is None:
            return
        try:
            run.finish(exit_code=1)
        except Exception:  # it already failed once; this is best effort
            pass

    def finish(self, summary: dict[str, Any]) -> None:
        # a second Ctrl-C quits at once: a run not up by then is left to its (daemon) thread
        run = self._await_start(QUIT_WAIT_S if summary.get("status") == "interrupted" else self._left_s())
        self._send(run)
        stopped = summary.get("status") == "stopped"  # a stop signal after a checkpoint: resumable, not failed
        if stopped:
            run.mark_preempting()
        run.summary.update(summary)
        run.finish(exit_code=0 if stopped else summary.get("exit_code", 0))


def new_run_id() -> str:
    """A W&B run id as wandb.util.generate_id makes it (8 of a-z0-9), without importing wandb."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def one_line(err: BaseException) -> str:
    """An error's first line: wandb's CommError goes on with advice over two more."""
    return (str(err).strip().splitlines() or [""])[0]


class Tracker:
    """Fans rows out to the sinks. A sink that fails (W&B down, disk full under wandb/) is dropped
    with a warning; metrics.jsonl failing is a real error, since then nothing would be kept."""

    def __init__(self, sinks: list):
        self.sinks = sinks

    def _guarded(self, method: str, arg: dict) -> None:
        for sink in list(self.sinks):
            try:
                getattr(sink, method)(arg)
            except Exception as err:  # any logger failure but metrics.jsonl's must not stop training
                if isinstance(sink, JsonlSink):
                    raise
                if isinstance(err, WandbStartFailed):
                    warn(str(err))
                else:
                    warn(f"{type(sink).__name__}.{method} failed ({type(err).__name__}: {err}); continuing without it")
                self.sinks.remove(sink)
                sink.abandon()

    @property
    def wandb_id(self) -> str | None:
        return next((s.run_id for s in self.sinks if isinstance(s, WandbSink)), None)

    def log(self, row: dict[str, Any]) -> None:
        self._guarded("log", row)

    def finish(self, summary: dict[str, Any]) -> None:
        self._guarded("finish", summary)


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def run_identity(cfg: DictConfig, run_dir: Path) -> tuple[str, str | None, list[str]]:
    """W&B name, group and tags from Hydra: named by the job's overrides, grouped by the sweep
    (`logger.group` overrides), tagged with every chosen group option (`precision:bf16`)."""
    group = cfg.logger.get("group")
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
    except ValueError:  # run() called outside Hydra (tests, notebooks)
        return run_dir.name, group, []
    name = hc.job.override_dirname or "defaults"
    if hc.mode == RunMode.MULTIRUN:
        sweep = Path(hc.sweep.dir)
        group = group or f"{sweep.parent.name}_{sweep.name}"  # e.g. 2026-12-02_14-40-00.123456
        name = f"{hc.job.num}_{name}"
    tags = [f"{k}:{v}" for k, v in sorted(hc.runtime.choices.items()) if v and not k.startswith("hydra")]
    return name, group, tags


def build_tracker(
    cfg: DictConfig, run_dir: Path, resume_step: int | None = None, wandb_id: str | None = None
) -> Tracker:
    """metrics.jsonl always, W&B when on; on resume, continue both from `resume_step`."""
    sinks: list = [JsonlSink(run_dir / "metrics.jsonl", resume_step)]
    if cfg.logger.kind == "wandb":
        name, group, tags = run_identity(cfg, run_dir)
        try:
            sinks.append(WandbSink(cfg, run_dir, name, group, tags, wandb_id))
        except Exception as err:  # no account, no network, broken install: train anyway
            warn(f"W&B could not start ({type(err).__name__}: {one_line(err)}); metrics go to metrics.jsonl only")
    return Tracker(sinks)
