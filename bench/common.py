"""Shared by the benchmarks: start real ranks, time steps, print tables. Not a test helper: figures come from
these scripts only, with every ratio taken against an anchor measured in the same run."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from launcher.base.env import DistEnv  # noqa: E402
from launcher.comm.strategy import interleaved_medians as timing_loop  # noqa: E402
from launcher.group.rendezvous import process_group  # noqa: E402
from launcher.launch.ports import free_port  # noqa: E402


def _entry(fn: Callable, rank: int, world: int, per_node: int, port: int, out: Any, args: tuple) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    env = DistEnv(
        rank=rank,
        local_rank=rank % per_node,
        world_size=world,
        local_world_size=per_node,
        node_rank=rank // per_node,
        num_nodes=world // per_node,
        master_port=port,
    )
    try:
        with process_group(env, "gloo", timeout_s=600):
            result = fn(env, *args)
        if rank == 0:
            out.put(result)
    except BaseException:
        traceback.print_exc()
        out.put(None)
        raise


def rank_context() -> Any:
    """How ``run_ranks`` starts its ranks: fresh interpreters. (tests/jobs/test_bench_scripts.py forks them from
    its fork server instead, which imported torch once: the same ranks, without paying the import each.)"""
    return mp.get_context("spawn")


def run_ranks(fn: Callable, world: int, *args: Any, per_node: int | None = None) -> Any:
    """Run ``fn(env, *args)`` on ``world`` gloo ranks over loopback; return rank 0's result."""
    ctx = rank_context()
    out = ctx.SimpleQueue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=_entry, args=(fn, r, world, per_node or world, port, out, args)) for r in range(world)]
    for p in procs:
        p.start()
    result = out.get()
    for p in procs:
        p.join()
    if result is None or any(p.exitcode for p in procs):
        raise SystemExit(f"a rank failed (exit codes {[p.exitcode for p in procs]})")
    return result


def run_in_namespaces(
    net: Any, placement: Sequence[tuple[int, int]], per_node: int, port: int, cmd: Sequence[str]
) -> dict:
    """Start ``cmd`` once per rank inside its node's namespace (``placement[rank] = (node, local rank)``) with
    torchrun's variables; return the JSON object rank 0 prints last. Fails naming the exit codes."""
    import json
    import subprocess

    procs = []
    for rank, (node, local) in enumerate(placement):
        where = DistEnv(rank, local, len(placement), per_node, node, len(placement) // per_node, net.addr(0), port)
        env = {**os.environ, **where.torchrun_environ(0), "GLOO_SOCKET_IFNAME": net.ifname(node)}
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        procs.append(
            subprocess.Popen(
                [*net.prefix(node), sys.executable, *cmd],
                env=env,
                stdout=subprocess.PIPE if rank == 0 else None,
                text=True,
            )
        )
    out, _ = procs[0].communicate(timeout=600)
    codes = [p.wait(timeout=600) for p in procs]
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")
    return json.loads(out.strip().splitlines()[-1])


def interleaved_medians(variants: dict[str, Callable[[], Any]], steps: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds per variant (the slowest rank's time per step), interleaved step by step: the launcher's
    own timing loop (``launcher.comm.strategy.interleaved_medians``) on the CPU."""
    return timing_loop(variants, torch.device("cpu"), reps=steps, warmup=warmup, slowest=True)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "-|-".join("-" * w for w in widths))
    return "\n".join(lines)


def machine() -> str:
    return f"{os.cpu_count()} cores, torch {torch.__version__}, python {sys.version.split()[0]}"
