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

``--profile`` adds, for ddp and bucketed, when each bucket's allreduce was launched and when backward returned
(ms after backward began, medians over the steps), and the main-thread time our gradient hooks took: where the
per-step difference between the two goes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
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
        profile = launch_profile(ddp, ours, ours_model, x, target, args.steps) if args.profile else None
        return {"medians": medians, "params": numel, "layout": ours.describe(), "profile": profile}


def launch_profile(ddp, ours, ours_model, x, target, steps: int) -> dict:
    """Per variant: bucket launch offsets and backward's return, ms after backward began (medians over steps);
    for ours also the main-thread ms inside the gradient hooks per step."""
    marks: list[float] = []
    hook_s = [0.0]

    def timed_allreduce(_, bucket):  # DDP's default hook, in Python, with a timestamp (4 calls per step)
        marks.append(time.perf_counter())
        fut = dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    ddp.register_comm_hook(None, timed_allreduce)
    launch, on_grad = ours.launch, ours._on_grad

    def timed_launch(*a, **k):
        marks.append(time.perf_counter())
        return launch(*a, **k)

    def timed_on_grad(param):
        t = time.perf_counter()
        on_grad(param)
        hook_s[0] += time.perf_counter() - t

    ours.launch, ours._on_grad = timed_launch, timed_on_grad
    variants = {"ddp": (ddp, lambda: ddp.zero_grad(set_to_none=True)), "bucketed": (ours_model, ours.zero_grad)}
    rows: dict[str, list[list[float]]] = {name: [] for name in variants}
    hooks: list[float] = []
    for _ in range(steps):  # interleaved, as the medians above
        for name, (module, zero) in variants.items():
            marks.clear()
            hook_s[0] = 0.0
            dist.barrier()
            begin = time.perf_counter()
            zero()
            out = F.mse_loss(module(x), target)
            start = time.perf_counter()
            out.backward()
            end = time.perf_counter()
            rows[name].append([(start - begin) * 1e3] + [(t - start) * 1e3 for t in marks] + [(end - start) * 1e3])
            if name == "bucketed":
                hooks.append(hook_s[0] * 1e3)
    result = {
        name: {"offsets": [statistics.median(col) for col in zip(*rs)], "hooks_ms": None} for name, rs in rows.items()
    }
    result["bucketed"]["hooks_ms"] = statistics.median(hooks)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--profile", action="store_true", help="bucket launch times and our hooks' cost")
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
    if result["profile"]:
        print("# profile (rank 0, medians): zero_grad + forward ms, then ms after backward began: launches | return")
        for name, p in result["profile"].items():
            before, *launches, end = p["offsets"]
            extra = f"   gradient hooks {p['hooks_ms']:.1f} ms/step" if p["hooks_ms"] is not None else ""
            print(
                f"{name:9} zero_grad+forward {before:5.1f} | launches {' '.join(f'{t:6.1f}' for t in launches)} "
                f"| returned {end:6.1f}{extra}"
            )


if __name__ == "__main__":
    main()
