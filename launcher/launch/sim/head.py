"""``+cluster=sim``: several virtual nodes on this host, one node process (``launch/nodes/process.py``, running torch's
elastic agent, or a healing job's ranks) per node, started and watched by the one attempt loop of the several-node
heads (``launch/nodes/attempts.py``); this module says how a simulated machine is used (``SimMachines``).

Each agent joins one c10d rendezvous, so workers get real GROUP_RANK / LOCAL_WORLD_SIZE and the Topology is the
one a real cluster would give. With ``cluster.netns=true`` each agent runs in its own network namespace
(``ip netns exec``), gloo talks over the node's veth, and ``cluster.link_gbit`` shapes the links; a job that heals
in place has its keeper on the bridge between them, off every node. A node is lost when its node process ends by a
signal nobody here sent (``lost_by_signal``); ``cluster.min_nodes``: the head, not the agents, restarts the job.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, replace

from launcher.base.env import DistEnv
from launcher.base.files import remove_empty_dirs
from launcher.base.node_args import NodeArgs
from launcher.base.threads import RANKS_ON_MACHINE
from launcher.config import JobConfig, SimClusterConfig
from launcher.config.rules import heals_in_place
from launcher.launch.mode import BaseMode, LaunchPlan
from launcher.launch.nodes.attempts import KeeperAt, Placement, run_on_machines
from launcher.launch.nodes.control import Node, ProcessNode
from launcher.launch.nodes.restarts import Membership
from launcher.launch.ports import free_port
from launcher.launch.sim.netns import SimNetwork, check_netns_possible
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
    members = Membership(job.run, [f"node-{n}" for n in range(c.nodes)], plan.min_nodes, head_max_restarts)
    secret = Secret.new()  # the job's: the keeper and the node processes get it in their environment
    with SimNetwork(c.nodes, c.netns, c.link_gbit, tuple(c.node_link_gbit), c.link_burst, c.subnet) as net:
        code = run_on_machines(SimMachines(job, c, net, secret, bool(heals_in_place(job))), job, members, secret)
        remove_empty_dirs(job.run.elastic_logs)  # every node process has ended
    return code


def lost_by_signal(code: int) -> str:
    """Why a simulated node whose process ended with ``code`` is lost ("" when it is not: no signal)."""
    return f"its agent was killed by {signal.Signals(-code).name}" if code < 0 else ""


def number(name: str) -> int:
    """A simulated node's number (``node-K``: the namespace and address it has)."""
    return int(name.removeprefix("node-"))


@dataclass
class SimMachines:
    """``attempts.Machines`` for simulated nodes: node processes of this host (in their namespaces), the first
    node's agent hosting the rendezvous, or the keeper on the bridge when the job heals in place (no lost node
    answers again: it stays lost)."""

    job: JobConfig
    c: SimClusterConfig
    net: SimNetwork
    secret: Secret
    heals: bool
    where: str = "node"

    def place(self, members: Membership, lost: list[str]) -> Placement:
        names = members.live
        if self.heals:
            addr = self.net.keeper_addr()
            return Placement(names, keeper=KeeperAt(self.net.keeper_prefix(), addr, self.port(addr)))
        master = self.net.addr(number(names[0]))
        return Placement(names, store=f"{master}:{self.c.master_port or self.port(master)}")

    def port(self, addr: str) -> int:
        return SIM_PORT if self.c.netns else free_port(addr)  # a fresh namespace has nothing listening

    def start(self, args: NodeArgs, name: str) -> Node:
        node = number(name)
        env = {**os.environ, "GLOO_SOCKET_IFNAME": self.net.ifname(node), **self.secret.environ()}
        env[RANKS_ON_MACHINE] = str(args.nodes * (self.c.procs_per_node or 1))  # they share its cores
        args = replace(args, addr=self.net.addr(node), head_restarts=self.c.may_shrink)
        # its own session: a Ctrl-C in this terminal reaches the head only, which passes it on once (a second one
        # to a node's agent would end its ranks' grace at once)
        argv = [*self.net.prefix(node), *args.argv(sys.executable)]
        return ProcessNode(subprocess.Popen(argv, env=env, start_new_session=True))

    def lost(self, code: int) -> str:
        return lost_by_signal(code)

    def answering(self, names: list[str]) -> list[str]:
        return []
