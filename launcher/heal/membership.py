"""The machines a several-node job runs on, and its changes (``cluster.min_nodes``).

A job started on ``cluster.nodes`` machines keeps going on fewer when machines are lost, down to
``cluster.min_nodes``, one of two ways (``config.rules.heals_in_place`` says which). Healing in place (the built-in
trainer, ``launcher.heal``): the keeper decides the rounds, the survivors go on in the same processes, a machine
that answers again (ssh: the head's checks) joins them at a step boundary, and their rank 0 records each change.
The restart: the launcher's head (``+cluster=sim``, ``+cluster=ssh``) sees which node was lost (its agent killed,
its ssh connection dropped, or it fails the host checks before a restart), restarts the job on the survivors
(``Membership``), and the ranks resume from the newest checkpoint on the smaller world (the global batch, and so the
trajectory, is unchanged: ``launcher.train.saving``); a machine that answers the checks again joins at the next
restart. Each change is one line of ``membership.jsonl`` in the run dir; the trainer copies them into
``summary.json`` (``membership``).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from launcher.base.checkpoint_names import newest_step
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


def write(run_dir: str | Path, change: Change) -> None:
    """Append one change to the run dir's record."""
    with open(RunDir(run_dir).membership, "a", encoding="utf-8") as f:
        f.write(json.dumps(asdict(change)) + "\n")


def changes(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every change recorded in the run dir, oldest first (for ``summary.json``)."""
    path = RunDir(run_dir).membership
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


class Membership:
    """The head's view: the nodes (host names, or ``node-K`` for simulated ones) the next attempt runs on."""

    def __init__(self, run_dir: str | Path, names: list[str], min_nodes: int, max_restarts: int) -> None:
        self.run_dir, self.all, self.min_nodes, self.max_restarts = Path(run_dir), list(names), min_nodes, max_restarts
        self.live = list(names)
        self.attempt = 0  # 0-based number of the next attempt (the workers' DistEnv.attempt: faults' attempt=)
        self.spent_restarts = 0  # restarts after failures, counted against max_restarts (a loss spends none)

    def again(self, lost: dict[str, str], where: str) -> bool:
        """After a failed attempt: go on without the ``lost`` nodes (name -> why) if enough are left, else restart
        on every node while ``max_restarts`` allows (said, naming ``where``: host / node). False: the job ends."""
        self.attempt += 1
        if self.may_shrink and lost and self.change(lost):
            return True
        if self.spent_restarts == self.max_restarts:
            return False
        self.spent_restarts += 1
        print(
            f"launcher: restarting the job on every {where} from the newest checkpoint (restart "
            f"{self.spent_restarts} of {self.max_restarts}, cluster.max_restarts)",
            file=sys.stderr,
        )
        return True

    @property
    def may_shrink(self) -> bool:
        """``cluster.min_nodes`` < the nodes listed: the job may go on with fewer (``ClusterConfig.may_shrink``)."""
        return self.min_nodes < len(self.all)

    def change(self, lost: dict[str, str], joined: Sequence[str] = ()) -> bool:
        """Drop the ``lost`` nodes (name -> why) and add ``joined`` (in the listed order). True when the job goes
        on (recorded and said); False when fewer than ``min_nodes`` would be left (nothing changes)."""
        lost = {name: why for name, why in lost.items() if name in self.live}
        after = [n for n in self.all if (n in self.live or n in joined) and n not in lost]
        if not lost and after == self.live:
            return True
        names = ", ".join(f"{n} ({why})" for n, why in lost.items())
        if len(after) < self.min_nodes:
            print(
                f"launcher: lost {names}: {len(after)} node(s) left, fewer than cluster.min_nodes={self.min_nodes}; "
                "the job stops",
                file=sys.stderr,
            )
            return False
        step = newest_step(RunDir(self.run_dir).checkpoints)
        came = [n for n in after if n not in self.live]
        record = Change(
            step=step,
            nodes_before=len(self.live),
            nodes_after=len(after),
            hosts_lost=list(lost),
            hosts_joined=came,
            why="; ".join([*(f"{n}: {w}" for n, w in lost.items()), *(f"{n}: answers again" for n in came)]),
            time=time.time(),
        )
        write(self.run_dir, record)
        what = [f"lost {names}"] if lost else []
        what += [f"{', '.join(came)} joined"] if came else []
        start = f"the newest checkpoint (step {step})" if step is not None else "the start (no checkpoint yet)"
        print(
            f"launcher: {'; '.join(what)}: continuing on {len(after)} of {len(self.all)} nodes from {start} "
            f"(cluster.min_nodes={self.min_nodes})",
            file=sys.stderr,
        )
        self.live = after
        return True
