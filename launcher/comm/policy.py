"""Bucket sizing at defaults (``comm.bucket_cap_mb=null``): from the measured link and the model's size.

Why: a bucket's allreduce can only start when its last gradient is ready. torch DDP's 25 MB default leaves a
25 MB model in one bucket that starts when backward ends, so nothing overlaps (../shared/recipes/netns.md:
exposed communication / communication = 1.00 on a 1 Gbit link). Small buckets start early but each collective
pays a fixed latency. The policy picks the smallest bucket whose latency stays a small share of its transfer:

- measure, at start-up, an allreduce of two sizes on the path the reducer will use (flat or node-first) and fit
  ``t(b) = alpha + b / beta``: alpha is the per-collective latency, beta the bytes per second;
- a bucket of ``b`` bytes spends ``alpha / t(b)`` of its time on latency; keeping that under ``LATENCY_SHARE``
  needs ``b >= alpha * beta * (1 - s) / s``;
- at least ``MIN_CAP_MB`` (below that, per-bucket CPU work dominates: on a loopback "link" communication is CPU
  work that competes with backward, and one bucket after backward is fastest: bench/README.md), at most
  ``MAX_CAP_MB`` (torch DDP's default) and at most a ``1 / MIN_BUCKETS`` share of the model, so a large model
  always gets several buckets to overlap.

Buckets close when they reach the cap (as torch DDP's do): one layer's weight and bias share a bucket. All ranks
use the max-reduced figures, so they compute the same cap and the same layout. ``comm.bucket_cap_mb`` set
explicitly wins; the chosen layout is logged at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from launcher.base.sync_modes import Compress
from launcher.comm.collectives import start_allreduce
from launcher.comm.sizes import DDP_BUCKET_CAP_MB, MB
from launcher.comm.strategy import median_seconds
from launcher.comm.topology import Topology

LATENCY_SHARE = 0.1
MIN_CAP_MB = 1.0
MAX_CAP_MB = DDP_BUCKET_CAP_MB
MIN_BUCKETS = 4
LINK_PROBE_MB = (0.25, 4.0)  # the two allreduce sizes the link's latency and rate are fitted from


@dataclass(frozen=True)
class LinkFit:
    alpha_s: float  # per-allreduce latency
    beta_bps: float  # bytes per second

    def describe(self) -> str:
        return f"measured latency {self.alpha_s * 1e3:.2f} ms, {self.beta_bps / MB:.0f} MB/s"


def measure_link(topology: Topology, hierarchical: bool, device: torch.device, reps: int = 5) -> LinkFit:
    """Collective: fit latency and bandwidth from allreduce times of two sizes (max over ranks of medians)."""
    medians = []
    for mb in LINK_PROBE_MB:
        tensor = torch.ones(int(mb * MB) // 4, device=device)
        medians.append(
            median_seconds(lambda t=tensor: start_allreduce(t, topology, hierarchical).wait(), device, reps)  # type: ignore[misc]
        )
    agreed = torch.tensor(medians, dtype=torch.float64, device=device)  # nccl reduces device tensors only
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    t_small, t_large = agreed.cpu().tolist()
    bytes_small, bytes_large = (mb * MB for mb in LINK_PROBE_MB)
    beta = (bytes_large - bytes_small) / max(t_large - t_small, 1e-9)
    alpha = max(t_small - bytes_small / beta, 0.0)
    return LinkFit(alpha, beta)


def bucket_cap_mb(link: LinkFit, model_bytes: int) -> float:
    """The cap for this link and model (see the module docstring)."""
    latency_bound = link.alpha_s * link.beta_bps * (1 - LATENCY_SHARE) / LATENCY_SHARE / MB
    ceiling = max(MIN_CAP_MB, min(MAX_CAP_MB, model_bytes / MB / MIN_BUCKETS))
    return min(max(latency_bound, MIN_CAP_MB), ceiling)


# comm.compress=auto: the leaders' link (node-first allreduce rate) below these compresses (bench/compression.py)
POWERSGD_BELOW_BPS = 300 * MB
BF16_BELOW_BPS = 800 * MB


def auto_compression(link: LinkFit, flat_chosen: bool = False) -> tuple[Compress, str]:
    """(mode, why) for ``comm.compress=auto``: PowerSGD on a slow link, bf16 on a middling one, else none; none
    when the flat allreduce was measured faster than node-first (``flat_chosen``: the link is not the bottleneck,
    and compression runs node-first; bench/compression.py at 10 Gbit)."""
    if flat_chosen:
        return (
            Compress.none,
            "comm.compress=auto: the flat allreduce measured faster than node-first: nothing compressed",
        )
    rate = f"node-first allreduce at {link.beta_bps / MB:.0f} MB/s"
    if link.beta_bps < POWERSGD_BELOW_BPS:
        return Compress.powersgd, f"comm.compress=auto: {rate} < {POWERSGD_BELOW_BPS / MB:.0f} MB/s"
    if link.beta_bps < BF16_BELOW_BPS:
        return Compress.bf16, f"comm.compress=auto: {rate} < {BF16_BELOW_BPS / MB:.0f} MB/s"
    return Compress.none, f"comm.compress=auto: {rate}, fast enough: nothing compressed"


def fast_link_overlap(asked: Compress, compressed: Compress, nodes: int) -> str | None:
    """Why the bucketed reducer should take the backward overlap, or None: under ``comm.compress=auto`` (``asked``)
    on a link fast enough that nothing is compressed (``compressed``: what auto chose) between ``nodes`` > 1
    nodes, there is little wire time for the forward overlap to hide and its per-bucket work costs more
    (bench/compression.py at 10 Gbit: ours-auto 0.91x torch DDP flat with the forward overlap, 1.04-1.07x with
    the backward one)."""
    if asked is not Compress.auto or compressed is not Compress.none or nodes == 1:
        return None
    return "comm.compress=auto: a fast link, nothing compressed: little wire time to hide behind the next forward"
