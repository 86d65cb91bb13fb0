"""The progress watch (launcher/watch): the rules on hand-made progress (no processes), then real jobs on this host
(script= and the trainer) that hang, desync, stop a rank or slow one down; each asserts the culprit is named first,
with its host and a frame of its stack, in bounded time; and a script stuck on the second of two simulated nodes (no
test bed needed). Over ssh: tests/beds/test_hang_clusters.py; on Slurm: tests/beds/test_slurm.py."""

from __future__ import annotations

import json
import re
import socket
import time

from harness.checks import assert_hang_named
from harness.jobs import STUCK, STUCK_FRAME, WATCH
from harness.run import run_launcher, run_timed
from launcher.base.run_dir import RunDir
from launcher.watch.verdict import find_hang, find_stragglers

NOW = 1_000_000 * 10**9
SCRIPT = "script=tests/scripts/hang_script.py"


def progress(rank, groups, beat_s=0.0, progress_s=-70.0, ended=""):
    """One rank's published progress: ``groups`` maps a group to (members, enqueued, completed, waiting what)."""
    return {
        "rank": rank,
        "host": f"h{rank}",
        "pid": 100 + rank,
        "beat_ns": NOW + int(beat_s * 1e9),
        "progress_ns": NOW + int(progress_s * 1e9),
        "ended": ended,
        "groups": {
            name: {
                "members": members,
                "enqueued": enq,
                "completed": done,
                "waiting": {"seq": done + 1, "what": what, "prev": "ar", "since_ns": NOW - 70 * 10**9}
                if enq > done
                else None,
            }
            for name, (members, enq, done, what) in groups.items()
        },
    }


def test_the_rank_that_has_not_entered_is_the_culprit():
    ranks = {r: progress(r, {"0": ([0, 1, 2], 6, 5, "ar")}) for r in (0, 2)}
    ranks[1] = progress(1, {"0": ([0, 1, 2], 5, 5, "")})
    hang = find_hang(ranks, 3, NOW, stale_s=10)
    assert hang is not None and hang.kind == "hang" and hang.culprits == (1,) and hang.waiting == (0, 2)
    assert hang.seq == 6 and 69 < hang.stalled_s < 71 and "busy outside collectives" in hang.notes[1]


def test_an_op_a_peer_completed_is_not_the_one_waited_in():
    """Seen under load (the sim stall test): rank 0 enqueued #20 and #21 but its record shows #20 still open (gloo
    marks an async op's end when it is waited on), rank 1 completed #20 and stalls before #21. Rank 1 is the culprit
    for #21 (the empty culprit of a "deadlock" was printed)."""
    ranks = {0: progress(0, {"0": ([0, 1], 21, 19, "ar")}), 1: progress(1, {"0": ([0, 1], 20, 20, "")})}
    hang = find_hang(ranks, 2, NOW, stale_s=10)
    assert hang is not None and hang.kind == "hang" and hang.culprits == (1,) and hang.seq == 21


def test_the_culprit_is_followed_through_another_group():
    """Node-first hierarchy: rank 0 waits in the leader group for rank 2, which waits in its node group for 3."""
    ranks = {
        0: progress(0, {"lead": ([0, 2], 4, 3, "ar")}),
        2: progress(2, {"lead": ([0, 2], 3, 3, ""), "node1": ([2, 3], 8, 7, "ar")}),
        3: progress(3, {"node1": ([2, 3], 7, 7, "")}),
    }
    ranks[0]["groups"]["lead"]["waiting"]["since_ns"] = NOW - 80 * 10**9  # the oldest wait
    hang = find_hang(ranks, 4, NOW, stale_s=10)
    assert hang is not None and hang.culprits == (3,) and hang.group == "lead"


