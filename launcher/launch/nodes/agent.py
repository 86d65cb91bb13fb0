"""One node's torch elastic agent (the machinery torchrun uses): ``procs_per_node`` workers started as
``python -m launcher.rank.entry RUN_DIR``, c10d or static rendezvous, restarts, and on failure the records the job's
report needs. Used by the local mode (one agent in the launcher process, also for a machine started by hand) and
by each node process of the sim and ssh heads (``launch/nodes/process.py``)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
from pathlib import Path

from torch.distributed import DistError
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousTimeoutError
from torch.distributed.launcher.api import LaunchConfig

from launcher.base.env import ROLE, head_attempt
from launcher.base.files import remove_empty_dirs
from launcher.config import JobConfig
from launcher.config.rules import rank_command
from launcher.group.rendezvous import listening_store
from launcher.launch.nodes.elastic import launch
from launcher.report.failures import exit_failure, record_exits
from launcher.report.failures import print_report as report_failures
from launcher.report.stops import load_ends, print_stopped


def agent_config(
    job: JobConfig,
    nnodes: int,
    endpoint: str,
    launch_id: str,
    local_addr: str,
    node: int = 0,
    static_rendezvous: bool = False,
    head_restarts: bool = False,
) -> LaunchConfig:
    """The elastic agent of one node: ``procs_per_node`` workers; node 0's agent hosts the rendezvous store at
    ``endpoint``; ``launch_id`` is elastic's run id.

    Default: c10d rendezvous, elastic numbers the nodes (in the order of their addresses) and restarts the
    workers ``cluster.max_restarts`` times. ``static_rendezvous`` (machines named by the user: ssh hosts, or
    started by hand with ``cluster.node_rank``; the one machine of a local job that does not restart): node ``node``
    is group rank ``node`` (rank 0 on the first host, as listed), and the agent does not restart.
    ``head_restarts``: the head restarts the whole job, not the agent (the ssh head; the sim head under
    ``cluster.min_nodes``)."""
    c = job.cluster
    join = max(1, round(c.join_timeout_s))
    return LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=int(c.procs_per_node or 1),
        run_id=launch_id,
        rdzv_backend="static" if static_rendezvous else "c10d",
        rdzv_endpoint=endpoint,
        rdzv_configs={"rank": node, "timeout": join}
        if static_rendezvous
        else {"join_timeout": join, "is_host": node == 0},
        max_restarts=0 if head_restarts or static_rendezvous else c.max_restarts,
        role=ROLE,  # torchrun's (elastic_launch's default is "default_role"): ROLE_NAME as a script expects it
        monitor_interval=0.1,
        start_method="spawn",
        local_addr=local_addr,
        logs_specs=DefaultLogsSpecs(log_dir=str(job.run.node_logs(node))),
    )


def run_agent(job: JobConfig, config: LaunchConfig, node: int = 0, report: bool = True, by_hand: bool = False) -> int:
    """Run one node's agent to the end. On failure, record how each of its ranks ended, print the job's report
    (``report``: the agent is the only one; with several agents the launcher reports once for all) and
    return 1. ``by_hand``: one machine of a job started by hand on each (a stop is relayed to the others)."""
    # We report a failed rank ourselves (once, with the root cause first); elastic would dump every traceback.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    # its "Received Signals.SIGTERM death signal, shutting down workers": the launcher says the stop in its own words
    logging.getLogger("torch.distributed.elastic.agent.server.api").setLevel(logging.ERROR)
    # Rendezvous and worker stores listen on the rendezvous address only: the agent hosts its store on a bound
    # socket (elastic's own store for the same port shares that server), and rank 0 hosts the workers' store
    # (launcher.group.rendezvous.listening_store) instead of a second agent store that would listen on every interface.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if config.rdzv_configs.get("is_host") or config.rdzv_configs.get("rank") == 0:
        addr, port = config.rdzv_endpoint.rsplit(":", 1)
        _store = listening_store(addr, int(port))  # lives until the agent returns
        config.rdzv_endpoint = f"{addr}:{_store.port}"
    try:
        return _launch(job, config, node, report, by_hand)
    finally:
        # a stop from the head while the folders are tidied (elastic's handler raises it anywhere): the node's end
        # is already decided, and its own words said; no traceback over it
        with contextlib.suppress(SignalException):
            if isinstance(config.logs_specs, DefaultLogsSpecs):  # this node's folders (others' agents may still run)
                remove_empty_dirs(config.logs_specs.root_log_dir)
                if report:  # the job's only agent: the folder above is its own too
                    remove_empty_dirs(Path(config.logs_specs.root_log_dir).parent)


def _launch(job: JobConfig, config: LaunchConfig, node: int, report: bool, by_hand: bool) -> int:
    try:
        # Workers are started as commands (torchrun's way), not multiprocessing functions: elastic then reports
        # the exit code of every worker, not only the first in its poll order.
        grace = job.cluster.stop_grace_s
        launch(config, sys.executable, rank_command(job), job.run, head_attempt(os.environ), by_hand, grace)
    except ChildFailedError as exc:
        # restarts are exhausted: the workers' records are in the last attempt's directory (the attempt number the
        # ranks had: this agent's restarts plus the head's attempt, as in DistEnv.attempt)
        record_exits(
            job.run.failure_attempt(config.run_id, config.max_restarts + head_attempt(os.environ)),
            [
                exit_failure(rank, f.pid, f.exitcode, socket.gethostname(), node, config.max_nodes)
                for rank, f in exc.failures.items()
            ],
        )
        if report:
            report_failures(job.run, config.run_id)
        return 1
    except RendezvousTimeoutError:
        print(
            f"launcher: node {node}: the rendezvous at {config.rdzv_endpoint} did not gather {config.min_nodes} "
            f"nodes within {job.cluster.join_timeout_s:.0f} s (cluster.join_timeout_s); HINT: see the other "
            "nodes' agents (did they start? can they reach this address?)",
            file=sys.stderr,
        )
        return 1
    except SignalException as exc:  # SIGTERM / SIGINT / SIGHUP: the workers stopped (given their grace)
        if report:  # this machine's ranks' ends (by hand, each machine's launcher says its own)
            ends = [end for end in load_ends(job.run, config.run_id) if end.node == node]
            print_stopped(128 + int(exc.sigval), job, ends=ends)
        return 128 + int(exc.sigval)
    except DistError as exc:  # static rendezvous: the store did not gather every node in time
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
