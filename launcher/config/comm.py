"""The ``comm`` section of a job's schema: how gradients travel (``comm.reducer``, node-first, compression, the
overlap, sharding) and the collectives' watch and timeout. Its choices are the Enums of
``launcher/base/sync_modes.py``; ``schema.py`` holds the job around it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from launcher.base.liveness import TRAINER_TIMEOUT_S
from launcher.base.sync_modes import Backend, Compress, Hierarchical, Overlap, Reducer, Shard
from launcher.config.errors import ConfigError, _check, _member


@dataclass
class CommConfig:
    reducer: Reducer = Reducer.ddp  # ddp (torch DistributedDataParallel) | bucketed (our overlapped reducer) | fsdp
    #                                 (torch's FSDP2 shards parameters, gradients and optimizer state: comm.shard)
    shard: Shard = Shard.auto  # comm.reducer=fsdp: auto (node where a node has several ranks, world where it has one:
    #                            the plan says which) | node (shard among the ranks of a node, replicate across nodes:
    #                            only each shard's gradient crosses nodes, by our stage: comm.compress applies) | world
    #                            (one flat group: every all-gather and reduce-scatter crosses the slowest link)
    reshard_after_forward: bool = True  # comm.reducer=fsdp: free each unit's gathered parameters after its forward
    #                                     (gathered again in backward: less memory, more traffic inside the group)
    fsdp_units: list[str] = field(default_factory=list)  # comm.reducer=fsdp: class names sharded as units (e.g.
    #                                                      [TransformerBlock]); empty: the blocks of the model's
    #                                                      ModuleLists (a transformer's layers), or without any (or
    #                                                      with comm.fsdp_min_params set) every module holding
    #                                                      comm.fsdp_min_params parameters not yet in a unit
    fsdp_min_params: Optional[int] = None  # set: the size rule's threshold; null: the model's blocks, or without any
    #                                        the size rule from 2^20 or an eighth of the model, the fewer
    hierarchical: Hierarchical = Hierarchical.auto  # auto (measure both at start-up) | true | false: reduce inside a
    #                                                 node first
    bucket_cap_mb: Optional[float] = None  # gradient bucket size; null = ddp: torch's 25 MB; bucketed: sized from
    #                                        the measured link (launcher/comm/policy.py; 25 MB under PowerSGD or on
    #                                        one rank; a resume on the same layout keeps its cap)
    first_bucket_mb: float = 1.0  # bucketed: the first bucket is small so communication starts early
    find_unused_parameters: bool = False  # reduce parameters that got no gradient instead of failing (as DDP's)
    broadcast_buffers: bool = True  # rank 0's buffers (batch-norm statistics) before each forward, as DDP's
    backend: Backend = Backend.auto  # auto (nccl on GPUs, gloo on CPU) | gloo | nccl
    timeout_s: Optional[float] = None  # collective timeout: a stuck rank fails the job after this long, named; null:
    #                                  the trainer's 300 s, a script's own process group timeout (torch's: gloo 30
    #                                  min, nccl 10 min; the watch names a hang but does not end a script's job)
    hang_warn_s: float = 60.0  # no rank completed a collective for this long while one waits: the watch names the
    #                            rank(s) holding the job up, with their live stacks (launcher/watch); 0 = no watch
    flight_recorder_entries: int = 2000  # torch's flight recorder (TORCH_FR_BUFFER_SIZE): collectives kept per rank
    overlap: Overlap = Overlap.forward  # forward: bucketed updates each bucket as soon as it is reduced, hiding the
    #                                     tail of communication behind the optimizer and the next forward (where the
    #                                     run allows it: the banner names what disables it) | backward: wait for every
    #                                     bucket in backward
    trace: bool = False  # write trace.json (Chrome/Perfetto timeline) of trace_steps steps after the first
    trace_steps: int = 5  # comm.trace: how many steps the timeline covers
    compress: Compress = Compress.none  # what crosses nodes (the sum inside a node stays exact): none | bf16 (half
    #                                     the bytes) | powersgd (low rank, error feedback: launcher/comm/compress.py) |
    #                                     auto (by the link)
    powersgd_rank: int = 4  # comm.compress=powersgd: the rank of each weight matrix's approximation
    compress_warmup_steps: int = 10  # steps sent uncompressed before compression begins

    def __post_init__(self) -> None:
        self.reducer = _member(Reducer, self.reducer, "comm.reducer")  # (a member already when OmegaConf built it)
        self.hierarchical = _member(Hierarchical, self.hierarchical, "comm.hierarchical")
        self.overlap = _member(Overlap, self.overlap, "comm.overlap")
        self.compress = _member(Compress, self.compress, "comm.compress")
        self.shard = _member(Shard, self.shard, "comm.shard")
        self.backend = _member(Backend, self.backend, "comm.backend")
        if self.fsdp_min_params is not None:
            _check(self.fsdp_min_params >= 1, f"comm.fsdp_min_params={self.fsdp_min_params} must be >= 1 (or null)")
        self.shard_auto = ""  # (not a field: why comm.shard=auto became what it is, for the plan: resolve_shard)
        if self.reducer.sharded:
            self._check_compress()
        if self.bucket_cap_mb is not None:
            _check(
                self.bucket_cap_mb > 0,
                f"comm.bucket_cap_mb={self.bucket_cap_mb} must be > 0 (or null: sized from the measured link)",
            )
        _check(self.first_bucket_mb > 0, f"comm.first_bucket_mb={self.first_bucket_mb} must be > 0")
        _check(
            self.timeout_s is None or self.timeout_s > 0,
            f"comm.timeout_s={self.timeout_s} must be > 0 (or null: {TRAINER_TIMEOUT_S:.0f} s for the trainer)",
        )
        _check(self.hang_warn_s >= 0, f"comm.hang_warn_s={self.hang_warn_s} must be >= 0 (0 switches the watch off)")
        _check(
            self.flight_recorder_entries >= 16,
            f"comm.flight_recorder_entries={self.flight_recorder_entries} must be >= 16; HINT: 2000 (torch's default)",
        )
        _check(self.trace_steps >= 1, f"comm.trace_steps={self.trace_steps} must be >= 1")
        _check(self.powersgd_rank >= 1, f"comm.powersgd_rank={self.powersgd_rank} must be >= 1; HINT: 4")
        _check(self.compress_warmup_steps >= 0, f"comm.compress_warmup_steps={self.compress_warmup_steps} must be >= 0")

    def resolve_shard(self, nodes: int, per_node: int) -> None:
        """``comm.shard=auto`` made ``node`` or ``world`` for a sharded job of ``nodes`` node(s) of ``per_node``
        rank(s) (``Shard.resolve``), once, where the shape is known (``JobConfig``, after the mode filled it in), so
        the frozen config, the ranks and the checkpoints hold what runs; ``shard_auto`` keeps why for the plan."""
        if self.shard is not Shard.auto or not self.reducer.sharded:
            return
        self.shard = Shard.auto.resolve(nodes, per_node)
        self.shard_auto = shard_reason(self.shard, nodes, per_node)
        self._check_compress()

    def _check_compress(self) -> None:
        """A flat shard group (``world``) has nothing of ours crossing nodes to compress: ``comm.compress`` refused."""
        if self.shard is not Shard.world or self.compress is Compress.none:
            return
        if self.shard_auto:
            raise ConfigError(
                f"comm.compress={self.compress} with comm.shard=auto, which shards across every rank here "
                f"({self.shard_auto}): a flat shard group has no cross-node stage to compress (its reduce-scatters "
                "cross nodes as they are); HINT: comm.compress=none (the default), or comm.shard=node (every rank a "
                "whole replica, our compressed stage across nodes)"
            )
        raise ConfigError(
            f"comm.compress={self.compress} with comm.shard=world: a flat shard group has no cross-node stage to "
            "compress (its reduce-scatters cross nodes as they are); HINT: comm.shard=node (shard inside a node, our "
            "compressed stage across nodes) or comm.compress=none"
        )


def shard_reason(shard: Shard, nodes: int, per_node: int) -> str:
    """Why ``comm.shard=auto`` is ``shard`` on ``nodes`` node(s) of ``per_node`` rank(s) (the plan's words)."""
    if nodes == 1:
        return "one node: sharded among its ranks"
    if shard is Shard.world:
        return "one rank per node: sharding inside a node would leave every rank the whole model"
    return f"{per_node} ranks per node: sharded inside each node, replicated across the nodes"
