"""The trainer's side of healing in place (``launcher.heal.rank`` says how a round ends and the next forms): after
an error in the loop, whether a machine was lost, and if so going on with the survivors; at a step boundary where
the ranks agreed a machine joins, going on with it; and a joining rank's own start, which takes the job's state
from a live peer instead of reading a checkpoint."""

from __future__ import annotations

import logging

from .. import membership, watch
from ..heal.protocol import Decision
from ..heal.rank import HealStop, agree_on_state
from ..logs import take_the_console
from .banner import node_hosts

log = logging.getLogger(__name__)


class Healing:
    """Mixed into the Trainer (whose attributes it reads: healer, peers, group, env, pos, sync, stepper, model,
    metrics, loop, job, run_dir, global_batch, has_state, state/apply_state from ``saving.Checkpointing``,
    _build_world, _schedule)."""

    def heal_after(self, exc: Exception) -> bool:
        """After ``exc`` in the training loop: True when the round ended (a machine was lost, or one joins) and this
        rank now trains on in the next; False: ``exc`` ends no round (or this job does not heal). A machine lost
        while the ranks heal: they heal again, from the next decision."""
        while True:
            try:
                return self._heal_once(exc)
            except HealStop:
                raise
            except Exception as again:
                if self.healer is None or not self.healer.cut_off(again):
                    raise
                exc = again

    def _heal_once(self, exc: Exception) -> bool:
        healer = self.healer
        if healer is None or not healer.cut_off(exc):
            return False
        decision = healer.end_of_round()
        if decision is None:
            return False
        if decision.lost:
            seen_s = decision.seconds_since()
            log.warning("%s: healing in place (the loss was known %.1f s after it)", decision.said(), seen_s)
        else:
            log.warning("%s: going on with it from this step", decision.said())
        if getattr(self, "sync", None) is not None:  # (a joining rank has none before its first round)
            self.sync.leave()
        self._next_round(decision)
        return True

    def join_job(self) -> None:
        """A rank that joins a running job: ready, let in by the keeper, then the round as every rank forms it."""
        decision = self.healer.wait_to_join(self.group)
        try:
            self._next_round(decision)
        except Exception as exc:  # a machine lost while it joined
            if not self.heal_after(exc):
                raise

    def _next_round(self, decision: Decision) -> None:
        """Leave for the round after ``decision`` and go on in it (collective with its members, new ones too)."""
        healer = self.healer
        joining = not self.has_state  # it joins: the state, and the job's shape, come from the others
        left = watch.known_groups()  # the groups this rank leaves: the next round's watch reads the others
        self.group, self.env = healer.enter_round(self.env, decision)
        if self.env.is_main:  # perhaps a new rank 0: the console and the metrics are its now
            take_the_console()
            self.metrics.open()
        behind, loop = self.pos.step, self.loop
        # one gather: each rank's step (-1: it joins, it holds none of the job's), its loop counts (they may differ
        # by the step some were ahead: the highest hold), its node and host (the round's hosts)
        counts = (loop.logged_step, loop.saved_step, loop.trained_steps)
        facts = self.peers.all_gather_object((-1 if joining else behind, counts, self.env.node_rank, self.env.hostname))
        step, state = agree_on_state([f[0] for f in facts], self.state, healer)
        if joining:  # the job's shape as it started, whatever this rank's place was before it joined
            self.global_batch = state["global_batch"]
            self._schedule(state["steps_per_epoch"])
        if state is not None:
            self.apply_state(state)
            self.has_state = True
        loop.logged_step, loop.saved_step, loop.trained_steps = (max(c) for c in zip(*(f[1] for f in facts)))
        self._build_world({})  # the sync measures its strategy again: the ranks and links changed
        self.stepper.sync = self.sync
        self.hosts = node_hosts([f[2:] for f in facts])
        watch.rebase(self.env, healer.number, left)
        self._healed_from = step
        log.info(
            "round %d: %s; step %d%s (in memory: no checkpoint read)",
            healer.number,
            self.env.describe(),
            step,
            f", this rank was at step {behind}: state from the ranks ahead" if state is not None else "",
        )

    def healed_step(self, what: str = "") -> None:
        """After a step (``what``: or the end of training): the first one completed since a heal records (rank 0)
        each change healed since, with the time from it."""
        if getattr(self, "_healed_from", None) is None or self.healer is None:
            return
        step, self._healed_from = self._healed_from, None
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
            if self.env.is_main:
                membership.write(self.run_dir, decision.change(step, took))
        self.healer.decisions.clear()
