"""The sync plan: what the gradient sync runs, decided once and in one place. ``plan_sync`` turns what was asked
(``SyncAsk``: the ``comm.*`` choices as Enums, and what the rest of the job imposes), the world the sync runs in
(``SyncWorld``) and the measured links (``Links``) into one frozen ``SyncPlan``: flat or node-first, what crosses
nodes compressed, the overlap, the bucket cap, and why each, which the banner prints. The ``Sync`` it names
(``comm/sync.py``; ``train/sync.py`` turns the config into these terms) and the reducers only read it.

Pure but for ``Links``, which it calls only when a choice needs a figure, in a fixed order (the strategy's probe,
then the node-first link under ``comm.compress=auto``, then the link the buckets are sized from): every rank decides
from the same max-reduced figures, so every rank asks the same collectives in the same order. The rules it applies
live beside the measurements they need: ``strategy.decide`` (flat or node-first), ``policy`` (``comm.compress=auto``,
the bucket cap, the fast link's overlap), ``updates.choose_overlap`` (the bucketed reducer's overlap)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from launcher.base.sync_modes import Compress, Hierarchical, Overlap, Reducer, Shard
from launcher.comm.policy import LinkFit, auto_compression, bucket_cap_mb, fast_link_overlap, measure_link
from launcher.comm.sizes import DDP_BUCKET_CAP_MB, MB
from launcher.comm.strategy import StrategyChoice, decide, measure
from launcher.comm.topology import Topology
from launcher.comm.updates import choose_overlap

KEPT = "kept from the checkpoint this run resumes"


@dataclass(frozen=True)
class SyncAsk:
    """What the job asks of the sync: the ``comm.*`` choices, and what the rest of the job imposes."""

    reducer: Reducer = Reducer.ddp
    hierarchical: Hierarchical = Hierarchical.auto
    compress: Compress = Compress.none
    overlap: Overlap = Overlap.forward
    bucket_cap_mb: Optional[float] = None  # None: sized from the link (bucketed), torch's 25 MB (ddp)
    first_bucket_mb: float = 1.0
    whole_gradient: Optional[str] = None  # why the optimizer step needs every gradient at once (clipping, fp16)
    forward_refusal: Optional[str] = None  # why the forward overlap cannot run with this optimizer (updates.py)
    shard: Shard = Shard.auto  # comm.reducer=fsdp: the ranks a model is sharded among (auto: by the world's shape)


@dataclass(frozen=True)
class SyncWorld:
    """The world the sync runs in, and what a resumed run keeps of its checkpoint's plan."""

    nodes: int
    world_size: int
    useful: bool  # several nodes, one of them with several ranks: the hierarchy can pay (Topology.useful)
    model_bytes: int  # the trained parameters' bytes
    kept_hierarchical: Optional[bool] = None  # the checkpoint's strategy (comm.hierarchical=auto keeps it)
    kept_cap_mb: Optional[float] = None  # the checkpoint's bucket cap (the same buckets: the same sums)


class Links(Protocol):
    """The links, measured when asked (collective: every rank asks the same, in the same order)."""

    def strategy_ms(self, numel: int) -> tuple[float, float]: ...  # (flat, node-first) ms for numel floats

    def link(self, hierarchical: bool) -> LinkFit: ...  # latency and rate of the flat or node-first allreduce


@dataclass(frozen=True)
class SyncPlan:
    """What the gradient sync runs, and why."""

    reducer: Reducer
    strategy: StrategyChoice  # flat or node-first, why (and the measured figures when measured)
    compression: Compress  # what crosses nodes: none, bf16 or powersgd (never auto: resolved here)
    compression_reason: str  # why ("" when comm.compress=none)
    overlap: Overlap  # the overlap that runs (torch DDP: backward)
    overlap_reason: Optional[str]  # why backward where forward was asked; None otherwise
    bucket_cap_mb: float
    cap_reason: str
    first_bucket_mb: float  # the bucketed reducer's first bucket, at most the cap

    @property
    def hierarchical(self) -> bool:
        return self.strategy.hierarchical

    @property
    def sharded(self) -> bool:
        return self.reducer.sharded

    @property
    def compresses(self) -> bool:
        return self.compression is not Compress.none


def plan_sync(asked: SyncAsk, world: SyncWorld, links: Links) -> SyncPlan:
    """The one plan of the gradient sync (see the module docstring)."""
    strategy = _strategy(asked, world, links)
    compression, compression_reason = _compression(asked, world, links, world.useful and not strategy.hierarchical)
    if compression is not Compress.none and not strategy.hierarchical:
        strategy = StrategyChoice(True, f"comm.compress={compression}: compression runs node-first")
    overlap, overlap_reason = _overlap(asked, world, compression)
    cap, cap_reason = _cap(asked, world, links, compression, strategy.hierarchical)
    return SyncPlan(
        reducer=asked.reducer,
        strategy=strategy,
        compression=compression,
        compression_reason=compression_reason,
        overlap=overlap,
        overlap_reason=overlap_reason,
        bucket_cap_mb=cap,
        cap_reason=cap_reason,
        first_bucket_mb=min(asked.first_bucket_mb, cap),
    )


