"""Threads per rank (issue 36): every rank gets ``cores / ranks on its machine`` threads (torchrun sets 1; we set
nothing before, and each rank of a 2-rank script ran with every core's threads: 1.85x slower than torchrun), in a
``script=`` job too and on simulated nodes (which share one machine's cores); the user's OMP_NUM_THREADS and
train.threads_per_rank win. The ranks report what torch really uses (``torch.get_num_threads``)."""

import json
import os

import pytest

from harness import path_override
from harness.run import run_launcher
from launcher.base.threads import choose_threads

SCRIPT = """
import json, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
with open(os.path.join(sys.argv[1], f"threads-{dist.get_rank()}.json"), "w") as f:
    json.dump({"torch": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS")}, f)
dist.barrier()  # without one collective, rank 0 may leave while rank 1 still connects: "Connection closed by peer"
dist.destroy_process_group()
"""


def cores() -> int:
    return len(os.sched_getaffinity(0))


def threads_seen(tmp_path, *overrides, env=None, ranks=2):
    script = tmp_path / "threads.py"
    script.write_text(SCRIPT)
    given = (path_override("script", script), f"script_args=[{tmp_path}]", *overrides)
    result = run_launcher(*given, run_dir=tmp_path / "run", env=env)
    assert result.returncode == 0, result.stderr
    seen = [json.loads((tmp_path / f"threads-{r}.json").read_text()) for r in range(ranks)]
    return seen, result.stderr


def test_script_ranks_split_the_cores_like_torchrun(tmp_path):
    seen, stderr = threads_seen(tmp_path, "cluster.procs_per_node=2")
    expected = max(1, cores() // 2)
    assert seen == [{"torch": expected, "omp": str(expected)}] * 2
    assert f"threads     : {expected} per rank ({cores()} core(s) / 2 rank(s) on the machine)" in stderr
    empty = [str(p) for p in (tmp_path / "run").rglob("*") if p.is_dir() and not any(p.iterdir())]
    assert not empty, f"a script run left empty folders: {empty}"  # torch elastic's per-rank log folders


def test_simulated_nodes_share_the_machines_cores(tmp_path):
    seen, stderr = threads_seen(tmp_path, "+cluster=sim", "cluster.nodes=2", "cluster.procs_per_node=1")
    expected = max(1, cores() // 2)  # one rank per simulated node, both on this machine
    assert [s["torch"] for s in seen] == [expected, expected]
    assert f"({cores()} core(s) / 2 rank(s) on the machine)" in stderr


@pytest.mark.parametrize(
    ("overrides", "env", "expected"),
    [(("train.threads_per_rank=3",), None, 3), ((), {"OMP_NUM_THREADS": "3"}, 3)],
    ids=["threads_per_rank", "users_OMP_NUM_THREADS"],
)
def test_the_users_setting_wins(tmp_path, overrides, env, expected):
    seen, _ = threads_seen(tmp_path, "cluster.procs_per_node=2", *overrides, env=env)
    assert [s["torch"] for s in seen] == [expected, expected]


def test_rules():
    assert choose_threads(None, 4, {}) == (max(1, cores() // 4), f"{cores()} core(s) / 4 rank(s) on the machine")
    assert choose_threads(None, 10_000, {})[0] == 1  # at least one
    assert choose_threads(2, 4, {"OMP_NUM_THREADS": "5"}) == (2, "train.threads_per_rank")
    assert choose_threads(None, 4, {"OMP_NUM_THREADS": "5"}) == (5, "OMP_NUM_THREADS")
    not_a_number = choose_threads(None, 1, {"OMP_NUM_THREADS": "lots"})
    assert not_a_number[1].endswith("rank(s) on the machine")  # not a number: ours
