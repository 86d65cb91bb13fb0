"""Healing in place, a rank's side: a lost machine's survivors go on in the same processes, from memory, and a
machine that answers again joins them at a step boundary.

In a job that heals (its ranks are told their ``protocol.Place`` by their node process,
``launch/nodes/process.py``), every collective of the training loop waits through the ``Healer``'s abort signal
(``launcher.group.abort``) and a thread watches the keeper's store for the decision that ends the round
(``keeper.py``). When a machine is lost, the
survivors' collectives fail (at once, or when the decision comes) and the trainer calls ``Healer.enter_round``:

1. the decision names the next round's members (this rank's node among them: its new rank keeps the order);
2. the survivors leave the broken group (nothing waits for the dead) and, once every member checked in, form the
   next on the keeper's store;
3. they agree on the newest step every one of them can hold (``agree_on_state``): with whole-gradient steps a
   rank's state is always a completed step, so some may be one step ahead when the loss cut a gradient allreduce
   short; the lowest rank at the highest step sends its state to the others, in memory, signed with the job's
   secret: no checkpoint is read, no step is trained twice, nothing unverified is unpickled.

A machine that answers again (the head's checks) gets a node process whose ranks set up and wait
(``wait_to_join``); the keeper's decision then ends the round without failing anything: the watch sees it, the
ranks agree at the next step boundary to leave (``growth``), and all of them, the new ones included, enter the
next round as above (the new ones are behind every survivor: they get the state).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch.distributed as dist

from launcher.base.env import DistEnv
from launcher.base.errors import Kind, LauncherError
from launcher.base.liveness import CHECK_IN_S, RANK_STORE_POLL_S
from launcher.group import helpers as rank_helpers
from launcher.group.abort import Abort, PeerLost
from launcher.group.failed import CollectiveFailed
from launcher.group.rendezvous import Group, init_group
from launcher.heal.protocol import Decision, Keys, Place
from launcher.trust.secret import Secret
from launcher.trust.signed import SignedStore

log = logging.getLogger(__name__)


class HealStop(LauncherError):
    """The job cannot heal (too few machines left, a round that never formed): it stops, as named. Not a
    ``RuntimeError``: no net for torch's errors may take it for a failed collective."""

    kind = Kind.lost


class LeftJob(LauncherError):
    """This rank is out of the job, which goes on (or ended) without it: it was declared lost while it ran (cut off
    or frozen for a while), or the job trained to its end before it could join. The rank ends cleanly (exit 0, no
    failure record: ``Kind.left``)."""

    kind = Kind.left


