"""Sharded training, node first: torch's FSDP2 (``fully_shard``) inside a node, our own stage across nodes.

A flat FSDP group spans the slow link: every step all-gathers the parameters and reduce-scatters the gradients
across it (bench/fsdp.py: 1.9x the node-first step at 1 Gbit). Here FSDP2 shards each unit among the ranks of one
node (``shard_mesh``: a 1-D mesh over the node's group), so its all-gathers and reduce-scatters stay inside the node,
and every shard is replicated across nodes. What crosses nodes is ours (``CrossNodeStage``): FSDP2's all-reduce hook
hands each unit's reduce-scattered shard (a flat buffer, already averaged over the node) to the node-first pipeline
of ``collectives.py`` on a topology view without node phases (``Topology.across``), so ``comm.compress`` (bf16,
PowerSGD with error feedback per shard) and the backward overlap apply as to the replicated reducers. Native 2-D
HSDP could not host that: its own all-reduce runs before the hook.

Facts this rests on (torch 2.13, read in ``torch/distributed/fsdp/_fully_shard`` and checked on gloo):
- the hook gets ``t``, the unit's shard of every parameter's gradient, in the reduce dtype, averaged over the shard
  group (ReduceOp.AVG: no divide factor is ever set here, gloo has no PREMUL_SUM); parameter by parameter in the
  unit's order, each ``ceil(rows / s)`` rows (``torch.chunk``) of which the first ``to_local()`` rows are real;
- with ``reduce_dtype`` the parameters' (fp32: ``MixedPrecisionPolicy`` only lowers ``param_dtype``), FSDP's
  ``.grad`` are views into ``t``, so an in-place all-reduce still in flight when the hook returns lands in them;
  it is waited for in a callback queued on autograd's engine, which runs after FSDP's own;
- ``set_requires_gradient_sync(False)`` skips the reduce-scatter and the hook (accumulation: ``no_sync``).
No Hydra here: plain arguments (the trainer's ``train/model.py`` turns the config into a ``ShardSpec``)."""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.futures import Future

from launcher.base.sync_modes import Compress, Shard
from launcher.comm.collectives import hierarchical_allreduce
from launcher.comm.compress import Compression, Matrix
from launcher.comm.topology import Layout, Topology, new_groups
from launcher.comm.units import choose_units
from launcher.group.abort import Abort

log = logging.getLogger(__name__)

NEEDS = "comm.reducer=fsdp needs torch>=2.6 (torch.distributed.fsdp.fully_shard); HINT: pip install -U torch"


def _fsdp() -> Any:
    try:
        import torch.distributed.fsdp as fsdp

        fsdp.fully_shard, fsdp.FSDPModule, fsdp.MixedPrecisionPolicy  # noqa: B018 (present: torch>=2.6)
    except (ImportError, AttributeError) as exc:
        raise RuntimeError(f"{NEEDS} (torch {torch.__version__} here)") from exc
    return fsdp


@dataclass(frozen=True)
class ShardSpec:
    """How a model is sharded on its mesh (``shard_mesh``): whether the units free their gathered parameters after
    forward, which modules are units (``comm/units.py``: the classes named, else the model's blocks or every module
    holding ``min_params`` parameters not yet in a unit), the dtype the forward computes in."""

    reshard_after_forward: bool = True
    unit_classes: tuple[str, ...] = ()
    min_params: Optional[int] = None  # None: the blocks of the model's ModuleLists, or the size rule's default
    param_dtype: Optional[torch.dtype] = None  # None: the parameters' own (fp32)
    scatter_unused: bool = False  # parameters without a gradient join the reduce-scatter as zeros (same layout)


