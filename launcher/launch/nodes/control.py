"""The head of a several-node job (``+cluster=sim``, ``+cluster=ssh``) and its node processes (``nodes/process.py``,
one per machine, running torch's elastic agent or a healing job's ranks): what the head writes to one
(``Control``; what it starts one with is ``base/node_args.py``'s ``NodeArgs``), how it holds one
(``Node``; ``ProcessNode`` for a process of this host) and stop signals passed on (``forwarding_stops``; the stop
signals and the line a stopped job ends with: ``report/stops.py``). The attempts themselves: ``attempts.py``. No torch
here: the head only starts and watches processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

from launcher.base.exiting import children
from launcher.report.stops import STOP_SIGNALS


class Control(str, Enum):
    """What the head writes to a node process's stdin (``NodeArgs.stdin_control``), one word per line."""

    INT = "INT"  # stop the job as SIGINT would: the ranks agree on a step, checkpoint, exit 130 (a script's get it)
    TERM = "TERM"  # the same as SIGTERM (exit 143)
    HUP = "HUP"  # the same as SIGHUP (exit 129)
    ABORT = "ABORT"  # kill the ranks at once: another machine is lost (no checkpoint can be agreed)
    PING = "PING"  # a heartbeat: the head is there (silence for cluster.heartbeat_timeout_s stops the node)

    @classmethod
    def stop_for(cls, signum: int) -> Control:
        """The word that stops a node as ``signum`` (SIGINT / SIGTERM / SIGHUP) stops the head."""
        return {signal.SIGINT: cls.INT, signal.SIGHUP: cls.HUP}.get(signal.Signals(signum), cls.TERM)

    @property
    def signum(self) -> signal.Signals:
        """The signal a stop word stands for (``ABORT``: SIGTERM, to a node process of this host). A stop word to a
        node already stopping is a second stop: its ranks are ended at once, said with that signal's name."""
        return {Control.INT: signal.SIGINT, Control.HUP: signal.SIGHUP}.get(self, signal.SIGTERM)

    def line(self) -> bytes:
        return f"{self.value}\n".encode()


class Node(Protocol):
    """One node process as the head holds it (``ProcessNode``: the process itself, sim; ``ssh.clients.SshNode``:
    its ssh client): the attempt loop (``nodes/attempts.py``) waits for it, writes it ``Control`` words, kills it
    when its machine is lost, and finishes with it once the attempt is over."""

    def wait(self) -> int:
        """Its exit code, once it has ended."""
        ...

    def request(self, word: Control) -> None:
        """``INT`` / ``TERM``: stop its ranks as that signal would; ``ABORT``: at once; ``PING``: a heartbeat."""
        ...

    def kill(self) -> None:
        """End it and whatever it started at once (its machine is lost: it may be frozen)."""
        ...

    def finish(self) -> None:
        """After the attempt: what is left of it here (its output relayed to the end)."""
        ...


def kill_tree(proc: subprocess.Popen) -> None:
    """End a lost node's process and whatever it started, at once (it may be frozen: SIGKILL reaches it)."""
    for pid in [*children(proc.pid), proc.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@dataclass
class ProcessNode:
    """A ``Node`` that is a process of this host (a simulated node's, in a session of its own: a stop reaches it from
    the head only, once): a stop word is its signal (``ABORT`` too is SIGTERM: its agent ends the ranks, at once
    when they are in a stop's grace already), a heartbeat is nothing (no link to lose)."""

    proc: subprocess.Popen

    def wait(self) -> int:
        return self.proc.wait()

    def request(self, word: Control) -> None:
        if word is not Control.PING:
            self.proc.send_signal(word.signum)  # (nothing once it has ended)

    def kill(self) -> None:
        kill_tree(self.proc)

    def finish(self) -> None:
        pass


def abort(signum: int) -> Control:
    """A second stop signal's word where no node can name it (Slurm's head: every task killed at once)."""
    return Control.ABORT


@contextlib.contextmanager
def forwarding_stops(
    send: Callable[[Control], None], where: str, then: str, second: Callable[[int], Control] = abort
) -> Iterator[list[int]]:
    """While the head waits, SIGINT / SIGTERM / SIGHUP to it are passed on as a stop (``send(Control.INT, TERM or
    HUP)``: the nodes' ranks agree on a step, checkpoint and exit 130 / 143 / 129; a script's get the signal and
    their grace) instead of ending the head alone, which left the nodes training headless; a second one ends the
    job at once (``send(second(signum))``: the several-node heads send its stop word again, so that each node's
    agent ends its ranks naming the signal sent, not ABORT's SIGTERM: issue 60, item 6). ``then``: what the ranks
    do, said. Yields the signals got (the caller stops what it starts later)."""
    got: list[int] = []

    def forward(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if not got:
            print(f"launcher: {name}: stopping the job {where} ({then})", file=sys.stderr, flush=True)
            send(Control.stop_for(signum))
        elif len(got) == 1:
            print(f"launcher: a second stop signal ({name}): ending the job {where} at once", file=sys.stderr)
            send(second(signum))
        got.append(signum)

    previous = {s: signal.signal(s, forward) for s in STOP_SIGNALS}
    try:
        yield got
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
