"""The words of healing in place, typed: the keeper's decision (``Decision``), the keys of the keeper's store
(``Keys``), what the head says to the keeper (``LostWord``, ``JoinWord``) and the place a rank is told
(``Place``). Every side reads and writes them only through here. No torch.

The store: every key below lives under the attempt's prefix (``rendezvous.attempt_prefix``) in the keeper's
store, seen through the job's secret (``launcher.trust.signed.SignedStore``: a namespace only the job can name, every
value signed). A node process is known by ``node_id``: its node's name and which start of it this is in the
attempt (0: with the attempt; 1, 2, ...: joining later), so a cut-off process that answers again is never taken
for the one started after it."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Optional

from launcher.base.membership import Change

PLACE_ENV = "LAUNCHER_HEAL"  # a rank of a job that heals: JSON {"name": its node, "start": its node process's start}


def node_id(name: str, start: int) -> str:
    """A node process's name in the keeper's store: its node's ``name`` and its ``start`` in the attempt."""
    return f"{name}#{start}"


class Keys:
    """The keeper's store, key by key (values are signed; a counter is a signed decimal, never ``add``)."""

    @staticmethod
    def heartbeat(node: str) -> str:
        """A node process's heartbeat: its beat count."""
        return f"heal/heartbeat/{node}"

    @staticmethod
    def done(node: str) -> str:
        """A node process whose ranks ended (any way but lost): its silence is no loss."""
        return f"heal/done/{node}"

    @staticmethod
    def ready(node: str, local_rank: int) -> str:
        """One rank of a joining node process is set up and waits to be let in."""
        return f"heal/ready/{node}/{local_rank}"

    @staticmethod
    def joined(node: str) -> str:
        """A joining node process: the round it joins."""
        return f"heal/joined/{node}"

    @staticmethod
    def round_end(number: int) -> str:
        """The decision that ends round ``number``."""
        return f"heal/end/{number}"

    @staticmethod
    def checked_in(number: int, rank: int) -> str:
        """A member of round ``number`` arrived to form it."""
        return f"heal/in/{number}/{rank}"

    TRAINED = "heal/trained"  # the ranks trained every step: a machine still waiting to join need not


@dataclass(frozen=True)
class Decision:
    """The keeper's decision that ends round ``round - 1``: the next round's ``members`` (in rank order), who was
    ``before``, who was ``lost`` (name -> why) or ``joined``, when (a loss: ``fault_time``, the earliest it can have
    happened; a join: ``answer_time``, when the machine answered, and ``ready_time``, when its ranks were all started
    and ready: the keeper's decision), and ``stop``: why the job cannot go on ("")."""

    round: int
    members: tuple[str, ...]
    before: tuple[str, ...]
    lost: Mapping[str, str] = field(default_factory=dict)
    joined: tuple[str, ...] = ()
    fault_time: Optional[float] = None
    answer_time: Optional[float] = None
    ready_time: Optional[float] = None
    stop: str = ""

    @property
    def grows(self) -> bool:
        """No machine is lost: one joins (the ranks leave at a step boundary, nothing fails)."""
        return not self.lost and not self.stop

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Decision:
        raw = json.loads(data)
        return cls(
            round=int(raw["round"]),
            members=tuple(raw["members"]),
            before=tuple(raw["before"]),
            lost={str(k): str(v) for k, v in raw.get("lost", {}).items()},
            joined=tuple(raw.get("joined", ())),
            fault_time=raw.get("fault_time"),
            answer_time=raw.get("answer_time"),
            ready_time=raw.get("ready_time"),
            stop=str(raw.get("stop", "")),
        )

    def said(self) -> str:
        """``round 2 ended: lost node-1 (why); node-3 joined``."""
        lost = ", ".join(f"{name} ({why})" for name, why in self.lost.items())
        joined = ", ".join(self.joined)
        what = "; ".join(([f"lost {lost}"] if lost else []) + ([f"{joined} joined"] if joined else []))
        return f"round {self.round - 1} ended: {what}"

    @property
    def time(self) -> float:
        """When the change happened: the loss (the earliest it can have), or the joining machine's answer."""
        return float(self.fault_time if self.fault_time is not None else self.answer_time or 0.0)

    def seconds_since(self) -> float:
        return round(time.time() - self.time, 3)

    def change(self, step: int, took: Optional[float]) -> Change:
        """The record of this change in ``membership.jsonl``, continued from ``step``, ``took`` s after it."""
        return Change(
            step=step,
            nodes_before=len(self.before),
            nodes_after=len(self.members),
            hosts_lost=list(self.lost),
            hosts_joined=list(self.joined),
            why="; ".join(
                [*(f"{n}: {why}" for n, why in self.lost.items()), *(f"{n}: answers again" for n in self.joined)]
            ),
            time=self.time,
            how="in place",
            fault_to_step_s=took if self.lost else None,
            answer_to_step_s=None if self.lost else took,
            ready_to_step_s=None
            if took is None or self.ready_time is None
            else round(took + self.time - self.ready_time, 3),
        )


@dataclass(frozen=True)
class LostWord:
    """The head to the keeper: a node is gone (its process ended by a signal nobody sent, its ssh link dropped)."""

    name: str
    at: float
    why: str

    def line(self) -> str:
        return f"LOST {self.name} {self.at:.3f} {self.why}"


@dataclass(frozen=True)
class JoinWord:
    """The head to the keeper: a lost machine answered again at ``at``; its node process (``start``, ``ranks``
    ranks) is starting and joins once they are all ready."""

    name: str
    start: int
    ranks: int
    at: float

    def line(self) -> str:
        return f"JOIN {self.name} {self.start} {self.ranks} {self.at:.3f}"


def parse_word(line: str) -> LostWord | JoinWord | None:
    """A line the head wrote to the keeper (None: not one of its words)."""
    word, _, rest = line.strip().partition(" ")
    if word == "LOST":
        name, at, why = rest.split(" ", 2)
        return LostWord(name, float(at), why)
    if word == "JOIN":
        name, start, ranks, at = rest.split(" ")
        return JoinWord(name, int(start), int(ranks), float(at))
    return None


ROUND_WORD = "ROUND"  # the keeper to the head, one line per decision: ``ROUND <decision json>``


@dataclass(frozen=True)
class Place:
    """What a rank of a job that heals is told by its node process: its node's ``name`` and the node process's
    ``start`` (above 0: it joins a job already running)."""

    name: str
    start: int = 0

    @property
    def joins(self) -> bool:
        return self.start > 0

    @property
    def node(self) -> str:
        return node_id(self.name, self.start)

    def environ(self) -> dict[str, str]:
        return {PLACE_ENV: json.dumps({"name": self.name, "start": self.start})}

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Optional[Place]:
        """This rank's place in a job that heals in place; None: the job does not heal."""
        raw = environ.get(PLACE_ENV)
        if not raw:
            return None
        place = json.loads(raw)
        return cls(str(place["name"]), int(place.get("start", 0)))
