"""The head's wait for one attempt's node processes, plain or healing in place: one loop over one state
(``Waiting``), one method per event: a node process ended, and in a job that heals the keeper decided a round, the
keeper ended, a lost machine answers again.

A failure ends the attempt: the others get ``AFTER_FAILURE_GRACE_S`` to end on their own (their collectives fail
fast once a peer is gone), then are stopped; at once after a hang the progress watch ended (its culprit will not end
on its own). A node process stopped by a stop signal (exit 130 / 143 / 129) starts no grace: the others are
stopping too; nor does any node's end once the head has passed a stop on (``stopping``): each node's agent gives its
ranks ``cluster.stop_grace_s`` and kills what is left, and an early end (a script's rank that failed on its peers'
exit) must not cut the others' grace short.
A machine lost (``lost_by(code)``: its node process ended by a signal nobody here sent, its ssh connection dropped):
without healing its peers wait for it in collectives and can agree on no checkpoint, so they are ended at once
(``Control.ABORT``); healing in place, the keeper is told, and its decisions drop nodes (``Membership.apply``; a
lost one still running, frozen or cut off, is killed) or add one that answered again (``Rejoin``): the survivors go
on, so a loss is not the attempt's end. No torch here."""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional, Protocol

from launcher.base.liveness import AFTER_FAILURE_GRACE_S
from launcher.heal.head_side import KeeperClient
from launcher.heal.protocol import Decision
from launcher.launch.nodes.control import Control, Node
from launcher.launch.nodes.restarts import Membership
from launcher.report.stops import STOP_CODES


class Rejoin(Protocol):
    """How a lost machine comes back during a healing attempt (ssh: the host checks): how often the lost machines
    are checked (``every_s``, 0: never), which answer, a node process for one that does, and its ``ranks``."""

    @property
    def every_s(self) -> float: ...
    @property
    def ranks(self) -> int: ...

    def answering(self, names: list[str]) -> list[str]:
        """Which of the lost ``names`` answer now (it may take a while: the checks)."""
        ...

    def start(self, name: str, start: int, members: list[str]) -> Node:
        """``name``'s node process, joining (``start``: its number in the attempt; ``members``: the round it expects
        to join, itself last)."""
        ...


@dataclass
class HealingAttempt:
    """What a healing attempt's wait has beyond a plain one's: the keeper, the membership its decisions change, and
    how a lost machine comes back (None: it does not during the attempt)."""

    keeper: KeeperClient
    members: Membership
    rejoin: Optional[Rejoin] = None


@dataclass
class Outcome:
    codes: list[int]  # each node process's exit code (in the order started: the attempt's nodes, then joiners)
    names: list[str]  # each node process's node
    first: int = -1  # the node process that failed first (-1: none; a node healed away is not a failure)
    lost: set[int] = field(default_factory=set)  # node processes the keeper declared lost (the job went on)
    stopped: set[int] = field(default_factory=set)  # node processes the head stopped (after a failure, ...)
    keeper_ended: bool = False  # the keeper (the job's store) ended under a running job


