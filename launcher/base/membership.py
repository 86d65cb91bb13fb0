"""The record of a several-node job's changes of machines: one line of ``membership.jsonl`` in the run dir per change
(``Change``), whichever way the job went on. Written by the launcher's head when it restarts a job on fewer (or
more) machines (``launch/nodes/restarts.py``), and by rank 0 when a job heals in place (``train/in_place.py``, from
the keeper's decision: ``heal.protocol.Decision.change``); the trainer copies them into ``summary.json``
(``membership``). It sits in the base, below both: a job that never heals records its restarts without the healing
package. No torch here."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from launcher.base.run_dir import RunDir


@dataclass(frozen=True)
class Change:
    step: Optional[int]  # the step the new world resumes from (the newest checkpoint's); None: from the start
    nodes_before: int
    nodes_after: int
    hosts_lost: list[str] = field(default_factory=list)
    hosts_joined: list[str] = field(default_factory=list)
    why: str = ""
    time: float = 0.0  # restart: when the head decided; in place: the loss, the earliest it can have happened
    how: str = "restart"  # restart: from the newest checkpoint; in place: healed or grown (launcher.train.in_place)
    fault_to_step_s: Optional[float] = None  # in place: from the loss to the survivors' first completed step
    answer_to_step_s: Optional[float] = None  # in place: from the joining machine's answer to the first step with it
    ready_to_step_s: Optional[float] = None  # in place: of which, from its ranks being ready (started, imported)


def write(run_dir: RunDir, change: Change) -> None:
    """Append one change to the run dir's record."""
    with open(run_dir.membership, "a", encoding="utf-8") as f:
        f.write(json.dumps(asdict(change)) + "\n")


def changes(run_dir: RunDir) -> list[dict[str, Any]]:
    """Every change recorded in the run dir, oldest first (for ``summary.json``)."""
    path = run_dir.membership
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
