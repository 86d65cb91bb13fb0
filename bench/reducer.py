"""Reducer benchmark: our BucketedReducer against torch DDP (same model, same bucket cap) and against no overlap.

    python bench/reducer.py [--steps 10] [--batch 32] [--width 2048] [--depth 6] [--bucket-mb 25]

Two gloo ranks on loopback; a depth x Linear(width, width) MLP (6 x 2048^2 ~ 25M parameters, 100 MB of
gradients). Variants are interleaved step by step; each step is forward + backward + gradient sync, timed as the
slowest rank's, median over steps:
  compute     forward + backward, no communication
  comm        allreduce of one flat buffer as large as all gradients, no compute
  no-overlap  one bucket holding every gradient, reduced after backward ends
  ddp         torch DistributedDataParallel, bucket_cap_mb as given
  bucketed    launcher.comm.BucketedReducer, same cap (first bucket 1 MB)
  bucketed-zeroed  the same, but zero_grad(set_to_none=False): autograd adds into zeroed bucket views
exposed = step - compute (communication the step waited for).
"""

from __future__ import annotations

import argparse

import torch
from common import interleaved_medians, machine, run_ranks, table
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from launcher.comm import Topology, flat_allreduce
from launcher.comm.reducer import BucketedReducer


def make_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def bench(env, args) -> dict:
    x = torch.randn(args.batch, args.width)
    target = torch.randn(args.batch, args.width)
    with Topology.build(env) as topo:
        compute_model = make_model(args.width, args.depth)
        no_overlap_model = make_model(args.width, args.depth)
        no_overlap = BucketedReducer(no_overlap_model, topo, bucket_cap_mb=1e6, first_bucket_mb=1e6)
        ddp = DistributedDataParallel(make_model(args.width, args.depth), bucket_cap_mb=args.bucket_mb)
        views_model = make_model(args.width, args.depth)
        views = BucketedReducer(views_model, topo, bucket_cap_mb=args.bucket_mb)
        ours_model = make_model(args.width, args.depth)
        ours = BucketedReducer(ours_model, topo, bucket_cap_mb=args.bucket_mb)
        numel = sum(p.numel() for p in compute_model.parameters())
        flat = torch.zeros(numel)

        def step(module, zero):
            zero()
            F.mse_loss(module(x), target).backward()

        variants = {
            "compute": lambda: step(compute_model, lambda: compute_model.zero_grad(set_to_none=False)),
            "comm": lambda: flat_allreduce(flat).wait(),
            "no-overlap": lambda: step(no_overlap_model, no_overlap.zero_grad),
            "ddp": lambda: step(ddp, lambda: ddp.zero_grad(set_to_none=True)),
            "bucketed": lambda: step(ours_model, ours.zero_grad),
            "bucketed-zeroed": lambda: step(views_model, lambda: views.zero_grad(set_to_none=False)),
        }
        medians = interleaved_medians(variants, args.steps)
        return {"medians": medians, "params": numel, "layout": ours.describe()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    args = parser.parse_args()
    result = run_ranks(bench, 2, args)
    m = result["medians"]
    compute, comm = m["compute"], m["comm"]
    rows = []
    for name in m:
        t = m[name]
        exposed = t - compute if name not in ("compute", "comm") else None
        rows.append(
            [
                name,
                t * 1e3,
                t / m["ddp"],
                t / m["no-overlap"],
                "" if exposed is None else exposed * 1e3,
                "" if exposed is None else exposed / comm,
            ]
        )
    print(f"# reducer benchmark: 2 gloo ranks, loopback; {machine()}")
    print(
        f"# model {args.depth} x Linear({args.width}, {args.width}) = {result['params'] / 1e6:.1f}M parameters, "
        f"batch {args.batch}/rank, {args.steps} interleaved steps (medians); ours: {result['layout']}"
    )
    print(table(["variant", "step ms", "/ ddp", "/ no-overlap", "exposed ms", "exposed / comm"], rows))
    print(
        f"bucketed / ddp = {m['bucketed'] / m['ddp']:.3f}   bucketed / no-overlap = "
        f"{m['bucketed'] / m['no-overlap']:.3f}"
    )


if __name__ == "__main__":
    main()
