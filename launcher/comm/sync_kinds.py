"""The three kinds of ``Sync`` (``comm/sync.py``), one class each, and ``sync_for_plan``, which builds the one the plan
names. Each does only what its engine does differently from ``BaseSync``:

- ``DdpSync``: torch DDP over the model with the plan's cap; our comm hook where the plan is node-first, compresses,
  or a heal must be able to leave a bucket's wait (the abortable hook);
- ``BucketedSync``: our reducer, which keeps ``.grad`` as views into its buckets (its own ``zero_grad``), may hold
  the optimizer (its own ``step``, updates at the next forward: ``flush``) and times its exposed wait;
- ``ShardedSync``: FSDP2's model (sharded before the optimizer held it), our cross-node stage where several nodes
  hold replicas, rank 0's buffers before each training forward (FSDP2 leaves them alone); a heal keeps its groups
  and the model's mesh groups, not its shards (the model moves to the next round's mesh: ``train/regroup.py``)."""

from __future__ import annotations

import functools
import warnings
from contextlib import AbstractContextManager
from typing import Any, Optional

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launcher.base.sync_modes import Overlap, Reducer
from launcher.comm.collectives import AbortableHook, abortable_hook, hierarchical_hook
from launcher.comm.reducer import BucketedReducer
from launcher.comm.shard import CrossNodeStage, describe_sharding, no_sync
from launcher.comm.sync import BaseSync, Sync, SyncParts, rank0_buffers_hook
from launcher.group.abort import Abort


class DdpSync(BaseSync):
    def __init__(self, parts: SyncParts, device: torch.device) -> None:
        super().__init__(parts)
        model, topology, plan, options = parts.model, parts.topology, parts.plan, parts.options
        with warnings.catch_warnings():  # torch 2.13 renames broadcast_buffers (older ones lack the new name)
            warnings.simplefilter("ignore", FutureWarning)
            self.ddp = DistributedDataParallel(
                model,
                device_ids=[device] if device.type == "cuda" else None,
                bucket_cap_mb=plan.bucket_cap_mb,
                find_unused_parameters=options.find_unused_parameters,
                broadcast_buffers=options.broadcast_buffers,
            )
        if self.abort is not None or plan.compresses:  # a lost machine left behind; compression
            keys = {id(p): i for i, p in enumerate(p for p in model.parameters() if p.requires_grad)}
            hook = AbortableHook(topology, plan.hierarchical, self.abort or Abort(), parts.compression, keys)
            self.ddp.register_comm_hook(hook, abortable_hook)
        elif plan.hierarchical:
            self.ddp.register_comm_hook(topology, hierarchical_hook)
        self.module = self.ddp
        layout = f"torch DDP, bucket cap {plan.bucket_cap_mb:g} MB"
        self.described(layout + (f", backward overlap ({plan.overlap_reason})" if plan.overlap_reason else ""))

    def no_sync(self) -> AbstractContextManager[None]:
        return self.ddp.no_sync()


class BucketedSync(BaseSync):
    def __init__(self, parts: SyncParts, optimizer: Optional[torch.optim.Optimizer]) -> None:
        """``optimizer``: held by the reducer (its updates bucket by bucket), or None where the optimizer step needs
        every synchronised gradient at once (clipping, the fp16 scaler)."""
        super().__init__(parts)
        plan, cap = parts.plan, parts.plan.bucket_cap_mb
        self.reducer = BucketedReducer(
            parts.model,
            parts.topology,
            bucket_cap_mb=cap,
            first_bucket_mb=plan.first_bucket_mb,
            hierarchical=plan.hierarchical,
            find_unused_parameters=parts.options.find_unused_parameters,
            broadcast_buffers=parts.options.broadcast_buffers,
            optimizer=optimizer,
            overlap=plan.overlap,
            chunk_mb=cap,  # the forward overlap's chunks sized as buckets: latency a small share of each
            peers=parts.peers,
            compression=parts.compression,
            prefer_backward=plan.overlap_reason,
        )
        self.described(f"bucketed, cap {cap:.2f} MB ({plan.cap_reason}): {self.reducer.describe()}")

    @property
    def overlaps_forward(self) -> bool:
        return self.reducer.overlap is Overlap.forward

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        self.reducer.zero_grad()  # keeps .grad as views into the buckets

    def no_sync(self) -> AbstractContextManager[None]:
        return self.reducer.no_sync()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.reducer.optimizer is None:  # (the step needs every gradient at once: the plain optimizer's)
            optimizer.step()
        else:
            self.reducer.step()

    def flush(self) -> None:
        self.reducer.flush()

    def exposed_s(self) -> Optional[float]:
        return self.reducer.last_wait_s

    def release(self) -> None:
        self.reducer.close()

    def detach(self) -> None:
        self.reducer.close()  # (its hooks off the model; the rest is kept by the abort signal until the end)


class ShardedSync(BaseSync):
    def __init__(self, parts: SyncParts) -> None:
        super().__init__(parts)
        model = parts.model
        # several nodes under comm.shard=node: each shard's gradient summed across nodes by our stage
        hierarchical = parts.plan.hierarchical
        self.stage = CrossNodeStage(model, parts.topology, parts.compression, self.abort) if hierarchical else None
        self._buffers: Any = None  # the forward pre-hook broadcasting rank 0's buffers
        if parts.options.broadcast_buffers and any(True for _ in model.buffers()):  # as DDP's (FSDP2 leaves them)
            self._buffers = model.register_forward_pre_hook(functools.partial(rank0_buffers_hook, parts.peers))
        self.described(describe_sharding(model))

    def no_sync(self) -> AbstractContextManager[None]:
        return no_sync(self.model)

    def exposed_s(self) -> Optional[float]:
        return self.stage.last_wait_s if self.stage is not None else None

    def release(self) -> None:
        if self.stage is not None:
            self.stage.close()
        if self._buffers is not None:
            self._buffers.remove()

    def kept_by_abort(self) -> Any:
        """The model goes to the next round's mesh (``train/regroup.py``): its groups are kept, not its shards."""
        return (self.topology, self.stage and self.stage.across, _mesh_groups(self.model))


def _mesh_groups(model: nn.Module) -> list[Any]:
    """The process groups of a sharded ``model``'s meshes (a heal keeps them: destructors may wait for peers)."""
    groups = (p.device_mesh.get_group() for p in model.parameters() if hasattr(p, "device_mesh"))
    return list({id(g): g for g in groups}.values())


def sync_for_plan(
    parts: SyncParts, device: torch.device, optimizer: torch.optim.Optimizer, whole_gradient: bool
) -> Sync:
    """The ``Sync`` of the plan's kind (collective: DDP broadcasts the model; the stage and the reducer build their
    groups' state). ``whole_gradient``: the optimizer step needs every synchronised gradient at once (clipping, the
    fp16 scaler): the bucketed reducer does not hold the optimizer then."""
    if parts.plan.sharded:
        return ShardedSync(parts)
    if parts.plan.reducer is Reducer.bucketed:
        return BucketedSync(parts, None if whole_gradient else optimizer)
    return DdpSync(parts, device)
