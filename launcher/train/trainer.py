"""The built-in trainer: model, data and optimiser from the config, torch DDP as the reducer, checkpoints that
resume bit-identically, metrics and a summary. Runs the same with one rank or many (no ``if ddp:`` branches)."""

from __future__ import annotations

import logging
import math
import time
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from .. import dist_helpers, membership
from ..comm import trace
from ..comm.trace import Tracer, write_trace
from ..config import JobConfig
from ..devices import describe_device, seed_all
from ..env import DistEnv
from ..faults import faults_for, fire_at
from ..rendezvous import Group
from ..stall import explain_stall, is_timeout
from ..summary import RunSummary
from ..watch import note_step, stragglers
from . import checkpoint as ckpt
from .banner import format_banner
from .data import build_datasets, eval_loader, train_loader
from .metrics import MetricsWriter
from .model import build_model, check_same_weights, evaluate
from .optim import build_optimizer, build_scheduler
from .saving import Checkpointing, Position
from .step import Stepper, describe_precision, whole_gradient_reason
from .stop import Preempted, StopRequest
from .sync import GradientSync

log = logging.getLogger(__name__)


class Trainer(Checkpointing):
    def __init__(
        self,
        job: JobConfig,
        env: DistEnv,
        device: torch.device,
        backend: str,
        group: Optional[Group] = None,
        stop: Optional[StopRequest] = None,
    ) -> None:
        self.job, self.env, self.device, self.backend, self.stop = job, env, device, backend, stop
        self.group = group
        self.run_dir = Path(job.run_dir)
        world = env.world_size
        t = job.train
        self.batch_per_rank = t.batch_size_per_rank or t.batch_size // world
        self.global_batch = self.batch_per_rank * world

        model = build_model(job, device)
        check_same_weights(model)
        seed_all(t.seed + env.rank)  # per-rank stream for dropout/augmentation; data order comes from the sampler
        self.model = model
        self.ckpt_dir = self.run_dir / "checkpoints"
        self._resume_path, self._resume_state = ckpt.agreed_resume_source(job.train.resume, self.ckpt_dir, device)
        # a resumed run keeps the strategy and bucket cap it measured before: the same summation order, bit for bit
        # (on another world size both are measured again: the layout of ranks and links changed)
        kept = self._resume_state or {}
        if kept.get("world_size", world) != world:
            kept = {}
        self.optimizer = build_optimizer(job.optim, model, world)
        self.sync = GradientSync(
            model,
            env,
            device,
            job.comm,
            self.optimizer,
            resumed_hierarchical=kept.get("hierarchical"),
            resumed_cap_mb=kept.get("bucket_cap_mb"),
            whole_gradient=whole_gradient_reason(t, job.optim),
        )
        train_set, test_set = build_datasets(job.data)
        loading = {"workers": job.data.num_workers, "pin": device.type == "cuda"}
        self.train_loader = train_loader(train_set, self.batch_per_rank, env.rank, world, seed=t.seed, **loading)
        self.test_loader = eval_loader(test_set, max(256, self.batch_per_rank), env.rank, world, **loading)
        self.steps_per_epoch = len(self.train_loader)
        schedule_steps = t.epochs * self.steps_per_epoch  # the schedule spans the epochs; max_steps only stops early
        self.total_steps = min(t.max_steps or schedule_steps, schedule_steps)
        self.scheduler = build_scheduler(job.optim, self.optimizer, schedule_steps)
        self.stepper = Stepper(t, job.optim, device, self.sync, self.optimizer, self.scheduler)
        self.pos = Position()
        self.resumed_from: Optional[str] = None
        self.metrics = MetricsWriter(self.run_dir, enabled=env.is_main)
        self._faults = faults_for(env)  # LAUNCHER_FAULT, for the failure tests
        self._phase = "start-up"  # what the ranks are doing, for a timed-out collective's report
        self._exposed_s = 0.0  # communication waited for since the last log
        self._tracer = Tracer(env.rank, env.hostname) if job.comm.trace else None  # comm.trace
        self._tracing = ExitStack()
        self._banner()

    def _banner(self) -> None:
        """One screen at start (rank 0); every rank's node, host and device are gathered for it (and the hosts
        for the summary)."""
        env = self.env
        facts = dist_helpers.all_gather_object((env.node_rank, env.hostname, describe_device(self.device)))
        self.hosts = [host for _, host in sorted({node: host for node, host, _ in reversed(facts)}.items())]
        if env.is_main:
            t = self.job.train
            batch = (
                f"{self.global_batch} global = {self.batch_per_rank} per rank x {env.world_size}; "
                f"{self.total_steps} steps ({t.epochs} epoch(s) of {self.steps_per_epoch}); "
                f"{describe_precision(t, self.job.optim)}"
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
                f"{self.job.comm.timeout_s:.0f} s (comm.timeout_s); {explain_stall(self.group, where)}"
            ) from exc
        finally:
            if self.stop is not None:
                self.stop.disarm()
            self.sync.close()
            self.metrics.close()

    def _fit(self) -> RunSummary:
        self.maybe_resume()
        t, env = self.job.train, self.env
        start = time.perf_counter()
        trained_steps, last_eval_epoch = 0, -1
        window = torch.zeros(3, dtype=torch.float64, device=self.device)  # loss sum, batches, exposed comm s
        window_t0, final_loss, accuracy = time.perf_counter(), math.nan, None
        bar = tqdm(
            total=self.total_steps,
            initial=self.pos.step,
            disable=None if env.is_main else True,
            unit="step",
            dynamic_ncols=True,
            leave=False,
        )
        quiet_bar = logging_redirect_tqdm(loggers=[logging.getLogger("launcher")]) if env.is_main else nullcontext()
        if self.stop is not None:
            self.stop.arm()  # a signal now means: stop at the next step boundary with a checkpoint
        with quiet_bar:
            while self.pos.step < self.total_steps and self.pos.epoch < t.epochs:
                epoch = self.pos.epoch
                skip = self.pos.batch_in_epoch * self.batch_per_rank
                self.train_loader.sampler.set_epoch(epoch, skip=skip)
                self.sync.module.train()
                for x, y in self.train_loader:
                    self._trace_window(trained_steps)
                    loss = self._step(x, y)
                    window[:2] += torch.stack(
                        [loss.detach().double(), torch.ones((), dtype=torch.float64, device=self.device)]
                    )
                    self.pos.step += 1
                    self.pos.batch_in_epoch += 1
                    trained_steps += 1
                    bar.update(1)
                    if self.pos.step % t.log_every_steps == 0 or self.pos.step == self.total_steps:
                        final_loss = self._log_window(window, window_t0)
                        bar.set_postfix(epoch=epoch, loss=f"{final_loss:.4f}")
                        window.zero_()
                        window_t0 = time.perf_counter()
                    self._checkpoint_or_stop()
                    if self.pos.step >= self.total_steps:
                        break
                if self.pos.batch_in_epoch >= self.steps_per_epoch:
                    self.pos.epoch, self.pos.batch_in_epoch = epoch + 1, 0
                    if (epoch + 1) % t.eval_every_epochs == 0:
                        accuracy, last_eval_epoch = self._evaluate(epoch), epoch
        bar.close()
        self._trace_window(trained_steps, end=True)
        if self.stop is not None:
            self.stop.disarm()
        wall = time.perf_counter() - start
        if last_eval_epoch != self.pos.epoch - 1 or accuracy is None:
            accuracy = self._evaluate(self.pos.epoch)
        if not (t.checkpoint_every_steps and self.pos.step % t.checkpoint_every_steps == 0 and trained_steps):
            self.save()
        return self._summary(final_loss, accuracy, trained_steps, wall)

    def _checkpoint_or_stop(self) -> None:
        """After a step: the checkpoint cadence, then (collective) whether any rank was asked to stop; if so, every
        rank leaves at this step with one checkpoint (``Preempted``)."""
        every = self.job.train.checkpoint_every_steps
        saved = bool(every) and self.pos.step % every == 0
        if saved:
            self.save()
        if self.stop is not None and self.stop.agreed(self.device, pipelined=self.sync.overlaps_forward):
            if not saved:
                self.save()
            raise Preempted(self.pos.step, self.stop.signum or 0)

    def _step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self._phase = f"step {self.pos.step + 1}"
        note_step(self.pos.step)
        fire_at(self._faults, self.pos.step + 1, self.model)  # LAUNCHER_FAULT: tests and trying failures
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        loss = self.stepper.step(x, y)  # micro-batches, precision, clipping: launcher/train/step.py
        if (exposed := self.sync.exposed_s()) is not None:
            self._exposed_s += exposed
        return loss

    def _trace_window(self, trained_steps: int, end: bool = False) -> None:
        """comm.trace: record steps 2 .. 1 + trace_steps of this run (the first warms up), then every rank hands
        its events to rank 0, which writes trace.json. Collective at the window's end (same step everywhere)."""
        if self._tracer is None:
            return
        if trained_steps == 1 and not end:
            self._tracing.enter_context(self._tracer.activate())
            return
        if trace.active() is not None and (end or trained_steps == 1 + self.job.comm.trace_steps):
            self._tracing.close()
            events = dist_helpers.all_gather_object(self._tracer.trace_events())
            if self.env.is_main:
                log.info(
                    "comm.trace: %s (open in https://ui.perfetto.dev)", write_trace(self.run_dir / "trace.json", events)
                )
            self._tracer = None

    def _log_window(self, window: torch.Tensor, t0: float) -> float:
        """Global mean loss over the steps since the last log (one small allreduce every log_every steps)."""
        window[2] = self._exposed_s
        self._exposed_s = 0.0
        dist_helpers.all_reduce(window)
        batches = window[1].item() / self.env.world_size
        loss = window[0].item() / max(1.0, window[1].item())
        step_s = (time.perf_counter() - t0) / max(1.0, batches)
        record = {
            "kind": "train",
            "step": self.pos.step,
            "epoch": self.pos.epoch,
            "loss": loss,
            "lr": self.scheduler.get_last_lr()[0],
            "samples_per_s": self.global_batch / step_s,
            "step_s": step_s,
        }
        if self.sync.exposed_s() is not None:  # mean over ranks and steps of the wait after backward
            record["comm_exposed_s"] = window[2].item() / self.env.world_size / max(1.0, batches)
        self.metrics.write(record)
        return loss

    def _evaluate(self, epoch: int) -> Optional[float]:
        """Accuracy on the held-out split (None without one); logged and written to the metrics."""
        if self.test_loader is None:
            return None
        self._phase = f"the evaluation after epoch {epoch}"
        self.sync.flush()
        self.sync.module.eval()
        with self.stepper.autocast():
            loss, accuracy = evaluate(self.model, self.test_loader, self.device)
        self.metrics.write(
            {"kind": "eval", "step": self.pos.step, "epoch": epoch, "test_loss": loss, "test_accuracy": accuracy}
        )
        log.info("epoch %d step %d: test accuracy %.4f, test loss %.4f", epoch, self.pos.step, accuracy, loss)
        return accuracy

    def _summary(self, final_loss: float, accuracy: Optional[float], trained_steps: int, wall: float) -> RunSummary:
        job, env = self.job, self.env
        summary = RunSummary(
            world_size=env.world_size,
            nodes=env.num_nodes,
            procs_per_node=env.local_world_size,
            backend=self.backend,
            device=str(self.device.type),
            reducer=job.comm.reducer,
            hierarchical=self.sync.hierarchical,
            hierarchical_reason=self.sync.choice.reason,
            model=job.model["_target_"],
            data=job.data.label,
            epochs=self.pos.epoch,
            steps=self.pos.step,
            global_batch=self.global_batch,
            final_loss=final_loss,
            test_accuracy=accuracy,
            samples_per_s=trained_steps * self.global_batch / wall if wall > 0 else None,
            wall_s=wall,
            resumed_from=self.resumed_from,
            hosts=self.hosts,
            membership=membership.changes(self.run_dir),
            stragglers=stragglers(),
        )
        if env.is_main:
            summary.write(self.run_dir)
        return summary
