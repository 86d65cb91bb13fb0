"""The one attempt loop of every several-node head (``+cluster=sim``, ``+cluster=ssh``; healing in place or not), in
the shape of torch elastic's ``SimpleElasticAgent._invoke_run``: one loop over one state.

``run_on_machines``: the attempts, until one ends the job: each is placed by the mode (``Machines.place``: the
machines it runs on, where its node processes meet), run (``run_attempt``), and after a failed one
``Membership.again`` (``restarts.py``, the restart policy) says whether and where the job goes on
(``cluster.max_restarts``; ``cluster.min_nodes``: without the machines lost) from the newest checkpoint.
``run_attempt``: the keeper started when the job heals in place, one node process per machine (``Machines.start``),
stop signals to the head passed on to each (``Control`` words), a heartbeat to each, the wait
(``waiting.wait_for_nodes``: a failure, a lost machine, the keeper's decisions; after a stop, each node's agent
gives its ranks their grace, ``cluster.stop_grace_s``, and the head waits for it), then the attempt's end said once
(``said_end``: the stop line, the machines lost, or the job's failure report).

A mode supplies its machines through ``Machines`` (sim: processes in network namespaces; ssh: hosts, checked,
reached over ssh) and each node process through ``control.Node``. No torch here."""

from __future__ import annotations

import contextlib
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Optional, Protocol

from launcher.base.liveness import HEAD_PING_S
from launcher.base.node_args import NodeArgs
from launcher.config import ConfigError, JobConfig
from launcher.config.rules import entry_argv
from launcher.heal.head_side import KeeperClient
from launcher.launch.nodes.control import Control, Node, forwarding_stops
from launcher.launch.nodes.restarts import Membership
from launcher.launch.nodes.waiting import HealingAttempt, Outcome, wait_for_nodes
from launcher.report.failures import Failure, hang_ended, load_attempt
from launcher.report.failures import print_report as report_failures
from launcher.report.stops import STOP_CODES, print_stopped
from launcher.trust.secret import Secret


@dataclass(frozen=True)
class KeeperAt:
    """Where an attempt's keeper runs: ``prefix`` runs it where every node reaches ``addr`` (off every training
    machine), listening on ``port``."""

    prefix: list[str]
    addr: str
    port: int


@dataclass(frozen=True)
class Placement:
    """Where the next attempt runs: its machines (node 0 first) and where their node processes meet: node 0's
    rendezvous store (``store``, HOST:PORT), or, when the job heals in place, the keeper's (``keeper``)."""

    names: list[str]
    store: str = ""
    keeper: Optional[KeeperAt] = None
    rejoin_every_s: float = 0.0  # healing: how often the lost machines are checked (0: never)


class Machines(Protocol):
    """What a several-node mode supplies to the attempt loop: its machines, named ``where`` in messages (``node``,
    ``host``)."""

    @property
    def where(self) -> str: ...

    def place(self, members: Membership, lost: list[str]) -> Placement:
        """The next attempt's machines (``members.live``, or what the mode's checks leave of them; ``lost``: those
        just lost, not waited for) and where they meet; a ``ConfigError`` when it cannot start."""
        ...

    def start(self, args: NodeArgs, name: str) -> Node:
        """A node process running ``args`` on machine ``name`` (the mode adds its address and its flags)."""
        ...

    def lost(self, code: int) -> str:
        """Why a node process that ended with ``code`` means its machine is lost ("": it does not)."""
        ...

    def answering(self, names: list[str]) -> list[str]:
        """Which of the lost machines ``names`` answer again (healing: they then join the running job)."""
        ...


@dataclass(frozen=True)
class Ended:
    """How an attempt ended: the job's exit code so far, whether it ends the job (finished, or stopped by a
    signal: no restart), and the machines lost by signal (name -> why)."""

    code: int
    final: bool = False
    lost: dict[str, str] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)  # the ranks' records of a failed attempt (its cause)


Keeper = Callable[..., KeeperClient]  # KeeperClient's signature (a stand-in in the rules tests)


def run_on_machines(
    machines: Machines, job: JobConfig, members: Membership, secret: Secret, keeper: Keeper = KeeperClient
) -> int:
    """Run ``job``'s attempts on ``machines`` until one finishes, is stopped, or fails with no restart left; its
    exit code. A restart that cannot be placed ends the job with the last attempt's code, said."""
    ended = Ended(1)
    lost: list[str] = []  # the machines the last attempt lost: the next placement does not wait for them
    while True:
        try:
            placement = machines.place(members, lost)
        except ConfigError as exc:
            if members.attempt == 0:
                raise
            print(f"launcher: cannot restart the job: {exc}", file=sys.stderr)
            return ended.code
        ended = run_attempt(machines, job, members, placement, secret, keeper)
        if ended.final or not members.again(ended.lost, machines.where, ended.failures):
            return ended.code
        lost = list(ended.lost)


