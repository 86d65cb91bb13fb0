"""Compression benchmark: what crosses nodes, compressed, against torch DDP and torch's own compression hooks.

    sudo python bench/compression.py [--link-gbit 1] [--rounds 6] [--json PATH]

Two network namespaces x 2 gloo ranks (one thread each), joined by a ``--link-gbit`` link (tbf, burst 2mbit); a
6 x Linear(1024, 1024) MLP (24 MB of gradients), batch 32 per rank, forward + backward + SGD with momentum. Every
variant has its own model and engine, built once; after WARMUP untimed steps each (compression's warm-up of
COMPRESS_WARMUP steps and the forward overlap's re-measured schedule are over by then) the variants take RUN
steps in turn, ``--rounds`` times (interleaved: drift hits all alike), each run timed behind a barrier as the
slowest rank's. Medians of the per-step times; ratios to ddp-flat measured in the same run:

  compute-only         forward + backward + step, nothing sent (the bound no sync gets past)
  ddp-flat             torch DDP at its defaults (the anchor)
  ddp-node-first       torch DDP + our node-first comm hook
  ddp-torch-bf16       torch DDP + torch's bf16_compress_hook (under another name: DDP refuses it by its name)
  ddp-torch-powersgd   torch DDP + torch's powerSGD_hook, rank 4, one bucket (it mismatches with several)
  ddp-ours-powersgd    torch DDP + our node-first hook with comm.compress=powersgd
  ours-none | ours-bf16 | ours-powersgd | ours-auto
                       our reducer at the launcher's defaults (node-first, forward overlap, cap and chunks sized
                       from the link; under PowerSGD backward overlap, 25 MB buckets) with each comm.compress
                       (ours-auto as the trainer decides: on a link where nothing is compressed, backward overlap)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from common import machine, run_in_namespaces, table
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel

from launcher.base.env import DistEnv
from launcher.base.sync_modes import Compress
from launcher.comm import Topology, hierarchical_hook
from launcher.comm.collectives import AbortableHook, abortable_hook
from launcher.comm.compress import build_compression
from launcher.comm.policy import auto_compression, bucket_cap_mb, fast_link_overlap, measure_link
from launcher.comm.reducer import BucketedReducer
from launcher.comm.sizes import DDP_BUCKET_CAP_MB, MB
from launcher.comm.strategy import choose
from launcher.group.abort import Abort
from launcher.group.rendezvous import process_group
from launcher.launch.sim.netns import SimNetwork

PORT = 29617
WIDTH, DEPTH, BATCH, RANK = 1024, 6, 32, 4
COMPRESS_WARMUP, WARMUP, RUN = 5, 12, 5
VARIANTS = (
    "compute-only",
    "ddp-flat",
    "ddp-node-first",
    "ddp-torch-bf16",
    "ddp-torch-powersgd",
    "ddp-ours-powersgd",
    "ours-none",
    "ours-bf16",
    "ours-powersgd",
    "ours-auto",
)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])


def bf16_hook(state, bucket):  # type: ignore[no-untyped-def]  # no annotations: DDP checks them as objects
    """torch's bf16_compress_hook under another name (DDP refuses the original by its name on gloo)."""
    return default_hooks.bf16_compress_hook(state, bucket)  # type: ignore[arg-type]


