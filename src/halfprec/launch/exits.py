"""How a run or a sweep ends: the exit code, and the one line a user reads for each way it can end.

`train.py` hands its whole Hydra call to `run_cli`. Hydra is told to raise (HYDRA_FULL_ERROR=1)
instead of printing its own multi-line reports, so that every failure reaches this module and is
printed as one line: the key, the value and what would work. Only a bug (an exception that is none
of ours) prints a traceback. Kept free of torch: a config error answers without importing it.
The exit codes are listed in docs/guide/errors.md.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import os
import re
import shutil
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from omegaconf.errors import OmegaConfBaseException

from halfprec import ctrl_c
from halfprec.config.resolvers import register_resolvers
from halfprec.errors import ConfigError, InitError, Interrupted, PrecisionMismatch, Preempted, TrainingAborted
from halfprec.launch import sweep_log

OK = 0
BUG = 1  # an unexpected exception: the traceback is printed
CONFIG = 2  # a config value, key or option that cannot work
TRAINING_STOPPED = 3  # diverged (skip storm, scale floor, overflow rate, non-finite loss) or wrong precision
SIGNAL = 4  # SIGTERM, SIGUSR1 or the first Ctrl-C: a checkpoint was saved, the run can resume
SWEEP_FAILED = 5  # a multirun in which some job failed or diverged (sweep.jsonl says which and why)
FILES = 6  # a file the run writes or reads failed: a full disk, no permission, a run dir that cannot be made
INTERRUPTED = 130  # a second Ctrl-C: quit at once, as shells report SIGINT

# The user-facing errors, most specific first: (class, exit code, prefix of the printed line).
FAILURES: tuple[tuple[type[BaseException], int, str], ...] = (
    (ConfigError, CONFIG, "error"),
    (InitError, CONFIG, "error"),
    (TrainingAborted, TRAINING_STOPPED, "error: training stopped"),
    (PrecisionMismatch, TRAINING_STOPPED, "error: training stopped"),
    (Preempted, SIGNAL, "stopped"),
)


_FULL = "; free some space, or set hydra.run.dir to another disk"
_DENIED = "; set hydra.run.dir to a directory you can write"
FILE_ADVICE = {
    errno.ENOSPC: _FULL,
    errno.EDQUOT: _FULL,
    errno.EFBIG: _FULL,
    errno.EACCES: _DENIED,
    errno.EPERM: _DENIED,
    errno.EROFS: _DENIED,
    errno.ENOTDIR: "; a part of that path is a file, not a directory: set hydra.run.dir to another path",
    errno.ENOENT: "; no such directory, and it cannot be made there: set hydra.run.dir to another path",
}


class SweepStopped(SystemExit):
    """Ends a multirun from a Hydra callback (fail_fast, a stop signal). A SystemExit, because Hydra
    logs and swallows a callback's ordinary exceptions."""

    def __init__(self, code: int, message: str):
        super().__init__(code)
        self.message = message


def failure_line(err: BaseException) -> tuple[int, str] | None:
    """(exit code, the line to print) for one of halfprec's own errors; None for anything else (a bug)."""
    for cls, code, prefix in FAILURES:
        if isinstance(err, cls):
            return code, f"{prefix}: {err}"
    if isinstance(err, OSError) and err.strerror and (err.filename is not None or err.errno in FILE_ADVICE):
        # errors.naming gives ours their path; a write of Hydra's own (.hydra/) comes without one
        where = err.filename if err.filename is not None else "writing the run dir"
        return FILES, f"error: {where}: {err.strerror}{FILE_ADVICE.get(err.errno or 0, '')}"
    if isinstance(err, OmegaConfBaseException):  # an interpolation that cannot resolve: ${model.block_size}
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        key = getattr(err, "full_key", None)
        return CONFIG, f"error: {key}: {first}" if key else f"error: {first}"
    return None


