"""What docs/performance.md promises of the forward overlap beyond the contract table: the order chunks leave
in, ``flush()``, ``close()`` and the fallback's reason. One spawn of 2 gloo ranks runs every check and writes what
it saw; each test reads its part.

- Chunk order: every rank launches the same chunks in the same order, and from a bucket's event on its chunks go
  before any chunk still pooled of a bucket that became ready before it (its layers come earlier in the model,
  so the next forward needs them first).
- ``flush()``: after ``step()`` some updates wait for the next forward; the parameters read directly are then
  stale, and after ``flush()`` they equal one process's SGD steps on the global batch.
- ``close()``: the first layer's forward is ``nn.Linear``'s again and a backward no longer reaches the buckets.
- The fallback: the reducer says why it runs the backward overlap, and the trainer's banner carries it.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from harness.ranks import spawn_ranks, virtual_env
from launcher.comm import Topology
from launcher.comm.reducer import BucketedReducer
from launcher.comm.schedule import WARMUP_STEPS
from launcher.config import CommConfig
from launcher.train.sync import build_sync

WORLD, BATCH, LR = 2, 8, 0.05


def deep(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32), nn.Linear(32, 4))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(BATCH, 6, generator=gen), torch.randint(0, 4, (BATCH,), generator=gen)


def reducer_for(model, topo, opt):
    return BucketedReducer(model, topo, bucket_cap_mb=0.008, first_bucket_mb=0.002, optimizer=opt, chunk_mb=0.004)


def one_step(model, reducer, step, rank):
    x, y = batch(step, rank)
    F.cross_entropy(model(x), y).backward()
    reducer.step()


def chunk_order(topo, rank) -> dict:
    """Events and launches of every pass after the warm-up."""
    model = deep()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    reducer = reducer_for(model, topo, opt)
    log: list = []
    ready, launch = reducer.forward.bucket_ready, reducer.launch

    def logged_ready(index):
        log.append(["event", index])
        ready(index)

    def logged_launch(index, tensor, chunk=None):
        log.append(["launch", index, chunk])
        launch(index, tensor, chunk)

    reducer.forward.bucket_ready, reducer.launch = logged_ready, logged_launch
    for step in range(WARMUP_STEPS + 3):
        if step == WARMUP_STEPS:
            log.clear()
        opt.zero_grad()
        one_step(model, reducer, step, rank)
    reducer.flush()
    chunks = [len(b.chunks) for b in reducer.buckets]
    reducer.close()
    return {"log": log, "chunks": chunks, "early": reducer.early_chunks}


def flushed(topo, rank) -> dict:
    """Parameters after step() (stale: updates wait for the next forward) and after flush(), vs one process.

    In the last pass of rank ``c`` (each rank in turn) every other rank starts its backward only once ``c`` has
    read its parameters after step(): ``c``'s last buckets cannot have been reduced then, so an update is
    pending on every box, however loaded (a store key, not a sleep, orders it)."""
    model, reference = deep(), deep()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    reducer = reducer_for(model, topo, opt)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)
    store = dist.distributed_c10d._get_default_store()
    differs = lambda: max((p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))  # noqa: E731
    got: dict = {}
    for step in range(WARMUP_STEPS + WORLD):
        checker = step - WARMUP_STEPS  # the rank that checks in this pass (none in the warm-up)
        if checker >= 0 and rank != checker:
            store.wait([f"flushed-{checker}"])
        opt.zero_grad()
        one_step(model, reducer, step, rank)
        ref_opt.zero_grad()
        xs, ys = zip(*(batch(step, r) for r in range(WORLD)))
        F.cross_entropy(reference(torch.cat(xs)), torch.cat(ys)).backward()
        ref_opt.step()
        if rank == checker:
            got = {"pending": sum(b.claimed for b in reducer.buckets), "before": differs()}
            store.set(f"flushed-{checker}", "read")
        if checker >= 0:
            reducer.flush()
        if rank == checker:
            got["after"] = differs()
    return got


def closed(topo, rank) -> dict:
    model = deep()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    reducer = reducer_for(model, topo, opt)
    tail = reducer.describe()
    for step in range(WARMUP_STEPS + 1):
        opt.zero_grad()
        one_step(model, reducer, step, rank)
    reducer.flush()
    reducer.close()
    launched = reducer.launched
    opt.zero_grad()
    x, y = batch(99, rank)
    F.cross_entropy(model(x), y).backward()  # a plain local backward now: no bucket, no collective
    views = [p.grad.data_ptr() for p in model.parameters()]
    buffers = [(b.buffer.data_ptr(), b.buffer.data_ptr() + b.buffer.numel() * 4) for b in reducer.buckets]
    in_buckets = sum(lo <= v < hi for v in views for lo, hi in buffers)
    plain = model[0].forward.__func__ is nn.Linear.forward
    return {
        "tail": tail,
        "plain_forward": plain,
        "launched_after": reducer.launched - launched,
        "in_buckets": in_buckets,
    }


def fallback(topo, rank, env) -> dict:
    model = deep()
    lbfgs = BucketedReducer(model, topo, optimizer=torch.optim.LBFGS(model.parameters()))
    lbfgs.close()
    unused = BucketedReducer(model, topo, optimizer=torch.optim.SGD(model.parameters()), find_unused_parameters=True)
    unused.close()
    plain = BucketedReducer(model, topo)
    plain.close()
    banners = {}
    for name, cfg in {
        "banner_unused": CommConfig(reducer="bucketed", hierarchical="false", find_unused_parameters=True),
        "banner_ddp": CommConfig(reducer="ddp", hierarchical="false"),
    }.items():
        sync = build_sync(model, env, torch.device("cpu"), cfg, torch.optim.SGD(model.parameters(), lr=LR))
        banners[name] = sync.description
        sync.close()
    return {"lbfgs": lbfgs.describe(), "unused": unused.describe(), "plain": plain.describe(), **banners}


class Sparse(nn.Module):
    """Logits straight from a sparse embedding: its gradient's hook is the first of a backward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(20, 4, sparse=True)

    def forward(self, x):
        return self.embed((x.abs() * 3).long().clamp(max=19)).mean(1)


