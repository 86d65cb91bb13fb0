"""``+cluster=sim``: one elastic agent per virtual node on this host; optionally network namespaces."""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from harness.beds import ALL, namespaces, needs_netns
from harness.checks import assert_same_trajectory, final_state
from harness.config import plan
from harness.jobs import HEAL_JOB, HEAL_SCHEDULE
from harness.probes import stranger_writing
from harness.run import launcher_argv, run_launcher
from harness.stops import PROGRAMS, Cell, check, drive_all, job
from launcher.config import ConfigError
from launcher.launch.sim.netns import RECORDS, SimNetwork

SHORT = ("train.max_steps=12", "train.log_every_steps=4", "train.checkpoint_every_steps=0")


def test_two_virtual_nodes_two_ranks_each(tmp_path):
    result = run_launcher("+cluster=sim", "cluster.procs_per_node=2", "comm.reducer=bucketed", *SHORT, run_dir=tmp_path)
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["world_size"], summary["nodes"], summary["procs_per_node"]) == (4, 2, 2)
    assert "topology 2 node(s) (2+2 ranks)" in result.stderr
    assert all((tmp_path / "logs" / f"rank-{r}.log").is_file() for r in range(4))
    # the secret reached every rank (that a rank holding it refuses an unsigned value, here and on simulated nodes:
    # tests/jobs/test_claims_store.py)
    assert all(
        "store signed with the job's secret" in (tmp_path / "logs" / f"rank-{r}.log").read_text() for r in range(4)
    )


def test_failing_rank_on_second_node_fails_the_job(tmp_path):
    result = run_launcher(
        "+cluster=sim", "cluster.procs_per_node=1", *SHORT, run_dir=tmp_path, env={"LAUNCHER_FAULT": "step=3,rank=1"}
    )
    assert result.returncode == 1
    assert "RuntimeError: injected fault at step 3 on rank 1" in result.stderr
    assert re.search(r"launcher: rank 1 \(node 1, pid \d+\) on \S+ failed:", result.stderr), result.stderr


def test_sim_config_errors():
    with pytest.raises(
        ConfigError,
        match=r"cluster.link_gbit=1.0 shapes the namespace links; HINT: add "
        r"cluster.netns=true",
    ):
        plan("+cluster=sim", "cluster.link_gbit=1")
    with pytest.raises(ConfigError, match=r"simulated nodes run on the CPU"):
        plan("+cluster=sim", "cluster.gpus_per_node=1")
    job, p = plan("+cluster=sim")
    assert (p.mode, p.nodes, p.procs_per_node, p.world_size) == ("sim", 2, 2, 4)


