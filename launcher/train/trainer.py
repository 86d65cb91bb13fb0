"""The built-in trainer: model, data and optimiser from the config, the gradient sync the config asks for, checkpoints
that resume bit-identically, metrics and a summary; the same with one rank or many (no ``if ddp:`` branches).

Reading map: ``__init__`` builds every component once, in order, each handed what it needs. ``fit`` runs rounds of
the loop: a round is the life of one process group and its ``World`` (the gradient sync, the loaders). A round
returns how it ended (``progress.RoundEnd``): ``Finished``, ``Stopped`` (a stop agreed at a step boundary, the
checkpoint written), ``Lost`` or ``Grows`` with the keeper's decision (a machine lost under it, or one joining:
the one seam to healing, ``in_place.Healing``, tells; the next round's world is built and the loop goes on from
the agreed step), or ``Left``. Any other error is raised as it is, the user's frames and the trainer's step in its
traceback."""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import torch
from torch.utils.data import Dataset
from tqdm import tqdm

from launcher.base.devices import seed_all
from launcher.base.env import DistEnv
from launcher.base.faults import Fault, faults_for, fire_at
from launcher.base.run_dir import RunDir
from launcher.config import JobConfig, collective_timeout_s
from launcher.group import helpers as rank_helpers
from launcher.group.abort import PeerLost
from launcher.group.failed import CollectiveFailed, CollectiveTimedOut, typed_errors
from launcher.group.rendezvous import Group
from launcher.group.stall import timed_out
from launcher.heal.protocol import Decision
from launcher.heal.rank_side import Healer, LeftJob
from launcher.report.summary import RunSummary
from launcher.train.banner import node_hosts, show_banner
from launcher.train.data import IMAGE_MODELS, build_datasets
from launcher.train.in_place import Healing, healing_for
from launcher.train.model import build_model, check_same_weights
from launcher.train.optim import build_optimizer
from launcher.train.progress import Finished, Grows, Left, Lost, RoundEnd, Totals
from launcher.train.records import Records, progress_bar
from launcher.train.saving import Checkpointer
from launcher.train.state import TrainState, state_kind
from launcher.train.stop import Stopped, StopRequest
from launcher.train.world import World
from launcher.trust.secret import Secret
from launcher.watch import ProgressWatch

log = logging.getLogger(__name__)


