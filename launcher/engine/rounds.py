"""Healing in place, a loop's side (``Engine``'s part for a job that heals: sim and ssh under ``cluster.min_nodes``).

The trainer's healing (``launcher.heal``, through the seam ``train/in_place.py``) with the engine's calls as the
places where a loss is met: a machine lost while the ranks are inside ``with Engine.step():`` (its body or its
boundary) or an ``Engine.save()`` fails their collectives (at once, or when the keeper decides); the engine asks the
keeper's decision and, when a machine was lost, every survivor goes into the next round (``_heal``): the new
process group, the training state agreed (the highest step a survivor completed; ranks behind it get a live peer's
state, in memory, signed: ``heal.rank_side.agree_on_state``), the sync built again for the new ranks (FSDP2: the
model sharded anew on the new mesh, each rank's shards kept: ``EngineSharded.regroup``), the loader re-split. The
step the loss cut short is dropped on every survivor (its batch handed out again, re-split); the loop goes on.

Where the ranks were in the loop when the loss came may differ by one step, or by one ``save``: a rank may have
completed the step (or the save) the others could not. The agreement takes the most advanced, and what the others
would do again is not done twice: their step is dropped (the state comes from the rank ahead), and a save a rank
ahead began at that step is skipped (``_skip``: per step, the number of saves begun). A machine that answers again
joins at a step boundary: the ranks agree to leave the round there (the stop question's second flag), the joining
ranks enter it from ``Engine.setup`` (their script runs from its first line and waits there to be let in)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, Optional

import torch

from launcher.base.env import TORCHRUN_VARS, DistEnv
from launcher.base.logs import take_the_console
from launcher.group.abort import PeerLost
from launcher.group.failed import CollectiveFailed, typed_errors
from launcher.group.helpers import Peers
from launcher.group.rendezvous import Group
from launcher.heal.protocol import Decision
from launcher.heal.rank_side import HealStop, LeftJob
from launcher.train.in_place import Healing

log = logging.getLogger(__name__)
_PLACE_VARS = {
    TORCHRUN_VARS[k] for k in ("rank", "world_size", "node_rank", "num_nodes", "role_rank", "role_world_size")
}


class EngineRounds:
    """Mixed into ``Engine``: what it holds that a heal rebuilds."""

    env: DistEnv
    device: torch.device
    pos: Any
    peers: Peers
    state: Any
    sync: Any
    watch: Any
    job: Any
    _seam: Healing
    _group: Optional[Group]
    _loader: Any
    _plain: Any
    _stops: Any
    _saves_at: tuple[int, int]  # (step, saves begun at it) on this rank
    _skip: tuple[int, int]  # (step, saves begun at it by the rank furthest on): not begun again after a heal
    _joined: bool  # this rank joined a running job: its state came from a live peer (``resume`` reads nothing)
    _out: bool  # this rank is out of the job (declared lost while it ran) or the job stopped healing
    _seen: Optional[tuple[int, ...]]  # the parameters' versions the last step left (``checks.check_changed``)
    _step_state: Any  # the current step's (``steps.StepState``)

    def _build_sync(self, kept: dict[str, Any], healed: bool) -> None:
        raise NotImplementedError

    def _save_once(self, save: Callable[[], None]) -> None:
        """``save`` (collective), unless a rank further on began this one before a heal (then the ranks would not
        meet in it); in a job that heals, a loss while it writes (outside a step) heals, the checkpoint cut short."""
        step = self.pos.step
        begun = self._saves_at[1] + 1 if self._saves_at[0] == step else 1
        self._saves_at = (step, begun)
        if self._skip[0] == step and begun <= self._skip[1]:
            return
        if self._seam.abort is None or self._step_state.inside:  # (inside a step: the step heals)
            save()
            return
        try:
            with typed_errors(self._seam.abort):
                save()
        except (PeerLost, CollectiveFailed) as exc:
            decision = self._lost(exc)
            log.warning("the checkpoint of step %d was cut short by the loss: healing; the next save writes one", step)
            self._heal(decision)

    def _worlds(self) -> list[int]:
        """The numbers of ranks the job may go on with after healing in place ([]: a job that does not heal)."""
        c = self.job.cluster
        if self._seam.abort is None or c.min_nodes is None:
            return []
        return [nodes * self.env.local_world_size for nodes in range(c.min_nodes, c.nodes + 1)]

    def _lost(self, exc: PeerLost | CollectiveFailed) -> Decision:
        """The keeper's decision that a machine was lost under ``exc``; ``exc`` raised when none was (a peer failed
        on its own: the job fails, as it would without healing)."""
        decision = self._seam.lost(exc)
        if decision is None:
            raise exc
        return decision

    def _heal(self, decision: Decision, joining: bool = False) -> None:
        """Into the round after ``decision`` (collective with its members, joining ones too); a machine lost while
        it formed: into the round after that one. ``LeftJob`` (this rank was declared lost while it ran) is raised
        on: the rank ends cleanly, the job goes on without it."""
        while True:
            if self.sync is not None:
                self.sync.leave()
            if self._seam.abort is not None:
                self._stops.left(self._seam.abort)
            try:
                with typed_errors(self._seam.abort):
                    self._enter_round(decision, joining)
                return
            except (PeerLost, CollectiveFailed) as exc:
                decision = self._lost(exc)
            except (LeftJob, HealStop):
                self._out = True  # (its close does not tell the keeper the job trained to its end)
                raise

    def _enter_round(self, decision: Decision, joining: bool) -> None:
        self._group, self.env = self._seam.enter(self.env, decision)
        env = self.env
        if env.is_main:
            take_the_console()  # (perhaps the new rank 0: its output to the console from now on)
        os.environ.update({k: v for k, v in env.torchrun_environ(0).items() if k in _PLACE_VARS})  # (the script's)
        self.state.regroup(env, joining)  # (collective) FSDP2: sharded anew on this round's mesh, shards kept
        completed = -1 if joining else self.pos.step
        facts = self.peers.all_gather_object((completed, self._saves_at))
        steps = [step for step, _ in facts]
        top = max(steps)
        self._skip = (top, max((saves[1] for _, saves in facts if saves[0] == top), default=0))
        sent = self._seam.settle(
            env, steps, self.pos.step, lambda: self.state.state_dict(env, self.sync), by_place=self.state.by_place
        )
        if sent is not None:
            self.state.take(sent, joining)
        self._joined = self._joined or joining
        self._build_sync({"healed": True}, healed=True)  # (collective) measured again: the ranks changed
        if self._loader is not None:
            self._loader.regroup(env.rank, env.world_size)
        self.sync.zero_grad(self._plain)  # what the step cut short left in the gradients
        self._seen = None  # (the state taken, the sync built: the parameters' versions moved)
        scaler = self.state.scaler
        if scaler is not None:  # (a step cut short after its unscale: the next one unscales anew)
            scaler._per_optimizer_states.clear()
