"""Healing in place, the ranks' side: a lost machine's survivors go on in the same processes, from memory, and a
machine that answers again joins them at a step boundary.

In a job that heals (``config.rules.heal_off_reason``; the ranks learn it from ``membership.HEAL_ENV``, set by
``launch/workers.py``), every collective of the training loop is abortable (``launcher.abandon``) and a thread
watches the keeper's store for the decision that ends the round (``launch/keeper.py``). When a machine is lost,
the survivors' collectives fail (at once, or when the decision comes) and the trainer (``train/in_place.py``)
calls ``Healer.rejoin``:

1. the decision names the next round's members (this rank's node among them: its new rank keeps the order);
2. the survivors leave the broken group (``rendezvous.next_round``: nothing waits for the dead) and form the next;
3. they agree on the newest step every one of them can hold: with whole-gradient steps a rank's state is always a
   completed step (the update runs after every bucket arrived), so some may be one step ahead when the loss cut
   a gradient allreduce short; the lowest rank at the highest step broadcasts its state (model, optimizer,
   schedule, scaler, position) to the others, in memory: no checkpoint is read and no step is trained twice.

A machine that answers again (``launch/healing.py``: the head's checks) gets a node process whose ranks set up
and wait (``Healer.wait_to_join``); the keeper's decision then ends the round without failing anything: the watch
sees it, the ranks agree at the next step boundary to leave (``StopRequest.agreed``: ``grow``), and all of them,
the new ones included, form the next round as above (the new ones are behind every survivor: they get the state).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from .. import abandon, dist_helpers
from ..env import DistEnv
from ..membership import JOINED_KEY, READY_KEY, ROUND_END_KEY, TRAINED_KEY, heal_place, node_id
from ..rendezvous import Group, next_round

log = logging.getLogger(__name__)


class HealStop(RuntimeError):
    """The job cannot heal (too few machines left, a round that never formed): it stops, as named."""


CHECK_IN_S = 60.0  # a round's members must all arrive this soon (a lost one is declared within lost_after_s)


@dataclass
class Healer:
    name: str  # this rank's node
    lost_after_s: float
    backend: str  # every round's (a failed init leaves no default group to ask)
    start: int = 0  # its node process's start in the attempt (``membership.node_id``); > 0: it joins a running job
    store: Any = None  # the attempt's store on the keeper (round 0's group store)
    timeout_s: float = 0.0  # every round's collectives (comm.timeout_s and the backstop)
    number: int = 0  # the current round
    decisions: list[dict[str, Any]] = field(default_factory=list)  # accepted, not yet recorded (membership)
    joined: bool = True  # this rank is in a round (a joining one: not until ``rejoin``)
    _stop: threading.Event = field(default_factory=threading.Event)
    _grow: threading.Event = field(default_factory=threading.Event)  # the round ends with a machine joining

    @classmethod
    def from_environ(cls, lost_after_s: float, backend: str) -> Optional[Healer]:
        """The healer of a rank in a job that heals in place (None elsewhere); abortable collectives from now on."""
        place = heal_place(os.environ)
        if place is None:
            return None
        abandon.enable()
        start = int(place.get("start", 0))
        return cls(place["name"], lost_after_s, backend, start, joined=not start)

    @property
    def joins(self) -> bool:
        """This rank joins a running job and has not yet: no collective before ``rejoin``."""
        return not self.joined

    def watch(self, group: Group) -> None:
        """Watch the keeper's store for the end of the current round (round 0: ``group`` is its group): a loss
        fails this rank's collectives (``abandon.lost``), a machine joining is ``growing`` from then on."""
        if self.store is None:
            self.store = group.store
        self.timeout_s = group.timeout_s
        self._stop.set()
        self._stop = threading.Event()
        self._grow.clear()
        key = ROUND_END_KEY.format(self.number)
        abandon.watch_store(self.store, key, self._stop, self._heard)

    def _heard(self, value: bytes) -> Optional[str]:
        decision = json.loads(value)
        if decision["lost"] or decision["stop"]:
            return said(decision)
        self._grow.set()
        # a machine lost before the ranks leave for the join must still fail this round's collectives
        abandon.watch_store(self.store, ROUND_END_KEY.format(decision["round"]), self._stop, self._heard)
        return None

    def growing(self) -> bool:
        """A machine joins: the round ends at the next step boundary (every rank agrees when: ``stop.agreed``)."""
        return self._grow.is_set()

    def close(self) -> None:
        self._stop.set()

    def trained(self) -> None:
        """Every step is trained: a machine still waiting to join need not (``wait_to_join``, ``_check_in``)."""
        with contextlib.suppress(RuntimeError, OSError):
            self.store.set(TRAINED_KEY, "1")

    def end_of_round(self) -> Optional[dict[str, Any]]:
        """The keeper's decision ending this round: there already, or within ``lost_after_s`` and a second (a killed
        peer's reset connection reaches the ranks before its heartbeat is missed); None: no machine was lost."""
        key = ROUND_END_KEY.format(self.number)
        try:
            self.store.wait([key], timedelta(seconds=self.lost_after_s + 1.0))
        except (RuntimeError, OSError):  # no decision: this was no loss of a machine
            return None
        return json.loads(self.store.get(key))

    def wait_to_join(self, group: Group) -> dict[str, Any]:
        """A joining rank, set up: ready (``READY_KEY``); returns the keeper's decision that ends the round before
        the one it joins, once every rank of its node is ready. A job that trained to its end meanwhile: this rank
        leaves (SystemExit 0, no traceback)."""
        self.store, self.timeout_s = group.store, group.timeout_s
        me = node_id(self.name, self.start)
        self.store.add(READY_KEY.format(me), 1)
        log.info("%s answers again: ready to join the job (waiting for the round)", self.name)
        joined = JOINED_KEY.format(me)
        self._poll(lambda: self.store.check([joined]) or None, lambda: f"{self.name} was not let in")
        self.number = int(self.store.get(joined)) - 1
        return json.loads(self.store.get(ROUND_END_KEY.format(self.number)))

    def _poll(self, answer: Callable[[], Any], what: Callable[[], str]) -> Any:
        """Ask the keeper's store every ``abandon.POLL_S`` until ``answer()`` is not None (a store wait that times
        out writes a warning each time). A joining rank leaves if the job trained to its end meanwhile; HealStop
        after ``CHECK_IN_S`` (a joining rank: the group's timeout; the others reach a step boundary first)."""
        limit_s = self.timeout_s if self.joins else CHECK_IN_S
        deadline = time.monotonic() + limit_s
        tick = threading.Event()  # never set: the pace of the questions
        while (got := answer()) is None:
            if self.joins and self.store.check([TRAINED_KEY]):
                log.warning("the job trained to its end before %s could join: leaving", self.name)
                raise SystemExit(0)
            if time.monotonic() > deadline:
                raise HealStop(f"{what()} within {limit_s:.0f} s; the job stops")
            tick.wait(abandon.POLL_S)
        return got

    def rejoin(self, env: DistEnv, decision: dict[str, Any]) -> tuple[Group, DistEnv]:
        """Steps 1 and 2: this rank's place in the next round, and that round's group."""
        if decision["stop"]:
            raise HealStop(f"{said(decision)}: {decision['stop']}; the job stops (cluster.min_nodes)")
        if self.name not in decision["members"]:  # it was cut off or frozen for a while: the others went on
            why = decision["lost"].get(self.name, "?")
            log.warning("%s was declared lost (%s) while it ran: the job went on without it; leaving", self.name, why)
            if dist.is_initialized():  # destroyed, the broken group would wait for the dead
                abandon.GRAVEYARD.append(dist.group.WORLD)
            raise SystemExit(0)
        node = decision["members"].index(self.name)
        per_node = env.local_world_size
        new = replace(
            env,
            rank=node * per_node + env.local_rank,
            world_size=len(decision["members"]) * per_node,
            node_rank=node,
            num_nodes=len(decision["members"]),
        )
        self.number = decision["round"]
        self.decisions.append(decision)  # recorded once the first step after it completes
        self._stop.set()  # the old round's watch (a late word from it is ignored: abandon.reset)
        later = self._check_in(new)
        if later is not None:  # another machine lost while this round formed
            log.warning("%s while round %d formed: healing again", said(later), self.number)
            return self.rejoin(env, later)
        group = next_round(self.number, new, self.store, self.backend, self.timeout_s)
        self.joined = True
        self.watch(group)
        return group, new

    def _check_in(self, env: DistEnv) -> Optional[dict[str, Any]]:
        """Every member of the round being formed says so in the store before its group forms (whose own rendezvous
        would wait for a missing one until the group's timeout); returns the decision that ends this round
        instead, when another machine is lost meanwhile."""
        keys = [f"heal/in/{self.number}/{rank}" for rank in range(env.world_size)]
        self.store.set(keys[env.rank], "1")
        end = ROUND_END_KEY.format(self.number)

        def formed_or_ended() -> Optional[tuple[Optional[dict[str, Any]]]]:
            if self.store.check(keys):  # everyone arrived: the round forms, whatever comes next
                return (None,)
            return (json.loads(self.store.get(end)),) if self.store.check([end]) else None

        def missing() -> str:
            ranks = [rank for rank, key in enumerate(keys) if not self.store.check([key])]
            return f"round {self.number}: ranks {ranks} did not check in, and no machine was declared lost"

        return self._poll(formed_or_ended, missing)[0]


