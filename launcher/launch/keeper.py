"""The keeper of a job that heals in place (``cluster.min_nodes`` < ``cluster.nodes``, the built-in trainer, sim
and ssh): one small process started by the head for each attempt, off every training machine (on the head's host;
for simulated nodes in their own namespaces, on the bridge between them), so that losing any machine, the first
included, leaves it standing.

It hosts the job's store (the ranks' rendezvous and every round after it: ``rendezvous.next_round``), hears each
node process's heartbeat (``HEARTBEAT_KEY``, every ``BEAT_S``) and decides the rounds (``membership.Rounds``): a node
is lost when its heartbeat has been silent for ``cluster.lost_after_s`` (a frozen machine, a link down; not one
whose ranks ended, which says so: ``DONE_KEY``), or at once when the head says so (its node process ended by a
signal: ``LOST`` on stdin). The decision goes into the store (``ROUND_END_KEY``: the ranks leave the broken round
and form the next one) and to the head (stdout).

``python -m launcher.launch.keeper ADDR PORT ATTEMPT MIN_NODES LOST_AFTER_S NAME...`` (built by ``healing.Keeper``);
stdout: one ``ROUND <json>`` line per decision; stdin: ``LOST <name> <time> <why>`` lines; the end of input ends
it.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time

import torch.distributed as dist

from ..membership import DONE_KEY, HEARTBEAT_KEY, ROUND_END_KEY, Rounds
from ..rendezvous import attempt_prefix, listening_store

BEAT_S = 0.5  # how often a node process beats (launch/workers.py)
LOOK_S = 0.1  # how often the keeper looks at the heartbeats and at what the head said


def read_head(lines: queue.SimpleQueue) -> None:
    """The head's ``LOST`` lines onto ``lines``; None at the end of input (the head is gone: the keeper ends)."""
    for line in sys.stdin:
        word, _, rest = line.strip().partition(" ")
        if word == "LOST":
            name, at, why = rest.split(" ", 2)
            lines.put((name, float(at), why))
    lines.put(None)


def main(argv: list[str]) -> int:
    addr, port, attempt, min_nodes, lost_after_s, *names = argv
    store = listening_store(addr, int(port))
    view = dist.PrefixStore(attempt_prefix(int(attempt)), store)
    rounds = Rounds(names, int(min_nodes))
    said: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=read_head, args=(said,), daemon=True).start()
    heard: dict[str, tuple[int, float]] = {}  # name -> (its counter, when it last changed: wall time)
    silence = float(lost_after_s)
    done = DONE_KEY.format  # a node whose ranks ended: silent, not lost
    while True:
        lost: dict[str, str] = {}
        fault_time = time.time()
        try:
            item = said.get(timeout=LOOK_S)
            while True:
                if item is None:
                    return 0
                name, at, why = item
                lost[name], fault_time = why, min(fault_time, at)
                item = said.get_nowait()
        except queue.Empty:
            pass
        now = time.time()
        for name in rounds.live:
            count = view.add(HEARTBEAT_KEY.format(name), 0)
            if count and count != heard.get(name, (0, 0.0))[0]:
                heard[name] = (count, now)
            elif count and now - heard[name][1] > silence and name not in lost and not view.check([done(name)]):
                lost[name] = f"no heartbeat for {now - heard[name][1]:.1f} s (cluster.lost_after_s={silence:g})"
                fault_time = min(fault_time, heard[name][1])
        decision = rounds.lose(lost, fault_time) if lost else None
        if decision is not None:
            view.set(ROUND_END_KEY.format(decision["round"] - 1), json.dumps(decision))
            print(f"ROUND {json.dumps(decision)}", flush=True)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:
        os._exit(130)
