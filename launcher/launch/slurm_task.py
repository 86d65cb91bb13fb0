"""Slurm-task mode: ``srun python -m launcher [overrides]`` in a user's sbatch script makes each task one rank.

Each task composes the config from the same command line (rank 0 writes it into the run dir, ``runs/slurm-<job
id>`` by default, so a requeued job finds its checkpoints); the rank runs as a task of ``+cluster=slurm`` does
(``run_slurm_rank``: SIGUSR2 stops with a checkpoint, rank 0 requeues).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import JobConfig
from ..env import DistEnv
from .mode import StartedMode

if TYPE_CHECKING:
    from .plan import LaunchPlan


class SlurmTaskMode(StartedMode):
    name = "slurm-task"
    source = "slurm"
    starter = "srun"
    layout_flags = "-N/--ntasks-per-node"
    store_host = "rank 0 hosts the store"

    def run(self, plan: LaunchPlan, job: JobConfig, env: DistEnv) -> int:
        from .slurm import run_slurm_rank

        run_slurm_rank(job, env, composed_here=True)
        return 0
