"""Healing in place, the head's rules without a job: the keeper's round decisions (``heal.rounds.Rounds``), a round
that loses a member while forming, and which jobs heal. The head's wait on real processes standing in for nodes,
and the real keeper process: tests/jobs/test_healing_processes.py. The whole path runs in tests/beds/test_sim.py
(node killed, node frozen) and tests/beds/test_ssh.py (the first machine's link down)."""

import pytest

from launcher.heal.protocol import Decision
from launcher.heal.rounds import Rounds

NAMES = ["node-0", "node-1", "node-2"]


def test_rounds_name_the_survivors_in_order_and_stop_below_min_nodes():
    rounds = Rounds(NAMES, min_nodes=2)
    assert rounds.lose({"node-7": "?"}, 1.0) is None  # not in the round: nothing to decide
    first = rounds.lose({"node-0": "gone"}, 5.0)
    assert first == Decision(
        round=1, members=("node-1", "node-2"), before=tuple(NAMES), lost={"node-0": "gone"}, fault_time=5.0
    )
    assert Decision.from_bytes(first.to_bytes()) == first  # what the store and the head's pipe carry
    second = rounds.lose({"node-2": "frozen", "node-0": "again"}, 6.0)  # node-0 is no longer in the round
    assert (second.round, second.members, second.lost) == (2, (), {"node-2": "frozen"})
    assert second.stop == "1 node(s) left, fewer than cluster.min_nodes=2"


def test_a_machine_that_answers_again_joins_last_and_rank_0_stays():
    rounds = Rounds(NAMES, min_nodes=1)
    rounds.lose({"node-0": "link down"}, 5.0)
    assert rounds.join("node-2", 6.0) is None  # in the round already
    back = rounds.join("node-0", 7.0, 9.5)  # its ranks started and were ready 2.5 s after the answer
    members, before = ("node-1", "node-2", "node-0"), ("node-1", "node-2")
    assert back == Decision(
        round=2, members=members, before=before, joined=("node-0",), answer_time=7.0, ready_time=9.5
    )
    assert back.grows and back.said() == "round 1 ended: node-0 joined"
    change = back.change(step=4, took=4.0)  # its first step done at 11.0: 4 s after the answer, 1.5 s after ready
    assert (change.answer_to_step_s, change.ready_to_step_s, change.fault_to_step_s) == (4.0, 1.5, None), change
    again = rounds.lose({"node-0": "gone again"}, 8.0)  # the one that joined is a member like the others
    assert (again.round, again.members, again.grows) == (3, ("node-1", "node-2"), False)


def test_a_round_that_loses_a_member_while_forming_is_left_for_the_next_decision():
    """The ranks' side: members check in on the keeper's store before their group forms; one that never comes
    (lost meanwhile) does not hold the others up until the group's timeout: the keeper's next decision does."""
    import torch.distributed as dist

    from launcher.base.env import DistEnv
    from launcher.heal.protocol import Keys, Place
    from launcher.heal.rank_side import Healer
    from launcher.trust.secret import Secret
    from launcher.trust.signed import SignedStore

    store = SignedStore(dist.HashStore(), Secret.new())
    healer = Healer(Place("node-0"), lost_after_s=1.0, backend="gloo", secret=store.secret, store=store, number=1)
    env = DistEnv(rank=0, world_size=2, local_world_size=1, num_nodes=2)
    store.set(Keys.checked_in(1, 1), "1")  # the other member arrived: the round forms
    assert healer._check_in(env) is None
    healer.number = 2
    decision = Decision(round=3, members=("node-0",), before=("node-0", "node-1"), lost={"node-1": "gone"})
    store.set(Keys.round_end(2), decision.to_bytes())  # node-1 lost before it checked in to round 2
    assert healer._check_in(env) == decision


