"""One node's ranks in a job that heals in place (``launch/node.py --members``): no elastic agent and no rendezvous
of agents, whose store would sit on node 0 and whose end-of-job barrier would wait for a lost machine. The node's
``procs_per_node`` ranks are started with torch's elastic process management (``start_processes``: the same
workers, log and error files as under the agent), told their place and the keeper's store, and this process
beats the node's heartbeat to the keeper (``keeper.BEAT_S``) until they end. A lost machine's survivors keep their
processes: the ranks heal among themselves (``launcher.train.heal``)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, start_processes

from ..config import JobConfig
from ..env import TORCHRUN_VARS, head_attempt
from ..failures import attempt_dir, exit_failure, record_exits
from ..membership import DONE_KEY, HEAL_ENV, HEARTBEAT_KEY, node_id
from ..rendezvous import attempt_prefix
from .head import NodeArgs
from .keeper import BEAT_S


def beat(store: dist.Store, me: str, stop: threading.Event) -> None:
    """The node process's heartbeat to the keeper (``me``: its ``node_id``), until ``stop`` (a keeper gone for
    good: the head sees it, ends the job)."""
    key = HEARTBEAT_KEY.format(me)
    while not stop.is_set():
        with contextlib.suppress(RuntimeError):  # the keeper unreachable for a while: beat on when it answers
            store.add(key, 1)
        stop.wait(BEAT_S)


def node_name(args: NodeArgs) -> str:
    """This node's name: its place in ``--members``, or their last one when it joins (``--start``)."""
    names = args.members.split(",")
    return names[-1] if args.start else names[args.node]


def worker_envs(job: JobConfig, args: NodeArgs) -> dict[int, dict[str, str]]:
    """Each local rank's environment: its place in round 0 (joining: a place of its own, until it learns its
    round), the keeper's store as the rendezvous (as a client)."""
    procs = int(job.cluster.procs_per_node or 1)
    host, port = args.endpoint.rsplit(":", 1)
    v = TORCHRUN_VARS
    place = {
        v["world_size"]: str(args.nodes * procs),
        v["local_world_size"]: str(procs),
        v["node_rank"]: str(args.node),
        v["master_addr"]: host,
        v["master_port"]: port,
        v["launch_id"]: args.launch_id,
        v["agent_store"]: "True",
        v["attempt"]: "0",
        HEAL_ENV: json.dumps({"name": node_name(args), "start": args.start}),
    }
    return {
        local: {**os.environ, **place, v["rank"]: str(args.node * procs + local), v["local_rank"]: str(local)}
        for local in range(procs)
    }


def run_workers(job: JobConfig, args: NodeArgs) -> int:
    """Run this node's ranks to their end: 0, 128 + a stop signal, or 1 with the exits recorded for the report."""
    me = node_id(node_name(args), args.start)
    host, port = args.endpoint.rsplit(":", 1)
    timeout = timedelta(seconds=job.cluster.join_timeout_s)
    store = dist.PrefixStore(
        attempt_prefix(head_attempt(os.environ)),
        dist.TCPStore(host, int(port), is_master=False, timeout=timeout, wait_for_workers=False),
    )
    stop = threading.Event()
    threading.Thread(target=beat, args=(store, me, stop), name="heartbeat", daemon=True).start()
    envs = worker_envs(job, args)
    logs = DefaultLogsSpecs(log_dir=str(Path(job.run_dir) / "logs" / "elastic" / f"node-{args.node}"))
    entry = ("-u", "-m", "launcher.rank_entry", job.run_dir)
    ranks = start_processes("launcher", sys.executable, {local: entry for local in envs}, envs, logs)
    try:
        result = ranks.wait(period=0.1)
    except SignalException as exc:  # SIGTERM / SIGINT from the head: the ranks checkpoint and stop
        ranks.close(exc.sigval)
        return 128 + int(exc.sigval)
    finally:
        with contextlib.suppress(RuntimeError):  # before the heartbeat stops: this silence is no loss
            store.set(DONE_KEY.format(me), "1")
        stop.set()
    if result is None or not result.is_failed():
        return 0
    procs = len(envs)
    record_exits(
        attempt_dir(job.run_dir, args.launch_id, head_attempt(os.environ)),
        [
            exit_failure(args.node * procs + local, f.pid, f.exitcode, socket.gethostname(), args.node, args.nodes)
            for local, f in result.failures.items()
        ],
    )
    return 1
