"""Issue 50 (item 2): a checkpoint resumes on another layout than the one that wrote it. A sharded job
(``comm.reducer=fsdp``) stopped on 2 virtual nodes x 2 ranks goes on on 1 x 2, on 3 x 1, under ``comm.shard=world``
and as a replicated (ddp) job; one stopped on 1 x 2 goes on on 2 x 2; a ddp job's file goes on as a sharded job.
Each ends with the parameters of the run never stopped, up to float32 summation order: with plain SGD and one global
batch (48: every layout here divides it) the trajectory does not depend on the layout of ranks (each global batch is
the same samples, tests/jobs/test_parity.py), so one uninterrupted run on 2 x 2 is every resume's reference; a resume
that lost the momentum, a shard or a step would be far off it. A compressed job resumed on another layout of nodes
starts its error feedback anew and says so once. (The checks in one process: tests/rules/test_sharded_checkpoint.py.)"""

import logging
import shutil

import pytest
import torch

from harness.checks import assert_same_trajectory
from harness.config import plan
from harness.ranks import LAYOUT_JOB, LAYOUTS, _train_and_dump, spawn_ranks
from launcher.base.checkpoint_names import rank_state, sharded_path
from launcher.train import checkpoint as ckpt

pytestmark = pytest.mark.slow
FSDP = ("comm.reducer=fsdp", "comm.fsdp_min_params=1000")  # the MLP's layers each a unit
JOB = ("train.batch_size=48", "optim.schedule_steps=12", "train.checkpoint_every_steps=6", "train.threads_per_rank=1")
STOP, END = "train.max_steps=6", "train.max_steps=12"


def train(tmp_path, layout, *overrides):
    """``harness.ranks.train_layout``'s job (``JOB`` on top) on ``layout``, each rank's log lines kept in
    ``log-<rank>.txt`` (``logged``); every rank's results."""
    from launcher.config import freeze

    world, per_node = LAYOUTS[layout]
    job, _ = plan(*LAYOUT_JOB, *JOB, *overrides, f"cluster.procs_per_node={world}", run_dir=tmp_path / "run")
    freeze(job)
    spawn_ranks(_logged_rank, world, tmp_path, per_node)
    return [torch.load(tmp_path / f"params-{r}.pt") for r in range(world)]


def _logged_rank(rank, world, out_dir, per_node):
    handler = logging.FileHandler(out_dir / f"log-{rank}.txt")
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    _train_and_dump(rank, world, out_dir, per_node)


def logged(tmp_path, rank=0):
    return (tmp_path / f"log-{rank}.txt").read_text()


def same_as(result, reference):
    """Rank 0's final parameters (a sharded model's gathered) are the reference run's, up to float32 order, and so
    is the final model's held-out loss, within the issue's 1e-3."""
    assert_same_trajectory({"model": result[0]["params"]}, {"model": reference[0]["params"]})
    losses = [r[0]["summary"]["test_loss"] for r in (result, reference)]
    assert abs(losses[0] - losses[1]) < 1e-3, losses


