"""``python -m launcher`` heads forked from a preloaded process, as ``spawn_ranks`` forks its ranks (harness.ranks).

Why: the suite is CPU-bound on its two cores, and each head spent ~2.4 CPU-s importing torch, Hydra and the
launcher before doing anything (measured: ``python -c "import launcher.commands.cli"``); with ~300 heads a run that
was a sixth of the suite. A head forked here skips only that: from ``launcher/__main__.py`` on it is the same program,
run the way ``python -m`` runs it (``runpy``, ``sys.argv``, the environment, the working directory, its own
session, stdin/stdout/stderr), and it ends as the interpreter ends one (non-daemon threads joined, atexit, the
exit code, death by SIGINT after an uncaught KeyboardInterrupt).

The preloaded process (one per test process, started on first use, ended when that process ends) imports
``launcher.commands.cli`` and nothing runs in it: no thread, no torch op, no process group, so forking it is safe. It is
used only where a fresh interpreter could not differ: ``popen`` starts a fresh ``python -m launcher`` instead when
the argv is anything else, or the environment changes a variable that torch or Python read at import time
(``FRESH_PREFIXES``), or ``LAUNCHER_TEST_FRESH_HEADS=1`` asks for every head fresh.

Protocol (one SOCK_SEQPACKET socketpair): the test process sends the argv, environment and working directory as
JSON with four descriptors (a reply socket, stdin, stdout, stderr); the server forks, replies ``pid N`` on the
reply socket, and ``exit CODE`` (``subprocess``'s convention: -N for signal N) once it has reaped the child.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
FRESH_PREFIXES = ("TORCH", "OMP_", "MKL_", "KMP_", "PYTHON", "LD_", "CUDA", "NCCL", "GLOO", "HYDRA")
_server: subprocess.Popen | None = None
_server_environ: dict[str, str] = {}  # the environment the server imported under
_control: socket.socket | None = None
_lock = threading.Lock()


class Head:
    """What ``subprocess.Popen`` gives the tests for a forked head: ``pid``, ``poll``, ``wait``, ``returncode``,
    ``send_signal``/``terminate``/``kill``, and the pipes asked for (``stdout``, ``stderr``)."""

    def __init__(self, reply: socket.socket, stdout: Any, stderr: Any) -> None:
        self._reply, self._buffer = reply, b""
        self.stdout, self.stderr, self.stdin = stdout, stderr, None
        self.returncode: int | None = None
        self.pid = int(self._line(None).split()[1])

    def _exited(self, line: str) -> int:
        self.returncode = int(line.split()[1])
        self._reply.close()
        return self.returncode

    def _line(self, timeout: float | None) -> str:
        self._reply.settimeout(timeout)
        while b"\n" not in self._buffer:
            chunk = self._reply.recv(64)
            if not chunk:
                raise RuntimeError("the preloaded head server ended (its log: the test process's stderr)")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                return self._exited(self._line(0))
            except (BlockingIOError, TimeoutError):
                return None
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                return self._exited(self._line(timeout))
            except TimeoutError:
                raise subprocess.TimeoutExpired(f"head {self.pid}", timeout or 0) from None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)


Process = Head | subprocess.Popen  # what ``popen`` returns


def popen(argv: list[str], *, cwd: Path, env: dict[str, str], stdout: Any, stderr: Any, fresh: bool = False) -> Process:
    """``subprocess.Popen(argv, cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=True,
    start_new_session=True, stdin=DEVNULL)``, forked from the preloaded process where that cannot differ (never
    with ``fresh``)."""
    if fresh or not _forkable(argv, env):
        return subprocess.Popen(
            argv, cwd=cwd, env=env, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, text=True,
            start_new_session=True,
        )  # fmt: skip
    ours, theirs = [], []  # (our read ends of pipes, the fds the child gets)
    out_pipe = err_pipe = None
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        fds = [devnull]
        for target in (stdout, stderr):
            if target == subprocess.PIPE:
                r, w = os.pipe()
                ours.append(r)
                theirs.append(w)
                fds.append(w)
            elif target == subprocess.STDOUT:
                fds.append(fds[1])
            elif target == subprocess.DEVNULL or target is None:
                fds.append(devnull)
            else:
                fds.append(target.fileno())
        reply, child_reply = socket.socketpair()
        mask = os.umask(0o077)  # (read: set tighter meanwhile, never looser)
        os.umask(mask)  # a fresh head inherits this process's umask: a forked one is given it (test_file_modes)
        request = json.dumps({"argv": argv, "cwd": str(cwd), "env": env, "umask": mask}).encode()
        with _lock:
            socket.send_fds(_connect(), [request], [child_reply.fileno(), *fds])
        child_reply.close()
    finally:
        os.close(devnull)
        for fd in theirs:
            os.close(fd)
    if stdout == subprocess.PIPE:
        out_pipe = open(ours.pop(0), encoding="utf-8", errors="replace")
    if stderr == subprocess.PIPE:
        err_pipe = open(ours.pop(0), encoding="utf-8", errors="replace")
    return Head(reply, out_pipe, err_pipe)


def _forkable(argv: list[str], env: dict[str, str]) -> bool:
    if os.environ.get("LAUNCHER_TEST_FRESH_HEADS") == "1" or argv[:3] != [sys.executable, "-m", "launcher"]:
        return False
    return _import_time(env) == _import_time(_server_env())


def _import_time(env: dict[str, str]) -> dict[str, str]:
    """The variables torch or Python may read at import time (the server must have imported under the same)."""
    return {k: v for k, v in env.items() if k.startswith(FRESH_PREFIXES)}


def _server_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("LAUNCHER_", "TORCHELASTIC_"))}


def _connect() -> socket.socket:
    global _server, _server_environ, _control
    drifted = _import_time(_server_environ) != _import_time(_server_env())
    if _server is not None and _server.poll() is None and drifted and _control is not None:
        _control.close()  # the old server ends once its running heads have ended (it still reports their exits)
        _server = None
    if _server is None or _server.poll() is not None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        _server_environ = _server_env()
        _server = subprocess.Popen(
            [sys.executable, __file__, str(theirs.fileno())], cwd=REPO, env=_server_environ, pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        theirs.close()
        _control = ours  # closed when this process ends: the server sees it and ends
    assert _control is not None
    return _control


# ---- the server (run as ``python tests/harness/heads.py FD``: the standard library and the launcher only) ----


def _serve(control: socket.socket) -> None:
    import gc

    import launcher.commands.cli  # noqa: F401  (the preload: torch, Hydra, the launcher)

    gc.freeze()  # a forked head walks none of the preload's objects, nor copies their pages (harness.preloaded)

    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ, None)
    while selector.get_map():
        for key, _ in selector.select():
            if key.data is None:
                message, fds, _, _ = socket.recv_fds(control, 1 << 22, 4)
                if not message:  # the test process ended or replaced this server: report the running heads' ends
                    selector.unregister(control)
                    continue
                reply = socket.socket(fileno=fds[0])
                pid = os.fork()
                if pid == 0:  # the child keeps none of the server's descriptors
                    for other in selector.get_map().values():
                        if other.data is not None:
                            os.close(other.fd)
                            other.data[1].close()
                    selector.close()
                    control.close()
                    reply.close()
                    _child(json.loads(message), fds[1:])
                for fd in fds[1:]:
                    os.close(fd)
                reply.sendall(f"pid {pid}\n".encode())
                selector.register(os.pidfd_open(pid), selectors.EVENT_READ, (pid, reply))
            else:
                pid, reply = key.data
                selector.unregister(key.fd)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                try:
                    reply.sendall(f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass  # the test no longer listens
                reply.close()


def _child(request: dict, fds: list[int]) -> None:
    """Become ``python -m launcher ARGS`` in CWD with ENV, in a session of its own; never returns."""
    import atexit
    import runpy
    import signal
    import threading
    import traceback

    code = 1
    try:
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.umask(request["umask"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[0] = request["cwd"]  # as ``python -m`` puts the working directory first
        sys.argv = ["-m", *request["argv"][3:]]  # runpy sets argv[0] to launcher/__main__.py, as python -m does
        try:
            runpy.run_module("launcher", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
        except KeyboardInterrupt:
            traceback.print_exc()
            code = -signal.SIGINT
        except BaseException:
            traceback.print_exc()
        threading._shutdown()  # type: ignore[attr-defined]  (as the interpreter: non-daemon threads, then atexit)
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        if code == -signal.SIGINT:  # as Python ends after an uncaught KeyboardInterrupt: by SIGINT
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        os._exit(code & 0xFF)


if __name__ == "__main__":
    sys.path[0] = str(REPO)
    # setproctitle finds the room for a title (the command line, the environment after it) once, at its first
    # call; a forked head replaces its environment (above), after which it would find none: set up here instead
    # (the titles: launcher.base.titles), so a forked head shows its title as a fresh one does
    import setproctitle

    setproctitle.getproctitle()
    _serve(socket.socket(fileno=int(sys.argv[1])))