@needs_netns
def test_sigterm_deletes_the_namespaces():
    """A program holding simulated nodes' namespaces (a benchmark, say) and ended by SIGTERM deletes them."""
    before = namespaces()
    program = (
        "import sys, time\n"
        "from launcher.launch.sim.netns import SimNetwork\n"
        "with SimNetwork(2, netns=True) as net:\n"
        "    print(net.ns(0), flush=True)\n"
        "    time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True)
    try:
        name = proc.stdout.readline().strip()
        assert name in namespaces() - before, name
        proc.terminate()
        assert proc.wait(timeout=30) == 143
        left = namespaces() - before
    finally:
        proc.kill()
        proc.wait()
        for ns in namespaces() - before:  # pass or fail, the machine as it was
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
    assert not left, left
    assert not os.path.exists(f"/etc/netns/{name}")


@needs_netns
def test_namespaces_a_killed_program_left_are_deleted_by_the_next(capfd):
    """SIGKILL runs no exit path: the next network started on the machine deletes the dead program's namespaces
    and /etc/netns entries, kills what still ran in them, and says so."""
    before = namespaces()
    program = (
        "import subprocess, sys\n"
        "from launcher.launch.sim.netns import SimNetwork\n"
        "with SimNetwork(2, netns=True) as net:\n"
        "    held = subprocess.Popen([*net.prefix(1), 'sleep', '300'])\n"
        "    print(net.tag, held.pid, flush=True)\n"
        "    sys.stdin.read()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", program], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    tag, held = "", 0
    try:
        tag, held_pid = proc.stdout.readline().split()
        held = int(held_pid)
        dead = {f"lnch{tag}br", f"lnch{tag}n0", f"lnch{tag}n1"}
        proc.kill()
        proc.wait(timeout=30)
        assert dead <= namespaces()  # nothing of its exit path ran
        with SimNetwork(1, netns=True):
            left = dead & namespaces()
        err = capfd.readouterr().err
        deadline = time.monotonic() + 5
        while _running(held) and time.monotonic() < deadline:
            time.sleep(0.05)
        still_held = _running(held)
    finally:
        proc.kill()
        proc.wait()
        if held:
            with contextlib.suppress(OSError):
                os.kill(held, signal.SIGKILL)
        for ns in namespaces() - before:  # pass or fail, the machine as it was
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        with contextlib.suppress(OSError):
            os.remove(f"{RECORDS}/{tag}")
        with contextlib.suppress(OSError):
            os.rmdir(RECORDS)
    assert not left, left
    assert not [ns for ns in dead if os.path.exists(f"/etc/netns/{ns}")]
    assert not still_held, f"pid {held} still runs in a deleted namespace"
    line = next(line for line in err.splitlines() if "a killed program left" in line)
    assert line.startswith(
        f"launcher: deleted the simulated nodes' namespaces a killed program left, pid {proc.pid} (gone): "
    )
    assert set(line.split(": ", 2)[2].split(", ")) == dead, line
    assert not os.path.exists(RECORDS)


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed process waits there for whoever reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@needs_netns
def test_namespaces_with_shaped_link_and_cleanup(tmp_path):
    before = namespaces()
    result = run_launcher(
        "+cluster=sim",
        "cluster.procs_per_node=2",
        "cluster.netns=true",
        "cluster.link_gbit=0.2",
        "comm.hierarchical=auto",
        "comm.reducer=bucketed",
        *SHORT,
        run_dir=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert "network namespaces on 10.99.0.0/24, links shaped to 0.2 Gbit/s" in result.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    # auto measured both on the slow link: node-first sends half the bytes across it and must win
    assert (summary["world_size"], summary["nodes"], summary["hierarchical"]) == (4, 2, True), summary
    assert summary["hierarchical_reason"].startswith("measured"), summary["hierarchical_reason"]
    assert namespaces() == before  # everything created was removed
    etc = os.listdir("/etc/netns") if os.path.isdir("/etc/netns") else []
    assert not [p for p in etc if p.startswith("lnch") and p not in ALL], etc  # (the ssh machines': their fixture's)


@needs_netns
def test_namespaces_removed_when_a_rank_fails(tmp_path):
    before = namespaces()
    result = run_launcher(
        "+cluster=sim",
        "cluster.procs_per_node=1",
        "cluster.netns=true",
        *SHORT,
        run_dir=tmp_path,
        env={"LAUNCHER_FAULT": "step=2,rank=0"},
    )
    assert result.returncode == 1 and "injected fault at step 2 on rank 0" in result.stderr
    assert namespaces() == before


@needs_netns
def test_ctrl_c_under_netns_reaches_every_rank_as_sigint(tmp_path):
    """Issue 60, item 6 (edge 7): under ``cluster.netns=true`` the node processes run through ``ip netns exec``, and
    a Ctrl-C was said to reach the ranks as SIGTERM while the launcher said SIGINT. The stop-signal matrix's sim
    cells run on loopback, and its trainer cells read only the head's line: here a Ctrl-C (SIGINT at the head's
    process group) stops a netns job of the trainer and one of a script, each checked as a matrix cell
    (``harness.stops.check``): the trainer's ranks each say they stopped on SIGINT (or were told by a peer), the
    script's ranks got SIGINT themselves; nothing of either job is left (the matrix's check)."""

    def driver(cell: Cell):
        run_dir = tmp_path / cell.id / "run"
        argv = launcher_argv(run_dir, *NETNS_SIM, *cell.program_args(run_dir))
        return job(cell, run_dir, lambda: [argv], [tmp_path / cell.id / "head.log"])

    outcomes = drive_all(driver, [Cell("sim-netns", "INT", program) for program in PROGRAMS], at_once=2)
    for out in outcomes.values():
        check(out)


NETNS_SIM = ("+cluster=sim", "cluster.nodes=2", "cluster.procs_per_node=1", "cluster.netns=true")


def test_netns_without_root_is_refused_before_start(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ConfigError, match=r"cluster.netns=true needs root to create network namespaces"):
        plan("+cluster=sim", "cluster.netns=true")


def test_script_runs_unchanged_on_virtual_nodes(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    result = run_launcher(
        "+cluster=sim",
        "cluster.procs_per_node=2",
        "script=tests/scripts/env_script.py",
        f"script_args=[{out}]",
        run_dir=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    seen = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(4)]
    assert [(s["LOCAL_RANK"], s["GROUP_RANK"], s["LOCAL_WORLD_SIZE"]) for s in seen] == [
        ("0", "0", "2"),
        ("1", "0", "2"),
        ("0", "1", "2"),
        ("1", "1", "2"),
    ]
    assert all(s["allreduce"] == 10.0 for s in seen)


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_lost_nodes_the_survivors_heal_in_place(tmp_path, one_process_heal_job):
    """``cluster.min_nodes=1`` on 3 simulated nodes of 2 ranks each, our bucketed reducer with the backward overlap,
    2 micro-batches per step: node 1 is killed inside step 15's backward, while its peers wait in the gradient
    allreduce (its agent and ranks SIGKILLed at once, as when a machine goes away: the head sees it), then node 2
    freezes at step 17 (SIGSTOP: only the keeper's missing heartbeat tells). Each time the survivors heal in place:
    the same processes, no checkpoint read, each step trained and logged once, the next step within 10 s of each
    loss, and the final model is one process's on the same global batches up to float32 summation order
    (test_launch's tolerance). All along, a stranger writes forged decisions (the job stops), heartbeats and
    readiness marks into the keeper's store (issue 34): ignored, said once each, the job finishes as without them;
    the job's secret is on no process's command line."""
    job = (*HEAL_JOB[:2], HEAL_SCHEDULE, "train.threads_per_rank=1", "train.checkpoint_every_steps=10")
    job += ("train.accumulate_steps=2",)
    ours = ("comm.reducer=bucketed", "comm.overlap=backward", "cluster.procs_per_node=2")
    faults = "step=15,rank=2,signal=KILL,target=node,backward;step=17,rank=4,signal=STOP,target=node"
    sim = ("+cluster=sim", "cluster.nodes=3", "cluster.min_nodes=1")
    with stranger_writing() as wrote:
        result = run_launcher(
            *job, *ours, *sim, "train.log_every_steps=1", run_dir=tmp_path, env={"LAUNCHER_FAULT": faults}
        )
    assert result.returncode == 0, result.stderr[-3000:]
    err = result.stderr
    assert wrote[:2] == ["decisions", "beats"] and not [w for w in wrote if w.startswith("argv")], wrote
    forged = "ignored a value of launcher/attempt-0/heal/end/0 in the rendezvous store at "
    assert (tmp_path / "logs" / "rank-0.log").read_text().count(forged) == 1  # said once, by the round's watch
    assert "forged by a stranger" not in err
    assert "lost machine: the survivors heal in place (cluster.heal)" in err
    assert (
        "launcher: lost node-1 (its agent was killed by SIGKILL): the survivors heal in place, continuing on 2 of 3 "
        "nodes (round 1, cluster.min_nodes=1)" in err
    )
    assert re.search(
        r"launcher: lost node-2 \(no heartbeat for [3-9]\.\d s \(cluster.lost_after_s=3\)\): the survivors heal in "
        r"place, continuing on 1 of 3 nodes \(round 2, cluster.min_nodes=1\)",
        err,
    ), err[-3000:]
    assert "(in memory: no checkpoint read)" in err
    assert "resumed from /" not in err and "restarting" not in err  # no checkpoint loaded
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["nodes"], summary["world_size"], summary["steps"]) == (1, 2, 20), summary
    assert summary["resumed_from"] is None and summary["hosts"] == [summary["hosts"][0]]
    killed, frozen = summary["membership"]
    assert killed["why"] == "node-1: its agent was killed by SIGKILL", killed
    assert re.match(r"node-2: no heartbeat for [3-9]\.\d s", frozen["why"]), frozen  # typical 3.1-3.3 s
    for change, step, nodes in ((killed, 14, (3, 2)), (frozen, 16, (2, 1))):
        assert (change["step"], change["how"], change["nodes_before"], change["nodes_after"]) == (
            step,
            "in place",
            *nodes,
        )
        assert 0 < change["fault_to_step_s"] <= 10, change  # typical: killed 0.3 s, frozen 3.3 s (3x and more)
    steps = [r["step"] for r in metrics(tmp_path) if r["kind"] in ("train", "eval")]  # a straggler line has none
    assert [s for s in steps if s] == list(range(1, 21)) + [20], steps  # each step once (the last: the evaluation)
    assert_same_trajectory(final_state(tmp_path), final_state(one_process_heal_job))


def test_fp16_with_accumulation_heals_and_keeps_its_gradient_scaler(tmp_path):
    """fp16 (a gradient scaler) and 2 micro-batches per step on 2 simulated nodes: node 1 is killed inside step 6's
    backward; the survivor heals in place and its scaler goes on, not afresh: from each step's checkpoint to the
    next the growth tracker counts one more step at the same scale, or (an overflow) restarts at 0 with half the
    scale; a scaler rebuilt by the heal would restart at 1 with 2**16."""
    job = ("train.max_steps=10", "train.precision=fp16", "train.accumulate_steps=2", "train.log_every_steps=1")
    saves = ("train.checkpoint_every_steps=1", "train.keep_checkpoints=10")
    sim = ("+cluster=sim", "cluster.nodes=2", "cluster.min_nodes=1")
    faults = "step=6,rank=1,signal=KILL,target=node,backward"
    result = run_launcher(*HEAL_JOB[1:], *job, *saves, *sim, run_dir=tmp_path, env={"LAUNCHER_FAULT": faults})
    err = result.stderr
    assert result.returncode == 0, err[-3000:]
    assert "launcher: lost node-1 (its agent was killed by SIGKILL): the survivors heal in place" in err, err[-3000:]
    assert "resumed from /" not in err and "restarting" not in err
    steps = [r["step"] for r in metrics(tmp_path) if r["kind"] in ("train", "eval")]  # a straggler line has none
    assert [s for s in steps if s] == list(range(1, 11)) + [10], steps
    scalers = [
        (s["step"], s["stepper"]["scaler"]["scale"], s["stepper"]["scaler"]["_growth_tracker"])
        for s in (torch.load(p, weights_only=True) for p in sorted((tmp_path / "checkpoints").glob("step-*.pt")))
    ]
    assert [step for step, *_ in scalers] == list(range(1, 11)) and scalers[0][1:] == (2.0**16, 1), scalers
    for (_, scale, tracker), (step, next_scale, next_tracker) in zip(scalers, scalers[1:]):
        assert (next_scale, next_tracker) in ((scale, tracker + 1), (scale / 2, 0)), (step, scalers)


def test_a_stall_after_a_heal_is_named_by_the_watch_of_the_new_round(tmp_path):
    """Node 2 is killed at step 4 and the survivors heal in place; then rank 1 stalls at step 8, in the new round:
    the new round's watch names it (hang line, its stack) within comm.hang_warn_s + a few beats, ends the job at
    comm.timeout_s, and the report's first line names rank 1, not the rank waiting for it (issue 34)."""
    faults = "step=4,rank=2,signal=KILL,target=node;step=8,rank=1,stall"
    sim = ("+cluster=sim", "cluster.nodes=3", "cluster.min_nodes=2")
    fast = ("comm.hang_warn_s=2", "comm.timeout_s=6", "train.max_steps=30")
    result = run_launcher(*HEAL_JOB[1:], *sim, *fast, run_dir=tmp_path, env={"LAUNCHER_FAULT": faults}, timeout=120)
    err = result.stderr
    assert result.returncode == 1, err[-3000:]
    assert "launcher: lost node-2 (its agent was killed by SIGKILL): the survivors heal in place" in err, err[-3000:]
    hang = next(line for line in err.splitlines() if "hang:" in line)
    assert "hang: rank 1 (node 1, pid" in hang and "rank 0 waits in it" in hang, hang
    assert re.search(r'faults\.py", line \d+, in fire\n', err) and re.search(r'trainer\.py", line \d+, in _step', err)
    report = next(line for line in err.splitlines() if line.startswith("launcher: rank "))
    assert report.startswith("launcher: rank 1 (node 1, pid ") and " hung: " in report, report
    assert "Thread heal-watch" not in err  # the launcher's own threads are not where a rank is stuck
