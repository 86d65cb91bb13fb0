"""One node's ranks in a job that heals in place (``launch/nodes/process.py`` with ``--members``; its command line:
``base/node_args.py``): no elastic agent and no rendezvous of agents, whose store would sit on node 0 and whose
end-of-job barrier would wait for a lost machine. The node's ``procs_per_node`` ranks are started with torch's
elastic process management (``start_processes``: the same workers, log and error files as under the agent), told
their place and the keeper's store, and this process beats the node's heartbeat to the keeper
(``liveness.NODE_BEAT_S``, a signed count) until they end. The ranks get the job's secret in their environment, as
this process got it. A lost machine's survivors keep their processes: the ranks heal among themselves
(``rank_side.py``)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

from launcher.base.env import DistEnv, head_attempt
from launcher.base.exiting import stop_within
from launcher.base.liveness import NODE_BEAT_S
from launcher.base.node_args import NodeArgs
from launcher.config import JobConfig
from launcher.config.rules import rank_command
from launcher.group.rendezvous import attempt_prefix
from launcher.heal.protocol import Keys, Place
from launcher.report.failures import exit_failure, record_exits
from launcher.report.stops import STOP_SIGNALS, said_killed
from launcher.trust.secret import Secret
from launcher.trust.signed import SignedStore


def beat(store: SignedStore, me: str, stop: threading.Event) -> None:
    """The node process's heartbeat to the keeper (``me``: its ``node_id``), until ``stop`` (a keeper gone for
    good: the head sees it, ends the job)."""
    key, count = Keys.heartbeat(me), 0
    while not stop.is_set():
        count += 1
        with contextlib.suppress(dist.DistError):  # the keeper unreachable for a while: beat on when it answers
            store.set(key, str(count))
        stop.wait(NODE_BEAT_S)


def node_place(args: NodeArgs) -> Place:
    """This node process's place (the one answer for its ranks, told it, and its heartbeat, keyed by ``Place.node``):
    its node's name (its place in ``--members``, or their last one when it joins: ``--start``) and its start."""
    names = args.members.split(",")
    return Place(names[-1] if args.start else names[args.node], args.start)


def worker_envs(job: JobConfig, args: NodeArgs, secret: Secret) -> dict[int, dict[str, str]]:
    """Each local rank's environment: its place in round 0 (joining: a place of its own, until it learns its
    round), the keeper's store as the rendezvous (as a client), the job's secret."""
    procs = int(job.cluster.procs_per_node or 1)
    host, port = args.endpoint.rsplit(":", 1)
    ours = {**node_place(args).environ(), **secret.environ()}
    envs = {}
    for local in range(procs):
        place = DistEnv(  # no agent: torchrun's variables as its agent sets them (the head's attempt is added)
            rank=args.node * procs + local,
            local_rank=local,
            world_size=args.nodes * procs,
            local_world_size=procs,
            node_rank=args.node,
            num_nodes=args.nodes,
            master_addr=host,
            master_port=int(port),
            launch_id=args.launch_id,
        )  # the rank's threads are its own (launcher.base.threads): not set here
        envs[local] = {**os.environ, **place.torchrun_environ(job.cluster.max_restarts), **ours}
    return envs


def run_workers(job: JobConfig, args: NodeArgs, secret: Secret) -> int:
    """Run this node's ranks to their end: 0, 128 + a stop signal, or 1 with the exits recorded for the report."""
    me = node_place(args).node
    host, port = args.endpoint.rsplit(":", 1)
    timeout = timedelta(seconds=job.cluster.join_timeout_s)
    client = dist.TCPStore(host, int(port), is_master=False, timeout=timeout, wait_for_workers=False)
    store = SignedStore(
        client, secret, attempt_prefix(head_attempt(os.environ)), where=f"the keeper's store at {host}:{port}"
    )
    stop = threading.Event()
    threading.Thread(target=beat, args=(store, me, stop), name="heartbeat", daemon=True).start()
    envs = worker_envs(job, args, secret)
    logs = DefaultLogsSpecs(log_dir=str(job.run.node_logs(args.node)))
    entry = rank_command(job)
    ranks = start_processes("launcher", sys.executable, {local: entry for local in envs}, envs, logs)
    # A stop from the head (this process has a session of its own) is recorded, not raised (elastic's handlers
    # raise anywhere, a second stop inside the first one's handling too): the ranks checkpoint
    stops: list[int] = []
    for signum in STOP_SIGNALS:
        signal.signal(signum, lambda signum, frame: stops.append(signum))
    try:
        result = None
        while result is None and not stops:
            result = ranks.wait(timeout=0.1, period=0.1)
        if stops:  # the ranks get it and cluster.stop_grace_s; a second stop meanwhile ends them at once
            handlers = getattr(ranks, "subprocess_handlers", {})
            workers = {args.node * len(envs) + local: handler.proc for local, handler in handlers.items()}
            grace = job.cluster.stop_grace_s
            end = stop_within(workers, stops[0], grace, again=lambda: len(stops) > 1)
            if end.killed:
                again = stops[1] if len(stops) > 1 else None
                line, _ = said_killed(end.killed, socket.gethostname(), stops[0], grace, again, end.waited_s)
                print(line, file=sys.stderr, flush=True)
            ranks.close(signal.Signals(stops[0]), timeout=int(grace))  # (the ranks have ended: their files closed)
            return 128 + stops[0]
    finally:
        with contextlib.suppress(dist.DistError):  # before the heartbeat stops: this silence is no loss
            store.set(Keys.done(me), "1")
        stop.set()
    if result is None or not result.is_failed():
        return 0
    procs = len(envs)
    record_exits(
        job.run.failure_attempt(args.launch_id, head_attempt(os.environ)),
        [
            exit_failure(args.node * procs + local, f.pid, f.exitcode, socket.gethostname(), args.node, args.nodes)
            for local, f in result.failures.items()
        ],
    )
    return 1
