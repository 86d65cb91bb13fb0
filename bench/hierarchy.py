"""Hierarchy benchmark: flat vs node-first vs auto allreduce on 2 simulated nodes x 2 ranks (network namespaces).

    sudo python bench/hierarchy.py [--mb 25] [--reps 5] [--links unshaped,1] [--json PATH]

For each link (``--links``: unshaped veth, then tbf 1 Gbit/s burst 2mbit) and each rank layout (ranks numbered node
by node, then interleaved across nodes), four gloo ranks run in two namespaces joined by a bridge. Per variant,
repetitions are interleaved; each is timed as the slowest rank's (median). Inter-node bytes come from the veth counters
(what each node sent on its link, per allreduce). Wire bound: a node must send 2(n-1)/n * S bytes over its link
for n nodes, so at B bytes/s no allreduce beats 2(n-1)/n * S / B (n = 2: S / B).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from common import machine, run_in_namespaces, table

from launcher.base.env import DistEnv
from launcher.comm import Topology, flat_allreduce, hierarchical_allreduce
from launcher.comm.strategy import choose
from launcher.group.rendezvous import process_group
from launcher.launch.sim.netns import SimNetwork

NODES, PER_NODE = 2, 2
PORT = 29611


def worker(args: argparse.Namespace) -> None:
    env = DistEnv.resolve()
    torch.set_num_threads(1)
    net = SimNetwork(NODES, netns=True, tag=args.tag)
    with process_group(env, "gloo", timeout_s=600):
        with Topology.build(env) as topo:
            tensor = torch.ones(int(args.mb * 2**20) // 4)
            choice = choose(topo, None, tensor.numel(), torch.device("cpu"))
            ops = {
                "flat": lambda: flat_allreduce(tensor, topo.world).wait(),
                "hierarchical": lambda: hierarchical_allreduce(tensor, topo).wait(),
            }
            ops["auto"] = ops["hierarchical" if choice.hierarchical else "flat"]
            times: dict[str, list[float]] = {name: [] for name in ops}
            sent = {name: 0 for name in ops}
            for op in ops.values():
                op()  # warm-up
            for _ in range(args.reps):
                for name, op in ops.items():
                    dist.barrier()
                    before = [net.tx_bytes(n) for n in range(NODES)] if env.rank == 0 else None
                    dist.barrier()
                    start = time.perf_counter()
                    op()
                    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                    times[name].append(elapsed.item())
                    dist.barrier()
                    if before is not None:  # (rank 0)
                        after = [net.tx_bytes(n) for n in range(NODES)]
                        sent[name] += max(a - b for a, b in zip(after, before))
            if env.rank == 0:
                print(
                    json.dumps(
                        {
                            "ms": {n: statistics.median(t) * 1e3 for n, t in times.items()},
                            "bytes_per_node": {n: s / args.reps for n, s in sent.items()},
                            "auto": choice.describe(),
                        }
                    )
                )


def run_case(args: argparse.Namespace, link_gbit: float | None, interleaved: bool) -> dict:
    with SimNetwork(NODES, netns=True, link_gbit=link_gbit) as net:
        world = NODES * PER_NODE
        placement = [(r % NODES, r // NODES) if interleaved else (r // PER_NODE, r % PER_NODE) for r in range(world)]
        return run_in_namespaces(
            net,
            placement,
            PER_NODE,
            PORT,
            [__file__, "--worker", "--tag", net.tag, "--mb", str(args.mb), "--reps", str(args.reps)],
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=25.0)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--links", default="unshaped,1", help="comma-separated: unshaped, or a tbf rate in Gbit/s")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tag", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if os.geteuid() != 0:
        raise SystemExit("bench/hierarchy.py creates network namespaces: run it as root")
    size = args.mb * 2**20
    rows, records = [], []
    for link in [None if x == "unshaped" else float(x) for x in args.links.split(",")]:
        for interleaved in (False, True):
            r = run_case(args, link, interleaved)
            ms, sent = r["ms"], r["bytes_per_node"]
            best = min(ms["flat"], ms["hierarchical"])
            bound_ms = 2 * (NODES - 1) / NODES * size / (link * 125e6) * 1e3 if link else None
            for name in ("flat", "hierarchical", "auto"):
                rows.append(
                    [
                        f"{link or 'unshaped'}{' Gbit' if link else ''}",
                        "interleaved" if interleaved else "by node",
                        name,
                        ms[name],
                        ms[name] / ms["flat"],
                        ms[name] / best,
                        "" if bound_ms is None else ms[name] / bound_ms,
                        sent[name] / size,
                        sent[name] / sent["flat"] if sent["flat"] else "",
                    ]
                )
            records.append({"link_gbit": link, "interleaved": interleaved, **r})
            print(
                f"# link {link or 'unshaped'}, {'interleaved' if interleaved else 'by node'}: auto chose {r['auto']}",
                flush=True,
            )
    print(
        f"# hierarchy benchmark: {NODES} namespaces x {PER_NODE} gloo ranks, {args.mb} MB, {args.reps} interleaved "
        f"reps (medians); {machine()}"
    )
    print(
        table(
            ["link", "ranks", "variant", "ms", "/ flat", "/ best", "/ wire bound", "node bytes / S", "bytes / flat"],
            rows,
        )
    )
    if args.json:
        args.json.write_text(json.dumps({"rows": records}, indent=2))


if __name__ == "__main__":
    main()
