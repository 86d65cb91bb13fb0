"""The start banner: one screen on rank 0 with the layout, every rank's device, the gradient sync and why, the
batch split and the run dir."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from launcher.base.devices import describe_device
from launcher.base.env import DistEnv
from launcher.config import JobConfig
from launcher.group.helpers import Peers
from launcher.train.optim import describe_schedule
from launcher.train.progress import Span
from launcher.train.step import describe_precision
from launcher.train.world import World

log = logging.getLogger(__name__)

MAX_DEVICE_LINES = 12


def node_hosts(facts: list) -> list[str]:
    """Each node's host name in node order, from every rank's ``(node_rank, host, ...)``."""
    return [host for _, host in sorted({fact[0]: fact[1] for fact in reversed(facts)}.items())]


def format_banner(env: DistEnv, backend: str, devices: list[str], sync: str, batch: str, run_dir: Path) -> str:
    """``devices``: ``"host: device"`` per rank; consecutive CPU ranks on one host share a line."""
    groups: list[tuple[list[int], str]] = []
    for rank, where in enumerate(devices):
        if groups and groups[-1][1] == where and where.endswith(": cpu"):
            groups[-1][0].append(rank)
        else:
            groups.append(([rank], where))
    shown = [f"rank{'s' if len(r) > 1 else ''} {r[0]}{f'-{r[-1]}' if len(r) > 1 else ''} on {w}" for r, w in groups]
    if len(shown) > MAX_DEVICE_LINES:
        more = len(shown) - MAX_DEVICE_LINES
        shown = shown[:MAX_DEVICE_LINES] + [f"... and {more} more (see each rank's log)"]
    lines = [
        f"layout         {env.num_nodes} node(s) x {env.local_world_size} rank(s) = {env.world_size}, "
        f"backend {backend}",
        *[f"{'devices' if i == 0 else '':<14} {line}" for i, line in enumerate(shown)],
        f"gradient sync  {sync}",
        f"batch          {batch}",
        f"run dir        {run_dir}",
    ]
    return "\n".join("  " + line for line in lines)


def describe_span(steps: int, steps_per_epoch: int) -> str:
    """``3 epoch(s) of 22``, or ``0.55 of an epoch of 22`` when the steps end within the first."""
    epochs = steps / max(1, steps_per_epoch)
    if epochs < 1:
        return f"{epochs:.2g} of an epoch of {steps_per_epoch}"
    return f"{epochs:.3g} epoch(s) of {steps_per_epoch}"


def show_banner(
    job: JobConfig, env: DistEnv, backend: str, device: torch.device, world: World, span: Span, peers: Peers
) -> list[str]:
    """Collective: every rank's node, host and device gathered; rank 0 logs the banner. Returns each node's host."""
    facts = peers.all_gather_object((env.node_rank, env.hostname, describe_device(device)))
    if env.is_main:
        batch = (
            f"{span.global_batch} global = {world.batch_per_rank} per rank x {env.world_size}; "
            f"{span.total_steps} steps ({describe_span(span.total_steps, span.steps_per_epoch)}); "
            f"{describe_schedule(job.optim, span.schedule_steps)}; {describe_precision(job.train, job.optim)}"
        )
        devices = [f"{host}: {device}" for _, host, device in facts]
        log.info("job\n%s", format_banner(env, backend, devices, world.sync.description, batch, Path(job.run_dir)))
    return node_hosts(facts)
