"""A sharded job (``comm.reducer=fsdp``) losing a simulated machine: with ``comm.shard=node`` every machine holds a
whole replica, so the survivors heal in place (``launcher/train/regroup.py``: the model sharded anew on the next
round's mesh, each rank's shards kept); with ``comm.shard=world`` the lost machine took shards with it, so the
survivors restart from the newest checkpoint, resharded onto fewer ranks. Both end on the trajectory of one process
trained on the same global batches."""

import json

import pytest

from harness.checks import assert_same_trajectory, final_state
from harness.jobs import HEAL_JOB
from harness.run import run_launcher
from launcher.train.dcp_index import whole_model

pytestmark = pytest.mark.slow

SHARDED = ("comm.reducer=fsdp", "cluster.procs_per_node=2", "train.log_every_steps=1")
SIM = ("+cluster=sim", "cluster.nodes=3", "cluster.min_nodes=2")


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def final_sharded_state(run_dir):
    """The last checkpoint's model, whole (a sharded checkpoint's shards read back together in this process)."""
    newest = sorted(p for p in (run_dir / "checkpoints").glob("step-*") if p.is_dir())[-1]
    return {"model": whole_model(newest)}


def test_a_sharded_job_heals_in_place_when_a_machine_is_lost(tmp_path, one_process_heal_job):
    """3 simulated nodes x 2 ranks, each node's ranks sharing the model (comm.shard=node), ``cluster.min_nodes=2``;
    node 1 is killed inside step 10's backward (its peers wait in the cross-node stage). The survivors heal in place:
    no checkpoint read, each step once, the first step after the loss within 10 s, 2 nodes x 2 ranks to the end, and
    the final model is one process's on the same global batches."""
    job = (*HEAL_JOB[:2], *HEAL_JOB[3:], *SHARDED, "train.checkpoint_every_steps=5")
    faults = "step=10,rank=2,signal=KILL,target=node,backward"
    result = run_launcher(*job, *SIM, run_dir=tmp_path, env={"LAUNCHER_FAULT": faults})
    err = result.stderr
    assert result.returncode == 0, err[-3000:]
    assert "lost machine: the survivors heal in place (cluster.heal)" in err
    assert (
        "launcher: lost node-1 (its agent was killed by SIGKILL): the survivors heal in place, continuing on 2 of 3 "
        "nodes (round 1, cluster.min_nodes=2)" in err
    ), err[-3000:]
    assert "step 9 (in memory: no checkpoint read)" in err
    assert "resumed from /" not in err and "restarting" not in err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["nodes"], summary["world_size"], summary["steps"], summary["resumed_from"]) == (2, 4, 20, None)
    (change,) = summary["membership"]
    assert (change["step"], change["how"], change["nodes_before"], change["nodes_after"]) == (9, "in place", 3, 2)
    assert 0 < change["fault_to_step_s"] <= 10, change  # typical 0.2 s
    steps = [r["step"] for r in metrics(tmp_path) if r["kind"] in ("train", "eval")]
    assert [s for s in steps if s] == list(range(1, 21)) + [20], steps  # each step once (the last: the evaluation)
    assert_same_trajectory(final_sharded_state(tmp_path), final_state(one_process_heal_job))


def test_a_job_sharded_over_every_machine_restarts_from_its_checkpoint_on_the_survivors(tmp_path, one_process_heal_job):
    """``comm.shard=world``: each shard on one rank only, so a lost machine takes shards with it; the plan says the
    job restarts from the newest checkpoint, and it does: node 1 killed at step 10, the 3-rank checkpoint of step 5
    resumed on the 2 ranks left (each reading its new shards), on to the end on the same trajectory."""
    # one rank a node (HEAL_JOB's): the shards still span the machines, each machine's its own
    job = (*HEAL_JOB, "comm.reducer=fsdp", "comm.shard=world", "train.checkpoint_every_steps=5")
    result = run_launcher(
        *job, *SIM, run_dir=tmp_path, env={"LAUNCHER_FAULT": "step=10,rank=2,signal=KILL,target=node,attempt=0"}
    )
    err = result.stderr
    assert result.returncode == 0, err[-3000:]
    assert "lost machine: restart from the checkpoint (comm.shard=world: a lost machine takes shards no survivor" in err
    assert "continuing on 2 of 3 nodes from the newest checkpoint (step 5)" in err, err[-3000:]
    assert f"resumed from {tmp_path}/checkpoints/step-00000005 at step 5" in err, err[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["nodes"], summary["world_size"], summary["steps"]) == (2, 2, 20), summary
    assert_same_trajectory(final_sharded_state(tmp_path), final_state(one_process_heal_job))
