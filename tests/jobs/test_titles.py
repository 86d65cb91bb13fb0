"""Issue 47: processes that say what they are. In ``ps``/``top`` each rank is ``launcher rank R/W node N: <script>
<args> (run dir D)``, its node process (several nodes) ``launcher node N/M: ...``, the head ``launcher head MODE:
...`` (setproctitle), and a rank's environment stays readable in ``/proc/PID/environ``."""

import json

import pytest

from harness.run import run_launcher

SCRIPT = "script=tests/scripts/titles_script.py"


def titles(run_dir, mode, *extra):
    out = run_dir / "titles"
    out.mkdir()
    run = run_launcher(SCRIPT, *mode, *extra, "--", f"--out={out}", "--lr", "0.1", run_dir=run_dir)
    assert run.returncode == 0, run.stderr
    return [json.loads((out / f"rank-{k}.json").read_text()) for k in range(2)]


@pytest.mark.slow
def test_each_rank_and_the_head_name_the_script_and_their_place(tmp_path):
    seen = titles(tmp_path, ("cluster.procs_per_node=2",))
    words = f"titles_script.py --out={tmp_path / 'titles'} --lr 0.1 (run dir {tmp_path})"
    for rank, rank_seen in enumerate(seen):
        assert rank_seen["rank"] == f"launcher rank {rank}/2 node 0: {words}", rank_seen
        assert rank_seen["parent"] == f"launcher head local: {words}", rank_seen  # the head runs the agent
        assert rank_seen["environ"], "the rank's environment is gone from /proc/PID/environ"
        assert rank_seen["comm"] == f"rank-{rank}/2-node-0", rank_seen  # no space: Slurm's linuxproc splits on them


@pytest.mark.slow
def test_simulated_nodes_name_their_node_and_the_head(tmp_path):
    seen = titles(tmp_path, ("+cluster=sim", "cluster.nodes=2", "cluster.procs_per_node=1"))
    words = f"titles_script.py --out={tmp_path / 'titles'} --lr 0.1 (run dir {tmp_path})"
    nodes = sorted(s["parent"] for s in seen)
    assert nodes == [f"launcher node {n}/2: {words}" for n in range(2)], seen
    assert {s["grandparent"] for s in seen} == {f"launcher head sim: {words}"}, seen
    assert sorted(s["rank"] for s in seen) == [f"launcher rank {r}/2 node {r}: {words}" for r in range(2)], seen
