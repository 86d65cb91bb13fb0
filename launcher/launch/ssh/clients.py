"""The head's ssh clients of a ``+cluster=ssh`` job: what a host runs and reads (its node process, or its host
check: ``ssh_command`` + ``remote_shell``, then ``handoff`` on its stdin), one client per host (``SshNode``: the
``Node`` the attempt loop holds, ``launch/nodes/attempts.py``), and the line a slow start-up phase says
(``say_if_slow``).

Nothing a user would keep from other users of the machines is on a command line (``ps`` shows every process's to
every user of both machines): the remote script holds the directory, the head's umask, the paths ``ON_COMMAND_LINE``
and the command; ``cluster.setup`` (where users put ``export HF_TOKEN=...`` or a licence key), the forwarded
environment (``cluster.env``'s values) and the job's secret come over stdin (issues 35 and 51).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import IO

from launcher.base.files import run_umask
from launcher.base.liveness import SLOW_PHASE_S
from launcher.config import SshClusterConfig
from launcher.launch.nodes.control import Control, kill_tree
from launcher.trust.secret import SECRET_ENV, Secret, handoff_line

# Ours come after the user's cluster.ssh_options: ssh takes the first value it is given for an option.
SSH_OPTIONS = (
    "-T",
    "-o",
    "BatchMode=yes",
    "-o",
    "ConnectTimeout=10",
    "-o",
    "ServerAliveInterval=5",
    "-o",
    "ServerAliveCountMax=3",
)
SSH_LOST = 255  # ssh's own failure: no connection, or it dropped
FORWARDED_PREFIXES = ("LAUNCHER_", "NCCL_", "GLOO_", "TORCH_")
FORWARDED_NAMES = ("CUDA_VISIBLE_DEVICES", "PYTHONPATH", "OMP_NUM_THREADS")
# on the remote command line (python's start and a host check need them; paths and device lists, never secrets);
# every other forwarded variable, cluster.env's included, goes over the connection's stdin with the job's secret
ON_COMMAND_LINE = ("PYTHONPATH", "CUDA_VISIBLE_DEVICES")
NO_CWD, SETUP_FAILED, NOT_FOUND = 97, 96, 127  # exit codes of the remote shell prelude

# The remote shell reads ``setup_input`` a line at a time (a shell's ``read`` takes nothing after its line from a
# pipe: the node process reads the rest), then runs it with /dev/null as stdin (it cannot read the secret); a setup
# cut short (the connection dropped) runs nothing.
READ_SETUP = """IFS= read -r launcher_n || exit {code}
launcher_setup=
while [ "$launcher_n" -gt 0 ]; do
  IFS= read -r launcher_line || exit {code}
  launcher_setup="$launcher_setup$launcher_line
"; launcher_n=$((launcher_n - 1))
done
{{ eval "$launcher_setup"; }} </dev/null || exit {code}"""


def ssh_command(c: SshClusterConfig, host: str, shell: str) -> list[str]:
    return ["ssh", *c.ssh_options, *SSH_OPTIONS, host, shell]


def forwarded_env(c: SshClusterConfig) -> dict[str, str]:
    prefixes = FORWARDED_PREFIXES + tuple(n[:-1] for n in c.env if n.endswith("*"))
    names = set(FORWARDED_NAMES) | {n for n in c.env if not n.endswith("*")}
    return {  # never a secret of this process's own: the head's job secret is handed off with these
        k: v for k, v in sorted(os.environ.items()) if (k in names or k.startswith(prefixes)) and k != SECRET_ENV
    }


def setup_input(c: SshClusterConfig) -> str:
    """``cluster.setup`` as the remote shell reads it from stdin (``READ_SETUP``): the count of its lines, then the
    lines, joined with ``&&`` (the first that fails stops it)."""
    if not c.setup:
        return ""
    script = " && ".join(c.setup)
    lines = script.count("\n") + 1  # (a line of cluster.setup may hold several)
    return f"{lines}\n{script}\n"


def handoff(c: SshClusterConfig, secret: Secret) -> bytes:
    """What a node process's host reads first from its stdin: ``cluster.setup`` for its shell (``setup_input``),
    then the first line the node process reads: the forwarded environment not on its command line
    (``cluster.env``'s values: tokens, keys) and the job's secret."""
    env = {k: v for k, v in forwarded_env(c).items() if k not in ON_COMMAND_LINE}
    return setup_input(c).encode() + handoff_line({**env, **secret.environ()})


def remote_shell(c: SshClusterConfig, argv: list[str]) -> str:
    """The script a host runs: this directory (shared file system), ``cluster.setup`` (from stdin), then ``argv``
    with the forwarded paths, under the head's umask (``run_umask``: a remote shell's is not the user's, and the
    job's files there must be as private as here). Each step that can fail exits with its own code (``NO_CWD``,
    ``SETUP_FAILED``, ``NOT_FOUND``)."""
    lines = [f"cd {shlex.quote(os.getcwd())} 2>/dev/null || exit {NO_CWD}"]
    if c.setup:
        lines.append(READ_SETUP.format(code=SETUP_FAILED))
    env = [f"{k}={shlex.quote(v)}" for k, v in forwarded_env(c).items() if k in ON_COMMAND_LINE]
    lines += [f"umask {run_umask():04o}", " ".join(["exec", "env", *env, shlex.join(argv)])]
    return "\n".join(lines)


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
