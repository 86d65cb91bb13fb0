"""How long name resolution takes on this machine: c10d resolves the store's name on every connection a rank opens,
and its store server looks every client's address up (to log it): where a name is in no ``/etc/hosts`` and the DNS
server never answers (common in clouds and in network namespaces), each of those waits the resolver's timeout (5 to
10 s), every time. The ssh host checks and ``doctor`` time both directions for the job's names and say which is slow,
where, and the fix (``slow_lookups``). No torch here."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from typing import Optional

from launcher.base.liveness import LOOKUP_LIMIT_S, SLOW_LOOKUP_S


@dataclass(frozen=True)
class Lookup:
    """One timed look-up: ``forward`` (a name to its address) or ``reverse`` (an address to its name)."""

    kind: str
    what: str
    seconds: float
    answer: Optional[str]  # the address or the name found; None: none (or not within the limit)
    finished: bool = True  # False: still waiting when the limit (``seconds``) came

    def said(self, where: str) -> str:
        took = f"{self.seconds:.1f} s" if self.finished else f"more than {self.seconds:.0f} s"
        if self.kind == "forward" and self.what == where:  # its own name: torch's agent and gloo resolve it
            fix = f"a line '<its address> {where}' in its /etc/hosts"
            return f"on {where}, resolving its own name {where} takes {took} (torch resolves it); HINT: {fix}"
        if self.kind == "forward":
            fix = f"put {self.what}'s address in {where}'s /etc/hosts, or give cluster.master_addr as an address"
            return f"on {where}, resolving {self.what} takes {took}; HINT: {fix}"
        fix = f"name {self.what} in {where}'s /etc/hosts (a line '{self.what} <its name>')"
        return f"on {where}, a reverse look-up of {self.what} takes {took} (c10d makes one per connection); HINT: {fix}"


def _forward(name: str) -> Optional[str]:
    try:
        return str(socket.getaddrinfo(name, None, socket.AF_INET)[0][4][0])
    except OSError:
        return None


def _reverse(addr: str) -> Optional[str]:
    try:
        return socket.getnameinfo((addr, 0), socket.NI_NAMEREQD)[0]
    except OSError:
        return None


def time_lookups(names: list[str], limit_s: float = LOOKUP_LIMIT_S) -> list[Lookup]:
    """Each name resolved, and each address found looked up in reverse, timed, all at once (at most ``limit_s``
    in all: a look-up still waiting then is reported as that long; its thread is a daemon's, never waited for)."""
    found: dict[tuple[str, str], Lookup] = {}
    lock = threading.Lock()

    def run(kind: str, what: str) -> None:
        start = time.monotonic()
        answer = _forward(what) if kind == "forward" else _reverse(what)
        with lock:
            found[(kind, what)] = Lookup(kind, what, round(time.monotonic() - start, 2), answer)
        if kind == "forward" and answer is not None:
            start_thread("reverse", answer)
            start_thread("reverse", f"::ffff:{answer}")  # (how a dual-stack store server sees an IPv4 peer)

    threads: list[threading.Thread] = []

    def start_thread(kind: str, what: str) -> None:
        with lock:
            if any(t.name == f"{kind} {what}" for t in threads):
                return
            thread = threading.Thread(target=run, args=(kind, what), name=f"{kind} {what}", daemon=True)
            threads.append(thread)
        thread.start()

    deadline = time.monotonic() + limit_s
    for name in dict.fromkeys(names):
        start_thread("reverse" if _is_address(name) else "forward", name)
    while True:
        with lock:
            pending = [t for t in threads if t.is_alive()]
        if not pending:
            break
        pending[0].join(max(0.0, deadline - time.monotonic()))
        if time.monotonic() >= deadline:
            break
    with lock:
        for thread in threads:
            kind, what = thread.name.split(" ", 1)
            found.setdefault((kind, what), Lookup(kind, what, limit_s, None, finished=False))
        return list(found.values())


def slow_lookups(lookups: list[Lookup]) -> list[Lookup]:
    return [lookup for lookup in lookups if lookup.seconds >= SLOW_LOOKUP_S]


def _is_address(name: str) -> bool:
    try:
        socket.inet_aton(name)
        return name.count(".") == 3
    except OSError:
        return False
