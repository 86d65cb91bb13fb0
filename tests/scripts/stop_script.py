"""A ``script=`` job that stops as a torchrun script does (the signal matrix's script: tests/harness/stops.py; issue
58): each rank installs one handler for SIGINT, SIGTERM and SIGHUP that only notes the signal, registers an atexit
handler that writes ``atexit-<RANK>``, joins the group, says it is running (``running-<RANK>``), all in the folder its
first argument names, then all_reduces its flag (MAX) every 50 ms, as a training loop's step would. Once any rank
was signalled, every rank learns it at that all_reduce, writes ``saved-<RANK>`` (the signals it got itself, or
``told`` when only a peer did), leaves the group and exits 0; its atexit handler runs after that."""

import atexit
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    marks, rank, got = Path(sys.argv[1]), os.environ["RANK"], []
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda signum, frame: got.append(signal.Signals(signum).name))
    atexit.register(lambda: (marks / f"atexit-{rank}").write_text("ran"))
    dist.init_process_group("gloo")
    flag = torch.zeros(1)
    dist.all_reduce(flag)
    (marks / f"running-{rank}").touch()
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
