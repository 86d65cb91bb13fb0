"""Process titles: what ``ps``, ``top``, htop, py-spy and nvidia-smi show for the launcher's processes, instead of
``python -u -m launcher.rank.entry RUN_DIR`` for every rank (setproctitle rewrites the command line the kernel
shows, and the short name ``top`` shows).

    launcher head sim: train.py --lr 0.1 (run dir runs/2026-11-27/13-40-00)
    launcher node 1/2: train.py --lr 0.1 (run dir ...)
    launcher rank 3/4 node 1: train.py --lr 0.1 (run dir ...)

The run dir stays in every title: it tells two jobs of one machine apart (and finds a job's processes)."""

from __future__ import annotations

import os

import setproctitle

NO_ENV = "SPT_NOENV"  # setproctitle: keep /proc/PID/environ whole (the title fits where the command line was)


def title(place: str, entry: str, run_dir: object) -> str:
    """The title of the process at ``place`` ("head sim", "node 1/2", "rank 3/4 node 1") running ``entry``."""
    return f"launcher {place}: {entry} (run dir {run_dir})"


def short_name(place: str) -> str:
    """The process's short name (``top``'s COMMAND, ``/proc/PID/comm``: 15 bytes): ``place`` without spaces. A
    space there breaks tools that split ``/proc/PID/stat`` on spaces: Slurm's proctrack/linuxproc then loses the
    process's parent and never signals it (a job's ranks outlived the job)."""
    return place.replace(" ", "-")[:15]


def name_process(place: str, entry: str, run_dir: object) -> None:
    """Give this process its title (``title``), cut to the length of its command line: setproctitle would take
    the environment's room too, and ``/proc/PID/environ`` (what a rank was given: NCCL's variables, the script's)
    would then show the title. The launcher starts ranks with room for it (``config.rules.rank_command``)."""
    users = os.environ.get(NO_ENV)
    os.environ[NO_ENV] = users or "1"  # read once, at the first title
    try:
        setproctitle.setproctitle(title(place, entry, run_dir))
        setproctitle.setthreadtitle(short_name(place))  # this thread's is the process's: setproctitle set it too
    finally:
        if users is None:
            del os.environ[NO_ENV]
