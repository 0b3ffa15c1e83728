"""Weights & Biases: a run under `<run dir>/wandb/`, offline unless `logger.wandb.mode` or
$WANDB_MODE says otherwise, so it needs no account or network (`wandb sync` uploads later)."""

from __future__ import annotations

import os
import secrets
import signal
import string
import sys
import threading
import time
from collections import deque
from typing import Annotated, Any, Literal

from halfprec.loggers import Histogram, LoggerUnavailable, RunInfo, one_line, register_logger
from halfprec.spec import Spec

# W&B's own wandb.init timeout is 90 s. It no longer holds training up (see WandbSink), but a run
# shorter than it that has no network still waits for it at the end, before its warning.
START_TIMEOUT_S = 30.0
START_GRACE_S = 15.0  # W&B's own 10 s beyond init_timeout, and `import wandb`
NOTICE_AFTER_S = 5.0  # finish says why it waits once the wait is longer than an offline start takes
QUIT_WAIT_S = 2.0  # after a second Ctrl-C: enough for an offline run that is nearly up
# wandb.init, or the finish of a run given up on, one at a time: consecutive multirun jobs share
# this process, and reinit="finish_previous" must see the previous job's run finished, not half up.
_START_LOCK = threading.Lock()


class WandbStartFailed(LoggerUnavailable):
    """wandb.init failed, or gave no answer in time: the sink has no run and is dropped."""


@register_logger("wandb", "W&B", package="wandb", install="pip install wandb")
class WandbSink:
    """A W&B run under `<run dir>/wandb/`, carrying the resolved config, finished exactly once.

    `import wandb` and wandb.init take seconds (minutes without network), so they run in a
    background thread and training starts at once: rows logged meanwhile are kept, in order, and
    sent by the first log after the run is up. Only finish waits for it. The run id is chosen
    here, so a checkpoint can record it before the run is up."""

    def __init__(
        self,
        run: RunInfo,
        *,
        mode: Annotated[Literal["offline", "online", "disabled"], Spec(doc="or set WANDB_MODE")],
        project: Annotated[str, Spec(nonempty=True, doc="the W&B project")],
        entity: Annotated[str | None, Spec(doc="the W&B team or user; null: your default")],
        job_type: str | None,
        tags: Annotated[list[str], Spec(doc="added to the group options' tags (precision:bf16, ...)")],
        group: Annotated[str | None, Spec(doc="null: the multirun sweep (one group per sweep), none for single runs")],
    ):
        # a sweep agent passes its run's id in $WANDB_RUN_ID (wandb.init ignores id= in a sweep)
        run_id = run.state.get("id")
        env_id = os.environ.get("WANDB_RUN_ID")
        self.id = run_id or env_id or new_run_id()
        init_args = dict(
            id=run_id or (None if env_id else self.id),
            resume="allow" if run_id else None,
            reinit="finish_previous",  # one run per multirun job, even after a job that failed
            project=project,
            entity=entity,
            mode=mode,
            dir=str(run.dir),
            name=run.name,
            group=group or run.group,
            job_type=job_type,
            tags=[*run.tags, *tags],
            config=run.config,
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
            # Ctrl-C is ignored once a stop or a quit is under way (halfprec.ctrl_c), and under nohup
            quit = "" if signal.getsignal(signal.SIGINT) == signal.SIG_IGN else "Ctrl-C: quit without it; "
            print(
                f"W&B is still starting; waiting up to {wait_s - NOTICE_AFTER_S:.0f} s more for it "
                f"({quit}metrics.jsonl has every row)",
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

    def state(self) -> dict[str, Any]:
        return {"id": self.run_id}

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