def in_sweep() -> bool:
    """Whether this Hydra job is one of a multirun's."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.get().mode == RunMode.MULTIRUN


def check_not_a_lone_sweep() -> None:
    """A config that sweeps (`+experiment=formats`, `hparams_search=optuna`: hydra.sweeper.params)
    started without -m would train once with none of the values it sweeps, and say nothing. One
    job of it, every swept key set on the command line (what `wandb agent` runs), is a run."""
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    params = dict(hydra_cfg.sweeper.get("params") or {})
    given = {o.split("=", 1)[0].lstrip("+~") for o in hydra_cfg.overrides.task}
    if in_sweep() or not set(params) - given:
        return
    choices = hydra_cfg.runtime.choices
    named = next(((key, choices[key]) for key in ("experiment", "hparams_search") if choices.get(key)), None)
    key, value = named or ("hydra.sweeper.params", ",".join(params))
    jobs = sweep_size(params)
    what = f"a sweep of {jobs} jobs" if jobs else "a sweep"
    raise ConfigError(
        key if key != "experiment" else "+experiment", value, f"is {what} over {', '.join(params)}: add -m to run "
        f"it (python train.py -m ...); without -m it would train once, with none of the values it sweeps",
    )  # fmt: skip


def sweep_size(params: dict[str, Any]) -> int | None:
    """How many jobs Hydra's basic sweeper makes of `params` (None for a search's ranges: Optuna's)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    size = 1
    try:
        for override in OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in params.items()]):
            size *= len(list(override.sweep_string_iterator())) if override.is_sweep_override() else 1
    except Exception:  # interval(), tag(): a search space, not a list of values
        return None
    return size


@contextlib.contextmanager
def job_errors() -> Iterator[None]:
    """Around a Hydra job: a single run prints its own error as one line and exits with its code
    (before Hydra would add a line of its own); a multirun job raises it, so that the sweep records
    the job as failed (sweep.jsonl, Optuna) and goes on with the others."""
    try:
        yield
    except Exception as err:
        known = failure_line(err)
        if known is None or in_sweep():
            raise
        print(known[1], file=sys.stderr)
        if known[0] == CONFIG:
            remove_unused_run_dir()
        raise SystemExit(known[0]) from None


def remove_unused_run_dir() -> None:
    """A config error stops a run before it writes anything: the run dir Hydra made for it would
    hold .hydra/ alone (and `halfprec report` count it as running). A dir with anything else in it
    (a resumed run's checkpoints) stays. A multirun's job dirs stay too: sweep.jsonl names them."""
    from hydra.core.hydra_config import HydraConfig

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if not run_dir.is_dir() or {p.name for p in run_dir.iterdir()} - {".hydra"}:
        return
    shutil.rmtree(run_dir, ignore_errors=True)


def run_cli(main: Callable[[], Any], conf_dir: Path, argv: list[str]) -> int:
    """Run Hydra's `main()` and turn however it ends into an exit code and at most a few lines."""
    user_wants_traces = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises; what it would print is decided below
    try:
        with ctrl_c.quits_once():  # and ignored once the command ends: its lines, the interpreter's exit
            main()
    except Interrupted as err:  # a second Ctrl-C during training: its message says what is on disk
        print(f"interrupted: {err}", file=sys.stderr)
        return _end_of_sweep(INTERRUPTED)
    except KeyboardInterrupt:  # Ctrl-C outside the training steps, which is not deferred to a step's end
        print("interrupted: quit at once, outside the training steps (nothing more was saved)", file=sys.stderr)
        return _end_of_sweep(INTERRUPTED)
    except SweepStopped as stop:
        print(stop.message, file=sys.stderr)
        return _end_of_sweep(int(stop.code or 0))
    except Exception as err:
        if user_wants_traces:
            raise
        return _failed(err, conf_dir, argv)
    return _end_of_sweep(OK)


def _failed(err: Exception, conf_dir: Path, argv: list[str]) -> int:
    if sweep_log.jobs_recorded():  # a job failed (its line is printed by now, or just below); the sweep's
        if isinstance(err, Preempted):  # a job in another process was stopped by a signal
            return _end_of_sweep(SIGNAL)
        if not sweep_log.records_error(err):  # launching the next job failed: nothing has said so
            return _launch_failed(err, conf_dir, argv)
        # a job's error that the sweeper raised again (Optuna's max_failure_rate): printed as the job ended
        printed = failure_line(err) is not None or id(err) in sweep_log.printed_errors
        return _end_of_sweep(SWEEP_FAILED if printed else _bug(err))
    known = _known_line(err, conf_dir, argv)
    if known is None:
        return _bug(err)
    print(known[1], file=sys.stderr)
    return known[0]


def _known_line(err: Exception, conf_dir: Path, argv: list[str]) -> tuple[int, str] | None:
    """(exit code, one line) for an error halfprec or Hydra explains; None for a bug."""
    return failure_line(err) or hydra_error_line(err, conf_dir, argv)