def _strategy(asked: SyncAsk, world: SyncWorld, links: Links) -> StrategyChoice:
    """Flat or node-first: as set, kept on resume under auto, else measured on a bucket-sized tensor."""
    if asked.reducer.sharded:
        return _sharded(asked, world)
    if asked.hierarchical is Hierarchical.auto and world.kept_hierarchical is not None:
        return StrategyChoice(world.kept_hierarchical, KEPT)
    numel = max(1, min(world.model_bytes, int((asked.bucket_cap_mb or DDP_BUCKET_CAP_MB) * MB)) // 4)
    measured = functools.partial(links.strategy_ms, numel)
    return decide(asked.hierarchical.forced, world.nodes, world.useful, measured, numel * 4 / MB)


def _sharded(asked: SyncAsk, world: SyncWorld) -> StrategyChoice:
    """Sharded training's layout is the choice: node-first across nodes under ``comm.shard=node``, measured nothing
    (``comm.hierarchical`` does not apply)."""
    if world.nodes == 1:
        return StrategyChoice(False, "comm.reducer=fsdp on one node: sharded among its ranks, nothing crosses nodes")
    per_node = world.world_size // world.nodes
    shard = asked.shard.resolve(world.nodes, per_node)  # (the config resolved auto already where it knew the shape)
    said = f"comm.shard=auto -> {shard}" if asked.shard is Shard.auto else f"comm.shard={shard}"
    if shard is Shard.world:
        inside = " (comm.shard=node keeps them inside a node)" if per_node > 1 else " (one rank a node)"
        return StrategyChoice(
            False,
            f"{said}: one flat shard group over {world.world_size} ranks; every all-gather and reduce-scatter "
            f"crosses the slowest link{inside}",
        )
    return StrategyChoice(
        True,
        f"{said}: sharded among the ranks of a node, each shard's gradient summed across the {world.nodes} nodes by "
        "our stage",
    )


def _compression(asked: SyncAsk, world: SyncWorld, links: Links, flat_chosen: bool) -> tuple[Compress, str]:
    """``comm.compress`` as it applies to this world, and why (``flat_chosen``: several ranks a node and the flat
    allreduce measured faster than node-first)."""
    if asked.compress is Compress.none:
        return Compress.none, ""
    if world.nodes == 1:
        return Compress.none, f"comm.compress={asked.compress}: one node, nothing crosses nodes: nothing compressed"
    if asked.reducer.sharded and asked.shard.resolve(world.nodes, world.world_size // world.nodes) is Shard.world:
        return Compress.none, f"comm.compress={asked.compress}: a flat shard group has no cross-node stage to compress"
    if asked.compress is Compress.auto:
        return auto_compression(links.link(True), flat_chosen)
    return asked.compress, f"comm.compress={asked.compress}"


def _overlap(asked: SyncAsk, world: SyncWorld, compression: Compress) -> tuple[Overlap, Optional[str]]:
    if asked.reducer.sharded:
        why = "comm.reducer=fsdp: the sharded optimizer steps once every shard is summed; the cross-node stage hides "
        why += "behind the rest of backward"
        return Overlap.backward, why if asked.overlap is Overlap.forward else None
    if asked.reducer is Reducer.ddp:
        why = "comm.reducer=ddp: torch DDP waits for its buckets in backward"
        return Overlap.backward, why if asked.overlap is Overlap.forward else None
    if asked.overlap is Overlap.backward:
        return Overlap.backward, None
    if asked.whole_gradient is not None:
        return Overlap.backward, f"not the forward overlap: {asked.whole_gradient}"
    prefer_backward = fast_link_overlap(asked.compress, compression, world.nodes)
    return choose_overlap(None, asked.forward_refusal, compression, prefer_backward)


def _cap(
    asked: SyncAsk, world: SyncWorld, links: Links, compression: Compress, hierarchical: bool
) -> tuple[float, str]:
    """The bucket cap and why: as set; torch's for DDP; kept on resume; else sized from the link (policy.py)."""
    if asked.reducer.sharded:
        return 0.0, "FSDP2: each unit's shard is one bucket (comm.fsdp_units, comm.fsdp_min_params)"
    if asked.bucket_cap_mb is not None:
        return asked.bucket_cap_mb, "comm.bucket_cap_mb"
    if asked.reducer is Reducer.ddp:
        return DDP_BUCKET_CAP_MB, "torch DDP's default"
    if world.kept_cap_mb is not None:  # same layout, same summation order: exact resume
        return world.kept_cap_mb, KEPT
    if compression is Compress.powersgd:
        return DDP_BUCKET_CAP_MB, "PowerSGD: two round trips a bucket, little wire: few buckets"
    if world.world_size == 1:
        return DDP_BUCKET_CAP_MB, "one rank: nothing to overlap"
    link = links.link(hierarchical)
    return bucket_cap_mb(link, world.model_bytes), (
        f"sized from the link: {link.describe()}, model {world.model_bytes / MB:.1f} MB"
    )


class MeasuredLinks:
    """``Links`` measured on the real groups (``strategy.measure``, ``policy.measure_link``)."""

    def __init__(self, topology: Topology, device: torch.device) -> None:
        self.topology, self.device = topology, device

    def strategy_ms(self, numel: int) -> tuple[float, float]:
        return measure(self.topology, numel, self.device)

    def link(self, hierarchical: bool) -> LinkFit:
        return measure_link(self.topology, hierarchical, self.device)
