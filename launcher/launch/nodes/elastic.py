"""torch's elastic agent, run as ``elastic_launch`` runs it, with two additions (``RestartingAgent``). Every restart
is announced with its cause: torchrun's own agent says only "Worker group FAILED. 2/3 attempts left"; ours records
how each of its ranks ended (a SIGKILLed rank writes nothing itself) and, on node 0, once every node has met again
for the next attempt (so every node's records are in), names the rank that ended the attempt by the root-cause
rules (``launcher.report.attempts.restart_line``), which attempt starts and how many restarts are left. And a stop
signal gives the ranks ``cluster.stop_grace_s`` (torch's agent: a fixed 30 s, said nowhere): passed on to each rank as
that signal, the ranks that have not exited by then are killed and named, a second stop signal meanwhile kills them
at once (said too), and how each rank ended is recorded for the stop line (``report.stops.RankEnd``).

``launch`` builds the agent from a ``LaunchConfig`` with torch's public classes, as ``launch_agent`` does (no
metrics, events or health-check server: the launcher has its own records), and raises ``ChildFailedError`` when the
workers failed with no restart left."""

from __future__ import annotations

import os
import signal
import socket
import sys
from typing import Any, Optional

from torch.distributed.elastic.agent.server.api import DEFAULT_ROLE, RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rendezvous_registry
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint
from torch.distributed.launcher.api import LaunchConfig

from launcher.base.exiting import stop_within
from launcher.base.run_dir import RunDir
from launcher.launch.nodes.relay import StopRelay
from launcher.report.attempts import cause_of, restart_line
from launcher.report.failures import exit_failure, load_attempt, record_exits
from launcher.report.stops import RankEnd, record_ends, said_killed
from launcher.trust.secret import Secret


