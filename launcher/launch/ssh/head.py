"""``+cluster=ssh``: one command on a head host (one of the hosts, or a login node that is none of them) runs a
job on several machines: one node process per host started over ssh (``nodes/process.py``, the one ``+cluster=sim``
uses too), each running torch's elastic agent for that host's ranks; rendezvous on the first host.

Reading map, in the order things happen (from ``SshMode.run`` to a rank):
  1. ``hosts.resolve_hosts`` (from ``SshMode.fill_defaults``, before validation): the hosts, slots, master.
  2. ``launch_ssh`` (here): the attempts; ``membership.Membership`` decides, after a failed one, whether and on
     which hosts the job goes on (``cluster.max_restarts``, ``cluster.min_nodes``).
  3. ``hosts.ready_hosts`` -> ``hosts.check_hosts``: every host checked in parallel over ssh by ``host_check.py``.
  4. ``run_attempt`` (here; ``run_healing_attempt`` for a job that heals in place: ``heal.head_side``): per host
     an ``SshNode`` (``clients.py``) (its ssh client: ``hosts.ssh_command`` +
     ``hosts.remote_shell`` running ``head.NodeArgs.argv``); stop signals forwarded and heartbeats written as
     ``head.Control`` words; ``head.wait_nodes`` waits, then ``failures.report`` names the root cause.
  5. on each host, ``node.py``: reads the ``Control`` words, relays output, runs ``agent.run_agent``
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
3. The head controls each node through its ssh stdin (``node.py --stdin-control``, ``head.Control``): Ctrl-C /
   SIGTERM here becomes the same signal there (the ranks agree on a step, checkpoint, exit 130 / 143); the end of
   input (the head killed, the connection dropped) stops the node as SIGTERM would. An ssh session ending does not
   by itself end its remote processes: this is what does.
4. The first failure ends the job on every host (the others get ``head.AFTER_FAILURE_GRACE_S``, then are stopped),
   then one report names the root cause (``launcher.report.failures``). A host whose ssh connection dropped (exit 255:
   the host or its link went down) is named instead of a report: its peers, which wait for it in collectives,
   are ended at once (``Control.ABORT``) and not blamed. ``cluster.max_restarts``: the head checks the hosts again and
   restarts the job on all of them from the newest checkpoint (the agents themselves do not restart).
5. A job that heals in place (``run_healing_attempt``): a lost host's survivors go on; the head checks the lost hosts
   every ``cluster.rejoin_every_s`` (``SshRejoin``), and one that passes the checks again gets a node process whose
   ranks join the running job at a step boundary (``launcher.heal.head_side``, ``launcher.heal.rank_side``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import uuid

from omegaconf import DictConfig

from launcher.base.env import DistEnv
from launcher.base.run_dir import RunDir
from launcher.config import ConfigError, JobConfig, SshClusterConfig
from launcher.config.rules import heals_in_place
from launcher.heal.membership import Membership
from launcher.launch.mode import BaseMode, LaunchPlan
from launcher.launch.nodes.control import Control, NodeArgs, print_stopped, wait_nodes
from launcher.launch.ssh.clients import SshNode, forwarding_stops, heartbeats, saying_if_slow
from launcher.launch.ssh.healing import run_healing_attempt
from launcher.launch.ssh.hosts import SSH_LOST, open_files_for, ready_hosts, resolve_hosts
from launcher.report.failures import STOP_CODES, hang_ended
from launcher.report.failures import report as report_failures
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
    members = Membership(job.run_dir, list(c.hosts), plan.min_nodes, c.max_restarts)
    secret = Secret.new()  # the job's: each host gets it as the first line of its connection's stdin
    lost: list[str] = []
    code = 1
    while True:
        try:
            checking = f"checking {len(members.all)} host(s) over ssh (cluster.check_timeout_s={c.check_timeout_s:.0f})"
            with saying_if_slow(checking):
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
    heard = threading.Event()
    connecting = f"connecting to {', '.join(hosts)} over ssh and starting their node processes"
    with forwarding_stops(nodes) as stops, saying_if_slow(connecting, heard):
        for node, host in enumerate(hosts):
            addr = master if node == 0 else (facts[node]["addr"] or host)
            args = NodeArgs(
                job.run_dir, len(hosts), node, endpoint, launch_id, addr,
                stdin_control=True, static_rendezvous=True, head_restarts=True, attempt=attempt,
            )  # fmt: skip
            nodes.append(SshNode(c, host, args.argv(c.python), lock, secret, heard))
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
            f"their logs: {RunDir(job.run_dir).logs}",
            file=sys.stderr,
        )
    elif not report_failures(job.run_dir, launch_id):
        print(
            f"launcher: node {first}'s agent on {hosts[first]} exited with code {codes[first]} (no rank recorded "
            f"a failure; see {RunDir(job.run_dir).logs})",
            file=sys.stderr,
        )
    return (codes[first] if codes[first] in STOP_CODES else 1), lost
