"""The keeper of a job that heals in place (``cluster.min_nodes`` < ``cluster.nodes``, the built-in trainer, sim
and ssh): one small process started by the head for each attempt, off every training machine (on the head's host;
for simulated nodes in their own namespaces, on the bridge between them), so that losing any machine, the first
included, leaves it standing.

It hosts the job's store (the ranks' rendezvous and every round after it: ``rendezvous.next_round``), hears each
node process's heartbeat (``HEARTBEAT_KEY``, every ``BEAT_S``) and decides the rounds (``membership.Rounds``): a node
is lost when its heartbeat has been silent for ``cluster.lost_after_s`` (a frozen machine, a link down; not one
whose ranks ended, which says so: ``DONE_KEY``), or at once when the head says so (its node process ended by a
signal: ``LOST`` on stdin). A machine that answers again joins: the head starts a node process for it and says
``JOIN`` (``healing.Keeper.join``); once all its ranks are ready (``READY_KEY``: set up, waiting), the round ends
with it as the next one's last member, and the new ranks learn their round (``JOINED_KEY``). Each decision goes
into the store (``ROUND_END_KEY``: the ranks leave the round, broken or not, and form the next one) and to the head
(stdout). Every key of a node process carries its ``membership.node_id``: a cut-off process that answers again is
not the one started after it.

``python -m launcher.launch.keeper ADDR PORT ATTEMPT MIN_NODES LOST_AFTER_S NAME...`` (built by ``healing.Keeper``);
stdout: one ``ROUND <json>`` line per decision; stdin: ``LOST <name> <time> <why>`` and ``JOIN <name> <start>
<ranks> <time>`` lines; the end of input ends it.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from ..membership import DONE_KEY, HEARTBEAT_KEY, JOINED_KEY, READY_KEY, ROUND_END_KEY, Rounds, node_id
from ..rendezvous import attempt_prefix, listening_store

BEAT_S = 0.5  # how often a node process beats (launch/workers.py)
LOOK_S = 0.1  # how often the keeper looks at the heartbeats and at what the head said


def read_head(lines: queue.SimpleQueue) -> None:
    """The head's lines onto ``lines``: ``("LOST", name, time, why)``, ``("JOIN", name, start, procs, time)``; None
    at the end of input (the head is gone: the keeper ends)."""
    for line in sys.stdin:
        word, _, rest = line.strip().partition(" ")
        if word == "LOST":
            name, at, why = rest.split(" ", 2)
            lines.put((word, name, float(at), why))
        elif word == "JOIN":
            name, start, procs, at = rest.split(" ")
            lines.put((word, name, int(start), int(procs), float(at)))
    lines.put(None)


@dataclass
class Ledger:
    """The rounds, and what the keeper knows of each node process: its heartbeat, and those waiting to join."""

    view: dist.Store  # the attempt's keys
    rounds: Rounds
    silence: float  # cluster.lost_after_s
    starts: dict[str, int] = field(default_factory=dict)  # a member -> its node process's start (node_id)
    heard: dict[str, tuple[int, float]] = field(default_factory=dict)  # a member -> (its counter, when it changed)
    joining: dict[str, tuple[int, int, float]] = field(default_factory=dict)  # name -> (start, ranks, answered at)

    def silent(self, now: float) -> tuple[dict[str, str], float]:
        """The members whose heartbeat has been silent too long (name -> why), and the earliest it stopped."""
        lost, since = {}, now
        for name in self.rounds.live:
            me = node_id(name, self.starts.get(name, 0))
            count = self.view.add(HEARTBEAT_KEY.format(me), 0)
            if count and count != self.heard.get(name, (0, 0.0))[0]:
                self.heard[name] = (count, now)
            elif count and now - self.heard[name][1] > self.silence and not self.view.check([DONE_KEY.format(me)]):
                lost[name] = (
                    f"no heartbeat for {now - self.heard[name][1]:.1f} s (cluster.lost_after_s={self.silence:g})"
                )
                since = min(since, self.heard[name][1])
        return lost, since

    def ready(self, now: float) -> list[dict[str, Any]]:
        """A decision for each joining node process whose ranks are all ready (they learn their round)."""
        decisions = []
        for name, (start, ranks, answered) in list(self.joining.items()):
            me = node_id(name, start)
            if self.view.add(READY_KEY.format(me), 0) < ranks:
                continue
            del self.joining[name]
            decision = self.rounds.join(name, answered)
            if decision is None:
                continue
            self.starts[name], self.heard[name] = start, (self.view.add(HEARTBEAT_KEY.format(me), 0), now)
            decisions.append(decision)
            self.view.set(JOINED_KEY.format(me), str(decision["round"]))
        return decisions

    def decide(self, decision: dict[str, Any]) -> None:
        self.view.set(ROUND_END_KEY.format(decision["round"] - 1), json.dumps(decision))
        print(f"ROUND {json.dumps(decision)}", flush=True)


def main(argv: list[str]) -> int:
    addr, port, attempt, min_nodes, lost_after_s, *names = argv
    store = listening_store(addr, int(port))
    keeper = Ledger(
        dist.PrefixStore(attempt_prefix(int(attempt)), store), Rounds(names, int(min_nodes)), float(lost_after_s)
    )
    said: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=read_head, args=(said,), daemon=True).start()
    while True:
        told: dict[str, str] = {}
        fault_time = time.time()
        try:
            item = said.get(timeout=LOOK_S)
            while True:
                if item is None:
                    return 0
                if item[0] == "JOIN":
                    keeper.joining[item[1]] = item[2:]
                else:
                    _, name, at, why = item
                    told[name], fault_time = why, min(fault_time, at)
                    keeper.joining.pop(name, None)  # a joining one that is gone again
                item = said.get_nowait()
        except queue.Empty:
            pass
        now = time.time()
        silent, since = keeper.silent(now)
        lost = {**silent, **told}
        if lost and (decision := keeper.rounds.lose(lost, min(fault_time, since))) is not None:
            keeper.decide(decision)
        for decision in keeper.ready(now):
            keeper.decide(decision)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:
        os._exit(130)
