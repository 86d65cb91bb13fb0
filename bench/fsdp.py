"""Sharded training across nodes: torch's FSDP2 (flat, HSDP) and DDP against ours (FSDP2 inside a node, our stage
across nodes, launcher/comm/shard.py), at a shaped link and on unshaped namespaces.

    sudo python bench/fsdp.py [--link-gbit 1] [--rounds 6] [--json PATH] [--trainer] [--keep-gathered] [--accuracy]

Why this shape: what sharding across nodes costs is the link, so each variant is timed on unshaped namespaces (veth
+ bridge, no tbf) and at ``--link-gbit`` (tbf, burst 2mbit, as SimNetwork's) in one run, each node's first rank
switching its link's tbf between blocks (two runs one after the other drifted apart by more than some links' share
on this shared box). Link share: the shaped step minus the unshaped one. 2 namespaces x 2 gloo ranks, one thread
each, bench/compression.py's 6 x Linear(1024, 1024), batch 32 per rank, SGD with momentum (non-fused: no DTensor rule):

  torch_ddp         torch DDP at its defaults
  torch_fsdp_flat   fully_shard on each Linear, then the root, over one flat mesh of the 4 ranks
  torch_hsdp        the same on a (replicate 2, shard 2) mesh: sharded inside a node, all-reduced across (the anchor)
  ours, ours_bf16, ours_powersgd: shard_model on the node's mesh + CrossNodeStage, comm.compress none, bf16, powersgd

Every variant has its own model and engine, built once; after WARMUP untimed steps each (compression's warm-up of
COMPRESS_WARMUP steps is over by then) the variants take RUN steps in turn, unshaped then shaped, ``--rounds`` times
(interleaved: drift hits all alike), each run timed behind a barrier as the slowest rank's; medians. Bytes per
rank: the parameters, gradients and optimizer state a rank holds after a step, measured from its (local) tensors.
``--trainer``: the launcher's own job (``comm.reducer=fsdp``) too, its median step from metrics.jsonl. ``--accuracy``:
bench/compression_accuracy.py's guard under ``comm.reducer=fsdp`` (PowerSGD within 1 point over paired seeds)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from common import machine, run_in_namespaces, table
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from launcher.base.env import DistEnv
from launcher.base.sync_modes import Shard
from launcher.comm import Topology
from launcher.comm.compress import build_compression
from launcher.comm.shard import CrossNodeStage, ShardSpec, shard_mesh, shard_model
from launcher.comm.sizes import MB
from launcher.group.rendezvous import process_group
from launcher.launch.sim.netns import SimNetwork

REPO = Path(__file__).resolve().parent.parent
PORT = 29641
WIDTH, DEPTH, BATCH, RANK = 1024, 6, 32, 4
COMPRESS_WARMUP, WARMUP, RUN, TRAINER_STEPS = 5, 12, 5, 40
VARIANTS = ("torch_ddp", "torch_fsdp_flat", "torch_hsdp", "ours", "ours_bf16", "ours_powersgd")
LINKS = ("unshaped", "shaped")
BYTES = {"ddp": "torch_ddp", "flat": "torch_fsdp_flat", "hsdp": "torch_hsdp", "ours": "ours"}


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])


class Engine:
    """One variant: the module to call, its optimizer, what to close (our stage and its topology)."""

    def __init__(self, name: str, env: DistEnv, reshard: bool) -> None:
        model, self.stage, self.closers = mlp(), None, []
        self.module: nn.Module = model
        if name == "torch_ddp":
            self.module = DistributedDataParallel(model)
        elif name.startswith("torch_"):
            flat = name == "torch_fsdp_flat"
            shape = (env.world_size,) if flat else (env.num_nodes, env.local_world_size)
            mesh = init_device_mesh("cpu", shape, mesh_dim_names=("shard",) if flat else ("replicate", "shard"))
            for layer in model:
                fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
            fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        else:
            mode = name.split("_", 1)[1] if "_" in name else "none"
            spec = ShardSpec(reshard_after_forward=reshard, scatter_unused=mode == "powersgd")
            shard_model(model, shard_mesh(env, Shard.node, "cpu"), spec)
            topology = Topology.build(env)
            self.compression = build_compression(mode, rank=RANK, warmup_steps=COMPRESS_WARMUP)
            self.stage = CrossNodeStage(model, topology, self.compression, None)
            self.closers = [self.stage.close, topology.close]
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def steps(self, x: torch.Tensor, count: int) -> None:
        for _ in range(count):
            self.opt.zero_grad(set_to_none=True)
            self.module(x).pow(2).mean().backward()  # our stage's wait runs in autograd's final callback
            self.opt.step()

    def held_bytes(self) -> int:
        """Parameters + gradients + optimizer state this rank holds (a DTensor's local shard)."""
        local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
        tensors = [local(p) for p in self.opt.param_groups[0]["params"]]
        tensors += [local(p.grad) for p in self.opt.param_groups[0]["params"] if p.grad is not None]
        tensors += [local(v) for s in self.opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)


def shape_link(env: DistEnv, gbit: float | None) -> None:
    """Collective: this node's link shaped to ``gbit`` (tbf, as SimNetwork shapes it) or unshaped (None), by the
    node's first rank from inside its namespace, between barriers (nothing in flight)."""
    dist.barrier()
    if env.local_rank == 0:
        dev = ["tc", "qdisc", "replace" if gbit else "del", "dev", os.environ["GLOO_SOCKET_IFNAME"], "root"]
        tbf = ["tbf", "rate", f"{gbit}gbit", "burst", "2mbit", "latency", "50ms"] if gbit else []
        subprocess.run([*dev, *tbf], check=bool(gbit), capture_output=True)  # del: none there at first
    dist.barrier()


def worker(args: argparse.Namespace) -> None:
    env = DistEnv.resolve()
    torch.set_num_threads(1)
    chosen = [n for n in VARIANTS if not args.only or n in args.only.split(",") or n == "torch_hsdp"]  # the anchor
    with process_group(env, "gloo", timeout_s=600):
        engines = {name: Engine(name, env, not args.keep_gathered) for name in chosen}
        x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(env.rank))
        for engine in engines.values():
            engine.steps(x, WARMUP)
        extra = {}
        if "ours_powersgd" in engines:  # the shards' matrices were found and compressed (else PowerSGD sends fp32)
            engine = engines["ours_powersgd"]
            extra = {"powersgd_matrices": len(engine.compression.qs), "matrices_ok": engine.stage.matrices_ok}
        held = {key: engines[name].held_bytes() for key, name in BYTES.items() if name in engines}
        tx = Path(f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics/tx_bytes")  # the node's link sent
        times: dict[str, dict[str, list[float]]] = {link: {name: [] for name in chosen} for link in LINKS}
        sent: dict[str, dict[str, list[int]]] = {link: {name: [] for name in chosen} for link in LINKS}
        for _ in range(args.rounds):
            for link in LINKS:
                shape_link(env, args.link_gbit if link == "shaped" else None)
                for name, engine in engines.items():
                    dist.barrier()
                    before, start = int(tx.read_text()), time.perf_counter()
                    engine.steps(x, RUN)
                    dist.barrier()
                    t = torch.tensor([(time.perf_counter() - start) / RUN], dtype=torch.float64)
                    sent[link][name].append((int(tx.read_text()) - before) // RUN)
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    times[link][name].append(t.item())
        for engine in engines.values():
            for close in engine.closers:
                close()
        if env.rank == 0:
            medians = {k: {n: statistics.median(v) * 1e3 for n, v in d.items()} for k, d in times.items()}
            mb = {k: {n: statistics.median(v) / MB for n, v in d.items()} for k, d in sent.items()}
            print(json.dumps({"step_ms": medians, "node_tx_mb": mb, "bytes_per_rank": held, **extra}))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One run in unshaped namespaces, the workers shaping the link in turn: the in-process variants' figures."""
    placement = [(0, 0), (0, 1), (1, 0), (1, 1)]
    cmd = [__file__, "--worker", "--rounds", str(args.rounds), "--link-gbit", str(args.link_gbit)]
    cmd += ["--keep-gathered"] if args.keep_gathered else []
    with SimNetwork(2, netns=True, link_gbit=None) as net:
        run = run_in_namespaces(net, placement, 2, PORT, [*cmd, *(["--only", args.only] if args.only else [])])
    shaped, unshaped = run["step_ms"]["shaped"], run["step_ms"]["unshaped"]
    return {
        "link_gbit": args.link_gbit,
        "step_ms": shaped,
        "unshaped_ms": unshaped,
        "link_share_ms": {n: shaped[n] - unshaped[n] for n in shaped},
        "node_tx_mb_per_step": run["node_tx_mb"]["shaped"],
        "unshaped_node_tx_mb_per_step": run["node_tx_mb"]["unshaped"],
        "bytes_per_rank": run["bytes_per_rank"],
        **{k: v for k, v in run.items() if k.startswith(("powersgd", "matrices"))},
    }


def goals(r: dict[str, Any]) -> list[list[Any]]:
    """(goal, measured, bound, met) of issue 49 item 6, each a ratio within this run."""
    ms, share, held = r["step_ms"], r["link_share_ms"], r["bytes_per_rank"]
    rows = []

    def goal(text: str, value: float, bound: float, at_most: bool = True) -> None:
        met = value <= bound if at_most else value >= bound
        rows.append([text, value, f"{'<=' if at_most else '>='} {bound:g}", met])

    if "ours" in ms:
        goal("ours / torch_hsdp (step)", ms["ours"] / ms["torch_hsdp"], 1.05)
    if {"ours", "torch_fsdp_flat"} <= ms.keys():
        goal("torch_fsdp_flat / ours (step)", ms["torch_fsdp_flat"] / ms["ours"], 1.8, at_most=False)
    for name, step, link in (("ours_bf16", 1.2, 0.6), ("ours_powersgd", 1.4, 0.35)):
        if name in ms:
            goal(f"{name} / torch_hsdp (step)", ms[name] / ms["torch_hsdp"], round(1 / step, 3))
            goal(f"{name} / torch_hsdp (link share)", share[name] / share["torch_hsdp"], link)
    if {"ours", "ddp"} <= held.keys():
        goal("bytes ours / (ddp / 2 ranks a node)", held["ours"] / (held["ddp"] / 2), 1.05)
    return rows


def launcher_job(overrides: list[str], run_dir: Path, netns: bool, link_gbit: float, steps: int) -> dict[str, Any]:
    """One job of the launcher (2 simulated nodes x 2 ranks); its summary and train records."""
    cmd = [sys.executable, "-m", "launcher", "+cluster=sim", "cluster.nodes=2", "cluster.procs_per_node=2"]
    if netns:  # the in-process variants' model and batch, through the trainer
        cmd += f"cluster.netns=true cluster.link_gbit={link_gbit} model=mlp model.depth={DEPTH}".split()
        cmd += f"model.hidden={WIDTH} data=synthetic train.batch_size={4 * BATCH} train.max_steps={steps}".split()
        cmd += "train.log_every_steps=5 train.checkpoint_every_steps=0 train.eval_every_epochs=100".split()
        cmd += [f"comm.compress_warmup_steps={COMPRESS_WARMUP}"]
    result = subprocess.run([*cmd, *overrides, "train.plots=false", f"hydra.run.dir={run_dir}"], cwd=REPO,
                            capture_output=True, text=True)  # fmt: skip
    if result.returncode:
        raise SystemExit(f"{' '.join(cmd + overrides)} failed:\n{result.stderr[-3000:]}")
    train = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"summary": summary, "train": [r for r in train if r["kind"] == "train"]}


def trainer(args: argparse.Namespace) -> dict[str, float]:
    """The launcher's sharded job at the shaped link: the median step over the windows after step 15."""
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("none", "bf16", "powersgd"):
            keep = f"comm.reshard_after_forward={str(not args.keep_gathered).lower()}"
            job = launcher_job(["comm.reducer=fsdp", f"comm.compress={mode}", keep], Path(tmp) / mode, True,
                               args.link_gbit, TRAINER_STEPS)  # fmt: skip
            windows = [r["step_s"] for r in job["train"] if r["step"] > 15]
            found[f"trainer_fsdp_{mode}"] = statistics.median(windows) * 1e3
            print(f"# trainer comm.reducer=fsdp comm.compress={mode}: {found[f'trainer_fsdp_{mode}']:.0f} ms "
                  f"({job['summary'].get('compression', '')})", flush=True)  # fmt: skip
    return found


ACCURACY_BOUNDS = {"bf16": -0.5, "powersgd": -1.0}  # bench/compression_accuracy.py's: median paired diff, points


def accuracy(args: argparse.Namespace) -> dict[str, Any]:
    """bench/compression_accuracy.py's guard under comm.reducer=fsdp: the default job (LeNet, digits, 10 epochs) on 2
    simulated nodes x 2 ranks per seed and comm.compress; each compressed run paired with its seed's uncompressed."""
    acc: dict[str, list[float]] = {"none": [], **{mode: [] for mode in ACCURACY_BOUNDS}}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            for mode in acc:
                job = launcher_job(["comm.reducer=fsdp", f"comm.compress={mode}", f"train.seed={seed}"],
                                   Path(tmp) / f"{seed}-{mode}", False, 0, 0)  # fmt: skip
                said = job["summary"]["compression"]
                if mode != "none" and ("PowerSGD" if mode == "powersgd" else "bf16") not in said:
                    raise SystemExit(f"comm.compress={mode}: the run says it compressed nothing: {said!r}")
                acc[mode].append(100.0 * job["summary"]["test_accuracy"])
            print(f"# seed {seed}: " + ", ".join(f"{m} {a[-1]:.2f}" for m, a in acc.items()), flush=True)
    diffs = {m: [a - b for a, b in zip(acc[m], acc["none"])] for m in ACCURACY_BOUNDS}
    return {"accuracy": acc, "median_diff": {m: statistics.median(d) for m, d in diffs.items()},
            "worst_diff": {m: min(d) for m, d in diffs.items()}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link-gbit", type=float, default=1.0, help="the shaped run's link (the other: unshaped)")
    parser.add_argument("--rounds", type=int, default=6, help=f"timed runs of {RUN} steps per variant")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--only", default="", help="comma-separated variants (default: all; torch_hsdp always)")
    parser.add_argument("--trainer", action="store_true", help="the launcher's comm.reducer=fsdp jobs too")
    parser.add_argument("--accuracy", action="store_true", help="only the accuracy guard (no namespaces)")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--keep-gathered", action="store_true", help="reshard_after_forward=False (every shard)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.accuracy:
        result = accuracy(args)
        print(f"# comm.reducer=fsdp, default job, 2 simulated nodes x 2 ranks, {args.seeds} paired seeds; {machine()}")
        rows = [[m, statistics.median(result["accuracy"][m]), result["median_diff"][m], result["worst_diff"][m],
                 f">= {b} / >= -3.0", result["median_diff"][m] >= b and result["worst_diff"][m] >= -3.0]
                for m, b in ACCURACY_BOUNDS.items()]  # fmt: skip
        print(f"# none: median test accuracy {statistics.median(result['accuracy']['none']):.2f} %")
        print(table(["comm.compress", "median acc %", "median diff", "worst diff", "bounds", "within"], rows))
    else:
        if os.geteuid() != 0:
            raise SystemExit("bench/fsdp.py creates network namespaces: run it as root (sudo)")
        result = measure(args)
        if args.trainer:
            result["trainer_step_ms"] = trainer(args)
        ms, share = result["step_ms"], result["link_share_ms"]
        print(f"# sharded training: 2 namespaces x 2 gloo ranks, {args.link_gbit:g} Gbit tbf burst 2mbit vs unshaped, "
              f"{DEPTH} x Linear({WIDTH}, {WIDTH}), batch {BATCH} per rank, PowerSGD rank {RANK}, {args.rounds} "
              f"interleaved runs of {RUN} steps (medians of the slowest rank); {machine()}")  # fmt: skip
        rows = [[n, ms[n], result["unshaped_ms"][n], share[n], result["node_tx_mb_per_step"][n],
                 ms[n] / ms["torch_hsdp"], share[n] / share["torch_hsdp"]] for n in VARIANTS if n in ms]  # fmt: skip
        rows += [[n, v, "", "", "", v / ms["torch_hsdp"], ""] for n, v in result.get("trainer_step_ms", {}).items()]
        print(table(["variant", "step ms", "unshaped ms", "link ms", "node tx MB", "x hsdp", "link x hsdp"], rows))
        print("# bytes per rank (MB): " + ", ".join(f"{k} {v / MB:.1f}" for k, v in result["bytes_per_rank"].items()))
        met = goals(result)
        result["goals"] = {text: {"measured": value, "bound": bound, "met": ok} for text, value, bound, ok in met}
        print(table(["goal", "measured", "bound", "met"], met))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
