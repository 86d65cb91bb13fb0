"""The one way to start and end a process group: reach (or host) the rendezvous store, check every rank in,
then ``init_process_group`` (``init_group``: also a healed job's next round, ``launcher.heal.rank_side``); always
destroy it. Also the stores' listening rules (``bind_address``)."""

from __future__ import annotations

import contextlib
import errno
import gc
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from launcher.base.env import DistEnv
from launcher.base.errors import Kind, LauncherError
from launcher.base.liveness import RANK_STORE_POLL_S
from launcher.group.failed import waited
from launcher.trust.secret import Secret
from launcher.trust.signed import SignedStore, guard

log = logging.getLogger(__name__)


class JoinError(LauncherError):
    """A rank could not reach the rendezvous, or not every rank arrived in time: most often because another rank
    failed first (it never came, or the store's host is gone)."""

    kind = Kind.peer


class PortTaken(JoinError):
    """Rank 0 cannot host the rendezvous store: its port is held by something else (this rank's own cause)."""

    kind = Kind.error


@dataclass(frozen=True)
class Group:
    """A process group that is up: this attempt's view of the rendezvous store (stall reports go through it)."""

    store: dist.Store
    env: DistEnv
    timeout_s: float


@contextlib.contextmanager
def process_group(
    env: DistEnv,
    backend: str,
    timeout_s: float = 300.0,
    store: dist.Store | None = None,
    join_timeout_s: Optional[float] = None,
    form: bool = True,
    secret: Optional[Secret] = None,
) -> Iterator[Group]:
    """Initialise the default group for ``env``, yield it, and always destroy it, whatever happens inside.

    Rendezvous through ``store`` when given (tests use a FileStore), else a TCPStore client at
    ``env.master_addr:env.master_port``; a single process uses an in-memory store (no port at all).
    Every rank first checks in on the store: after ``join_timeout_s`` (default ``timeout_s``) the ranks that are
    there name the ranks that are not, and the address they waited at; ``timeout_s`` then bounds collectives.
    ``form=False``: a rank joining a job that heals in place reaches the store only (its healer forms its group
    later); whatever group it formed is destroyed at the end. ``secret``: the job's (``launcher.trust.secret``): every
    key under its namespace, every value signed, gloo's own rendezvous of the group included.
    """
    join_s = join_timeout_s or timeout_s
    if store is None and env.world_size == 1:
        store = dist.HashStore()
    if store is None:
        store = _connect(env, join_s)
    # The agent's store outlives a failed attempt: a restarted group must not read the dead ranks' addresses.
    store = guard(store, secret, attempt_prefix(env.attempt), where=f"the rendezvous store at {_where(env)}")
    if form:
        check_in(store, env, join_s)
    store.set_timeout(timedelta(seconds=max(timeout_s, join_s)))  # later store reads (subgroups' set-up, ...)
    if form:
        init_group(store, env, backend, timeout_s)
        log.debug("process group up: %s backend=%s", env.describe(), backend)
    try:
        yield Group(store, env, timeout_s)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # Groups still referenced from garbage cycles (DDP, reducer hooks) would otherwise be destroyed at
        # interpreter exit, while their backend threads are joinable: std::terminate (SIGABRT) after a clean run.
        gc.collect()


def attach(env: DistEnv, timeout_s: float, join_timeout_s: float, secret: Optional[Secret]) -> Group:
    """The rendezvous store of a process group the caller opened itself, reached as a client and seen as
    ``process_group`` sees it (the attempt's keys, signed with the job's ``secret``): what healing in place watches
    when a script opened its own group."""
    store = guard(
        _connect(env, join_timeout_s), secret, attempt_prefix(env.attempt), where=f"the store at {_where(env)}"
    )
    store.set_timeout(timedelta(seconds=max(timeout_s, join_timeout_s)))
    return Group(store, env, timeout_s)


def init_group(store: dist.Store, env: DistEnv, backend: str, timeout_s: float) -> None:
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)


def attempt_prefix(attempt: int) -> str:
    """Every attempt's keys apart in a store that outlives an attempt (the agent's, the keeper's)."""
    return f"launcher/attempt-{attempt}"


def _where(env: DistEnv) -> str:
    return f"{env.master_addr}:{env.master_port}"


def bind_address(addr: str) -> str:
    """Where a store for ``addr`` listens: that address, unless ``addr`` is a host NAME resolving to loopback
    here (Debian maps a machine's own name to 127.0.1.1): peers on other machines reach that name at a real
    interface, so listen on all of them (TCPStore's own default). Loopback given as such stays loopback."""
    ip = socket.gethostbyname(addr)
    literal = addr == "localhost" or addr.replace(".", "").isdigit()
    return "" if ipaddress.ip_address(ip).is_loopback and not literal else ip


