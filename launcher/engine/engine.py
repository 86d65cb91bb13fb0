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
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from launcher.base.devices import rank_device
from launcher.base.env import DistEnv
from launcher.base.gpus import backend_for
from launcher.base.sync_modes import Backend
from launcher.comm.sync import Sync
from launcher.config import collective_timeout_s
from launcher.engine.checks import Autocast, broadcast_weights, check_same_world, check_setup, closer
from launcher.engine.loader import EngineLoader
from launcher.engine.settings import engine_job, handed
from launcher.engine.state import EngineSharded, Plain, engine_state, rebuilt, routed
from launcher.engine.steps import Steps
from launcher.engine.stopping import StopSignals
from launcher.group.helpers import Peers
from launcher.group.rendezvous import process_group
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
        if dist.is_initialized():  # the script opened it: its backend says where the rank computes
            check_same_world(self.env)
            use_gpu = dist.get_backend() == "nccl"
        else:
            use_gpu = bool(job.cluster.gpus_per_node) if job is not None else torch.cuda.is_available()
            asked = self.job.comm.backend
            backend = backend_for(use_gpu) if asked is Backend.auto else asked.value
            use_gpu = backend == "nccl"
            timeout_s = collective_timeout_s(self.job.comm)
            self._stack.enter_context(process_group(self.env, backend, timeout_s, secret=secret))
        self.device = rank_device(self.env.local_rank, use_gpu)
        self.peers = Peers(secret=secret)  # (the launcher's job: object collectives signed with its secret)
        self.pos, self.totals = Position(), Totals.on(self.device)
        self.state: Any = None
        self.sync: Optional[Sync] = None
        self.checkpointer: Optional[Checkpointer] = None
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self._loader: Optional[EngineLoader] = None
        self._plain: Optional[Plain] = None
        self._divide = 1  # micro-batches: each one's loss divided by their number
        self._stops = StopSignals()
        self._closed = False
        precision = self.job.train.precision
        self.scaler = torch.amp.GradScaler(self.device.type) if precision == "fp16" else None
        self._atexit = closer(self)
        atexit.register(self._atexit)

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
        model.to(self.device)
        names = {id(p): name for name, p in model.named_parameters()}
        if self.job.comm.reducer.sharded:  # (torch DDP and our reducer broadcast rank 0's weights themselves)
            broadcast_weights(model, self.peers)  # FSDP2 does not: rank 0's, before each rank keeps its shards
            EngineSharded.prepare(self.job, self.env, self.device, model)  # (collective) in place
            optimizer = rebuilt(optimizer, names, model)
        self.state = engine_state(self.job, model, optimizer, self.device, self.scaler)
        self.state.pos = self.pos
        if self._loader is not None:
            self.state.shape(self._loader.per_rank * self.world_size, len(self._loader))
        self.checkpointer = Checkpointer(self.job, self.env, self.device, self.peers, joins=False)  # (the resume's)
        kept = self.checkpointer.kept(self.world_size)
        self.sync = build_sync(
            model,
            self.env,
            self.device,
            self.job.comm,
            optimizer,
            resumed_hierarchical=kept.get("hierarchical"),
            resumed_cap_mb=kept.get("bucket_cap_mb"),
            resumed_compression=kept.get("compression"),
            whole_gradient=WHY_WHOLE,
            peers=self.peers,
        )
        module = self.sync.module
        dtype = AUTOCAST_DTYPES[self.job.train.precision]
        if dtype is not None:
            module = Autocast(module, self.device, dtype)
        self._plain, self.optimizer = Plain(optimizer), routed(optimizer, self)
        if self.is_main:
            print(f"launcher.Engine: {self.sync.description}", flush=True)
        return module, self.optimizer

    def loader(self, dataset: Dataset, batch_size: int, shuffle: bool = True, num_workers: int = 0) -> EngineLoader:
        """The training loader: ``batch_size`` is the GLOBAL batch, split evenly over the ranks; each sample at most
        once per epoch, no padding; the same global batches on any number of ranks (``engine/loader.py``);
        resumable mid-epoch (it follows ``resume``)."""
        if self._loader is not None:
            raise ValueError(
                "engine.loader() was called already: an Engine follows one training loader's position; HINT: an "
                "evaluation loader is torch's own DataLoader (e.g. over a Subset of this rank's indices)"
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
        if self.state is not None:
            self.state.shape(batch_size, len(self._loader))
        return self._loader

    # ---------------------------------------------------------------- checkpoints
    def save(self, extra: Optional[dict[str, Any]] = None) -> None:
        """Collective (every rank calls it at the same step): the model, optimizer, loader position, fp16 scaler,
        each rank's RNG stream and ``extra`` (kept for the cadence's saves too) into the run dir's checkpoints/,
        replicated or sharded (DCP), in the background under ``train.checkpoint_async``."""
        self._require("engine.save()")
        assert self.sync is not None and self.checkpointer is not None
        if extra is not None:
            self.state.extra = dict(extra)
        self.sync.flush()
        self.checkpointer.save(self.state, self.sync, self.env, self.pos.step, self.totals.partial())

    def resume(self) -> dict[str, Any]:
        """Collective: the newest checkpoint in the run dir (``train.resume``: auto; a path; never) into the model,
        optimizer, loader position and RNG streams, on this or another layout of ranks; returns its ``extra`` ({}:
        nothing to resume)."""
        self._require("engine.resume()")
        assert self.checkpointer is not None
        path = self.checkpointer.resume(self.state, self.env, self.job.train.seed, self.totals)
        if self._loader is not None:
            self._loader.settle()
        return dict(self.state.extra) if path is not None else {}

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
            self._stops.settle()
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

    # ---------------------------------------------------------------- checks
    def _require(self, what: str) -> None:
        if self.sync is None:
            raise ValueError(f"{what} before engine.setup(model, optimizer); HINT: setup first")
