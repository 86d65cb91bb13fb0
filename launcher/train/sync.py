"""How the trainer's gradients are averaged: torch DDP (optionally with our node-first comm hook) or our
BucketedReducer, flat or hierarchical as ``comm.hierarchical`` says (``auto`` measures at start-up).
One object, one interface, so the training loop has no reducer branches."""

from __future__ import annotations

import logging
import warnings
from contextlib import AbstractContextManager
from typing import Any, Optional

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launcher.base.env import DistEnv
from launcher.comm import Topology, hierarchical_hook
from launcher.comm.collectives import AbortableHook, abortable_hook
from launcher.comm.compress import Compression, build_compression
from launcher.comm.policy import auto_compression, bucket_cap_mb, fast_link_overlap, measure_link
from launcher.comm.reducer import BucketedReducer
from launcher.comm.sizes import DDP_BUCKET_CAP_MB, MB
from launcher.comm.strategy import StrategyChoice, choose
from launcher.config import CommConfig, collective_timeout_s
from launcher.dist.abort import Abort
from launcher.dist.helpers import Peers

log = logging.getLogger(__name__)


def bucket_cap_for(topology: Topology, hierarchical: bool, device: torch.device, model_bytes: int) -> tuple[float, str]:
    """The bucketed reducer's cap at defaults: launcher/comm/policy.py (collective: every rank agrees)."""
    if topology.world_size == 1:
        return DDP_BUCKET_CAP_MB, "one rank: nothing to overlap"
    link = measure_link(topology, hierarchical, device)
    return bucket_cap_mb(link, model_bytes), f"sized from the link: {link.describe()}, model {model_bytes / MB:.1f} MB"


def compression_for(
    cfg: CommConfig, topology: Topology, device: torch.device, flat_chosen: bool
) -> tuple[Compression, str]:
    """``comm.compress`` as it applies to this layout, and why (collective under ``auto``: the link is measured;
    ``flat_chosen``: the flat allreduce measured faster than node-first)."""
    if cfg.compress == "none":
        return Compression(), ""
    if topology.num_nodes == 1:
        return Compression(), f"comm.compress={cfg.compress}: one node, nothing crosses nodes: nothing compressed"
    mode, why = cfg.compress, f"comm.compress={cfg.compress}"
    if mode == "auto":
        mode, why = auto_compression(measure_link(topology, True, device), flat_chosen)
    compression = build_compression(mode, cfg.powersgd_rank, cfg.compress_warmup_steps)
    return compression, why if mode == "none" else f"{compression.describe()} ({why})"


