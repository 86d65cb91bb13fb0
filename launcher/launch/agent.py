"""One node's torch elastic agent (the machinery torchrun uses): ``procs_per_node`` workers started as
``python -m launcher.rank RUN_DIR``, c10d rendezvous, restarts, and on failure the records the job's report needs.
Used by the local mode (one agent in the launcher process), simulated nodes and nodes started by hand
(``launch/node.py``, one agent process per node)."""

from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from torch.distributed import DistError
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousTimeoutError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from ..config import JobConfig
from ..failures import STOP_CODES, attempt_dir, exit_failure, record_exits
from ..failures import report as report_failures
from ..rendezvous import listening_store

GRACE_S = 5.0  # after one agent failed, the others' time to end on their own (the report follows within 10 s)


def agent_config(
    job: JobConfig,
    nnodes: int,
    endpoint: str,
    run_id: str,
    local_addr: str,
    node: int = 0,
    fixed: bool = False,
    agent_restarts: bool = True,
) -> LaunchConfig:
    """The elastic agent of one node: ``procs_per_node`` workers; node 0's agent hosts the rendezvous store at
    ``endpoint``.

    ``fixed=False``: c10d rendezvous, elastic numbers the nodes (in the order of their addresses) and restarts
    the workers ``cluster.max_restarts`` times. ``fixed=True`` (machines named by the user: ssh hosts, by hand):
    static rendezvous, node ``node`` is group rank ``node`` (rank 0 on the first host, as listed), and the agent
    does not restart (the ssh head restarts the whole job). ``agent_restarts=False``: the head restarts the job,
    not the agent (the ssh head; the sim head under ``cluster.min_nodes``)."""
    c = job.cluster
    join = max(1, round(c.join_timeout_s))
    return LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=int(c.procs_per_node or 1),
        run_id=run_id,
        rdzv_backend="static" if fixed else "c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs={"rank": node, "timeout": join} if fixed else {"join_timeout": join, "is_host": node == 0},
        max_restarts=c.max_restarts if agent_restarts and not fixed else 0,
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
    if config.rdzv_configs.get("is_host") or config.rdzv_configs.get("rank") == 0:
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
            [
                exit_failure(rank, f.pid, f.exitcode, socket.gethostname(), node, config.max_nodes)
                for rank, f in exc.failures.items()
            ],
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
        if report:
            print_stopped(128 + int(exc.sigval), job.run_dir)
        return 128 + int(exc.sigval)
    except DistError as exc:  # static rendezvous (fixed nodes): the store did not gather every node in time
        print(
            f"launcher: node {node}: the rendezvous store at {config.rdzv_endpoint} did not gather "
            f"{config.min_nodes} nodes within {job.cluster.join_timeout_s:.0f} s (cluster.join_timeout_s): "
            f"{str(exc).splitlines()[0]}; HINT: did every node start, and can it reach that address?",
            file=sys.stderr,
        )
        return 1
    except RendezvousError as exc:  # the node hosting the rendezvous ended (its failure is in the job's report)
        if report:
            print(f"launcher: node {node}: lost the rendezvous at {config.rdzv_endpoint} ({exc})", file=sys.stderr)
        return 1
    return 0


def print_stopped(code: int, run_dir: str) -> None:
    """The one line a job stopped by a signal ends with (exit ``code``: 130 / 143)."""
    print(
        f"launcher: stopped by {signal.Signals(code - 128).name}; the ranks wrote a checkpoint, run again with "
        f"hydra.run.dir={run_dir} to continue",
        file=sys.stderr,
    )


def wait_agents(
    agents: list[subprocess.Popen],
    stop: Callable[[subprocess.Popen], None] = subprocess.Popen.terminate,
    at_once: tuple[int, ...] = (),
) -> tuple[list[int], int]:
    """Wait for the agents of a several-node job; returns every exit code (node order) and the node that failed
    first (-1: none did). After a failure the others get ``GRACE_S`` to end on their own (their collectives fail
    fast once a peer is gone), then ``stop`` is applied to each one still running and they are waited for; after
    an exit code in ``at_once`` (a machine lost: its peers hang in collectives with it) they get no grace. An
    agent stopped by a stop signal (exit 130 / 143) starts no grace period: the others are stopping too."""
    done: queue.SimpleQueue = queue.SimpleQueue()
    for node, agent in enumerate(agents):
        threading.Thread(target=lambda n=node, a=agent: done.put((n, a.wait())), daemon=True).start()
    codes: list[int] = [0] * len(agents)
    first, grace, remaining = -1, None, len(agents)
    while remaining:
        try:
            node, code = done.get(timeout=grace)
        except queue.Empty:
            after = f"{GRACE_S:.0f} s after the failure" if grace else "at once: they wait for a lost machine"
            print(f"launcher: stopping the agents still running {after}", file=sys.stderr)
            for agent in agents:
                if agent.poll() is None:
                    stop(agent)
            for node, agent in enumerate(agents):
                codes[node] = agent.wait()
            break
        remaining -= 1
        codes[node] = code
        if code != 0 and first < 0:
            first = node
        if code in at_once:
            grace = 0.0
        elif code not in (0, *STOP_CODES) and grace is None:
            grace = GRACE_S
    return codes, first
