"""``python -m launcher -m ... optim.lr=0.1,0.05``: Hydra runs one job per point, each in its own run dir.
Local and simulated points run one after the other; Slurm points are all submitted first, then waited for
together. At the end every point is reported with its result; the exit code is 0 only if all succeeded.

A stop signal to the sweep's head (SIGINT, SIGTERM, SIGHUP) stops the sweep: the point running stops as a job
does (its ranks checkpoint), no further point starts, the submitted Slurm jobs are stopped the same way (no
requeue), and the head exits 128 + the signal after reporting every point."""

from __future__ import annotations

import signal
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

from launcher.base.liveness import SWEEP_POLL_S
from launcher.base.run_dir import RunDir
from launcher.launch.nodes.control import Control
from launcher.report.stops import STOP_CODES, STOP_SIGNALS
from launcher.report.summary import RunSummary


@dataclass
class _Point:
    label: str
    run_dir: Optional[RunDir] = None  # None: its config was refused
    code: Optional[int] = None
    submitted: Any = None


@dataclass
class Sweep:
    points: list[_Point] = field(default_factory=list)
    stops: list[int] = field(default_factory=list)  # the stop signals the head got

    def point(self, label: str) -> Sweep:
        """The next point. The sweep's stop handler is (re)installed here: a point's mode installs its own while it
        runs (torch elastic's agent leaves its own behind)."""
        for s in STOP_SIGNALS:
            signal.signal(s, self._stop)
        self.points.append(_Point(label or "(no overrides)"))
        return self

    def should_end(self, code: int) -> bool:
        """After a point ended with ``code``: a stop (the head's signal, or the point's own stop) ends the sweep."""
        if not self.stops and code in STOP_CODES:
            self.stops.append(code - 128)  # the point's mode caught the signal
        return bool(self.stops)

    def _stop(self, signum: int, frame: Any) -> None:
        if not self.stops:
            print(
                f"launcher: {signal.Signals(signum).name}: stopping the sweep (no further point starts; its "
                "submitted Slurm jobs checkpoint and are not requeued)",
                file=sys.stderr,
            )
            for p in self.points:
                if p.submitted is not None and not p.submitted.done():
                    p.submitted.stop(Control.stop_for(signum))
        self.stops.append(signum)

    def add(self, run_dir: Optional[RunDir], code: Optional[int] = None, submitted: Any = None) -> None:
        """``submitted``: a pending job (``done()``, ``finish()``, ``job_id``) of a batch mode."""
        p = self.points[-1]
        p.run_dir, p.code, p.submitted = run_dir, code, submitted

    def finish(self) -> int:
        pending = [p for p in self.points if p.submitted is not None and p.code is None]
        if pending:
            print(
                f"[launcher] waiting for {len(pending)} Slurm job(s): "
                + ", ".join(p.submitted.job_id for p in pending),
                file=sys.stderr,
            )
        tick = threading.Event()
        while not all(p.submitted.done() for p in pending):
            tick.wait(SWEEP_POLL_S)
        for p in pending:
            p.code = p.submitted.finish()
        lines = ["[launcher] sweep results:"]
        for k, p in enumerate(self.points):
            lines.append(f"[launcher]   {k}: {p.label}: {_result(p)}  ({p.run_dir or ''})")
        if self.stops:
            lines.append(
                f"[launcher] the sweep was stopped by {signal.Signals(self.stops[0]).name}: later points not run"
            )
        print("\n".join(lines), file=sys.stderr)
        if self.stops:
            return 128 + self.stops[0]
        return 0 if all(p.code == 0 for p in self.points) else 1


def _result(p: _Point) -> str:
    if p.code is not None and p.code > 128:
        return f"stopped by {signal.Signals(p.code - 128).name} (exit {p.code})"
    if p.code != 0:
        return f"FAILED (exit {p.code})"
    s = RunSummary.read(p.run_dir) if p.run_dir is not None else None
    if s is None:
        return "ok"
    acc = "".join(f", test {k} {v:.4f}" for k, v in s.scores.items() if v is not None)
    return f"ok, final loss {s.final_loss:.4f}{acc}"
