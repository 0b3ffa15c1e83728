"""Entry point: `python train.py [overrides]`, `python train.py -m [sweeps]`. See README.md."""

import os
import sys
import tempfile
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from halfprec.config import checked
from halfprec.config.resolvers import register_resolvers
from halfprec.errors import TrainingAborted
from halfprec.launch.cluster import join_job_tasks
from halfprec.launch.continuing import say_if_new_run_dir, skipped_job
from halfprec.launch.exits import check_not_a_lone_sweep, in_sweep, job_errors, run_cli
from halfprec.launch.objective import sweep_value


@hydra.main(config_path="conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float:
    with job_errors():  # one line and an exit code; in a sweep, the job is recorded as failed instead
        join_job_tasks()  # a submitit job of several tasks: one distributed run, as under torchrun
        check_not_a_lone_sweep()  # +experiment=formats without -m
        config = checked(cfg)  # validated and typed: a bad value fails before any data or model is built
        say_if_new_run_dir(config.resume)  # resume=auto without hydra.run.dir
        # a sweep continued with resume=auto: a job that finished is not run again
        summary = skipped_job(config.resume, config.trainer.max_steps)
        if summary is None:
            from halfprec.training.run import run

            try:
                summary = run(config, HydraConfig.get().runtime.output_dir)
            except TrainingAborted:
                if not in_sweep():
                    raise
                summary = {"status": "diverged"}  # a result for the sweep: the worst objective for a search
    return sweep_value(config.task.name, config.objective, summary)  # for a sweeper (hparams_search=optuna)


if __name__ == "__main__":
    if int(os.environ.get("RANK", 0)) > 0:
        # torchrun: rank 0's Hydra run dir is the run's (shared with the others after the process
        # group is up); the other ranks get a scratch dir so that no stray run dirs appear
        sys.argv += [f"hydra.run.dir={tempfile.mkdtemp(prefix='halfprec-rank-')}", "hydra.output_subdir=null"]
    register_resolvers()  # ${div:...}, ${halfprec.direction:...}, ${halfprec.dirname:...}
    # every way a run or sweep ends becomes an exit code and one line (halfprec/launch/exits.py)
    sys.exit(run_cli(main, Path(__file__).resolve().parent / "conf", sys.argv[1:]))
