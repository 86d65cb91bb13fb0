"""The head of a several-node job (``+cluster=sim``, ``+cluster=ssh``) and its node processes (``launch/node.py``,
one per machine): waiting for them all, ending the others after a failure, and the line a stopped job ends with.
No torch here: the head only starts and watches processes."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable

from ..failures import STOP_CODES

AFTER_FAILURE_GRACE_S = 5.0  # after one node failed, the others' time to end on their own (the report follows)


def print_stopped(code: int, run_dir: str) -> None:
    """The one line a job stopped by a signal ends with (exit ``code``: 130 / 143)."""
    print(
        f"launcher: stopped by {signal.Signals(code - 128).name}; the ranks wrote a checkpoint, run again with "
        f"hydra.run.dir={run_dir} to continue",
        file=sys.stderr,
    )


def wait_nodes(
    nodes: list[subprocess.Popen],
    stop: Callable[[subprocess.Popen], None] = subprocess.Popen.terminate,
    at_once: tuple[int, ...] = (),
) -> tuple[list[int], int]:
    """Wait for the node processes of a several-node job (``launch/node.py``, or the ssh clients running it);
    returns every exit code (node order) and the node that failed first (-1: none did). After a failure the others
    get ``AFTER_FAILURE_GRACE_S`` to end on their own (their collectives fail fast once a peer is gone), then
    ``stop`` is applied to each one still running and they are waited for; after an exit code in ``at_once`` (a
    machine lost: its peers hang in collectives with it) they get no grace. A node stopped by a stop signal (exit
    130 / 143) starts no grace period: the others are stopping too."""
    done: queue.SimpleQueue = queue.SimpleQueue()
    for index, proc in enumerate(nodes):
        threading.Thread(target=lambda n=index, p=proc: done.put((n, p.wait())), daemon=True).start()
    codes: list[int] = [0] * len(nodes)
    first, grace, remaining = -1, None, len(nodes)
    while remaining:
        try:
            node, code = done.get(timeout=grace)
        except queue.Empty:
            after = (
                f"{AFTER_FAILURE_GRACE_S:.0f} s after the failure" if grace else "at once: they wait for a lost machine"
            )
            print(f"launcher: stopping the nodes still running {after}", file=sys.stderr)
            for proc in nodes:
                if proc.poll() is None:
                    stop(proc)
            for index, proc in enumerate(nodes):
                codes[index] = proc.wait()
            break
        remaining -= 1
        codes[node] = code
        if code != 0 and first < 0:
            first = node
        if code in at_once:
            grace = 0.0
        elif code not in (0, *STOP_CODES) and grace is None:
            grace = AFTER_FAILURE_GRACE_S
    return codes, first
