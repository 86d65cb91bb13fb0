"""Torchrun mode: ``torchrun ... -m launcher [overrides]`` makes this process one rank already; run it here.

``torchrun --standalone --nproc_per_node=2 -m launcher [overrides]`` composes the config on every rank (same
command line, same result); rank 0 writes it into the run dir. Errors go through ``@record`` so torchrun's
agent reports the failing rank's traceback; the launcher's own failure records are written as in every mode.
"""

from __future__ import annotations

from ..config import JobConfig
from ..env import DistEnv
from .mode import LaunchPlan, StartedMode


class TorchrunMode(StartedMode):
    name = "torchrun"
    source = "elastic"
    starter = "torchrun"
    layout_flags = "--nnodes/--nproc_per_node"
    store_host = "torchrun's store"

    def run(self, plan: LaunchPlan, job: JobConfig, env: DistEnv) -> int:
        from ..rank_entry import rank_main

        rank_main(job, env, composed_here=True)  # torchrun is an elastic agent: the same stop signals as ours
        return 0
