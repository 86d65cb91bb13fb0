"""The head's ssh clients of a ``+cluster=ssh`` job, one per host (``SshNode``: the ``Node`` the attempt loop holds,
``launch/nodes/attempts.py``), and the line a slow start-up phase says (``say_if_slow``)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import IO

from launcher.base.liveness import SLOW_PHASE_S
from launcher.config import SshClusterConfig
from launcher.launch.nodes.control import Control, kill_tree
from launcher.launch.ssh.hosts import handoff, remote_shell, ssh_command
from launcher.trust.secret import Secret


def say_if_slow(what: str, done: threading.Event) -> None:
    """One line on the console, ``[launcher] what ...``, unless ``done`` is set within ``SLOW_PHASE_S``: a user who
    sees nothing for half a minute (host checks, connections, a slow name look-up) knows what the head waits for."""

    def say() -> None:
        if not done.wait(SLOW_PHASE_S):
            print(f"[launcher] {what} ...", file=sys.stderr, flush=True)

    threading.Thread(target=say, daemon=True).start()


@contextlib.contextmanager
def saying_if_slow(what: str) -> Iterator[None]:
    """``say_if_slow`` for the block: said when it takes over ``SLOW_PHASE_S``."""
    finished = threading.Event()
    say_if_slow(what, finished)
    try:
        yield
    finally:
        finished.set()


class SshNode:
    """One host's node process (``nodes/process.py``), through its ssh client: output streamed here with the host as
    prefix, ``Control`` words written to its stdin (``process.py --stdin-control``). Its end is its ssh client's
    (``hosts.SSH_LOST``: the connection dropped); killed, it is its ssh client that ends (the host, cut off, stops
    its ranks once it hears nothing)."""

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

    def wait(self) -> int:
        return self.proc.wait()

    def kill(self) -> None:
        kill_tree(self.proc)

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