def _launch_failed(err: Exception, conf_dir: Path, argv: list[str]) -> int:
    """A multirun that stopped between jobs (the next job's config did not compose: a conf/ file
    edited while the sweep ran, say): its error, and that the jobs after the recorded ones did not run."""
    known = _known_line(err, conf_dir, argv)
    if known is None:
        return _end_of_sweep(_bug(err))
    print(f"{known[1]}; the sweep stopped: the jobs after those recorded did not run", file=sys.stderr)
    return _end_of_sweep(known[0])


def _bug(err: BaseException) -> int:
    traceback.print_exception(err)
    return BUG


def _end_of_sweep(code: int) -> int:
    """After a multirun: one line with the counts and where sweep.jsonl is; the sweep's exit code."""
    counts = sweep_log.status_counts()
    if counts is None:
        return code
    for message in sweep_log.unprinted_failures():
        print(message, file=sys.stderr)
    path, by_status = counts
    unfinished = sum(n for status, n in by_status.items() if status != "completed")
    if code == OK and unfinished:
        code = SWEEP_FAILED
    stopped = {"stopped", "interrupted"} & set(by_status)  # a job a launcher in another process saw stop
    if sweep_log.continue_with and (stopped or code in (SIGNAL, INTERRUPTED)):
        print(f"continue the sweep with: {sweep_log.continue_with}", file=sys.stderr)
    shown = ", ".join(f"{n} {status}" for status, n in by_status.items()) or "no job finished"
    print(f"sweep: {shown}; {path} (exit {code})", file=sys.stderr)
    return code


# Hydra's own errors, reworded. Hydra's messages span many lines (every option of a group, the
# config search path, advice to add '+'); ours name the key, the value and what would work.
NOT_IN_CONFIG = re.compile(r"Could not override '([^']+)'\.\s*To append to your config use \+(\S+)")
AMBIGUOUS = re.compile(r"Ambiguous value for argument '([^'=]+)=([^']*)'")
NOT_IN_DEFAULTS = re.compile(r"Could not override '([^']+)'\. No match in the defaults list")
ADDED_TWICE = re.compile(r"Multiple values for ([^.\s]+)\. To override a value use 'override [^:]+: ([^']+)'")


def hydra_error_line(err: Exception, conf_dir: Path, argv: list[str]) -> tuple[int, str] | None:
    from hydra.errors import HydraException, MissingConfigException, OverrideParseException

    if isinstance(err, MissingConfigException) and err.missing_cfg_file:
        group, _, value = err.missing_cfg_file.rpartition("/")
        # an option in a list (logger=[csv,tensorbord]) comes without Hydra's list of options
        options = list(err.options or sorted(p.stem for p in (conf_dir / group).glob("*.yaml")))
        if options:
            return CONFIG, "error: " + unknown_option(group, value, options)
    if isinstance(err, OverrideParseException):
        syntax = err.message.splitlines()[0]
        whole = rejoined(err.override, argv)
        if whole is not None:
            return CONFIG, (
                f"error: {err.override}: the shell split this override at its spaces, and Hydra cannot read the "
                f"pieces ({syntax}): quote the whole override: '{whole}'"
            )
        fix = "quote a value that holds '=', spaces or brackets: 'key=\"a value\"'"
        return CONFIG, f"error: {err.override}: not an override Hydra can read ({syntax}); {fix}"
    if isinstance(err, ValueError) and str(err).startswith("Config group override must be a string"):
        return CONFIG, "error: " + number_for_option(conf_dir, argv)  # trainer=5: Hydra read 5 as a number
    if isinstance(err, ValueError) and str(err).startswith("Only one of --run, --multirun, --cfg"):
        return CONFIG, (
            "error: -m with --cfg or --info: Hydra takes one of them at a time; to see the config a sweep's job "
            "composes, give one value per key without -m: python train.py <overrides> --cfg job"
        )
    if not isinstance(err, HydraException):
        return None
    found = NOT_IN_CONFIG.search(str(err))
    if found:
        return CONFIG, "error: " + unknown_key(found.group(1), found.group(2), conf_dir, argv)
    found = AMBIGUOUS.search(str(err))
    if found:  # a comma list without -m: Hydra's own hint (add --multirun) was the last of its lines
        key, value = found.groups()
        return CONFIG, (
            f"error: {key}={value}: a comma list is a sweep: add -m (python train.py -m {key}={value}); "
            f"a list value is {key}=[{value}]"
        )
    found = ADDED_TWICE.search(str(err))
    if found:  # +logger=csv: '+' adds a group train.yaml does not choose
        group, value = found.groups()
        chosen = default_choice(conf_dir, group)
        both = f", or {group}=[{chosen},{value}] for both" if group == "logger" and chosen else ""
        return CONFIG, (
            f"error: +{group}={value}: train.yaml chooses {group} already, and '+' adds a group it does not "
            f"choose: write {group}={value} (without +){both}"
        )
    found = NOT_IN_DEFAULTS.search(str(err))
    if found and (conf_dir / found.group(1)).is_dir():  # a group train.yaml does not choose: experiment
        group = found.group(1)
        value = next((o.split("=", 1)[1] for o in argv if o.split("=", 1)[0] == group), "<option>")
        return CONFIG, f"error: {group}={value}: {group} is not in train.yaml's defaults: add it with +{group}={value}"
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    cause = str(err.__cause__).strip().splitlines()[0] if err.__cause__ else ""
    return CONFIG, f"error: {first}" + (f" ({cause})" if cause and cause not in first else "")