class RestartingAgent(LocalElasticAgent):
    """A ``LocalElasticAgent`` that records its failed ranks at each restart and, on node 0, announces it."""

    def __init__(  # noqa: PLR0913
        self, spec: WorkerSpec, run: RunDir, first_attempt: int, by_hand: bool, grace_s: float, **kwargs: Any
    ) -> None:
        super().__init__(spec, **kwargs)
        self.run_dir, self.first_attempt = run, first_attempt  # the head's attempt (ssh, sim under min_nodes): added
        self.by_hand = by_hand  # a machine of a job started by hand: a stop is relayed to / from the others
        self.grace_s = grace_s  # cluster.stop_grace_s: the ranks' time to exit after a stop signal
        self.stopped_by: Optional[signal.Signals] = None  # the stop signal that ended the run
        self.relay: Optional[StopRelay] = None  # (relay.py: made once the rendezvous gave the agent its store)
        self.running = first_attempt  # the attempt the workers now running belong to (their DistEnv.attempt)
        self.ended: Optional[tuple[int, bool]] = None  # the attempt a restart ended, and whether ours failed
        self.last: Optional[RunResult] = None

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        if self.by_hand and self.relay is None and self._store is not None:
            nodes = worker_group.group_world_size or 1
            self.relay = StopRelay(self._store, worker_group.group_rank or 0, nodes, Secret.from_environ(keep=True))
        if self.relay is not None and (heard := self.relay.listen()):  # another machine's stop: as if sent here
            raise SignalException(f"node {heard[0]} was stopped", sigval=signal.Signals(heard[1]))
        self.last = super()._monitor_workers(worker_group)
        return self.last

    def _invoke_run(self, role: str = DEFAULT_ROLE) -> RunResult:
        try:
            return super()._invoke_run(role)
        except SignalException as exc:  # sent here: the other machines are told before this one's ranks stop
            self.stopped_by = exc.sigval
            if self.relay is not None:
                self.relay.tell(exc.sigval)
            raise

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        """After a stop signal: the ranks get it and ``grace_s`` to exit (``stop_within``); else torch's own."""
        handlers = getattr(self._pcontext, "subprocess_handlers", None)  # (the workers are commands: SubprocessContext)
        if self.stopped_by is None or not handlers:
            super()._shutdown(death_sig, timeout)
            return
        stop, group = self.stopped_by, self._worker_group
        procs = {group.workers[local].global_rank: handler.proc for local, handler in handlers.items()}
        end = stop_within(procs, stop, self.grace_s)
        host, why = socket.gethostname(), ""
        if end.killed:
            again = getattr(end.cut_short, "sigval", signal.SIGINT) if end.cut_short is not None else None
            line, why = said_killed(end.killed, host, stop, self.grace_s, again, end.waited_s)
            print(line, file=sys.stderr, flush=True)
        node = group.group_rank or 0
        ends = [RankEnd(r, host, code, node, why if r in end.killed else "") for r, code in end.codes.items()]
        record_ends(self.run_dir, group.spec.rdzv_handler.get_run_id(), self.running, ends)
        assert self._pcontext is not None  # (it has handlers)
        self._pcontext.close(signal.SIGKILL, timeout=1)  # (every worker has ended: its files closed)
        self.stopped_by = None

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        last = self.last
        failed = last is not None and last.state in (WorkerState.FAILED, WorkerState.UNHEALTHY)
        if last is not None and failed:
            group = worker_group
            nodes = group.group_world_size or 1
            record_exits(
                self.run_dir.failure_attempt(group.spec.rdzv_handler.get_run_id(), self.running),
                [
                    exit_failure(rank, f.pid, f.exitcode, socket.gethostname(), group.group_rank or 0, nodes)
                    for rank, f in last.failures.items()
                ],
            )
        self.ended = (self.running, failed)  # also when another node's failure restarts ours (torch: no restart spent)
        super()._restart_workers(worker_group)  # stop, meet every node again, start

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        spec = worker_group.spec
        if self.ended is not None and worker_group.group_rank == 0:  # every node has met: their records are in
            ended, failed = self.ended
            failures = load_attempt(self.run_dir, spec.rdzv_handler.get_run_id(), ended)
            if failures or failed:  # (not a node joining)
                left, used = self._remaining_restarts, spec.max_restarts - self._remaining_restarts
                print(restart_line(ended, cause_of(failures), used, left), file=sys.stderr, flush=True)
        self.ended = None
        self.running = self.first_attempt + spec.max_restarts - self._remaining_restarts
        return super()._start_workers(worker_group)


def launch(  # noqa: PLR0913
    config: LaunchConfig,
    entrypoint: str,
    args: tuple[str, ...],
    run: RunDir,
    first_attempt: int,
    by_hand: bool,
    grace_s: float = 30.0,
) -> None:
    """Run the workers ``entrypoint args`` under a ``RestartingAgent`` to their end, as ``elastic_launch(config,
    entrypoint)(*args)``: ``ChildFailedError`` when they failed with no restart left. ``by_hand``: one of the
    machines of a job started by hand (a stop is relayed to the others); ``grace_s``: ``cluster.stop_grace_s``."""
    parameters = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle  # as launch_agent: the workers see it
    master_addr, master_port = None, None
    if config.rdzv_backend == "static":  # node 0's store is the workers' master (c10d: the rendezvous says)
        master_addr, master_port = parse_rendezvous_endpoint(config.rdzv_endpoint, default_port=-1)
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=args,
        rdzv_handler=rendezvous_registry.get_rendezvous_handler(parameters),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=config.local_addr,
    )
    agent = RestartingAgent(
        spec, run, first_attempt, by_hand, grace_s, logs_specs=config.logs_specs, start_method=config.start_method
    )
    shutdown = True
    try:
        result = agent.run()
        if result.is_failed():
            raise ChildFailedError(name=entrypoint, failures=result.failures)
    except SignalException:
        shutdown = False  # a signal ends the agent: its rendezvous stays open (as launch_agent leaves it)
        raise
    finally:
        if shutdown:
            spec.rdzv_handler.shutdown()
