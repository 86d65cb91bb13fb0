"""A ``script=`` job that runs until it is stopped (the signal matrix: tests/harness/stops.py): each rank joins the
group, all_reduces once, says it is running (an empty ``running-<RANK>`` in the folder its first argument names),
then all_reduces every 50 ms, as a training loop would; it saves nothing."""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    value = torch.ones(1)
    dist.all_reduce(value)
    Path(sys.argv[1], f"running-{os.environ['RANK']}").touch()
    while True:
        dist.all_reduce(value)
        time.sleep(0.05)


if __name__ == "__main__":
    main()
