"""Under torchrun this process already is a worker: run it here, no second spawn.

``torchrun --standalone --nproc_per_node=2 -m launcher [overrides]`` composes the config on every rank (same
command line, same result); rank 0 writes it into the run dir. Errors go through ``@record`` so torchrun's
agent reports the failing rank's traceback; the launcher's own failure records are written as in every mode.
"""

from __future__ import annotations

from ..config import JobConfig
from ..env import DistEnv
from ..rank import rank_main


def run_under_torchrun(job: JobConfig, env: DistEnv) -> int:
    rank_main(job, env, composed_here=True)  # torchrun is an elastic agent: same stop signals as ours
    return 0
