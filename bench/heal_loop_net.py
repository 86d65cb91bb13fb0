"""``bench/heal_loop.py``'s hands on the machine: every process a job started (found by its name on the command
line, ended and reported if any is left), and the network namespaces of a simulated job (its link cut, restored,
any left deleted and reported)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
RECORDS = "/run/launcher-netns"  # launcher/launch/sim/netns.py: one file per live network, "OWNER_PID START_TIME"
STEP_LINE = re.compile(r"^rank (\d+): step (\d+) on (\d+) ranks at ([\d.]+)$", re.M)
FIRED = re.compile(r"^(\S+ \S+) WARNING .*LAUNCHER_FAULT: firing", re.M)
HEALED = re.compile(r"^(\S+ \S+) WARNING .*healed in place: the first step after the change \(step (\d+)\)", re.M)
RESUMED = re.compile(r"resumed from +(?!-\s*$)\S", re.M)  # the log line (or a summary's "resumed from  <path>")
CUT_DELAY_S = 5.0  # rank 1's hold at step AT while the cut is being made (it is lost before it ends)


def _stat(pid: int) -> Optional[tuple[int, str]]:
    """(parent pid, start time) of a live process, None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[19]


def _descendants(root: int) -> dict[int, str]:
    """Every live process under ``root`` (by parent), with its start time (a pid is one process only with it)."""
    parents: dict[int, list[tuple[int, str]]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        stat = _stat(int(entry.name))
        if stat is not None:
            parents.setdefault(stat[0], []).append((int(entry.name), stat[1]))
    found, todo = {}, [root]
    while todo:
        for pid, start in parents.get(todo.pop(), []):
            if pid not in found:
                found[pid] = start
                todo.append(pid)
    return found


def _naming(text: str) -> dict[int, str]:
    """Live processes whose command line contains ``text`` (the job's run dir: its nodes, ranks, tees)."""
    found = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        stat = _stat(int(entry.name))
        if text in cmdline and stat is not None and int(entry.name) != os.getpid():
            found[int(entry.name)] = stat[1]
    return found


def _end_leftovers(seen: dict[int, str]) -> list[str]:
    """SIGKILL each process of ``seen`` still alive (the same start time: not a reused pid); what was killed."""
    killed = []
    for pid, start in seen.items():
        stat = _stat(pid)
        if stat is None or stat[1] != start:
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
            os.kill(pid, signal.SIGKILL)
            killed.append(f"{pid} {cmd}")
        except OSError:
            continue
    return killed


# ---------------------------------------------------------------------------------------------------- namespaces
def _namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.splitlines()
    return [line.split()[0] for line in listed if line.strip()]


def _job_tag(owners: set[int]) -> Optional[str]:
    """The tag of the simulated network whose owner is one of ``owners`` (the launcher's processes)."""
    if not os.path.isdir(RECORDS):
        return None
    for tag in os.listdir(RECORDS):
        try:
            pid = int(Path(RECORDS, tag).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        if pid in owners:
            return tag
    return None


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


def _restore(tag: str) -> list[str]:
    """After the job: node 1's link up again if its namespace is still there, and any namespace of the job left
    (its launcher gone) deleted with what runs in it. What was done, for the report."""
    done = []
    left = [ns for ns in _namespaces() if ns.startswith(f"lnch{tag}")]
    if f"lnch{tag}n1" in left:
        _ip("-n", f"lnch{tag}n1", "link", "set", f"v{tag}1", "up")
        done.append(f"link v{tag}1 set up again in lnch{tag}n1")
    if left:
        time.sleep(2.0)  # a launcher still exiting deletes its own
        left = [ns for ns in _namespaces() if ns.startswith(f"lnch{tag}")]
    for ns in left:
        for pid in _ip("netns", "pids", ns).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (OSError, ValueError):
                pass
        _ip("netns", "del", ns)
        shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        done.append(f"namespace {ns} left by the job: deleted")
    if left and os.path.exists(os.path.join(RECORDS, tag)):
        os.remove(os.path.join(RECORDS, tag))
    return done


# ---------------------------------------------------------------------------------------------------- one job