def build(
    name: str, topo: Topology, cap_mb: float, auto: tuple[Compress, bool]
) -> tuple[nn.Module, Callable[[], None]]:
    """(the module to call, the optimizer step) of variant ``name``."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    if name == "compute-only":
        return model, opt.step
    if name.startswith("ours-"):
        mode, hierarchical = auto if name == "ours-auto" else (Compress(name.split("-", 1)[1]), True)
        compression = build_compression(mode, RANK, COMPRESS_WARMUP)
        cap_mb = DDP_BUCKET_CAP_MB if mode is Compress.powersgd else cap_mb  # as comm/sync_plan.py sizes them
        auto_on = name == "ours-auto"  # as the plan (comm/sync_plan.py) decides
        backward = fast_link_overlap(Compress.auto, mode, topo.num_nodes) if auto_on else None
        reducer = BucketedReducer(model, topo, bucket_cap_mb=cap_mb, hierarchical=hierarchical, optimizer=opt,
                                  compression=compression, chunk_mb=cap_mb, prefer_backward=backward)  # fmt: skip
        return model, reducer.step
    ddp = DistributedDataParallel(model, bucket_cap_mb=64 if name == "ddp-torch-powersgd" else 25)
    keys = {id(p): i for i, p in enumerate(model.parameters())}
    if name == "ddp-node-first":
        ddp.register_comm_hook(topo, hierarchical_hook)
    elif name == "ddp-torch-bf16":
        ddp.register_comm_hook(None, bf16_hook)
    elif name == "ddp-torch-powersgd":
        state = torch_powersgd.PowerSGDState(None, matrix_approximation_rank=RANK, start_powerSGD_iter=COMPRESS_WARMUP)
        ddp.register_comm_hook(state, torch_powersgd.powerSGD_hook)
    elif name == "ddp-ours-powersgd":
        compression = build_compression(Compress.powersgd, RANK, COMPRESS_WARMUP)
        ddp.register_comm_hook(AbortableHook(topo, True, Abort(), compression, keys), abortable_hook)
    return ddp, opt.step


def worker(args: argparse.Namespace) -> None:
    env = DistEnv.resolve()
    torch.set_num_threads(1)
    with process_group(env, "gloo", timeout_s=600), Topology.build(env) as topo:
        link = measure_link(topo, True, torch.device("cpu"))
        model_bytes = WIDTH * (WIDTH + 1) * DEPTH * 4
        cap = bucket_cap_mb(link, model_bytes)
        # ours-auto as the trainer decides: the strategy (flat or node-first, measured), then comm.compress=auto
        choice = choose(topo, None, model_bytes // 4, torch.device("cpu"))  # the trainer probes min(model, cap)
        mode, why = auto_compression(link, flat_chosen=not choice.hierarchical)
        auto = (mode, choice.hierarchical or mode is not Compress.none)
        chosen = [name for name in VARIANTS if not args.only or name in args.only.split(",")]
        engines = {name: build(name, topo, cap, auto) for name in chosen}
        gen = torch.Generator().manual_seed(env.rank)
        x = torch.randn(BATCH, WIDTH, generator=gen)

        def steps(name: str, count: int) -> None:
            module, step = engines[name]
            for _ in range(count):
                for p in module.parameters():
                    p.grad = None
                module(x).pow(2).mean().backward()
                step()

        for name in chosen:
            steps(name, WARMUP)
        times: dict[str, list[float]] = {name: [] for name in chosen}
        for _ in range(args.rounds):
            for name in chosen:
                dist.barrier()
                start = time.perf_counter()
                steps(name, RUN)
                dist.barrier()
                t = torch.tensor([(time.perf_counter() - start) / RUN], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                times[name].append(t.item())
        if env.rank == 0:
            medians = {name: statistics.median(v) * 1e3 for name, v in times.items()}
            print(json.dumps({"step_ms": medians, "cap_mb": cap, "link": link.describe(), "auto": why}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link-gbit", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=6, help=f"timed runs of {RUN} steps per variant")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--only", default="", help="comma-separated variants (default: all; ddp-flat always)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if os.geteuid() != 0:
        raise SystemExit("bench/compression.py creates network namespaces: run it as root (sudo)")
    with SimNetwork(2, netns=True, link_gbit=args.link_gbit, burst="2mbit") as net:
        placement = [(0, 0), (0, 1), (1, 0), (1, 1)]
        only = ["--only", f"ddp-flat,{args.only}"] if args.only else []
        cmd = [__file__, "--worker", "--rounds", str(args.rounds), *only]
        result = run_in_namespaces(net, placement, 2, PORT, cmd)
    ms = result["step_ms"]
    anchor = ms["ddp-flat"]
    versus = {
        "ours-powersgd": "ddp-torch-powersgd",
        "ours-bf16": "ddp-torch-bf16",
        "ddp-ours-powersgd": "ddp-torch-powersgd",
    }
    print(
        f"# compression benchmark: 2 namespaces x 2 gloo ranks, {args.link_gbit:g} Gbit tbf burst 2mbit, {DEPTH} x "
        f"Linear({WIDTH}, {WIDTH}) ({WIDTH * WIDTH * DEPTH * 4 / MB:.0f} MB of gradients), batch {BATCH} per rank, "
        f"PowerSGD rank {RANK}, {args.rounds} interleaved runs of {RUN} steps (medians); {machine()}"
    )
    print(f"# our reducer: cap {result['cap_mb']:.2f} MB ({result['link']}); auto: {result['auto']}")
    rows = [
        [
            name,
            ms[name],
            anchor / ms[name],
            f"{ms[versus[name]] / ms[name]:.3f} vs {versus[name]}" if versus.get(name) in ms else "",
        ]
        for name in VARIANTS
        if name in ms
    ]
    print(table(["variant", "step ms", "x ddp-flat", "x torch's hook"], rows))
    if args.json:
        args.json.write_text(json.dumps({"link_gbit": args.link_gbit, **result}, indent=2))


if __name__ == "__main__":
    main()
