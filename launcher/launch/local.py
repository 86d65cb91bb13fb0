"""Local launch: the elastic agent torchrun uses spawns ``procs_per_node`` workers on this host.

- Rendezvous: c10d store listening on the loopback address only (``bind_store``); port 0 takes a free port and
  holds it (no race between "check it is free" and "bind it"), a fixed ``cluster.master_port`` is checked first.
- ``cluster.max_restarts``: the agent restarts the whole group; workers resume from the newest checkpoint.
- A failure prints the job's report (``launcher.failures``: the root cause first, with its host, pid and
  traceback, then the ranks that failed too); exit code 1.
- One rank: the worker runs in this process (nothing to spawn).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import traceback
import uuid
from pathlib import Path

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousTimeoutError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from ..config import ConfigError, JobConfig
from ..env import DistEnv
from ..failures import attempt_dir, exit_failure, record_exits
from ..failures import report as report_failures
from ..gpus import by_free_memory
from ..rendezvous import listening_store
from ..worker import run_worker
from .plan import LaunchPlan

log = logging.getLogger(__name__)


def port_in_use(addr: str, port: int) -> str | None:
    """Why ``port`` cannot be bound on ``addr`` now, or None. Binds as the store does (SO_REUSEADDR): a previous
    run's socket in TIME_WAIT is no clash, a listener is."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((addr, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def check_port(addr: str, port: int) -> None:
    """A fixed port must be free now; say which and how to fix it instead of a clash at rendezvous."""
    reason = port_in_use(addr, port)
    if reason:
        raise ConfigError(
            f"cluster.master_port={port} on {addr} is not free ({reason}); HINT: cluster.master_port=0 "
            "lets the launcher take a free port"
        )


def free_port(addr: str) -> int:
    """A port that is free on ``addr`` now (for agents that must all be told the port in advance)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((addr, 0))
        return sock.getsockname()[1]


def agent_config(
    job: JobConfig, nnodes: int, endpoint: str, run_id: str, is_host: bool, local_addr: str, node: int = 0
) -> LaunchConfig:
    """The elastic agent of one node: ``procs_per_node`` workers, c10d rendezvous at ``endpoint``."""
    c = job.cluster
    return LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=c.procs_per_node,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs={"join_timeout": max(1, round(c.join_timeout_s)), "is_host": is_host},
        max_restarts=c.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        local_addr=local_addr,
        logs_specs=DefaultLogsSpecs(log_dir=str(Path(job.run_dir) / "logs" / "elastic" / f"node-{node}")),
    )


def run_agent(job: JobConfig, config: LaunchConfig, node: int = 0, report: bool = True) -> int:
    """Run one node's agent to the end. On failure, record how each of its ranks ended, print the job's report
    (``report``: the agent is the only one; with several agents the launcher reports once for all) and
    return 1."""
    # We report a failed rank ourselves (once, with the root cause first); elastic would dump every traceback.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    # Rendezvous and worker stores listen on the rendezvous address only: the agent hosts its store on a bound
    # socket (elastic's own store for the same port shares that server), and rank 0 hosts the workers' store
    # (launcher.rendezvous.listening_store) instead of a second agent store that would listen on every interface.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if config.rdzv_configs.get("is_host"):
        addr, port = config.rdzv_endpoint.rsplit(":", 1)
        _store = listening_store(addr, int(port))  # lives until the agent returns
        config.rdzv_endpoint = f"{addr}:{_store.port}"
    try:
        # Workers are started as commands (torchrun's way), not multiprocessing functions: elastic then reports
        # the exit code of every worker, not only the first in its poll order.
        elastic_launch(config, sys.executable)("-u", "-m", "launcher.rank", job.run_dir)
    except ChildFailedError as exc:
        # restarts are exhausted: the workers' records are in the last attempt's directory
        record_exits(
            attempt_dir(job.run_dir, config.run_id, config.max_restarts),
            [exit_failure(rank, f.pid, f.exitcode, socket.gethostname(), node) for rank, f in exc.failures.items()],
        )
        if report:
            report_failures(job.run_dir, config.run_id)
        return 1
    except RendezvousTimeoutError:
        print(
            f"launcher: node {node}: the rendezvous at {config.rdzv_endpoint} did not gather {config.min_nodes} "
            f"nodes within {job.cluster.join_timeout_s:.0f} s (cluster.join_timeout_s); HINT: see the other "
            "nodes' agents (did they start? can they reach this address?)",
            file=sys.stderr,
        )
        return 1
    except SignalException as exc:  # SIGTERM / SIGINT: the workers checkpointed and stopped
        print(
            f"launcher: stopped by {exc.sigval.name}; the ranks wrote a checkpoint, run again with "
            f"hydra.run.dir={job.run_dir} to continue",
            file=sys.stderr,
        )
        return 128 + int(exc.sigval)
    return 0


def launch_local(plan: LaunchPlan, job: JobConfig) -> int:
    if plan.world_size == 1:
        try:
            run_worker(job, DistEnv(hostname=socket.gethostname()))
        except Exception:
            print(f"launcher: rank 0 on {socket.gethostname()} failed:\n{traceback.format_exc()}", file=sys.stderr)
            return 1
        return 0
    c = job.cluster
    if c.master_port:
        check_port(c.master_addr, c.master_port)
    if c.gpus_per_node and c.gpu_select == "free_memory":  # before any worker initialises CUDA
        os.environ["CUDA_VISIBLE_DEVICES"] = by_free_memory(c.gpus_per_node)
        log.warning("cluster.gpu_select=free_memory: CUDA_VISIBLE_DEVICES=%s", os.environ["CUDA_VISIBLE_DEVICES"])
    if c.master_addr.startswith("127.") and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # workers inherit it: gloo listens on loopback only
    config = agent_config(job, 1, f"{c.master_addr}:{c.master_port}", uuid.uuid4().hex[:12], True, c.master_addr)
    return run_agent(job, config)
