"""``+cluster=ssh``: one command on a head host (one of the hosts, or a login node that is none of them) runs a
job on several machines: one node process per host started over ssh (``launch/node.py``, the one ``+cluster=sim``
uses too), each running torch's elastic agent for that host's ranks; rendezvous on the first host.

Reading map, in the order things happen (from ``SshMode.run`` to a rank):
  1. ``hosts.resolve_hosts`` (from ``SshMode.fill_defaults``, before validation): the hosts, slots, master.
  2. ``launch_ssh`` (here): the attempts; ``membership.Membership`` decides, after a failed one, whether and on
     which hosts the job goes on (``cluster.max_restarts``, ``cluster.min_nodes``).
  3. ``hosts.ready_hosts`` -> ``hosts.check_hosts``: every host checked in parallel over ssh by ``host_check.py``.
  4. ``run_attempt`` (here; ``run_healing_attempt`` for a job that heals in place: ``launcher.heal.head``): per host
     an ``SshNode`` (``ssh_nodes.py``) (its ssh client: ``hosts.ssh_command`` +
     ``hosts.remote_shell`` running ``head.NodeArgs.argv``); stop signals forwarded and heartbeats written as
     ``head.Control`` words; ``head.wait_nodes`` waits, then ``failures.report`` names the root cause.
  5. on each host, ``node.py``: reads the ``Control`` words, relays output, runs ``agent.run_agent``
     (torch's elastic agent, static rendezvous), which starts ``python -m launcher.rank_entry RUN_DIR`` per rank.
  6. ``rank_entry.rank_main`` -> ``rank_work.run_rank_work`` -> the trainer (or the user's script).

What each host needs: passwordless ssh from the head (``BatchMode``: a password or host-key prompt is an error,
never a hang), the same python path (``cluster.python``, default this interpreter's; ``cluster.setup`` lines run
first, e.g. ``source venv/bin/activate``), and the run dir on a shared file system.

Order of events:
1. Before anything starts, every host is checked in parallel (``launch/host_check.py`` over ssh, within
   ``cluster.check_timeout_s``): ssh answers, python and the launcher import, the run dir is the head's and
   writable, ``cluster.master_addr`` resolves, enough GPUs; the master host picks (or checks) the port. Every
   failing host is named with its cause (exit 2).
2. One node process per host. Forwarded to it: ``LAUNCHER_*``, ``NCCL_*``, ``GLOO_*``, ``TORCH_*``,
   ``CUDA_VISIBLE_DEVICES``, ``PYTHONPATH``, ``OMP_NUM_THREADS`` and ``cluster.env``. Its output is streamed here,
   each line prefixed with its host.
3. The head controls each node through its ssh stdin (``node.py --stdin-control``, ``head.Control``): Ctrl-C /
   SIGTERM here becomes the same signal there (the ranks agree on a step, checkpoint, exit 130 / 143); the end of
   input (the head killed, the connection dropped) stops the node as SIGTERM would. An ssh session ending does not
   by itself end its remote processes: this is what does.
4. The first failure ends the job on every host (the others get ``head.AFTER_FAILURE_GRACE_S``, then are stopped),
   then one report names the root cause (``launcher.failures``). A host whose ssh connection dropped (exit 255:
   the host or its link went down) is named instead of a report: its peers, which wait for it in collectives,
   are ended at once (``Control.ABORT``) and not blamed. ``cluster.max_restarts``: the head checks the hosts again and
   restarts the job on all of them from the newest checkpoint (the agents themselves do not restart).
5. A job that heals in place (``run_healing_attempt``): a lost host's survivors go on; the head checks the lost hosts
   every ``cluster.rejoin_every_s`` (``SshRejoin``), and one that passes the checks again gets a node process whose
   ranks join the running job at a step boundary (``launcher.heal.head``, ``launcher.heal.rank``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import DictConfig

from ..config import ConfigError, JobConfig, SshClusterConfig
from ..config.rules import heals_in_place
from ..env import DistEnv
from ..failures import STOP_CODES, hang_ended
from ..failures import report as report_failures
from ..heal.head import KeeperClient, wait_healing
from ..membership import Membership
from ..secret import Secret
from .head import Control, NodeArgs, print_stopped, wait_nodes
from .host_check import token_path
from .hosts import SSH_LOST, check_hosts, ready_hosts, remote_shell, resolve_hosts, ssh_command
from .mode import BaseMode, LaunchPlan
from .ports import free_port
from .ssh_nodes import SshNode, forwarding_stops, heartbeats


class SshMode(BaseMode):
    name = "ssh"

    def fill_defaults(self, cluster: DictConfig, env: DistEnv, gpus_visible: int) -> None:
        resolve_hosts(cluster)
        cluster.python = cluster.python or sys.executable
        if shutil.which("ssh") is None:
            raise ConfigError("+cluster=ssh needs the ssh client here; HINT: apt-get install openssh-client")
        super().fill_defaults(cluster, env, gpus_visible)

    def rendezvous(self, job: JobConfig, env: DistEnv) -> str:
        c = job.cluster
        hosts = ", ".join(getattr(c, "hosts", []))
        port = c.master_port or "a free port chosen there"
        if heals_in_place(job):
            return f"the keeper's store on this head (healing); node processes started over ssh on {hosts}"
        return f"store on {c.master_addr}:{port} (node 0's agent, the first host); agents started over ssh on {hosts}"

    def run(self, plan: LaunchPlan, job: JobConfig, env: DistEnv) -> int:
        if not isinstance(job.cluster, SshClusterConfig):
            raise TypeError(f"cluster.kind={job.cluster.kind!r}: the ssh launcher needs +cluster=ssh")
        return launch_ssh(plan, job, job.cluster)


def launch_ssh(plan: LaunchPlan, job: JobConfig, c: SshClusterConfig) -> int:
    members = Membership(job.run_dir, list(c.hosts), plan.min_nodes, c.max_restarts)
    secret = Secret.new()  # the job's: each host gets it as the first line of its connection's stdin
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
        launch_id = uuid.uuid4().hex[:12]
        if heals_in_place(job):
            code, lost = run_healing_attempt(job, c, hosts, facts, launch_id, members, secret)
        else:
            code, lost = run_attempt(job, c, hosts, master, facts, launch_id, members.attempt, secret)
        if code == 0 or code in STOP_CODES:
            return code
        why = "its ssh connection dropped while its ranks ran (the host or its link went down)"
        if not members.again(dict.fromkeys(lost, why), "host"):
            return code


def run_attempt(  # noqa: PLR0913
    job: JobConfig,
    c: SshClusterConfig,
    hosts: list[str],
    master: str,
    facts: list[dict],
    launch_id: str,
    attempt: int,
    secret: Secret,
) -> tuple[int, list[str]]:
    """One attempt on ``hosts`` (node 0 on the first, its store at ``master``): the exit code, and the hosts whose
    ssh connection dropped while their ranks ran."""
    endpoint = f"{master}:{facts[0]['port']}"
    lock = threading.Lock()
    nodes: list[SshNode] = []
    with forwarding_stops(nodes) as stops:
        for node, host in enumerate(hosts):
            addr = master if node == 0 else (facts[node]["addr"] or host)
            args = NodeArgs(
                job.run_dir, len(hosts), node, endpoint, launch_id, addr,
                stdin_control=True, static_rendezvous=True, head_restarts=True, attempt=attempt,
            )  # fmt: skip
            nodes.append(SshNode(host, ssh_command(c, host, remote_shell(c, args.argv(c.python))), lock, secret))
        if stops:  # a stop signal while the nodes were being started
            for ssh_node in nodes:
                ssh_node.request(Control.stop_for(stops[0]))
        with heartbeats(nodes):
            # a host lost: its peers' ranks hang in collectives with it and cannot checkpoint; end them at once
            def stop(proc: subprocess.Popen) -> None:
                lost = any(n.proc.returncode == SSH_LOST for n in nodes)
                next(n for n in nodes if n.proc is proc).request(Control.ABORT if lost else Control.TERM)

            ended = lambda: hang_ended(job.run_dir, launch_id, attempt)  # noqa: E731
            codes, first = wait_nodes([n.proc for n in nodes], stop=stop, at_once=(SSH_LOST,), hang_ended=ended)
    for ssh_node in nodes:
        ssh_node.finish()
    if stops:
        print_stopped(128 + stops[0], job)
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
    elif not report_failures(job.run_dir, launch_id):
        print(
            f"launcher: node {first}'s agent on {hosts[first]} exited with code {codes[first]} (no rank recorded "
            f"a failure; see {job.run_dir}/logs)",
            file=sys.stderr,
        )
    return (codes[first] if codes[first] in STOP_CODES else 1), lost


def keeper_addr(hosts: list[str], facts: list[dict]) -> str:
    """The head's address as every host reaches it (``SSH_CONNECTION``'s client address there), where the keeper
    listens: one address, or an error naming what each host saw."""
    seen = {f.get("head", "") for f in facts}
    if len(seen) != 1 or "" in seen:
        saw = ", ".join(f"{host}: {f.get('head') or '?'}" for host, f in zip(hosts, facts))
        raise ConfigError(
            f"the hosts reach this head at different addresses ({saw}): healing in place needs one, where the job's "
            "store runs; HINT: reach the hosts through one network, or cluster.heal=false"
        )
    addr = seen.pop()
    slow = [f"{host} ({f['head_lookup_s']:.0f} s)" for host, f in zip(hosts, facts) if f.get("head_lookup_s", 0) > 1]
    if slow:
        print(
            f"launcher: warning: a reverse look-up of this head's address {addr} is slow on {', '.join(slow)}: each "
            "connection to the job's store here waits that long (c10d looks its peer up); HINT: name the address "
            "in those hosts' /etc/hosts",
            file=sys.stderr,
        )
    return addr


@dataclass
class SshRejoin:
    """``healing.Rejoin`` over ssh: a lost host answers again when it passes the host checks, reaching this head
    at the keeper's address; its node process then starts as the others did, to join."""

    job: JobConfig
    c: SshClusterConfig
    keeper: KeeperClient
    launch_id: str
    attempt: int
    nodes: list[SshNode]  # the attempt's (a joining one is added: stop signals and heartbeats reach it too)
    lock: threading.Lock
    secret: Secret
    facts: dict[str, dict] = field(default_factory=dict)  # the hosts that passed the checks, until started
    said: dict[str, str] = field(default_factory=dict)  # each host's last problem said (said again when it changes)

    @property
    def ranks(self) -> int:
        return int(self.c.procs_per_node or 1)

    @property
    def every_s(self) -> float:
        return self.c.rejoin_every_s

    def answering(self, names: list[str]) -> list[str]:
        addr = self.keeper.endpoint.rsplit(":", 1)[0]
        for name, (facts, problems) in zip(names, check_hosts(self.job, self.c, names, addr, picks_port=False)):
            if not problems and facts.get("head") != addr:
                problems = [f"it reaches this head at {facts.get('head')}, not at {addr} where the job's store is"]
            if not problems:
                self.facts[name] = facts
                self.said.pop(name, None)
            elif self.said.get(name) != problems[0]:
                self.said[name] = problems[0]
                every = f"{self.c.rejoin_every_s:g}"
                print(f"launcher: {name} cannot join yet: {problems[0]} (checked every {every} s)", file=sys.stderr)
        return [name for name in names if name in self.facts]

    def start(self, name: str, start: int, members: list[str]) -> subprocess.Popen:
        node = len(self.nodes)  # a place of its own until it joins (its ranks' log and failure files)
        args = NodeArgs(
            self.job.run_dir, node + 1, node, self.keeper.endpoint, self.launch_id,
            self.facts.pop(name)["addr"] or name, stdin_control=True, head_restarts=True, attempt=self.attempt,
            members=",".join(members), start=start,
        )  # fmt: skip
        self.nodes.append(
            SshNode(
                name, ssh_command(self.c, name, remote_shell(self.c, args.argv(self.c.python))), self.lock, self.secret
            )
        )
        return self.nodes[-1].proc