class GradientSync:
    def __init__(
        self,
        model: nn.Module,
        env: DistEnv,
        device: torch.device,
        cfg: CommConfig,
        optimizer: torch.optim.Optimizer,
        resumed_hierarchical: Optional[bool] = None,
        resumed_cap_mb: Optional[float] = None,
        resumed_compression: Optional[list[Any]] = None,
        whole_gradient: Optional[str] = None,
        peers: Optional[Peers] = None,
        healed: bool = False,
    ) -> None:
        """``whole_gradient``: why the optimizer step needs every synchronised gradient at once (clipping, the fp16
        scaler), or None: then the bucketed reducer runs the backward overlap and does not hold the optimizer.
        ``peers``: the abort signal (healing in place: every bucket's wait is left when it trips) and the job's
        secret (signed object collectives). ``resumed_compression``: the checkpoint's compression state per rank;
        ``healed``: built again after healing in place (a compression state starts anew on every rank alike)."""
        self.model = model
        self.abort = abort = (peers or Peers()).abort
        self.topology = Topology.build(env, timeout_s=collective_timeout_s(cfg))
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        probe_numel = max(1, min(model_bytes, int((cfg.bucket_cap_mb or DDP_BUCKET_CAP_MB) * MB)) // 4)
        if cfg.hierarchical == "auto" and resumed_hierarchical is not None:
            self.choice = StrategyChoice(bool(resumed_hierarchical), "kept from the checkpoint this run resumes")
        else:
            forced = {"auto": None, "true": True, "false": False}[cfg.hierarchical]
            self.choice = choose(self.topology, forced, probe_numel, device)
        compressed = self._choose_compression(cfg, device)
        self._restore_compression(resumed_compression, env, healed)
        self.reducer: Optional[BucketedReducer] = None
        if cfg.reducer == "bucketed":
            cap, why = self._cap(cfg, resumed_cap_mb, device, model_bytes)
            self.bucket_cap_mb: Optional[float] = cap
            self.reducer = BucketedReducer(
                model,
                self.topology,
                bucket_cap_mb=cap,
                first_bucket_mb=min(cfg.first_bucket_mb, cap),
                hierarchical=self.choice.hierarchical,
                find_unused_parameters=cfg.find_unused_parameters,
                broadcast_buffers=cfg.broadcast_buffers,
                optimizer=None if whole_gradient else optimizer,
                overlap=None if cfg.overlap == "forward" and not whole_gradient else "backward",  # forward where it can
                chunk_mb=cap,  # the forward overlap's chunks sized as buckets: latency a small share of each
                peers=peers,
                compression=self.compression,
                prefer_backward=fast_link_overlap(cfg.compress, self.compression.name, self.topology.num_nodes),
            )
            self.module: nn.Module = model
            layout = f"bucketed, cap {cap:.2f} MB ({why}): {self.reducer.describe()}"
            if whole_gradient and cfg.overlap == "forward":
                layout += f" (not the forward overlap: {whole_gradient})"
        else:
            cap = self.bucket_cap_mb = cfg.bucket_cap_mb or DDP_BUCKET_CAP_MB
            with warnings.catch_warnings():  # torch 2.13 renames broadcast_buffers (older ones lack the new name)
                warnings.simplefilter("ignore", FutureWarning)
                ddp = DistributedDataParallel(
                    model,
                    device_ids=[device] if device.type == "cuda" else None,
                    bucket_cap_mb=cap,
                    find_unused_parameters=cfg.find_unused_parameters,
                    broadcast_buffers=cfg.broadcast_buffers,
                )
            if abort is not None or self.compression.name != "none":  # a lost machine left behind; compression
                keys = {id(p): i for i, p in enumerate(p for p in model.parameters() if p.requires_grad)}
                hook = AbortableHook(self.topology, self.choice.hierarchical, abort or Abort(), self.compression, keys)
                ddp.register_comm_hook(hook, abortable_hook)
            elif self.choice.hierarchical:
                ddp.register_comm_hook(self.topology, hierarchical_hook)
            self.module = ddp
            layout = f"torch DDP, bucket cap {cap:g} MB"
            if cfg.overlap == "forward":
                layout += ", backward overlap (comm.reducer=ddp: torch DDP waits for its buckets in backward)"
        self.description = f"{layout}; {self.choice.describe()}; topology {self.topology.describe()}"
        if compressed:
            self.description += f"; {compressed}"
        log.debug("gradient sync: %s", self.description)

    def _cap(
        self, cfg: CommConfig, resumed_cap_mb: Optional[float], device: torch.device, model_bytes: int
    ) -> tuple[float, str]:
        """The bucketed reducer's cap and why (collective when measured)."""
        if cfg.bucket_cap_mb is not None:
            return cfg.bucket_cap_mb, "comm.bucket_cap_mb"
        if resumed_cap_mb is not None:  # same layout, same summation order: exact resume
            return resumed_cap_mb, "kept from the checkpoint this run resumes"
        if self.compression.name == "powersgd":
            return DDP_BUCKET_CAP_MB, "PowerSGD: two round trips a bucket, little wire: few buckets"
        return bucket_cap_for(self.topology, self.choice.hierarchical, device, model_bytes)

    def _choose_compression(self, cfg: CommConfig, device: torch.device) -> str:
        """``self.compression`` and why; compressing, the strategy is node-first (what the banner and the checkpoint
        say). Collective under ``comm.compress=auto``."""
        flat_chosen = self.topology.useful and not self.choice.hierarchical  # several ranks a node, flat faster
        self.compression, compressed = compression_for(cfg, self.topology, device, flat_chosen)
        if self.compression.name != "none" and not self.choice.hierarchical:
            self.choice = StrategyChoice(True, f"comm.compress={self.compression.name}: compression runs node-first")
        return compressed

    def compression_state(self) -> Optional[dict[str, Any]]:
        """This rank's compression state (a leader's error feedback and Qs: its own), with the layout it belongs
        to; None uncompressed."""
        if self.compression.name == "none":
            return None
        return {"layout": self._nodes(), **self.compression.state_dict()}

    def _nodes(self) -> list[list[int]]:
        """The layout of nodes (each node's global ranks) a compression state belongs to."""
        return [list(node) for node in self.topology.layout.nodes]

    def _restore_compression(self, saved: Optional[list[Any]], env: DistEnv, healed: bool) -> None:
        """Each rank takes its own saved state on the same layout (a bit-identical continuation); else its errors
        and Qs start anew, said once (after a heal too: a joiner has none, and every rank must start alike)."""
        if self.compression.name == "none" or not (saved or healed):
            return
        mine = saved[env.rank] if saved and len(saved) == env.world_size else None
        if healed:
            why = f"healed in place: the ranks changed; {self.compression.warmup_steps} step(s) uncompressed first"
        elif mine is None or mine.get("layout") != self._nodes():
            why = "saved on another layout of nodes"
        else:
            why = self.compression.load_state_dict(mine)
        if why and env.is_main:
            log.info("compression: error feedback and Qs start anew (%s)", why)

    @property
    def hierarchical(self) -> bool:
        return self.choice.hierarchical

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        if self.reducer is not None:
            self.reducer.zero_grad()  # keeps .grad as views into the buckets
        else:
            optimizer.zero_grad(set_to_none=True)

    def no_sync(self) -> AbstractContextManager[None]:
        """Backward passes that accumulate without synchronising (every micro-batch of a step but the last)."""
        if self.reducer is not None:
            return self.reducer.no_sync()
        assert isinstance(self.module, DistributedDataParallel)
        return self.module.no_sync()

    @property
    def overlaps_forward(self) -> bool:
        """Buckets may still be in flight after the optimizer step (their updates run at the next forward)."""
        return self.reducer is not None and self.reducer.overlap == "forward"

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer step: the reducer's when it holds the optimizer (forward overlap or not)."""
        if self.reducer is not None and self.reducer.optimizer is not None:
            self.reducer.step()
        else:
            optimizer.step()

    def flush(self) -> None:
        """Every pending update applied: before evaluation, a checkpoint, the end (forward overlap)."""
        if self.reducer is not None:
            self.reducer.flush()

    def exposed_s(self) -> Optional[float]:
        """Time the last backward waited for communication after its own work was done (bucketed only)."""
        return self.reducer.last_wait_s if self.reducer is not None else None

    def close(self) -> None:
        if getattr(self, "left", False):  # left to the graveyard: its groups may wait for the dead
            return
        if self.reducer is not None:
            self.reducer.close()
        self.topology.close()

    def leave(self) -> None:
        """Healing in place: this round's sync is left as it is (its groups wait for a lost machine; closing them
        would too): our reducer's hooks come off the model, the rest is kept by the abort signal until the end."""
        if self.reducer is not None:
            self.reducer.close()
        self.left = True
        if self.abort is not None:
            self.abort.keep(self)
