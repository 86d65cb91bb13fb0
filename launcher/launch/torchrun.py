"""Torchrun mode: ``torchrun ... -m launcher [overrides]`` makes this process one rank already; run it here.

``torchrun --standalone --nproc_per_node=2 -m launcher [overrides]`` composes the config on every rank (same
command line, same result); rank 0 writes it into the run dir. Errors go through ``@record`` so torchrun's
agent reports the failing rank's traceback; the launcher's own failure records are written as in every mode.
Rank 0 ends a finished run with the summary table, a stopped one with the torchrun command that continues it
(torchrun's own flags, read from its agent's command line, and ``hydra.run.dir``: the run dir's saved overrides
come with it); a stopped ``script=`` with the stop line saying how rank 0's script ended (torchrun's agent, not the
launcher, gives the ranks their grace: its own 30 s).
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Any

from launcher.base.env import DistEnv
from launcher.config import JobConfig
from launcher.launch.mode import StartedMode
from launcher.report.stops import RankEnd, print_stopped


class TorchrunMode(StartedMode):
    name = "torchrun"
    source = "elastic"
    starter = "torchrun"
    layout_flags = "--nnodes/--nproc_per_node"
    store_host = "torchrun's store"

    def run_rank(self, job: JobConfig, env: DistEnv) -> Any:
        from launcher.rank.entry import end_by_signal, rank_main

        def say_stopped(signum: int) -> None:  # rank 0: no launcher above torchrun says it
            if env.is_main:
                print_stopped(128 + signum, job)
                if job.script is None:
                    again = f"{rerun_command(os.getppid())} hydra.run.dir={job.run_dir}"
                    print(f"launcher: the command: {again}", file=sys.stderr)

        def stopped(job: JobConfig, env: DistEnv, stop: Any) -> None:
            if stop.signum:
                say_stopped(stop.signum)
            end_by_signal(job, env, stop)

        def script_stopped(job: JobConfig, env: DistEnv, signum: int, end: RankEnd) -> None:
            if env.is_main:  # how rank 0 ended (torchrun, not the launcher, waits for the others: 30 s, then kills)
                print_stopped(128 + signum, job, ends=[end])

        # torchrun is an elastic agent: the same stop signals as ours; a script gets them itself and ends its way
        return rank_main(
            job, env, composed_here=True, after_stop=stopped, last_words=say_stopped, after_script_stop=script_stopped
        )


def rerun_command(agent_pid: int) -> str:
    """torchrun's command line up to ``-m launcher`` (its own flags, without the job's overrides), from its
    agent process (this rank's parent); a generic form where that cannot be read."""
    try:
        argv = Path(f"/proc/{agent_pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        argv = []
    for i in range(1, len(argv)):
        if argv[i - 1] == "-m" and argv[i] == "launcher":
            return shlex.join(argv[: i + 1])
    return "torchrun <its flags as before> -m launcher"
