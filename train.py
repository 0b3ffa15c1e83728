"""Entry point: `python train.py [overrides]`, `python train.py -m [sweeps]`. See README.md."""

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from halfprec.checkpoint import Preempted
from halfprec.config import ConfigError, validate
from halfprec.init import InitError
from halfprec.precision import PrecisionMismatch
from halfprec.scaling import TrainingAborted


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float:
    try:
        validate(cfg)  # a bad value fails before any data or model is built
        from halfprec.train import run

        summary = run(cfg, HydraConfig.get().runtime.output_dir)
    except (ConfigError, InitError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except (TrainingAborted, PrecisionMismatch) as err:
        print(f"error: training stopped: {err}", file=sys.stderr)
        sys.exit(3)
    except Preempted as err:
        print(f"stopped: {err}", file=sys.stderr)
        sys.exit(4)
    return summary["val/acc"]  # the sweep metric (Optuna maximizes it)


if __name__ == "__main__":
    main()
