"""The trainer's one seam to healing in place (``launcher.heal``; a no-op in a job that does not heal): the keeper's
decision that ends a round, a joining rank's wait, entering the next round with the others, and the records of
each change once the first step after it completes. The Trainer calls it at four places: the start (watch or
join), a step boundary (a machine joins), an error in the loop (a machine lost?) and each completed step."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from launcher import watch
from launcher.base.env import DistEnv
from launcher.dist.abort import Abort
from launcher.dist.rendezvous import Group
from launcher.heal import membership
from launcher.heal.protocol import Decision
from launcher.heal.rank_side import Healer, agree_on_state
from launcher.trust.secret import Secret

log = logging.getLogger(__name__)


class HealSeam:
    def __init__(self, healer: Optional[Healer]) -> None:
        self.healer = healer
        self.healed_from: Optional[int] = None  # the step a heal went on from, until the first step after it ends

    @classmethod
    def from_environ(cls, lost_after_s: float, backend: str, secret: Optional[Secret]) -> HealSeam:
        return cls(Healer.from_environ(lost_after_s, backend, secret))

    @property
    def heals(self) -> bool:
        return self.healer is not None

    @property
    def joins(self) -> bool:
        """This rank joins a running job: no collective before it is in a round."""
        return self.healer is not None and self.healer.joins

    @property
    def abort(self) -> Optional[Abort]:
        """Handed to every collective of the loop: tripped when a machine is lost."""
        return self.healer.abort if self.healer is not None else None

    def watch(self, group: Optional[Group]) -> None:
        """A rank that started with the job: watch the keeper's store for the end of round 0."""
        if self.healer is not None and group is not None:
            self.healer.watch(group)

    def growing(self) -> bool:
        return self.healer is not None and self.healer.growing()

    def cuts(self, exc: BaseException) -> bool:
        """``exc`` may end this round (a machine lost under a collective): the keeper's decision then tells."""
        return self.healer is not None and self.healer.cut_off(exc)

    def decision_after(self, exc: Optional[BaseException]) -> Optional[Decision]:
        """The keeper's decision ending this round after ``exc`` cut it (None: the ranks agreed a machine joins);
        None when ``exc`` ends no round or this job does not heal."""
        healer = self.healer
        if healer is None or (exc is not None and not healer.cut_off(exc)):
            return None
        decision = healer.end_of_round()
        if decision is None:
            return None
        if decision.lost:
            seen_s = decision.seconds_since()
            log.warning("%s: healing in place (the loss was known %.1f s after it)", decision.said(), seen_s)
        else:
            log.warning("%s: going on with it from this step", decision.said())
        return decision

    def wait_to_join(self, group: Optional[Group]) -> Decision:
        """A joining rank: ready, then the decision that ends the round before the one it joins."""
        assert self.healer is not None and group is not None
        return self.healer.wait_to_join(group)

    def enter(self, env: DistEnv, decision: Decision) -> tuple[Group, DistEnv, frozenset[str]]:
        """This rank's group and place in the round after ``decision``, and the groups it left (the next round's
        watch reads the others)."""
        assert self.healer is not None
        left = watch.known_groups()
        group, env = self.healer.enter_round(env, decision)
        return group, env, left

    def agree(self, steps: list[int], state: Callable[[], Any]) -> tuple[int, Optional[Any]]:
        """Collective: the highest completed step, and on the ranks behind it the state of one that holds it."""
        assert self.healer is not None
        return agree_on_state(steps, state, self.healer)

    def went_on(self, env: DistEnv, left: frozenset[str], step: int, behind: int, got_state: bool) -> None:
        """The round formed: the watch follows it; the changes are recorded once the first step completes."""
        assert self.healer is not None
        watch.rebase(env, self.healer.number, left)
        self.healed_from = step
        log.info(
            "round %d: %s; step %d%s (in memory: no checkpoint read)",
            self.healer.number,
            env.describe(),
            step,
            f", this rank was at step {behind}: state from the ranks ahead" if got_state else "",
        )

    def step_completed(self, env: DistEnv, run_dir: Path, what: str = "") -> None:
        """After a step (``what``: or the end of training): the first one completed since a heal records (rank 0)
        each change healed since, with the time from it."""
        if self.healed_from is None or self.healer is None:
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
                log.warning(
                    "grown in place: %s completed %.1f s after %s answered", what, took, ", ".join(decision.joined)
                )
            if env.is_main:
                membership.write(run_dir, decision.change(step, took))
        self.healer.decisions.clear()

    def trained(self) -> None:
        if self.healer is not None:
            self.healer.trained()

    def close(self) -> None:
        if self.healer is not None:
            self.healer.close()  # the round's store watch
