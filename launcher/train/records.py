"""What the trainer records as it goes: the logged window of steps (``metrics.jsonl``: loss, LR, throughput, the
gradient norm, the exposed communication), the communication trace (``comm.trace``) and the evaluation on the
held-out split. Rank 0 writes; the collectives (one small allreduce per log, the evaluation, the trace's gather)
run on every rank."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, Optional

import torch
from tqdm import tqdm

from launcher.base import membership
from launcher.base.env import DistEnv
from launcher.base.logs import console_stream, take_the_console
from launcher.comm import trace
from launcher.comm.sync import Sync
from launcher.comm.trace import Tracer, write_trace
from launcher.config import JobConfig
from launcher.group.helpers import Peers
from launcher.report.summary import RunSummary
from launcher.train.batch import Batch, as_tree, split, to_device
from launcher.train.metrics import MetricsWriter
from launcher.train.model import evaluate
from launcher.train.progress import Totals
from launcher.train.scores import Scores, metric_specs
from launcher.train.state import TrainState
from launcher.train.world import World
from launcher.watch import ProgressWatch

log = logging.getLogger(__name__)


@contextmanager
def progress_bar(total: int, initial: int, main: bool) -> Iterator[tqdm]:
    """The steps' progress bar on rank 0's console (the launcher's log lines print above it)."""
    bar = tqdm(
        total=total, initial=initial, disable=None if main else True, unit="step", dynamic_ncols=True, leave=False,
        file=console_stream(),  # the console itself (a terminal: the bar shows), not into the log file
    )  # fmt: skip
    try:  # (the launcher's log lines print above it: base/logs.py writes them through tqdm)
        yield bar
    finally:
        bar.close()


class Records:
    def __init__(
        self, job: JobConfig, env: DistEnv, peers: Peers, state: TrainState, watch: ProgressWatch, start_step: int = 0
    ) -> None:
        """``state``: the training state recorded (its position, span, schedule and stepper); ``start_step``: the
        step the run resumes from (0: a fresh start)."""
        self.job, self.peers, self.state, self.watch = job, peers, state, watch  # (the watch: its stragglers)
        self.run_dir = job.run
        self.metrics = MetricsWriter(self.run_dir, env.is_main, job.train.tensorboard, start_step)
        self._tracer: Optional[Tracer] = Tracer(env.rank, env.hostname) if job.comm.trace else None
        self.scores = Scores(metric_specs(job.train), job.train.labels_key)  # train.metrics, for every evaluation
        self._metrics_checked = False
        self._tracing = ExitStack()

    def entered(self, env: DistEnv) -> None:
        """This rank entered a new round (the job healed in place): as its rank 0, the console and the metrics are
        its now."""
        if env.is_main:
            take_the_console()
            self.metrics.open()

    def close(self) -> None:
        self.metrics.close()

    def log_if_due(self, totals: Totals, env: DistEnv, sync: Sync, bar: tqdm) -> None:
        """At a step's end: the window's global mean loss when a log is due (``train.log_every_steps``, the last
        step), once per step (after a heal, the step the loss cut short may have logged already); on the bar too."""
        pos = self.state.pos
        due = pos.step % self.job.train.log_every_steps == 0 or pos.step == self.state.span.total_steps
        if not due or totals.logged_step >= pos.step:
            return
        totals.final_loss = self._log_window(totals, env, sync)
        totals.logged_step = pos.step
        totals.restart(pos.step)
        bar.set_postfix(epoch=pos.epoch, loss=f"{totals.final_loss:.4f}")

    def _log_window(self, totals: Totals, env: DistEnv, sync: Sync) -> float:
        """Global mean loss over the window's steps (one small allreduce every log_every steps), and its time per
        step (``Totals``: a resumed window's counts its steps before the checkpoint too)."""
        window, pos, grad_norm = totals.window, self.state.pos, self.state.stepper.grad_norm
        window[2] = totals.exposed_s
        self.peers.all_reduce(window)
        steps = max(1, pos.step - totals.window_from)
        loss = window[0].item() / max(1.0, window[1].item())
        step_s = totals.elapsed_s() / steps
        record = {
            "kind": "train",
            "step": pos.step,
            "epoch": pos.epoch,
            "loss": loss,
            "lr": self.state.scheduler.get_last_lr()[0],
            "samples_per_s": self.state.span.global_batch / step_s,
            "step_s": step_s,
        }
        if grad_norm is not None:  # optim.clip_grad_norm: the last step's norm before clipping
            record["grad_norm"] = grad_norm
        if sync.exposed_s() is not None:  # mean over ranks and steps of the wait after backward
            record["comm_exposed_s"] = window[2].item() / env.world_size / steps
        self.metrics.write(record)
        return loss

    def batch(self, raw: Any) -> Batch:
        """A training batch on the rank's device, split (``batch.py``); the first also tries ``train.metrics`` on
        the model's outputs: a metric that does not fit fails at step 1, not after the first epoch. That forward runs
        in eval mode under a forked RNG: no batch-norm statistic, no dropout draw, the training stream untouched."""
        state = self.state
        batch = split(to_device(as_tree(raw), state.device), self.job.train.labels_key)
        if not self._metrics_checked and self.scores.names:
            model, cuda = state.model, [state.device] if state.device.type == "cuda" else []
            was_training = model.training
            with torch.random.fork_rng(devices=cuda), torch.no_grad(), state.stepper.autocast():
                model.eval()
                try:
                    self.scores.check(state.stepper.task.outputs(model, batch), batch, state.device)
                finally:
                    model.train(was_training)
        self._metrics_checked = True
        return batch

    def trace_window(self, trained_steps: int, env: DistEnv, end: bool = False) -> None:
        """comm.trace: record steps 2 .. 1 + trace_steps of this run (the first warms up), then every rank hands
        its events to rank 0, which writes trace.json. Collective at the window's end (same step everywhere)."""
        if self._tracer is None:
            return
        if trained_steps == 1 and not end:
            self._tracing.enter_context(self._tracer.activate())
            return
        if trace.active() is not None and (end or trained_steps == 1 + self.job.comm.trace_steps):
            self._tracing.close()
            events = self.peers.all_gather_object(self._tracer.trace_events())
            if env.is_main:
                written = write_trace(self.run_dir.trace, events)
                log.info("comm.trace: %s (open in https://ui.perfetto.dev)", written)
            self._tracer = None

    def saved(self, step: int, blocked_s: float, in_background: bool) -> None:
        """A checkpoint: what it cost the loop (``train.checkpoint_async``: the staging copy; else the whole write)."""
        self.metrics.write({"kind": "checkpoint", "step": step, "blocked_ms": blocked_s * 1000, "async": in_background})

    def evaluate(self, epoch: int, world: World) -> Optional[dict[str, Optional[float]]]:
        """The held-out split's loss, accuracy (cross-entropy) and ``train.metrics``, by name (None without a test
        split); logged and written to the metrics as ``test_<name>``."""
        if world.test_loader is None:
            return None
        sync, state, step = world.sync, self.state, self.state.pos.step
        sync.flush()
        sync.module.eval()
        with state.stepper.autocast():
            task, lockstep = state.stepper.task, sync.plan.sharded
            found = evaluate(state.model, world.test_loader, state.device, task, self.scores, self.peers, lockstep)
        self.metrics.write({"kind": "eval", "step": step, "epoch": epoch, **{f"test_{k}": v for k, v in found.items()}})
        shown = ", ".join(f"test {name} {_shown(value)}" for name, value in found.items() if name != "loss")
        log.info("epoch %d step %d: %stest loss %.4f", epoch, step, f"{shown}, " if shown else "", found["loss"])
        return found

    def summary(
        self,
        env: DistEnv,
        backend: str,
        sync: Sync,
        totals: Totals,
        wall: float,
        hosts: list[str],
        resumed: Optional[str],
    ) -> RunSummary:
        """The run's summary; rank 0 writes ``summary.json``."""
        job, pos, span = self.job, self.state.pos, self.state.span
        summary = RunSummary(
            world_size=env.world_size,
            nodes=env.num_nodes,
            procs_per_node=env.local_world_size,
            backend=backend,
            device=str(self.state.device.type),
            reducer=job.comm.reducer,
            hierarchical=sync.plan.hierarchical,
            hierarchical_reason=sync.plan.strategy.reason,
            model=job.model["_target_"],
            data=job.data.label,
            epochs=pos.epoch,
            steps=pos.step,
            global_batch=span.global_batch,
            final_loss=totals.final_loss,
            test_accuracy=(totals.evaluated or {}).get("accuracy"),
            test_loss=(totals.evaluated or {}).get("loss"),
            test_metrics={k: v for k, v in (totals.evaluated or {}).items() if k != "loss"},
            samples_per_s=totals.trained_steps * span.global_batch / wall if wall > 0 else None,
            wall_s=wall,
            resumed_from=resumed,
            hosts=hosts,
            membership=membership.changes(self.run_dir),
            stragglers=self.watch.stragglers(),
            precision=job.train.precision,
            accumulate_steps=job.train.accumulate_steps,
            clip_grad_norm=job.optim.clip_grad_norm,
            loss=job.train.loss,
            skipped_steps=int(self.state.stepper.skipped),
            steps_per_epoch=span.steps_per_epoch,
            compression=sync.compression.describe() if sync.plan.compresses else "none",
        )
        if env.is_main:
            summary.write(self.run_dir)
        return summary


def _shown(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.4f}"