def test_silent_ended_and_missing_ranks_are_said_so():
    ranks = {0: progress(0, {"0": ([0, 1, 2], 6, 5, "ar")}), 1: progress(1, {"0": ([0, 1, 2], 2, 2, "")}, -30)}
    hang = find_hang(ranks, 3, NOW, stale_s=10)
    assert hang is not None and hang.culprits == (1, 2)
    assert "silent for 30 s" in hang.notes[1] and "reported no progress" in hang.notes[2]
    ranks[1]["ended"] = "returned"
    assert "ended (returned)" in find_hang(ranks, 3, NOW, stale_s=10).notes[1]


def test_nobody_waiting_is_no_hang():
    """Every rank paused together (a long evaluation everywhere): nobody is held up."""
    ranks = {r: progress(r, {"0": ([0, 1], 5, 5, "")}) for r in (0, 1)}
    assert find_hang(ranks, 2, NOW, stale_s=10) is None


def test_desync_minority_and_tie():
    three = {r: progress(r, {"0": ([0, 1, 2], 6, 5, "ar")}) for r in (0, 1)}
    three[2] = progress(2, {"0": ([0, 1, 2], 6, 5, "bcast")})
    hang = find_hang(three, 3, NOW, stale_s=10)
    assert hang.kind == "desync" and hang.culprits == (2,) and hang.sides[1] == ("ar", (0, 1))
    # two ranks: the one that left the op both ran before is the culprit (it skipped a collective)
    two = {0: progress(0, {"0": ([0, 1], 10, 9, "ar")}), 1: progress(1, {"0": ([0, 1], 10, 9, "barrier")})}
    assert find_hang(two, 2, NOW, stale_s=10).culprits == (1,)


def arrivals(ranks, steps, late, step_ns=100_000_000, per_step=("bucket", "flag")):
    """rank -> {seq: (time, signature)}: ``late`` maps a rank to how late (ns) it enters each step's collectives."""
    out = {r: {} for r in range(ranks)}
    seq = 0
    for step in range(steps):
        for k, what in enumerate(per_step):
            seq += 1
            for r in range(ranks):
                jitter = (step * 7919 + r * 104729 + k) % 5_000_000  # deterministic noise, 5 ms at most
                out[r][seq] = (step * step_ns + k * 1000 + jitter + late.get(r, 0), what)
    return out


def test_straggler_named_with_its_share_and_a_clean_run_names_none():
    found = find_stragglers(arrivals(4, 40, {2: 40_000_000}), window_s=15, min_share=0.2)
    assert [s.rank for s in found] == [2] and 0.35 < found[0].share < 0.45
    assert find_stragglers(arrivals(4, 40, {}), window_s=15, min_share=0.2) == []
    assert find_stragglers(arrivals(4, 40, {2: 10_000_000}), window_s=15, min_share=0.2) == []  # 10 %: not enough
    # 40 % of the step but 40 ms only, under a floor of 50 ms: noise, not named (the watch's floor: 10 ms)
    assert find_stragglers(arrivals(4, 40, {2: 40_000_000}), window_s=15, min_share=0.2, min_late_s=0.05) == []


# ------------------------------------------------------------------------------------------------ real jobs
def reporter_over(timeout_s, tmp_path, monkeypatch, seconds=600):
    """A Reporter (rank 0's) fed by hand: rank 0 waits in collective #6 from t=0 on, rank 1 never enters it but
    keeps beating (busy in its own code); ``tick`` each second for ``seconds``. Returns the reports said (time,
    text) and when the job was ended (None: never)."""
    from launcher.base.env import DistEnv
    from launcher.watch.reporter import Reporter

    said, ended = [], []
    reporter = Reporter(RunDir(tmp_path), DistEnv(rank=0, world_size=2), tmp_path, 2.0, timeout_s)
    monkeypatch.setattr(reporter, "_read", lambda rank: None)
    monkeypatch.setattr(reporter, "_end", lambda hang: ended.append(now))
    monkeypatch.setattr(reporter.stragglers, "update", lambda *a: None)
    for second in range(seconds):
        now = NOW + second * 10**9
        reporter.ranks = {r: progress(r, {"0": ([0, 1], 6 - r, 5, "ar")}, progress_s=0.0) for r in (0, 1)}
        for r in (0, 1):
            reporter.ranks[r]["beat_ns"] = now
        monkeypatch.setattr(reporter, "say", lambda text, at=second: said.append((at, text)))
        reporter.tick(now)
        if ended:
            break
    return said, (ended[0] - NOW) / 1e9 if ended else None


