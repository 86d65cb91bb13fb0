"""A sharded job healing in place (``comm.reducer=fsdp``, ``comm.shard=node``; launcher/train/regroup.py,
``ShardedState.regroup``, ``heal.rank_side.agree_on_state``'s lanes) on real gloo ranks, 2 virtual nodes x 2: a rank
behind takes the shards of a rank at its own place in its node, and a job whose node 1 is lost and joins again
trains on as one process would have trained it all along."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from harness.config import plan
from harness.ranks import spawn_ranks, virtual_env
from launcher.heal.protocol import Place
from launcher.heal.rank_side import Healer, HealStop, agree_on_state
from launcher.trust.secret import Secret

WORLD, PER_NODE = 4, 2
SECRET = Secret.from_hex("cd" * 32)
LANES = [0, 1, 0, 1]  # each rank's place in its node (virtual_env: node by node)


def _agree_by_lane(rank, world, out_dir):
    healer = Healer(Place(f"node-{rank // PER_NODE}"), 1.0, "gloo", SECRET)  # signed with the job's secret
    called = []

    def state():
        called.append(rank)
        return {"from": rank, "shard": torch.full((3,), float(rank))}

    def agree(steps):
        called.clear()
        top, got = agree_on_state(steps, state, healer, LANES)
        if got is not None:  # the state itself, verified and unpickled
            assert got["shard"].tolist() == [float(got["from"])] * 3, got
        return top, (None if got is None else got["from"]), list(called)

    # node 0 joins (-1: it holds nothing): each of its ranks takes the shards of node 1's rank at its own place
    top, got, sources = agree([-1, -1, 7, 7])
    assert top == 7 and got == {0: 2, 1: 3, 2: None, 3: None}[rank], (rank, got)
    assert sources == ([rank] if rank in (2, 3) else []), (rank, sources)  # called on the sources only

    # rank 1 one step behind: rank 0 is the lowest rank at step 7, but holds the other half; rank 3 sends
    top, got, sources = agree([7, 6, 7, 7])
    assert top == 7 and got == (3 if rank == 1 else None), (rank, got)
    assert sources == ([3] if rank == 3 else []), (rank, sources)  # lane 0 is all at 7: no traffic there

    # rank 0 behind: rank 1 is the lowest rank at the top, rank 2 the lowest of lane 0
    top, got, sources = agree([6, 7, 7, 7])
    assert top == 7 and got == (2 if rank == 0 else None), (rank, got)
    assert sources == ([2] if rank == 2 else []), (rank, sources)

    # lane 1 never reached step 7: no rank holds local rank 1's shards of step 7; every rank stops, as named
    with pytest.raises(HealStop) as stopped:
        agree([7, 6, 7, 6])
    assert str(stopped.value).startswith(
        "no survivor holds one whole step: the shards of local rank 1 are at step 6 at most"
    ), stopped.value
    assert not called
    # the same where lane 0 alone could be healed (rank 0 behind): every lane is checked before any traffic
    with pytest.raises(HealStop, match="the shards of local rank 1 are at step 6 at most, others at step 7"):
        agree([6, 6, 7, 6])
    assert not called
    dist.barrier()  # the group still works: nothing was half sent


def test_a_rank_behind_takes_the_shards_of_its_own_place_in_its_node(tmp_path):
    """``agree_on_state`` with lanes (each rank's local rank) on 4 gloo ranks, 2 virtual nodes x 2: a rank behind
    gets the state of the lowest rank at the top step in its own lane (not the lowest rank at the top: it holds
    other shards), the ranks already there get None, ``state`` is called on the sources only; a lane whose ranks
    never reached the top stops every rank (HealStop) before any traffic."""
    spawn_ranks(_agree_by_lane, WORLD, tmp_path)


# The heal, end to end at rank level
MAX_STEPS, HEAL_AT, PER_RANK, STEPS_PER_EPOCH, SCHEDULE_STEPS = 4, 2, 4, 100, 6
JOB = (
    "model=mlp",
    "model.hidden=25",  # odd: the second rank of a node holds 12 rows of a hidden layer, the first 13
    "data.image_size=6",
    "comm.reducer=fsdp",
    "comm.shard=node",
    "comm.fsdp_min_params=1",  # every Linear a unit of its own, and the root
    f"cluster.procs_per_node={WORLD}",
    f"train.max_steps={MAX_STEPS}",
    "optim.lr=0.2",
    "optim.momentum=0.9",
    "optim.scheduler=cosine",  # a schedule that moves: a joining rank must take its position
    f"optim.schedule_steps={SCHEDULE_STEPS}",
)


def _global_batch(step, job):
    """Step ``step``'s global batch (rank r's rows: ``PER_RANK`` from r * PER_RANK), known to the reference."""
    g = torch.Generator().manual_seed(1000 + step)
    d = job.data
    x = torch.randn(PER_RANK * WORLD, d.channels, d.image_size, d.image_size, generator=g)
    return x, torch.randint(0, d.num_classes, (PER_RANK * WORLD,), generator=g)


def _rank_batch(step, job, rank):
    from launcher.train.batch import split

    x, y = _global_batch(step, job)
    rows = slice(PER_RANK * rank, PER_RANK * (rank + 1))
    return split([x[rows], y[rows]], job.train.labels_key)


def _train(state, sync, env, job, steps):
    for step in steps:
        state.stepper.step(sync, _rank_batch(step, job, env.rank))
        state.pos.step += 1


def _heal(rank, world, out_dir, job, swapped):
    from launcher.base.env import DistEnv
    from launcher.train.model import build_model
    from launcher.train.optim import build_optimizer
    from launcher.train.state import ShardedState
    from launcher.train.sync import build_sync
    from launcher.trust.signed import SignedStore

    device = torch.device("cpu")
    env = virtual_env(rank, world, PER_NODE)
    model = build_model(job, device)
    ShardedState.prepare(job, env, device, model)
    state = ShardedState(job, model, build_optimizer(job.optim, model, world, job.train.precision), device)
    state.shape(PER_RANK * world, STEPS_PER_EPOCH)
    sync = build_sync(state.model, env, device, job.comm, state.optimizer)
    assert sync.stage is not None  # FSDP2 inside each node, the cross-node stage across
    _train(state, sync, env, job, range(HEAL_AT))
    sync.leave()

    # node 1 is lost and answers again: its ranks start anew (a fresh model, unsharded; nothing of the job's state)
    joining = env.node_rank == 1
    if joining:
        model = build_model(job, device)
        state = ShardedState(job, model, build_optimizer(job.optim, model, world, job.train.precision), device)
    # the next round, on the keeper's (signed) store; ``swapped``: the joining node is node 0 there, the
    # survivors' ranks change (their places in their node do not)
    node = (1 - env.node_rank) if swapped else env.node_rank
    new = DistEnv(
        rank=node * PER_NODE + env.local_rank,
        local_rank=env.local_rank,
        world_size=world,
        local_world_size=PER_NODE,
        node_rank=node,
        num_nodes=world // PER_NODE,
    )
    store = SignedStore(dist.FileStore(str(out_dir / "keeper-store"), world), SECRET)
    healer = Healer(Place(f"node-{env.node_rank}"), 1.0, "gloo", SECRET, store=store, timeout_s=60, number=1)
    healer._form(new)
    assert dist.get_rank() == new.rank
    state.regroup(new, joining)  # survivors: their shards onto the new mesh; joiners: their fresh model sharded
    steps = dist_gather_steps(-1 if joining else state.pos.step)
    lanes = [r % new.local_world_size for r in range(new.world_size)]  # as InPlace.settle (by_place)
    top, sent = agree_on_state(steps, lambda: state.state_dict(new, sync), healer, lanes)
    assert top == HEAL_AT and (sent is not None) == joining, (rank, top, sent is not None)
    if sent is not None:
        assert sent["step"] == HEAL_AT and set(sent) >= {"local", "scheduler"}, sorted(sent)
        state.take(sent, joining)
    assert state.pos.step == HEAL_AT
    sync = build_sync(state.model, new, device, job.comm, state.optimizer, healed=True)
    _train(state, sync, new, job, range(HEAL_AT, MAX_STEPS))

    params, momentum = {}, {}
    for name, p in state.model.named_parameters():
        assert isinstance(p, DTensor) and p.device_mesh.size() == PER_NODE, name  # sharded inside the node
        params[name] = p.full_tensor()
        momentum[name] = state.optimizer.state[p]["momentum_buffer"].full_tensor()
    lr = state.optimizer.param_groups[0]["lr"]
    torch.save({"params": params, "momentum": momentum, "lr": lr}, out_dir / f"rank-{rank}.pt")
    sync.close()


def dist_gather_steps(step):
    steps = [None] * dist.get_world_size()
    dist.all_gather_object(steps, step)
    return steps


def _reference(job):
    """One process, no group: the same init, each step on the whole global batch, SGD with momentum, the cosine
    schedule over ``SCHEDULE_STEPS`` computed here."""
    from launcher.train.model import build_model

    model = build_model(job, torch.device("cpu"))
    o = job.optim
    optimizer = torch.optim.SGD(model.parameters(), lr=o.lr, momentum=o.momentum)
    for step in range(MAX_STEPS):
        for group in optimizer.param_groups:
            group["lr"] = _cosine(o.lr, step)
        optimizer.zero_grad()
        x, y = _global_batch(step, job)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    params = {name: p.detach() for name, p in model.named_parameters()}
    momentum = {name: optimizer.state[p]["momentum_buffer"] for name, p in model.named_parameters()}
    return params, momentum, _cosine(o.lr, MAX_STEPS)  # the learning rate of the step after the last


def _cosine(lr, step):
    return lr * 0.5 * (1.0 + math.cos(math.pi * step / SCHEDULE_STEPS))


@pytest.mark.parametrize("swapped", [False, True], ids=["same-ranks", "joiners-first"])
def test_a_sharded_job_heals_in_place_as_one_process_trains(tmp_path, swapped):
    """Node 1 of a sharded job (FSDP2 inside each node, the cross-node stage across) is lost after step 2 and
    joins again: its ranks start from a fresh, unsharded model; the survivors' shards move to the next round's mesh
    (``ShardedState.regroup``), the joiners' fresh model is sharded there, each joiner takes the shards, optimizer
    state, schedule and step of the survivor at its place in its node (``agree_on_state``'s lanes), and two more
    steps train. Every rank's final parameters and momentum buffers are those of one process training the same
    init on the whole global batch for the 4 steps; ``joiners-first``: the joining node is node 0 of the new round
    (the survivors change rank, not place)."""
    job, _ = plan(*JOB, run_dir=tmp_path / "run")
    spawn_ranks(_heal, WORLD, tmp_path, job, swapped)
    params, momentum, lr = _reference(job)
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank-{rank}.pt")
        assert got["lr"] == pytest.approx(lr, abs=1e-12), (rank, got["lr"])
        assert set(got["params"]) == set(params)
        for name in params:
            for what, expected in (("params", params), ("momentum", momentum)):
                torch.testing.assert_close(
                    got[what][name],
                    expected[name],
                    rtol=1e-5,
                    atol=1e-6,
                    msg=lambda m, r=rank, n=name, w=what: f"rank {r} {w} of {n}: {m}",
                )
