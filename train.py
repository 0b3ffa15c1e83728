"""Entry point: `python train.py [overrides]`, `python train.py -m [sweeps]`. See README.md."""

import os
import sys
import tempfile

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from halfprec.config import ConfigError, validate
from halfprec.errors import InitError, PrecisionMismatch, Preempted, TrainingAborted

# What each user-facing failure prints and exits with (README, "Errors").
EXIT_CODES = {
    ConfigError: (2, "error"),  # a config value that cannot work
    InitError: (2, "error"),
    TrainingAborted: (3, "error: training stopped"),  # skip storm, scale floor, nonfinite=abort
    PrecisionMismatch: (3, "error: training stopped"),
    Preempted: (4, "stopped"),  # SIGTERM/SIGUSR1 after a checkpoint: resumable
}


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float:
    try:
        validate(cfg)  # a bad value fails before any data or model is built
        from halfprec.train import run

        summary = run(cfg, HydraConfig.get().runtime.output_dir)
    except tuple(EXIT_CODES) as err:
        code, prefix = next(v for cls, v in EXIT_CODES.items() if isinstance(err, cls))
        print(f"{prefix}: {err}", file=sys.stderr)
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            # let Hydra mark this job failed (sweep.jsonl) and run the others; an exit here
            # would end the whole sweep at the first bad combination
            raise
        sys.exit(code)
    return summary[cfg.objective]  # the sweep metric (hparams_search=optuna maximizes val/acc)


if __name__ == "__main__":
    if int(os.environ.get("RANK", 0)) > 0:
        # torchrun: rank 0's Hydra run dir is the run's (shared with the others after the process
        # group is up); the other ranks get a scratch dir so that no stray run dirs appear
        sys.argv += [f"hydra.run.dir={tempfile.mkdtemp(prefix='halfprec-rank-')}", "hydra.output_subdir=null"]
    main()
