"""``+cluster=ssh``: one command on a head host (one of the hosts, or a login node that is none of them) runs a
job on several machines: one node process per host started over ssh (``nodes/process.py``, the one ``+cluster=sim``
uses too), each running torch's elastic agent for that host's ranks (rendezvous on the first host), or a job that
heals in place's ranks (the keeper, the job's store, on this head).

Reading map, in the order things happen (from ``SshMode.run`` to a rank):
  1. ``hosts.resolve_hosts`` (from ``SshMode.fill_defaults``, before validation): the hosts, slots, master.
  2. ``launch_ssh`` (here) -> ``nodes.attempts.run_on_machines``: the attempts, the one loop of every several-node
     head; ``restarts.Membership`` decides, after a failed one, whether and on which hosts the job goes on
     (``cluster.max_restarts``, ``cluster.min_nodes``). How a host is used: ``SshMachines`` (here).
  3. ``SshMachines.place`` -> ``hosts.ready_hosts`` -> ``hosts.check_hosts``: every host checked in parallel over
     ssh by ``host_check.py`` (its ``HostFacts``).
  4. ``attempts.run_attempt``: per host an ``SshNode`` (``clients.py``: its ssh client, ``clients.ssh_command`` +
     ``clients.remote_shell`` running ``base.node_args.NodeArgs.argv``); stop signals forwarded and heartbeats
     written as ``control.Control`` words; ``nodes.waiting.wait_for_nodes`` waits, then the job's report names the
     root cause.
  5. on each host, ``nodes/process.py``: reads the ``Control`` words, relays output, runs ``agent.run_agent``
     (torch's elastic agent, static rendezvous), which starts ``python -m launcher.rank.entry RUN_DIR`` per rank.
  6. ``rank.entry.rank_main`` -> ``rank.work.run_rank_work`` -> the trainer (or the user's script).

What each host needs: passwordless ssh from the head (``BatchMode``: a password or host-key prompt is an error,
never a hang), the same python path (``cluster.python``, default this interpreter's; ``cluster.setup`` lines run
first, e.g. ``source venv/bin/activate``), and the run dir on a shared file system.

Order of events:
1. Before anything starts, every host is checked in parallel (``launch/ssh/host_check.py`` over ssh, within
   ``cluster.check_timeout_s``): ssh answers, python and the launcher import, the run dir is the head's and
   writable, ``cluster.master_addr`` resolves, enough GPUs; the master host picks (or checks) the port. Every
   failing host is named with its cause (exit 2).
2. One node process per host. Forwarded to it: ``LAUNCHER_*``, ``NCCL_*``, ``GLOO_*``, ``TORCH_*``,
   ``CUDA_VISIBLE_DEVICES``, ``PYTHONPATH``, ``OMP_NUM_THREADS`` and ``cluster.env``. Its output is streamed here,
   each line prefixed with its host.
3. The head controls each node through its ssh stdin (``process.py --stdin-control``, ``control.Control``): Ctrl-C /
   SIGTERM here becomes the same word there (the ranks agree on a step, checkpoint, exit 130 / 143); the end of
   input (the head killed, the connection dropped) stops the node as SIGTERM would. An ssh session ending does not
   by itself end its remote processes: this is what does.
4. The first failure ends the job on every host (the others get ``AFTER_FAILURE_GRACE_S``, then are stopped),
   then one report names the root cause (``launcher.report.failures``). A host whose ssh connection dropped (exit 255:
   the host or its link went down) is named instead of a report: its peers, which wait for it in collectives,
   are ended at once (``Control.ABORT``) and not blamed. ``cluster.max_restarts``: the head checks the hosts again and
   restarts the job on all of them from the newest checkpoint (the agents themselves do not restart).
5. A job that heals in place: the keeper on this head, at the address every host reaches it at (``keeper_addr``);
   a lost host's survivors go on; the head checks the lost hosts every ``cluster.rejoin_every_s``
   (``SshMachines.answering``), and one that passes the checks again gets a node process whose ranks join the
   running job at a step boundary (``launcher.launch.nodes.waiting``, ``launcher.heal.rank_side``).
"""

from __future__ import annotations

import shutil
import sys
import threading
from dataclasses import dataclass, field, replace

from omegaconf import DictConfig

from launcher.base.env import DistEnv
from launcher.base.node_args import NodeArgs
from launcher.config import ConfigError, JobConfig, SshClusterConfig
from launcher.config.rules import heals_in_place
from launcher.launch.mode import BaseMode, LaunchPlan
from launcher.launch.nodes.attempts import KeeperAt, Placement, run_on_machines
from launcher.launch.nodes.control import Node
from launcher.launch.nodes.restarts import Membership
from launcher.launch.ports import free_port
from launcher.launch.ssh.clients import SshNode, say_if_slow, saying_if_slow
from launcher.launch.ssh.host_check import HostFacts
from launcher.launch.ssh.hosts import SSH_LOST, check_hosts, open_files_for, ready_hosts, resolve_hosts
from launcher.trust.secret import Secret


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
    open_files_for(len(c.hosts))
    members = Membership(job.run, list(c.hosts), plan.min_nodes, c.max_restarts)
    secret = Secret.new()  # the job's: each host gets it as the first line of its connection's stdin
    try:
        return run_on_machines(SshMachines(job, c, secret, bool(heals_in_place(job))), job, members, secret)
    finally:
        for marker in job.run.host_checks():  # a rejoin check still in flight
            marker.unlink(missing_ok=True)


