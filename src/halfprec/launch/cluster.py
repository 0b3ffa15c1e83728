"""A Hydra job that a cluster launcher starts as several tasks (submitit: `hydra.launcher.tasks_per_node`,
`nodes`, `gpus_per_node`, on SLURM or as local processes) trains as one distributed run.

Each task runs the whole Hydra job. Before anything else, it exports the env:// variables that
torchrun would have set (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR: the job's first
host, MASTER_PORT: drawn from the job id), read from submitit's job environment by submitit's own
helper; from there on the run is the one torchrun starts: rank 0 owns the run dir, metrics,
checkpoints, W&B run and the sweep.jsonl line. A job of one task is left alone.
"""

from __future__ import annotations

import os


def join_job_tasks() -> int:
    """In a submitit job of several tasks: export torch.distributed's variables; the number of tasks
    (1 outside submitit, or for a job of one task)."""
    if "SUBMITIT_EXECUTOR" not in os.environ:
        return 1
    import submitit

    if submitit.JobEnvironment().num_tasks == 1:
        return 1
    # CUDA_VISIBLE_DEVICES is left as the scheduler set it: the run picks its GPU by local rank
    # (halfprec.training.distributed), whether a task sees all of the node's GPUs or one.
    # overwrite: SLURM hands a job the environment of the shell that submitted it, whose RANK or
    # MASTER_ADDR (from some other run) would be wrong here.
    env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    return env.world_size
