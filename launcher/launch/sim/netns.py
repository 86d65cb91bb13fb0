"""Simulated nodes' network: loopback, or one network namespace per node joined by a bridge, each node's link
optionally shaped by tbf (the recipe in ../shared/recipes/netns.md). The addresses exist only inside namespaces
this module creates; everything it creates is deleted on exit, whatever happened inside (a SIGTERM too, where
nothing else handles it: it then raises SystemExit(143) so the exit path runs). SIGKILL leaves them behind: each
network records its owner under RECORDS, and the next one started on the machine deletes what a dead owner left."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass, field

from launcher.config import ConfigError


def check_netns_possible() -> None:
    """Clear errors before anything starts."""
    if os.geteuid() != 0:
        raise ConfigError(
            "cluster.netns=true needs root to create network namespaces; HINT: run as root, or drop "
            "cluster.netns (virtual nodes then share loopback)"
        )
    if shutil.which("ip") is None or shutil.which("tc") is None:
        raise ConfigError("cluster.netns=true needs iproute2 (ip, tc); HINT: apt-get install iproute2")


RECORDS = "/run/launcher-netns"  # one file per live network, named by its tag: "OWNER_PID START_TIME" (tmpfs)


def _start_time(pid: int) -> str | None:
    """A process's start time in clock ticks since boot (/proc/PID/stat field 22): with the pid, it names one
    process even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def sweep_stale_namespaces() -> list[str]:
    """Delete what networks whose owner ended without its exit path (SIGKILL) left behind: their namespaces,
    the processes still running in them (ranks of the dead job) and their /etc/netns entries. Returns a line
    per dead owner, naming it and what was deleted."""
    if not os.path.isdir(RECORDS):
        return []
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    names = [line.split()[0] for line in listed if line.strip()]
    swept = []
    for tag in sorted(os.listdir(RECORDS)):
        record = os.path.join(RECORDS, tag)
        try:
            with open(record) as f:
                pid, start = f.read().split()
        except (OSError, ValueError):
            continue
        if _start_time(int(pid)) == start:
            continue  # its owner still runs
        mine = [ns for ns in names if ns.startswith(f"lnch{tag}")]
        for ns in mine:
            held = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for held_pid in held:
                try:
                    os.kill(int(held_pid), signal.SIGKILL)
                except (OSError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        if mine:
            swept.append(f"pid {pid} (gone): {', '.join(mine)}")
        os.remove(record)
    return swept


def _run(*cmd: str) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {result.stderr.strip()}")


@dataclass
class SimNetwork:
    nodes: int
    netns: bool = False
    link_gbit: float | None = None
    node_link_gbit: tuple[float, ...] = ()  # per node, overrides link_gbit
    burst: str = "2mbit"
    subnet: str = "10.99.0"
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    _created: list[str] = field(default_factory=list)
    _etc: list[str] = field(default_factory=list)
    _sigterm: object = None  # the handler to put back on exit, when this network installed its own
    _record: str = ""  # this network's file under RECORDS

    def ns(self, node: int) -> str:
        return f"lnch{self.tag}n{node}"

    def ifname(self, node: int) -> str:
        """The interface a node's ranks talk on (GLOO_SOCKET_IFNAME)."""
        return f"v{self.tag}{node}" if self.netns else "lo"

    def addr(self, node: int) -> str:
        return f"{self.subnet}.{node + 1}" if self.netns else "127.0.0.1"

    def prefix(self, node: int) -> list[str]:
        """Command prefix that runs a program on ``node``."""
        return ["ip", "netns", "exec", self.ns(node)] if self.netns else []

    def keeper_addr(self) -> str:
        """Where the nodes reach a process on no node (healing's keeper): the bridge, or loopback."""
        return f"{self.subnet}.254" if self.netns else "127.0.0.1"

    def keeper_prefix(self) -> list[str]:
        """Command prefix that runs a program on the bridge (``keeper_addr``), off every node."""
        return ["ip", "netns", "exec", f"lnch{self.tag}br"] if self.netns else []

    def tx_bytes(self, node: int) -> int:
        """Bytes ``node`` sent on its link (veth counter) since it was created."""
        path = f"/sys/class/net/{self.ifname(node)}/statistics/tx_bytes"
        out = subprocess.run([*self.prefix(node), "cat", path], capture_output=True, text=True, check=True)
        return int(out.stdout)

    def __enter__(self) -> SimNetwork:
        if not self.netns:
            return self
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            self._sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        for line in sweep_stale_namespaces():
            print(f"launcher: deleted the simulated nodes' namespaces a killed program left, {line}", file=sys.stderr)
        try:
            self._write_record()
            bridge = f"lnch{self.tag}br"
            _run("ip", "netns", "add", bridge)
            self._created.append(bridge)
            _run("ip", "-n", bridge, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", bridge, "link", "set", "br0", "up")
            _run("ip", "-n", bridge, "addr", "add", f"{self.keeper_addr()}/24", "dev", "br0")
            _run("ip", "-n", bridge, "link", "set", "lo", "up")
            for node in range(self.nodes):
                ns, dev, peer = self.ns(node), self.ifname(node), f"p{self.tag}{node}"
                _run("ip", "netns", "add", ns)
                self._created.append(ns)
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                _run("ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", peer, "netns", bridge)
                _run("ip", "-n", bridge, "link", "set", peer, "master", "br0")
                _run("ip", "-n", bridge, "link", "set", peer, "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.addr(node)}/24", "dev", dev)
                _run("ip", "-n", ns, "link", "set", dev, "up")
                self._hosts_file(ns, node)
                rate = self.node_link_gbit[node] if self.node_link_gbit else self.link_gbit
                if rate:
                    _run(
                        "ip",
                        "netns",
                        "exec",
                        ns,
                        "tc",
                        "qdisc",
                        "add",
                        "dev",
                        dev,
                        "root",
                        "tbf",
                        "rate",
                        f"{rate}gbit",
                        "burst",
                        self.burst,
                        "latency",
                        "50ms",
                    )
        except BaseException:
            self.__exit__()
            raise
        return self

    def _write_record(self) -> None:
        self._record = os.path.join(RECORDS, self.tag)
        for attempt in (1, 2):  # another network's exit may remove the emptied directory in between
            os.makedirs(RECORDS, exist_ok=True)
            try:
                with open(self._record, "w") as f:
                    f.write(f"{os.getpid()} {_start_time(os.getpid())}\n")
                return
            except FileNotFoundError:
                if attempt == 2:
                    raise

    def _hosts_file(self, ns: str, node: int) -> None:
        """``ip netns exec`` shows /etc/netns/NS/hosts as /etc/hosts: name the node addresses, so reverse
        look-ups of peers succeed instead of c10d warning "hostname ... cannot be retrieved" (a namespace has no
        DNS), and this machine's own name as the node's address."""
        directory = f"/etc/netns/{ns}"
        os.makedirs(directory, exist_ok=True)
        self._etc.append(directory)
        # IPv4 and the IPv4-mapped IPv6 form a dual-stack TCPStore server sees its peers as
        names = "".join(f"{a}{self.addr(n)} {self.ns(n)}\n" for n in range(self.nodes) for a in ("", "::ffff:"))
        names += "".join(f"{a}{self.keeper_addr()} keeper\n" for a in ("", "::ffff:"))  # healing's store
        with open(f"{directory}/hosts", "w") as f:
            f.write(f"127.0.0.1 localhost\n::1 localhost\n{names}{self.addr(node)} {socket.gethostname()}\n")

    def __exit__(self, *exc: object) -> None:
        while self._created:  # deleting a namespace removes its end of each veth pair too
            subprocess.run(["ip", "netns", "del", self._created.pop()], capture_output=True)
        while self._etc:
            shutil.rmtree(self._etc.pop(), ignore_errors=True)
        if self._record:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._record)
            with contextlib.suppress(OSError):  # the last network on the machine leaves nothing
                os.rmdir(RECORDS)
            self._record = ""
        if self._sigterm is not None:
            signal.signal(signal.SIGTERM, self._sigterm)  # type: ignore[arg-type]
            self._sigterm = None


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
