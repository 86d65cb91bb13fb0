"""A ``+cluster=ssh`` job that heals in place (``config.rules.heals_in_place``): the keeper on this head, at the
address every host reaches it at (``keeper_addr``), one node process per host without agents' rendezvous; a lost
host's survivors go on (``launcher.heal.head_side.wait_healing``), and a lost host that passes the host checks again
gets a node process that joins the running job (``SshRejoin``)."""

from __future__ import annotations

import subprocess
import sys
import threading
from dataclasses import dataclass, field

from launcher.base.run_dir import RunDir
from launcher.config import ConfigError, JobConfig, SshClusterConfig
from launcher.heal.head_side import KeeperClient, wait_healing
from launcher.heal.membership import Membership
from launcher.launch.nodes.control import Control, NodeArgs, print_stopped
from launcher.launch.ports import free_port
from launcher.launch.ssh.clients import SshNode, forwarding_stops, heartbeats, saying_if_slow
from launcher.launch.ssh.hosts import SSH_LOST, check_hosts
from launcher.report.failures import STOP_CODES, hang_ended
from launcher.report.failures import report as report_failures
from launcher.trust.secret import Secret


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
    """``heal.head.Rejoin`` over ssh: a lost host answers again when it passes the host checks, reaching this head
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
        self.nodes.append(SshNode(self.c, name, args.argv(self.c.python), self.lock, self.secret))
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
    rendezvous; a lost host's survivors go on (``heal.head.wait_healing``). The exit code, and no host to skip."""
    addr = keeper_addr(hosts, facts)
    keeper = KeeperClient([], addr, free_port(addr), members.attempt, members.min_nodes, c.lost_after_s, hosts, secret)
    lock = threading.Lock()
    nodes: list[SshNode] = []
    heard = threading.Event()
    connecting = f"connecting to {', '.join(hosts)} over ssh and starting their node processes"
    try:
        with forwarding_stops(nodes) as stops, saying_if_slow(connecting, heard):
            for node, host in enumerate(hosts):
                args = NodeArgs(
                    job.run_dir, len(hosts), node, keeper.endpoint, launch_id, facts[node]["addr"] or host,
                    stdin_control=True, head_restarts=True, attempt=members.attempt, members=",".join(hosts),
                )  # fmt: skip
                nodes.append(SshNode(c, host, args.argv(c.python), lock, secret, heard))
            if stops:
                for ssh_node in nodes:
                    ssh_node.request(Control.stop_for(stops[0]))
            with heartbeats(nodes):
                stop = lambda proc: next(n for n in nodes if n.proc is proc).request(Control.TERM)  # noqa: E731
                why = lambda code: "its ssh connection dropped" if code == SSH_LOST else ""  # noqa: E731
                rejoin = SshRejoin(job, c, keeper, launch_id, members.attempt, nodes, lock, secret)
                hang = lambda: hang_ended(job.run_dir, launch_id, members.attempt)  # noqa: E731
                out = wait_healing([n.proc for n in nodes], hosts, keeper, members, stop, why, rejoin, hang)
    finally:
        keeper.close()
        for marker in RunDir(job.run_dir).host_checks():  # a rejoin check still in flight
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
            f"a failure; see {RunDir(job.run_dir).logs})",
            file=sys.stderr,
        )
    return (code if code in STOP_CODES else 1), []
