"""Threads per rank (issue 36): every rank gets ``cores / ranks on its machine`` threads (torchrun sets 1; we set
nothing before, and each rank of a 2-rank script ran with every core's threads: 1.85x slower than torchrun), in a
``script=`` job too and on simulated nodes (which share one machine's cores); the user's OMP_NUM_THREADS and
train.threads_per_rank win. The ranks report what torch really uses (``torch.get_num_threads``). The jobs run on a
machine of 8 or 6 cores (a fake: ``sitecustomize`` gives every process of the job that CPU affinity), so each rank's
share differs from torchrun's blunt 1 and from the machine's every core on any box."""

import json
import os

import pytest

from harness import path_override
from harness.run import run_launcher
from launcher.base.threads import RANKS_ON_MACHINE, choose_threads, for_this_rank, plan_line

SCRIPT = """
import json, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
with open(os.path.join(sys.argv[1], f"threads-{dist.get_rank()}.json"), "w") as f:
    json.dump({"torch": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS")}, f)
dist.barrier()  # without one collective, rank 0 may leave while rank 1 still connects: "Connection closed by peer"
dist.destroy_process_group()
"""


FAKE_CORES = """import os
os.sched_getaffinity = lambda pid: set(range({cores}))  # a machine of {cores} cores (tests/jobs/test_threads.py)
"""


def cores() -> int:
    return len(os.sched_getaffinity(0))


def on_cores(tmp_path, count: int) -> dict[str, str]:
    """The environment of a job whose every process (head, nodes, ranks) sees ``count`` usable cores."""
    fake = tmp_path / "fake_cores"
    fake.mkdir()
    (fake / "sitecustomize.py").write_text(FAKE_CORES.format(cores=count))
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(fake), os.environ.get("PYTHONPATH")) if p)}


def threads_seen(tmp_path, *overrides, env=None, ranks=2):
    script = tmp_path / "threads.py"
    script.write_text(SCRIPT)
    given = (path_override("script", script), f"script_args=[{tmp_path}]", *overrides)
    result = run_launcher(*given, run_dir=tmp_path / "run", env=env)
    assert result.returncode == 0, result.stderr
    seen = [json.loads((tmp_path / f"threads-{r}.json").read_text()) for r in range(ranks)]
    return seen, result.stderr


def test_script_ranks_split_the_cores_like_torchrun(tmp_path):
    seen, stderr = threads_seen(tmp_path, "cluster.procs_per_node=2", env=on_cores(tmp_path, 8))
    assert seen == [{"torch": 4, "omp": "4"}] * 2  # (torchrun: 1 each; none set: 8 each)
    assert "threads     : 4 per rank (8 core(s) / 2 rank(s) on the machine)" in stderr
    empty = [str(p) for p in (tmp_path / "run").rglob("*") if p.is_dir() and not any(p.iterdir())]
    assert not empty, f"a script run left empty folders: {empty}"  # torch elastic's per-rank log folders


def test_simulated_nodes_share_the_machines_cores(tmp_path):
    sim = ("+cluster=sim", "cluster.nodes=2", "cluster.procs_per_node=1")
    seen, stderr = threads_seen(tmp_path, *sim, env=on_cores(tmp_path, 6))
    assert [s["torch"] for s in seen] == [3, 3]  # one rank per simulated node, both on this machine (not 6 each)
    assert "(6 core(s) / 2 rank(s) on the machine)" in stderr


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


def test_the_share_of_a_machines_cores(monkeypatch):
    """On a machine of 12 usable cores (a fake affinity): 12 / ranks, at least 1, never torchrun's blunt 1 where
    more fit; the rank sets OMP_NUM_THREADS to it; the plan says it."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(12)))
    assert choose_threads(None, 1, {}) == (12, "12 core(s) / 1 rank(s) on the machine")
    assert choose_threads(None, 4, {}) == (3, "12 core(s) / 4 rank(s) on the machine")
    assert choose_threads(None, 5, {}) == (2, "12 core(s) / 5 rank(s) on the machine")
    assert choose_threads(None, 24, {})[0] == 1
    assert plan_line(None, 3, {}) == "4 per rank (12 core(s) / 3 rank(s) on the machine)"
    monkeypatch.setenv("OMP_NUM_THREADS", "")  # (none given; what the rank sets is undone after the test)
    monkeypatch.setenv(RANKS_ON_MACHINE, "")
    assert for_this_rank(None, 2) == (6, "12 core(s) / 2 rank(s) on the machine")
    assert os.environ["OMP_NUM_THREADS"] == "6"
    monkeypatch.setenv(RANKS_ON_MACHINE, "4")  # (simulated nodes: every rank of the machine)
    monkeypatch.setenv("OMP_NUM_THREADS", "")
    assert for_this_rank(None, 1) == (3, "12 core(s) / 4 rank(s) on the machine")