def keeper_addr(hosts: list[str], facts: list[HostFacts]) -> str:
    """The head's address as every host reaches it (``SSH_CONNECTION``'s client address there), where the keeper
    listens: one address, or an error naming what each host saw."""
    seen = {f.head for f in facts}
    if len(seen) != 1 or "" in seen:
        saw = ", ".join(f"{host}: {f.head or '?'}" for host, f in zip(hosts, facts))
        raise ConfigError(
            f"the hosts reach this head at different addresses ({saw}): healing in place needs one, where the job's "
            "store runs; HINT: reach the hosts through one network, or cluster.heal=false"
        )
    addr = seen.pop()
    slow = [f"{host} ({f.head_lookup_s:.0f} s)" for host, f in zip(hosts, facts) if f.head_lookup_s > 1]
    if slow:
        print(
            f"launcher: warning: a reverse look-up of this head's address {addr} is slow on {', '.join(slow)}: each "
            "connection to the job's store here waits that long (c10d looks its peer up); HINT: name the address "
            "in those hosts' /etc/hosts",
            file=sys.stderr,
        )
    return addr


@dataclass
class SshMachines:
    """``attempts.Machines`` over ssh: each attempt's hosts pass the host checks first (a restart's may be fewer,
    or more: ``hosts.ready_hosts``); a node process is an ssh client (``SshNode``); a host is lost when its ssh
    connection drops; healing in place, a lost host answers again when it passes the checks again, reaching this
    head at the keeper's address."""

    job: JobConfig
    c: SshClusterConfig
    secret: Secret
    heals: bool
    where: str = "host"
    facts: dict[str, HostFacts] = field(default_factory=dict)  # each host's, from its last check
    master: str = ""  # node 0's address (its agent hosts the rendezvous store)
    keeper: str = ""  # healing: the keeper's address (the head's, as every host reaches it)
    heard: threading.Event = field(default_factory=threading.Event)  # a first line from the attempt's nodes
    lock: threading.Lock = field(default_factory=threading.Lock)  # one line of relayed output at a time
    said: dict[str, str] = field(default_factory=dict)  # each lost host's last problem said (again when it changes)

    def place(self, members: Membership, lost: list[str]) -> Placement:
        checking = (
            f"checking {len(members.all)} host(s) over ssh (cluster.check_timeout_s={self.c.check_timeout_s:.0f})"
        )
        with saying_if_slow(checking):
            hosts, self.master, facts = ready_hosts(self.job, self.c, members, skip=lost)
        self.facts.update(zip(hosts, facts))
        self.heard = threading.Event()
        say_if_slow(f"connecting to {', '.join(hosts)} over ssh and starting their node processes", self.heard)
        if not self.heals:
            return Placement(hosts, store=f"{self.master}:{facts[0].port}")
        self.keeper = keeper_addr(hosts, facts)
        return Placement(
            hosts, keeper=KeeperAt([], self.keeper, free_port(self.keeper)), rejoin_every_s=self.c.rejoin_every_s
        )

    def start(self, args: NodeArgs, name: str) -> Node:
        plain = not args.members
        addr = self.master if plain and args.node == 0 else (self.facts[name].addr or name)
        args = replace(args, addr=addr, stdin_control=True, static_rendezvous=plain, head_restarts=True)
        heard = self.heard if not args.start else None  # a joiner: not the attempt's start-up
        return SshNode(self.c, name, args.argv(self.c.python), self.lock, self.secret, heard)

    def lost(self, code: int) -> str:
        if code != SSH_LOST:
            return ""
        if self.heals:
            return "its ssh connection dropped"
        return "its ssh connection dropped while its ranks ran (the host or its link went down)"

    def answering(self, names: list[str]) -> list[str]:
        answer = []
        for name, (facts, problems) in zip(names, check_hosts(self.job, self.c, names, self.keeper, picks_port=False)):
            if facts and not problems and facts.head != self.keeper:
                problems = [f"it reaches this head at {facts.head}, not at {self.keeper} where the job's store is"]
            if facts and not problems:
                self.facts[name] = facts
                self.said.pop(name, None)
                answer.append(name)
            elif self.said.get(name) != problems[0]:
                self.said[name] = problems[0]
                every = f"{self.c.rejoin_every_s:g}"
                print(f"launcher: {name} cannot join yet: {problems[0]} (checked every {every} s)", file=sys.stderr)
        return answer