@dataclass
class Healer:
    place: Place  # this rank's node, and its node process's start
    lost_after_s: float
    backend: str  # every round's (a failed init leaves no default group to ask)
    secret: Secret
    store: Optional[SignedStore] = None  # the attempt's keys on the keeper's store (round 0's group store)
    timeout_s: float = 0.0  # every round's collectives (comm.timeout_s and the backstop)
    number: int = 0  # the current round
    decisions: list[Decision] = field(default_factory=list)  # entered, not yet recorded (membership)
    joined: bool = True  # this rank is in a round (a joining one: not until ``enter_round``)
    abort: Abort = field(default_factory=Abort)  # handed to every collective of the loop
    _stop: threading.Event = field(default_factory=threading.Event)
    _growth: Optional[Decision] = None  # the keeper's decision that a machine joins, ending the round

    @classmethod
    def from_environ(cls, lost_after_s: float, backend: str, secret: Optional[Secret]) -> Optional[Healer]:
        """The healer of a rank in a job that heals in place (None elsewhere)."""
        place = Place.from_environ(os.environ)
        if place is None:
            return None
        if secret is None:
            raise RuntimeError("a rank of a job that heals in place got no job secret from its node process")
        return cls(place, lost_after_s, backend, secret, joined=not place.joins)

    @property
    def joins(self) -> bool:
        """This rank joins a running job and has not yet: no collective before ``enter_round``."""
        return not self.joined

    def watch(self, group: Group) -> None:
        """Watch the keeper's store for the end of the current round (round 0: ``group`` is its group): a loss
        trips this rank's collectives, a machine joining is the round's ``growth`` from then on."""
        if self.store is None:
            assert isinstance(group.store, SignedStore), "a healing job's store is signed with the job's secret"
            self.store = group.store
        self.timeout_s = group.timeout_s
        self._stop.set()
        self._stop = threading.Event()
        self._growth = None
        self._watch_for(self.number)

    def _watch_for(self, number: int) -> None:
        """A thread that waits for the decision ending round ``number`` (a store unreachable for a while, a link
        down, is asked again), then trips the abort signal with it (a loss) or keeps it as the round's growth (a
        join)."""
        store, stop, round_ = self.store, self._stop, self.abort.round
        assert store is not None

        def run() -> None:
            while not stop.is_set() and not self.abort.is_set():
                with contextlib.suppress(dist.DistError):  # unreachable for now
                    if (value := store.read(Keys.round_end(number))) is not None:
                        decision = Decision.from_bytes(value)
                        if not decision.grows:
                            self.abort.trip(decision.said(), round_, cause=decision)
                            return
                        self._growth = decision  # a machine lost before the ranks leave for the join still trips
                        return self._watch_for(decision.round)
                stop.wait(RANK_STORE_POLL_S)

        threading.Thread(target=run, name="heal-watch", daemon=True).start()

    def growth(self, agreed: bool = False) -> Optional[Decision]:
        """The keeper's decision that a machine joins: the round ends at the next step boundary (every rank agrees
        when: ``stop.agreed``); None: none joins. ``agreed``: the ranks agreed to leave for it (another rank saw it
        first): read from the store if this rank's watch has not yet."""
        if self._growth is None and agreed:
            said = f"round {self.number}'s end was not written"
            self._growth = self._poll(lambda: self._decision(self.number), lambda: said)
        return self._growth

    def lost(self, exc: PeerLost | CollectiveFailed) -> Optional[Decision]:
        """The keeper's decision that ends this round because a machine was lost under ``exc``, a failed collective
        (the abort signal's cause: at once for ``PeerLost``; for the backend's own error, once the keeper decides,
        within ``lost_after_s`` and a second: a killed peer resets its connections before it is declared lost);
        None: no machine was lost under it."""
        lost = exc if isinstance(exc, PeerLost) else self.abort.lost_within(self.lost_after_s + 1.0)
        decision = lost.cause if lost is not None else None
        if not isinstance(decision, Decision):
            return None
        seen_s = decision.seconds_since()
        log.warning("%s: healing in place (the loss was known %.1f s after it)", decision.said(), seen_s)
        return decision

    def close(self) -> None:
        self._stop.set()

    def trained(self) -> None:
        """Every step is trained: a machine still waiting to join need not (``wait_to_join``, ``_check_in``)."""
        with contextlib.suppress(dist.DistError, OSError):
            assert self.store is not None
            self.store.set(Keys.TRAINED, "1")

    def _decision(self, number: int) -> Optional[Decision]:
        assert self.store is not None
        value = self.store.read(Keys.round_end(number))
        return None if value is None else Decision.from_bytes(value)

    def wait_to_join(self, group: Group) -> Decision:
        """A joining rank, set up: ready; returns the keeper's decision that ends the round before the one it
        joins, once every rank of its node is ready. A job that trained to its end meanwhile: this rank leaves
        (``LeftJob``)."""
        assert isinstance(group.store, SignedStore), "a healing job's store is signed with the job's secret"
        self.store, self.timeout_s = group.store, group.timeout_s
        node = self.place.node
        self.store.set(Keys.ready(node, group.env.local_rank), "1")
        log.info("%s answers again: ready to join the job (waiting for the round)", self.place.name)
        store = self.store
        joined = self._poll(lambda: store.read(Keys.joined(node)), lambda: f"{self.place.name} was not let in")
        self.number = int(joined) - 1
        return self._poll(lambda: self._decision(self.number), lambda: f"round {self.number}'s end was not written")

    def _poll(self, answer: Callable[[], Any], what: Callable[[], str], limit_s: Optional[float] = None) -> Any:
        """Ask the keeper's store every ``RANK_STORE_POLL_S`` until ``answer()`` is not None. A joining rank leaves if
        the job trained to its end meanwhile; HealStop after ``limit_s``, by default ``CHECK_IN_S`` (a joining rank:
        the group's timeout; the others reach a step boundary first)."""
        limit_s = limit_s or (self.timeout_s if self.joins else CHECK_IN_S)
        stop_at = time.monotonic() + limit_s
        tick = threading.Event()  # never set: the pace of the questions
        assert self.store is not None
        while (got := answer()) is None:
            if self.joins and self.store.read(Keys.TRAINED) is not None:
                raise LeftJob(f"the job trained to its end before {self.place.name} could join: leaving")
            if time.monotonic() > stop_at:
                raise HealStop(f"{what()} within {limit_s:.0f} s; the job stops")
            tick.wait(RANK_STORE_POLL_S)
        return got

    def enter_round(self, env: DistEnv, decision: Decision) -> tuple[Group, DistEnv]:
        """Steps 1 and 2: this rank's place in the next round, and that round's group."""
        if decision.stop:
            raise HealStop(f"{decision.said()}: {decision.stop}; the job stops (cluster.min_nodes)")
        name = self.place.name
        if name not in decision.members:  # it was cut off or frozen for a while: the others went on
            why = decision.lost.get(name, "?")
            if dist.is_initialized():  # destroyed, the broken group would wait for the dead
                self.abort.keep(dist.group.WORLD)
            raise LeftJob(f"{name} was declared lost ({why}) while it ran: the job went on without it; leaving")
        node = decision.members.index(name)
        per_node = env.local_world_size
        new = replace(
            env,
            rank=node * per_node + env.local_rank,
            world_size=len(decision.members) * per_node,
            node_rank=node,
            num_nodes=len(decision.members),
        )
        self.number = decision.round
        self.decisions.append(decision)  # recorded once the first step after it completes
        self._stop.set()  # the old round's watch (a late word from it is ignored: the abort's round)
        later = self._check_in(new)
        if later is not None:  # another machine lost while this round formed
            log.warning("%s while round %d formed: healing again", later.said(), self.number)
            return self.enter_round(env, later)
        group = self._form(new)
        self.joined = True
        self.watch(group)
        return group, new

    def _form(self, env: DistEnv) -> Group:
        """Leave the current default group (a lost machine broke it; a joining rank has none yet) and form this
        round's on the keeper's store, with nothing lost in it yet. The old group is not destroyed but kept
        (``Abort.keep``): its destructor joins backend threads that wait for the dead peers until its timeout
        (measured: seconds to minutes), while leaving it costs nothing. The caller then builds anew what held the
        old group (DDP, the reducer's topology); the rank's ``process_group`` destroys the newest round at the end."""
        if dist.is_initialized():
            self.abort.keep(dist.group.WORLD)
            dist.destroy_process_group()  # forgets the group; the kept reference keeps its threads alive
        self.abort.next_round()
        assert self.store is not None
        store = dist.PrefixStore(f"round-{self.number}", self.store)  # one root for every round
        store.set(f"joined/{env.rank}", env.hostname or "?")  # who holds each rank (stall.explain_stall reads it)
        init_group(store, env, self.backend, self.timeout_s)
        log.info("process group round %d: %s", self.number, env.describe())
        return Group(store, env, self.timeout_s)

    def _check_in(self, env: DistEnv) -> Optional[Decision]:
        """Every member of the round being formed says so in the store before its group forms (whose own rendezvous
        would wait for a missing one until the group's timeout); returns the decision that ends this round
        instead, when another machine is lost meanwhile."""
        store = self.store
        assert store is not None
        keys = [Keys.checked_in(self.number, rank) for rank in range(env.world_size)]
        store.set(keys[env.rank], "1")

        def formed_or_ended() -> Optional[tuple[Optional[Decision]]]:
            if all(store.read(key) is not None for key in keys):  # everyone arrived: the round forms
                return (None,)
            ended = self._decision(self.number)
            return (ended,) if ended is not None else None

        def missing() -> str:
            ranks = [rank for rank, key in enumerate(keys) if store.read(key) is None]
            return f"round {self.number}: ranks {ranks} did not check in, and no machine was declared lost"

        return self._poll(formed_or_ended, missing)[0]


