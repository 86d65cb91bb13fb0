"""Start-up at scale, for bench/scale.py (issue 61, item 1): from one moment to every simulated rank ready, the
launcher's way against torch's store alone, on the same store server and the same number of clients.

Each simulated rank is a thread of one of ``--hosts`` processes, with a store client of its own (a TCP connection,
as a rank has). Ready means:

- ``ours``: joined the job's signed store and checked in (``launcher.group.rendezvous.check_in``: its arrival signed,
  rank 0 verifying every rank's before it says all have joined) -- the launcher's part of forming a group, as far as
  a CPU box can show one at this size (gloo's own connections are not made);
- ``torch``: torch's store barrier alone (each client adds to one counter; the last one sets a key the others wait
  for), what ``init_process_group`` does over its store before its backend connects.

The hosts start, connect nothing, and say ``up``; the parent then hands every host the same start time on its
stdin; each host prints one JSON line, its ranks' seconds from that moment to connected (the store client made) and
to ready. On this box c10d's client connect alone stalls for exactly 5 or 10 s now and then when tens of clients
connect at once, torch's barrier and ours alike (with c10d's warning "The hostname of the client socket cannot be
retrieved. err=-3", EAI_AGAIN; plain sockets on a listener of the same backlog: 256 at once in 0.06 s): the connect
phase is reported apart.

    python bench/scale_start.py host KIND PORT WORLD FIRST LAST     (KIND: ours or torch; the secret from the env)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from launcher.base.env import DistEnv
from launcher.group.rendezvous import attempt_prefix, check_in, listening_store
from launcher.trust.secret import Secret
from launcher.trust.signed import guard

JOIN_S = 600.0  # cluster.join_timeout_s for the simulated ranks: long enough never to be what ends a run
PER_NODE = 4  # ranks a simulated node (only their DistEnv says it)
KINDS = ("ours", "torch")  # the launcher's start-up, torch's store alone


def _ready(kind: str, port: int, rank: int, world: int, secret: Secret | None) -> float:
    """Make rank ``rank`` ready; when its store client had connected (wall clock)."""
    client = dist.TCPStore(
        "127.0.0.1", port, world_size=world, is_master=False, timeout=timedelta(seconds=JOIN_S), wait_for_workers=False
    )
    connected = time.time()
    if kind == "torch":
        if client.add("arrived", 1) == world:
            client.set("all", "1")
        client.wait(["all"])
        return connected
    env = DistEnv(
        rank=rank, local_rank=rank % PER_NODE, world_size=world, local_world_size=PER_NODE,
        node_rank=rank // PER_NODE, num_nodes=max(1, world // PER_NODE), master_addr="127.0.0.1", master_port=port,
        hostname=f"sim-{rank // PER_NODE}",
    )  # fmt: skip
    check_in(guard(client, secret, attempt_prefix(0)), env, JOIN_S)
    return connected


def host(kind: str, port: int, world: int, first: int, last: int) -> None:
    """Ranks ``first`` .. ``last - 1``: each a thread waiting for the start time (read from stdin), then made ready."""
    secret = Secret.from_environ(keep=True) if kind == "ours" else None
    start, took = threading.Event(), {}
    t0: list[float] = []

    def rank(r: int) -> None:
        start.wait()
        connected = _ready(kind, port, r, world, secret)
        took[r] = (connected - t0[0], time.time() - t0[0])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(first, last)]
    for thread in threads:
        thread.start()
    print("up", flush=True)
    t0.append(float(sys.stdin.readline()))
    start.set()
    for thread in threads:
        thread.join()
    print(json.dumps(took), flush=True)


def ready_times(kind: str, ranks: int, hosts: int) -> tuple[list[float], list[float]]:
    """Every simulated rank's seconds from the common start to connected and to ready (each sorted), ``kind``
    ``ours`` or ``torch``."""
    store = listening_store("127.0.0.1", 0, timedelta(seconds=JOIN_S))  # the store a job's rendezvous serves
    env = {**os.environ, **(Secret.new().environ() if kind == "ours" else {})}
    cuts = [ranks * i // hosts for i in range(hosts + 1)]
    argv = [sys.executable, str(Path(__file__).resolve()), "host", kind, str(store.port), str(ranks)]
    procs = [
        subprocess.Popen([*argv, str(a), str(b)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        for a, b in zip(cuts, cuts[1:])
        if b > a
    ]
    try:
        for proc in procs:  # every host imported and made its threads: the clock starts for all at once
            if proc.stdout is None or proc.stdout.readline().strip() != "up":
                raise SystemExit(f"a start-up host ended before it was up (exit {proc.wait()})")
        t0 = f"{time.time():.6f}\n"
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(t0)
            proc.stdin.close()
        times: list[list[float]] = []
        for proc in procs:
            assert proc.stdout is not None
            out = proc.stdout.read()
            if proc.wait(timeout=JOIN_S):
                raise SystemExit(f"a start-up host failed (exit {proc.returncode})")
            times += json.loads(out.strip().splitlines()[-1]).values()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return sorted(c for c, _ in times), sorted(r for _, r in times)


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of sorted ``values`` (nearest rank)."""
    return values[min(len(values) - 1, max(0, round(q * len(values)) - 1))]


if __name__ == "__main__":
    if len(sys.argv) != 7 or sys.argv[1] != "host" or sys.argv[2] not in KINDS:
        raise SystemExit(__doc__)
    host(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
