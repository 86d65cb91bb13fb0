"""``+cluster=sim``: several virtual nodes on this host, one node process (``launch/node.py``, running torch's
elastic agent) per node, started and watched by this head (``launch/head.py``).

Each agent joins one c10d rendezvous, so workers get real GROUP_RANK / LOCAL_WORLD_SIZE and the Topology is the
one a real cluster would give. With ``cluster.netns=true`` each agent runs in its own network namespace
(``ip netns exec``), gloo talks over the node's veth, and ``cluster.link_gbit`` shapes the links.
When a node fails, the others get ``head.AFTER_FAILURE_GRACE_S`` to stop on their own (their collectives fail fast
once a peer is gone), then are terminated; then one report for the whole job names the root cause across all
nodes (``launcher.failures``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

from ..config import JobConfig, SimClusterConfig
from ..env import DistEnv
from ..failures import STOP_CODES, hang_ended
from ..failures import report as report_failures
from ..membership import Membership
from .head import NodeArgs, print_stopped, wait_nodes
from .mode import BaseMode, LaunchPlan
from .netns import SimNetwork, check_netns_possible
from .ports import free_port

SIM_PORT = 29400  # inside fresh namespaces nothing else listens


class SimMode(BaseMode):
    name = "sim"

    def validate(self, job: JobConfig, env: DistEnv, gpus_visible: int) -> None:
        if isinstance(job.cluster, SimClusterConfig) and job.cluster.netns:
            check_netns_possible()

    def rendezvous(self, job: JobConfig, env: DistEnv) -> str:
        c = job.cluster
        if not (isinstance(c, SimClusterConfig) and c.netns):
            return "c10d on node 0's agent; loopback"
        links = f", links shaped to {c.link_gbit} Gbit/s" if c.link_gbit else ", unshaped links"
        return f"c10d on node 0's agent; network namespaces on {c.subnet}.0/24{links}"

    def run(self, plan: LaunchPlan, job: JobConfig, env: DistEnv) -> int:
        return launch_sim(plan, job)


def launch_sim(plan: LaunchPlan, job: JobConfig) -> int:
    c = job.cluster
    if not isinstance(c, SimClusterConfig):
        raise TypeError(f"cluster.kind={c.kind!r}: the sim launcher needs +cluster=sim")
    # cluster.min_nodes: the head restarts the job (on the survivors, or after failures), the agents do not
    head_max_restarts = c.max_restarts if c.may_shrink else 0
    members = Membership(job.run_dir, [f"node-{n}" for n in range(c.nodes)], plan.min_nodes, head_max_restarts)
    with SimNetwork(c.nodes, c.netns, c.link_gbit, tuple(c.node_link_gbit), c.link_burst, c.subnet) as net:
        while True:
            launch_id = uuid.uuid4().hex[:12]
            nodes = [int(name.removeprefix("node-")) for name in members.live]
            codes, first, stopped = run_attempt(job, c, net, nodes, launch_id, members.attempt, c.may_shrink)
            code = codes[first] if first >= 0 else 0
            if code == 0 or code in STOP_CODES:
                break
            lost = {  # a simulated machine lost: its node process ended by a signal nobody here sent
                f"node-{n}": f"its agent was killed by {signal.Signals(-rc).name}"
                for position, (n, rc) in enumerate(zip(nodes, codes))
                if rc < 0 and position not in stopped
            }
            if not members.again(lost, "node"):
                break
        if code in STOP_CODES:
            print_stopped(code, job)
        elif code and not report_failures(job.run_dir, launch_id):
            print(
                f"launcher: node {nodes[first]}'s agent exited with code {code} (no rank recorded a failure; "
                f"see {job.run_dir}/logs)",
                file=sys.stderr,
            )
    return code if code >= 0 else 1


def run_attempt(
    job: JobConfig,
    c: SimClusterConfig,
    net: SimNetwork,
    nodes: list[int],
    launch_id: str,
    attempt: int,
    head_restarts: bool,
) -> tuple[list[int], int, set[int]]:
    """One attempt: a node process for each of ``nodes`` (simulated machines, in their namespaces), the first as
    the master; returns ``wait_nodes``'s codes and failing position, and the positions the head stopped itself
    (after another's failure). ``head_restarts``: the head restarts the job (this is its attempt ``attempt``) and
    the agents do not."""
    master = net.addr(nodes[0])
    port = c.master_port or (SIM_PORT if c.netns else free_port(master))
    procs = []
    for position, node in enumerate(nodes):
        env = {**os.environ, "GLOO_SOCKET_IFNAME": net.ifname(node)}
        args = NodeArgs(
            job.run_dir,
            len(nodes),
            position,
            f"{master}:{port}",
            launch_id,
            net.addr(node),
            head_restarts=head_restarts,
            attempt=attempt,
        )
        procs.append(subprocess.Popen([*net.prefix(node), *args.argv(sys.executable)], env=env))
    stopped: set[int] = set()

    def stop(proc: subprocess.Popen) -> None:
        stopped.add(procs.index(proc))
        proc.terminate()

    codes, first = wait_nodes(procs, stop, hang_ended=lambda: hang_ended(job.run_dir, launch_id, attempt))
    return codes, first, stopped
