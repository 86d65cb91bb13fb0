"""``+cluster=sim``: several virtual nodes on this host, one node process (``launch/nodes/process.py``, running torch's
elastic agent) per node, started and watched by this head (``launch/head.py``).

Each agent joins one c10d rendezvous, so workers get real GROUP_RANK / LOCAL_WORLD_SIZE and the Topology is the
one a real cluster would give. With ``cluster.netns=true`` each agent runs in its own network namespace
(``ip netns exec``), gloo talks over the node's veth, and ``cluster.link_gbit`` shapes the links.
When a node fails, the others get ``head.AFTER_FAILURE_GRACE_S`` to stop on their own (their collectives fail fast
once a peer is gone), then are terminated; then one report for the whole job names the root cause across all
nodes (``launcher.report.failures``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass, field

from launcher.base.env import DistEnv
from launcher.base.files import remove_empty_dirs
from launcher.base.run_dir import RunDir
from launcher.base.threads import RANKS_ON_MACHINE
from launcher.config import JobConfig, SimClusterConfig
from launcher.config.rules import heals_in_place
from launcher.heal.head_side import KeeperClient, wait_healing
from launcher.heal.membership import Membership
from launcher.launch.mode import BaseMode, LaunchPlan
from launcher.launch.nodes.control import NodeArgs, forwarding_stops, print_stopped, wait_nodes
from launcher.launch.ports import free_port
from launcher.launch.sim.netns import SimNetwork, check_netns_possible
from launcher.report.failures import STOP_CODES, hang_ended
from launcher.report.failures import report as report_failures
from launcher.trust.secret import Secret

SIM_PORT = 29400  # inside fresh namespaces nothing else listens


class SimMode(BaseMode):
    name = "sim"

    def ranks_on_this_machine(self, job: JobConfig, env: DistEnv) -> int | None:
        return job.cluster.nodes * (job.cluster.procs_per_node or 1)  # every simulated node runs on this one

    def validate(self, job: JobConfig, env: DistEnv, gpus_visible: int) -> None:
        if isinstance(job.cluster, SimClusterConfig) and job.cluster.netns:
            check_netns_possible()

    def rendezvous(self, job: JobConfig, env: DistEnv) -> str:
        c = job.cluster
        where = "the keeper's store, off every node (healing)" if heals_in_place(job) else "c10d on node 0's agent"
        if not (isinstance(c, SimClusterConfig) and c.netns):
            return f"{where}; loopback"
        links = f", links shaped to {c.link_gbit} Gbit/s" if c.link_gbit else ", unshaped links"
        return f"{where}; network namespaces on {c.subnet}.0/24{links}"

    def run(self, plan: LaunchPlan, job: JobConfig, env: DistEnv) -> int:
        return launch_sim(plan, job)


def launch_sim(plan: LaunchPlan, job: JobConfig) -> int:
    c = job.cluster
    if not isinstance(c, SimClusterConfig):
        raise TypeError(f"cluster.kind={c.kind!r}: the sim launcher needs +cluster=sim")
    # cluster.min_nodes: the head restarts the job (on the survivors, or after failures), the agents do not
    head_max_restarts = c.max_restarts if c.may_shrink else 0
    members = Membership(job.run_dir, [f"node-{n}" for n in range(c.nodes)], plan.min_nodes, head_max_restarts)
    heals = bool(heals_in_place(job))
    secret = Secret.new()  # the job's: the keeper and the node processes get it in their environment
    current: list[Attempt] = []  # the attempt running now: a stop signal to the head goes to its node processes
    with (
        SimNetwork(c.nodes, c.netns, c.link_gbit, tuple(c.node_link_gbit), c.link_burst, c.subnet) as net,
        forwarding_stops(
            lambda word: current[-1].signal_all(word.signum) if current else None, "on every node"
        ) as stops,
    ):
        while True:
            launch_id = uuid.uuid4().hex[:12]
            nodes = [int(name.removeprefix("node-")) for name in members.live]
            attempt = Attempt(job, c, net, nodes, launch_id, members.attempt, c.may_shrink, secret)
            current.append(attempt)
            codes, first, stopped = attempt.heal(members) if heals else attempt.run()
            code = codes[first] if first >= 0 else 0
            if code == 0 or code in STOP_CODES:
                break
            lost = {  # a simulated machine lost: its node process ended by a signal nobody here sent
                f"node-{n}": why
                for position, (n, rc) in enumerate(zip(nodes, codes))
                if (why := lost_by_signal(rc)) and position not in stopped
            }
            if not members.again(lost, "node"):
                break
        remove_empty_dirs(RunDir(job.run_dir).elastic_logs)  # every node process has ended
        if code in STOP_CODES:
            code = 128 + stops[0] if stops else code  # the head's own signal (SIGHUP passed on as a SIGTERM)
            print_stopped(code, job)
        elif code and not report_failures(job.run_dir, launch_id):
            print(
                f"launcher: node {nodes[first]}'s agent exited with code {code} (no rank recorded a failure; "
                f"see {RunDir(job.run_dir).logs})",
                file=sys.stderr,
            )
    return code if code >= 0 else 1


def lost_by_signal(code: int) -> str:
    """Why a simulated node whose process ended with ``code`` is lost ("" when it is not: no signal)."""
    return f"its agent was killed by {signal.Signals(-code).name}" if code < 0 else ""


@dataclass
class Attempt:
    """One attempt: a node process for each of ``nodes`` (simulated machines, in their namespaces), the first as
    the master. ``head_restarts``: the head restarts the job (this is its attempt ``number``), the agents do not."""

    job: JobConfig
    c: SimClusterConfig
    net: SimNetwork
    nodes: list[int]
    launch_id: str
    number: int
    head_restarts: bool
    secret: Secret
    procs: list[subprocess.Popen] = field(default_factory=list)
    stopped: set[int] = field(default_factory=set)  # positions the head stopped itself (after another's failure)

    def start(self, endpoint: str, members: str = "") -> None:
        for position, node in enumerate(self.nodes):
            env = {**os.environ, "GLOO_SOCKET_IFNAME": self.net.ifname(node), **self.secret.environ()}
            env[RANKS_ON_MACHINE] = str(len(self.nodes) * (self.c.procs_per_node or 1))  # they share its cores
            args = NodeArgs(
                self.job.run_dir,
                len(self.nodes),
                position,
                endpoint,
                self.launch_id,
                self.net.addr(node),
                head_restarts=self.head_restarts,
                attempt=self.number,
                members=members,
            )
            self.procs.append(subprocess.Popen([*self.net.prefix(node), *args.argv(sys.executable)], env=env))

    def signal_all(self, signum: int) -> None:
        """A stop signal the head got, passed on to every node process still running (its agent stops the ranks
        with a checkpoint, as the signal would)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    def stop(self, proc: subprocess.Popen) -> None:
        self.stopped.add(self.procs.index(proc))
        proc.terminate()

    def run(self) -> tuple[list[int], int, set[int]]:
        """The nodes' agents meet at node 0's; returns ``wait_nodes``'s codes and failing position, and the
        positions the head stopped."""
        master = self.net.addr(self.nodes[0])
        port = self.c.master_port or (SIM_PORT if self.c.netns else free_port(master))
        self.start(f"{master}:{port}")
        hang = lambda: hang_ended(self.job.run_dir, self.launch_id, self.number)  # noqa: E731
        codes, first = wait_nodes(self.procs, self.stop, hang_ended=hang)
        return codes, first, self.stopped

    def heal(self, members: Membership) -> tuple[list[int], int, set[int]]:
        """Healing in place: the keeper on the bridge holds the store, a lost node's survivors go on."""
        names = [f"node-{n}" for n in self.nodes]
        addr = self.net.keeper_addr()
        port = SIM_PORT if self.c.netns else free_port(addr)
        lost_after = self.c.lost_after_s
        keeper = KeeperClient(
            self.net.keeper_prefix(), addr, port, self.number, members.min_nodes, lost_after, names, self.secret
        )
        try:
            self.start(keeper.endpoint, ",".join(names))
            hang = lambda: hang_ended(self.job.run_dir, self.launch_id, self.number)  # noqa: E731
            out = wait_healing(self.procs, names, keeper, members, self.stop, lost_by_signal, hang_ended=hang)
        finally:
            keeper.close()
        return out.codes, out.first, self.stopped | out.lost
