"""``comm.reducer=fsdp`` as a user starts it: ``python -m launcher +cluster=sim`` on 2 simulated nodes x 2 ranks. The
default digits job ends where torch DDP's ends (the same seed: final loss within 1e-4 relative), and a job whose
cross-node stage is PowerSGD-compressed learns."""

import json

import pytest

from harness.run import run_launcher

pytestmark = pytest.mark.slow
SIM = ("+cluster=sim", "cluster.nodes=2", "cluster.procs_per_node=2")


def summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def test_the_default_job_sharded_ends_where_ddp_ends(tmp_path):
    ends = {}
    for reducer in ("ddp", "fsdp"):
        result = run_launcher(*SIM, f"comm.reducer={reducer}", "train.max_steps=30", run_dir=tmp_path / reducer)
        assert result.returncode == 0, result.stderr[-3000:]
        ends[reducer] = summary(tmp_path / reducer)
    assert ends["fsdp"]["reducer"] == "fsdp" and ends["fsdp"]["hierarchical"] is True
    assert ends["fsdp"]["final_loss"] == pytest.approx(ends["ddp"]["final_loss"], rel=1e-4), ends
    assert ends["fsdp"]["final_loss"] < 0.6 * 2.3  # (ln 10: where an untrained digits model starts)


def test_a_sharded_job_compressed_across_nodes_learns(tmp_path):
    job = ("comm.reducer=fsdp", "comm.compress=powersgd", "comm.compress_warmup_steps=3", "train.max_steps=30")
    result = run_launcher(*SIM, "model=mlp", *job, run_dir=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "PowerSGD rank 4 across nodes" in result.stdout + result.stderr
    done = summary(tmp_path)
    assert done["compression"].startswith("PowerSGD rank 4") and done["final_loss"] < 0.6 * 2.3, done
