"""``+cluster=sim``: several virtual nodes on this host, one elastic agent process per node.

Each agent joins one c10d rendezvous, so workers get real GROUP_RANK / LOCAL_WORLD_SIZE and the Topology is the
one a real cluster would give. With ``cluster.netns=true`` each agent runs in its own network namespace
(``ip netns exec``), gloo talks over the node's veth, and ``cluster.link_gbit`` shapes the links.
When an agent fails, the others get ``agent.GRACE_S`` to stop on their own (their collectives fail fast once a peer
is gone), then are terminated; then one report for the whole job names the root cause across all nodes
(``launcher.failures``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

from ..config import JobConfig, SimClusterConfig
from ..env import DistEnv
from ..failures import STOP_CODES
from ..failures import report as report_failures
from .agent import print_stopped, wait_agents
from .mode import BaseMode
from .netns import SimNetwork, check_netns_possible
from .plan import LaunchPlan
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
    run_id = uuid.uuid4().hex[:12]
    with SimNetwork(c.nodes, c.netns, c.link_gbit, tuple(c.node_link_gbit), c.link_burst, c.subnet) as net:
        master = net.addr(0)
        port = c.master_port or (SIM_PORT if c.netns else free_port(master))
        agents = []
        for node in range(c.nodes):
            env = {**os.environ, "GLOO_SOCKET_IFNAME": net.ifname(node)}
            cmd = [
                *net.prefix(node),
                sys.executable,
                "-m",
                "launcher.launch.node",
                job.run_dir,
                str(c.nodes),
                str(node),
                f"{master}:{port}",
                run_id,
                net.addr(node),
            ]
            agents.append(subprocess.Popen(cmd, env=env))
        codes, first = wait_agents(agents)
        code = codes[first] if first >= 0 else 0
        if code in STOP_CODES:
            print_stopped(code, job.run_dir)
        elif code and not report_failures(job.run_dir, run_id):
            print(
                f"launcher: node {first}'s agent exited with code {code} (no rank recorded a failure; "
                f"see {job.run_dir}/logs)",
                file=sys.stderr,
            )
    return code if code >= 0 else 1
