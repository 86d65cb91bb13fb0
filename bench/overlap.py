"""Overlap benchmark: does our reducer hide communication at its DEFAULTS where the link is the bottleneck?

    sudo python bench/overlap.py [--steps 8] [--json PATH] [--trace PREFIX]

Two network namespaces, one gloo rank each, joined by a 1 Gbit link (tbf, burst 2mbit: with a burst under ~64 KB
tbf splits every segment and the CPU becomes the bottleneck). A 6 x Linear(1024, 1024) MLP (25 MB of gradients).
The batch is calibrated so that computation (forward + backward) takes about as long as one allreduce of all
gradients ("1x"), then twice as long ("2x"). Every step is forward + backward + an SGD step (momentum). Variants
are interleaved so drift hits all alike: each takes RUN consecutive steps (timed together behind a barrier as the
slower rank's, so a tail left in flight by one step is paid by the next or by the barrier), then the next variant;
medians of the per-step times:

  compute-only   forward + backward + optimizer, no communication   -> compute_ms
  comm-only      one allreduce of a 25 MB buffer                     -> comm_ms
  no-overlap     backward, then the gradients flattened and allreduced at once
  ddp-default    torch DDP at its defaults (25 MB buckets)
  ddp-2mb        torch DDP with bucket_cap_mb=2 (hand-tuned: one bucket per layer)
  ours-backward  BucketedReducer, cap from launcher/comm/policy.py, waiting for every bucket in backward
  ours-default   BucketedReducer at the launcher's defaults: the optimizer handed over, forward overlap (each
                 bucket's update when it is reduced, the next forward waiting per layer, chunks by priority)
  side-by-side   compute-only while an unrelated 25 MB allreduce runs beside it (started with the step, waited at
                 its end): no dependency at all, so no scheduler can expose less on this machine (the contention
                 bound: computation and the link's traffic share 2 cores)

exposed_ratio = (step_ms - compute_ms) / comm_ms: 1.0 hides nothing, 0.0 hides everything.

--trace PREFIX: after the timed runs of each level, TRACED more steps of ours-default under ``comm.trace``'s
recorder, written as PREFIX-1x.json / PREFIX-2x.json (Chrome trace: chrome://tracing, ui.perfetto.dev), and a
summary per level (rank 0, medians over the steps): when the first layer's bucket (the last one sent) was reduced
after backward returned, and what the next forward waited for each bucket.
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
from common import interleaved_medians, machine, run_in_namespaces, table
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from launcher.base.env import DistEnv
from launcher.comm import Topology
from launcher.comm.policy import bucket_cap_mb, measure_link
from launcher.comm.reducer import BucketedReducer
from launcher.comm.sizes import MB
from launcher.comm.trace import Tracer, span, write_trace
from launcher.group.rendezvous import process_group
from launcher.launch.sim.netns import SimNetwork

PORT = 29613
WIDTH, DEPTH = 1024, 6
VARIANTS = (
    "compute-only",
    "comm-only",
    "side-by-side",
    "no-overlap",
    "ddp-default",
    "ddp-2mb",
    "ours-backward",
    "ours-default",
)
RUN = 4  # consecutive steps of one variant per timed repetition
TRACED = 6  # steps of ours-default recorded per level with --trace


def mlp() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(DEPTH):
        layers.append(nn.Linear(WIDTH, WIDTH))
        if i < DEPTH - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def machine_busy_s() -> float:
    """CPU seconds spent so far by all cores on anything but idling (user, system, interrupts, soft interrupts)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def step_fn(model: nn.Module, x: torch.Tensor, step, after_backward=None, steps: int = RUN):
    """``steps`` training steps; ``step`` is the optimizer's (or the reducer's) step."""

    def run() -> None:
        for _ in range(steps):
            for p in model.parameters():
                p.grad = None
            model(x).pow(2).mean().backward()
            if after_backward is not None:
                after_backward()
            step()

    return run


