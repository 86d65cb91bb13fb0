"""The machines each attempt of a several-node job runs on (``Membership``, the head's view) and the restart policy
(``cluster.max_restarts``, ``cluster.min_nodes``), where restarts live: beside the one attempt loop
(``attempts.py``) that asks it after every failed attempt.

A job started on ``cluster.nodes`` machines keeps going on fewer when machines are lost, down to
``cluster.min_nodes``, one of two ways (``config.rules.heals_in_place`` says which). The restart: the launcher's
head (``+cluster=sim``, ``+cluster=ssh``) sees which node was lost (its agent killed, its ssh connection dropped, or
it fails the host checks before a restart), restarts the job on the survivors (``Membership.again``,
``Membership.change``), and the ranks resume from the newest checkpoint on the smaller world (the global batch, and
so the trajectory, is unchanged: ``launcher.train.saving``); a machine that answers the checks again joins at the
next restart. Healing in place (the built-in trainer, ``launcher.heal``): the keeper decides the rounds, the
survivors go on in the same processes, and the head follows each decision (``Membership.apply``). Each change is one
line of ``membership.jsonl`` (``base/membership.py``). The restart policy is the launcher's own, no part of the healing
package: a keeper's decision reaches it only through ``apply``. No torch here.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

from launcher.base import membership
from launcher.base.checkpoint_names import newest_step
from launcher.base.run_dir import RunDir
from launcher.heal.protocol import Decision
from launcher.report.attempts import cause_of, restart_line
from launcher.report.failures import Failure


class Membership:
    """The head's view: the nodes (host names, or ``node-K`` for simulated ones) the next attempt runs on. It changes
    only through its methods: ``again`` after a failed attempt, ``change`` (the host checks), ``apply`` (the
    keeper's decision, healing in place)."""

    def __init__(self, run_dir: RunDir, names: list[str], min_nodes: int, max_restarts: int) -> None:
        self.run_dir, self.min_nodes, self.max_restarts = run_dir, min_nodes, max_restarts
        self._all, self._live = list(names), list(names)
        self._attempt = 0
        self._spent = 0

    @property
    def all(self) -> list[str]:
        """Every node the job has run on, in the order listed (then joined)."""
        return list(self._all)

    @property
    def live(self) -> list[str]:
        """The nodes the next attempt runs on (healing in place: the running round's)."""
        return list(self._live)

    @property
    def attempt(self) -> int:
        """0-based number of the next attempt (the workers' DistEnv.attempt: faults' attempt=)."""
        return self._attempt

    @property
    def spent_restarts(self) -> int:
        """Restarts after failures, counted against max_restarts (a loss spends none)."""
        return self._spent

    def again(self, lost: dict[str, str], where: str, failures: Sequence[Failure] = ()) -> bool:
        """After a failed attempt (its ranks' ``failures``): go on without the ``lost`` nodes (name -> why) if
        enough are left, else restart on every node while ``max_restarts`` allows (said with the attempt's cause,
        naming ``where``: host / node). False: the job ends."""
        ended, self._attempt = self._attempt, self._attempt + 1
        if self.may_shrink and lost and self.change(lost):
            return True
        if self._spent == self.max_restarts:
            return False
        self._spent += 1
        lost_ones = "; ".join(f"{where} {name} lost ({why})" for name, why in lost.items())
        cause = lost_ones or cause_of(list(failures))
        print(
            restart_line(ended, cause, self._spent, self.max_restarts - self._spent, f"every {where}"), file=sys.stderr
        )
        return True

    def apply(self, decision: Decision) -> bool:
        """The keeper's ``decision`` (healing in place), said; the next restart (if any) runs on its members. False
        when too few nodes are left (the job stops; no restart either). The ranks record the change themselves."""
        names = ", ".join(f"{n} ({why})" for n, why in decision.lost.items())
        if decision.stop:
            print(f"launcher: lost {names}: {decision.stop}; the job stops", file=sys.stderr)
            self._spent = self.max_restarts  # too few machines: no restart either
            return False
        self._live = list(decision.members)
        self._all += [name for name in decision.joined if name not in self._all]
        what = f"lost {names}: the survivors heal in place" if names else f"{', '.join(decision.joined)} joined"
        print(
            f"launcher: {what}, continuing on {len(self._live)} of {len(self._all)} nodes (round {decision.round}, "
            f"cluster.min_nodes={self.min_nodes})",
            file=sys.stderr,
        )
        return True

    @property
    def may_shrink(self) -> bool:
        """``cluster.min_nodes`` < the nodes listed: the job may go on with fewer (``ClusterConfig.may_shrink``)."""
        return self.min_nodes < len(self._all)

    def change(self, lost: dict[str, str], joined: Sequence[str] = ()) -> bool:
        """Drop the ``lost`` nodes (name -> why) and add ``joined`` (in the listed order). True when the job goes
        on (recorded and said); False when fewer than ``min_nodes`` would be left (nothing changes)."""
        lost = {name: why for name, why in lost.items() if name in self._live}
        after = [n for n in self._all if (n in self._live or n in joined) and n not in lost]
        if not lost and after == self._live:
            return True
        names = ", ".join(f"{n} ({why})" for n, why in lost.items())
        if len(after) < self.min_nodes:
            print(
                f"launcher: lost {names}: {len(after)} node(s) left, fewer than cluster.min_nodes={self.min_nodes}; "
                "the job stops",
                file=sys.stderr,
            )
            return False
        step = newest_step(self.run_dir.checkpoints)
        came = [n for n in after if n not in self._live]
        record = membership.Change(
            step=step,
            nodes_before=len(self._live),
            nodes_after=len(after),
            hosts_lost=list(lost),
            hosts_joined=came,
            why="; ".join([*(f"{n}: {w}" for n, w in lost.items()), *(f"{n}: answers again" for n in came)]),
            time=time.time(),
        )
        membership.write(self.run_dir, record)
        what = [f"lost {names}"] if lost else []
        what += [f"{', '.join(came)} joined"] if came else []
        start = f"the newest checkpoint (step {step})" if step is not None else "the start (no checkpoint yet)"
        print(
            f"launcher: {'; '.join(what)}: continuing on {len(after)} of {len(self._all)} nodes from {start} "
            f"(cluster.min_nodes={self.min_nodes})",
            file=sys.stderr,
        )
        self._live = after
        return True
