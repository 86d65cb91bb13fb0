"""The test beds' names and helpers (tests/beds/: they need root): the ssh machines (network namespaces with their
own address, host name and sshd, scripts/ssh-hosts/start.sh) and the simulated nodes' network namespaces. The
fixtures that start and check them are in tests/beds/conftest.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

# ------------------------------------------------------------------------------------------------ the ssh machines
PREFIX, SUBNET, BRIDGE = "lnchvm", "10.97.0", "lnchtestbr0"
HOSTS = [f"{PREFIX}1", f"{PREFIX}2"]  # the jobs' machines; a third one joins the doctor's
ALL = [*HOSTS, f"{PREFIX}3"]
LEFT_S = 15.0  # the bound: nothing of a job left on any machine this long after it ended

needs_ssh_machines = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="the ssh test machines need root and iproute2"
)


def job_processes(state: Path, sessions: bool = True) -> list[str]:
    """Every process in the machines except their sshd listeners (and sshd's per-connection processes unless
    ``sessions``)."""
    sshd = {(state / f"{h}.sshd.pid").read_text().strip() for h in ALL}
    pids = []
    for host in ALL:
        out = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True).stdout.split()
        pids += [p for p in out if p not in sshd]
    found = [f"{p}: {command_line(p)}" for p in pids if Path(f"/proc/{p}").exists()]
    return [f for f in found if sessions or not f.split(": ", 1)[1].startswith("sshd:")]


def command_line(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
    except OSError:
        return "(ended)"


def wait_nothing_left(state: Path, within_s: float = LEFT_S, sessions: bool = True) -> None:
    deadline = time.monotonic() + within_s
    while (left := job_processes(state, sessions)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"still running {within_s:.0f} s after the job ended:\n" + "\n".join(left)


# ------------------------------------------------------------------------------------------------ network namespaces
needs_netns = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="network namespaces need root and iproute2 (ip, tc)",
)


def namespaces() -> set[str]:
    """The simulated nodes' network namespaces (``lnch*``) on this host; not the ssh machines' (``ALL``): another
    worker's module starts and stops those meanwhile, and its fixture checks what they leave."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith("lnch") and line.split()[0] not in ALL}