def agree_on_state(
    steps: list[int], state: Callable[[], Any], healer: Healer, lanes: Optional[list[int]] = None
) -> tuple[int, Optional[Any]]:
    """Step 3 (collective, the new round; ``steps``: every rank's completed step, gathered): the highest, and, on
    the ranks behind it, the state of the lowest rank that holds it (None on ranks already there: nothing to load).
    ``state``: returns this rank's state (called on the source only). Signed: a rank unpickles only what verifies.
    ``lanes``: each rank's lane, when only a rank of the same lane holds what another needs (a sharded job: its
    place in its node, whose shards it holds); each lane's source sends to that lane's ranks behind."""
    top, rank = max(steps), rank_helpers.get_rank()
    lanes = lanes or [0] * len(steps)
    sent, members_of = None, {lane: [r for r, at in enumerate(lanes) if at == lane] for lane in sorted(set(lanes))}
    for lane, members in members_of.items():  # (every lane checked before any traffic)
        held = max(steps[r] for r in members)
        if held < top:
            raise HealStop(
                f"no survivor holds one whole step: the shards of local rank {lane} are at step {held} at most, "
                f"others at step {top} (the loss cut a cross-node allreduce short on some ranks only); the job "
                "stops, to restart from the newest checkpoint (cluster.max_restarts)"
            )
    for lane, members in members_of.items():
        if all(steps[r] == top for r in members):
            continue  # nobody behind in this lane: no traffic
        source = min(r for r in members if steps[r] == top)
        got = rank_helpers.broadcast_object(
            state() if rank == source else None, src=source, abort=healer.abort, secret=healer.secret
        )
        if lanes[rank] == lane and steps[rank] < top:
            sent = got
    return top, sent
