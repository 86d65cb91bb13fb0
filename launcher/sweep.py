"""``python -m launcher -m ... optim.lr=0.1,0.05``: Hydra runs one job per point, each in its own run dir.
Local and simulated points run one after the other; Slurm points are all submitted first, then waited for
together. At the end every point is reported with its result; the exit code is 0 only if all succeeded."""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

from .summary import RunSummary

POLL_S = 1.0  # how often the pending jobs are asked whether they are done


@dataclass
class _Point:
    label: str
    run_dir: str = ""
    code: Optional[int] = None
    submitted: Any = None


@dataclass
class Sweep:
    points: list[_Point] = field(default_factory=list)

    def point(self, label: str) -> Sweep:
        self.points.append(_Point(label or "(no overrides)"))
        return self

    def add(self, run_dir: str, code: Optional[int] = None, submitted: Any = None) -> None:
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
            tick.wait(POLL_S)
        for p in pending:
            p.code = p.submitted.finish()
        lines = ["[launcher] sweep results:"]
        for k, p in enumerate(self.points):
            lines.append(f"[launcher]   {k}: {p.label}: {_result(p)}  ({p.run_dir})")
        print("\n".join(lines), file=sys.stderr)
        return 0 if all(p.code == 0 for p in self.points) else 1


def _result(p: _Point) -> str:
    if p.code != 0:
        return f"FAILED (exit {p.code})"
    s = RunSummary.read(p.run_dir)
    if s is None:
        return "ok"
    acc = f", test accuracy {s.test_accuracy:.4f}" if s.test_accuracy is not None else ""
    return f"ok, final loss {s.final_loss:.4f}{acc}"
