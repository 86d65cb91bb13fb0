"""The trainer's checkpoints: which one a run resumes from (rank 0's choice, agreed at start), writing one
(collective: every rank hands rank 0 its RNG state and its part of the log's window; rank 0 writes atomically and
prunes; a full disk named with the previous checkpoint kept), and the resume's own steps (every rank's RNG stream and
log window, what it says). What a checkpoint holds, and how it is written and read, is the training state's kind
(``train/state.py``): one file of the ``TrainState``'s ``state_dict`` with every rank's own parts (``rng``,
``log_window``: ``progress.Totals``, the resumed run logs what the uninterrupted one logs; ``compression``), or a
sharded job's directory every rank writes its shards and its own parts into (``launcher.train.sharded``). The
Checkpointer holds what both share: the directory and its retention, the background writer, the write's failure
said with the fix. Either kind resumes in a job of either kind and on another layout of ranks
(``state.resume_from``); what belonged to the old layout (RNG streams, the loss window, the sync's choices,
compression state) starts anew there, said once."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch

from launcher.base.checkpoint_names import is_sharded, list_checkpoints
from launcher.base.devices import seed_all, set_rng_state
from launcher.base.env import DistEnv
from launcher.base.faults import faults_for
from launcher.comm.sync import Sync
from launcher.config import JobConfig
from launcher.group.helpers import Peers
from launcher.report.attempts import mark_start
from launcher.train import checkpoint as ckpt
from launcher.train.background import Background
from launcher.train.progress import Span, Totals
from launcher.train.state import TrainState, resume_from

log = logging.getLogger(__name__)


class Checkpointer:
    def __init__(self, job: JobConfig, env: DistEnv, device: torch.device, peers: Peers, joins: bool) -> None:
        """Collective unless ``joins`` (a rank joining a running job takes the state from a live peer)."""
        self.run, self.dir = job.run, job.run.checkpoints
        self.keep = job.train.keep_checkpoints
        self.peers, self.joins = peers, joins
        self.faults = faults_for(env)  # LAUNCHER_FAULT's write=S: a checkpoint slower to complete (the tests')
        self.background = Background() if job.train.checkpoint_async else None  # (train/background.py)
        self.resume_path: Optional[Path] = None
        self._resume_state: Optional[dict[str, Any]] = None
        self._changed: Optional[str] = None  # how the resumed checkpoint's kind or comm.shard is not this job's
        if not joins:
            if env.is_main:  # what a sharded write cut short left (before the agreement: no rank writes yet)
                ckpt.clear_leftovers(self.dir)
            self.resume_path, self._resume_state = ckpt.agreed_resume_source(job.train.resume, self.dir, device, peers)
        if self.resume_path is not None and self._resume_state is not None:
            self._resume_state = resumable(self.resume_path, self._resume_state, env, device)
            self._changed = layout_change(self.resume_path, self._resume_state, job)
        self.start_step = int((self._resume_state or {}).get("step", 0))  # the run starts from (0: fresh, joining)

    def kept(self, world_size: int) -> dict[str, Any]:
        """The resumed checkpoint's measured choices a run keeps (strategy, bucket cap) and each rank's compression
        state: not on another world size, where the layout of ranks and links changed, nor from a checkpoint of
        the other kind or ``comm.shard`` (other buckets, other shards: another rank's error feedback is not this
        one's). There a compression state the checkpoint had is handed on as none of any rank's: the sync starts
        it anew and says so once."""
        state = self._resume_state or {}
        if state.get("world_size", world_size) == world_size and self._changed is None:
            return state
        return {"compression": [None]} if state.get("compression") or state.get("compressed") else {}

    def resume(self, state: TrainState, env: DistEnv, seed: int, totals: Totals) -> Optional[str]:
        """Apply the checkpoint chosen at start to ``state`` (once), with every rank's RNG stream, and start the
        loop's log window (``totals``: the checkpoint's on the same world size); returns its path (None: a fresh
        start)."""
        saved, self._resume_state = self._resume_state, None
        if saved is None:
            if not self.joins:  # (a joining rank's window is the others', once it is in)
                totals.start(0)
            return None
        path = self.resume_path
        assert path is not None
        resume_from(state, path, saved)
        self._resumed(saved, env, seed, state.span)
        windows = saved.get("log_window") or []
        same_world = saved.get("world_size") == env.world_size and len(windows) == env.world_size
        totals.start(state.pos.step, windows[env.rank] if same_world else None)
        return str(self.resume_path)

    def save(self, state: TrainState, sync: Sync, env: DistEnv, step: int, window: dict[str, Any]) -> None:
        """Collective: this step's checkpoint, as the state's kind writes it (``TrainState.save``)."""
        state.save(self, sync, env, step, window)

    def write_file(self, whole: dict[str, Any], env: DistEnv, path: Path, step: int) -> None:
        """Rank 0: a one-file checkpoint ``whole`` to ``path`` atomically, then the retention; under
        ``train.checkpoint_async`` staged now and written in the background."""
        if self.background is None:
            self.commit(lambda: ckpt.save_atomic(whole, path), env, path, step)
            return
        self.background.wait("the next checkpoint")  # (its staged buffers are reused; its error is raised here)
        staged = self.background.stage(whole)
        self.background.start(step, lambda: self.commit(lambda: ckpt.save_atomic(staged, path), env, path, step))

    def wait(self, why: str) -> None:
        """The checkpoint being written (``train.checkpoint_async``), finished: a stop, the end of the run."""
        if self.background is not None:
            self.background.wait(why)

    def close(self) -> None:
        """The writer thread ends; a write that failed is logged, not raised over what ends the run."""
        if self.background is not None:
            try:
                self.background.wait("the end of this process")
            except Exception as exc:  # noqa: BLE001 - an error raised already, or the one to report below
                log.error("the last checkpoint was not written: %s", exc)
            self.background.close()

    def commit(self, write: Callable[[], object], env: DistEnv, path: Path, step: int) -> None:
        """``write`` the checkpoint at ``path`` (every rank that writes: the one that could not is named), then rank 0
        prunes to ``train.keep_checkpoints`` and says so."""
        self._hold(step)
        try:
            write()
        except OSError as exc:  # disk full, quota, read-only: say so; the previous checkpoint stays valid
            raise self.cannot_write(env, path, step, exc) from exc
        if env.is_main:
            ckpt.prune(self.dir, self.keep, step)  # (a later step's write may be under way on another rank)
            log.info("checkpoint %s", path)

    def _hold(self, step: int) -> None:
        if (fault := self.faults.get(step)) is not None:
            fault.hold_write()

    def cannot_write(self, env: DistEnv, path: Path, step: int, exc: OSError) -> RuntimeError:
        """Disk full, quota, read-only: said with the fix; the previous checkpoint stays valid."""
        earlier = [p for p in list_checkpoints(self.dir) if p != path]
        kept = f"the previous checkpoint {earlier[-1]} is intact" if earlier else "there is no earlier checkpoint"
        return RuntimeError(
            f"rank {env.rank} on {env.hostname}: cannot write checkpoint {path} at step {step} "
            f"({exc.strerror or exc}); {kept}; HINT: free space in {self.dir} (train.keep_checkpoints keeps fewer), "
            "then run again with the same run dir to resume"
        )

    def _resumed(self, state: dict[str, Any], env: DistEnv, seed: int, span: Span) -> None:
        """After ``state`` (this run's resume source) is applied: every rank's RNG stream (its own saved one on the
        same world size; on another, restarted from (seed, rank, step)), and what the resume says."""
        rngs = state.get("rng") or []
        step = state["step"]
        if env.is_main:  # this attempt's start, in summary.json's attempts
            mark_start(self.run, env, resumed_from_step=step)
        saved_world = state.get("world_size", len(rngs))
        if saved_world == env.world_size and len(rngs) == saved_world:
            set_rng_state(rngs[env.rank])
        else:
            seed_all(seed + env.rank + 1_000_003 * step)
        if saved_world != env.world_size:
            log.info(
                "resuming a %d-rank checkpoint on %d ranks: global batch %d as before, the same samples from step %d; "
                "the train loss's window restarts there (the first train record averages the steps from it)",
                saved_world,
                env.world_size,
                span.global_batch,
                step,
            )
        path = self.resume_path
        if self._changed is not None and env.is_main:
            log.info(
                "resuming %s on another layout (%s): each rank loads its part of the model and optimiser as this job "
                "holds them (launcher.train.reshard); the sync's choices are this job's own",
                path,
                self._changed,
            )
        log.info("resumed from %s at step %d (epoch %d, batch %d)", path, step, state["epoch"], state["batch_in_epoch"])
        was = state.get("schedule_steps")
        if was is not None and was != span.schedule_steps:
            log.warning(
                "the LR schedule spans %d steps now, %d in the run that wrote %s (the LR follows the new span from "
                "step %d); optim.schedule_steps=N on every run keeps one schedule",
                span.schedule_steps,
                was,
                path,
                step,
            )


def resumable(path: Path, state: dict[str, Any], env: DistEnv, device: torch.device) -> dict[str, Any]:
    """The chosen checkpoint's state as this rank resumes from it: a sharded one with this rank's own parts
    (``sharded.own_view``), whichever reducer this job runs (``reshard``: either kind loads into either)."""
    if not is_sharded(path):
        return state
    from launcher.train import sharded

    return sharded.own_view(path, state, env.rank, env.world_size, device)


def layout_change(path: Path, state: dict[str, Any], job: JobConfig) -> Optional[str]:
    """How the checkpoint's writer differs from this job in kind (sharded or replicated) or, both sharded, in
    ``comm.shard``; None where it does not (the sync's kept choices and compression state are then this job's)."""
    comm = (state.get("config") or {}).get("comm") or {}
    wrote = f"comm.reducer={comm.get('reducer', 'fsdp' if is_sharded(path) else '?')}"
    here = f"comm.reducer={job.comm.reducer.value}"
    if is_sharded(path) != job.comm.reducer.sharded:
        return f"{wrote} wrote it, this job is {here}"
    if is_sharded(path) and comm.get("shard") not in (None, job.comm.shard.value):
        return f"comm.shard={comm['shard']} wrote it, this job shards with comm.shard={job.comm.shard.value}"
    return None