def test_a_scripts_hang_is_named_again_and_again_but_never_ended_without_comm_timeout_s(tmp_path, monkeypatch):
    """A script's job without comm.timeout_s (issue 35): torchrun would let its process group wait 30 min (gloo),
    so the watch names the hang at comm.hang_warn_s (2 s; the stacks are waited for 6 s) and again each time it
    has lasted twice as long, and never ends the job; with a timeout (the trainer's, or set) it ends it then."""
    said, ended = reporter_over(None, tmp_path, monkeypatch)
    assert ended is None
    at = [second for second, text in said if text.startswith("hang: rank 1 ")]
    assert at == [8, 22, 50, 106, 218, 442], said  # asked at 2, 16, 44, 100, 212, 436 s: answers waited 6 s
    assert "the script's own process group timeout ends it (comm.timeout_s=N ends it at N s)" in said[0][1]
    said, ended = reporter_over(30.0, tmp_path, monkeypatch)
    assert ended == 30.0 and [second for second, text in said if text.startswith("hang: ")] == [8], said
    assert "the job is ended at comm.timeout_s=30 s unless it moves on" in said[0][1]


FAST = ("comm.hang_warn_s=3", "comm.timeout_s=8")


def first_line_with(text: str, needle: str) -> str:
    return next(line for line in text.splitlines() if needle in line)


def assert_named_first(err: str, culprit: int, waiting: int, kind: str = "hang:") -> str:
    line = first_line_with(err, kind)
    assert line.index(f"rank {culprit} ") < line.index(f"rank {waiting} "), line
    report = first_line_with(err, "launcher: rank ")
    assert report.startswith(f"launcher: rank {culprit} (pid ") and " hung: " in report, report
    assert f"launcher: failed too: rank {waiting} " in err and "after a peer failed (waited" in err
    return line


def test_script_rank_stuck_in_user_code(tmp_path):
    start = time.monotonic()
    result = run_launcher(SCRIPT, *FAST, run_dir=tmp_path, env={"HANG_CASE": "stuck"}, timeout=120)
    took = time.monotonic() - start
    err = result.stderr
    assert result.returncode == 1, err
    line = assert_named_first(err, culprit=1, waiting=0)
    assert "has not entered collective #6 of the default group" in line and "(gloo:all_reduce [[1000]] Float)" in line
    assert re.search(r'hang_script\.py", line \d+, in stuck_in_user_code\n\s+time\.sleep\(1\)', err), err
    assert took < 45, took  # typical 12-15 s: start-up, the end at comm.timeout_s=8 s, the report (3x and more)
    (folder,) = (tmp_path / "hangs").iterdir()
    report = json.loads((folder / "report.json").read_text())
    assert report["culprits"][0]["rank"] == 1 and "stuck_in_user_code" in report["culprits"][0]["stack"]
    for rank in (0, 1):  # every rank's flight recorder, the culprit's included
        dump = json.loads((folder / f"rank-{rank}.fr.json").read_text())
        assert any(e["profiling_name"] == "gloo:all_reduce" for e in dump["entries"])
    assert err.index("hang: rank 1") < err.index("launcher: rank 1")  # the warning came first, at hang_warn_s


def test_script_skipped_collective_is_a_desync(tmp_path):
    result = run_launcher(SCRIPT, *FAST, run_dir=tmp_path, env={"HANG_CASE": "skip"}, timeout=120)
    err = result.stderr
    assert result.returncode == 1, err
    line = first_line_with(err, "desync:")
    assert line.index("rank 1 ") < line.index("rank 0 ") and "gloo:barrier [] vs gloo:all_reduce [[1000]]" in line
    assert re.search(r'hang_script\.py", line \d+, in main\n\s+dist\.barrier\(\)', err), err
    assert first_line_with(err, "launcher: rank ").startswith("launcher: rank 1 (pid ")