def agree_on_state(steps: list[int], state: Any) -> tuple[int, Optional[Any]]:
    """Step 3 (collective, the new round; ``steps``: every rank's completed step, gathered): the highest, and, on
    the ranks behind it, the state of the lowest rank that holds it (None on ranks already there: nothing to load).
    ``state``: a callable returning this rank's state (called on the source only)."""
    top = max(steps)
    if min(steps) == top:
        return top, None
    source, rank = steps.index(top), dist_helpers.get_rank()
    sent = dist_helpers.broadcast_object(state() if rank == source else None, src=source)
    return top, sent if steps[rank] < top else None


class Grow(Exception):
    """The ranks agreed to leave the round at this step boundary: a machine joins (``Healer.growing``)."""


def cut_off(exc: BaseException) -> bool:
    """``exc`` may end this round (the keeper's decision then tells): a machine lost under a collective, or one
    joining."""
    return isinstance(exc, (abandon.PeerLost, Grow)) or abandon.LOST.is_set() or "onnection" in str(exc)


def said(decision: dict[str, Any]) -> str:
    lost = ", ".join(f"{name} ({why})" for name, why in decision["lost"].items())
    joined = ", ".join(decision.get("joined", ()))
    what = "; ".join(([f"lost {lost}"] if lost else []) + ([f"{joined} joined"] if joined else []))
    return f"round {decision['round'] - 1} ended: {what}"


def seconds_since(decision: dict[str, Any]) -> float:
    """From the change (a loss: the earliest it can have happened; a join: the machine's answer) to now."""
    return round(time.time() - float(decision["fault_time"] or decision["answer_time"]), 3)
