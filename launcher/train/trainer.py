"""The built-in trainer: model, data and optimiser from the config, torch DDP as the reducer, checkpoints that
resume bit-identically, metrics and a summary. Runs the same with one rank or many (no ``if ddp:`` branches)."""

from __future__ import annotations

import logging
import math
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from .. import dist_helpers
from ..comm.trace import Tracer
from ..config import JobConfig, collective_timeout_s
from ..config.rules import whole_gradient_reason
from ..devices import describe_device, seed_all
from ..env import DistEnv
from ..faults import faults_for, fire_at
from ..heal.rank import Grow, Healer
from ..rendezvous import Group
from ..secret import Secret
from ..stall import explain_stall, is_timeout
from ..summary import RunSummary
from ..watch import note_step
from . import checkpoint as ckpt
from .banner import describe_span, format_banner, node_hosts
from .data import IMAGE_MODELS, build_datasets, eval_loader, train_loader
from .in_place import Healing
from .metrics import MetricsWriter
from .model import build_model, check_same_weights
from .optim import build_optimizer, build_scheduler, describe_schedule
from .records import Records
from .saving import Checkpointing, Position
from .step import Stepper, describe_precision
from .stop import Preempted, StopRequest
from .sync import GradientSync

log = logging.getLogger(__name__)


@dataclass
class Loop:
    """The training loop's running totals (kept across a heal in place)."""

    window: torch.Tensor  # since the last log: loss sum, batches, exposed communication s
    window_t0: float = field(default_factory=time.perf_counter)
    trained_steps: int = 0
    last_eval_epoch: int = -1
    final_loss: float = math.nan
    accuracy: Optional[float] = None
    logged_step: int = -1
    saved_step: int = -1  # the step of the newest checkpoint this run wrote in the loop