def shard_mesh(env: Any, shard: Shard, device_type: str, timeout_s: Optional[float] = None) -> Any:
    """The 1-D ``DeviceMesh`` FSDP2 shards over (collective): the ranks of this rank's node under
    ``Shard.node`` (groups of their own: the cross-node stage's are the topology's), every rank under ``world``
    (``auto``: by the world's shape, ``Shard.resolve``)."""
    from torch.distributed.device_mesh import DeviceMesh

    if shard.resolve(env.num_nodes, env.local_world_size) is Shard.world or env.num_nodes == 1:
        group = dist.group.WORLD
    else:
        from datetime import timedelta

        layout = Layout.gather(env)
        sizes = {len(n) for n in layout.nodes}
        if len(sizes) > 1:
            raise ValueError(
                f"comm.shard=node: the nodes hold {'+'.join(str(len(n)) for n in layout.nodes)} ranks; every node's "
                "ranks must hold one shard each of the same model; HINT: comm.shard=world (one flat group)"
            )
        timeout = timedelta(seconds=timeout_s) if timeout_s else None
        group = new_groups([list(n) for n in layout.nodes], env.rank, None, timeout)
    assert group is not None
    return DeviceMesh.from_group(group, device_type, mesh_dim_names=("shard",))


def units(model: nn.Module, spec: ShardSpec) -> list[tuple[str, nn.Module]]:
    """The modules wrapped as units, children before parents (the root comes last, apart): ``comm/units.py``."""
    return choose_units(model, spec.unit_classes, spec.min_params)


def shard_model(model: nn.Module, mesh: Any, spec: ShardSpec) -> list[str]:
    """``fully_shard`` on each unit (``units``) and on the root, in place (the model is then an ``FSDPModule``, its
    parameters sharded DTensors: build the optimizer after). Returns the units' names."""
    fsdp = _fsdp()
    policy = fsdp.MixedPrecisionPolicy(param_dtype=spec.param_dtype, reduce_dtype=torch.float32)
    chosen = units(model, spec)
    for _, module in chosen:
        fsdp.fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=spec.reshard_after_forward)
    fsdp.fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=spec.reshard_after_forward or False)
    if spec.scatter_unused:
        for module in model.modules():
            if isinstance(module, fsdp.FSDPModule) and hasattr(module, "set_reduce_scatter_unused_params"):
                module.set_reduce_scatter_unused_params(True)
    return [name for name, _ in chosen]


def describe_sharding(model: nn.Module) -> str:
    """For the banner: how many ranks share each parameter, the units, this rank's parameter bytes."""
    params = list(model.parameters())
    mesh = params[0].device_mesh if params else None  # type: ignore[attr-defined]  # DTensors
    size, device = (mesh.size(), mesh.device_type) if mesh is not None else (1, "cpu")
    among = "every rank" if size == dist.get_world_size() else "the ranks of each node"
    per_rank = sum(p.to_local().numel() * p.element_size() for p in params) / 2**20  # type: ignore[attr-defined]
    units = len(fsdp_modules(model)) - 1
    return (
        f"FSDP2 on a 1-D {device} mesh of {size} rank(s) ({among}), {units} unit(s) + the root, {per_rank:.2f} MB of "
        "parameters a rank"
    )


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    fsdp = _fsdp()
    return [m for m in model.modules() if isinstance(m, fsdp.FSDPModule)]


@contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Backward passes that accumulate (unsharded, in fp32) without reduce-scatter nor the cross-node stage."""
    model.set_requires_gradient_sync(False)  # type: ignore[operator]  # (an FSDPModule's)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]


def _own_params(module: nn.Module, fsdp: Any) -> list[nn.Parameter]:
    """The parameters ``module``'s own FSDP unit manages (not those of nested units), in FSDP2's order: its modules
    depth first, each module's own parameters after its children's (torch's ``_get_managed_modules``: an attention
    holding its own weight and an ``out_proj`` lays the latter out first)."""
    visited: set[int] = set()  # modules (one shared by two parents: once)
    seen: set[int] = set()  # parameters
    own: list[nn.Parameter] = []

    def visit(m: nn.Module) -> None:
        visited.add(id(m))
        for child in m.children():
            if id(child) not in visited and not isinstance(child, fsdp.FSDPModule):
                visit(child)
        for p in m.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                own.append(p)

    visit(module)
    return own


class _Unit:
    """One FSDP unit's shard layout in its hook's flat buffer: (offset, local shape, key) of each parameter."""

    def __init__(self, module: nn.Module, keys: dict[int, int], fsdp: Any) -> None:
        self.params = [p for p in _own_params(module, fsdp) if p.requires_grad]
        self.slots: list[tuple[int, torch.Size, int]] = []
        at = 0
        for p in self.params:
            local = p.to_local().shape  # type: ignore[attr-defined]  # a DTensor
            s = p.device_mesh.size()  # type: ignore[attr-defined]
            rows = -(-p.shape[0] // s) if p.dim() else 1
            self.slots.append((at, local, keys[id(p)]))
            at += rows * (p.numel() // p.shape[0] if p.dim() and p.shape[0] else 1)
        self.numel = at
        self.checked: Optional[torch.Tensor] = None  # the first buffer: its layout is checked against the grads

    def matrices(self, t: torch.Tensor) -> list[Matrix]:
        """Each 2-D-or-more shard with rows, as a view into ``t`` (PowerSGD's matrices; vectors ride along)."""
        if t.numel() != self.numel:
            return []
        found = []
        for at, local, key in self.slots:
            if len(local) >= 2 and local[0] > 0:
                found.append(Matrix(t[at : at + local.numel()].view(local), key))
        return found

    def layout_holds(self) -> bool:
        """After the first synchronised backward: FSDP's ``.grad`` are the views ``matrices`` took."""
        t = self.checked
        if t is None or t.numel() != self.numel:
            return t is None
        base, size = t.data_ptr(), t.element_size()
        for p, (at, local, _) in zip(self.params, self.slots):
            grad = p.grad.to_local() if p.grad is not None else None  # type: ignore[attr-defined]
            if grad is not None and local.numel() and grad.data_ptr() != base + at * size:
                return False
        return True


class CrossNodeStage:
    """FSDP2's all-reduce hook on every unit: each shard summed across nodes (÷ nodes: FSDP averaged inside the
    node, so the result is the world's mean) by the node-first pipeline on ``Topology.across`` (``compression``
    applies there), started in the backward and waited for at its end."""

    def __init__(self, model: nn.Module, topology: Topology, compression: Compression, abort: Optional[Abort]) -> None:
        """Collective under PowerSGD (its second lane)."""
        fsdp = _fsdp()
        self.topology, self.compression, self.abort = topology, compression, abort
        keys = {id(p): i for i, p in enumerate(p for p in model.parameters() if p.requires_grad)}
        self.across = topology.across(second_lane=compression.name is Compress.powersgd)
        self.futures: list[Future] = []
        self.units: list[_Unit] = []
        self.last_wait_s = 0.0
        # the layout PowerSGD's matrices assume, checked after the first backward (nothing to check uncompressed)
        self.matrices_ok, self.layout_checked = True, compression.name is not Compress.powersgd
        for module in fsdp_modules(model):
            unit = _Unit(module, keys, fsdp)
            if unit.params:
                self.units.append(unit)
                module.set_all_reduce_hook(_weak_hook(self, unit))  # type: ignore[operator]

    def _ready(self, unit: _Unit, t: torch.Tensor) -> None:
        if not self.futures:  # this backward's first shard: a synchronised step begins
            self.compression.begin_step()
            torch.autograd.Variable._execution_engine.queue_callback(self.wait)
        if not self.layout_checked:
            unit.checked = t
        t.div_(self.topology.num_nodes)
        matrices = unit.matrices(t) if self.matrices_ok else []
        future = hierarchical_allreduce(t, self.across, self.compression, matrices)
        self.futures.append(future if self.abort is None else self.abort.abortable(future))

    def wait(self) -> None:
        """Every shard of this backward summed across nodes (autograd's final callback)."""
        start = time.perf_counter()
        futures, self.futures = self.futures, []
        for future in futures:
            future.wait()
        self.last_wait_s = time.perf_counter() - start
        if not self.layout_checked:  # the first synchronised backward: FSDP's .grad are the views PowerSGD took?
            self.layout_checked = True
            if not all(u.layout_holds() for u in self.units):
                self.matrices_ok = False  # a torch laying its buffers out otherwise: correct, matrices uncompressed
                log.warning("FSDP's gradient buffers are not laid out as expected: PowerSGD sends them uncompressed")
            for unit in self.units:
                unit.checked = None

    def close(self) -> None:
        self.across.close()


def _weak_hook(stage: CrossNodeStage, unit: _Unit) -> Any:
    """The hook, holding the stage weakly (the model outlives a round's stage when the job heals)."""
    ref = weakref.ref(stage)

    def hook(t: torch.Tensor) -> None:
        live = ref()
        if live is not None:
            live._ready(unit, t)

    return hook
