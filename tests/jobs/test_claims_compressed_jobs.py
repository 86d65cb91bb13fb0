"""Compressed jobs end to end (README, docs/performance.md): a lossy-compressed job on 2 simulated nodes x 2 ranks
learns (PowerSGD across nodes from step 3 on: its loss falls as the uncompressed job's does, and it classifies
held-out digits); a healing job with compression on loses a node, heals in place and finishes, still compressing
between the nodes left."""

import json

from harness.jobs import HEAL_JOB
from harness.run import run_launcher


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_powersgd_job_on_two_by_two_nodes_learns(tmp_path):
    sim = ("+cluster=sim", "cluster.nodes=2", "cluster.procs_per_node=2", "train.threads_per_rank=1")
    lossy = ("comm.compress=powersgd", "comm.compress_warmup_steps=2", "comm.powersgd_rank=2")
    span = ("train.max_steps=40", "train.log_every_steps=5", "train.checkpoint_every_steps=0")
    result = run_launcher(*sim, *lossy, *span, run_dir=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["compression"] == "PowerSGD rank 2 across nodes (after 2 step(s) uncompressed)", summary
    assert (summary["nodes"], summary["world_size"]) == (2, 4), summary
    losses = [r["loss"] for r in metrics(tmp_path) if r["kind"] == "train"]
    assert len(losses) == 8 and losses[-1] < 0.5 * losses[0], losses  # from ~2.3 (ten classes)
    assert summary["test_accuracy"] > 0.6, summary  # 40 steps; chance is 0.1


def test_a_job_with_compression_heals_in_place(tmp_path):
    """3 simulated nodes x 1 rank, bf16 across nodes from the first step; node 1 killed inside step 6's backward:
    the two left heal in place (no checkpoint read), every step trained once, the sync built again for them, still
    bf16 across nodes."""
    sim = ("+cluster=sim", "cluster.nodes=3", "cluster.min_nodes=2", "comm.compress=bf16")
    job = (*HEAL_JOB[1:], "train.max_steps=12", "train.log_every_steps=1", "comm.compress_warmup_steps=0")
    fault = {"LAUNCHER_FAULT": "step=6,rank=1,signal=KILL,target=node,backward"}
    result = run_launcher(*sim, *job, run_dir=tmp_path, env=fault)
    err = result.stderr
    assert result.returncode == 0, err[-3000:]
    assert "launcher: lost node-1 (its agent was killed by SIGKILL): the survivors heal in place" in err, err[-3000:]
    assert "(in memory: no checkpoint read)" in err and "resumed from /" not in err
    steps = [r["step"] for r in metrics(tmp_path) if r["kind"] in ("train", "eval") and r.get("step")]
    assert steps == list(range(1, 13)) + [12], steps  # each step once (the last: the evaluation)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["nodes"], summary["world_size"], summary["steps"]) == (2, 2, 12), summary
    assert summary["compression"] == "bf16 across nodes (after 0 step(s) uncompressed)", summary  # after the heal
