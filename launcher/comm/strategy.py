"""Flat or node-first? ``auto`` measures both on the real groups at start-up and keeps the faster.

The hierarchy pays when the inter-node link is the bottleneck (it sends one tensor per node across, not one per
rank) and costs an extra hop on fast links. Timing: a few alternating repetitions of each on a bucket-sized
tensor, each started behind a barrier; every rank's medians are max-reduced, so all ranks see the same figures
and make the same choice. The hierarchy must win by ``MARGIN`` (5 %): a closer call is within the probe's noise,
and flat then costs less CPU (one collective, no extra hops).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from launcher.comm.collectives import flat_allreduce, hierarchical_allreduce
from launcher.comm.sizes import MB
from launcher.comm.topology import Topology

MARGIN = 0.05


@dataclass(frozen=True)
class StrategyChoice:
    hierarchical: bool
    reason: str
    flat_ms: Optional[float] = None
    hier_ms: Optional[float] = None

    def describe(self) -> str:
        return f"{'hierarchical' if self.hierarchical else 'flat'} allreduce: {self.reason}"


def interleaved_medians(
    runs: dict[str, Callable[[], object]],
    device: torch.device,
    reps: int = 5,
    group: dist.ProcessGroup | None = None,
    warmup: int = 1,
    slowest: bool = False,
) -> dict[str, float]:
    """The one timing loop: median seconds of each ``run()`` (a blocking collective or step), the runs
    interleaved rep by rep so drift hits all alike, each started behind a barrier of ``group``; ``warmup``
    uncounted rounds first (they set up connections). ``slowest``: each rep counts the slowest rank's time (one
    small allreduce per rep), else this rank's own. Every member of ``group`` calls it."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for rep in range(warmup + reps):
        for name, run in runs.items():
            dist.barrier(group=group)
            start = time.perf_counter()
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - start
            if slowest:
                box = torch.tensor([elapsed], dtype=torch.float64, device=device)  # nccl: device tensors only
                dist.all_reduce(box, op=dist.ReduceOp.MAX, group=group)
                elapsed = box.item()
            if rep >= warmup:
                times[name].append(elapsed)
    return {name: statistics.median(ts) for name, ts in times.items()}


def median_seconds(
    run: Callable[[], object], device: torch.device, reps: int = 5, group: dist.ProcessGroup | None = None
) -> float:
    """This rank's median time of ``run()`` (``interleaved_medians`` of one run)."""
    return interleaved_medians({"run": run}, device, reps, group)["run"]


def measure(topology: Topology, numel: int, device: torch.device, reps: int = 5) -> tuple[float, float]:
    """(flat ms, hierarchical ms): max over ranks of each rank's median. Collective."""
    tensor = torch.ones(numel, dtype=torch.float32, device=device)
    medians = interleaved_medians(
        {
            "flat": lambda: flat_allreduce(tensor, topology.world).wait(),
            "hier": lambda: hierarchical_allreduce(tensor, topology).wait(),
        },
        device,
        reps,
    )
    agreed = torch.tensor([medians["flat"], medians["hier"]], dtype=torch.float64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    flat_s, hier_s = agreed.cpu().tolist()
    return flat_s * 1e3, hier_s * 1e3


def choose(
    topology: Topology, hierarchical: bool | None, numel: int, device: torch.device, reps: int = 5
) -> StrategyChoice:
    """``hierarchical``: True / False as the user set it, None to decide here (measuring when it matters)."""
    measured = functools.partial(measure, topology, numel, device, reps)
    return decide(hierarchical, topology.num_nodes, topology.useful, measured, numel * 4 / MB)


def decide(
    hierarchical: bool | None, nodes: int, useful: bool, measured: Callable[[], tuple[float, float]], size_mb: float
) -> StrategyChoice:
    """The rule (pure): ``hierarchical`` as set; else flat on one node or one rank a node; else ``measured()`` (flat
    ms, node-first ms of ``size_mb``, called only here) and node-first when it wins by ``MARGIN``. ``useful``:
    several nodes, one of them with several ranks (``Topology.useful``)."""
    if hierarchical is not None:
        return StrategyChoice(hierarchical, f"comm.hierarchical={str(hierarchical).lower()}")
    if nodes == 1:
        return StrategyChoice(False, "one node: nothing crosses nodes")
    if not useful:
        return StrategyChoice(False, "one rank per node: nothing to reduce inside a node")
    flat_ms, hier_ms = measured()
    if hier_ms < (1 - MARGIN) * flat_ms:
        return StrategyChoice(
            True, f"measured {hier_ms:.1f} ms < flat {flat_ms:.1f} ms on {size_mb:.1f} MB", flat_ms, hier_ms
        )
    return StrategyChoice(
        False,
        f"measured flat {flat_ms:.1f} ms vs hierarchical {hier_ms:.1f} ms on {size_mb:.1f} MB "
        f"(the hierarchy must win by {MARGIN:.0%})",
        flat_ms,
        hier_ms,
    )