def listening_store(addr: str, port: int, timeout: timedelta = timedelta(seconds=300)) -> dist.TCPStore:
    """Host a TCPStore that listens on ``addr``'s interface only (a TCPStore left alone listens on every
    interface; see ``bind_address``). ``port`` 0 takes a free port and holds it; read it back from
    ``store.port``. A taken port raises OSError (EADDRINUSE)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((bind_address(addr), port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(
        addr,
        sock.getsockname()[1],
        is_master=True,
        multi_tenant=True,
        timeout=timeout,
        master_listen_fd=sock.detach(),
        wait_for_workers=False,
    )


def _connect(env: DistEnv, join_s: float) -> dist.Store:
    """A client of the rendezvous store; rank 0 hosts it (on MASTER_ADDR's interface only) unless the elastic
    agent already does."""
    timeout = timedelta(seconds=join_s)
    try:
        if env.rank == 0 and not env.agent_store:
            try:
                return listening_store(env.master_addr, env.master_port, timeout)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise PortTaken(
                        f"rank 0 on {env.hostname or socket.gethostname()} cannot host the rendezvous store: port "
                        f"{env.master_port} on {env.master_addr} is taken ({exc.strerror}); HINT: another job or a "
                        "stale process holds it; free it, or pick another with cluster.master_port"
                    ) from None
                if exc.errno != errno.EADDRNOTAVAIL:
                    raise
                # MASTER_ADDR is not an address of this host (NAT, alias): listen on all interfaces
                log.warning(
                    "cannot listen on %s (%s): the rendezvous store listens on all interfaces", _where(env), exc
                )
        return dist.TCPStore(
            env.master_addr,
            env.master_port,
            world_size=env.world_size,
            is_master=env.rank == 0 and not env.agent_store,
            timeout=timeout,
            wait_for_workers=False,
        )
    except (dist.DistError, OSError) as exc:  # DistNetworkError, DistStoreError: the store unreachable
        raise JoinError(
            f"rank {env.rank} on {env.hostname or socket.gethostname()} could not reach the rendezvous store at "
            f"{_where(env)} within {join_s:.0f} s ({str(exc).splitlines()[0]}); HINT: check that MASTER_ADDR "
            "resolves and the port is reachable from this host (firewall, wrong interface), or raise "
            "cluster.join_timeout_s"
        ) from None


ALL_JOINED = "joined/all"  # rank 0's word, once every rank's check-in verified (a signed store)


def check_in(store: dist.Store, env: DistEnv, join_s: float) -> None:
    """Every rank writes ``joined/<rank>`` = host and waits for all the others, naming the missing ones. In a signed
    store a rank has arrived only once its value verifies (a stranger's ``joined/<rank>`` is no arrival; the real
    rank's own write replaces it): rank 0 reads every one and then says so (``ALL_JOINED``), which the others wait
    for, so the store serves each rank one read, not one per rank."""
    host = env.hostname or socket.gethostname()
    store.set(f"joined/{env.rank}", host)
    keys = [f"joined/{r}" for r in range(env.world_size)]
    signed = isinstance(store, SignedStore)
    awaited = keys if env.rank == 0 or not signed else [ALL_JOINED]
    if _arrived(store, awaited, signed, time.monotonic() + join_s):
        if env.rank == 0 and signed:
            store.set(ALL_JOINED, "1")
        return
    missing = [r for r in range(env.world_size) if not _arrived(store, [keys[r]], signed, 0.0)]
    raise JoinError(
        f"ranks {missing} did not join within {join_s:.0f} s (cluster.join_timeout_s) at {_where(env)}; "
        f"rank {env.rank} on {host} waited for them; HINT: see those ranks' logs (a crash or hang before "
        "init), check that their hosts can reach the address, or raise cluster.join_timeout_s"
    )


def _arrived(store: dist.Store, keys: list[str], signed: bool, deadline: float) -> bool:
    """Whether every key is there (and verifies, in a signed store) by ``deadline`` (monotonic)."""
    tick, waiting = threading.Event(), list(keys)
    while True:
        waited(store, waiting, timedelta(seconds=max(0.001, deadline - time.monotonic())))  # (missing: asked below)
        # where all are there, one round trip asks for all of them (rank 0 at 16k ranks: not three per rank)
        there = list(waiting) if store.check(waiting) else [k for k in waiting if store.check([k])]
        verified = store.read_all(there) if signed and there else there  # type: ignore[attr-defined]
        arrived = {k for k, value in zip(there, verified) if value is not None}
        waiting = [k for k in waiting if k not in arrived]
        if not waiting:
            return True
        if time.monotonic() >= deadline:
            return False
        if set(waiting) <= set(there):  # forged values stand where the ranks' will come: store.wait returns
            tick.wait(RANK_STORE_POLL_S)  # at once, so ask again at the store's pace
