"""A ``script=`` job whose ranks register two atexit handlers (tests/jobs/test_stop_grace.py; issue 58): each rank
all_reduces once, registers ``first`` then ``second``, each appending its name as a line to ``atexit-<RANK>`` in the
folder its first argument names, and ends normally: Python runs them last-in, first-out (``second``, then
``first``), before the launcher's own end of the process."""

import atexit
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def note(path: Path, name: str) -> None:
    with open(path, "a") as f:
        f.write(name + "\n")


def main() -> None:
    path = Path(sys.argv[1], f"atexit-{os.environ['RANK']}")
    dist.init_process_group("gloo")
    value = torch.ones(1)
    dist.all_reduce(value)
    atexit.register(note, path, "first")
    atexit.register(note, path, "second")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
