"""Real gloo ranks without the launcher: ``spawn_ranks`` runs a module-level function on N processes (forked from
a fork server that imported torch once), ``virtual_env`` says who shares a virtual node, ``train_layout`` trains a
frozen job on ranks laid out as virtual nodes.

A rank's function is pickled by reference (its module's name and its own): it lives in a test module, imported by
its basename in the rank (pytest puts each test file's folder on ``sys.path``, and the fork server starts with the
test process's ``sys.path``), or here."""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.forkserver as forkserver
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from harness.config import plan
from launcher.base.env import DistEnv
from launcher.base.exiting import end_process_at_exit
from launcher.group.rendezvous import process_group

RANK_TIMEOUT_S = 120


def _rank_main(
    fn: Callable, rank: int, world: int, store_path: str, out_dir: str, args: tuple, environ: dict, cwd: str
) -> None:
    os.environ.clear()  # the test's environment and directory now, as a spawned process would have them (the
    os.environ.update(environ)  # fork server's are those of its own start)
    os.chdir(cwd)
    env = DistEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world)
    try:
        # (a fork server skips a preload it cannot import without a word: every rank would pay for it again)
        assert "harness.preloaded" in sys.modules, f"the fork server did not preload {RANK_PRELOAD} (sys.path?)"
        store = dist.FileStore(store_path, world)
        with process_group(env, "gloo", timeout_s=60, store=store):
            fn(rank, world, Path(out_dir), *args)
    except BaseException:
        Path(out_dir, f"error-{rank}.txt").write_text(traceback.format_exc())
        raise
    end_process_at_exit(0)  # as the launcher's workers do (see its docstring)


# What every rank of ``spawn_ranks`` imports: loaded once by the fork server, not by each rank (torch and the
# torch._dynamo any optimizer imports cost a rank ~4 s of CPU here, more than most tests' own work)
RANK_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel", "launcher.comm.reducer"]
RANK_PRELOAD += ["harness.ranks"]  # this module: ``_rank_main``, and ``train_layout``'s rank function
RANK_PRELOAD += ["harness.preloaded"]  # last: what the preload made is frozen, never walked by a rank's collector


def _rank_context() -> Any:
    """multiprocessing's fork server, one per test process: each rank is forked from a process that imported
    ``RANK_PRELOAD`` and nothing else (no thread, no process group: fork-safe), in milliseconds."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_PRELOAD)
    # Python 3.11's fork server imports its preload before it takes the test process's sys.path (and skips a module
    # it cannot import without a word): tests/ reaches it on PYTHONPATH, for its start only
    tests = str(Path(__file__).resolve().parent.parent)
    given = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([tests, given] if given else [tests])
    try:
        forkserver.ensure_running()
    finally:
        if given is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = given
    return ctx


def spawn_ranks(fn: Callable, world: int, tmp_path: Path, *args: Any, timeout: float = RANK_TIMEOUT_S) -> None:
    """Run module-level ``fn(rank, world, out_dir, *args)`` on ``world`` real gloo ranks (FileStore, no ports).
    Fails with the failing rank's traceback; kills every rank if any is still running after ``timeout``."""
    ctx = _rank_context()
    store = tmp_path / "filestore"
    store.unlink(missing_ok=True)  # a FileStore left by earlier ranks in this directory would hand on its keys
    # every rank here is on this host: gloo listens on loopback by name, never resolving the host's name (on a host
    # named `node` that resolves nowhere, building groups stalled 5 s now and then: CI's second clone)
    environ = {"GLOO_SOCKET_IFNAME": "lo", **os.environ}
    common = (str(store), str(tmp_path), args, environ, os.getcwd())
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, *common)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errors = {
        r: (tmp_path / f"error-{r}.txt").read_text() for r in range(world) if (tmp_path / f"error-{r}.txt").exists()
    }
    if errors:
        raise AssertionError("\n".join(f"rank {r} failed:\n{tb}" for r, tb in errors.items()))
    assert not hung, f"ranks {hung} still running after {timeout}s"
    codes = [p.exitcode for p in procs]
    assert codes == [0] * world, f"exit codes {codes}"


def virtual_env(rank, world, per_node, interleaved=False):
    """rank -> DistEnv on ``world // per_node`` virtual nodes, numbered node by node or round robin."""
    nodes = world // per_node
    node, local = (rank % nodes, rank // nodes) if interleaved else (rank // per_node, rank % per_node)
    return DistEnv(
        rank=rank, local_rank=local, world_size=world, local_world_size=per_node, node_rank=node, num_nodes=nodes
    )


# ``train_layout``'s layouts (world size, ranks per virtual node) and the job it trains unless told otherwise
LAYOUTS = {"1x2": (2, 2), "1x1": (1, 1), "2x2": (4, 2), "3x1": (3, 1), "2x1": (2, 1)}
LAYOUT_JOB = ("train.max_steps=40", "train.log_every_steps=5", "model=mlp", "comm.bucket_cap_mb=0.05")


def _train_and_dump(rank, world, out_dir, per_node):
    # imported by the rank that trains, not by the fork server (``RANK_PRELOAD`` stays what it was)
    from launcher.config import load_frozen
    from launcher.train.trainer import Trainer

    job = load_frozen(out_dir / "run")
    env = virtual_env(rank, world, per_node)
    trainer = Trainer(job, env, torch.device("cpu"), "gloo")
    summary = trainer.fit()
    assert summary is not None
    torch.save(
        {"params": whole_params(trainer.state.model), "summary": summary.to_json()}, out_dir / f"params-{rank}.pt"
    )


def whole_params(model):
    """The model's state dict as plain tensors: a sharded (FSDP2) model's gathered on every rank (collective)."""
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p, DTensor) for p in model.parameters()):
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False))


def train_layout(tmp_path, layout, *overrides):
    """Freeze the job for ``layout`` and train it on real gloo ranks; every rank's results."""
    from launcher.config import freeze  # (here, not at the top: the fork server preloads this module)

    world, per_node = LAYOUTS[layout]
    run = tmp_path / "run"
    job, _ = plan(*LAYOUT_JOB, *overrides, f"cluster.procs_per_node={world}", run_dir=run)
    freeze(job)
    spawn_ranks(_train_and_dump, world, tmp_path, per_node)
    return [torch.load(tmp_path / f"params-{r}.pt") for r in range(world)]
