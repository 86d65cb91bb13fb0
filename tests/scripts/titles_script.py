"""Writes what ``ps`` shows for this rank, its parent and its grandparent (``/proc/PID/cmdline``), its short name
(``/proc/PID/comm``) and whether its environment is still readable in ``/proc/self/environ``, to
``--out=DIR/rank-<k>.json`` (issue 47: titles)."""

import argparse
import json
import os
from pathlib import Path

import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--lr", type=float, default=0.1)
args = parser.parse_args()


def command_line(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").replace(b"\0", b" ").decode()


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


dist.init_process_group("gloo")
rank = dist.get_rank()
me = os.getpid()
seen = {
    "rank": command_line(me),
    "parent": command_line(parent(me)),
    "grandparent": command_line(parent(parent(me))),
    "comm": Path("/proc/self/comm").read_text().strip(),
    "environ": f"RANK={rank}".encode() in Path("/proc/self/environ").read_bytes().split(b"\0"),
}
Path(args.out, f"rank-{rank}.json").write_text(json.dumps(seen))
dist.barrier()
dist.destroy_process_group()
