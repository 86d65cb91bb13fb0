"""A ``script=`` job that does not stop (tests/jobs/test_stop_grace.py): each rank installs one handler for SIGINT,
SIGTERM and SIGHUP that appends the signal's name to ``got-<RANK>`` in the folder its first argument names and goes
on, joins the group, says it is running (``running-<RANK>``), then all_reduces every 50 ms until it is killed."""

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    marks, rank = Path(sys.argv[1]), os.environ["RANK"]

    def note(signum: int, frame: object) -> None:
        with open(marks / f"got-{rank}", "a") as got:
            got.write(signal.Signals(signum).name + "\n")

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, note)
    dist.init_process_group("gloo")
    value = torch.ones(1)
    dist.all_reduce(value)
    (marks / f"running-{rank}").touch()
    while True:
        dist.all_reduce(value)
        time.sleep(0.05)


if __name__ == "__main__":
    main()
