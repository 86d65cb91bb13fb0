"""Gradient sync engine: topology, flat and node-first allreduce (also as DDP comm hooks), the bucketed
reducer that overlaps allreduce with backward, and the start-up choice between strategies.
Knows nothing of Hydra or the launcher's config: plain arguments in, tensors and Futures out."""

from .collectives import flat_allreduce, flat_hook, hierarchical_allreduce, hierarchical_hook
from .topology import Layout, Topology

__all__ = [
    "Layout",
    "Topology",
    "flat_allreduce",
    "flat_hook",
    "hierarchical_allreduce",
    "hierarchical_hook",
]
