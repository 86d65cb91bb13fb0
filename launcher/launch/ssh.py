"""``+cluster=ssh``: one command on a head host (one of the hosts, or a login node that is none of them) runs a
job on several machines, one torch elastic agent per host started over ssh (``launch/node.py``, the agent
``+cluster=sim`` uses), rendezvous on the first host.

What each host needs: passwordless ssh from the head (``BatchMode``: a password or host-key prompt is an error,
never a hang), the same python path (``cluster.python``, default this interpreter's; ``cluster.setup`` lines run
first, e.g. ``source venv/bin/activate``), and the run dir on a shared file system.

Order of events:
1. Before anything starts, every host is checked in parallel (``launch/probe.py`` over ssh, within
   ``cluster.check_timeout_s``): ssh answers, python and the launcher import, the run dir is the head's and
   writable, ``cluster.master_addr`` resolves, enough GPUs; the master host picks (or checks) the port. Every
   failing host is named with its cause (exit 2).
2. One agent per host. Forwarded to it: ``LAUNCHER_*``, ``NCCL_*``, ``GLOO_*``, ``TORCH_*``, ``CUDA_VISIBLE_DEVICES``,
   ``PYTHONPATH``, ``OMP_NUM_THREADS`` and ``cluster.env``. Its output is streamed here, each line prefixed with
   its host.
3. The head controls each agent through its ssh stdin (``node.py --over-ssh``): Ctrl-C / SIGTERM here becomes the
   same signal there (the ranks agree on a step, checkpoint, exit 130 / 143); the end of input (the head killed,
   the connection dropped) stops the agent as SIGTERM would. An ssh session ending does not by itself end its
   remote processes: this is what does.
4. The first failure ends the job on every host (the others get ``head.AFTER_FAILURE_GRACE_S``, then are stopped),
   then one report names the root cause (``launcher.failures``); a host whose ssh connection dropped (exit 255:
   the host or its link went down) is named first. ``cluster.max_restarts``: the head checks the hosts again and
   restarts the job on all of them from the newest checkpoint (the agents themselves do not restart).
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from typing import IO, Any

from omegaconf import DictConfig

from ..config import ConfigError, JobConfig, SshClusterConfig
from ..env import DistEnv
from ..failures import STOP_CODES
from ..failures import report as report_failures
from ..membership import Membership
from .head import print_stopped, wait_nodes
from .hosts import SSH_LOST, parse_hostfile, ready_hosts, remote_shell, ssh_command
from .mode import BaseMode, LaunchPlan

HEARTBEAT_S = 5.0  # the head writes to every agent this often (cluster.heartbeat_timeout_s)


class SshMode(BaseMode):
    name = "ssh"

    def fill_defaults(self, cluster: DictConfig, env: DistEnv, gpus_visible: int) -> None:
        if cluster.hostfile and cluster.hosts:
            raise ConfigError("cluster.hosts and cluster.hostfile are both set; HINT: give the hosts one way")
        listed = parse_hostfile(cluster.hostfile) if cluster.hostfile else [(str(h), None) for h in cluster.hosts]
        if not listed:
            where = f"cluster.hostfile={cluster.hostfile!r} lists no host" if cluster.hostfile else "no hosts given"
            raise ConfigError(f"+cluster=ssh: {where}; HINT: cluster.hosts=[host1,host2] or cluster.hostfile=PATH")
        hosts = [host for host, _ in listed]
        if dups := sorted({h for h in hosts if hosts.count(h) > 1}):
            raise ConfigError(
                f"cluster.hosts lists {', '.join(dups)} more than once; HINT: one entry per machine, "
                "cluster.procs_per_node ranks run on each"
            )
        nodes = int(cluster.nodes) or len(hosts)
        if nodes > len(hosts):
            raise ConfigError(
                f"cluster.nodes={nodes} but only {len(hosts)} host(s) are listed; HINT: list more hosts or omit "
                "cluster.nodes (every listed host is used)"
            )
        used = listed[:nodes]
        slots = {host: n for host, n in used if n is not None}
        if cluster.procs_per_node is None and slots:
            if len(set(slots.values())) > 1 or len(slots) < nodes:
                given = ", ".join(f"{h}: {n if n is not None else 'none'}" for h, n in used)
                raise ConfigError(
                    f"the hostfile's slots differ ({given}); every node runs the same number of ranks; HINT: set "
                    f"cluster.procs_per_node={min(slots.values())}"
                )
            cluster.procs_per_node = next(iter(slots.values()))
        elif cluster.procs_per_node is not None:
            for host, n in slots.items():
                if cluster.procs_per_node > n:
                    raise ConfigError(
                        f"cluster.procs_per_node={cluster.procs_per_node} but the hostfile gives {host} slots={n}; "
                        f"HINT: cluster.procs_per_node={n}, or raise its slots"
                    )
        cluster.hosts, cluster.nodes = [h for h, _ in used], nodes
        cluster.master_addr = cluster.master_addr or used[0][0]
        cluster.python = cluster.python or sys.executable
        if shutil.which("ssh") is None:
            raise ConfigError("+cluster=ssh needs the ssh client here; HINT: apt-get install openssh-client")
        super().fill_defaults(cluster, env, gpus_visible)

    def rendezvous(self, job: JobConfig, env: DistEnv) -> str:
        c = job.cluster
        hosts = ", ".join(getattr(c, "hosts", []))
        port = c.master_port or "a free port chosen there"
        return f"store on {c.master_addr}:{port} (node 0's agent, the first host); agents started over ssh on {hosts}"

    def run(self, plan: LaunchPlan, job: JobConfig, env: DistEnv) -> int:
        if not isinstance(job.cluster, SshClusterConfig):
            raise TypeError(f"cluster.kind={job.cluster.kind!r}: the ssh launcher needs +cluster=ssh")
        return launch_ssh(job, job.cluster)


def launch_ssh(job: JobConfig, c: SshClusterConfig) -> int:
    members = Membership(job.run_dir, list(c.hosts), c.fewest_nodes, c.max_restarts)
    lost: list[str] = []
    code = 1
    while True:
        try:
            hosts, master, facts = ready_hosts(job, c, members, skip=lost)
        except ConfigError as exc:
            if members.attempt == 0:
                raise
            print(f"launcher: cannot restart the job: {exc}", file=sys.stderr)
            return code
        code, lost = run_agents(job, c, hosts, master, facts, uuid.uuid4().hex[:12], members.attempt)
        if code == 0 or code in STOP_CODES:
            return code
        why = "its ssh connection dropped while its ranks ran (the host or its link went down)"
        if not members.again(dict.fromkeys(lost, why), "host"):
            return code


class RemoteAgent:
    """One host's agent, through its ssh client: output streamed here with the host as prefix, stop requests
    written to its stdin (``node.py --over-ssh``)."""

    def __init__(self, host: str, cmd: list[str], lock: threading.Lock) -> None:
        self.host = host
        # its own session: a Ctrl-C in this terminal reaches the head only, which forwards it as a request
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
        )
        self.pumps = [
            threading.Thread(target=self._pump, args=(src, dst, lock), daemon=True)
            for src, dst in ((self.proc.stdout, sys.stdout), (self.proc.stderr, sys.stderr))
        ]
        for pump in self.pumps:
            pump.start()

    def _pump(self, src: IO[bytes] | None, dst: IO[str], lock: threading.Lock) -> None:
        assert src is not None
        for line in iter(src.readline, b""):
            with lock:
                dst.write(f"[{self.host}] {line.decode(errors='replace')}")
                dst.flush()

    def request(self, what: str) -> None:
        """``INT`` or ``TERM``: the agent stops its ranks as that signal would; ``PING``: a heartbeat."""
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(f"{what}\n".encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # it has ended already

    def finish(self) -> None:
        for pump in self.pumps:
            pump.join(timeout=5)
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()


@contextlib.contextmanager
def forwarding_stops(agents: list[RemoteAgent]) -> Iterator[list[int]]:
    """While the job runs, SIGINT / SIGTERM here are forwarded to every agent (once); yields the signals got."""
    got: list[int] = []

    def forward(signum: int, frame: Any) -> None:
        if not got:
            print(
                f"launcher: {signal.Signals(signum).name}: stopping the job on every host (the ranks checkpoint)",
                file=sys.stderr,
            )
            for agent in agents:
                agent.request("INT" if signum == signal.SIGINT else "TERM")
        got.append(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield got
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def heartbeats(agents: list[RemoteAgent]) -> Iterator[None]:
    """A line to every agent every ``HEARTBEAT_S``: an agent that hears nothing for ``cluster.heartbeat_timeout_s``
    stops its ranks (its host cannot reach us, so nobody else would stop them)."""
    done = threading.Event()

    def beat() -> None:
        while not done.wait(HEARTBEAT_S):
            for agent in agents:
                agent.request("PING")

    thread = threading.Thread(target=beat, name="heartbeats", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def run_agents(
    job: JobConfig, c: SshClusterConfig, hosts: list[str], master: str, facts: list[dict], run_id: str, attempt: int
) -> tuple[int, list[str]]:
    """One attempt on ``hosts`` (node 0 on the first, its store at ``master``): the exit code, and the hosts whose
    ssh connection dropped while their ranks ran."""
    endpoint = f"{master}:{facts[0]['port']}"
    lock = threading.Lock()
    agents: list[RemoteAgent] = []
    with forwarding_stops(agents) as stops:
        for node, host in enumerate(hosts):
            addr = master if node == 0 else (facts[node]["addr"] or host)
            argv = [c.python, "-u", "-m", "launcher.launch.node", job.run_dir, str(len(hosts)), str(node), endpoint]
            argv += [run_id, addr, "--over-ssh", "--restarts", str(attempt)]
            agents.append(RemoteAgent(host, ssh_command(c, host, remote_shell(c, argv)), lock))
        if stops:  # a stop signal while the agents were being started
            for agent in agents:
                agent.request("INT" if stops[0] == signal.SIGINT else "TERM")
        with heartbeats(agents):
            # a host lost: its peers' ranks hang in collectives with it and cannot checkpoint; end them at once
            def stop(proc: subprocess.Popen) -> None:
                lost = any(a.proc.returncode == SSH_LOST for a in agents)
                request_of(agents, proc, "ABORT" if lost else "TERM")

            codes, first = wait_nodes([a.proc for a in agents], stop=stop, at_once=(SSH_LOST,))
    for agent in agents:
        agent.finish()
    if stops:
        print_stopped(128 + stops[0], job.run_dir)
        return 128 + stops[0], []
    if first < 0:
        return 0, []
    lost = [host for host, code in zip(hosts, codes) if code == SSH_LOST]
    for node, host in enumerate(hosts):
        if host in lost:
            print(
                f"launcher: node {node} ({host}): the ssh connection dropped while its ranks ran (exit 255): "
                "the host or its link went down",
                file=sys.stderr,
            )
    if lost:  # the other ranks were ended by the launcher (ABORT): a report would blame them
        print(
            f"launcher: the ranks on the other hosts were ended (they waited for {', '.join(lost)} in collectives); "
            f"their logs: {job.run_dir}/logs",
            file=sys.stderr,
        )
    elif not report_failures(job.run_dir, run_id):
        print(
            f"launcher: node {first}'s agent on {hosts[first]} exited with code {codes[first]} (no rank recorded "
            f"a failure; see {job.run_dir}/logs)",
            file=sys.stderr,
        )
    return (codes[first] if codes[first] in STOP_CODES else 1), lost


def request_of(agents: list[RemoteAgent], proc: subprocess.Popen, what: str) -> None:
    next(a for a in agents if a.proc is proc).request(what)
