"""The head's side of healing in place (sim and ssh; ``config.rules.heals_in_place`` says when a job heals): it
starts the attempt's keeper (``keeper.py``) off the training machines and hands it the job's secret, tells it at
once when a node process ends by a signal nobody sent (the machine is gone), starts a node process for a lost
machine that answers again (``Rejoin``), and waits for the nodes (``wait_healing``): a lost node's survivors go on,
so its loss is not the attempt's end; each decision is said on the console (the ranks record it). No torch here."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional, Protocol

from launcher.base.exiting import children
from launcher.base.liveness import AFTER_FAILURE_GRACE_S
from launcher.heal.membership import Membership
from launcher.heal.protocol import ROUND_WORD, Decision, Join, Lost
from launcher.report.failures import STOP_CODES
from launcher.trust.secret import Secret


class KeeperClient:
    """The head's handle on the keeper process of one attempt: ``prefix`` runs it where the nodes reach ``addr``
    (the bridge namespace of simulated nodes), listening on ``port``; the job's ``secret`` goes in its environment."""

    def __init__(  # noqa: PLR0913
        self,
        prefix: list[str],
        addr: str,
        port: int,
        attempt: int,
        min_nodes: int,
        lost_after_s: float,
        names: list[str],
        secret: Secret,
    ) -> None:
        argv = [sys.executable, "-u", "-m", "launcher.heal.keeper", addr, str(port), str(attempt), str(min_nodes)]
        self.proc = subprocess.Popen(
            [*prefix, *argv, f"{lost_after_s:g}", *names],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **secret.environ()},
        )
        self.endpoint = f"{addr}:{port}"

    def lose(self, name: str, why: str) -> None:
        """Tell the keeper ``name`` is gone (now)."""
        self._say(Lost(name, time.time(), why).line())

    def join(self, name: str, start: int, ranks: int, answered: float) -> None:
        """Tell the keeper that ``name``'s machine answered again at ``answered`` and its node process (``start``,
        ``ranks`` ranks) is starting: it joins once they are ready."""
        self._say(Join(name, start, ranks, answered).line())

    def _say(self, line: str) -> None:
        with contextlib.suppress(OSError, ValueError):  # the keeper is gone: the head sees that too
            assert self.proc.stdin is not None
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()

    def read(self, put: Callable[[tuple], None]) -> None:
        """Each decision as ``("round", Decision)``, then ``("keeper", exit code)`` when it ends."""

        def run() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                word, _, rest = line.partition(" ")
                if word == ROUND_WORD:
                    put(("round", Decision.from_bytes(rest.encode())))
            put(("keeper", self.proc.wait()))

        threading.Thread(target=run, name="keeper-read", daemon=True).start()

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # the end of input ends it
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def apply(members: Membership, decision: Decision) -> bool:
    """The keeper's ``decision``, said, and the next restart (if any) runs on its members. False when too few nodes
    are left (the job stops; no restart either)."""
    names = ", ".join(f"{n} ({why})" for n, why in decision.lost.items())
    if decision.stop:
        print(f"launcher: lost {names}: {decision.stop}; the job stops", file=sys.stderr)
        members.spent_restarts = members.max_restarts  # too few machines: no restart either
        return False
    members.live = list(decision.members)
    members.all += [name for name in decision.joined if name not in members.all]
    what = f"lost {names}: the survivors heal in place" if names else f"{', '.join(decision.joined)} joined"
    print(
        f"launcher: {what}, continuing on {len(members.live)} of {len(members.all)} nodes (round {decision.round}, "
        f"cluster.min_nodes={members.min_nodes})",
        file=sys.stderr,
    )
    return True


