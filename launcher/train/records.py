"""The trainer's records concern: the logged window of steps (``metrics.jsonl``), the communication trace
(``comm.trace``), the evaluation on the held-out split, and ``summary.json`` at the end. Mixed into the Trainer,
whose attributes it reads."""

from __future__ import annotations

import logging
import time
from typing import Optional

import torch
from tqdm import tqdm

from .. import membership
from ..comm import trace
from ..comm.trace import write_trace
from ..summary import RunSummary
from ..watch import stragglers
from .model import evaluate

log = logging.getLogger(__name__)


class Records:
    def _log_if_due(self, bar: tqdm, epoch: int) -> None:
        loop = self.loop
        due = self.pos.step % self.job.train.log_every_steps == 0 or self.pos.step == self.total_steps
        if due and loop.logged_step < self.pos.step:
            loop.final_loss = self._log_window(loop.window, loop.window_t0)
            loop.logged_step = self.pos.step
            bar.set_postfix(epoch=epoch, loss=f"{loop.final_loss:.4f}")
            loop.window.zero_()
            loop.window_t0 = time.perf_counter()

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
            events = self.peers.all_gather_object(self._tracer.trace_events())
            if self.env.is_main:
                log.info(
                    "comm.trace: %s (open in https://ui.perfetto.dev)", write_trace(self.run_dir / "trace.json", events)
                )
            self._tracer = None

    def _log_window(self, window: torch.Tensor, t0: float) -> float:
        """Global mean loss over the steps since the last log (one small allreduce every log_every steps)."""
        window[2] = self._exposed_s
        self._exposed_s = 0.0
        self.peers.all_reduce(window)
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
        if self.stepper.grad_norm is not None:  # optim.clip_grad_norm: the last step's norm before clipping
            record["grad_norm"] = self.stepper.grad_norm
        if self.sync.exposed_s() is not None:  # mean over ranks and steps of the wait after backward
            record["comm_exposed_s"] = window[2].item() / self.env.world_size / max(1.0, batches)
        self.metrics.write(record)
        return loss

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
            precision=job.train.precision,
            accumulate_steps=job.train.accumulate_steps,
            clip_grad_norm=job.optim.clip_grad_norm,
            loss=job.train.loss,
            skipped_steps=int(self.stepper.skipped),
            steps_per_epoch=self.steps_per_epoch,
        )
        if env.is_main:
            summary.write(self.run_dir)
        return summary

    def _evaluate(self, epoch: int) -> Optional[float]:
        """Accuracy on the held-out split (None without one); logged and written to the metrics."""
        if self.test_loader is None:
            return None
        self._phase = f"the evaluation after epoch {epoch}"
        self.sync.flush()
        self.sync.module.eval()
        with self.stepper.autocast():
            loss, accuracy = evaluate(self.model, self.test_loader, self.device, self.stepper.task, self.peers)
        self.metrics.write(
            {"kind": "eval", "step": self.pos.step, "epoch": epoch, "test_loss": loss, "test_accuracy": accuracy}
        )
        shown = "n/a (train.loss gives no accuracy: train.metric)" if accuracy is None else f"{accuracy:.4f}"
        log.info("epoch %d step %d: test accuracy %s, test loss %.4f", epoch, self.pos.step, shown, loss)
        return accuracy