def resume(tmp_path, stopped, layout, *overrides):
    """``stopped``'s checkpoints copied into a new run dir, resumed there on ``layout`` to step 12."""
    shutil.copytree(stopped / "run" / "checkpoints", tmp_path / "run" / "checkpoints")
    return train(tmp_path, layout, *overrides, END)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The run never stopped: 12 steps on 2 x 2, sharded."""
    return train(tmp_path_factory.mktemp("reference"), "2x2", *FSDP, END)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """The sharded job on 2 x 2, stopped at its checkpoint at step 6."""
    run = tmp_path_factory.mktemp("stopped")
    train(run, "2x2", *FSDP, STOP)
    assert sorted(p.name for p in (run / "run" / "checkpoints").iterdir()) == ["step-00000006"]
    return run


@pytest.mark.parametrize("layout", ["1x2", "3x1"])
def test_a_sharded_job_resumes_on_fewer_ranks_and_nodes(tmp_path, reference, stopped, layout):
    resumed = resume(tmp_path, stopped, layout, *FSDP)
    saved = sharded_path(stopped / "run" / "checkpoints", 6)
    assert resumed[0]["summary"]["resumed_from"] == str(tmp_path / "run" / "checkpoints" / saved.name)
    world = LAYOUTS[layout][0]
    assert f"resuming a 4-rank checkpoint on {world} ranks: global batch 48 as before" in logged(tmp_path)
    same_as(resumed, reference)


def test_a_sharded_job_resumes_on_more_ranks_and_nodes(tmp_path, reference):
    train(tmp_path / "stopped", "1x2", *FSDP, STOP)
    resumed = resume(tmp_path / "resumed", tmp_path / "stopped", "2x2", *FSDP)
    assert "resuming a 2-rank checkpoint on 4 ranks" in logged(tmp_path / "resumed")
    same_as(resumed, reference)


def test_a_job_sharded_within_nodes_resumes_sharded_over_the_world(tmp_path, reference, stopped):
    resumed = resume(tmp_path, stopped, "2x2", *FSDP, "comm.shard=world")
    assert "on another layout (comm.shard=node wrote it, this job shards with comm.shard=world)" in logged(tmp_path)
    same_as(resumed, reference)


@pytest.mark.parametrize("reducer,layout", [("ddp", "1x2"), ("bucketed", "2x2")])
def test_a_sharded_checkpoint_resumes_in_a_replicated_job(tmp_path, reference, stopped, reducer, layout):
    """Every rank reads the whole model and optimiser from the shards. On the same world size (2 x 2) too, the
    sharded job's sync choices are not kept (its bucket cap was FSDP's 0, its node-first stage no measured choice)."""
    resumed = resume(tmp_path, stopped, layout, f"comm.reducer={reducer}", "comm.bucket_cap_mb=null")
    assert f"on another layout (comm.reducer=fsdp wrote it, this job is comm.reducer={reducer})" in logged(tmp_path)
    assert "kept from the checkpoint" not in resumed[0]["summary"]["hierarchical_reason"], resumed[0]["summary"]
    same_as(resumed, reference)


@pytest.fixture(scope="module")
def replicated(tmp_path_factory):
    """The same job under comm.reducer=ddp on 2 x 2, stopped at its checkpoint (one file) at step 6."""
    run = tmp_path_factory.mktemp("replicated")
    train(run, "2x2", "comm.reducer=ddp", STOP)
    assert sorted(p.name for p in (run / "run" / "checkpoints").glob("*.pt")) == ["step-00000006.pt"]
    return run


@pytest.mark.parametrize("layout", ["2x2", "1x2"])
def test_a_replicated_checkpoint_resumes_in_a_sharded_job(tmp_path, reference, replicated, layout):
    """Each rank cuts its shards out of the file's whole tensors (the model's and the optimiser's momentum)."""
    resumed = resume(tmp_path, replicated, layout, *FSDP)
    said = logged(tmp_path)
    assert "on another layout (comm.reducer=ddp wrote it, this job is comm.reducer=fsdp)" in said, said
    same_as(resumed, reference)


COMPRESSED = ("comm.compress=powersgd", "comm.compress_warmup_steps=1", "comm.powersgd_rank=2")


def test_a_compressed_sharded_job_on_another_layout_of_nodes_starts_its_error_feedback_anew(tmp_path):
    """PowerSGD across 2 nodes of 2 ranks, resumed on 2 nodes of 1 (on one node nothing is compressed: nothing to
    start anew): each rank's saved error feedback belongs to a shard of the old layout; every rank starts anew,
    said once."""
    train(tmp_path / "stopped", "2x2", *FSDP, *COMPRESSED, STOP)
    saved = sharded_path(tmp_path / "stopped" / "run" / "checkpoints", 6)
    assert all(ckpt.read(rank_state(saved, r))["compression"]["errors"] for r in range(4))  # what is dropped
    resumed = resume(tmp_path / "resumed", tmp_path / "stopped", "2x1", *FSDP, *COMPRESSED)
    assert resumed[0]["summary"]["compression"].startswith("PowerSGD rank 2"), resumed[0]["summary"]
    said = logged(tmp_path / "resumed") + logged(tmp_path / "resumed", 1)
    line = "compression: error feedback and Qs start anew (saved on another layout of nodes)"
    assert said.count(line) == 1, said