def kill_tree(proc: subprocess.Popen) -> None:
    """End a lost node's process and whatever it started, at once (it may be frozen: SIGKILL reaches it)."""
    for pid in [*children(proc.pid), proc.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class Rejoin(Protocol):
    """How a mode brings a lost machine back (ssh: the host checks; ``wait_healing``): each node process's
    ``ranks``, how often the lost machines are checked (``every_s``, 0: never), which answer, and a node process
    for one that does."""

    @property
    def ranks(self) -> int: ...
    @property
    def every_s(self) -> float: ...

    def answering(self, names: list[str]) -> list[str]:
        """Which of the lost ``names`` answer now (it may take a while: the checks)."""
        ...

    def start(self, name: str, start: int, members: list[str]) -> subprocess.Popen:
        """``name``'s node process, joining (``start``: its number in the attempt; ``members``: the round it expects
        to join, itself last)."""
        ...


@dataclass
class Outcome:
    codes: list[int]  # each node process's exit code (in the order started: the attempt's nodes, then joiners)
    names: list[str]  # each node process's node
    first: int = -1  # the node process that failed first (-1: none; a lost node is not a failure)
    lost: set[int] = field(default_factory=set)  # node processes declared lost (the job went on without them)
    keeper_ended: bool = False  # the keeper (the job's store) ended under a running job


@dataclass
class Waiting:
    """``wait_healing``'s state, one method per event: a node process ended, a lost machine answers, the keeper
    decided a round, the keeper ended."""

    procs: list[subprocess.Popen]
    keeper: KeeperClient
    members: Membership
    stop: Callable[[subprocess.Popen], None]
    lost_by_signal: Callable[[int], str]
    rejoin: Optional[Rejoin]
    hang_ended: Callable[[], bool] = lambda: False  # the progress watch ended a hang (``failures.hang_ended``)
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    out: Outcome = field(default_factory=lambda: Outcome(codes=[], names=[]))
    running: set[int] = field(default_factory=set)
    joining: dict[int, str] = field(default_factory=dict)  # node process -> its node, until the round with it
    starts: int = 0  # node processes started in the attempt beyond the first (their node_id's number)
    deadline: Optional[float] = None  # the others are stopped then (a failure, too few left, the keeper gone)
    deadline_why: str = ""
    done: threading.Event = field(default_factory=threading.Event)

    def started(self, proc: subprocess.Popen, name: str) -> None:
        index = len(self.out.codes)
        self.out.codes.append(0)
        self.out.names.append(name)
        self.running.add(index)
        threading.Thread(target=lambda: self.events.put(("exit", index, proc.wait())), daemon=True).start()

    def check_lost(self) -> None:
        """Check the lost machines every ``rejoin.every_s`` (those not joining already): ``("answers", name, time)``
        for each one that answers."""
        rejoin = self.rejoin
        if rejoin is None or not rejoin.every_s:
            return

        def run() -> None:
            while not self.done.wait(rejoin.every_s):
                lost = [n for n in self.members.all if n not in self.members.live and n not in self.joining.values()]
                for name in rejoin.answering(lost) if lost else []:
                    self.events.put(("answers", name, time.time()))

        threading.Thread(target=run, name="rejoin-checks", daemon=True).start()

    def stop_at(self, deadline: float, why: str) -> None:
        if self.deadline is None:
            self.deadline, self.deadline_why = deadline, why

    def on_exit(self, index: int, code: int) -> None:
        out = self.out
        self.running.discard(index)
        out.codes[index] = code
        if index in self.joining:
            name = self.joining.pop(index)
            print(f"launcher: {name} did not join (its node process ended with code {code})", file=sys.stderr)
            self.keeper.lose(name, "its node process ended before it joined")
            return
        if index in out.lost or code == 0:
            return
        why = self.lost_by_signal(code)
        if why and out.first < 0 and self.deadline is None:
            self.keeper.lose(out.names[index], why)  # the keeper decides; the survivors heal
            return
        if out.first < 0:
            out.first = index
        if code not in STOP_CODES and self.hang_ended():  # its culprit will not end on its own
            self.stop_at(time.monotonic(), "at once: the progress watch ended a hang")
        elif code not in STOP_CODES:
            self.stop_at(time.monotonic() + AFTER_FAILURE_GRACE_S, f"{AFTER_FAILURE_GRACE_S:.0f} s after the failure")

    def on_answers(self, name: str, answered: float) -> None:
        if self.rejoin is None or self.deadline is not None:
            return
        if name in self.members.live or name in self.joining.values():
            return
        self.starts += 1
        self.procs.append(self.rejoin.start(name, self.starts, [*self.members.live, name]))
        self.joining[len(self.out.codes)] = name
        self.started(self.procs[-1], name)
        self.keeper.join(name, self.starts, self.rejoin.ranks, answered)
        print(f"launcher: {name} answers again: starting its ranks to join the job in place", file=sys.stderr)

    def on_round(self, decision: Decision) -> None:
        self.joining = {i: n for i, n in self.joining.items() if n not in decision.joined}
        names = self.out.names
        positions = {i for i, name in enumerate(names) if name in decision.lost and i not in self.joining}
        self.out.lost |= positions
        for index in positions & self.running:
            kill_tree(self.procs[index])
        if not apply(self.members, decision) and self.deadline is None:
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


def wait_healing(
    procs: list[subprocess.Popen],
    names: list[str],
    keeper: KeeperClient,
    members: Membership,
    stop: Callable[[subprocess.Popen], None],
    lost_by_signal: Callable[[int], str],
    rejoin: Optional[Rejoin] = None,
    hang_ended: Callable[[], bool] = lambda: False,
) -> Outcome:
    """Wait for an attempt's node processes while the job heals: a node ended by a signal nobody here sent
    (``lost_by_signal(code)``: why, or "" when the code is no loss) is reported to the keeper, whose decisions drop
    nodes (a lost one still running, frozen or cut off, is killed); a failure ends the attempt as ``wait_nodes``
    does (the others get ``AFTER_FAILURE_GRACE_S``, then ``stop``), and so does the keeper's end or its verdict that
    too few nodes are left. With ``rejoin``, a lost machine that answers again gets a node process that joins the
    job at a step boundary; one that ends before it joined is no failure (the job goes on without it). After a hang
    the progress watch ended (``hang_ended()``) the others are stopped at once."""
    wait = Waiting(procs, keeper, members, stop, lost_by_signal, rejoin, hang_ended)
    for proc, name in zip(procs, names):
        wait.started(proc, name)
    keeper.read(wait.events.put)
    wait.check_lost()
    handlers: dict[str, Callable[..., None]] = {
        "exit": wait.on_exit,
        "answers": wait.on_answers,
        "round": wait.on_round,
        "keeper": wait.on_keeper,
    }
    stopping = False
    while wait.running - set(wait.joining):
        try:
            timeout = None if wait.deadline is None or stopping else max(0.0, wait.deadline - time.monotonic())
            kind, *what = wait.events.get(timeout=timeout)
        except queue.Empty:
            print(f"launcher: stopping the nodes still running {wait.deadline_why}", file=sys.stderr)
            for index in wait.running:
                stop(procs[index])
            stopping = True
            continue
        handlers[kind](*what)
    wait.done.set()
    for index in list(wait.joining):  # the job ended before they joined
        stop(procs[index])
        procs[index].wait()
    out = wait.out
    if out.keeper_ended:  # not a stop: the attempt failed (a restart from the checkpoint, if cluster.max_restarts)
        out.codes[out.first] = 1
    return out
