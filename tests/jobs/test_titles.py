"""Issue 47: processes that say what they are. In ``ps``/``top`` each rank is ``launcher rank R/W node N: <script>
<args> (run dir D)``, its node process (several nodes) ``launcher node N/M: ...``, the head ``launcher head MODE:
...`` (setproctitle), rank 0's output helper ``launcher tee rank 0: ...`` (issue 60), and a rank's environment stays
readable in ``/proc/PID/environ``. A script's job, of one attempt too, ends with a line naming its run dir."""

import json
import re

import pytest

from harness.run import run_launcher

SCRIPT = "script=tests/scripts/titles_script.py"


def titles(run_dir, mode, *extra):
    out = run_dir / "titles"
    out.mkdir()
    run = run_launcher(SCRIPT, *mode, *extra, "--", f"--out={out}", "--lr", "0.1", run_dir=run_dir)
    assert run.returncode == 0, run.stderr
    # issue 60, item 6 (edge 10): every script job ends with a line, one attempt too (none said where its run was)
    words = f"titles_script.py --out={out} --lr 0.1"
    ended = rf"^launcher: script {re.escape(words)}: finished, exit code 0, 1 attempt in [\d.]+ s; run dir "
    assert re.search(ended + rf"{re.escape(str(run_dir))} \(logs/rank-<k>\.log, summary\.json\)$", run.stderr, re.M)
    seen = [json.loads((out / f"rank-{k}.json").read_text()) for k in range(2)]
    tee = f"launcher tee rank 0: to the console and logs/rank-0.log (run dir {run_dir})"
    assert seen[0]["tee"] == tee, seen[0]  # rank 0's tee helper, titled as every other process (issue 60)
    return seen


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
