"""Healing in place, the ranks' side: a lost machine's survivors go on in the same processes, from memory.

In a job that heals (``config.rules.heal_off_reason``; the ranks learn it from ``membership.HEAL_ENV``, set by
``launch/workers.py``), every collective of the training loop is abortable (``launcher.abandon``) and a thread
watches the keeper's store for the decision that ends the round (``launch/keeper.py``). When a machine is lost,
the survivors' collectives fail (at once, or when the decision comes) and the trainer calls ``Healer.rejoin``:

1. the decision names the next round's members (this rank's node among them: its new rank keeps the order);
2. the survivors leave the broken group (``rendezvous.next_round``: nothing waits for the dead) and form the next;
3. they agree on the newest step every one of them can hold: with whole-gradient steps a rank's state is always a
   completed step (the update runs after every bucket arrived), so some may be one step ahead when the loss cut
   a gradient allreduce short; the lowest rank at the highest step broadcasts its state (model, optimizer,
   schedule, scaler, position) to the others, in memory: no checkpoint is read and no step is trained twice.

The trainer then rebuilds what held the old group (the gradient sync, the loaders for the new world: the same
global batch, the same samples) and goes on; its rank 0 records the change in ``membership.jsonl`` with the time
from the loss to the first step completed after it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from .. import abandon, dist_helpers, membership, watch
from ..env import DistEnv
from ..logs import take_the_console
from ..membership import HEAL_ENV, ROUND_END_KEY
from ..rendezvous import Group, next_round
from .banner import node_hosts

log = logging.getLogger(__name__)


class HealStop(RuntimeError):
    """The job cannot heal (too few machines left, a round that never formed): it stops, as named."""


CHECK_IN_S = 60.0  # a round's members must all arrive this soon (a lost one is declared within lost_after_s)


@dataclass
class Healer:
    name: str  # this rank's node
    lost_after_s: float
    store: Any = None  # the attempt's store on the keeper (round 0's group store)
    number: int = 0  # the current round
    decisions: list[dict[str, Any]] = field(default_factory=list)  # accepted, not yet recorded (membership)
    _stop: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def from_environ(cls, lost_after_s: float) -> Optional[Healer]:
        """The healer of a rank in a job that heals in place (None elsewhere); abortable collectives from now on."""
        raw = os.environ.get(HEAL_ENV)
        if not raw:
            return None
        place = json.loads(raw)
        abandon.enable()
        return cls(place["name"], lost_after_s)

    def watch(self, group: Group) -> None:
        """Watch the keeper's store for the end of the current round (round 0: ``group`` is its group)."""
        if self.store is None:
            self.store = group.store
        self._stop.set()
        self._stop = threading.Event()
        key = ROUND_END_KEY.format(self.number)
        abandon.watch_store(self.store, key, self._stop, lambda value: _said(json.loads(value)))

    def close(self) -> None:
        self._stop.set()

    def end_of_round(self) -> Optional[dict[str, Any]]:
        """The keeper's decision ending this round: there already, or within ``lost_after_s`` and a second (a killed
        peer's reset connection reaches the ranks before its heartbeat is missed); None: no machine was lost."""
        key = ROUND_END_KEY.format(self.number)
        try:
            self.store.wait([key], timedelta(seconds=self.lost_after_s + 1.0))
        except (RuntimeError, OSError):  # no decision: this was no loss of a machine
            return None
        return json.loads(self.store.get(key))

    def rejoin(self, group: Group, env: DistEnv, decision: dict[str, Any]) -> tuple[Group, DistEnv]:
        """Steps 1 and 2: this rank's place in the next round, and that round's group."""
        if decision["stop"]:
            raise HealStop(f"{_said(decision)}: {decision['stop']}; the job stops (cluster.min_nodes)")
        if self.name not in decision["members"]:  # it was cut off or frozen for a while: the others went on
            why = decision["lost"].get(self.name, "?")
            log.warning("%s was declared lost (%s) while it ran: the job went on without it; leaving", self.name, why)
            abandon.GRAVEYARD.append(dist.group.WORLD)  # destroyed, the broken group would wait for the dead
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
            log.warning("%s while round %d formed: healing again", _said(later), self.number)
            return self.rejoin(group, env, later)
        group = next_round(group, self.number, new, base=self.store)
        self.watch(group)
        return group, new

    def _check_in(self, env: DistEnv) -> Optional[dict[str, Any]]:
        """Every member of the round being formed says so in the store before its group forms (whose own rendezvous
        would wait for a missing one until the group's timeout); returns the decision that ends this round
        instead, when another machine is lost meanwhile."""
        keys = [f"heal/in/{self.number}/{rank}" for rank in range(env.world_size)]
        self.store.set(keys[env.rank], "1")
        end = ROUND_END_KEY.format(self.number)
        deadline = time.monotonic() + CHECK_IN_S
        while True:
            try:
                self.store.wait(keys, timedelta(seconds=abandon.POLL_S * 4))
                return None
            except (RuntimeError, OSError):
                if self.store.check(keys):  # everyone arrived just now: the round forms, whatever comes next
                    return None
                if self.store.check([end]):
                    return json.loads(self.store.get(end))
                if time.monotonic() > deadline:
                    missing = [rank for rank, key in enumerate(keys) if not self.store.check([key])]
                    raise HealStop(
                        f"round {self.number}: ranks {missing} did not check in within {CHECK_IN_S:.0f} s, and no "
                        "machine was declared lost; the job stops"
                    ) from None


