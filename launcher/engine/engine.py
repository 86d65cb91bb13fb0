"""``launcher.Engine``: the built-in trainer's engine for a user's own training loop (docs/your-loop.md).

    engine = launcher.Engine(compress="powersgd")                    # the job's comm.* / train.*, then these
    model, optimizer = engine.setup(model, optimizer)               # the sync the plan chooses, as the trainer's
    loader = engine.loader(dataset, batch_size=256, shuffle=True)   # a GLOBAL batch split over the ranks
    extra = engine.resume()                                         # {} on a fresh start
    for epoch in range(engine.epoch, epochs):
        for x, y in loader:
            with engine.step():                                     # one optimizer step
                engine.backward(F.cross_entropy(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
        engine.save({"epoch_done": epoch})

What ``setup`` gives is exactly what the trainer builds from the same settings (``train/sync.py``'s ``build_sync``:
torch DDP with the node-first hook, our bucketed reducer, or FSDP2 inside a node with our cross-node stage, each
with compression across nodes), the model's forward under ``train.precision``'s autocast, and an optimizer whose
``step`` and ``zero_grad`` go through the engine (the fp16 gradient scaler, ``optim.clip_grad_norm``, the sync's
``zero_grad``). Checkpoints are the trainer's (``engine/state.py``). The engine opens the process group when the
script did not (and closes it: ``close``, or the end of a ``with`` block, or the process's exit)."""

from __future__ import annotations

import atexit
import contextlib
import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from launcher.base.devices import rank_device
from launcher.base.env import DistEnv
from launcher.base.faults import faults_for
from launcher.base.gpus import backend_for
from launcher.base.sync_modes import Backend
from launcher.comm.sync import Sync
from launcher.config import collective_timeout_s
from launcher.engine.checks import broadcast_weights, check_heals, check_same_world, check_setup, closer
from launcher.engine.loader import EngineLoader
from launcher.engine.model import EngineModel, skeleton
from launcher.engine.settings import engine_job, handed
from launcher.engine.state import EngineSharded, Plain, engine_state, rebuilt, routed
from launcher.engine.steps import Steps, StepState
from launcher.engine.stopping import StopSignals
from launcher.group.helpers import Peers
from launcher.group.rendezvous import Group, attach, process_group
from launcher.heal.rank_side import Healer
from launcher.train.in_place import healing_for
from launcher.train.progress import Position, Totals
from launcher.train.saving import Checkpointer
from launcher.train.step import AUTOCAST_DTYPES
from launcher.train.sync import build_sync

WHY_WHOLE = "your loop steps the optimizer itself (launcher.Engine)"  # the bucketed reducer holds no optimizer


