"""The head's side of healing in place (sim and ssh; ``config.rules.heal_off_reason`` says when a job heals): it
starts the attempt's keeper (``launch/keeper.py``) off the training machines, tells it at once when a node process
ends by a signal nobody sent (the machine is gone), and waits for the nodes (``wait_healing``): a lost node's
survivors go on, so its loss is not the attempt's end; each decision is said on the console (the ranks record it
in ``membership.jsonl``, with the step they continue from). No torch here."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..exiting import children
from ..failures import STOP_CODES
from ..membership import Membership
from .head import AFTER_FAILURE_GRACE_S


class Keeper:
    """The keeper process of one attempt: ``prefix`` runs it where the nodes reach ``addr`` (the bridge namespace
    of simulated nodes), listening on ``port``."""

    def __init__(  # noqa: PLR0913
        self,
        prefix: list[str],
        addr: str,
        port: int,
        attempt: int,
        min_nodes: int,
        lost_after_s: float,
        names: list[str],
    ) -> None:
        argv = [sys.executable, "-u", "-m", "launcher.launch.keeper", addr, str(port), str(attempt), str(min_nodes)]
        self.proc = subprocess.Popen(
            [*prefix, *argv, f"{lost_after_s:g}", *names], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.endpoint = f"{addr}:{port}"

    def lose(self, name: str, why: str) -> None:
        """Tell the keeper ``name`` is gone (now)."""
        with contextlib.suppress(OSError, ValueError):  # the keeper is gone: the head sees that too
            assert self.proc.stdin is not None
            self.proc.stdin.write(f"LOST {name} {time.time():.3f} {why}\n")
            self.proc.stdin.flush()

    def read(self, put: Callable[[tuple], None]) -> None:
        """Each decision as ``("round", decision)``, then ``("keeper", exit code)`` when it ends."""

        def run() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                word, _, rest = line.partition(" ")
                if word == "ROUND":
                    put(("round", json.loads(rest)))
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


def kill_tree(proc: subprocess.Popen) -> None:
    """End a lost node's process and whatever it started, at once (it may be frozen: SIGKILL reaches it)."""
    for pid in [*children(proc.pid), proc.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@dataclass
class Outcome:
    codes: list[int]  # each node process's exit code (node order)
    first: int = -1  # the node that failed first (-1: none; a lost node is not a failure)
    lost: set[int] = field(default_factory=set)  # positions the keeper declared lost (the job went on without them)
    keeper_ended: bool = False  # the keeper (the job's store) ended under a running job


def wait_healing(
    procs: list[subprocess.Popen],
    names: list[str],
    keeper: Keeper,
    members: Membership,
    stop: Callable[[subprocess.Popen], None],
    lost_by_signal: Callable[[int], str],
) -> Outcome:
    """Wait for an attempt's node processes while the job heals: a node ended by a signal nobody here sent
    (``lost_by_signal(code)``: why, or "" when the code is no loss) is reported to the keeper, whose decisions drop
    nodes (a lost one still running, frozen or cut off, is killed); a failure ends the attempt as ``wait_nodes``
    does (the others get ``AFTER_FAILURE_GRACE_S``, then ``stop``), and so does the keeper's end or its verdict that
    too few nodes are left."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    for index, proc in enumerate(procs):
        threading.Thread(target=lambda n=index, p=proc: events.put(("exit", n, p.wait())), daemon=True).start()
    keeper.read(events.put)
    out = Outcome(codes=[0] * len(procs))
    running, deadline, stopping, deadline_why = set(range(len(procs))), None, False, ""
    while running:
        try:
            wait_s = None if deadline is None or stopping else max(0.0, deadline - time.monotonic())
            kind, *what = events.get(timeout=wait_s)
        except queue.Empty:
            print(f"launcher: stopping the nodes still running {deadline_why}", file=sys.stderr)
            for index in running:
                stop(procs[index])
            stopping = True
            continue
        if kind == "exit":
            index, code = what
            running.discard(index)
            out.codes[index] = code
            if index in out.lost or code == 0:
                continue
            why = lost_by_signal(code)
            if why and out.first < 0 and deadline is None:
                keeper.lose(names[index], why)  # the keeper decides; the survivors heal
                continue
            if out.first < 0:
                out.first = index
            if deadline is None and code not in STOP_CODES:
                deadline = time.monotonic() + AFTER_FAILURE_GRACE_S
                deadline_why = f"{AFTER_FAILURE_GRACE_S:.0f} s after the failure"
        elif kind == "round":
            decision = what[0]
            positions = {names.index(name) for name in decision["lost"]}
            out.lost |= positions
            for index in positions & running:
                kill_tree(procs[index])
            if not members.healed(decision) and deadline is None:
                out.first = min(positions) if out.first < 0 else out.first
                deadline, deadline_why = time.monotonic(), "at once: too few nodes are left"
        elif kind == "keeper" and running and deadline is None:
            print(
                f"launcher: the keeper (the job's store, on the head's host) ended with code {what[0]} under a running "
                "job: stopping it",
                file=sys.stderr,
            )
            out.keeper_ended, deadline, deadline_why = True, time.monotonic(), "at once: the job's store is gone"
            out.first = min(running)
    if out.keeper_ended:  # not a stop: the attempt failed (a restart from the checkpoint, if cluster.max_restarts)
        out.codes[out.first] = 1
    return out
