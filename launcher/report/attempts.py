"""A job's attempts: a job restarted after a failure (``cluster.max_restarts``, by the agents or by the head) runs
again as its next attempt. Each restart is announced as it happens (``restart_line``: the rank that ended the
attempt, by the root-cause rules of ``launcher.report.failures`` applied to that attempt's records, which attempt
starts, how many restarts are left), and every attempt is listed at the end: ``summary.json["attempts"]``
(``job_summary``), and the end-of-run lines when there was more than one (``attempt_lines``).

Where it comes from: as an attempt starts, each node's first rank writes a marker (``mark_start``: launch, attempt,
node, host, time; the trainer's rank 0 adds the step it resumed from), and each attempt's failure
records are in ``failures/<launch>/attempt-<n>/``. The head clears the markers as a run starts (``clear``: they
describe the newest run of the run dir, as ``summary.json`` does); under torchrun there is no head, and rank 0 lists
the attempts of its own launch."""

from __future__ import annotations

import datetime
import json
import shutil
import signal
import socket
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

from launcher.base.env import DistEnv
from launcher.base.files import write_json_atomic
from launcher.base.run_dir import RunDir
from launcher.report.failures import Failure, load_attempt, ranked
from launcher.report.stops import STOP_CODES
from launcher.report.summary import JobSummary


@dataclass(frozen=True)
class Marker:
    """One node's start of one attempt."""

    launch: str
    attempt: int
    node: int
    host: str
    time: float  # the wall clock at the start (seconds since the epoch)
    resumed_from_step: Optional[int] = None  # the trainer's rank 0: the checkpoint's step it resumed from


def mark_start(run_dir: RunDir, env: DistEnv, resumed_from_step: Optional[int] = None) -> None:
    """This node's start of its attempt (its first rank writes it); the trainer's rank 0 writes it again with the
    step of the checkpoint it resumed from."""
    host = env.hostname or socket.gethostname()
    marker = Marker(env.launch_id, env.attempt, env.node_rank, host, time.time(), resumed_from_step)
    path = run_dir.attempt_marker(marker.launch, marker.attempt, marker.node)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, asdict(marker))


def clear(run_dir: RunDir) -> None:
    """A run starts: the markers of the run dir's earlier run go (their attempts are in its summary.json)."""
    shutil.rmtree(run_dir.attempt_markers, ignore_errors=True)


def _markers(run_dir: RunDir, launch: Optional[str]) -> dict[tuple[str, int], list[Marker]]:
    found: dict[tuple[str, int], list[Marker]] = {}
    for path in run_dir.attempt_marker_files():
        try:
            marker = Marker(**json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):
            continue  # unreadable: the other markers still tell the story
        if launch is None or marker.launch == launch:
            found.setdefault((marker.launch, marker.attempt), []).append(marker)
    return dict(sorted(found.items(), key=lambda item: min(m.time for m in item[1])))


def describe(failure: Failure, nodes: bool) -> str:
    """``rank 1 (node 0, pid 4242) on box died with signal 9 (SIGKILL)``: who ended an attempt, and how."""
    what = failure.ended()
    return f"{failure.who(nodes)} {what}" + (f" {failure.summary}" if what == "failed:" else "")


def cause_of(failures: list[Failure]) -> str:
    """The rank that ended an attempt, by the root-cause rules applied to the attempt's records."""
    nodes = max((f.nodes for f in failures), default=1) > 1
    return describe(ranked(failures)[0], nodes) if failures else "no rank recorded a failure (see the rank logs)"


def restart_line(ended: int, cause: str, used: int, left: int, on: str = "") -> str:
    """The line that announces a restart: attempt ``ended`` ended (``cause``), the next starts (``on``: where),
    ``used`` restarts taken so far (this one included), ``left`` remain."""
    where = f" on {on}" if on else ""
    return (
        f"launcher: attempt {ended} ended: {cause}; restarting{where}: attempt {ended + 1} starts (restart {used} of "
        f"{used + left}, {left} left: cluster.max_restarts)"
    )


def _iso(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds).astimezone().isoformat(timespec="seconds")