def sparse_backward_twice(topo, rank) -> dict:
    """A second backward through a retained graph before step(): both passes' averages add up, the sparse
    embedding's too (its reduced gradient is bound only when waited for). Reference: one process, the same two
    backward passes over the global batch."""
    model, reference = Sparse(), Sparse()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    reducer = reducer_for(model, topo, opt)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    for step in range(WARMUP_STEPS + 2):
        opt.zero_grad()
        x, y = batch(step, rank)
        loss = F.cross_entropy(model(x), y)
        loss.backward(retain_graph=True)
        loss.backward()
        reducer.step()
        ref_opt.zero_grad()
        xs, ys = zip(*(batch(step, r) for r in range(WORLD)))
        ref_loss = F.cross_entropy(reference(torch.cat(xs)), torch.cat(ys))
        ref_loss.backward(retain_graph=True)
        ref_loss.backward()
        ref_opt.step()
    reducer.flush()
    return {n: (p - q).abs().max().item() for (n, p), q in zip(model.named_parameters(), reference.parameters())}


def _all(rank, world, out_dir):
    env = virtual_env(rank, world, 1)
    with Topology.build(env) as topo:
        seen = {}
        for check in (chunk_order, flushed, closed, sparse_backward_twice):
            dist.barrier()
            seen[check.__name__] = check(topo, rank)
        seen["fallback"] = fallback(topo, rank, env)
        (out_dir / f"seen-{rank}.json").write_text(json.dumps(seen))


@pytest.fixture(scope="module")
def seen(tmp_path_factory):
    out = tmp_path_factory.mktemp("forward-overlap")
    spawn_ranks(_all, WORLD, out, timeout=120)
    return [json.loads((out / f"seen-{rank}.json").read_text()) for rank in range(WORLD)]


def test_chunks_leave_in_one_order_on_every_rank_most_urgent_first(seen):
    logs = [s["chunk_order"]["log"] for s in seen]
    assert logs[0] == logs[1], "the ranks launched different chunks or in another order"
    chunks = seen[0]["chunk_order"]["chunks"]
    assert len(chunks) >= 3 and max(chunks) >= 2, chunks  # several buckets, some in several chunks
    launched = [(entry[1], entry[2]) for entry in logs[0] if entry[0] == "launch"]
    assert sorted(launched) == sorted((i, c) for _ in range(3) for i, n in enumerate(chunks) for c in range(n))
    # in each pass, from a bucket's event until its last chunk left, no chunk of an earlier-ready (lower) bucket
    starts = [k for k, entry in enumerate(logs[0]) if entry == ["event", 0]] + [len(logs[0])]
    assert len(starts) == 4, starts  # three passes
    for first, end in zip(starts, starts[1:]):
        one_pass = logs[0][first:end]
        for at, (kind, index, *_) in enumerate(one_pass):
            later = one_pass[at + 1 :]
            ours = [k for k, entry in enumerate(later) if entry[:2] == ["launch", index]]
            if kind != "event" or not ours:  # not an event, or every chunk of it left early (the tail)
                continue
            overtaken = [e for e in later[: ours[-1]] if e[0] == "launch" and e[1] < index]
            assert not overtaken, f"bucket {index}'s chunks waited behind {overtaken}: {one_pass}"
    assert seen[0]["chunk_order"]["early"] > 0  # the first layer's chunks left before backward ended


def test_flush_applies_every_pending_update(seen):
    for rank, s in enumerate(seen):
        got = s["flushed"]
        assert got["pending"] >= 1, f"rank {rank}: no update was pending after step(); the check tests nothing"
        assert got["before"] > 1e-4, f"rank {rank}: parameters read before flush() already final: {got}"
        assert got["after"] < 1e-5, f"rank {rank}: after flush() they differ from one process's SGD: {got}"


def test_close_gives_the_first_layer_its_forward_back_and_detaches_the_buckets(seen):
    for s in seen:
        got = s["closed"]
        assert "0.weight's gradient sent as its rows are computed" in got["tail"], got["tail"]
        assert got["plain_forward"], "after close() the first layer's forward is still the reducer's"
        assert got["launched_after"] == 0 and got["in_buckets"] == 0, got


def test_the_fallback_to_the_backward_overlap_says_why(seen):
    got = seen[0]["fallback"]
    assert got["lbfgs"].endswith(", flat, backward overlap (LBFGS is not known to update each parameter on its own)"), (
        got["lbfgs"]
    )
    assert got["unused"].endswith(
        ", flat, backward overlap (find_unused_parameters: the used-parameters map comes after every bucket)"
    ), got["unused"]
    assert got["plain"].endswith(
        ", flat, backward overlap (no optimizer handed to the reducer (backward returns with averaged gradients))"
    ), got["plain"]
    # the trainer's banner (comm.* settings) carries the reason
    assert (
        "backward overlap (find_unused_parameters: the used-parameters map comes after every bucket); "
        in got["banner_unused"]
    ), got["banner_unused"]
    assert "backward overlap (comm.reducer=ddp: torch DDP waits for its buckets in backward); " in got["banner_ddp"], (
        got["banner_ddp"]
    )


def test_a_second_backward_before_step_adds_both_averages_sparse_gradients_too(seen):
    for rank, s in enumerate(seen):
        assert max(s["sparse_backward_twice"].values()) < 1e-5, f"rank {rank}: {s['sparse_backward_twice']}"
