"""The head's ssh clients of a ``+cluster=ssh`` job, one per host (``SshNode``), and what the head does to all of
them while the job runs: stop signals forwarded (``forwarding_stops``) and heartbeats written (``heartbeats``)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import IO

from launcher.base.liveness import HEAD_PING_S, SLOW_PHASE_S
from launcher.config import SshClusterConfig
from launcher.launch.nodes import control as head
from launcher.launch.nodes.control import Control
from launcher.launch.ssh.hosts import handoff, remote_shell, ssh_command
from launcher.trust.secret import Secret


@contextlib.contextmanager
def saying_if_slow(what: str, done: threading.Event | None = None) -> Iterator[None]:
    """One line on the console, ``[launcher] what ...``, when the block (or, with ``done``, the wait for that
    event, which may outlast the block) takes over ``SLOW_PHASE_S``: a user who sees nothing for half a minute
    (host checks, connections, a slow name look-up) knows what the head waits for."""
    finished = done or threading.Event()

    def say() -> None:
        if not finished.wait(SLOW_PHASE_S):
            print(f"[launcher] {what} ...", file=sys.stderr, flush=True)

    threading.Thread(target=say, daemon=True).start()
    try:
        yield
    finally:
        if done is None:
            finished.set()


class SshNode:
    """One host's node process (``nodes/process.py``), through its ssh client: output streamed here with the host as
    prefix, ``Control`` words written to its stdin (``process.py --stdin-control``)."""

    def __init__(  # noqa: PLR0913
        self,
        c: SshClusterConfig,
        host: str,
        argv: list[str],
        lock: threading.Lock,
        secret: Secret,
        heard: threading.Event | None = None,
    ) -> None:
        self.host = host
        self.heard = heard or threading.Event()  # set at its first line of output (its node process runs)
        cmd = ssh_command(c, host, remote_shell(c, argv))
        # its own session: a Ctrl-C in this terminal reaches the head only, which forwards it as a request
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
        )
        self._write(handoff(c, secret))  # the job's secret and environment: the first line, never a command line
        self.pumps = [
            threading.Thread(target=self._pump, args=(src, dst, lock), daemon=True)
            for src, dst in ((self.proc.stdout, sys.stdout), (self.proc.stderr, sys.stderr))
        ]
        for pump in self.pumps:
            pump.start()

    def _pump(self, src: IO[bytes] | None, dst: IO[str], lock: threading.Lock) -> None:
        assert src is not None
        for line in iter(src.readline, b""):
            self.heard.set()
            with lock:
                dst.write(f"[{self.host}] {line.decode(errors='replace')}")
                dst.flush()

    def request(self, word: Control) -> None:
        """``INT`` or ``TERM``: the node stops its ranks as that signal would; ``ABORT``: at once; ``PING``: a
        heartbeat."""
        self._write(word.line())

    def _write(self, data: bytes) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # it has ended already

    def finish(self) -> None:
        for pump in self.pumps:
            pump.join(timeout=5)
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()


def forwarding_stops(nodes: list[SshNode]) -> contextlib.AbstractContextManager[list[int]]:
    """``head.forwarding_stops`` to every node of ``nodes`` (the list may grow while the nodes start)."""

    def send(word: Control) -> None:
        for node in nodes:
            node.request(word)

    return head.forwarding_stops(send, "on every host")


@contextlib.contextmanager
def heartbeats(nodes: list[SshNode]) -> Iterator[None]:
    """``PING`` to every node every ``HEAD_PING_S``: a node that hears nothing for ``cluster.heartbeat_timeout_s``
    stops its ranks (its host cannot reach us, so nobody else would stop them)."""
    done = threading.Event()

    def beat() -> None:
        while not done.wait(HEAD_PING_S):
            for node in nodes:
                node.request(Control.PING)

    thread = threading.Thread(target=beat, name="heartbeats", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
