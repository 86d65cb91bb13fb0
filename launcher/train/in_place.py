"""The trainer's one seam to healing in place (``launcher.heal``): the ``Healing`` protocol, a few calls the Trainer
makes whatever the job, and its two sides: ``NoHealing`` (every job that does not heal: nothing ends a round but
its end) and ``InPlace`` (sim and ssh jobs that heal, over the rank's ``Healer``).

The trainer calls it at the start (``start``: watch the keeper, or a joining rank's wait), at a step boundary
(``growth``: a machine joins), when a collective of its loop failed (``lost``: was a machine lost under it? asked
only about the typed errors of a failed collective, ``PeerLost`` and ``CollectiveFailed``, which
``launcher.group.failed`` makes of torch's: an ordinary error is never asked about, and is raised as it is), to go
on in the next round (``enter``, then ``settle``), after each step (``step_completed``: the membership records) and
at the end (``close``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Optional, Protocol

from launcher.base import membership
from launcher.base.env import DistEnv
from launcher.base.run_dir import RunDir
from launcher.group.abort import Abort, PeerLost
from launcher.group.failed import CollectiveFailed
from launcher.group.rendezvous import Group
from launcher.heal.protocol import Decision
from launcher.heal.rank_side import Healer, agree_on_state
from launcher.watch import ProgressWatch

log = logging.getLogger(__name__)


class Healing(Protocol):
    abort: Optional[Abort]  # handed to every collective of the loop: tripped when a machine is lost

    @property
    def joins(self) -> bool:
        """This rank joins a running job: no collective before it is in a round."""
        ...

    def start(self, group: Optional[Group]) -> Optional[Decision]:
        """The start of the loop: watch the keeper for the end of round 0; a joining rank: its wait, then the
        decision that lets it in."""
        ...

    def growth(self, agreed: bool = False) -> Optional[Decision]:
        """The keeper's decision that a machine joins (every rank leaves the round at one step boundary;
        ``agreed``: the ranks agreed so, the decision is read if this rank has not seen it yet)."""
        ...

    def lost(self, exc: PeerLost | CollectiveFailed) -> Optional[Decision]:
        """The keeper's decision that a machine was lost under ``exc``, a failed collective; None: it was no loss
        (a peer failed on its own: the job fails)."""
        ...

    def enter(self, env: DistEnv, decision: Decision) -> tuple[Group, DistEnv]:
        """This rank's group and place in the round after ``decision`` (``LeftJob``: it is out of the job)."""
        ...

    def settle(
        self, env: DistEnv, steps: list[int], behind: int, state: Callable[[], Any], by_place: bool = False
    ) -> Optional[Any]:
        """Collective, the new round formed: the state of a rank at the highest step on the ranks behind it
        (``by_place``: of a rank at the same place in its node, a sharded job's)."""
        ...

    def step_completed(self, env: DistEnv, run_dir: RunDir, what: str = "") -> None: ...

    def close(self, trained: bool) -> None: ...


class NoHealing:
    """A job that does not heal: no round ends but the last, no error is a lost machine."""

    abort: Optional[Abort] = None
    joins = False

    def start(self, group: Optional[Group]) -> Optional[Decision]:
        return None

    def growth(self, agreed: bool = False) -> Optional[Decision]:
        return None

    def lost(self, exc: PeerLost | CollectiveFailed) -> Optional[Decision]:
        return None

    def enter(self, env: DistEnv, decision: Decision) -> tuple[Group, DistEnv]:
        raise AssertionError("a job that does not heal has one round")

    def settle(
        self, env: DistEnv, steps: list[int], behind: int, state: Callable[[], Any], by_place: bool = False
    ) -> Optional[Any]:
        raise AssertionError("a job that does not heal has one round")

    def step_completed(self, env: DistEnv, run_dir: RunDir, what: str = "") -> None:
        pass

    def close(self, trained: bool) -> None:
        pass


def healing_for(healer: Optional[Healer], watch: ProgressWatch, failing: Callable[[], bool]) -> Healing:
    """``InPlace`` for a rank of a job that heals (``healer``: its side, from the place its node process told it:
    ``Healer.from_environ``), else ``NoHealing``. ``failing``: True once another rank failed on its own (its error
    record): this rank's error is a consequence."""
    return NoHealing() if healer is None else InPlace(healer, watch, failing)


class InPlace:
    """A job that heals in place: a lost machine's survivors go on in the next round, a machine answering again
    joins at a step boundary."""

    def __init__(self, healer: Healer, watch: ProgressWatch, failing: Callable[[], bool]) -> None:
        self.healer, self.watch, self.failing = healer, watch, failing
        self.abort: Optional[Abort] = healer.abort
        self.left: frozenset[str] = frozenset()  # the groups left for the round being formed (the watch's)
        self.healed_from: Optional[int] = None  # the step a heal went on from, until the first step after it ends

    @property
    def joins(self) -> bool:
        return self.healer.joins

    def start(self, group: Optional[Group]) -> Optional[Decision]:
        assert group is not None, "a rank of a job that heals has its group's store"
        if self.healer.joins:
            return self.healer.wait_to_join(group)
        self.healer.watch(group)
        return None

    def growth(self, agreed: bool = False) -> Optional[Decision]:
        return self.healer.growth(agreed)

    def lost(self, exc: PeerLost | CollectiveFailed) -> Optional[Decision]:
        return None if self.failing() else self.healer.lost(exc)

    def enter(self, env: DistEnv, decision: Decision) -> tuple[Group, DistEnv]:
        if decision.grows:
            log.warning("%s: going on with it from this step", decision.said())
        self.left = self.watch.known_groups()  # taken before this rank leaves them
        return self.healer.enter_round(env, decision)

    def settle(
        self, env: DistEnv, steps: list[int], behind: int, state: Callable[[], Any], by_place: bool = False
    ) -> Optional[Any]:
        lanes = [rank % env.local_world_size for rank in range(env.world_size)] if by_place else None
        step, sent = agree_on_state(steps, state, self.healer, lanes)
        self.watch.rebase(env, self.healer.number, self.left)
        self.healed_from = step
        log.info(
            "round %d: %s; step %d%s (in memory: no checkpoint read)",
            self.healer.number,
            env.describe(),
            step,
            f", this rank was at step {behind}: state from the ranks ahead" if sent is not None else "",
        )
        return sent

    def step_completed(self, env: DistEnv, run_dir: RunDir, what: str = "") -> None:
        """After a step (``what``: or the end of training): the first one completed since a heal records (rank 0)
        each change healed since, with the time from it."""
        if self.healed_from is None:
            return
        step, self.healed_from = self.healed_from, None
        what = what or f"the first step after the change (step {step + 1})"
        for decision in self.healer.decisions:
            took = decision.seconds_since()
            if decision.lost:
                log.warning(
                    "healed in place: %s completed %.1f s after the loss of %s", what, took, ", ".join(decision.lost)
                )
            else:
                ready = decision.change(step, took).ready_to_step_s
                log.warning(
                    "grown in place: %s completed %.1f s after %s answered%s",
                    what,
                    took,
                    ", ".join(decision.joined),
                    "" if ready is None else f" ({ready:.1f} s after its ranks were ready)",
                )
            if env.is_main:
                membership.write(run_dir, decision.change(step, took))
        self.healer.decisions.clear()

    def close(self, trained: bool) -> None:
        if trained:
            self.healer.trained()  # a machine still waiting to join need not
        self.healer.close()  # the round's store watch
