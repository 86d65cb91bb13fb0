"""Your loop, our engine (issue 58, item 4): samples/s of a user's own training loop with the launcher's sync against
plain torch DDP, torch's own compression hooks and the built-in trainer, at one link.

    sudo .venv/bin/python bench/your_loop.py [--link-gbit 1] [--rounds 6] [--trainer-steps 40] [--json PATH]

Two network namespaces x 2 gloo ranks (one thread each), joined by a ``--link-gbit`` link (tbf, burst 2mbit:
bench/compression.py's machinery); the trainer's ``model=mlp model.hidden=1024 model.depth=6`` (25 MB of gradients)
on ``data=synthetic`` inputs, 32 samples per rank (128 global), SGD with momentum, cross-entropy.

Loop rows, in-process and interleaved (as bench/compression.py): every variant has its own model and optimizer, built
once by its builder (``LOOPS``, then ``engine_loops``); WARMUP untimed steps each (compression's COMPRESS_WARMUP
uncompressed steps among them), then ``--rounds`` rounds in which each variant takes RUN steps in turn, each run
timed behind a barrier as the slowest rank's; samples/s = 128 / the median step. Ratios to ``ddp-plain`` measured in
the same run:

  ddp-plain            the plain loop: torch DDP at its defaults (the anchor)
  hook-none            torch DDP + launcher.comm_hook(compress="none") (flat or node-first: measured)
  hook-bf16            torch DDP + launcher.comm_hook(compress="bf16")
  hook-powersgd        torch DDP + launcher.comm_hook(compress="powersgd"), rank 4
  torch-bf16           torch DDP + torch's bf16_compress_hook (under another name: DDP refuses it by its name)
  torch-powersgd       torch DDP + torch's PowerSGDState/powerSGD_hook, rank 4, the same warm-up, one bucket (as
                       bench/compression.py: it mismatches with several)
  engine-*             the same loop through launcher.Engine(compress=...) on the trainer's settings and optimizer
                       (fused SGD), batches from engine.loader: compared with trainer-<compress>

Job rows (``--trainer-steps``; 0: none), after the loops (bench/your_loop_jobs.py): the built-in trainer
(``trainer-<compress>``) and the same loop through the engine as a launcher job (``engine-job-<compress>``,
bench/engine_job.py), each a ``python -m launcher +cluster=sim cluster.netns=true cluster.link_gbit=...`` job on the
same settings, timed the trainer's way (the median samples/s of the 5-step windows after step 15), in pairs.
``engine-<c>`` is compared with ``hook-<c>`` (the same sync, in the same processes), ``engine-job-<c>`` with
``trainer-<c>`` (the same measurement)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from common import machine, run_in_namespaces, table
from compression import bf16_hook
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from your_loop_jobs import COMPRESSES, job_rows

from launcher.base.env import DistEnv
from launcher.comm.ddp_hook import comm_hook
from launcher.group.rendezvous import process_group
from launcher.launch.sim.netns import SimNetwork
from models.mlp import MLP

PORT = 29619
PER_RANK, WORLD, RANK = 32, 4, 4
GLOBAL = PER_RANK * WORLD
COMPRESS_WARMUP, WARMUP, RUN = 5, 12, 5
LR, MOMENTUM = 0.01, 0.9
VERSUS = {"hook-bf16": "torch-bf16", "hook-powersgd": "torch-powersgd"}  # comm_hook against torch's own hook


@dataclass
class Loop:
    """One variant: ``step()`` runs one training step of its loop (its own model, optimizer and batches);
    ``close()`` after the timing. ``note``: what it chose (printed)."""

    step: Callable[[], None]
    close: Callable[[], None] = lambda: None
    note: str = ""


@dataclass
class Ctx:
    """What every builder gets: this rank's place and a fixed batch of its own (the loader-free loops)."""

    env: DistEnv
    x: torch.Tensor = field(default_factory=lambda: torch.empty(0))
    y: torch.Tensor = field(default_factory=lambda: torch.empty(0))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return MLP(in_channels=1, image_size=28, num_classes=10, hidden=1024, depth=6)  # the trainer's model=mlp ...


