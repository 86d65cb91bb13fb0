"""Threads that watch a running job's processes from outside, as another user of the machine could: what is on
their command lines and in their environments, and a stranger writing into a healing job's keeper store."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from pathlib import Path


@contextlib.contextmanager
def in_background(work: Callable[[], None], done: threading.Event) -> Iterator[None]:
    """``work`` in a daemon thread while the block runs; then ``done`` is set and the thread joined."""
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=10)


@contextlib.contextmanager
def scanning_processes(needle: str) -> Iterator[dict[str, set[str]]]:
    """While the block runs, every process's command line and environment on this host (the ssh test machines' and
    simulated nodes' processes too: one kernel) are read every 50 ms. Yields what was found: ``argv``, the
    command lines holding ``needle`` (must stay empty for a secret); ``ranks``, the RANK of each process whose
    environment holds it (the value reached the ranks)."""
    found: dict[str, set[str]] = {"argv": set(), "ranks": set()}
    done, wanted = threading.Event(), needle.encode()

    def scan() -> None:
        while not done.wait(0.05):
            for proc in Path("/proc").iterdir():
                if not proc.name.isdigit():
                    continue
                try:
                    argv = (proc / "cmdline").read_bytes()
                    if wanted in argv:
                        found["argv"].add(argv.replace(b"\0", b" ").decode(errors="replace")[:200])
                    environ = (proc / "environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                if any(wanted in v for v in environ):
                    found["ranks"].update(v[5:].decode() for v in environ if v.startswith(b"RANK="))

    with in_background(scan, done):
        yield found


@contextlib.contextmanager
def stranger_writing(into: str = "launcher.heal.keeper") -> Iterator[list[str]]:
    """A process without the job's secret that writes into a running healing job's keeper store for as long as the
    block runs, as in issue 34: it finds the keeper's port on its command line and writes forged decisions (the job
    stops), heartbeats and readiness marks at the plain key names; and, having read the secret's namespace (as a
    stranger who guessed it), decisions and readiness marks at the job's real keys, signed with another secret (not
    the live heartbeats: overwritten, a real value is gone, which no store without access control prevents; the
    keeper's test forges those). Yields what it wrote, and "argv of PID" for any process whose command line holds
    the job's secret."""
    from datetime import timedelta

    import torch.distributed as dist

    from launcher.group.rendezvous import attempt_prefix
    from launcher.heal.protocol import Decision, Keys, node_id
    from launcher.trust.secret import SECRET_ENV, Secret
    from launcher.trust.signed import SignedStore

    done, wrote = threading.Event(), []

    def keeper() -> tuple[str, int, Secret] | None:
        for proc in Path("/proc").iterdir():
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
                if into.encode() in argv:
                    at = argv.index(into.encode())
                    environ = dict(
                        line.split("=", 1) for line in (proc / "environ").read_text().split("\0") if "=" in line
                    )
                    return argv[at + 1].decode(), int(argv[at + 2]), Secret.from_hex(environ[SECRET_ENV])
            except (OSError, ValueError, IndexError, KeyError):
                continue
        return None

    def run() -> None:
        while (found := keeper()) is None and not done.wait(0.1):
            pass
        if found is None:
            return
        addr, port, secret = found
        client = None
        while client is None and not done.is_set():  # the keeper's store listens once it started (seconds, loaded)
            with contextlib.suppress(RuntimeError):  # (DistNetworkError: not listening yet)
                wait = timedelta(seconds=5)
                client = dist.TCPStore(addr, port, is_master=False, timeout=wait, wait_for_workers=False)
        if client is None:
            return
        plain = dist.PrefixStore(attempt_prefix(0), client)
        guessed = SignedStore(client, Secret.new(), attempt_prefix(0))
        guessed._root = SignedStore(client, secret, attempt_prefix(0))._root  # the namespace, not the key
        stop = Decision(round=1, members=("node-0",), before=("node-0",), stop="forged by a stranger").to_bytes()
        for store in (plain, guessed):  # decisions once (a later one would hide the keeper's own from late readers)
            for number in range(3):
                store.set(Keys.round_end(number), stop)
        wrote.append("decisions")
        secret_hex = secret.environ()[SECRET_ENV].encode()
        while not done.wait(0.5):
            with contextlib.suppress(RuntimeError):
                for name in ("node-0", "node-1", "node-2"):
                    plain.set(Keys.heartbeat(node_id(name, 0)), b"1")
                    for store in (plain, guessed):  # (a real key a stranger overwrites loses its real value)
                        store.set(Keys.ready(node_id(name, 1), 0), b"1")
                wrote.append("beats")
            for proc in Path("/proc").iterdir():  # the secret is on no command line (issue 34)
                with contextlib.suppress(OSError):
                    if proc.name.isdigit() and secret_hex in (proc / "cmdline").read_bytes():
                        wrote.append(f"argv of {proc.name}")

    with in_background(run, done):
        yield wrote