class Trainer(Checkpointing, Healing, Records):
    def __init__(
        self,
        job: JobConfig,
        env: DistEnv,
        device: torch.device,
        backend: str,
        group: Optional[Group] = None,
        stop: Optional[StopRequest] = None,
        secret: Optional[Secret] = None,
    ) -> None:
        self.job, self.env, self.device, self.backend = job, env, device, backend
        self.group = group
        self.run_dir = Path(job.run_dir)
        self.healer = Healer.from_environ(job.cluster.lost_after_s, backend, secret)  # healing in place (sim, ssh)
        # every collective of the trainer: left when a machine is lost (healing), objects signed with the secret
        self.peers = dist_helpers.Peers(self.healer.abort if self.healer else None, secret)
        self.stop = stop or (StopRequest() if self.healer else None)  # (the step boundary where a machine joins)
        joins = self.healer is not None and self.healer.joins  # no collective until the keeper lets it in
        self.has_state = not joins  # the job's state, its own or (joining) from a live peer
        world = env.world_size
        t = job.train
        self.global_batch = (t.batch_size_per_rank or t.batch_size // world) * world

        model = build_model(job, device)
        if not joins:
            check_same_weights(model, self.peers)
        seed_all(t.seed + env.rank)  # per-rank stream for dropout/augmentation; data order comes from the sampler
        self.model = model
        self.ckpt_dir = self.run_dir / "checkpoints"
        self._resume_path, self._resume_state = (
            (None, None) if joins else ckpt.agreed_resume_source(job.train.resume, self.ckpt_dir, device, self.peers)
        )
        # a resumed run keeps the strategy and bucket cap it measured before: the same summation order, bit for bit
        # (on another world size both are measured again: the layout of ranks and links changed)
        kept = self._resume_state or {}
        if kept.get("world_size", world) != world:
            kept = {}
        self.optimizer = build_optimizer(job.optim, model, world)
        images = job.model["_target_"] in IMAGE_MODELS  # the built-in image models take (C, H, W) images
        self.train_set, self.test_set = build_datasets(job.data, images=images)
        self.pos = Position()
        self.resumed_from: Optional[str] = None
        self.metrics = MetricsWriter(self.run_dir, enabled=env.is_main)
        self._faults = faults_for(env)  # LAUNCHER_FAULT, for the failure tests
        self._phase = "start-up"  # what the ranks are doing, for a timed-out collective's report
        self._exposed_s = 0.0  # communication waited for since the last log
        self._tracer = Tracer(env.rank, env.hostname) if job.comm.trace else None  # comm.trace
        self._tracing = ExitStack()
        if joins:
            return  # the rest once the keeper lets it in, from a live peer's state (in_place.Healing.join_job)
        self._build_world(kept)
        self._schedule(len(self.train_loader))
        self._banner()

    def _schedule(self, steps_per_epoch: int) -> None:
        """The steps the run takes (the epochs, or ``train.max_steps`` when fewer), and the step that follows it.
        The LR schedule spans the steps the run takes (``optim.schedule_steps`` when given: a run stopped at N
        steps and extended to 2N then follows the 2N-step run bit for bit)."""
        t = self.job.train
        self.steps_per_epoch = steps_per_epoch
        epochs_steps = t.epochs * steps_per_epoch
        self.total_steps = min(t.max_steps or epochs_steps, epochs_steps)
        self.schedule_steps = self.job.optim.schedule_steps or self.total_steps
        self.scheduler = build_scheduler(self.job.optim, self.optimizer, self.schedule_steps)
        sync = getattr(self, "sync", None)
        self.stepper = Stepper(t, self.job.optim, self.device, sync, self.optimizer, self.scheduler)

    def _build_world(self, kept: dict) -> None:
        """What holds this round's ranks: the gradient sync (its groups) and the loaders (this rank's share of the
        same global batches). Built again when the job heals in place (``in_place.Healing``)."""
        job, env, t = self.job, self.env, self.job.train
        self.batch_per_rank = self.global_batch // env.world_size
        self.sync = GradientSync(
            self.model,
            env,
            self.device,
            job.comm,
            self.optimizer,
            resumed_hierarchical=kept.get("hierarchical"),
            resumed_cap_mb=kept.get("bucket_cap_mb"),
            whole_gradient=whole_gradient_reason(t, job.optim),
            peers=self.peers,
        )
        loading = {"workers": job.data.num_workers, "pin": self.device.type == "cuda"}
        world, rank = env.world_size, env.rank
        self.train_loader = train_loader(self.train_set, self.batch_per_rank, rank, world, seed=t.seed, **loading)
        self.test_loader = eval_loader(self.test_set, max(256, self.batch_per_rank), rank, world, **loading)

    def _banner(self) -> None:
        """One screen at start (rank 0); every rank's node, host and device are gathered for it (and the hosts
        for the summary)."""
        env = self.env
        facts = self.peers.all_gather_object((env.node_rank, env.hostname, describe_device(self.device)))
        self.hosts = node_hosts(facts)
        if env.is_main:
            t = self.job.train
            batch = (
                f"{self.global_batch} global = {self.batch_per_rank} per rank x {env.world_size}; "
                f"{self.total_steps} steps ({describe_span(self.total_steps, self.steps_per_epoch)}); "
                f"{describe_schedule(self.job.optim, self.schedule_steps)}; {describe_precision(t, self.job.optim)}"
            )
            devices = [f"{host}: {device}" for _, host, device in facts]
            log.info("job\n%s", format_banner(env, self.backend, devices, self.sync.description, batch, self.run_dir))

    # ---------------------------------------------------------------- loop
    def fit(self) -> RunSummary:
        try:
            return self._fit()
        except RuntimeError as exc:
            if not is_timeout(exc):
                raise
            where = self._phase
            raise RuntimeError(
                f"rank {self.env.rank} on {self.env.hostname}: a collective at {where} timed out after "
                f"{collective_timeout_s(self.job.comm):.0f} s (comm.timeout_s); {explain_stall(self.group, where)}"
            ) from exc
        finally:
            if self.stop is not None:
                self.stop.disarm()
            if getattr(self, "sync", None) is not None:  # (a joining rank that never got in has none)
                self.sync.close()
            self.metrics.close()
            if self.healer is not None:
                self.healer.close()  # the round's store watch

    def _fit(self) -> RunSummary:
        self.maybe_resume()
        start = time.perf_counter()
        self.loop = Loop(window=torch.zeros(3, dtype=torch.float64, device=self.device))  # loss, batches, comm s
        if self.healer is not None and self.healer.joins:
            self.join_job()  # (its loop counts and position come from the ranks it joins)
        elif self.healer is not None:
            self.healer.watch(self.group)
        if self.stop is not None:
            self.stop.arm()  # a signal now means: stop at the next step boundary with a checkpoint
        env = self.env
        bar = tqdm(
            total=self.total_steps,
            initial=self.pos.step,
            disable=None if env.is_main else True,
            unit="step",
            dynamic_ncols=True,
            leave=False,
        )
        quiet_bar = logging_redirect_tqdm(loggers=[logging.getLogger("launcher")]) if env.is_main else nullcontext()
        with quiet_bar:
            while not self._epochs(bar):
                pass  # healed in place (a machine was lost, or one joins): on in the next round
        bar.close()
        if self.healer is not None:
            self.healer.trained()
        self._trace_window(self.loop.trained_steps, end=True)
        if self.stop is not None:
            self.stop.disarm()
        wall = time.perf_counter() - start
        while True:
            try:
                return self._finish(wall)
            except Exception as exc:  # a machine lost in the last evaluation or checkpoint: those again, healed
                if not self.heal_after(exc):
                    raise

    def _finish(self, wall: float) -> RunSummary:
        """The end: the evaluation and the checkpoint the loop did not write, then the summary."""
        loop = self.loop
        if loop.last_eval_epoch != self.pos.epoch - 1 or loop.accuracy is None:
            loop.accuracy = self._evaluate(self.pos.epoch)
        if loop.saved_step != self.pos.step:  # the loop did not just write this step's
            self.save()
        self.healed_step("the end of training")  # a loss in the last evaluation or checkpoint: recorded now
        return self._summary(loop.final_loss, loop.accuracy, loop.trained_steps, wall)

    def _epochs(self, bar: tqdm) -> bool:
        """Train to the end (True), or until the job healed in place after losing a machine (False)."""
        t, loop = self.job.train, self.loop
        try:
            if loop.trained_steps:  # healed: the step whose log or checkpoint the loss cut short, now (each once)
                self._log_if_due(bar, self.pos.epoch)
                self._checkpoint_or_stop()
            while self.pos.step < self.total_steps and self.pos.epoch < t.epochs:
                epoch = self.pos.epoch
                skip = self.pos.batch_in_epoch * self.batch_per_rank
                self.train_loader.sampler.set_epoch(epoch, skip=skip)
                self.sync.module.train()
                for x, y in self.train_loader:
                    self._trace_window(loop.trained_steps)
                    loss = self._step(x, y)
                    loop.window[:2] += torch.stack(
                        [loss.detach().double(), torch.ones((), dtype=torch.float64, device=self.device)]
                    )
                    self.pos.step += 1
                    self.pos.batch_in_epoch += 1
                    loop.trained_steps += 1
                    bar.update(1)
                    self.healed_step()
                    self._log_if_due(bar, epoch)
                    self._checkpoint_or_stop()
                    if self.pos.step >= self.total_steps:
                        break
                if self.pos.batch_in_epoch >= self.steps_per_epoch:
                    self.pos.epoch, self.pos.batch_in_epoch = epoch + 1, 0
                    if (epoch + 1) % t.eval_every_epochs == 0:
                        loop.accuracy, loop.last_eval_epoch = self._evaluate(epoch), epoch
        except Exception as exc:
            if not self.heal_after(exc):
                raise
            return False
        return True

    def _checkpoint_or_stop(self) -> None:
        """After a step: the checkpoint cadence, then (collective) whether any rank was asked to stop; if so, every
        rank leaves at this step with one checkpoint (``Preempted``)."""
        every = self.job.train.checkpoint_every_steps
        saved = bool(every) and self.pos.step % every == 0
        if saved and self.loop.saved_step < self.pos.step:  # (after a heal, this step's may be written already)
            self.save()
            self.loop.saved_step = self.pos.step
        if self.stop is None:
            return
        growing = self.healer is not None and self.healer.growing()
        pipelined = self.sync.overlaps_forward
        if self.stop.agreed(self.device, pipelined=pipelined, growing=growing, abort=self.peers.abort):
            if not saved:
                self.save()
            raise Preempted(self.pos.step, self.stop.signum or 0)
        if self.stop.grow:
            raise Grow(f"a machine joins at step {self.pos.step}")

    def _step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self._phase = f"step {self.pos.step + 1}"
        note_step(self.pos.step)
        fire_at(self._faults, self.pos.step + 1, self.model)  # LAUNCHER_FAULT: tests and trying failures
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        loss = self.stepper.step(x, y)  # micro-batches, precision, clipping: launcher/train/step.py
        if (exposed := self.sync.exposed_s()) is not None:
            self._exposed_s += exposed
        return loss