def test_trainer_stalled_rank_named_first(tmp_path):
    result = run_launcher(
        *FAST, "train.max_steps=30", run_dir=tmp_path, env={"LAUNCHER_FAULT": "step=5,rank=1,stall"}, timeout=120
    )
    err = result.stderr
    assert result.returncode == 1, err
    assert_named_first(err, culprit=1, waiting=0)
    assert re.search(r'faults\.py", line \d+, in fire\n', err) and re.search(r'trainer\.py", line \d+, in _step', err)


def test_stopped_rank_named_without_a_stack(tmp_path):
    """SIGSTOP: the rank's watch is stopped too; it is named from its silence, and ended by the watch."""
    result = run_launcher(
        *FAST, "train.max_steps=30", run_dir=tmp_path, env={"LAUNCHER_FAULT": "step=5,rank=1,signal=STOP"}, timeout=120
    )
    err = result.stderr
    assert result.returncode == 1, err
    assert_named_first(err, culprit=1, waiting=0)
    assert "rank 1 has been silent for" in err and "(state T in /proc: stopped)" in err
    assert "(not taken: rank 1 did not answer within 6 s" in err


def test_pauses_on_every_rank_and_a_clean_run_say_nothing(tmp_path):
    env = {"HANG_CASE": "pauses", "HANG_PAUSE_S": "4"}
    result = run_launcher(SCRIPT, "comm.hang_warn_s=2", run_dir=tmp_path, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "hang:" not in result.stderr and "straggler:" not in result.stderr and "desync:" not in result.stderr
    assert not (tmp_path / "hangs").exists()


def test_a_busy_rank_is_a_warning_and_the_job_goes_on_under_torchrun(tmp_path):
    """A rank busy in its own code (a checkpoint, an evaluation) for 14 s while the other waits: a script's job
    without comm.timeout_s is never ended by the watch (issue 35: its own group would wait 30 min); the hang is
    named at comm.hang_warn_s=2 (at a stall of 2-5 s, by load) and again at twice that stall, then "hang over"; the
    job finishes. Started by torchrun: the watch runs in every entry (rank_work starts it), and rank 0's console is
    torchrun's."""
    env = {"HANG_CASE": "busy", "HANG_PAUSE_S": "14", "HANG_STEPS": "250", "HANG_STEP_S": "0.01"}
    logs = f"--log-dir={tmp_path}/torchrun"  # torchrun's default: a torchelastic_* dir left in the temp dir
    torchrun = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", logs, "-m", "launcher")
    result = run_launcher(SCRIPT, "comm.hang_warn_s=2", run_dir=tmp_path, env=env, timeout=120, module=torchrun)
    err = result.stderr
    assert result.returncode == 0, err
    line = first_line_with(err, "hang: ")
    assert re.search(r"hang: rank 1 \(pid \d+\) on \S+ has not entered collective #6 of the default group", line), line
    stack = err.split("stack of rank 1 (live, every thread):")[1]
    assert re.search(r'hang_script\.py", line \d+, in main\n\s+time\.sleep\(', stack), err
    assert "cli.py" not in stack and "hydra" not in stack and "torchrun.py" not in stack, stack  # wrappers dropped
    assert "the script's own process group timeout ends it (comm.timeout_s=N ends it at N s)" in err, err
    assert err.count("hang: ") >= 2 and "hang over: every rank is moving again" in err.split(line)[1], err
    assert "launcher: rank" not in err  # no failure report


def test_script_straggler_named_and_clean_ranks_not(tmp_path):
    env = {"HANG_CASE": "slow", "HANG_STEPS": "300", "HANG_STEP_S": "0.02", "HANG_FACTOR": "2.5", "HANG_FROM": "50"}
    result = run_launcher(SCRIPT, run_dir=tmp_path, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    line = first_line_with(result.stderr, "straggler:")
    assert re.search(r"straggler: rank 1 on \S+ enters each step's collectives 0\.0\d\d s after the others", line)
    events = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [e["rank"] for e in events if e["kind"] == "straggler"] == [1]


def test_trainer_straggler_in_summary(tmp_path):
    """Rank 1 spends 30 ms more on every step from step 100 (``delay``: a lateness that does not shrink with the
    machine's speed; ``slow=2`` added one step's compute, under the 10 ms a straggler must lag on a fast box)."""
    fault = {"LAUNCHER_FAULT": "step=100,rank=1,delay=0.03"}  # 400 steps of ~35 ms: longer than the 15 s window
    result = run_launcher("train.max_steps=500", "train.epochs=100", run_dir=tmp_path, env=fault)
    assert result.returncode == 0, result.stderr
    named = json.loads((tmp_path / "summary.json").read_text())["stragglers"]
    slowed = [e for e in named if e["rank"] == 1]  # on a loaded machine it may recover and lag again
    assert slowed, named
    # before the fault only: on a loaded machine rank 0 (the console, the metrics) may lag a few ms for a while
    assert all(e["from_step"] < 100 for e in named if e["rank"] != 1), named
    # the episode that holds the fault: on a loaded machine rank 1 may already lag before step 100 and stay named
    covering = [e for e in slowed if e["from_step"] <= 400 and (e["until_step"] is None or e["until_step"] > 200)]
    assert covering and covering[0]["share"] >= 0.2, named  # steps are noted every 0.25 s
    assert "straggler: rank 1 on " in result.stderr


def test_mismatched_shapes_name_the_rank_gloo_aborted_with_its_reason(tmp_path):
    """gloo notices sizes that differ and aborts the rank with the smaller tensor: the report says why, first."""
    result = run_launcher(SCRIPT, *FAST, run_dir=tmp_path, env={"HANG_CASE": "shape"}, timeout=120)
    err = result.stderr
    assert result.returncode == 1, err
    assert first_line_with(err, "launcher: rank ").startswith("launcher: rank 1 (pid ")
    assert "Is there a distributed collective mismatch in your code?" in err.split("launcher: failed too")[0]


def test_sim_script_stuck_on_the_second_node(tmp_path):
    """Simulated nodes (2 x 1 rank), the last rank stuck in its own code: the hang named live, the culprit first with
    its node and its live stack, then the failure report (the multi-node modes' check: tests/beds/test_hang_clusters.py
    over ssh, tests/beds/test_slurm.py on Slurm)."""
    sim = ("+cluster=sim", "cluster.nodes=2", "cluster.procs_per_node=1")
    run = run_timed([*sim, SCRIPT, *WATCH], tmp_path, {**STUCK, "HANG_RANK": "1"})
    assert_hang_named(run, tmp_path, 1, socket.gethostname(), [0], r"node 1, pid \d+", STUCK_FRAME)


def test_without_torchs_flight_recorder_the_watch_is_off_with_one_warning(tmp_path, monkeypatch, caplog):
    """On a torch whose flight recorder is not backend-neutral (before 2.8) the import must not fail every rank:
    rank 0 says once that the watch is off and why, and the job goes on without it (issue 35)."""
    from launcher import watch
    from launcher.base.env import DistEnv
    from launcher.watch import recorder

    monkeypatch.setattr(recorder, "MISSING", "torch 2.4.0 has no backend-neutral flight recorder (...)")
    with caplog.at_level("WARNING", logger="launcher.watch"):
        watches = [watch.start_watch(RunDir(tmp_path), DistEnv(rank=r, world_size=2), 60.0, None, 2000) for r in (0, 1)]
    assert [r.getMessage() for r in caplog.records] == ["torch 2.4.0 has no backend-neutral flight recorder (...)"]
    assert all(w.known_groups() == frozenset() and w.stragglers() == [] for w in watches)
    assert not any(w._current for w in watches)  # no watch thread
