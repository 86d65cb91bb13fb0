"""The trainer's optimizer step: torch's fused kernel (what ``launcher/train/optim.py`` builds where it applies)
against the plain per-parameter loop and ``foreach``, on the end-to-end benchmark's model (6 x Linear(1024, 1024),
24 MB of parameters), one thread, interleaved; ratios to the plain step measured in the same run.

    python bench/optimizer.py [--steps 30]
"""

from __future__ import annotations

import argparse

import torch
from common import interleaved_medians, machine, run_ranks, table
from torch import nn

from launcher.config import OptimConfig
from launcher.train.optim import build_optimizer


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(6)))


def stepper(name: str, opt_name: str):  # noqa: ANN201
    net = model()
    for p in net.parameters():
        p.grad = torch.randn_like(p)
    if name == "trainer (fused)":
        optimizer = build_optimizer(OptimConfig(name=opt_name, weight_decay=1e-4), net, world_size=1)
        assert all(group["fused"] for group in optimizer.param_groups)
    else:
        cls = torch.optim.SGD if opt_name == "sgd" else torch.optim.AdamW
        kwargs = {"momentum": 0.9} if opt_name == "sgd" else {}
        optimizer = cls(net.parameters(), lr=0.1, weight_decay=1e-4, foreach=name == "foreach", **kwargs)
    return optimizer.step


def measure(_env: object, steps: int) -> list[list[str]]:
    """In one rank (the timing loop's barriers need a process group): every variant's median step."""
    torch.set_num_threads(1)
    rows = []
    for opt_name in ("sgd", "adamw"):
        names = ("plain", "foreach", "trainer (fused)")
        medians = interleaved_medians({n: stepper(n, opt_name) for n in names}, steps)
        rows += [[opt_name, n, f"{medians[n] * 1e3:.2f}", f"{medians['plain'] / medians[n]:.2f}"] for n in names]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    print(f"# optimizer step, 24 MB of parameters, one thread, {args.steps} interleaved steps (medians); {machine()}")
    print(table(["optimizer", "step", "ms", "x plain"], run_ranks(measure, 1, args.steps)))


if __name__ == "__main__":
    main()