@dataclass
class Waiting:
    """``wait_for_nodes``' state: the attempt's node processes (``nodes``: the list grows with joiners, as the head's
    stop forwarding and heartbeats see it), what is known of each, and when the others are stopped."""

    nodes: list[Node]
    lost_by: Callable[[int], str]
    hang_ended: Callable[[], bool]  # the progress watch ended a hang (``failures.hang_ended``)
    healing: Optional[HealingAttempt]
    stopping: Callable[[], bool] = lambda: False  # the head passed a stop on: the nodes are in their ranks' grace
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    out: Outcome = field(default_factory=lambda: Outcome(codes=[], names=[]))
    running: set[int] = field(default_factory=set)
    joining: dict[int, str] = field(default_factory=dict)  # node process -> its node, until the round with it
    starts: int = 0  # node processes started in the attempt beyond the first (their node_id's number)
    deadline: Optional[float] = None  # the others are stopped then (a failure, a loss, too few left, no keeper)
    deadline_why: str = ""
    abort: bool = False  # a machine was lost without healing: the others are ended at once (``Control.ABORT``)
    done: threading.Event = field(default_factory=threading.Event)

    def started(self, node: Node, name: str) -> None:
        index = len(self.out.codes)
        self.out.codes.append(0)
        self.out.names.append(name)
        self.running.add(index)
        threading.Thread(target=lambda: self.events.put(("exit", index, node.wait())), daemon=True).start()

    def stop(self, index: int) -> None:
        self.out.stopped.add(index)
        self.nodes[index].request(Control.ABORT if self.abort else Control.TERM)

    def stop_at(self, deadline: float, why: str) -> None:
        if self.deadline is None:
            self.deadline, self.deadline_why = deadline, why

    def check_lost(self, healing: HealingAttempt) -> None:
        """Check the lost machines every ``rejoin.every_s`` (those not joining already): ``("answers", name, time)``
        for each one that answers."""
        rejoin = healing.rejoin
        if rejoin is None or not rejoin.every_s:
            return

        def run() -> None:
            while not self.done.wait(rejoin.every_s):
                live, joining = healing.members.live, self.joining.values()
                lost = [n for n in healing.members.all if n not in live and n not in joining]
                for name in rejoin.answering(lost) if lost else []:
                    self.events.put(("answers", name, time.time()))

        threading.Thread(target=run, name="rejoin-checks", daemon=True).start()

    def on_exit(self, index: int, code: int) -> None:
        out = self.out
        self.running.discard(index)
        out.codes[index] = code
        if index in self.joining and self.healing is not None:
            name = self.joining.pop(index)
            print(f"launcher: {name} did not join (its node process ended with code {code})", file=sys.stderr)
            self.healing.keeper.lose(name, "its node process ended before it joined")
            return
        if index in out.lost or code == 0:
            return
        why = self.lost_by(code)
        if why and self.healing is not None and out.first < 0 and self.deadline is None:
            self.healing.keeper.lose(out.names[index], why)  # the keeper decides; the survivors heal
            return
        if out.first < 0:
            out.first = index
        if self.stopping():  # every node is stopping, each within its ranks' grace
            return
        if why and self.healing is None:  # its peers wait for it in collectives: no grace, no checkpoint
            self.abort = True
            self.deadline, self.deadline_why = time.monotonic(), "at once: they wait for a lost machine"
        elif code not in STOP_CODES and self.hang_ended():  # its culprit will not end on its own
            self.stop_at(time.monotonic(), "at once: the progress watch ended a hang")
        elif code not in STOP_CODES:
            self.stop_at(time.monotonic() + AFTER_FAILURE_GRACE_S, f"{AFTER_FAILURE_GRACE_S:.0f} s after the failure")

    def on_answers(self, name: str, answered: float) -> None:
        healing = self.healing
        if healing is None or healing.rejoin is None or self.deadline is not None:
            return
        if name in healing.members.live or name in self.joining.values():
            return
        self.starts += 1
        self.nodes.append(healing.rejoin.start(name, self.starts, [*healing.members.live, name]))
        self.joining[len(self.out.codes)] = name
        self.started(self.nodes[-1], name)
        healing.keeper.join(name, self.starts, healing.rejoin.ranks, answered)
        print(f"launcher: {name} answers again: starting its ranks to join the job in place", file=sys.stderr)

    def on_round(self, decision: Decision) -> None:
        assert self.healing is not None
        self.joining = {i: n for i, n in self.joining.items() if n not in decision.joined}
        names = self.out.names
        positions = {i for i, name in enumerate(names) if name in decision.lost and i not in self.joining}
        self.out.lost |= positions
        for index in positions & self.running:
            self.nodes[index].kill()
        if not self.healing.members.apply(decision) and self.deadline is None:
            self.out.first = min(positions) if self.out.first < 0 else self.out.first
            self.stop_at(time.monotonic(), "at once: too few nodes are left")

    def on_keeper(self, code: int) -> None:
        if not self.running or self.deadline is not None:
            return
        print(
            f"launcher: the keeper (the job's store, on the head's host) ended with code {code} under a running job: "
            "stopping it",
            file=sys.stderr,
        )
        self.out.keeper_ended = True
        self.out.first = min(self.running)
        self.stop_at(time.monotonic(), "at once: the job's store is gone")


def wait_for_nodes(
    nodes: list[Node],
    names: list[str],
    lost_by: Callable[[int], str],
    hang_ended: Callable[[], bool] = lambda: False,
    healing: Optional[HealingAttempt] = None,
    stopping: Callable[[], bool] = lambda: False,
) -> Outcome:
    """Wait for an attempt's node processes (``nodes``, on the machines ``names``) until every one has ended; a
    joiner still waiting to join when the job ends is stopped. Returns each one's exit code, the first failure, and
    which were lost, or stopped by the head. ``stopping``: the head has passed a stop on (no failure stops the
    others then: they are in their grace)."""
    state = Waiting(nodes, lost_by, hang_ended, healing, stopping=stopping)
    for node, name in zip(list(nodes), names):
        state.started(node, name)
    if healing is not None:
        healing.keeper.read(state.events.put)
        state.check_lost(healing)
    handlers: dict[str, Callable[..., None]] = {
        "exit": state.on_exit,
        "answers": state.on_answers,
        "round": state.on_round,
        "keeper": state.on_keeper,
    }
    stopped_them = False  # (the deadline passed: the nodes still running were stopped)
    while state.running - set(state.joining):
        try:
            deadline = None if stopped_them or state.stopping() else state.deadline  # (a stop: the nodes' own grace)
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            kind, *what = state.events.get(timeout=timeout)
        except queue.Empty:
            if state.stopping():  # passed on while this waited: the nodes end within their ranks' grace
                continue
            print(f"launcher: stopping the nodes still running {state.deadline_why}", file=sys.stderr)
            for index in sorted(state.running):
                state.stop(index)
            stopped_them = True
            continue
        handlers[kind](*what)
    state.done.set()
    for index in list(state.joining):  # the job ended before they joined
        state.stop(index)
        nodes[index].wait()
    out = state.out
    if out.keeper_ended:  # not a stop: the attempt failed (a restart from the checkpoint, if cluster.max_restarts)
        out.codes[out.first] = 1
    return out