def dataset(samples: int = 64 * GLOBAL) -> torch.utils.data.TensorDataset:
    """data=synthetic's kind of samples (random images, a fixed random linear teacher's labels): for loader loops."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 1, 28, 28, generator=g)
    teacher = torch.randn(28 * 28, 10, generator=g)
    return torch.utils.data.TensorDataset(x, (x.flatten(1) @ teacher).argmax(1))


def ddp_loop(ctx: Ctx, register: Callable[[DistributedDataParallel], str] | None = None, cap_mb: float = 25) -> Loop:
    """The plain loop on torch DDP; ``register(ddp)`` puts a comm hook on it (returns a note)."""
    ddp = DistributedDataParallel(mlp(), bucket_cap_mb=cap_mb)
    note = register(ddp) if register is not None else ""
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)

    def step() -> None:
        loss = F.cross_entropy(ddp(ctx.x), ctx.y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return Loop(step, note=note)


def hook_loop(compress: str) -> Callable[[Ctx], Loop]:
    def build(ctx: Ctx) -> Loop:
        states = []

        def register(ddp: DistributedDataParallel) -> str:
            state, hook = comm_hook(compress, powersgd_rank=RANK, compress_warmup_steps=COMPRESS_WARMUP, model=ddp)
            ddp.register_comm_hook(state, hook)
            states.append(state)
            return state.describe()

        loop = ddp_loop(ctx, register)
        loop.close = states[0].close
        return loop

    return build


def torch_bf16(ctx: Ctx) -> Loop:
    return ddp_loop(ctx, lambda ddp: ddp.register_comm_hook(None, bf16_hook) or "")


def torch_powersgd_loop(ctx: Ctx) -> Loop:
    def register(ddp: DistributedDataParallel) -> str:
        state = torch_powersgd.PowerSGDState(None, matrix_approximation_rank=RANK, start_powerSGD_iter=COMPRESS_WARMUP)
        ddp.register_comm_hook(state, torch_powersgd.powerSGD_hook)
        return ""

    return ddp_loop(ctx, register, cap_mb=64)


LOOPS: dict[str, Callable[[Ctx], Loop]] = {
    "ddp-plain": ddp_loop,
    "hook-none": hook_loop("none"),
    "hook-bf16": hook_loop("bf16"),
    "hook-powersgd": hook_loop("powersgd"),
    "torch-bf16": torch_bf16,
    "torch-powersgd": torch_powersgd_loop,
}


def engine_loop(compress: str) -> Callable[[Ctx], Loop]:
    """The loop as a user writes it through ``launcher.Engine`` (docs/your-loop.md), on the trainer's settings of
    ``trainer-<compress>`` (``comm.reducer=ddp``, ``comm.hierarchical=auto``, PowerSGD rank RANK after
    COMPRESS_WARMUP steps) and the optimizer the trainer builds (fused SGD with momentum): its batches from the
    engine's loader, its step in ``engine.step()`` (the stop's agreement included, as the trainer's)."""

    def build(ctx: Ctx) -> Loop:
        import itertools

        import launcher

        run_dir = tempfile.mkdtemp(prefix="your-loop-engine-")
        engine = launcher.Engine(
            compress=compress,
            reducer="ddp",
            hierarchical="auto",
            powersgd_rank=RANK,
            compress_warmup_steps=COMPRESS_WARMUP,
            checkpoint_every_steps=0,
            run_dir=run_dir,
        )
        bare = mlp()
        model, optimizer = engine.setup(bare, torch.optim.SGD(bare.parameters(), lr=LR, momentum=MOMENTUM, fused=True))
        batches = itertools.cycle(engine.loader(dataset(), batch_size=GLOBAL, shuffle=True))

        def step() -> None:
            x, y = next(batches)
            with engine.step():
                engine.backward(F.cross_entropy(model(x), y))
                optimizer.step()
                optimizer.zero_grad()

        def close() -> None:
            engine.close()
            shutil.rmtree(run_dir, ignore_errors=True)

        assert engine.sync is not None
        return Loop(step, close=close, note=engine.sync.description)

    return build


def engine_loops() -> dict[str, Callable[[Ctx], Loop]]:
    """The same loop through ``launcher.Engine``, one per ``compress`` (each compared with ``trainer-<compress>``)."""
    return {f"engine-{compress}": engine_loop(compress) for compress in ("none", "bf16", "powersgd")}