SIM3 = ("+cluster=sim", "cluster.nodes=3", "cluster.min_nodes=2", "cluster.procs_per_node=1", "train.batch_size=48")


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (
            ("comm.reducer=bucketed", "comm.overlap=forward"),
            "comm.overlap=forward updates bucket by bucket during the next forward: no rank holds a whole step's state "
            "at any moment; HINT: comm.overlap=backward heals in place",
        ),
        (
            ("script=tests/scripts/allreduce_script.py",),
            "tests/scripts/allreduce_script.py does not use launcher.Engine: its own loop cannot go on in a new "
            "process group, so it starts again on the machines left, from its first line and its own snapshot, if it "
            "keeps one (a loop through launcher.Engine heals in place: docs/your-loop.md)",
        ),
        (("cluster.heal=false",), "cluster.heal=false"),
        (("doctor=true",), "doctor=true"),
        (("cluster.min_nodes=3",), "every machine is needed (cluster.min_nodes = cluster.nodes)"),
        (
            ("comm.reducer=fsdp", "comm.shard=world"),
            "comm.shard=world: a lost machine takes shards no survivor holds (comm.shard=node keeps a whole replica "
            "on every machine: it heals in place)",
        ),
        (
            ("comm.reducer=fsdp", "comm.shard=node", "train.checkpoint_async=true"),
            "train.checkpoint_async with comm.reducer=fsdp: a sharded write in flight holds the old round's group",
        ),
    ],
)
def test_a_job_that_does_not_heal_says_why_in_its_plan(overrides, reason):
    from harness.config import plan
    from launcher.config.rules import heals_in_place
    from launcher.launch.plan import describe_on_loss

    job, _ = plan(*SIM3, *overrides)
    heals = heals_in_place(job)
    assert not heals and heals.reason.startswith(reason), heals
    if job.cluster.may_shrink:
        how = "restart on the machines left" if job.script else "restart from the checkpoint"
        assert describe_on_loss(job) == f"{how} ({heals.reason})"


def test_a_script_heals_in_place_when_its_loop_goes_through_the_engine(tmp_path):
    """The plan tells a loop through ``launcher.Engine`` (imported any of the documented ways) from a plain loop:
    the first heals in place, the second restarts on the machines left, and the plan line says which."""
    from harness.config import plan
    from launcher.config.rules import heals_in_place, uses_engine
    from launcher.launch.plan import describe_on_loss

    job, _ = plan(*SIM3, "script=tests/scripts/engine_loop.py")
    assert heals_in_place(job) and describe_on_loss(job) == (
        "the survivors heal in place through launcher.Engine (cluster.heal)"
    )
    # the trainer's train.batch_size (64) splits over neither 3 nor 2 ranks: a script's batches are its own
    three = ("+cluster=sim", "cluster.nodes=3", "cluster.min_nodes=2", "cluster.procs_per_node=1")
    assert heals_in_place(plan(*three, "script=tests/scripts/engine_loop.py")[0])
    for source, uses in (
        ("import launcher\nengine = launcher.Engine()", True),
        ("from launcher import Engine as E", True),
        ("from launcher.engine import Engine", True),
        ("import launcher\nprint(launcher.__name__)  # Engine", False),
        ("import torch.distributed as dist\ndist.init_process_group()", False),
        ("def broken(:", False),
    ):
        script = tmp_path / "loop.py"
        script.write_text(source)
        assert uses_engine(str(script)) is uses, source
    assert not uses_engine(str(tmp_path / "missing.py"))


def test_what_heals_and_the_rules_that_keep_nccl_and_the_forward_overlap_away():
    """Healing's positive rule, and the two that depend on more than one key: the forward overlap heals when clipping
    or fp16 makes every step whole (the reducer then runs the backward overlap); GPUs (nccl) never heal."""
    import copy

    from harness.config import plan
    from launcher.config.rules import heals_in_place

    job, _ = plan(*SIM3)
    assert heals_in_place(job) and describe(job) == "the survivors heal in place (cluster.heal)"
    sharded = plan(*SIM3, "comm.reducer=fsdp", "comm.shard=node")[0]  # a whole replica on every machine
    assert heals_in_place(sharded)
    clipped, _ = plan(*SIM3, "comm.reducer=bucketed", "comm.overlap=forward", "optim.clip_grad_norm=1.0")
    assert heals_in_place(clipped)
    gpus = copy.deepcopy(job)
    gpus.cluster.gpus_per_node = 1  # (sim refuses GPUs before this rule: the rule itself)
    assert heals_in_place(gpus).reason == "nccl: healing in place is built on gloo's behaviour so far"


def describe(job) -> str:
    from launcher.launch.plan import describe_on_loss

    return describe_on_loss(job)
