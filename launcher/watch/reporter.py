"""The one place that compares the ranks' progress: rank 0's watch (rank 1's while rank 0 is silent, e.g.
stopped). Each beat it reads every rank's progress file and:

- names a hang once it has lasted ``comm.hang_warn_s``: asks every rank for its flight recorder and live stacks,
  waits for the answers (``ANSWER_WAIT_S`` at most: a stopped rank never answers), then prints the report,
  culprit first, on rank 0's console (the console of the command the user started, in every mode; Slurm streams
  rank 0's log) and writes ``RUN_DIR/hangs/<id>/report.json`` beside the dumps;
- reports it again, with fresh stacks, each time it has lasted twice as long, in a script's job without
  ``comm.timeout_s`` (the script's own process group timeout ends it, as under torchrun);
- at ``comm.timeout_s`` ends the job (the trainer's, or a script's when the user set it): failure records for
  the culprits (kind ``hang``, with their stacks) and for the ranks waiting for them (``peer``), then this process
  exits 1; the launcher ends the other ranks and its report leads with the culprit (``launcher.report.failures``);
  ``cluster.max_restarts`` applies as for any failure;
- names stragglers (``verdict.find_stragglers``) when they start and when they recover: console, ``metrics.jsonl``
  and, through ``stragglers()``, the run's ``summary.json``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any, Optional

from launcher.base import logs
from launcher.base.env import DistEnv
from launcher.base.errors import Kind
from launcher.base.files import read_bytes, write_json_atomic
from launcher.base.liveness import ANSWER_WAIT_S, SILENT_MIN_S, STALE_S
from launcher.base.run_dir import RunDir, progress_file, report_file, request_file, stack_file
from launcher.report.failures import Failure, record_exits
from launcher.watch.stragglers import Stragglers
from launcher.watch.verdict import Hang, find_hang

log = logging.getLogger("launcher.watch")


def group_label(name: str, progress: dict[str, Any]) -> str:
    group = progress.get("groups", {}).get(name, {})
    if group.get("desc") == "default_pg" or name == "0":
        return "the default group"
    members = group.get("members")
    if members is None:  # every rank of the job (the publisher leaves them out)
        return f"group {name[:12]} (every rank)"
    ranks = ",".join(map(str, members)) if len(members) <= 8 else f"{len(members)} ranks"
    return f"group {name[:12]} (ranks {ranks})"


def _state(progress: dict[str, Any]) -> str:
    """The process state letter (``T``: stopped) of a rank on this host, from /proc; "" when not known here."""
    if not progress or progress.get("host") != socket.gethostname():
        return ""
    try:
        return Path(f"/proc/{progress['pid']}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _ranks(numbers: tuple[int, ...] | list[int]) -> str:
    return ("rank " if len(numbers) == 1 else "ranks ") + ", ".join(map(str, numbers))


class Reporter:
    def __init__(  # noqa: PLR0913
        self,
        run_dir: RunDir,
        env: DistEnv,
        folder: Path,
        warn_s: float,
        timeout_s: Optional[float],
        round_: int = 0,
    ) -> None:
        self.run, self.env, self.dir = run_dir, env, folder
        # each report's folder: the attempt's, and the round's after a heal (a round's first report must not find
        # the stacks of an earlier round's in a folder of the same name)
        self.round = round_
        self.timeout_s = timeout_s  # None: a script's job, its own process group ends a hang (the watch names it)
        # a report (with stacks) always comes before the end
        self.warn_s = min(warn_s, 0.75 * timeout_s) if timeout_s is not None else warn_s
        self.again_s = 0.0  # without an end: the same hang is reported again once it has lasted this long
        # a stopped rank is named silent by the time its hang is reported, however short comm.timeout_s is
        self.stale_s = max(SILENT_MIN_S, min(STALE_S, self.warn_s))
        self.ranks: dict[int, dict[str, Any]] = {}
        self.paths: dict[int, str] = {}  # each rank's progress file (1,024 reads a second: no Path objects)
        self.request: dict[str, Any] | None = None
        self.reported: tuple[Any, ...] | None = None
        self.stacks: dict[int, str] = {}
        self.asked = 0
        self.stragglers = Stragglers(self.run, self.say, env.world_size)

    # ------------------------------------------------------------------------------------------------ beat
    def active(self) -> bool:
        """Rank 0 reports; rank 1 only while rank 0 is silent (stopped or frozen) and has not ended."""
        if self.env.rank == 0:
            return True
        zero = self.ranks.get(0)
        if zero is None or zero.get("ended"):
            return False
        return (time.time_ns() - zero["beat_ns"]) / 1e9 > STALE_S

    def tick(self, now_ns: int) -> None:
        self._read(0)
        if not self.active():  # the stand-in reads rank 0's progress only, until rank 0 falls silent
            return
        for rank in range(1, self.env.world_size):
            self._read(rank)
        if self.env.rank == 0:
            self.stragglers.update(self.ranks, self.dir, now_ns)
        hang = find_hang(self.ranks, self.env.world_size, now_ns, self.stale_s)
        if hang is None or hang.stalled_s < self.warn_s:  # moving: a stall shorter than warn_s is a new one
            if self.reported is not None:
                self.say("hang over: every rank is moving again")  # a later hang is reported anew
            self.reported, self.request = None, None
            return
        key = (hang.kind, hang.group, hang.seq, hang.culprits)
        if key != self.reported and self.request is None:
            self._ask(now_ns)
        if self.request is not None and self._answered(hang, now_ns):
            self._report(hang, now_ns)
            self.reported, self.request = key, None  # (_report set again_s)
        if self.reported == key and self.timeout_s is not None and hang.stalled_s >= self.timeout_s:
            self._end(hang)
        elif self.reported == key and self.timeout_s is None and hang.stalled_s >= self.again_s and not self.request:
            self._ask(now_ns)  # reported again, with fresh stacks, at twice the stall of the last report

    def _read(self, rank: int) -> None:
        path = self.paths.get(rank)
        if path is None:
            path = self.paths[rank] = str(progress_file(self.dir, rank))
        try:
            self.ranks[rank] = json.loads(read_bytes(path))
        except (OSError, ValueError):
            pass  # not written yet, or being replaced: the previous read stands

    def say(self, text: str) -> None:
        log.warning("%s", text)
        if self.env.rank != 0 and logs.console_fd is not None:  # the stand-in reporter: its stderr is its log
            os.write(logs.console_fd, f"[launcher] {text}\n".encode())

    # ------------------------------------------------------------------------------------------------ hangs
    def _ask(self, now_ns: int) -> None:
        self.asked += 1
        folder = self.run.hang(self.env.launch_id, self.env.attempt, self.round, self.asked)
        folder.mkdir(parents=True, exist_ok=True)
        self.request = {"id": self.asked, "dir": str(folder), "at_ns": now_ns}
        write_json_atomic(request_file(self.dir), self.request)

    def _answered(self, hang: Hang, now_ns: int) -> bool:
        assert self.request is not None
        folder = Path(self.request["dir"])
        wanted = set(hang.culprits) | {r for _, side in hang.sides for r in side[:1]}
        have = {r for r in wanted if stack_file(folder, r).exists()}
        return have == wanted or (now_ns - self.request["at_ns"]) / 1e9 >= ANSWER_WAIT_S

    def _stack(self, rank: int, folder: Path) -> str:
        path = stack_file(folder, rank)
        if path.exists():
            return path.read_text()
        return (
            f"(not taken: rank {rank} did not answer within {ANSWER_WAIT_S:.0f} s: stopped, or stuck holding the GIL)"
        )

    def _report(self, hang: Hang, now_ns: int) -> None:
        folder = Path(self.request["dir"]) if self.request else self.run.hangs
        self.stacks = {r: self._stack(r, folder) for r in {*hang.culprits, *(s[1][0] for s in hang.sides)}}
        lines = [self.headline(hang)]
        for rank in hang.culprits:
            if rank in hang.notes:
                stopped = _state(self.ranks.get(rank, {})) == "T"
                lines.append(f"  rank {rank} {hang.notes[rank]}" + (" (state T in /proc: stopped)" if stopped else ""))
        for rank in sorted(self.stacks, key=lambda r: (r not in hang.culprits, r)):
            lines.append(f"  stack of rank {rank} (live, every thread):")
            lines.extend("    " + line for line in self.stacks[rank].rstrip().splitlines())
        self.again_s = 2 * max(hang.stalled_s, self.warn_s, 1.0)  # without an end: the next report's stall
        end = (
            f"the job is ended at comm.timeout_s={self.timeout_s:.0f} s unless it moves on"
            if self.timeout_s is not None
            else f"reported again at {self.again_s:.0f} s; the script's own process "
            "group timeout ends it (comm.timeout_s=N ends it at N s)"
        )
        lines.append(f"  report and every rank's flight recorder: {folder}; {end}")
        self.say("\n".join(lines))
        write_json_atomic(
            report_file(folder),
            {
                "kind": hang.kind,
                "headline": lines[0],
                "culprits": [
                    {**self._ident(r), "note": hang.notes.get(r, ""), "stack": self.stacks.get(r, "")}
                    for r in hang.culprits
                ],
                "group": hang.group,
                "seq": hang.seq,
                "collective": hang.what,
                "waiting": list(hang.waiting),
                "sides": [{"collective": what, "ranks": list(ranks)} for what, ranks in hang.sides],
                "stalled_s": round(hang.stalled_s, 1),
                "time_ns": now_ns,
            },
        )

    def _ident(self, rank: int) -> dict[str, Any]:
        p = self.ranks.get(rank, {})
        task = f"task {rank} of Slurm job {self.env.launch_id}" if self.env.source == "slurm" else ""
        return dict(rank=rank, host=p.get("host", "?"), pid=p.get("pid", 0), node=p.get("node", 0), task=task)

    def who(self, rank: int) -> str:
        """As the launcher's failure report names a rank: Slurm task, node (of several) and pid, then host."""
        if rank not in self.ranks:
            return f"rank {rank}"
        return Failure(**self._ident(rank), kind=Kind.hang, summary="").who(with_node=self.env.num_nodes > 1)

    def headline(self, hang: Hang, ending: bool = False) -> str:
        """The report's first line: the culprit before any other rank."""
        kind, culprits, rest = self._parts(hang, ending)
        return f"{kind}: {culprits} {rest}"

    def _parts(self, hang: Hang, ending: bool) -> tuple[str, str, str]:
        """(kind, the culprits, what they did): the failure record names the culprit itself."""
        anchor = self.ranks.get(hang.waiting[0], {}) if hang.waiting else {}
        label = group_label(hang.group, anchor)
        culprits = ", ".join(self.who(r) for r in hang.culprits)
        if hang.kind == "desync":
            theirs = " vs ".join(what for what, _ in hang.sides)
            rest = f"in another collective than {_ranks(list(hang.sides[1][1]))} at #{hang.seq} of {label}: {theirs}"
            return "desync", culprits, rest
        others = [r for r in hang.waiting if r not in hang.culprits]
        waiters = f"{_ranks(others)} {'waits' if len(others) == 1 else 'wait'}" if others else "the others wait"
        what = f" ({hang.what})" if hang.what else ""
        late = f"after {hang.stalled_s:.0f} s (comm.timeout_s)" if ending else f"for {hang.stalled_s:.0f} s"
        verb = "has" if len(hang.culprits) == 1 else "have"
        rest = f"{verb} not entered collective #{hang.seq} of {label} {late}; {waiters} in it{what}"
        return ("deadlock" if hang.kind == "deadlock" else "hang"), culprits, rest

    def _end(self, hang: Hang) -> None:
        """Past comm.timeout_s: records naming the culprit first, then this rank exits; the launcher ends the rest."""
        kind, _, rest = self._parts(hang, ending=True)
        self.say(f"{self.headline(hang, ending=True)}; ending the job")
        now, nodes = time.time_ns(), self.env.num_nodes
        records = [
            Failure(
                **self._ident(r),
                kind=Kind.hang,
                nodes=nodes,
                summary=rest if kind == "hang" else f"{kind}: {rest}",
                traceback=(f"rank {r} {hang.notes[r]}\n" if r in hang.notes else "")
                + f"its stack when the hang was reported:\n{self.stacks.get(r)}",
                time_ns=now,
            )
            for r in hang.culprits
        ]
        waited = f"waited {hang.stalled_s:.0f} s in collective #{hang.seq} for {_ranks(list(hang.culprits))}"
        records += [
            Failure(**self._ident(r), kind=Kind.peer, nodes=nodes, summary=waited, time_ns=now)
            for r in hang.waiting
            if r not in hang.culprits
        ]
        record_exits(self.run.failure_attempt(self.env.launch_id, self.env.attempt), records)
        for rank in hang.culprits:  # a stopped process ignores the launcher's SIGTERM: end it here if it is ours
            if _state(self.ranks.get(rank, {})) == "T":
                os.kill(self.ranks[rank]["pid"], signal.SIGKILL)
        logging.shutdown()
        os._exit(1)