def time_loops(loops: dict[str, Loop], rounds: int) -> dict[str, float]:
    """Median seconds per step of each loop (the slowest rank's), the loops interleaved round by round."""
    for loop in loops.values():
        for _ in range(WARMUP):
            loop.step()
    times: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(rounds):
        for name, loop in loops.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(RUN):
                loop.step()
            dist.barrier()
            t = torch.tensor([(time.perf_counter() - start) / RUN], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[name].append(t.item())
    return {name: statistics.median(v) for name, v in times.items()}


def worker(args: argparse.Namespace) -> None:
    env = DistEnv.resolve()
    torch.set_num_threads(1)
    builders = {**LOOPS, **engine_loops()}
    chosen = [name for name in builders if not args.only or name in args.only.split(",") or name == "ddp-plain"]
    with process_group(env, "gloo", timeout_s=600):
        x, y = dataset(GLOBAL)[env.rank * PER_RANK : (env.rank + 1) * PER_RANK]
        ctx = Ctx(env, x, y)
        loops = {name: builders[name](ctx) for name in chosen}
        seconds = time_loops(loops, args.rounds)
        for loop in loops.values():
            loop.close()
        if env.rank == 0:
            notes = {name: loop.note for name, loop in loops.items() if loop.note}
            print(json.dumps({"step_ms": {n: s * 1e3 for n, s in seconds.items()}, "notes": notes}))


def report(args: argparse.Namespace, loops: dict, trainer: dict, wall_s: float) -> dict:
    sps = {name: GLOBAL / (ms / 1e3) for name, ms in loops["step_ms"].items()}
    sps.update({name: row["samples_per_s"] for name, row in trainer.items()})
    anchor = sps["ddp-plain"]
    versus = {**VERSUS, **{f"engine-{c}": f"hook-{c}" for c in COMPRESSES}}  # the engine on the same sync
    versus.update({f"engine-job-{c}": f"trainer-{c}" for c in COMPRESSES})  # and against the trainer's loop
    rows = [
        [name, loops["step_ms"].get(name, trainer.get(name, {}).get("step_ms", 0.0)), value, value / anchor,
         f"{value / sps[versus[name]]:.3f} vs {versus[name]}" if versus.get(name) in sps else ""]
        for name, value in sps.items()
    ]  # fmt: skip
    print(
        f"# your loop: 2 namespaces x 2 gloo ranks, {args.link_gbit:g} Gbit tbf burst 2mbit, MLP 1024 x 6 (25 MB of "
        f"gradients), {PER_RANK} samples per rank, PowerSGD rank {RANK}, compression after {COMPRESS_WARMUP} steps, "
        f"{args.rounds} interleaved runs of {RUN} steps (medians; trainer: {args.trainer_steps} steps, windows after "
        f"step 15); {machine()}; wall {wall_s:.0f} s"
    )
    for name, note in loops["notes"].items():
        print(f"# {name}: {note}")
    print(table(["variant", "step ms", "samples/s", "x ddp-plain", "x reference"], rows))
    goals = [(name, sps[name] / sps[ref], ref) for name, ref in versus.items() if name in sps and ref in sps]
    for name, ratio, ref in goals:
        bound = 0.95 if name.startswith("engine") else 1.1  # the engine within 5 %; the hook 1.1x torch's
        print(f"# goal {name} / {ref} >= {bound}: {ratio:.3f} {'met' if ratio >= bound else 'NOT met'}")
    return {"samples_per_s": sps, "x_ddp_plain": {n: v / anchor for n, v in sps.items()}, "goals": goals}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link-gbit", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=6, help=f"timed runs of {RUN} steps per loop")
    parser.add_argument("--trainer-steps", type=int, default=40, help="steps of each trainer row (0: no trainer)")
    parser.add_argument("--only", default="", help="comma-separated loops (default: all; ddp-plain always)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if os.geteuid() != 0:
        raise SystemExit("bench/your_loop.py creates network namespaces: run it as root (sudo)")
    start = time.perf_counter()
    with SimNetwork(2, netns=True, link_gbit=args.link_gbit, burst="2mbit") as net:
        placement = [(0, 0), (0, 1), (1, 0), (1, 1)]
        cmd = [__file__, "--worker", "--rounds", str(args.rounds), *(["--only", args.only] if args.only else [])]
        loops = run_in_namespaces(net, placement, 2, PORT, cmd)
    trainer = job_rows(args) if args.trainer_steps else {}
    result = report(args, loops, trainer, time.perf_counter() - start)
    if args.json:
        args.json.write_text(json.dumps({"link_gbit": args.link_gbit, **loops, "trainer": trainer, **result}, indent=2))


if __name__ == "__main__":
    main()
