"""Issue 47 (item 7): the script's side of restarts, as docs/running.md shows it. A script of the DDP tutorial's
shape (tests/scripts/snapshot_script.py: a snapshot every 2 epochs, resumed at start, the attempt read from
TORCHELASTIC_RESTART_COUNT) has one rank SIGKILLed at the start of epoch 3 of 6 on its first attempt; under
``cluster.max_restarts=1`` the launcher starts the ranks again, locally (2 ranks, the store's host killed) and on 2
simulated nodes of one rank each (the other node's rank killed): the job exits 0, the killed rank's log says it
resumed from the snapshot at epoch 2, the last epoch ran, and the model is the one a run without the kill trains,
bit for bit. Each rank's log marks where each attempt starts, and the end-of-run lines name the killed rank's node
as the restart's line does (issue 60, item 6)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from harness import REPO, path_override
from harness.run import Run, run_launcher

SCRIPT = path_override("script", REPO / "tests" / "scripts" / "snapshot_script.py")
EPOCHS, SAVE_EVERY, KILL_EPOCH = 6, 2, 3  # snapshots after epochs 1, 3, 5; the kill before epoch 3: resume at 2
RESUMED = f"Resuming training from snapshot at Epoch {KILL_EPOCH // SAVE_EVERY * SAVE_EVERY}"
LAST = f"Epoch {EPOCHS - 1} | Steps: 4 | attempt 1"  # the last epoch, run by the second attempt (64 samples / 2 / 8)


def run_snapshot_job(tmp_path: Path, *overrides: str, kill_rank: int | None = None) -> tuple[Run, Path]:
    """The snapshot script under ``python -m launcher`` with ``overrides``, its arguments after ``--``: its
    snapshot and final model in ``tmp_path``, ``kill_rank`` SIGKILLed at the start of epoch ``KILL_EPOCH`` on the
    first attempt (None: no kill). Returns the run and its run dir (``tmp_path / "run"``: logs, summary.json)."""
    args = [str(EPOCHS), f"--snapshot={tmp_path / 'snapshot.pt'}", f"--save-every={SAVE_EVERY}"]
    args.append(f"--final={tmp_path / 'final.pt'}")
    if kill_rank is not None:
        args += [f"--kill-rank={kill_rank}", f"--kill-epoch={KILL_EPOCH}"]
    run_dir = tmp_path / "run"
    return run_launcher(SCRIPT, "cluster.max_restarts=1", *overrides, "--", *args, run_dir=run_dir), run_dir


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The model 2 ranks train without a kill (every layout of 2 ranks trains the same one: rank r, shard r)."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    run, _ = run_snapshot_job(tmp_path, "cluster.procs_per_node=2")
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(tmp_path / "final.pt")


def assert_resumed_and_finished(tmp_path: Path, run: Run, run_dir: Path, killed: int, reference: dict) -> None:
    assert run.returncode == 0, run.stderr[-3000:]
    # the restart announced once, naming the killed rank (not the peer that saw its connection close), and listed
    where = r"\(pid \d+\)" if killed == 0 else rf"\(node {killed}, pid \d+\)"
    said = rf"^launcher: attempt 0 ended: rank {killed} {where} on \S+ died with signal 9 \(SIGKILL\); restarting: "
    said += r"attempt 1 starts \(restart 1 of 1, 0 left: cluster.max_restarts\)$"
    assert len(re.findall(said, run.stderr, re.M)) == 1, run.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    first, second = summary["attempts"]
    assert (first["ended"], first["cause"]["rank"], first["cause"]["signal"]) == ("failed", killed, "SIGKILL"), first
    assert second["ended"] == "finished" and second["cause"] is None and summary["exit"] == 0, summary
    assert summary["entry"].startswith("snapshot_script.py 6 --snapshot=") and summary["world_size"] == 2, summary
    # the end-of-run lines name the node as the restart's line does (issue 60, item 6: edge 10)
    node = rf" \(node {killed}\)" if killed else ""  # (two nodes: the sim job's rank 1 is node 1's)
    said = rf"^launcher: attempt 0: .*, failed: rank {killed}{node} on \S+ \(died with signal 9"
    assert re.search(said, run.stderr, re.M), run.stderr[-3000:]
    for rank in (0, 1):  # each rank's log: where each attempt's output starts (issue 60, item 6: edge 10)
        text = (run_dir / "logs" / f"rank-{rank}.log").read_text()
        marker = rf"^==== attempt (\d) \(launch \w+\): rank {rank}/2, node \d, on \S+, [\d-]+ [\d:]+ ====$"
        assert re.findall(marker, text, re.M) == ["0", "1"], text[-3000:]
    log = (run_dir / "logs" / f"rank-{killed}.log").read_text()
    assert log.index(RESUMED) > log.index("==== attempt 1 "), log[-3000:]  # the second attempt's, below its marker
    assert f"[rank {killed}] {LAST}" in log, log[-3000:]
    final = torch.load(tmp_path / "final.pt")
    assert final.keys() == reference.keys() and all(torch.equal(final[k], reference[k]) for k in final), (
        final,
        reference,
    )


@pytest.mark.slow
def test_a_killed_rank_restarts_and_the_script_resumes_from_its_snapshot(tmp_path, uninterrupted):
    run, run_dir = run_snapshot_job(tmp_path, "cluster.procs_per_node=2", kill_rank=0)  # the store's host
    assert_resumed_and_finished(tmp_path, run, run_dir, killed=0, reference=uninterrupted)


@pytest.mark.slow
def test_on_simulated_nodes_a_killed_rank_restarts_and_the_script_resumes(tmp_path, uninterrupted):
    sim = ("+cluster=sim", "cluster.nodes=2", "cluster.procs_per_node=1")
    run, run_dir = run_snapshot_job(tmp_path, *sim, kill_rank=1)  # node 1's
    assert_resumed_and_finished(tmp_path, run, run_dir, killed=1, reference=uninterrupted)
