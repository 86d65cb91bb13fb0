"""The one way to start and end a process group, and rank helpers that work without one.

Training code calls ``get_rank()``/``all_reduce(...)`` unconditionally: with no process group they return the
single-process answer, so there are no ``if distributed:`` branches anywhere else.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import gc
import ipaddress
import logging
import os
import re
import socket
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from .env import DistEnv

log = logging.getLogger(__name__)


class JoinError(RuntimeError):
    """A rank could not reach the rendezvous, or not every rank arrived in time."""


@dataclass
class _Group:
    store: dist.Store  # this attempt's view of the rendezvous store (stall reports go through it)
    env: DistEnv
    timeout_s: float


_GROUP: Optional[_Group] = None


@contextlib.contextmanager
def process_group(
    env: DistEnv,
    backend: str,
    timeout_s: float = 300.0,
    store: dist.Store | None = None,
    join_timeout_s: Optional[float] = None,
) -> Iterator[None]:
    """Initialise the default group for ``env`` and always destroy it, whatever happens inside.

    Rendezvous through ``store`` when given (tests use a FileStore), else a TCPStore client at
    ``env.master_addr:env.master_port``; a single process uses an in-memory store (no port at all).
    Every rank first checks in on the store: after ``join_timeout_s`` (default ``timeout_s``) the ranks that are
    there name the ranks that are not, and the address they waited at; ``timeout_s`` then bounds collectives.
    """
    global _GROUP
    join_s = join_timeout_s or timeout_s
    if store is None and env.world_size == 1:
        store = dist.HashStore()
    if store is None:
        store = _connect(env, join_s)
    # The agent's store outlives a failed attempt: a restarted group must not read the dead ranks' addresses.
    store = dist.PrefixStore(f"launcher/attempt-{env.restart_count}", store)
    _check_in(store, env, join_s)
    store.set_timeout(timedelta(seconds=max(timeout_s, join_s)))  # later store reads (subgroups' set-up, ...)
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    _GROUP = _Group(store, env, timeout_s)
    log.debug("process group up: %s backend=%s", env.describe(), backend)
    try:
        yield
    finally:
        _GROUP = None
        dist.destroy_process_group()
        # Groups still referenced from garbage cycles (DDP, reducer hooks) would otherwise be destroyed at
        # interpreter exit, while their backend threads are joinable: std::terminate (SIGABRT) after a clean run.
        gc.collect()


_EXIT_CODE: Optional[int] = None


def end_process_at_exit(code: int) -> None:
    """Make this process end with ``code`` right after the atexit handlers, skipping interpreter teardown
    (a later call changes the code).

    Why: process groups kept alive by C++ references (torch DDP's reducer holds the world group after
    ``destroy_process_group``) keep their gloo threads running; if one of them is still releasing a finished
    collective's tensors when the interpreter finalises, it needs the GIL, gets its thread cancelled and the
    process dies with std::terminate (SIGABRT) after a successful run (seen 1 in ~20 test runs; pytorch PR
    179291 describes it). Logs and output are flushed first; nothing else is left to do at that point."""
    global _EXIT_CODE
    if _EXIT_CODE is None:
        atexit.register(_end)  # runs first (atexit is last-in, first-out), before teardown begins
    _EXIT_CODE = code


def _end() -> None:
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(_EXIT_CODE or 0)


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
    return dist.TCPStore(addr, sock.getsockname()[1], is_master=True, multi_tenant=True, timeout=timeout,
                         master_listen_fd=sock.detach(), wait_for_workers=False)


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
                    raise JoinError(
                        f"rank 0 on {env.hostname or socket.gethostname()} cannot host the rendezvous store: port "
                        f"{env.master_port} on {env.master_addr} is taken ({exc.strerror}); HINT: another job or a "
                        "stale process holds it; free it, or pick another with cluster.master_port"
                    ) from None
                if exc.errno != errno.EADDRNOTAVAIL:
                    raise
                # MASTER_ADDR is not an address of this host (NAT, alias): listen on all interfaces
                log.warning("cannot listen on %s (%s): the rendezvous store listens on all interfaces",
                            _where(env), exc)
        return dist.TCPStore(
            env.master_addr, env.master_port, world_size=env.world_size,
            is_master=env.rank == 0 and not env.agent_store, timeout=timeout, wait_for_workers=False,
        )
    except (RuntimeError, OSError) as exc:  # DistNetworkError / DistStoreError derive from RuntimeError
        raise JoinError(
            f"rank {env.rank} on {env.hostname or socket.gethostname()} could not reach the rendezvous store at "
            f"{_where(env)} within {join_s:.0f} s ({str(exc).splitlines()[0]}); HINT: check that MASTER_ADDR "
            "resolves and the port is reachable from this host (firewall, wrong interface), or raise "
            "cluster.join_timeout_s"
        ) from None


def _check_in(store: dist.Store, env: DistEnv, join_s: float) -> None:
    """Every rank writes ``joined/<rank>`` = host and waits for all the others, naming the missing ones."""
    host = env.hostname or socket.gethostname()
    store.set(f"joined/{env.rank}", host)
    keys = [f"joined/{r}" for r in range(env.world_size)]
    try:
        store.wait(keys, timedelta(seconds=join_s))
    except (RuntimeError, OSError):
        missing = [r for r in range(env.world_size) if not store.check([keys[r]])]
        if not missing:
            return
        raise JoinError(
            f"ranks {missing} did not join within {join_s:.0f} s (cluster.join_timeout_s) at {_where(env)}; "
            f"rank {env.rank} on {host} waited for them; HINT: see those ranks' logs (a crash or hang before "
            "init), check that their hosts can reach the address, or raise cluster.join_timeout_s"
        ) from None


_COLLECTIVE_TIMEOUT = re.compile(r"Timed out waiting \d+ms|collective operation timeout|Watchdog caught", re.I)


def is_timeout(exc: BaseException) -> bool:
    """True for a collective that gave up waiting (gloo: "Timed out waiting 5000ms for recv ...", nccl's
    watchdog: "... collective operation timeout"), not for any error that mentions a timeout."""
    return isinstance(exc, RuntimeError) and bool(_COLLECTIVE_TIMEOUT.search(str(exc)))


def explain_stall(where: str, grace_s: float = 10.0) -> str:
    """After a collective timed out: every rank that was waiting reports it on the store; the ranks that do not
    report within ``grace_s`` never reached the collective: they are the stuck ones. Returns the diagnosis."""
    try:
        return _explain_stall(where, grace_s)
    except (RuntimeError, OSError) as exc:  # the store's host (rank 0) may be gone too
        return f"the rendezvous store could not be asked which rank is stuck ({str(exc).splitlines()[0]})"


def _explain_stall(where: str, grace_s: float) -> str:
    group = _GROUP
    if group is None:
        return "no process group"
    env, store = group.env, group.store
    host = env.hostname or socket.gethostname()
    store.set(f"timed-out/{env.rank}", f"{host}|{where}")
    keys = [f"timed-out/{r}" for r in range(env.world_size)]
    try:
        store.wait(keys, timedelta(seconds=grace_s))
    except (RuntimeError, OSError):
        pass
    stuck = [r for r in range(env.world_size) if not store.check([keys[r]])]
    if not stuck:
        return "every rank was waiting: a network or backend problem, not a stuck rank"
    hosts = {r: store.get(f"joined/{r}").decode() for r in stuck}
    named = ", ".join(f"rank {r} on {hosts[r]}" for r in stuck)
    return (f"stuck: {named} never reached it (the ranks waiting for it reported within {grace_s:.0f} s); see "
            "its log (under the launcher's own agents its stack is dumped there when it is stopped)")


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def is_main_process() -> bool:
    return get_rank() == 0


def barrier() -> None:
    if is_initialized() and get_world_size() > 1:
        dist.barrier()


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place allreduce (``sum``/``mean``/``max``/``min``) across the default group; identity when alone."""
    if is_initialized() and get_world_size() > 1:
        if op == "mean":
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            tensor.div_(get_world_size())
        else:
            dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op.upper()))
    return tensor


def broadcast_(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """In-place broadcast from ``src``; identity when alone."""
    if is_initialized() and get_world_size() > 1:
        dist.broadcast(tensor, src=src)
    return tensor


def broadcast_buffers(module: torch.nn.Module, src: int = 0) -> None:
    """Rank ``src``'s buffers (batch-norm statistics) on every rank."""
    for buffer in module.buffers():
        broadcast_(buffer, src=src)


def all_gather_object(obj: object) -> list:
    """Every rank's ``obj``, in rank order (a one-element list when alone)."""
    if not (is_initialized() and get_world_size() > 1):
        return [obj]
    out: list = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: object, src: int = 0) -> object:
    """Rank ``src``'s ``obj`` on every rank."""
    if not (is_initialized() and get_world_size() > 1):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