def agree_on_state(step: int, state: Any) -> tuple[int, Optional[Any]]:
    """Step 3 (collective, the new round): the highest step any survivor completed, and, on the ranks behind it,
    the state of the lowest rank that holds it (None on ranks already there: nothing to load). ``state``: a
    callable returning this rank's state (called on the source only)."""
    steps = dist_helpers.all_gather_object(step)
    top = max(steps)
    if min(steps) == top:
        return top, None
    source = steps.index(top)
    sent = dist_helpers.broadcast_object(state() if dist_helpers.get_rank() == source else None, src=source)
    return top, sent if step < top else None


def _cut_off(exc: BaseException) -> bool:
    """``exc`` may come from a machine lost under a collective (the keeper's decision then tells)."""
    return isinstance(exc, abandon.PeerLost) or abandon.LOST.is_set() or "onnection" in str(exc)


def _said(decision: dict[str, Any]) -> str:
    lost = ", ".join(f"{name} ({why})" for name, why in decision["lost"].items())
    return f"round {decision['round'] - 1} ended: lost {lost}"


def seconds_since(decision: Optional[dict[str, Any]]) -> Optional[float]:
    """From the loss (the earliest it can have happened) to now."""
    return None if decision is None else round(time.time() - float(decision["fault_time"]), 3)


class Healing:
    """Mixed into the Trainer (whose attributes it reads: healer, group, env, pos, sync, stepper, model, metrics,
    loop, job, run_dir, state/apply_state from ``saving.Checkpointing``, _build_world)."""

    def heal_after(self, exc: Exception) -> bool:
        """After ``exc`` in the training loop: True when a machine was lost and this rank now trains on in the
        next round with the survivors; False: ``exc`` is no loss of a machine (or this job does not heal). A machine
        lost while the survivors heal: they heal again, from the next decision."""
        while True:
            try:
                return self._heal_once(exc)
            except HealStop:
                raise
            except Exception as again:
                if not _cut_off(again) or self.healer is None:
                    raise
                exc = again

    def _heal_once(self, exc: Exception) -> bool:
        healer = self.healer
        if healer is None or not _cut_off(exc):
            return False
        decision = healer.end_of_round()
        if decision is None:
            return False
        seen_s = seconds_since(decision)
        log.warning("%s: healing in place (the loss was known %.1f s after it)", _said(decision), seen_s)
        self.sync.leave()
        self.group, self.env = healer.rejoin(self.group, self.env, decision)
        if self.env.is_main:  # perhaps a new rank 0: the console and the metrics are its now
            take_the_console()
            self.metrics.open()
        behind = self.pos.step
        step, state = agree_on_state(self.pos.step, self.state)
        if state is not None:
            self.apply_state(state)
        loop = self.loop  # the ranks' running counts may differ by the step some were ahead: the highest holds
        counts = dist_helpers.all_gather_object((loop.logged_step, loop.saved_step, loop.trained_steps))
        loop.logged_step, loop.saved_step, loop.trained_steps = (max(c) for c in zip(*counts))
        self._build_world({})  # the sync measures its strategy again: the ranks and links changed
        self.stepper.sync = self.sync
        self.hosts = node_hosts(dist_helpers.all_gather_object((self.env.node_rank, self.env.hostname)))  # round's
        watch.rebase(self.env, healer.number)
        self._healed_from = step
        log.info(
            "round %d: %s; step %d%s (in memory: no checkpoint read)",
            healer.number,
            self.env.describe(),
            step,
            f", this rank was at step {behind}: state from the ranks ahead" if state is not None else "",
        )
        return True

    def healed_step(self, what: str = "") -> None:
        """After a step (``what``: or the end of training): the first one completed since a heal records (rank 0)
        each loss healed since, with the time from it."""
        if getattr(self, "_healed_from", None) is None or self.healer is None:
            return
        step, self._healed_from = self._healed_from, None
        what = what or f"the first step after the loss (step {step + 1})"
        for decision in self.healer.decisions:
            took = seconds_since(decision)
            log.warning(
                "healed in place: %s completed %.1f s after the loss of %s", what, took, ", ".join(decision["lost"])
            )
            if self.env.is_main:
                membership.write(
                    self.run_dir,
                    membership.Change(
                        step=step,
                        nodes_before=len(decision["before"]),
                        nodes_after=len(decision["members"]),
                        hosts_lost=list(decision["lost"]),
                        why="; ".join(f"{name}: {why}" for name, why in decision["lost"].items()),
                        time=float(decision["fault_time"]),
                        how="in place",
                        fault_to_step_s=took,
                    ),
                )
        self.healer.decisions.clear()
