"""The keeper's rules (``keeper.py``): the nodes of each round of process groups. No torch, no store: pure rules.

Round 0 is every node started; each loss ends a round and names the next one's members in the order started (a
node's ranks keep their order), or none when fewer than ``min_nodes`` would be left (the job then stops); a machine
that answers again ends a round too, joining the next one last (every other rank keeps its place, rank 0 and its
console included)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from launcher.heal.protocol import Decision


@dataclass
class Rounds:
    names: list[str]
    min_nodes: int
    number: int = 0
    live: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.live = self.live or list(self.names)

    def lose(self, lost: dict[str, str], fault_time: float) -> Optional[Decision]:
        """End the round without the ``lost`` nodes (name -> why), lost at ``fault_time`` (seconds since the epoch,
        the earliest the loss can have happened); None when none of them is in the round."""
        lost = {name: why for name, why in lost.items() if name in self.live}
        if not lost:
            return None
        after = [name for name in self.live if name not in lost]
        if len(after) >= self.min_nodes:
            return self._next(after, after, lost=lost, fault_time=fault_time)
        stop = f"{len(after)} node(s) left, fewer than cluster.min_nodes={self.min_nodes}"
        return self._next([], after, lost=lost, fault_time=fault_time, stop=stop)

    def join(self, name: str, answer_time: float, ready_time: Optional[float] = None) -> Optional[Decision]:
        """End the round with ``name`` joining it last (its machine answered again at ``answer_time``, its ranks
        were ready at ``ready_time``); None when it is in already."""
        if name in self.live:
            return None
        members = [*self.live, name]
        return self._next(members, members, joined=(name,), answer_time=answer_time, ready_time=ready_time)

    def _next(self, members: list[str], live: list[str], **change: Any) -> Decision:
        decision = Decision(round=self.number + 1, members=tuple(members), before=tuple(self.live), **change)
        self.number, self.live = self.number + 1, live
        return decision