def _cause(failure: Failure) -> dict[str, Any]:
    code = failure.exitcode
    known = code is not None and code < 0 and -code in {int(s) for s in signal.Signals}
    return {
        "rank": failure.rank,
        "node": failure.node,
        "host": failure.host,
        "pid": failure.pid,
        "kind": failure.kind.value,
        "signal": signal.Signals(-code).name if known and code is not None else None,
        "exit_code": code if code is not None and code >= 0 else None,
        "error": failure.summary,
    }


def attempts(run_dir: RunDir, code: int, launch: Optional[str] = None) -> list[dict[str, Any]]:
    """Every attempt of the run (of ``launch`` only, when given), oldest first; the last ended with exit ``code``."""
    found = list(_markers(run_dir, launch).items())
    starts = [min(m.time for m in markers) for _, markers in found]
    listed = []
    for index, ((launch_id, number), markers) in enumerate(found):
        failures = load_attempt(run_dir, launch_id, number)
        last = index == len(found) - 1
        end = time.time() if last else starts[index + 1]
        if failures and not last:  # (its first failure; else: when the next attempt started)
            end = min(f.time_ns for f in failures) / 1e9
        how = "failed" if not last else "finished" if code == 0 else "stopped" if _stopped(code) else "failed"
        resumed = [m.resumed_from_step for m in markers if m.resumed_from_step is not None]
        listed.append(
            {
                "attempt": number,
                "launch": launch_id,
                "start": _iso(starts[index]),
                "start_s": starts[index],
                "end": _iso(end),
                "end_s": end,
                "ended": how,
                "cause": _cause(ranked(failures)[0]) if failures and how == "failed" else None,
                "hosts": [m.host for m in sorted(markers, key=lambda m: m.node)],
                "resumed_from_step": resumed[0] if resumed else None,
            }
        )
    return listed


def _stopped(code: int) -> bool:
    return code in STOP_CODES


def attempt_lines(listed: list[dict[str, Any]]) -> list[str]:
    """The end-of-run lines for the attempts (none when there was one)."""
    if len(listed) < 2:
        return []
    lines = []
    for a in listed:
        cause = a["cause"]
        node = f" (node {cause['node']})" if cause and len(a["hosts"]) > 1 else ""  # as the restart's line names it
        why = f": rank {cause['rank']}{node} on {cause['host']} ({cause['error']})" if cause else ""
        resumed = f", resumed from step {a['resumed_from_step']}" if a["resumed_from_step"] is not None else ""
        lines.append(f"launcher: attempt {a['attempt']}: {a['start']} to {a['end']}{resumed}, {a['ended']}{why}")
    return lines


def script_line(entry: str, code: int, attempts_run: int, wall_s: float, run_dir: RunDir) -> str:
    """The line a ``script=`` job ends with, whatever its end (it has no trainer's table): how it ended, its
    attempts, its time, and where its run dir is."""
    how = "finished" if code == 0 else "stopped" if _stopped(code) else "failed"
    attempts_said = f"{attempts_run} attempt{'s' if attempts_run != 1 else ''}"
    return (
        f"launcher: script {entry}: {how}, exit code {code}, {attempts_said} in {wall_s:.1f} s; run dir {run_dir} "
        "(logs/rank-<k>.log, summary.json)"
    )


def end_of_job(  # noqa: PLR0913
    run_dir: RunDir,
    entry: str,
    layout: tuple[int, int],
    code: int,
    since: float,
    launch: Optional[str] = None,
    script: bool = False,
) -> list[str]:
    """The job (``layout``: nodes, ranks per node) ended with ``code`` (started at ``since``): its ``summary.json``
    gets the job's part (``JobSummary``), and the end-of-run lines for its attempts are returned, then a ``script``'s
    own end line (every script job's: ``script_line``)."""
    listed = attempts(run_dir, code, launch)
    hosts = listed[-1]["hosts"] if listed else []
    nodes, procs_per_node = len(hosts) or layout[0], layout[1]
    first = min((time.time(), since, *(a["start_s"] for a in listed)))  # torchrun: its earlier attempts
    wall_s = round(time.time() - first, 3)
    JobSummary(entry, nodes * procs_per_node, nodes, procs_per_node, hosts, wall_s, code, listed).write(run_dir, since)
    ending = [script_line(entry, code, max(1, len(listed)), wall_s, run_dir)] if script else []
    return attempt_lines(listed) + ending