@dataclass
class Joiner:
    """``waiting.Rejoin`` for one healing attempt: a machine the mode finds answering gets a node process of its
    own place (past the attempt's nodes) that joins the round ``members``."""

    machines: Machines
    job: JobConfig
    endpoint: str  # the keeper's store
    launch_id: str
    attempt: int
    nodes: list[Node]  # the attempt's: a joiner is added there by the wait (stop signals, heartbeats reach it)
    every_s: float

    @property
    def ranks(self) -> int:
        return int(self.job.cluster.procs_per_node or 1)

    def answering(self, names: list[str]) -> list[str]:
        return self.machines.answering(names)

    def start(self, name: str, start: int, members: list[str]) -> Node:
        node = len(self.nodes)  # a place of its own until it joins (its ranks' log and failure files)
        args = NodeArgs(
            self.job.run_dir, node + 1, node, self.endpoint, self.launch_id, "", attempt=self.attempt,
            members=",".join(members), start=start, words=tuple(entry_argv(self.job)),
        )  # fmt: skip
        return self.machines.start(args, name)


def run_attempt(
    machines: Machines,
    job: JobConfig,
    members: Membership,
    placement: Placement,
    secret: Secret,
    keeper: Keeper = KeeperClient,
) -> Ended:
    """One attempt on ``placement``'s machines, to its end (said): its exit code and the machines lost."""
    launch_id, attempt, names = uuid.uuid4().hex[:12], members.attempt, placement.names
    at, client = placement.keeper, None
    if at is not None:  # healing in place: the keeper holds the job's store and decides the rounds
        lost_after = job.cluster.lost_after_s
        client = keeper(at.prefix, at.addr, at.port, attempt, members.min_nodes, lost_after, names, secret)
    endpoint = placement.store if client is None else client.endpoint
    nodes: list[Node] = []
    try:
        where = f"on every {machines.where}"  # a second stop: its word again (each node's agent names the signal)
        forward = forwarding_stops(lambda word: request_all(nodes, word), where, then_of(job), Control.stop_for)
        with forward as stops:
            for position, name in enumerate(names):
                heal = ",".join(names) if client is not None else ""
                args = NodeArgs(
                    job.run_dir, len(names), position, endpoint, launch_id, "", attempt=attempt, members=heal,
                    words=tuple(entry_argv(job)),
                )  # fmt: skip
                nodes.append(machines.start(args, name))
            if stops:  # a stop signal while the nodes were being started
                request_all(nodes, Control.stop_for(stops[0]))
            healing = None
            if client is not None:
                joiner = Joiner(machines, job, endpoint, launch_id, attempt, nodes, placement.rejoin_every_s)
                healing = HealingAttempt(client, members, joiner)
            with heartbeats(nodes):
                ended = lambda: hang_ended(job.run, launch_id, attempt)  # noqa: E731
                out = wait_for_nodes(nodes, names, machines.lost, ended, healing, stopping=lambda: bool(stops))
    finally:
        if client is not None:
            client.close()
    for node in nodes:
        node.finish()
    end = said_end(machines, job, launch_id, out, stops, healing=client is not None)
    return end if end.final else replace(end, failures=load_attempt(job.run, launch_id, attempt))


def then_of(job: JobConfig) -> str:
    """What a job's ranks do once a stop is passed on to them (said by the head)."""
    if job.script is None:
        return "the ranks checkpoint"
    return f"the script's ranks get it, and {job.cluster.stop_grace_s:g} s to exit: cluster.stop_grace_s"


def request_all(nodes: list[Node], word: Control) -> None:
    """``word`` to every node process (the list may grow meanwhile: the attempt's start, a joiner)."""
    for node in list(nodes):
        node.request(word)


@contextlib.contextmanager
def heartbeats(nodes: list[Node]) -> Iterator[None]:
    """``PING`` to every node every ``HEAD_PING_S`` (the list may grow): over ssh a node that hears nothing for
    ``cluster.heartbeat_timeout_s`` stops its ranks (its host cannot reach us, so nobody else would stop them)."""
    done = threading.Event()

    def beat() -> None:
        while not done.wait(HEAD_PING_S):
            request_all(nodes, Control.PING)

    thread = threading.Thread(target=beat, name="heartbeats", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def said_end(
    machines: Machines, job: JobConfig, launch_id: str, out: Outcome, stops: list[int], healing: bool
) -> Ended:
    """The attempt's end, said once: a stop (the stop line), success, machines lost without healing (named; their
    peers, ended by the head, are not blamed), or a failure (the job's report, root cause first)."""
    code = 128 + stops[0] if stops else out.codes[out.first] if out.first >= 0 else 0
    if stops or code in STOP_CODES:  # the head's own signal, or the nodes'
        print_stopped(code, job, launch_id)  # (a script's: how each rank ended, as their agents recorded it)
        return Ended(code, final=True)
    if code == 0:
        return Ended(0, final=True)
    gone = {i: why for i, c in enumerate(out.codes) if (why := machines.lost(c)) and i not in out.stopped | out.lost}
    logs = job.run.logs
    if gone and not healing:  # the other ranks were ended by the head (ABORT): a report would blame them
        for index, why in gone.items():
            print(f"launcher: node {index} ({out.names[index]}): {why}", file=sys.stderr)
        print(
            f"launcher: the ranks on the other {machines.where}s were ended (they waited for "
            f"{', '.join(out.names[i] for i in gone)} in collectives); their logs: {logs}",
            file=sys.stderr,
        )
    elif not out.keeper_ended and not report_failures(job.run, launch_id):
        what = "process" if healing else "agent"
        print(
            f"launcher: node {out.first}'s {what} on {out.names[out.first]} exited with code {code} (no rank recorded "
            f"a failure; see {logs})",
            file=sys.stderr,
        )
    return Ended(1, lost={out.names[i]: why for i, why in gone.items()})
