"""The trainer's checkpoint concern: what a checkpoint holds (model, optimizer, scheduler, position, every rank's RNG
state, the gradient sync's measured choices, the config), writing it (collective; rank 0 writes atomically, a full
disk named with the previous checkpoint kept), and applying one on resume (bit-identical continuation)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf

from ..checkpoint_names import checkpoint_path, list_checkpoints
from ..devices import rng_state, seed_all, set_rng_state
from . import checkpoint as ckpt

log = logging.getLogger(__name__)


@dataclass
class Position:
    step: int = 0  # optimiser steps done
    epoch: int = 0  # current epoch
    batch_in_epoch: int = 0  # batches of the current epoch already done


class Checkpointing:
    """Mixed into the Trainer, whose attributes it reads: job, env, model, optimizer, scheduler, pos, sync,
    stepper, ckpt_dir, _resume_path/_resume_state (chosen at start by ``checkpoint.agreed_resume_source``)."""

    def state(self) -> dict[str, Any]:
        return {
            "model": ckpt.unwrap(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "stepper": self.stepper.state_dict(),  # the fp16 gradient scaler
            "step": self.pos.step,
            "epoch": self.pos.epoch,
            "batch_in_epoch": self.pos.batch_in_epoch,
            "world_size": self.env.world_size,
            "global_batch": self.global_batch,  # the job's shape, for a machine joining in place
            "steps_per_epoch": self.steps_per_epoch,
            "schedule_steps": self.schedule_steps,  # the LR schedule's span: a resume with another one says so
            "hierarchical": self.sync.hierarchical,
            "bucket_cap_mb": self.sync.bucket_cap_mb,
            "config": OmegaConf.to_container(OmegaConf.structured(self.job)),
        }

    def save(self) -> None:
        """Collective (every rank hands rank 0 its RNG state); rank 0 writes atomically and prunes."""
        self._phase = f"the checkpoint at step {self.pos.step}"
        self.sync.flush()  # the checkpoint holds the fully updated state (forward overlap)
        rngs = self.peers.all_gather_object(rng_state())
        if self.env.is_main:
            path = checkpoint_path(self.ckpt_dir, self.pos.step)
            try:
                ckpt.save_atomic(dict(self.state(), rng=rngs), path)
            except OSError as exc:  # disk full, quota, read-only: say so; the previous checkpoint stays valid
                earlier = [p for p in list_checkpoints(self.ckpt_dir) if p != path]
                kept = (
                    f"the previous checkpoint {earlier[-1]} is intact" if earlier else "there is no earlier checkpoint"
                )
                raise RuntimeError(
                    f"rank 0 on {self.env.hostname}: cannot write checkpoint {path} at step {self.pos.step} "
                    f"({exc.strerror or exc}); {kept}; HINT: free space in {self.ckpt_dir} (train.keep_checkpoints "
                    "keeps fewer), then run again with the same run dir to resume"
                ) from exc
            ckpt.prune(self.ckpt_dir, self.job.train.keep_checkpoints)
            log.info("checkpoint %s", path)

    def apply_state(self, state: dict[str, Any]) -> None:
        """Model, optimizer, schedule, scaler and position from ``state`` (a checkpoint's, or a live peer's)."""
        ckpt.load_model_state(self.model, state)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.stepper.load_state_dict(state.get("stepper") or {})
        self.pos = Position(state["step"], state["epoch"], state["batch_in_epoch"])

    def maybe_resume(self) -> None:
        path, state = self._resume_path, self._resume_state
        if path is None or state is None:
            return
        self._resume_state = None  # free it once applied
        self.apply_state(state)
        rngs = state.get("rng") or []
        saved_world = state.get("world_size", len(rngs))
        if saved_world == self.env.world_size and len(rngs) == saved_world:
            set_rng_state(rngs[self.env.rank])
        else:  # another world size: every rank's stream restarts from (seed, rank, step), the saved ones are dropped
            seed_all(self.job.train.seed + self.env.rank + 1_000_003 * self.pos.step)
        self.resumed_from = str(path)
        if saved_world != self.env.world_size:
            log.info(
                "resuming a %d-rank checkpoint on %d ranks: global batch %d as before, the same samples from step %d",
                saved_world,
                self.env.world_size,
                self.global_batch,
                self.pos.step,
            )
        log.info("resumed from %s at step %d (epoch %d, batch %d)", path, *vars(self.pos).values())
        was = state.get("schedule_steps")
        if was is not None and was != self.schedule_steps:
            log.warning(
                "the LR schedule spans %d steps now, %d in the run that wrote %s (the LR follows the new span from "
                "step %d); optim.schedule_steps=N on every run keeps one schedule",
                self.schedule_steps,
                was,
                path,
                self.pos.step,
            )