def worker(args: argparse.Namespace) -> None:
    env = DistEnv.resolve()
    torch.set_num_threads(1)
    device = torch.device("cpu")
    with process_group(env, "gloo", timeout_s=600), Topology.build(env) as topo:
        plain = mlp()
        params = list(plain.parameters())
        model_bytes = sum(p.numel() * p.element_size() for p in params)
        flat = torch.zeros(model_bytes // 4)
        plain_opt = sgd(plain)

        def comm_only() -> None:
            for _ in range(RUN):
                dist.all_reduce(flat)

        # calibrate: seconds per sample of forward + backward, and one allreduce of all gradients
        def median_of(fn, reps=5) -> float:
            times = []
            for _ in range(reps):
                dist.barrier()
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            t = torch.tensor([statistics.median(times)], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return t.item()

        probe_batch = 64
        per_sample = median_of(step_fn(plain, torch.randn(probe_batch, WIDTH), plain_opt.step, steps=1)) / probe_batch
        comm_s = median_of(comm_only) / RUN
        # the CPU-work bound: CPU seconds one allreduce costs the machine (both ranks' gloo threads: sums, copies,
        # TCP; the kernel's veth and tbf work in soft interrupts), from /proc/stat (the namespaces share this host)
        dist.barrier()
        busy0, cpu0 = machine_busy_s(), time.process_time()
        comm_only()
        cpu = torch.tensor([(machine_busy_s() - busy0) / RUN, (time.process_time() - cpu0) / RUN], dtype=torch.float64)
        dist.broadcast(cpu, src=0)
        comm_cpu_s, comm_process_cpu_s = cpu.tolist()
        link = measure_link(topo, False, device)  # what the trainer measures at start-up
        cap = bucket_cap_mb(link, model_bytes)

        def side_by_side(compute) -> Callable[[], None]:
            def run() -> None:
                for _ in range(RUN):
                    work = dist.all_reduce(flat, async_op=True)
                    compute()
                    work.wait()

            return run

        def no_overlap() -> None:
            grads = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(grads)

        results = []
        for factor in (1, 2):
            batch = max(1, round(factor * comm_s / per_sample))
            for _ in range(2):  # compute does not scale exactly with the batch: measure where we land, rescale
                landed = median_of(step_fn(plain, torch.randn(batch, WIDTH), plain_opt.step, steps=1), reps=3)
                batch = max(1, round(batch * factor * comm_s / landed))
            x = torch.randn(batch, WIDTH, generator=torch.Generator().manual_seed(1))
            ddp_default = DistributedDataParallel(mlp())
            ddp_2mb = DistributedDataParallel(mlp(), bucket_cap_mb=2)
            back_model, ours_model = mlp(), mlp()
            back_opt, ours_opt = sgd(back_model), sgd(ours_model)
            policy = {"bucket_cap_mb": cap, "first_bucket_mb": min(1.0, cap)}
            back = BucketedReducer(back_model, topo, optimizer=back_opt, overlap="backward", **policy)
            ours = BucketedReducer(ours_model, topo, optimizer=ours_opt, **policy)
            assert ours.overlap == "forward", ours.describe()
            variants = {
                "compute-only": step_fn(plain, x, plain_opt.step),
                "comm-only": comm_only,
                "side-by-side": side_by_side(step_fn(plain, x, plain_opt.step, steps=1)),
                "no-overlap": step_fn(plain, x, plain_opt.step, no_overlap),
                "ddp-default": step_fn(ddp_default, x, sgd(ddp_default).step),
                "ddp-2mb": step_fn(ddp_2mb, x, sgd(ddp_2mb).step),
                "ours-backward": step_fn(back_model, x, back.step),
                "ours-default": step_fn(ours_model, x, ours.step),
            }
            medians = {k: v / RUN for k, v in interleaved_medians(variants, args.steps).items()}
            compute_ms, comm_ms = medians["compute-only"] * 1e3, medians["comm-only"] * 1e3
            for name in VARIANTS:
                step_ms = medians[name] * 1e3
                vs_ddp = medians[name] / medians["ddp-2mb"]
                results.append(
                    {
                        "variant": name,
                        "batch": batch,
                        "factor": factor,
                        "step_ms": step_ms,
                        "compute_ms": compute_ms,
                        "comm_ms": comm_ms,
                        "exposed_ratio": (step_ms - compute_ms) / comm_ms,
                        "step_vs_ddp_2mb": vs_ddp,
                        "comm_cpu_ms": comm_cpu_s * 1e3,
                        "comm_process_cpu_ms": comm_process_cpu_s * 1e3,
                    }
                )
            if args.trace:
                results[-1]["trace"] = trace_steps(env.rank, ours_model, ours, x, f"{args.trace}-{factor}x.json")
            ours.flush()
            ours.close()
            back.close()
        if env.rank == 0:
            print(
                json.dumps(
                    {"rows": results, "policy": {"cap_mb": cap, "link": link.describe(), "layout": ours.describe()}}
                )
            )


def trace_steps(rank: int, model: nn.Module, reducer: BucketedReducer, x: torch.Tensor, path: str) -> dict:
    """TRACED steps of ``model`` under the recorder, both ranks' events merged into ``path`` by rank 0; rank 0's
    summary: per step, ms from backward's return to the end of the last bucket's last chunk, and ms the next
    forward waited for each bucket (medians)."""
    tracer = Tracer(rank)
    dist.barrier()
    with tracer.activate():
        for _ in range(TRACED):
            for p in model.parameters():
                p.grad = None
            with span("forward", "step"):
                loss = model(x).pow(2).mean()
            with span("backward", "step"):
                loss.backward()
            with span("optimizer", "step"):
                reducer.step()
        reducer.flush()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, tracer.trace_events())
    if rank != 0:
        return {}
    write_trace(path, everyone)
    mine = [e for e in tracer.events if e["ph"] == "X"]
    last = f"bucket {len(reducer.buckets) - 1}"
    returns = [e["ts"] + e["dur"] for e in mine if e["name"] == "backward"]
    forwards = [e for e in mine if e["name"] == "forward"]
    after: list[float] = []
    waits: dict[str, list[float]] = {}
    for step, returned in enumerate(returns[:-1]):  # each but the last: its next forward is traced too
        ends = [e["ts"] + e["dur"] for e in mine if e["name"] == last and e["ts"] < returned]
        after.append(max(0.0, max(ends, default=returned) - returned) / 1e3)
        begin, finish = forwards[step + 1]["ts"], forwards[step + 1]["ts"] + forwards[step + 1]["dur"]
        for e in mine:
            if e["name"].startswith("await bucket") and begin <= e["ts"] < finish:
                waits.setdefault(e["name"].removeprefix("await "), []).append(e["dur"] / 1e3)
    return {
        "path": path,
        "last_bucket_done_after_backward_ms": statistics.median(after),
        "forward_waited_ms": {  # a step that waited for nothing counts as 0
            k: statistics.median(v + [0.0] * (len(after) - len(v))) for k, v in sorted(waits.items())
        },
    }


def run(args: argparse.Namespace) -> dict:
    trace = ["--trace", str(args.trace.resolve())] if args.trace else []
    with SimNetwork(2, netns=True, link_gbit=1.0, burst="2mbit") as net:
        return run_in_namespaces(
            net, [(0, 0), (1, 0)], 1, PORT, [__file__, "--worker", "--steps", str(args.steps), *trace]
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help=f"timed runs of {RUN} steps per variant")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--trace", type=Path, help="write ours-default's timelines as PREFIX-1x.json, PREFIX-2x.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if os.geteuid() != 0:
        raise SystemExit("bench/overlap.py creates network namespaces: run it as root (sudo)")
    result = run(args)
    rows = result["rows"]
    print(
        f"# overlap benchmark: 2 namespaces x 1 gloo rank, 1 Gbit tbf burst 2mbit, {DEPTH} x Linear({WIDTH}, "
        f"{WIDTH}) ({WIDTH * WIDTH * DEPTH * 4 / MB:.0f} MB of gradients), {args.steps} interleaved runs of {RUN} "
        f"steps (medians); {machine()}"
    )
    print(
        f"# our defaults: cap {result['policy']['cap_mb']:.2f} MB ({result['policy']['link']}): "
        f"{result['policy']['layout']}"
    )
    cpu_ms, comm_ms = rows[0]["comm_cpu_ms"], rows[0]["comm_ms"]
    print(
        f"# CPU work of one allreduce of all gradients: {cpu_ms:.0f} ms of machine CPU time (of which "
        f"{rows[0]['comm_process_cpu_ms']:.0f} ms in rank 0's process; the rest: the other rank, the kernel's veth "
        f"and tbf). With both cores computing, half of it delays each rank's computation: exposed / comm >= "
        f"{cpu_ms / 2 / comm_ms:.2f} (the CPU-work bound)"
    )
    print(
        table(
            ["compute", "batch", "variant", "step ms", "/ ddp-2mb", "compute ms", "comm ms", "exposed / comm"],
            [
                [
                    f"{r['factor']}x comm",
                    r["batch"],
                    r["variant"],
                    r["step_ms"],
                    r["step_vs_ddp_2mb"],
                    r["compute_ms"],
                    r["comm_ms"],
                    r["exposed_ratio"],
                ]
                for r in rows
            ],
        )
    )
    for r in rows:
        if r.get("trace"):
            t = r["trace"]
            waited = ", ".join(f"{k} {v:.1f}" for k, v in t["forward_waited_ms"].items()) or "nothing"
            print(
                f"# trace {r['factor']}x ({t['path']}; rank 0, medians of {TRACED - 1} steps): the last bucket reduced "
                f"{t['last_bucket_done_after_backward_ms']:.1f} ms after backward returned; the next forward waited "
                f"(ms) for {waited}"
            )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "rows": [
                        {
                            k: r[k]
                            for k in (
                                "factor",
                                "variant",
                                "batch",
                                "step_ms",
                                "step_vs_ddp_2mb",
                                "compute_ms",
                                "comm_ms",
                                "exposed_ratio",
                                "comm_cpu_ms",
                                "comm_process_cpu_ms",
                            )
                        }
                        for r in rows
                    ]
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
