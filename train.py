"""Entry point: `python train.py [overrides]`, `python train.py -m [sweeps]`. See README.md."""

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from halfprec.checkpoint import Preempted
from halfprec.config import ConfigError, validate
from halfprec.init import InitError
from halfprec.precision import PrecisionMismatch
from halfprec.scaling import TrainingAborted

# exit codes: 2 a config value that cannot work, 3 training stopped, 4 stopped by a signal (resumable)
EXIT_CODES = [
    ((ConfigError, InitError), 2, "error"),
    ((TrainingAborted, PrecisionMismatch), 3, "error: training stopped"),
]
EXIT_CODES.append(((Preempted,), 4, "stopped"))


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float:
    try:
        validate(cfg)  # a bad value fails before any data or model is built
        from halfprec.train import run

        summary = run(cfg, HydraConfig.get().runtime.output_dir)
    except tuple(e for errors, _, _ in EXIT_CODES for e in errors) as err:
        code, prefix = next((c, p) for errors, c, p in EXIT_CODES if isinstance(err, errors))
        print(f"{prefix}: {err}", file=sys.stderr)
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            # let Hydra mark this job failed (sweep.jsonl) and run the others; an exit here
            # would end the whole sweep at the first bad combination
            raise
        sys.exit(code)
    return summary["val/acc"]  # the sweep metric (Optuna maximizes it)


if __name__ == "__main__":
    main()
