"""Writes what ``ps`` shows for this rank, its parent and its grandparent (``/proc/PID/cmdline``), its short name
(``/proc/PID/comm``), whether its environment is still readable in ``/proc/self/environ``, and on rank 0 its
``tee`` helper's title (issue 60: the one untitled process), to ``--out=DIR/rank-<k>.json`` (issue 47: titles)."""

import argparse
import json
import os
import time
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


def tee_title(pid: int) -> str:
    """Rank 0's ``tee`` (its child), once it has named itself (it starts as ``python -S -u .../tee.py``)."""
    deadline, found = time.monotonic() + 10, ""
    while time.monotonic() < deadline:
        kids = [int(p.parent.name) for p in Path("/proc").glob("[0-9]*/stat") if parent_or_none(p) == pid]
        found = next((line for line in map(command_line, kids) if "tee" in line), "")
        if found.startswith("launcher "):
            break
        time.sleep(0.1)
    return found


def parent_or_none(stat: Path) -> int | None:
    try:
        return int(stat.read_text().rpartition(")")[2].split()[1])
    except OSError:
        return None


dist.init_process_group("gloo")
rank = dist.get_rank()
me = os.getpid()
seen = {
    "rank": command_line(me),
    "parent": command_line(parent(me)),
    "grandparent": command_line(parent(parent(me))),
    "comm": Path("/proc/self/comm").read_text().strip(),
    "environ": f"RANK={rank}".encode() in Path("/proc/self/environ").read_bytes().split(b"\0"),
    "tee": tee_title(me) if rank == 0 else "",
}
Path(args.out, f"rank-{rank}.json").write_text(json.dumps(seen))
dist.barrier()
dist.destroy_process_group()
