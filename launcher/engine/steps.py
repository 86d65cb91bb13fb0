"""One optimizer step of a loop through the engine (``Engine``'s part that runs every step): the block around it,
the micro-batches of ``train.accumulate_steps``, the backward that precision and accumulation need, the optimizer's
``step`` and ``zero_grad`` as the engine routes them, and the stop at a step boundary (``engine/stopping.py``)."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch

from launcher.base.env import DistEnv
from launcher.base.faults import Fault, fire_at
from launcher.comm.sync import Sync
from launcher.engine.checks import check_changed, check_schedulers, versions
from launcher.engine.rounds import EngineRounds
from launcher.engine.state import Plain
from launcher.engine.stopping import StopSignals
from launcher.group.abort import PeerLost
from launcher.group.failed import CollectiveFailed, typed_errors
from launcher.train.batch import chunk_tree
from launcher.train.progress import Position
from launcher.train.saving import Checkpointer


@dataclass
class StepState:
    """Where the current ``Engine.step()`` block is (a heal asks: was the step applied, was it counted?)."""

    inside: bool = False  # inside the block (a save there is the step's: the step heals)
    applied: bool = False  # the optimizer stepped
    counted: bool = False  # the step is counted (``global_step``): completed
    versions: tuple[int, ...] = ()  # the parameters' versions at its start (a job that heals: ``checks.py``)

    @property
    def done(self) -> bool:
        """After the block: the step completed (False: a heal dropped it; its batch comes again, re-split)."""
        return self.counted


class Steps(EngineRounds):
    """Mixed into ``Engine``: what it holds that a step uses."""

    job: Any
    pos: Position
    device: torch.device
    sync: Optional[Sync]
    checkpointer: Optional[Checkpointer]
    scaler: Optional[torch.amp.GradScaler]
    watch: Any
    _plain: Optional[Plain]
    _divide: int
    _stops: StopSignals
    _faults: dict[int, Fault]
    _step_state: StepState
    optimizer: Any
    env: DistEnv

    def _require(self, what: str) -> None:
        if self.sync is None:
            raise ValueError(f"{what} before engine.setup(model, optimizer); HINT: setup first")

    def save(self, extra: Optional[dict[str, Any]] = None) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def step(self) -> Iterator[StepState]:
        """Around one optimizer step: counted when its block completes; then the checkpoint cadence
        (``train.checkpoint_every_steps``: ``save`` with the last ``extra``), the stop at a step boundary. In a job
        that heals in place, a machine lost inside the block ends it unapplied on every survivor: the block is
        left (the exception suppressed), the survivors go on in the next round (``engine/rounds.py``)."""
        self._require("engine.step()")
        self._stops.install()  # (the loop's first step: a stop signal now waits for a step boundary)
        if self.watch is not None:
            self.watch.note_step(self.pos.step)
        fire_at(self._faults, self.pos.step + 1, self.state.model)  # LAUNCHER_FAULT: tests and trying failures
        now = self._step_state = StepState(inside=True)
        heals = self._seam.abort is not None  # (a job that does not heal: torch's errors as they are)
        if heals:  # what a loop that heals must not do (``checks.py``)
            now.versions = versions(self.state.model)
            if self._seen is not None:  # (what the last step left)
                check_changed(self._seen, now.versions, inside=False)
            check_schedulers(self.optimizer, self.state.registered)
        try:
            with typed_errors(self._seam.abort) if heals else contextlib.nullcontext():
                yield now
                if heals and not now.applied:
                    check_changed(now.versions, versions(self.state.model), inside=True)
                self._boundary(now)
                if heals:
                    self._seen = versions(self.state.model)
        except (PeerLost, CollectiveFailed) as exc:  # a machine lost? (the keeper's decision tells; else raised)
            decision = self._lost(exc)
            if now.applied and not now.counted:  # (the optimizer stepped: a collective after it in the body failed)
                self._count()
            elif not now.counted and self._loader is not None:
                self._loader.give_back(self.pos.step)  # its batch again, re-split over the next round's ranks
            self._heal(decision)
        finally:
            now.inside = False

    def _count(self) -> None:
        self.pos.step += 1
        self._step_state.counted = True
        self._seam.step_completed(self.env, self.job.run)  # the first step after a heal: the change recorded

    def _boundary(self, now: StepState) -> None:
        self._count()
        every = self.job.train.checkpoint_every_steps
        saved = bool(every) and self.pos.step % every == 0
        if saved:
            self.save()
        growing = self._seam.growth() is not None  # (a machine ready to join: the ranks agree to let it in here)
        if self._stops.stopping(self.device, growing, self._seam.abort):
            now.inside = False
            self._stopped(saved)
        if self._stops.grow:  # every rank saw it: all leave the round at this boundary, the new ranks come in
            decision = self._seam.growth(agreed=True)
            assert decision is not None, "the ranks agreed that a machine joins"
            self._heal(decision)

    def _stopped(self, saved: bool) -> None:
        """Every rank at this step boundary: the checkpoint (unless the cadence wrote it), written; the end."""
        signum = self._stops.agreed
        if not saved:
            self.save()
        assert self.checkpointer is not None
        self.checkpointer.wait("the stop")
        if self.env.is_main:
            print(
                f"launcher.Engine: stopped at step {self.pos.step} on {signal.Signals(signum).name}: the checkpoint is "
                f"in {self.job.run.checkpoints}; run again with the same run dir (engine.resume()) to continue",
                flush=True,
            )
        self.close()
        raise SystemExit(128 + signum)

    def micro_batches(self, batch: Any) -> Iterator[Any]:
        """``train.accumulate_steps`` equal parts of this rank's ``batch``: each one's forward and ``backward`` in
        the loop's body (the gradients synchronised once, after the last; each loss divided by their number)."""
        self._require("engine.micro_batches()")
        assert self.sync is not None
        n = self.job.train.accumulate_steps
        parts = chunk_tree(batch, n) if n > 1 else [batch]
        self._divide = n
        try:
            for i, part in enumerate(parts):
                with self.sync.no_sync() if i < n - 1 else contextlib.nullcontext():
                    yield part
        finally:
            self._divide = 1

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` as precision and accumulation need it (fp16: scaled; a micro-batch's: divided)."""
        if self._divide > 1:
            loss = loss / self._divide
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def optimizer_step(self) -> None:
        """The returned optimizer's ``step``: unscaled and clipped where configured, fp16's inf/nan steps skipped."""
        self._require("optimizer.step()")
        plain, clip = self._plain, self.job.optim.clip_grad_norm
        assert plain is not None and self.sync is not None
        if self.scaler is not None:
            self.scaler.unscale_(plain)  # type: ignore[arg-type]  # (the scaler reads its param groups)
        if clip is not None:
            params = [p for group in plain.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(params, clip)
        if self.scaler is not None:
            self.scaler.step(plain)  # type: ignore[arg-type]
            self.scaler.update()
        else:
            self.sync.step(plain)  # type: ignore[arg-type]
        self._step_state.applied = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The returned optimizer's ``zero_grad``: the sync's (our reducer keeps gradients as views of its buckets)."""
        self._require("optimizer.zero_grad()")
        assert self.sync is not None and self._plain is not None
        self.sync.zero_grad(self._plain)  # type: ignore[arg-type]
