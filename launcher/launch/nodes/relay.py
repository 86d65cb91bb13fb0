"""A stop told to the other machines of a job started by hand (``cluster.node_rank`` on each machine): no head stands
above them, so Ctrl-C, SIGTERM or SIGHUP reaches one machine's launcher only. That launcher writes the stop into the
rendezvous store node 0 hosts before its own ranks stop, and waits (up to ``STOP_SEEN_S``) until every other machine has
seen it; each other machine's agent looks at the store between its checks of the workers (every 0.1 s) and stops
its ranks with the same signal, as if it had been sent there. Without this a trainer's ranks would still agree on
the step (their stop collective), but their launchers would end as if the job had finished, and a script's ranks
would see their peers vanish and report a failure. The word is signed where the machines share a secret
(``LAUNCHER_SECRET``); without one the store of a job started by hand is not authenticated at all
(docs/security.md)."""

from __future__ import annotations

import contextlib
import signal
import sys
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from launcher.base.liveness import STOP_SEEN_S
from launcher.trust.secret import Secret
from launcher.trust.signed import SignedStore, guard

PREFIX = "launcher-stop"


class StopRelay:
    """The stop word of machine ``node`` of ``nodes`` in the rendezvous ``store``."""

    def __init__(self, store: dist.Store, node: int, nodes: int, secret: Optional[Secret]) -> None:
        self.store = guard(store, secret, PREFIX, "the rendezvous store")
        self.node, self.nodes = node, nodes
        self.heard: Optional[tuple[int, int]] = None  # (the machine, its signal) once another's stop was seen

    def tell(self, signum: int) -> None:
        """This machine was signalled: say so, then wait until every other machine has seen it."""
        if self.heard is not None:
            return  # (stopping on another machine's word: that one told)
        others = [f"seen/{k}" for k in range(self.nodes) if k != self.node]
        with contextlib.suppress(dist.DistError):  # (DistError: the store's machine is gone; its ranks too)
            self.store.set("stop", f"{self.node}:{int(signum)}")
            self.store.wait(others, timedelta(seconds=STOP_SEEN_S))

    def listen(self) -> Optional[tuple[int, int]]:
        """Another machine's stop, if it was told: ``(machine, signal)``, said once on the console."""
        if self.heard is not None:
            return self.heard
        with contextlib.suppress(dist.DistError, ValueError):  # (a value of another shape: not a stop)
            if not self.store.check(["stop"]):
                return None
            value = self.store.read("stop") if isinstance(self.store, SignedStore) else self.store.get("stop")
            node, signum = (int(x) for x in (value or b"-1:0").decode().split(":"))
            if node < 0 or node == self.node or signum not in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                return None
            self.store.set(f"seen/{self.node}", "1")
            self.heard = (node, signum)
            print(
                f"launcher: node {node} was stopped by {signal.Signals(signum).name}: stopping this machine's ranks",
                file=sys.stderr,
                flush=True,
            )
        return self.heard
