"""``launcher.mesh()``: the job's topology as a torch ``DeviceMesh``, for users' scripts (FSDP2's ``fully_shard``,
tensor parallelism, any collective on a sub-group), built the one way the launcher knows the machines.

The node-first rule, for sharded training too: ``shard="node"`` (the default) is a 2-D mesh with dims ``replicate``
(one entry per node) and ``shard`` (the ranks of one node). ``fully_shard(model, mesh=launcher.mesh())`` is then
HSDP: parameters and gradients sharded inside a node (all-gather and reduce-scatter on the fast links), every shard
replicated across nodes (one all-reduce of a shard's gradient per step on the slow link), not a flat group whose
every all-gather crosses it. ``shard="world"`` is the flat 1-D mesh (dim ``shard``) over every rank; one node gives
it too. ``shard="auto"`` (``comm.shard``'s default) is ``node`` where a node holds several ranks and ``world`` where
each holds one (a 2-D mesh would shard nothing there). The node-local group is ``mesh.get_group("shard")``, the
cross-node group ``mesh.get_group("replicate")``.

Ranks are numbered node by node (rank = node x ranks per node + local rank) in every mode: the mesh's rows are the
nodes. Call it after ``init_process_group`` (a script's own, as under torchrun)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from launcher.base.env import DistEnv
from launcher.base.sync_modes import Shard


def mesh(shard: str | Shard = "node", device_type: Optional[str] = None, env: Optional[DistEnv] = None) -> DeviceMesh:
    """The job's ``DeviceMesh``: ``shard="node"``: dims (``replicate``, ``shard``) = (nodes, ranks of a node);
    ``shard="world"`` (or one node): dim ``shard`` over every rank. ``device_type``: the process group's device
    (``cuda`` under nccl, else ``cpu``) unless given. ``env``: this rank's place (resolved from the environment)."""
    spread = Shard.of(shard)  # (a member, or the text a user types: compared as a member)
    if spread is None:
        raise ValueError(
            f"launcher.mesh(shard={shard!r}); HINT: shard='node' (HSDP: shard inside a node), 'world' or 'auto'"
        )
    if not dist.is_initialized():
        raise RuntimeError(
            "launcher.mesh() needs the job's process group; HINT: call dist.init_process_group() first (the launcher "
            "has set RANK, WORLD_SIZE, MASTER_ADDR ... for it)"
        )
    env = env or DistEnv.resolve()
    if env.world_size != dist.get_world_size() or env.rank != dist.get_rank():
        raise RuntimeError(
            f"launcher.mesh(): the process group (rank {dist.get_rank()} of {dist.get_world_size()}) is not the job's "
            f"({env.describe()}); HINT: build the mesh on the default group the script initialised"
        )
    per_node = env.local_world_size
    if env.world_size % per_node or env.world_size // per_node != env.num_nodes:
        raise ValueError(
            f"launcher.mesh(): {env.world_size} ranks are not {env.num_nodes} node(s) of {per_node}; HINT: "
            "shard='world' (a flat mesh) for uneven nodes"
        )
    device = device_type or ("cuda" if dist.get_backend() == "nccl" and torch.cuda.is_available() else "cpu")
    if spread.resolve(env.num_nodes, per_node) is Shard.world or env.num_nodes == 1:
        return init_device_mesh(device, (env.world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(device, (env.num_nodes, per_node), mesh_dim_names=("replicate", "shard"))
