"""What the job's secret costs the default job (issue 34): its step, on 2 gloo ranks over loopback, with the
launcher's collectives plain (the anchor: no secret) and signed, interleaved step by step in the same run.

What a secret changes in a training loop: the process group's store (every key namespaced, every value signed:
set-up only, no store access per step) and the object collectives (signed pickles, verified before unpickling: the
RNG states gathered for every checkpoint, ``train.checkpoint_every_steps`` = 50 by default). A step here is the
default job's (LeNet on the digits at 28x28, global batch 64: 32 per rank, torch DDP) plus, every ``--every`` steps, the
checkpoint's RNG gather; both variants run the same work but for the signature. Also printed: the one-time cost of
forming the process group through the signed store.

    .venv/bin/python bench/auth.py --blocks 10 --every 50
"""

from __future__ import annotations

import argparse
import time

import torch
from common import machine, run_ranks, table
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

from launcher.base.devices import rng_state
from launcher.base.env import DistEnv
from launcher.group.helpers import Peers
from launcher.trust.secret import Secret
from models.lenet import LeNet

SECRET_HEX = "5a" * 32


def steps(env: DistEnv, blocks: int, every: int) -> dict[str, float]:
    """Mean seconds per step of each variant: blocks of ``every`` steps (the last with the checkpoint's gather of
    every rank's RNG state), plain and signed blocks alternating (ranks in lockstep: DDP synchronises each step)."""
    torch.manual_seed(0)
    model = DistributedDataParallel(LeNet(in_channels=1, num_classes=10, image_size=28))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
    peers = {"plain": Peers(), "signed": Peers(secret=Secret.from_hex(SECRET_HEX))}
    took = {"plain": 0.0, "signed": 0.0}
    for block in range(blocks + 1):  # the first pair warms up
        order = ("plain", "signed") if block % 2 == 0 else ("signed", "plain")
        for variant in order:
            began = time.perf_counter()
            for _ in range(every):
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x), y).backward()
                opt.step()
            peers[variant].gather_object(rng_state())  # as the trainer's save (launcher/train/state.py)
            if block:
                took[variant] += time.perf_counter() - began
    return {v: t / (blocks * every) for v, t in took.items()}


def form(env: DistEnv, reps: int) -> dict[str, float]:
    """Median seconds to form a 2-rank gloo group (its rendezvous through the store) on a plain and a signed view
    of one TCPStore."""
    import statistics
    from datetime import timedelta

    import torch.distributed as dist

    from launcher.trust.signed import guard

    store = dist.TCPStore("127.0.0.1", env.master_port + 1, 2, env.rank == 0, timedelta(seconds=60))
    secret = Secret.from_hex(SECRET_HEX)
    took: dict[str, list[float]] = {"plain": [], "signed": []}
    for i in range(reps):
        for variant in ("plain", "signed"):
            view = guard(store, secret if variant == "signed" else None, f"form-{variant}-{i}")
            began = time.perf_counter()
            pg = dist.distributed_c10d.ProcessGroupGloo(view, env.rank, 2, timedelta(seconds=60))
            pg.allreduce([torch.ones(1)]).wait()  # type: ignore[attr-defined]  # gloo has it; torch's stubs do not
            took[variant].append(time.perf_counter() - began)
            del pg
    return {v: statistics.median(s) for v, s in took.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=10, help="blocks of --every steps per variant")
    parser.add_argument("--every", type=int, default=50, help="train.checkpoint_every_steps (the default job's)")
    args = parser.parse_args()
    means = run_ranks(steps, 2, args.blocks, args.every)
    formed = run_ranks(form, 2, 5)
    print(f"# {machine()}; {args.blocks} x {args.every} steps per variant, alternating; RNG gather every block")
    rows = [
        [v, 1000 * means[v], means[v] / means["plain"], 1000 * formed[v], formed[v] / formed["plain"]]
        for v in ("plain", "signed")
    ]
    print(table(["variant", "step ms (mean)", "/ plain", "form group ms", "/ plain"], rows))
    print(f"signed / plain step = {means['signed'] / means['plain']:.4f}")


if __name__ == "__main__":
    main()
