"""``comm.reducer=fsdp`` as a user starts it: ``python -m launcher +cluster=sim`` on 2 simulated nodes x 2 ranks: a job
whose cross-node stage is PowerSGD-compressed learns. (The sharded job following one process, hence torch DDP, on
four layouts, 2 x 2 included: tests/jobs/test_fsdp_parity.py.)"""

import json

import pytest

from harness.run import run_launcher

pytestmark = pytest.mark.slow
SIM = ("+cluster=sim", "cluster.nodes=2", "cluster.procs_per_node=2")


def summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def test_a_sharded_job_compressed_across_nodes_learns(tmp_path):
    job = ("comm.reducer=fsdp", "comm.compress=powersgd", "comm.compress_warmup_steps=3", "train.max_steps=30")
    result = run_launcher(*SIM, "model=mlp", *job, run_dir=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "PowerSGD rank 4 across nodes" in result.stdout + result.stderr
    done = summary(tmp_path)
    assert done["compression"].startswith("PowerSGD rank 4") and done["final_loss"] < 0.6 * 2.3, done