class Trainer:
    # the job, fixed for the run
    job: JobConfig
    device: torch.device
    backend: str
    run_dir: RunDir
    peers: rank_helpers.Peers  # every collective of the trainer: left when a machine is lost; objects signed
    # this round: this rank's place and group, and what holds the round's ranks (built again after a heal)
    env: DistEnv
    group: Optional[Group]
    world: Optional[World]  # None until a rank joining a running job is in
    hosts: list[str]  # each node's host, in node order (banner, summary)
    # the model and its training state (what a checkpoint holds), the data, the loop's running totals
    state: TrainState
    data: tuple[Dataset, Optional[Dataset]]  # (train, test): prepared once on the CPU
    totals: Totals
    has_state: bool  # this rank holds the job's state (its own, or from a live peer; not yet: it joins)
    resumed_from: Optional[str]
    started: float  # when the loop started (perf_counter); wall_s: its time, once every step is trained
    wall_s: Optional[float]
    watch: ProgressWatch  # the progress watch (its rounds follow the trainer's)
    seam: Healing  # healing in place (NoHealing in a job that does not heal)
    stop: Optional[StopRequest]  # a stop signal, agreed by every rank at a step boundary
    checkpointer: Checkpointer
    records: Records  # metrics.jsonl, the comm trace, the evaluation, summary.json
    faults: dict[int, Fault]  # LAUNCHER_FAULT: the failure tests'
    phase: str  # what the ranks are doing, for a timed-out collective's report

    def __init__(
        self,
        job: JobConfig,
        env: DistEnv,
        device: torch.device,
        backend: str,
        group: Optional[Group] = None,
        stop: Optional[StopRequest] = None,
        secret: Optional[Secret] = None,
        watch: Optional[ProgressWatch] = None,
        healer: Optional[Healer] = None,  # a rank of a job that heals in place (sim, ssh): its side of healing
    ) -> None:
        # 1. the job, this rank's place in it
        self.job, self.env, self.device, self.backend, self.group = job, env, device, backend, group
        self.run_dir, self.phase, self.faults = job.run, "start-up", faults_for(env)
        # 2. healing in place (sim, ssh): the seam, and the abort signal every collective of the trainer waits through
        self.watch = watch or ProgressWatch()
        failing = lambda: self.stop is not None and self.stop.failing()  # noqa: E731 (another rank failed on its own)
        self.seam = healing_for(healer, self.watch, failing)
        self.peers = rank_helpers.Peers(self.seam.abort, secret)
        self.stop = stop or (StopRequest() if self.seam.abort is not None else None)  # (where a machine joins)
        joins = self.seam.joins  # no collective until the keeper lets it in
        self.has_state = not joins
        # 3. the model, the same initial weights on every rank; per-rank RNG streams (data order: the sampler's)
        model, kind = build_model(job, device), state_kind(job)  # (the state's kind: replicated or sharded)
        if not joins:  # (a joining rank's model is sharded once it is in a round: ``regroup``)
            check_same_weights(model, self.peers)
            kind.prepare(job, env, device, model)  # sharded in place (comm.reducer=fsdp), before the optimizer
        seed_all(job.train.seed + env.rank)
        # 4. the checkpoint to resume from (rank 0's choice, agreed), the optimizer, the data, the records
        self.checkpointer = Checkpointer(job, env, device, self.peers, joins)
        optimizer = build_optimizer(job.optim, model, env.world_size, job.train.precision)  # fused where it applies
        self.state = kind(job, model, optimizer, device)
        self.data = build_datasets(job.data, images=job.model["_target_"] in IMAGE_MODELS)
        self.totals, self.resumed_from, self.started, self.wall_s = Totals.on(device), None, 0.0, None
        self.records = Records(job, env, self.peers, self.state, self.watch, self.checkpointer.start_step)
        self.world, self.hosts = None, []
        if joins:
            return  # the world, the span and the state once the keeper lets it in (``_next_round``), from a peer
        # 5. this round's world (the resumed run's measured choices kept), the span and LR schedule, the banner
        global_batch = (job.train.batch_size_per_rank or job.train.batch_size // env.world_size) * env.world_size
        self.world = self._build_world(global_batch, self.checkpointer.kept(env.world_size))
        self.state.shape(global_batch, len(self.world.train_loader))
        self.hosts = show_banner(self.job, self.env, self.backend, self.device, self.world, self.state.span, self.peers)

    def _build_world(self, global_batch: int, kept: dict[str, Any]) -> World:
        args = (self.state.model, self.state.optimizer, self.data, global_batch, self.peers, kept)
        return World.build(self.job, self.env, self.device, *args)

    def _world(self) -> World:
        assert self.world is not None, "a rank joining a running job has no world before it is in a round"
        return self.world

    # ---------------------------------------------------------------- the loop
    def fit(self) -> RunSummary | Stopped | None:
        """Train to the end: the summary (rank 0 wrote summary.json); ``Stopped``: every rank stopped at one step on a
        stop signal, the checkpoint written (the rank's entry then ends as it asked); None: this rank left the job."""
        try:
            with typed_errors(self.seam.abort):  # torch's errors of a failed collective as ours (group/failed.py)
                return self._fit()
        except CollectiveTimedOut as exc:  # where, after how long, and who is stuck; torch's own error its cause
            raise timed_out(self.env, self.phase, collective_timeout_s(self.job.comm), self.group) from exc.__cause__
        finally:
            if self.stop is not None:
                self.stop.disarm()
            if self.world is not None:
                self.world.sync.close()
            self.checkpointer.close()
            self.records.close()
            self.seam.close(trained=self.wall_s is not None)

    def _fit(self) -> RunSummary | Stopped | None:
        self.resumed_from = self.checkpointer.resume(self.state, self.env, self.job.train.seed, self.totals)
        self.started = time.perf_counter()
        joining = self.seam.start(self.group)  # a joining rank: the decision that lets it in
        if joining is not None and self._next_round(joining) is not None:
            return None
        if self.stop is not None:
            self.stop.arm()  # a signal now means: stop at the next step boundary with a checkpoint
        with progress_bar(self.state.span.total_steps, self.state.pos.step, self.env.is_main) as bar:
            end = self._round(bar)
            while isinstance(end, (Lost, Grows)):  # a machine was lost, or one joins: on in the next round
                end = self._next_round(end.decision) or self._round(bar)
        self.checkpointer.wait("the end of the run" if isinstance(end, Finished) else "the stop")  # (async: written)
        if not isinstance(end, Finished):
            return end if isinstance(end, Stopped) else None  # (Left: the job goes on without this rank)
        sync, wall_s = self._world().sync, self.wall_s or 0.0
        return self.records.summary(self.env, self.backend, sync, self.totals, wall_s, self.hosts, self.resumed_from)

    def _round(self, bar: tqdm) -> RoundEnd:
        """Train in this round: to the end (the last evaluation and checkpoint too), to a stop, or until a machine
        is lost or joins. An error that is no failed collective is raised as it is."""
        try:
            with typed_errors(self.seam.abort):
                if self.wall_s is None:  # (a round after a loss in the last evaluation: every step is trained)
                    end = self._train(bar, self._world())
                    if not isinstance(end, Finished):
                        return end
                    self.wall_s = time.perf_counter() - self.started  # every step trained: a stop signal acts now
                    self.records.trace_window(self.totals.trained_steps, self.env, end=True)
                    if self.stop is not None:
                        self.stop.disarm()
                self._complete()
                return Finished()
        except (PeerLost, CollectiveFailed) as exc:  # a machine lost under it? (the keeper's decision tells)
            if (decision := self.seam.lost(exc)) is None:
                raise
            return Lost(decision)

    def _train(self, bar: tqdm, world: World) -> RoundEnd:
        t, pos, span, totals = self.job.train, self.state.pos, self.state.span, self.totals
        if totals.trained_steps:  # healed: the step whose log or checkpoint the loss cut short, now (each once)
            self.records.log_if_due(self.totals, self.env, world.sync, bar)
            if (outcome := self._step_boundary()) is not None:
                return outcome
        while pos.step < span.total_steps and pos.epoch < t.epochs:
            epoch = pos.epoch
            world.sampler.set_epoch(epoch, skip=pos.batch_in_epoch * world.batch_per_rank)
            world.sync.module.train()
            for raw in world.train_loader:
                self.records.trace_window(totals.trained_steps, self.env)
                loss = self._step(world, raw)
                totals.window[:2] += torch.stack([loss.detach().double(), torch.ones_like(totals.window[0])])
                pos.step += 1
                pos.batch_in_epoch += 1
                totals.trained_steps += 1
                bar.update(1)
                self.seam.step_completed(self.env, self.run_dir)
                self.records.log_if_due(self.totals, self.env, world.sync, bar)
                if (outcome := self._step_boundary()) is not None:
                    return outcome
                if pos.step >= span.total_steps:
                    break
            if pos.batch_in_epoch >= span.steps_per_epoch:
                pos.epoch, pos.batch_in_epoch = epoch + 1, 0
                if (epoch + 1) % t.eval_every_epochs == 0:
                    totals.evaluated, totals.last_eval_step = self._evaluate(epoch), pos.step
        return Finished()

    def _step(self, world: World, raw: Any) -> torch.Tensor:
        self.phase = f"step {self.state.pos.step + 1}"
        self.watch.note_step(self.state.pos.step)
        fire_at(self.faults, self.state.pos.step + 1, self.state.model)  # LAUNCHER_FAULT: tests and trying failures
        batch = self.records.batch(raw)  # any structure (batch.py); the first also tries train.metrics
        loss = self.state.stepper.step(world.sync, batch)  # micro-batches, precision, clipping: launcher/train/step.py
        if (exposed := world.sync.exposed_s()) is not None:
            self.totals.exposed_s += exposed
        return loss

    def _step_boundary(self) -> Optional[RoundEnd]:
        """After a step: the checkpoint cadence, then (collective) whether any rank was asked to stop: ``Stopped``
        (every rank leaves at this step, with one checkpoint), ``Grows`` (a machine joins), or None: on."""
        every, pos = self.job.train.checkpoint_every_steps, self.state.pos
        saved = bool(every) and pos.step % every == 0
        if saved and self.totals.saved_step < pos.step:  # (after a heal, this step's may be written already)
            self._save()
        if self.stop is None:
            return None
        pipelined, abort, growing = self._world().sync.overlaps_forward, self.peers.abort, self.seam.growth()
        if self.stop.agreed(self.device, pipelined=pipelined, growing=growing is not None, abort=abort):
            if not saved:
                self._save()
            return Stopped(pos.step, self.stop.signum or 0)
        decision = self.seam.growth(agreed=True) if self.stop.grow else None  # (the ranks agreed: it is written)
        return None if decision is None else Grows(decision)

    def _evaluate(self, epoch: int) -> Optional[dict[str, Optional[float]]]:
        self.phase = f"the evaluation after epoch {epoch}"
        return self.records.evaluate(epoch, self._world())

    def _save(self) -> None:
        step, started, sync = self.state.pos.step, time.perf_counter(), self._world().sync
        self.phase = f"the checkpoint at step {step}"
        sync.flush()  # the checkpoint holds the fully updated state (forward overlap)
        self.checkpointer.save(self.state, sync, self.env, step, self.totals.partial())
        self.totals.saved_step = step
        self.records.saved(step, time.perf_counter() - started, self.checkpointer.background is not None)

    def _complete(self) -> None:
        """The end: the evaluation and the checkpoint the loop did not write."""
        totals, pos = self.totals, self.state.pos
        if totals.last_eval_step != pos.step or totals.evaluated is None:  # the final model, evaluated
            totals.evaluated = self._evaluate(pos.epoch)
        if totals.saved_step != pos.step:
            self._save()
        self.seam.step_completed(self.env, self.run_dir, "the end of training")  # a loss at the end: recorded now

    def _next_round(self, decision: Decision) -> Optional[Left]:
        """Into the round after ``decision`` (collective with its members, new ones too); a machine lost while it
        formed: into the round after that one. None once this rank is in; ``Left``: it is out of the job."""
        while True:
            if self.world is not None:
                self.world.sync.leave()
            try:
                with typed_errors(self.seam.abort):
                    self._enter_round(decision)
                return None
            except LeftJob as left:
                log.warning("%s", left)
                return Left(str(left))
            except (PeerLost, CollectiveFailed) as exc:  # a machine lost while the round formed: the one after it
                if (again := self.seam.lost(exc)) is None:
                    raise
                decision = again

    def _enter_round(self, decision: Decision) -> None:
        joining = not self.has_state  # it joins: the state, and the job's shape, come from the others
        self.group, self.env = self.seam.enter(self.env, decision)
        self.state.regroup(self.env, joining)  # (collective) sharded: anew on this round's mesh, shards kept
        self.records.entered(self.env)  # (perhaps as the new rank 0)
        behind, env = self.state.pos.step, self.env  # one gather: each rank's step (-1: it joins), counts, node, host
        mine = (-1 if joining else behind, self.totals.counts(), env.node_rank, env.hostname)
        facts = self.peers.all_gather_object(mine)
        state = lambda: self.state.state_dict(env, self._world().sync)  # noqa: E731 (a sharded rank's: its shards)
        sent = self.seam.settle(env, [f[0] for f in facts], behind, state, by_place=self.state.by_place)
        if sent is not None:
            self.state.take(sent, joining)
            self.has_state = True
        self.totals.take_highest([f[1] for f in facts])
        self.world = self._build_world(self.state.span.global_batch, {"healed": True})  # measured again: ranks changed
        self.hosts = node_hosts([f[2:] for f in facts])
