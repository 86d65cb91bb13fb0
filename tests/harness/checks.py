"""What modules of more than one tier assert of a finished job: its final model (the same trajectory as another
run's, the same training state), that a resume trained nothing twice, the root cause named first, the hang named
live."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from harness.jobs import BOUND_S, IN_BACKWARD, MESSAGES, TIMEOUT_S, WARN_S
from harness.run import REPORT_S, Run


def assert_trained_once_up_to(run_dir, step):
    """The resume trained only the remaining steps: no train step up to ``step`` (the checkpoint it resumed from)
    was logged twice (a run that ignored the checkpoint would log them again; metrics.jsonl is appended to)."""
    steps = [
        r["step"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"
    ]
    again = sorted({s for s in steps if s <= step and steps.count(s) > 1})
    assert not again, f"steps {again} were trained again after resuming from step {step}: {steps}"
    assert max(steps) > step, steps


def assert_same_trajectory(a, b):
    """Two runs' final models equal up to float32 summation order: rtol 1e-4, atol 5e-5 (2e-5 seen on a near-zero
    conv weight after 20 steps of SGD with momentum on some CPUs, whose vectorised sums differ); one different
    sample would give far more."""
    for name in a["model"]:
        torch.testing.assert_close(
            a["model"][name], b["model"][name], rtol=1e-4, atol=5e-5, msg=lambda m, name=name: f"{name}: {m}"
        )


def final_state(run_dir):
    path = sorted((run_dir / "checkpoints").glob("step-*.pt"))[-1]
    return torch.load(path, weights_only=True)


def assert_same_training_state(a, b):
    assert a["step"] == b["step"]
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), f"parameter {name} differs"
    for key, sa in a["optimizer"]["state"].items():
        assert torch.equal(sa["momentum_buffer"], b["optimizer"]["state"][key]["momentum_buffer"])


def expect_root_cause(
    code: int, stderr: str, reported_at: float, run_dir: Path, rank: int, kind: str, where: str
) -> None:
    """The job failed, the report names ``rank`` first with its own error (``MESSAGES[where][kind]``, from where
    it was raised), once, within REPORT_S of its record."""
    assert code == 1, stderr[-3000:]
    heads = re.findall(r"^launcher: rank (\d+) \(.*$", stderr, re.M)
    assert heads[:1] == [str(rank)], f"expected rank {rank} named first:\n{stderr[-3000:]}"
    assert len(heads) == 1, f"more than one report:\n{stderr[-3000:]}"
    report = stderr[stderr.index("launcher: rank ") :]
    cause = report.split("launcher: log of rank")[0]
    assert MESSAGES[where][kind].format(r=rank) in cause, f"rank {rank}'s own error missing from the report:\n{report}"
    if kind == "trainer" and where != "before":  # one message: the traceback says where it fired
        assert (IN_BACKWARD in cause) == (where == "inside"), f"not raised {where} collectives:\n{cause}"
    assert f"log of rank {rank}: {run_dir}/logs/rank-{rank}.log" in report
    assert "Connection closed by peer" not in cause  # peers come after
    record = json.loads(next(run_dir.glob(f"failures/*/attempt-*/rank-{rank}.json")).read_text())
    assert record["kind"] == "error", record
    delay = reported_at - record["time_ns"] / 1e9
    assert 0 <= delay < REPORT_S, f"report {delay:.1f} s after the failure"


def assert_hang_named(
    run: Run, run_dir: Path, culprit: int, host: str, waiting: list[int], who: str, frame: str
) -> None:
    """The job failed; the console names the hang at comm.hang_warn_s, ``culprit`` (on ``host``) first, with
    ``frame`` in its live stack; the failure report leads with it, ``hung:``, then lists the ``waiting`` ranks
    (``who``: a regex of what both say between "rank N (" and ") on HOST"); report.json says the same; in time."""
    console = run.console
    print(f"exit {run.code} after {run.wall_s:.1f} s")
    assert run.code != 0, console[-4000:]
    # the live report: the culprit first, named as the failure report names it, then the ranks waiting for it
    warned_at, line = run.first(r"\bhang: ")
    others = f"rank {waiting[0]} waits" if len(waiting) == 1 else f"ranks {', '.join(map(str, waiting))} wait"
    named = rf"hang: rank {culprit} \({who}\) on {re.escape(host)} has not entered collective #\d+ "
    assert re.search(rf"{named}of the default group for \d+ s; {others} in it \(", line), line
    assert line.index(f"rank {culprit} ") < line.index(others), line
    # the failure report: the culprit first, "hung:"; then the ranks that waited for it
    reported_at, head = run.first(r"^launcher: rank \d+ \(")
    print(f"hang named after {warned_at:.1f} s, failure report after {reported_at:.1f} s")
    assert re.match(rf"launcher: rank {culprit} \({who}\) on {re.escape(host)} hung: has not entered", head), head
    # named live, at comm.hang_warn_s: well before the end at comm.timeout_s (on Slurm too, through rank 0's log)
    assert reported_at - warned_at > (TIMEOUT_S - WARN_S) / 2, (warned_at, reported_at)
    live = console[console.index(line) : console.index(head)]
    assert f"  stack of rank {culprit} (live, every thread):" in live and re.search(frame, live), live[-4000:]
    for wrapper in (
        "submitit/core",
        "hydra/",
        "runpy",
        "launcher/commands/cli.py",
    ):  # what only carries a rank to its work
        assert wrapper not in live.split("  stack of rank")[1], live[-4000:]
    after = console[console.index(head) :]
    for rank in waiting:
        peer = rf"^launcher: failed too: rank {rank} on .*after a peer failed \(waited \d+ s in collective #\d+ for "
        assert re.search(rf"{peer}rank {culprit}\)", after, re.M), after[-4000:]
    # the files: one report, the culprit first, with its host and its stack
    (report_path,) = run_dir.glob("hangs/*/report.json")
    report = json.loads(report_path.read_text())
    assert report["kind"] == "hang" and report["waiting"] == waiting, report
    assert (report["culprits"][0]["rank"], report["culprits"][0]["host"]) == (culprit, host), report["culprits"]
    assert re.search(frame, report["culprits"][0]["stack"]), report["culprits"][0]["stack"]
    # ended by the watch at comm.timeout_s (a script's own process group would wait 30 minutes): the report
    # follows the hang's naming by about comm.timeout_s - comm.hang_warn_s (6 s; the bound is 3x); the whole run,
    # start-up included, typically 25 s (on a loaded box up to 45 s: the bound is 3x the typical)
    assert reported_at - warned_at < 3 * (TIMEOUT_S - WARN_S), (warned_at, reported_at)
    assert run.wall_s < BOUND_S, f"{run.wall_s:.0f} s (hang named after {warned_at:.0f} s, report {reported_at:.0f} s)"
