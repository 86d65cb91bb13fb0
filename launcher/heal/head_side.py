"""The head's side of healing in place (sim and ssh; ``config.rules.heals_in_place`` says when a job heals): its
handle on the attempt's keeper (``keeper.py``), started off the training machines with the job's secret
(``KeeperClient``): what the head tells it (a node process ended by a signal nobody sent: the machine is gone; a
lost machine answers again and its node process starts) and the decisions it reads back. The head's wait that
uses it, where a lost node's survivors go on and each decision changes the ``Membership`` (``Membership.apply``):
``launcher.launch.nodes.waiting``. No torch here."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from launcher.heal.protocol import ROUND_WORD, Decision, JoinWord, LostWord
from launcher.trust.secret import Secret


class KeeperClient:
    """The head's handle on the keeper process of one attempt: ``prefix`` runs it where the nodes reach ``addr``
    (the bridge namespace of simulated nodes), listening on ``port``; the job's ``secret`` goes in its environment."""

    def __init__(  # noqa: PLR0913
        self,
        prefix: list[str],
        addr: str,
        port: int,
        attempt: int,
        min_nodes: int,
        lost_after_s: float,
        names: list[str],
        secret: Secret,
    ) -> None:
        argv = [sys.executable, "-u", "-m", "launcher.heal.keeper", addr, str(port), str(attempt), str(min_nodes)]
        self.proc = subprocess.Popen(
            [*prefix, *argv, f"{lost_after_s:g}", *names],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **secret.environ()},
            start_new_session=True,  # a terminal's Ctrl-C or hang-up is the head's to pass on: the head ends it
        )
        self.endpoint = f"{addr}:{port}"

    def lose(self, name: str, why: str) -> None:
        """Tell the keeper ``name`` is gone (now)."""
        self._say(LostWord(name, time.time(), why).line())

    def join(self, name: str, start: int, ranks: int, answered: float) -> None:
        """Tell the keeper that ``name``'s machine answered again at ``answered`` and its node process (``start``,
        ``ranks`` ranks) is starting: it joins once they are ready."""
        self._say(JoinWord(name, start, ranks, answered).line())

    def _say(self, line: str) -> None:
        with contextlib.suppress(OSError, ValueError):  # the keeper is gone: the head sees that too
            assert self.proc.stdin is not None
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()

    def read(self, put: Callable[[tuple], None]) -> None:
        """Each decision as ``("round", Decision)``, then ``("keeper", exit code)`` when it ends."""

        def run() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                word, _, rest = line.partition(" ")
                if word == ROUND_WORD:
                    put(("round", Decision.from_bytes(rest.encode())))
            put(("keeper", self.proc.wait()))

        threading.Thread(target=run, name="keeper-read", daemon=True).start()

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # the end of input ends it
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