def run_healing_attempt(  # noqa: PLR0913
    job: JobConfig,
    c: SshClusterConfig,
    hosts: list[str],
    facts: list[dict],
    launch_id: str,
    members: Membership,
    secret: Secret,
) -> tuple[int, list[str]]:
    """One attempt of a job that heals in place: the keeper on this head, a node process per host without agents'
    rendezvous; a lost host's survivors go on (``healing.wait_healing``). The exit code, and no host to skip."""
    addr = keeper_addr(hosts, facts)
    keeper = KeeperClient([], addr, free_port(addr), members.attempt, members.min_nodes, c.lost_after_s, hosts, secret)
    lock = threading.Lock()
    nodes: list[SshNode] = []
    try:
        with forwarding_stops(nodes) as stops:
            for node, host in enumerate(hosts):
                args = NodeArgs(
                    job.run_dir, len(hosts), node, keeper.endpoint, launch_id, facts[node]["addr"] or host,
                    stdin_control=True, head_restarts=True, attempt=members.attempt, members=",".join(hosts),
                )  # fmt: skip
                nodes.append(SshNode(host, ssh_command(c, host, remote_shell(c, args.argv(c.python))), lock, secret))
            if stops:
                for ssh_node in nodes:
                    ssh_node.request(Control.stop_for(stops[0]))
            with heartbeats(nodes):
                stop = lambda proc: next(n for n in nodes if n.proc is proc).request(Control.TERM)  # noqa: E731
                why = lambda code: "its ssh connection dropped" if code == SSH_LOST else ""  # noqa: E731
                rejoin = SshRejoin(job, c, keeper, launch_id, members.attempt, nodes, lock, secret)
                out = wait_healing([n.proc for n in nodes], hosts, keeper, members, stop, why, rejoin)
    finally:
        keeper.close()
        for marker in Path(job.run_dir).glob(token_path(".", "*").name):  # a rejoin check still in flight
            marker.unlink(missing_ok=True)
    for ssh_node in nodes:
        ssh_node.finish()
    if stops:
        print_stopped(128 + stops[0], job)
        return 128 + stops[0], []
    if out.first < 0:
        return 0, []
    code = out.codes[out.first]
    if not out.keeper_ended and code not in STOP_CODES and not report_failures(job.run_dir, launch_id):
        print(
            f"launcher: node {out.first}'s process on {out.names[out.first]} exited with code {code} (no rank recorded "
            f"a failure; see {job.run_dir}/logs)",
            file=sys.stderr,
        )
    return (code if code in STOP_CODES else 1), []
