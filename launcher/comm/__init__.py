"""Gradient sync engine: plain arguments in, tensors and Futures out; it knows nothing of Hydra, the config or the
launcher (an import-linter contract holds that). Read in this order:

- ``topology.py``: the process groups of a layout (world, my node's ranks, the same local rank across nodes);
- ``collectives.py``: flat and node-first allreduce (pipelined in segments on comm threads), also as DDP comm
  hooks; ``strategy.py``: the start-up choice between them; ``policy.py``: the bucket cap from the measured link;
- ``plan.py``: the sync plan, every choice of a job's sync made once (strategy, compression, overlap, bucket cap),
  with why; the choices are the Enums of ``launcher/base/sync_modes.py``;
- ``reducer.py``: our bucketed reducer's core (its docstring maps its rooms: buckets, state, unused, forward,
  updates, schedule, tail, hooks);
- ``sizes.py``: MB and a tensor's bytes; ``trace.py``: the Chrome-trace timeline of a few steps.
"""

from launcher.comm.collectives import flat_allreduce, flat_hook, hierarchical_allreduce, hierarchical_hook
from launcher.comm.topology import Layout, Topology

__all__ = [
    "Layout",
    "Topology",
    "flat_allreduce",
    "flat_hook",
    "hierarchical_allreduce",
    "hierarchical_hook",
]
