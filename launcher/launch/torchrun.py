"""Under torchrun this process already is a worker: run it here, no second spawn.

``torchrun --standalone --nproc_per_node=2 -m launcher [overrides]`` composes the config on every rank (same
command line, same result); rank 0 freezes it into the run dir. Errors go through ``@record`` so torchrun's
agent reports the failing rank's traceback.
"""

from __future__ import annotations

from torch.distributed.elastic.multiprocessing.errors import record

from ..config import JobConfig, freeze
from ..dist import end_process_at_exit
from ..env import DistEnv
from ..worker import run_worker


def run_under_torchrun(job: JobConfig, env: DistEnv) -> int:
    if env.is_main:
        freeze(job, job.run_dir)
    try:
        record(run_worker)(job, env)
    except BaseException:
        end_process_at_exit(1)  # see launcher.dist.end_process_at_exit
        raise
    end_process_at_exit(0)
    return 0
