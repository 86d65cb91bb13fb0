"""Local mode (no cluster chosen): one elastic agent in this process spawns ``procs_per_node`` workers here.

By hand on several machines (torchrun's multi-node form): on each machine
``python -m launcher cluster.nodes=N cluster.node_rank=K cluster.master_addr=HOST cluster.master_port=P``, HOST
being node 0's address as the others reach it. Node K's ranks are ``K * procs_per_node ...``; each machine's agent
reports the failures it can see (all of them when the run dir is on a shared file system). The default run dir,
``runs/nodes-HOST-P``, is the same on every machine, so a shared file system gives one run dir and running the
same commands again resumes.

- Rendezvous: c10d store listening on the loopback address only; port 0 takes a free port and holds it (no race
  between "check it is free" and "bind it"), a fixed ``cluster.master_port`` is checked first.
- ``cluster.max_restarts``: the agent restarts the whole group; workers resume from the newest checkpoint.
- A failure prints the job's report (``launcher.report.failures``: the root cause first, with its host, pid and
  traceback, then the ranks that failed too); exit code 1.
- One rank: the worker runs in this process (nothing to spawn); with ``cluster.max_restarts`` the agent starts it,
  so that it can be started again.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sys
import traceback
import uuid

from omegaconf import DictConfig
from torch.distributed.launcher.api import LaunchConfig

from launcher.base.env import DistEnv
from launcher.base.gpus import by_free_memory
from launcher.config import ConfigError, JobConfig
from launcher.launch.mode import BaseMode, LaunchPlan
from launcher.launch.nodes.agent import agent_config, run_agent
from launcher.launch.ports import check_port
from launcher.rank.entry import rank_main
from launcher.report.stops import RankEnd, print_stopped
from launcher.train.stop import Stopped
from launcher.trust.secret import SECRET_ENV, Secret

log = logging.getLogger(__name__)


class LocalMode(BaseMode):
    name = "local"

    def ranks_on_this_machine(self, job: JobConfig, env: DistEnv) -> int | None:
        return job.cluster.procs_per_node

    def fill_defaults(self, cluster: DictConfig, env: DistEnv, gpus_visible: int) -> None:
        if cluster.gpus_per_node is None:
            cluster.gpus_per_node = gpus_visible  # this machine's GPUs are the job's
        super().fill_defaults(cluster, env, gpus_visible)

    def validate(self, job: JobConfig, env: DistEnv, gpus_visible: int) -> None:
        c = job.cluster
        if c.nodes > 1 and c.node_rank is None:
            raise ConfigError(
                f"cluster.nodes={c.nodes} needs a launcher that starts every machine, or this machine's node rank; "
                "HINT: +cluster=ssh cluster.hosts=[host1,host2] from one machine; or by hand on each machine "
                f"cluster.node_rank=K (0..{c.nodes - 1}) cluster.master_addr=NODE0 cluster.master_port=PORT; "
                "+cluster=sim to simulate nodes here; +cluster=slurm"
            )
        if c.nodes > 1 and (c.master_addr.startswith("127.") or c.master_addr == "localhost"):
            raise ConfigError(
                f"cluster.master_addr={c.master_addr} is this machine's loopback: the other machines cannot reach "
                "it; HINT: cluster.master_addr=<node 0's name or address, as the other machines reach it>"
            )
        if c.nodes > 1 and not c.master_port:
            raise ConfigError(
                "cluster.master_port=0 (a free port) cannot be agreed by machines started by hand; HINT: give "
                "every machine the same cluster.master_port, e.g. 29500"
            )
        if (c.gpus_per_node or 0) > gpus_visible:
            raise ConfigError(
                f"cluster.gpus_per_node={c.gpus_per_node} but this machine has {gpus_visible} visible GPU(s); "
                f"HINT: set cluster.gpus_per_node={gpus_visible}" + (" (CPU)" if gpus_visible == 0 else "")
            )

    def rendezvous(self, job: JobConfig, env: DistEnv) -> str:
        c = job.cluster
        if c.nodes > 1:
            host = "this machine" if c.node_rank == 0 else "node 0"
            return f"store on {c.master_addr}:{c.master_port} ({host}); this machine is node {c.node_rank}, by hand"
        where = f"{c.master_addr}:{c.master_port or 'free port held by the store'}"
        return f"c10d on {where} (restarts)" if c.max_restarts else f"the agent's store on {where}"

    def run(self, plan: LaunchPlan, job: JobConfig, env: DistEnv) -> int:
        return launch_local(plan, job)


def run_here(job: JobConfig) -> int:
    """One rank: it runs in this process, through the rank's one entry (``rank.entry.rank_main``: the stop
    handling, the end without interpreter teardown, as every rank's); its exit code is returned and settled by
    the caller once known (a sweep runs several jobs). A stop signal (SIGINT, SIGTERM, SIGHUP) stops it as it stops
    every job: a checkpoint at the next step, the stop line, exit 128 + the signal; a script gets it itself (this
    process is its rank: one it does not handle ends it as it ends any Python program, SIGTERM and SIGHUP without a
    word). A failure prints its traceback here (a single process in the launcher writes no failure record: no peers
    to rank it among): exit 1."""
    stopped: list[int] = []

    def say_stopped(job: JobConfig, env: DistEnv, stop: Stopped) -> None:  # no agent above: the exit code says it
        stopped.append(128 + (stop.signum or signal.SIGTERM))
        print_stopped(stopped[0], job)

    def script_stopped(job: JobConfig, env: DistEnv, signum: int, end: RankEnd) -> None:
        stopped.append(128 + signum)
        print_stopped(stopped[0], job, ends=[end])

    try:
        env = DistEnv(hostname=socket.gethostname())
        rank_main(job, env, after_stop=say_stopped, after_script_stop=script_stopped)
    except Exception:
        print(f"launcher: rank 0 on {socket.gethostname()} failed:\n{traceback.format_exc()}", file=sys.stderr)
        return 1
    return stopped[0] if stopped else 0


def launch_local(plan: LaunchPlan, job: JobConfig) -> int:
    if plan.world_size == 1 and not job.cluster.max_restarts:  # (restarts: a process of its own, the agent's)
        return run_here(job)
    c = job.cluster
    if c.master_port and not c.node_rank:  # node 0 (or the only one) hosts the store
        check_port(c.master_addr, c.master_port)
    if c.gpus_per_node and c.gpu_select == "free_memory":  # before any worker initialises CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = by_free_memory(c.gpus_per_node)
        log.warning("cluster.gpu_select=free_memory: CUDA_VISIBLE_DEVICES=%s", os.environ["CUDA_VISIBLE_DEVICES"])
    if c.master_addr.startswith("127.") and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # workers inherit it: gloo listens on loopback only
    if c.nodes > 1:  # by hand: the same launch id on every machine; an earlier run's records must not count
        node, launch_id = int(c.node_rank or 0), f"nodes-{c.master_port}"
        shutil.rmtree(job.run.launch_failures(launch_id), ignore_errors=True)
        addr = c.master_addr if node == 0 else socket.gethostname()
        endpoint = f"{c.master_addr}:{c.master_port}"
        config = agent_config(job, c.nodes, endpoint, launch_id, addr, node, static_rendezvous=True)
        return run_agent(job, config, node=node, by_hand=True)
    config = one_machine(job)
    os.environ.update(Secret.new().environ())  # a fresh one for this job: the agent's workers inherit it
    try:
        return run_agent(job, config)
    finally:
        os.environ.pop(SECRET_ENV, None)  # not the next job's of a sweep, nor anything this process starts later


def one_machine(job: JobConfig) -> LaunchConfig:
    """The agent of a job on this one machine. Without restarts, elastic's static rendezvous (the agent's store,
    nothing to negotiate): its dynamic c10d one cost every launch ~0.5 s more (a join delay, two stack walks per
    recorded event, a closing round: bench/launch.py). With restarts, c10d: a script's ``init_process_group`` puts no
    attempt prefix on the agent's store (torch counts on a new store per attempt), so over the static one's store a
    restarted rank read the dead ranks' addresses."""
    c = job.cluster
    endpoint, launch_id = f"{c.master_addr}:{c.master_port}", uuid.uuid4().hex[:12]
    return agent_config(job, 1, endpoint, launch_id, c.master_addr, static_rendezvous=not c.max_restarts)
