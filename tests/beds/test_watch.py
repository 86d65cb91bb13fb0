"""What a user watches: the start banner, the end-of-run table and curves, ``plot``, ``comm.trace`` timelines and
the ``doctor`` (locally, and under +cluster=sim with one deliberately slow namespace link)."""

import json
import subprocess
import sys

import pytest

from harness import REPO
from harness.beds import namespaces, needs_netns
from harness.run import run_launcher

SHORT = ("train.max_steps=12", "train.log_every_steps=4", "train.checkpoint_every_steps=0")
DOCTOR = ("-m", "launcher", "doctor")


def test_banner_summary_table_curves_and_preflight(tmp_path):
    result = run_launcher(*SHORT, "preflight=true", "train.plots=true", run_dir=tmp_path)
    assert result.returncode == 0, result.stderr
    err = result.stderr
    # the preflight report, then the banner, then the table
    assert "doctor: 2 rank(s) on 1 node(s)" in err and "no problems found" in err
    assert "  devices        ranks 0-1 on " in err and ": cpu" in err
    assert (
        "  gradient sync  torch DDP, bucket cap 25 MB, backward overlap (comm.reducer=ddp: torch DDP waits for its "
        "buckets in backward); flat allreduce" in err
    )
    assert "  batch          64 global = 32 per rank x 2; 12 steps" in err
    assert err.index("doctor: 2 rank(s)") < err.index("  devices ") < err.index("done: 12 steps")
    table = err[err.index("done: 12 steps") :]
    for row in ("layout", "model / data", "gradient sync", "final loss", "test accuracy", "throughput", "curves"):
        assert f"\n  {row} " in table, row
    assert (tmp_path / "plots" / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def plot(run_dir):
    return subprocess.run(
        [sys.executable, "-m", "launcher", "plot", str(run_dir)], cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_plot_command(tmp_path):
    run = run_launcher(*SHORT, run_dir=tmp_path)  # the harness's train.plots=false: none at the end
    assert run.returncode == 0, run.stderr
    assert "curves         not rendered (train.plots=false): python -m launcher plot " in run.stderr, run.stderr
    assert not (tmp_path / "plots").exists()
    result = plot(tmp_path)
    assert result.returncode == 0, result.stderr
    assert (
        result.stdout.strip() == str(tmp_path / "plots" / "curves.png")
        and (tmp_path / "plots" / "curves.png").is_file()
    )
    missing = plot(tmp_path / "nope")
    assert missing.returncode == 2
    assert f"launcher: error: no metrics in {tmp_path / 'nope' / 'metrics.jsonl'}" in missing.stderr


@pytest.mark.parametrize("overlap", ["forward", "backward"])
def test_trace_shows_buckets_in_flight_into_the_next_forward(tmp_path, overlap):
    """Buckets leave during backward; forward overlap: the first layers' bucket (sent last) is still in flight when
    the next step's forward begins, its update waits in that forward. Backward overlap: every bucket is done before
    backward returns."""
    result = run_launcher(
        "train.max_steps=8",
        "train.checkpoint_every_steps=0",
        "train.plots=true",
        "model=mlp",
        "model.hidden=2048",  # a 6 MB first layer: its allreduce outlasts the optimizer step
        "comm.reducer=bucketed",
        "comm.bucket_cap_mb=1",
        f"comm.overlap={overlap}",
        "comm.trace=true",
        "comm.trace_steps=5",
        run_dir=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    tail = ", net.1.weight's gradient sent as its rows are computed" if overlap == "forward" else ""
    assert f"flat, {overlap} overlap{tail};" in result.stderr
    assert (tmp_path / "plots" / "trace.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # rendered at the end
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    for rank in (0, 1):
        mine = [e for e in events if e["ph"] == "X" and e["pid"] == rank]
        forwards = [e["ts"] for e in mine if tracks[rank, e["tid"]] == "step" and e["name"] == "forward"]
        buckets = [(e["ts"], e["ts"] + e["dur"]) for e in mine if tracks[rank, e["tid"]] == "buckets"]
        assert len(forwards) == 5 and buckets
        # communication overlaps computation: in every step a bucket starts while autograd still computes, i.e.
        # before "wait for buckets" (which begins when autograd's work ends, and holds the launches of leftovers)
        backward = [e["ts"] for e in mine if tracks[rank, e["tid"]] == "step" and e["name"] == "backward"]
        autograd_done = [e["ts"] for e in mine if e["name"] == "wait for buckets"]
        assert len(backward) == len(autograd_done) == 5
        # (the last traced step's buckets end after the trace closes under the forward overlap: not recorded)
        for start, done in zip(backward[:-1], autograd_done):
            assert [b for b, _ in buckets if start <= b < done], f"rank {rank}: no bucket started during backward"
        crossing = [(f, b) for f in forwards for b in buckets if b[0] < f < b[1]]
        if overlap == "forward":
            assert crossing, f"rank {rank}: no bucket in flight when a forward began"
            waits = [e for e in mine if e["name"].startswith("await bucket")]
            assert waits, f"rank {rank}: no forward waited for a bucket"
        else:
            assert not crossing, f"rank {rank}: buckets still in flight at a forward: {crossing}"


def test_doctor_locally(tmp_path):
    result = run_launcher(run_dir=tmp_path, module=DOCTOR)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "doctor.json").read_text())
    assert [r["rank"] for r in report["ranks"]] == [0, 1] and report["problems"] == []
    assert all(r["interface"] == "lo" and r["connect_ms"] is not None for r in report["ranks"])
    assert set(report["intra_node_ms"]) == {"0"} and report["links_ms"] == {}
    assert "node 0: allreduce of 1 MB among its ranks" in result.stderr and "no problems found" in result.stderr
    assert not (tmp_path / "checkpoints").exists()  # nothing trained


@needs_netns
def test_doctor_names_the_node_behind_a_slow_link(tmp_path):
    before = namespaces()
    result = run_launcher(
        "+cluster=sim",
        "cluster.nodes=3",
        "cluster.procs_per_node=1",
        "cluster.netns=true",
        "cluster.node_link_gbit=[1,1,0.05]",
        run_dir=tmp_path,
        module=DOCTOR,
    )
    assert result.returncode == 1, result.stderr
    report = json.loads((tmp_path / "doctor.json").read_text())
    assert len(report["problems"]) == 1 and report["problems"][0].startswith("node 2 (")
    assert "is slow: its links take" in report["problems"][0]
    assert "PROBLEM node 2 (" in result.stderr
    assert namespaces() == before


def test_doctor_names_a_single_slow_link():
    """Four nodes, every link fast but 1-2: the link is named, no node is blamed (each has fast links too)."""
    from launcher.rank.doctor import verdict

    links = {(a, b): 1e-3 for a in range(4) for b in range(a + 1, 4)}
    links[(1, 2)] = 9e-3
    problems = verdict({}, links, {n: f"host{n}" for n in range(4)})
    assert problems == ["link node 1 (host1) - node 2 (host2) is slow: 9.0 ms vs 1.0 ms median (> 2x)"], problems