def default_choice(conf_dir: Path, group: str) -> str | None:
    """The option train.yaml's defaults list chooses for `group`."""
    from omegaconf import DictConfig, OmegaConf

    root = OmegaConf.load(conf_dir / "train.yaml")
    defaults = root.get("defaults", []) if isinstance(root, DictConfig) else []
    return next((str(d[group]) for d in defaults if isinstance(d, DictConfig) and group in d), None)


def rejoined(piece: str, argv: list[str]) -> str | None:
    """The override the shell split at its spaces (an unquoted `precision.schedule=[{from_step: 10, ...}]`),
    from `piece`, its first part, on: the argv items up to the one that closes its brackets. None
    when `piece` is whole."""
    if piece not in argv:
        return None
    parts, depth = [], 0
    for part in argv[argv.index(piece) :]:
        parts.append(part)
        depth += sum(part.count(c) for c in "[{") - sum(part.count(c) for c in "]}")
        if depth <= 0:
            break
    return " ".join(parts) if len(parts) > 1 else None


def unknown_option(group: str, value: str, options: list[str]) -> str:
    close = difflib.get_close_matches(value, options, n=1, cutoff=0.5)
    hint = f"did you mean {group}={close[0]}? " if close else ""
    return f"{group}={value}: no such option in conf/{group}/; {hint}options: {', '.join(options)}"


def number_for_option(conf_dir: Path, argv: list[str]) -> str:
    """A group given a number (`trainer=5`), which Hydra reads as an int and rejects without naming it."""
    for override in user_overrides(argv):
        group, _, value = override.lstrip("+").partition("=")
        if (conf_dir / group).is_dir():
            options = sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))
            if value not in options:
                return unknown_option(group, value, options)
    return "a config group was given a number where it takes an option's name"


def unknown_key(key: str, added: str, conf_dir: Path, argv: list[str]) -> str:
    """A `key=value` whose key is not in the composed config. Composed again with `+key=value`,
    the config's own checks name the keys that group takes and the closest one; a key they accept
    (an optimizer argument the YAML does not list) is added with '+'."""
    value = added.partition("=")[2]
    try:
        cfg = compose_with(conf_dir, [f"+{added}" if o.partition("=")[0] == key else o for o in user_overrides(argv)])
        from halfprec.config import validate, validate_optimizer

        validate(cfg)
        if key.startswith("optim."):
            validate_optimizer(cfg)
    except ConfigError as err:
        return str(err)
    except Exception:  # a second mistake elsewhere in the command: the plain statement still holds
        pass
    return f"{key}={value}: not a key of the config; to add it, write +{added}"


def user_overrides(argv: list[str]) -> list[str]:
    """The command line's overrides of the training config, a sweep's lists taken at their first
    value; Hydra's own settings (hydra.*, hydra/launcher=...) are left out."""
    from hydra._internal.utils import get_args_parser
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = get_args_parser().parse_args(argv).overrides
    kept = []
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.get_key_element()
        if key.lstrip("+~").startswith("hydra"):
            continue
        if override.is_sweep_override():
            kept.append(f"{key}={next(iter(override.sweep_string_iterator()))}")
        else:
            assert override.input_line is not None  # parse_overrides keeps each override's text
            kept.append(override.input_line)
    return kept


def compose_with(conf_dir: Path, overrides: list[str]) -> Any:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()  # the failed run left Hydra initialized
    register_resolvers()
    with initialize_config_dir(str(conf_dir), version_base="1.3"):
        return compose("train", overrides=overrides)
