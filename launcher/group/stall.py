"""Which rank is stuck? After a collective timed out, every rank that was waiting reports it on the rendezvous
store; the ranks that do not report within a grace time never reached the collective: they are the stuck ones."""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from launcher.base.env import DistEnv
from launcher.group.failed import CollectiveTimedOut, waited
from launcher.group.rendezvous import Group
from launcher.trust.signed import Forged


def timed_out(env: DistEnv, phase: str, timeout_s: float, group: Optional[Group]) -> CollectiveTimedOut:
    """The error a rank ends with when a collective of the trainer timed out (``failed.typed`` recognised torch's):
    where, after how long, and who is stuck (``explain_stall``, asked on ``group``'s store)."""
    return CollectiveTimedOut(
        f"rank {env.rank} on {env.hostname}: a collective at {phase} timed out after {timeout_s:.0f} s "
        f"(comm.timeout_s); {explain_stall(group, phase)}"
    )


def explain_stall(group: Optional[Group], where: str, grace_s: Optional[float] = None) -> str:
    """After a collective timed out: every rank that was waiting reports it on the store; the ranks that do not
    report within ``grace_s`` never reached the collective: they are the stuck ones. Returns the diagnosis.
    ``grace_s`` defaults to half the group's timeout, 2 to 10 s: the waiting ranks entered the collective within
    about a step of each other, so they time out about as close together."""
    if group is None:
        return "no rendezvous store to ask which rank is stuck"
    if grace_s is None:
        grace_s = min(10.0, max(2.0, group.timeout_s / 2))
    try:
        return _explain_stall(group, where, grace_s)
    except (dist.DistError, OSError, Forged) as exc:  # the store's host (rank 0) may be gone too; a value forged
        return f"the rendezvous store could not be asked which rank is stuck ({str(exc).splitlines()[0]})"


def _explain_stall(group: Group, where: str, grace_s: float) -> str:
    env, store = group.env, group.store
    host = env.hostname or socket.gethostname()
    store.set(f"timed-out/{env.rank}", f"{host}|{where}")
    keys = [f"timed-out/{r}" for r in range(env.world_size)]
    waited(store, keys, timedelta(seconds=grace_s))  # (who did not report within it is asked below)
    stuck = [r for r in range(env.world_size) if not store.check([keys[r]])]
    if not stuck:
        return "every rank was waiting: a network or backend problem, not a stuck rank"
    hosts = {r: store.get(f"joined/{r}").decode() if store.check([f"joined/{r}"]) else "?" for r in stuck}
    named = ", ".join(f"rank {r} on {hosts[r]}" for r in stuck)
    return (
        f"stuck: {named} never reached it (the ranks waiting for it reported within {grace_s:.0f} s); see "
        "its log (under the launcher's own agents its stack is dumped there when it is stopped)"
    )
