"""A ``script=`` job preempted on Slurm (tests/beds/test_slurm.py; issue 58): each rank installs a handler for
SIGINT, SIGTERM and SIGHUP that notes the signal and an atexit handler that writes ``atexit-<START>-<RANK>``, joins
the group and says it runs (``running-<START>-<RANK>``), all in the folder its first argument names (``START``:
``TORCHELASTIC_RESTART_COUNT``, the requeues so far). The first start all_reduces its flag (MAX) every 50 ms until a
rank was signalled, then every rank writes ``saved-<RANK>`` (the signals it got) and exits 0; a later start reads
what it saved (``resumed-<RANK>``) and exits 0."""

import atexit
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    marks, rank, start, got = Path(sys.argv[1]), os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"], []
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda signum, frame: got.append(signal.Signals(signum).name))
    atexit.register(lambda: (marks / f"atexit-{start}-{rank}").write_text("ran"))
    dist.init_process_group("gloo")
    flag = torch.zeros(1)
    dist.all_reduce(flag)
    (marks / f"running-{start}-{rank}").touch()
    if start != "0":
        (marks / f"resumed-{rank}").write_text((marks / f"saved-{rank}").read_text())
        dist.destroy_process_group()
        return
    while True:
        flag.fill_(1.0 if got else 0.0)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            break
        time.sleep(0.05)
    (marks / f"saved-{rank}").write_text(",".join(got) or "told")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
