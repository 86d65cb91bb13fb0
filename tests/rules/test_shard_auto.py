"""Issue 60 (6.1): ``comm.shard=auto``, the default, resolved once where the job's shape is known (``JobConfig``, after
the mode filled in ``cluster.nodes`` and ``cluster.procs_per_node``): ``node`` where a node holds several ranks,
``world`` where each holds one (``node`` there sharded nothing: "each holds 1/1 of the model"). The frozen config
holds what runs; the plan's words say which and why; ``comm.compress`` and healing follow the resolved choice."""

import pytest

from harness.config import plan
from launcher.base.sync_modes import Compress, Reducer, Shard
from launcher.comm.sync_plan import SyncAsk, SyncWorld, plan_sync
from launcher.config import ConfigError
from launcher.config.load import to_yaml
from launcher.config.rules import describe_planned_sharding, heals_in_place
from launcher.engine.checks import check_heals
from launcher.engine.settings import engine_job

FSDP = ("comm.reducer=fsdp", "+cluster=sim")


@pytest.mark.parametrize(
    "shape, shard",
    [
        (("cluster.procs_per_node=1",), Shard.world),  # 2 machines x 1 rank: across them
        (("cluster.procs_per_node=2",), Shard.node),  # 2 x 2: inside each, replicated across
        (("cluster.nodes=1", "cluster.procs_per_node=2"), Shard.node),  # one node: the same either way
        (("cluster.procs_per_node=1", "comm.shard=node"), Shard.node),  # as set
        (("cluster.procs_per_node=2", "comm.shard=world"), Shard.world),
    ],
)
def test_auto_is_resolved_once_into_the_frozen_config(shape, shard):
    job, _ = plan(*FSDP, *shape)
    assert job.comm.shard is shard
    assert f"shard: {shard}" in to_yaml(job)  # (what the ranks and the checkpoints read)


def test_the_plan_says_which_and_why():
    job, launch = plan(*FSDP, "cluster.procs_per_node=1")
    said = describe_planned_sharding(job, 1)
    assert "sharding    : comm.shard=auto -> world (one rank per node" in launch.describe()
    assert said.startswith("comm.shard=auto -> world (one rank per node: sharding inside a node would leave "), said
    assert "FSDP2 over every rank: each of 2 holds 1/2 of the parameters" in said
    job, _ = plan(*FSDP, "cluster.procs_per_node=2")
    said = describe_planned_sharding(job, 2)
    assert said.startswith("comm.shard=auto -> node (2 ranks per node: sharded inside each node, replicated "), said
    assert "each holds 1/2 of the model" in said
    job, _ = plan(*FSDP, "cluster.procs_per_node=1", "comm.shard=node")  # as set: the plan points to world
    said = describe_planned_sharding(job, 1)
    assert said.startswith("FSDP2 among the 1 rank(s) of each node (each holds 1/1 of the model)"), said
    assert said.endswith("every rank holds the whole model, nothing is sharded (comm.shard=world shards it)"), said


def test_the_default_compression_is_valid_with_auto_and_a_compression_it_cannot_apply_is_refused():
    """Resolved to ``world``, a flat shard group has no cross-node stage of ours: ``comm.compress=none`` (the
    default) runs; any other is refused naming auto and both ways out. On several ranks a node it compresses."""
    assert plan(*FSDP, "cluster.procs_per_node=1")[0].comm.compress is Compress.none
    with pytest.raises(ConfigError) as refused:
        plan(*FSDP, "cluster.procs_per_node=1", "comm.compress=powersgd")
    said = str(refused.value)
    assert said.startswith("comm.compress=powersgd with comm.shard=auto, which shards across every rank here "), said
    assert "HINT: comm.compress=none (the default), or comm.shard=node (every rank a whole replica" in said
    assert plan(*FSDP, "cluster.procs_per_node=2", "comm.compress=powersgd")[0].comm.shard is Shard.node


def test_a_job_that_would_heal_with_auto_on_one_rank_a_machine_says_it_restarts_and_why():
    """``world`` (each shard on one machine) cannot heal in place: the plan's reason names auto's choice and the
    setting that heals (every machine a whole replica)."""
    shrinks = (*FSDP, "cluster.nodes=3", "cluster.min_nodes=2", "train.batch_size=12")
    heals = heals_in_place(plan(*shrinks, "cluster.procs_per_node=1")[0])
    assert not heals
    assert heals.reason.startswith("comm.shard=auto -> world (one rank per node: "), heals.reason
    assert "a lost machine takes shards no survivor holds (comm.shard=node keeps a whole replica" in heals.reason
    assert heals_in_place(plan(*shrinks, "cluster.procs_per_node=1", "comm.shard=node")[0])
    assert heals_in_place(plan(*shrinks, "cluster.procs_per_node=2")[0])  # auto -> node


def test_an_engine_made_sharded_in_a_job_that_heals_says_it_cannot_and_what_would():
    """A loop's ``Engine(reducer="fsdp")`` in a job the plan runs as one that heals (replicated, one rank a
    machine): auto is world there, so the engine refuses before building anything, naming why."""
    shrinks = (*FSDP[1:], "cluster.nodes=3", "cluster.min_nodes=2", "train.batch_size=12", "cluster.procs_per_node=1")
    job, _ = plan(*shrinks)
    assert heals_in_place(job)
    check_heals(engine_job({"reducer": "fsdp", "shard": "node"}, job))
    with pytest.raises(ValueError) as refused:
        check_heals(engine_job({"reducer": "fsdp"}, job))
    said = str(refused.value)
    assert "heals in place, but with the engine's settings it cannot: comm.shard=auto -> world (one rank per " in said
    assert "comm.shard=node keeps a whole replica on every machine: it heals in place" in said, said


def test_the_sync_plan_resolves_auto_by_the_worlds_shape():
    """Where no shape was known before the ranks ran (an ``Engine`` under plain torchrun): the world's."""
    no_links = None  # (sharded training measures nothing)
    flat = plan_sync(SyncAsk(reducer=Reducer.fsdp), SyncWorld(2, 2, False, 1 << 20), no_links)
    assert not flat.hierarchical and flat.strategy.reason.startswith("comm.shard=auto -> world: one flat shard group")
    node_first = plan_sync(SyncAsk(reducer=Reducer.fsdp), SyncWorld(2, 4, True, 1 << 20), no_links)
    assert node_first.hierarchical and node_first.strategy.reason.startswith("comm.shard=auto -> node: sharded among")


def test_an_engine_under_plain_torchrun_resolves_auto_on_its_world(monkeypatch):
    torchrun = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "x"}
    for name, value in {**torchrun, "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    assert engine_job({"reducer": "fsdp"}).comm.shard is Shard.world
    with pytest.raises(ValueError, match=r"Engine\(reducer='fsdp', compress='bf16'\): comm.compress=bf16 with comm"):
        engine_job({"reducer": "fsdp", "compress": "bf16"})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert engine_job({"reducer": "fsdp"}).comm.shard is Shard.node
