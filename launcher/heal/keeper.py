"""The keeper of a job that heals in place: one small process started by the head for each attempt, off every
training machine (on the head's host; for simulated nodes in their own namespaces, on the bridge between them),
so that losing any machine, the first included, leaves it standing.

It hosts the job's store (the ranks' rendezvous and every round after it), hears each node process's heartbeat
(``Keys.heartbeat``, every ``liveness.NODE_BEAT_S``) and decides the rounds (``rounds.Rounds``): a node is lost when its
heartbeat has been silent for ``cluster.lost_after_s`` (a frozen machine, a link down; not one whose ranks ended,
which says so: ``Keys.done``), or at once when the head says so (``protocol.LostWord`` on stdin). A machine that answers
again joins: the head starts a node process for it and says ``protocol.JoinWord``; once all its ranks are ready
(``Keys.ready``), the round ends with it as the next one's last member, and the new ranks learn their round
(``Keys.joined``). Each decision goes into the store (``Keys.round_end``: the ranks leave the round, broken or
not, and form the next one) and to the head (stdout). Everything it reads from the store verifies with the job's
secret (its environment, ``SECRET_ENV``): a stranger's write is ignored.

``python -m launcher.heal.keeper ADDR PORT ATTEMPT MIN_NODES LOST_AFTER_S NAME...`` (built by
``head_side.KeeperClient``); stdout: one ``ROUND <json>`` line per decision; stdin: the head's words; its end ends it.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from launcher.base.liveness import KEEPER_LOOK_S
from launcher.group.rendezvous import attempt_prefix, listening_store
from launcher.heal.protocol import ROUND_WORD, Decision, JoinWord, Keys, LostWord, node_id, parse_word
from launcher.heal.rounds import Rounds
from launcher.trust.secret import Secret
from launcher.trust.signed import SignedStore


def read_head(words: queue.SimpleQueue) -> None:
    """The head's words onto ``words``; None at the end of input (the head is gone: the keeper ends)."""
    for line in sys.stdin:
        if (word := parse_word(line)) is not None:
            words.put(word)
    words.put(None)


@dataclass
class Keeper:
    """The rounds, and what the keeper knows of each node process: its heartbeat, and those waiting to join."""

    view: SignedStore  # the attempt's keys
    rounds: Rounds
    silence: float  # cluster.lost_after_s
    starts: dict[str, int] = field(default_factory=dict)  # a member -> its node process's start (node_id)
    heard: dict[str, tuple[int, float]] = field(default_factory=dict)  # a member -> (its count, when it changed)
    joining: dict[str, JoinWord] = field(default_factory=dict)

    def beats(self, node: str) -> Optional[int]:
        """A node process's heartbeat count; None: none that verifies (not started yet, or a stranger's)."""
        value = self.view.read(Keys.heartbeat(node))
        return int(value) if value is not None and value.isdigit() else None

    def silent(self, now: float) -> tuple[dict[str, str], float]:
        """The members whose heartbeat has been silent too long (name -> why), and the earliest it stopped. A node
        never heard yet is not lost (its process is starting); a stranger's value in its place, or an old signed one
        replayed (the count must grow), is no beat."""
        lost, since = {}, now
        for name in self.rounds.live:
            me = node_id(name, self.starts.get(name, 0))
            count, last = self.beats(me), self.heard.get(name)
            if count is not None and (last is None or count > last[0]):  # (an old value replayed is no beat)
                self.heard[name] = (count, now)
            elif last is not None and now - last[1] > self.silence and self.view.read(Keys.done(me)) is None:
                lost[name] = f"no heartbeat for {now - last[1]:.1f} s (cluster.lost_after_s={self.silence:g})"
                since = min(since, last[1])
        return lost, since

    def let_in(self, now: float) -> None:
        """Decide for each joining node process whose ranks are all ready: the round ends with it, then its ranks
        learn their round (in that order: a rank let in reads the decision at once)."""
        for name, join in list(self.joining.items()):
            me = node_id(name, join.start)
            if any(self.view.read(Keys.ready(me, local)) is None for local in range(join.ranks)):
                continue
            del self.joining[name]
            decision = self.rounds.join(name, join.at, now)
            if decision is None:
                continue
            self.starts[name], self.heard[name] = join.start, (self.beats(me) or 0, now)
            self.decide(decision)
            self.view.set(Keys.joined(me), str(decision.round))

    def decide(self, decision: Decision) -> None:
        self.view.set(Keys.round_end(decision.round - 1), decision.to_bytes())
        print(f"{ROUND_WORD} {decision.to_bytes().decode()}", flush=True)

    def hear(self, words: queue.SimpleQueue) -> tuple[dict[str, str], float] | None:
        """What the head said since the last look: the nodes it says are lost (name -> why) and the earliest
        time; None at the end of its input."""
        told: dict[str, str] = {}
        fault_time = time.time()
        try:
            word = words.get(timeout=KEEPER_LOOK_S)
            while True:
                if word is None:
                    return None
                if isinstance(word, JoinWord):
                    self.joining[word.name] = word
                elif isinstance(word, LostWord):
                    told[word.name], fault_time = word.why, min(fault_time, word.at)
                    self.joining.pop(word.name, None)  # a joining one that is gone again
                word = words.get_nowait()
        except queue.Empty:
            pass
        return told, fault_time


def main(argv: list[str]) -> int:
    addr, port, attempt, min_nodes, lost_after_s, *names = argv
    secret = Secret.from_environ(os.environ)
    if secret is None:
        print("launcher keeper: no job secret in the environment (the head hands it on)", file=sys.stderr)
        return 2
    store = listening_store(addr, int(port))
    view = SignedStore(store, secret, attempt_prefix(int(attempt)), where=f"the keeper's store at {addr}:{port}")
    keeper = Keeper(view, Rounds(names, int(min_nodes)), float(lost_after_s))
    words: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=read_head, args=(words,), daemon=True).start()
    while (heard := keeper.hear(words)) is not None:
        told, fault_time = heard
        now = time.time()
        silent, since = keeper.silent(now)
        lost = {**silent, **told}
        if lost and (decision := keeper.rounds.lose(lost, min(fault_time, since))) is not None:
            keeper.decide(decision)
        keeper.let_in(now)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:
        os._exit(130)