class Engine(Steps):
    def __init__(self, **overrides: Any) -> None:
        """The job's ``comm.*``, ``train.*`` and ``optim.clip_grad_norm`` (the launcher's job, or the defaults under
        plain torchrun), then ``overrides`` (``compress="bf16"``, ``reducer="fsdp"``, ``precision="bf16"``,
        ``run_dir="runs/mine"``, ...). Opens the default process group when it is not open (torchrun's variables)."""
        job, secret, self.watch = handed()
        self.job = engine_job(overrides, job)
        self.env = DistEnv.resolve()
        self._stack = contextlib.ExitStack()
        timeout_s = collective_timeout_s(self.job.comm)
        if dist.is_initialized():  # the script opened it: its backend says where the rank computes
            check_same_world(self.env)
            backend = str(dist.get_backend())
        else:
            use_gpu = bool(job.cluster.gpus_per_node) if job is not None else torch.cuda.is_available()
            asked = self.job.comm.backend
            backend = str(backend_for(use_gpu) if asked is Backend.auto else asked.value)
        healer = Healer.from_environ(self.job.cluster.lost_after_s, backend, secret) if job is not None else None
        self._seam = healing_for(healer, self.watch, lambda: False)  # (a job that heals in place: sim, ssh)
        self._group = self._open(backend, timeout_s, secret, joins=self._seam.joins)
        self.device = rank_device(self.env.local_rank, backend == "nccl")
        self.peers = Peers(self._seam.abort, secret)  # (the launcher's job: object collectives signed with its secret)
        self.pos, self.totals = Position(), Totals.on(self.device)
        self.state: Any = None
        self.sync: Optional[Sync] = None
        self.checkpointer: Optional[Checkpointer] = None
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self._model: Optional[EngineModel] = None
        self._loader: Optional[EngineLoader] = None
        self._plain: Optional[Plain] = None
        self._divide = 1  # micro-batches: each one's loss divided by their number
        self._stops = StopSignals()
        self._faults = faults_for(self.env)  # LAUNCHER_FAULT (the failure tests')
        self._step_state = StepState()
        self._saves_at, self._skip, self._joined, self._out = (0, 0), (-1, 0), False, False
        self._seen: Optional[tuple[int, ...]] = None
        self._closed = False
        precision = self.job.train.precision
        self.scaler = torch.amp.GradScaler(self.device.type) if precision == "fp16" else None
        self._atexit = closer(self)
        atexit.register(self._atexit)

    def _open(self, backend: str, timeout_s: float, secret: Any, joins: bool) -> Optional[Group]:
        """The process group (opened here unless the script did; a joining rank reaches the store only) and, in a
        job that heals, its store (the keeper's decisions are watched there)."""
        heals, join_s = self._seam.abort is not None, self.job.cluster.join_timeout_s
        if dist.is_initialized():
            return attach(self.env, timeout_s, join_s, secret) if heals else None
        opened = process_group(self.env, backend, timeout_s, join_timeout_s=join_s, form=not joins, secret=secret)
        return self._stack.enter_context(opened)

    # ---------------------------------------------------------------- where this rank is
    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        return self.env.is_main

    @property
    def global_step(self) -> int:
        """Optimizer steps done (``Engine.step()`` blocks completed), resumed ones included."""
        return self.pos.step

    @property
    def epoch(self) -> int:
        """The epoch the loader is in (after ``resume``: the one to go on with)."""
        return self.pos.epoch

    # ---------------------------------------------------------------- the pieces
    def setup(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Collective: ``model`` on this rank's device with rank 0's weights (each sync broadcasts them), sharded
        first under ``reducer=fsdp`` (the optimizer built again over the shards, with its class, groups and settings),
        inside the sync the plan chooses; returns what the loop runs and steps (an LR scheduler is made over the
        optimizer returned)."""
        if self.sync is not None:
            raise ValueError("engine.setup() was called already; HINT: one Engine per model: setup once, then train")
        check_setup(model, optimizer)
        if self._seam.abort is not None:
            check_heals(self.job)
        model.to(self.device)
        names = {id(p): name for name, p in model.named_parameters()}
        joins, sharded = self._seam.joins, self.job.comm.reducer.sharded
        empty = skeleton(model) if sharded and self._seam.abort is not None else None  # (to shard anew on a heal)
        if sharded and not joins:  # (torch DDP and our reducer broadcast rank 0's weights themselves)
            broadcast_weights(model, self.peers)  # FSDP2 does not: rank 0's, before each rank keeps its shards
            EngineSharded.prepare(self.job, self.env, self.device, model)  # (collective) in place
            optimizer = rebuilt(optimizer, names, model)
        self.state = engine_state(self.job, model, optimizer, self.device, self.scaler)
        self.state.pos, self.state.skeleton = self.pos, empty
        if self._loader is not None:
            self.state.shape(self._loader.global_batch, len(self._loader))
        self.checkpointer = Checkpointer(self.job, self.env, self.device, self.peers, joins)  # (the resume's)
        self._plain, self.optimizer = Plain(optimizer), routed(optimizer, self)
        if joins:  # a machine that answers again: its ranks wait here to be let in, then take a live peer's state
            decision = self._seam.start(self._group)
            assert decision is not None, "a joining rank is let in by the keeper's decision"
            self._heal(decision, joining=True)
        else:
            self._build_sync(self.checkpointer.kept(self.world_size), healed=False)
            self._seam.start(self._group)  # (a job that heals: the keeper's decisions watched from here on)
        assert self._model is not None
        return self._model, self.optimizer

    def _build_sync(self, kept: dict[str, Any], healed: bool) -> None:
        """(Collective) the sync the plan chooses around the model (again after a heal: other ranks, other links),
        and the model the loop runs over it."""
        assert self._plain is not None
        self.sync = build_sync(
            self.state.model,
            self.env,
            self.device,
            self.job.comm,
            self._plain.optimizer,
            resumed_hierarchical=kept.get("hierarchical"),
            resumed_cap_mb=kept.get("bucket_cap_mb"),
            resumed_compression=kept.get("compression"),
            healed=healed,
            whole_gradient=WHY_WHOLE,
            peers=self.peers,
        )
        if self._model is None:
            dtype = AUTOCAST_DTYPES[self.job.train.precision]
            self._model = EngineModel(self.state.model, self.sync.module, self.device, dtype)
        else:
            self._model.swap(self.state.model, self.sync.module)
        if self.is_main:
            print(f"launcher.Engine: {self.sync.description}", flush=True)

    def loader(self, dataset: Dataset, batch_size: int, shuffle: bool = True, num_workers: int = 0) -> EngineLoader:
        """The training loader: ``batch_size`` is the GLOBAL batch, split evenly over the ranks; each sample at most
        once per epoch, no padding; the same global batches on any number of ranks (``engine/loader.py``);
        resumable mid-epoch (it follows ``resume``)."""
        if self._loader is not None:
            raise ValueError(
                "engine.loader() was called already: an Engine follows one training loader's position; HINT: an "
                "evaluation loader is torch's own DataLoader (e.g. over a Subset of this rank's indices)"
            )
        for world in self._worlds():  # (each one the job may heal onto: every global batch split evenly there too)
            if batch_size % world:
                raise ValueError(
                    f"engine.loader(batch_size={batch_size}): the GLOBAL batch must split evenly over {world} ranks "
                    f"too, which the job goes on with once it loses machines (cluster.min_nodes="
                    f"{self.job.cluster.min_nodes}); HINT: a multiple of {math.lcm(*self._worlds())}"
                )
        self._loader = EngineLoader(
            dataset,
            batch_size,
            self.world_size,
            self.rank,
            self.job.train.seed,
            self.pos,
            self.device,
            shuffle,
            num_workers,
        )
        if not self._joined:
            self._loader.settle()
        if self.state is not None:
            self.state.shape(batch_size, len(self._loader))
        return self._loader

    # ---------------------------------------------------------------- checkpoints
    def save(self, extra: Optional[dict[str, Any]] = None) -> None:
        """Collective (every rank calls it at the same step): the model, optimizer, loader position, fp16 scaler,
        each rank's RNG stream and ``extra`` (kept for the cadence's saves too) into the run dir's checkpoints/,
        replicated or sharded (DCP), in the background under ``train.checkpoint_async``."""
        self._require("engine.save()")
        if extra is not None:
            self.state.extra = dict(extra)
        self._save_once(self._save)

    def _save(self) -> None:
        assert self.sync is not None and self.checkpointer is not None
        self.sync.flush()
        self.checkpointer.save(self.state, self.sync, self.env, self.pos.step, self.totals.partial())

    def resume(self) -> dict[str, Any]:
        """Collective: the newest checkpoint in the run dir (``train.resume``: auto; a path; never) into the model,
        optimizer, loader position and RNG streams, on this or another layout of ranks; returns its ``extra`` ({}:
        nothing to resume)."""
        self._require("engine.resume()")
        assert self.checkpointer is not None
        if self._joined:  # a machine that joined a running job: its state came from a live peer, nothing is read
            return dict(self.state.extra)
        path = self.checkpointer.resume(self.state, self.env, self.job.train.seed, self.totals)
        self._seen = None  # (loaded: the parameters' versions moved)
        if self._loader is not None:
            self._loader.settle()
        return dict(self.state.extra) if path is not None else {}

    def register(self, **objects: Any) -> None:
        """The loop's own objects with ``state_dict``/``load_state_dict`` (an LR scheduler, an EMA model, a metric):
        saved with every checkpoint, restored by ``resume``, and sent with the state to the ranks behind when the
        job heals in place (what arrived before one was registered is loaded when it is)."""
        self._require("engine.register()")
        self.state.register(objects)

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective under ``reducer=fsdp``: the whole model's weights on the CPU, without any wrapper's prefix
        (what ``python -m launcher export`` writes): on every rank, but under ``reducer=fsdp`` on rank 0 only (DCP
        gathers the shards there; the others get an empty dict)."""
        self._require("engine.model_state_dict()")
        return self.state.whole_model()

    @property
    def checkpoints(self) -> Any:
        """The run dir's checkpoints/ (the trainer's layout)."""
        return self.job.run.checkpoints

    # ---------------------------------------------------------------- the end
    def close(self) -> None:
        """The checkpoint being written finished, the sync's parts off the model, the process group closed where
        the engine opened it. Once; also at the end of a ``with`` block and at the process's exit."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._atexit)
        self._stops.uninstall()
        try:
            self._seam.close(trained=not self._out)  # (a job that heals: the keeper's watch ends; a machine
            self._stops.settle()  # waiting to join need not, once the loop ended)
            if self.checkpointer is not None:
                self.checkpointer.wait("the engine's end")
                self.checkpointer.close()
        finally:
            if self.sync is not None:
                self.sync.close()
            self._stack.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
