"""What crosses nodes, counted (docs/performance.md, README): on 2 virtual nodes x 2 gloo ranks, every byte each
rank hands to a collective during training steps, by the group it goes to, under each ``comm.compress``, in both
engines (our bucketed reducer, torch DDP through our hook). Only the leaders send across nodes, on the inter-node
groups; bf16 sends half the bytes uncompressed sends there and the same inside a node; PowerSGD sends each
weight matrix as its two rank-r factors, inside a node too (factor first), vectors as they are. And
``comm.compress=auto``'s choice from the launcher's own link probe, on links of a known rate."""

import threading

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from harness.ranks import spawn_ranks, virtual_env
from launcher.comm import Topology
from launcher.comm.collectives import AbortableHook, abortable_hook
from launcher.comm.compress import build_compression
from launcher.comm.reducer import BucketedReducer
from launcher.group.abort import Abort

STEPS, RANK = 3, 4
# the model's weights (out, in) and biases; elements a step: 26122 as they are; under PowerSGD rank 4 each weight
# crosses as two factors, 4 x (out + in): 768 + 1024 + 552, and the 266 bias elements ride along: 2610 (10.0x less)
SHAPES = [(128, 64), (128, 128), (10, 128)]
WHOLE = sum(n * m + n for n, m in SHAPES)
FACTORED = sum(RANK * (n + m) + n for n, m in SHAPES)


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for n, m in SHAPES:
        layers += [nn.Linear(m, n), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class Counted:
    """Bytes each collective of torch.distributed moves from this rank during ``counting``, by group: ``inter``
    (this rank's inter-node groups, every lane's), ``intra`` (its node's), ``other``."""

    def __init__(self, topology: Topology) -> None:
        self.topology, self.on, self.lock = topology, False, threading.Lock()
        self.bytes = {"inter": 0, "intra": 0, "other": 0}
        self.real = {name: getattr(dist, name) for name in ("all_reduce", "reduce", "broadcast")}
        for name, real in self.real.items():
            setattr(dist, name, self._counting(real))

    def _counting(self, real):
        def collective(tensor, *args, group=None, **kwargs):
            if self.on:
                lanes = [self.topology.lane(i) for i in range(1 + len(self.topology.lanes))]
                inter = any(group is lane[2] for lane in lanes)
                intra = any(group is lane[0] or group is lane[1] for lane in lanes)
                where = "inter" if inter else "intra" if intra else "other"
                with self.lock:
                    self.bytes[where] += tensor.numel() * tensor.element_size()
            return real(tensor, *args, group=group, **kwargs)

        return collective

    def close(self) -> None:
        for name, real in self.real.items():
            setattr(dist, name, real)


def _bytes_across_nodes(rank, world, out_dir, per_node):
    env = virtual_env(rank, world, per_node)
    with Topology.build(env) as topo:
        counted = Counted(topo)
        results = {}
        for engine in ("reducer", "ddp-hook"):
            for mode in ("none", "bf16", "powersgd"):
                model, compression = _model(), build_compression(mode, rank=RANK, warmup_steps=0)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
                if engine == "reducer":
                    reducer = BucketedReducer(
                        model, topo, hierarchical=True, overlap="backward", optimizer=opt, compression=compression
                    )
                    wrapped, step = model, reducer.step
                else:
                    wrapped = DistributedDataParallel(model)
                    keys = {id(p): i for i, p in enumerate(model.parameters())}
                    state = AbortableHook(topo, True, Abort(), compression, keys)
                    wrapped.register_comm_hook(state, abortable_hook)
                    step = opt.step
                counted.bytes = dict.fromkeys(counted.bytes, 0)
                counted.on = True
                for i in range(STEPS):
                    gen = torch.Generator().manual_seed(100 * i + rank)
                    x, y = torch.randn(16, 64, generator=gen), torch.randint(0, 10, (16,), generator=gen)
                    nn.functional.cross_entropy(wrapped(x), y).backward()
                    step()
                    opt.zero_grad()
                if engine == "reducer":
                    reducer.flush()
                counted.on = False
                if engine == "reducer":
                    reducer.close()
                results[engine, mode] = dict(counted.bytes)
        counted.close()
    leader = env.local_rank == 0
    for engine in ("reducer", "ddp-hook"):
        none, bf16, powersgd = (results[engine, mode] for mode in ("none", "bf16", "powersgd"))
        said = f"rank {rank}, {engine}: {results}"
        assert none["other"] == bf16["other"] == powersgd["other"] == 0, said  # nothing flat, nothing else
        assert none["inter"] == (STEPS * WHOLE * 4 if leader else 0), said  # only the leaders cross nodes
        assert 2 * bf16["inter"] == none["inter"] and bf16["intra"] == none["intra"], said  # half, fp32 inside
        assert powersgd["inter"] == (STEPS * FACTORED * 4 if leader else 0), said
        assert powersgd["intra"] * WHOLE == none["intra"] * FACTORED, said  # factor first: the factors inside too


def test_bytes_across_nodes_under_each_compression(tmp_path):
    spawn_ranks(_bytes_across_nodes, 4, tmp_path, 2)


class _Sent:
    """A collective's handle, completed: what the inter-node link of ``_link_of`` returns."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.future = torch.futures.Future()
        self.future.set_result([tensor])

    def get_future(self):
        return self.future

    def wait(self):
        return True


def _auto_on_links(rank, world, out_dir):
    """On 2 nodes of one rank each, the inter-node allreduce replaced by a link of a known rate (it takes 0.1 ms +
    bytes / rate, and carries nothing): the launcher's probe (``MeasuredLinks``, as a job measures it) and its
    plan choose from what they measure."""
    import time

    from launcher.base.sync_modes import Compress, Reducer
    from launcher.comm.sizes import MB
    from launcher.comm.sync_plan import MeasuredLinks, SyncAsk, SyncWorld, plan_sync

    env = virtual_env(rank, world, 1)
    real = dist.all_reduce
    with Topology.build(env) as topo:
        # (a simulated link is only ever slower than its rate, its sleeps overshooting: bf16's is set near the top of
        # its range, 300-800 MB/s, to be chosen under load too)
        for rate_mb_s, chosen in ((100, Compress.powersgd), (700, Compress.bf16), (20_000, Compress.none)):

            def link(tensor, *args, group=None, rate=rate_mb_s * MB, **kwargs):
                if group is None or group is not topo.inter:
                    return real(tensor, *args, group=group, **kwargs)
                time.sleep(1e-4 + tensor.numel() * tensor.element_size() / rate)  # the wire, simulated
                return _Sent(tensor)

            dist.all_reduce = link
            try:
                asked = SyncAsk(reducer=Reducer.bucketed, compress=Compress.auto)
                plan = plan_sync(asked, SyncWorld(2, 2, False, 25 * MB), MeasuredLinks(topo, torch.device("cpu")))
            finally:
                dist.all_reduce = real
            assert plan.compression is chosen, (rate_mb_s, plan)
            assert plan.compression_reason.startswith("comm.compress=auto: node-first allreduce at "), plan
            measured = float(plan.compression_reason.split(" at ")[1].split(" MB/s")[0])
            assert 0.5 * rate_mb_s < measured < 1.5 * rate_mb_s or rate_mb_s > 1000, (rate_mb_s, plan)


def test_compress_auto_chooses_by_the_link_it_measures(tmp_path):
    spawn_ranks(_auto_on_links, 2, tmp_path)
