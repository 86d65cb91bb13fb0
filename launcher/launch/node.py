"""One node's elastic agent of a several-node job:
``python -m launcher.launch.node RUN_DIR NNODES NODE ENDPOINT RUN_ID ADDR [--over-ssh] [--restarts N]``.

Started once per node by the sim launcher (inside the node's network namespace when there is one) and by the
ssh launcher on each host. The launcher that started the agents reports once for all nodes.

``--restarts N``: the head restarts the whole job (it has done so N times: the ssh head, and the sim head under
``cluster.min_nodes``), so this agent does not. ``--over-ssh``: the head controls this agent through stdin (a line
``INT`` or ``TERM`` stops the job as that signal would, ``ABORT`` kills the workers at once: another machine is
lost, no checkpoint can be agreed; the end of input, when the head or its connection is gone,
stops it as SIGTERM), and the workers' output goes through a pipe this agent copies to the ssh channel: when the
channel breaks, lines are dropped (they are in the rank logs) instead of ranks failing on a broken pipe while they
checkpoint.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import select
import signal
import sys
import threading

from ..config import load_frozen
from ..env import HEAD_RESTARTS
from ..exiting import children
from ..files import no_world_writable_files
from .agent import agent_config, run_agent

HEAD_GONE = threading.Event()  # the head stopped talking: relayed output is dropped instead of blocking on it


def stop_on_request(silent_s: float) -> None:
    """Turn the head's requests on stdin into one stop signal for this process (the elastic agent passes it on
    to the workers). The head also writes a heartbeat line every few seconds: silence for ``silent_s`` (its link
    or this host's is down, the head is suspended) stops the job as the end of input does."""

    def watch() -> None:
        requested, pending = signal.SIGTERM, b""
        while True:
            ready, _, _ = select.select([0], [], [], silent_s)
            if not ready:
                HEAD_GONE.set()
                print(f"launcher: nothing from the head for {silent_s:.0f} s: stopping", file=sys.stderr, flush=True)
                break
            chunk = os.read(0, 4096)
            if not chunk:  # end of input: the head or its connection is gone
                HEAD_GONE.set()
                break
            *lines, pending = (pending + chunk).split(b"\n")
            if b"ABORT" in lines:  # a machine of the job is lost: no checkpoint is possible, end the ranks now
                for pid in children(os.getpid()):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                continue  # the agent sees its workers die, and ends
            stops = [line for line in lines if line in (b"INT", b"TERM")]  # other lines: heartbeats
            if stops:
                requested = signal.SIGINT if stops[0] == b"INT" else signal.SIGTERM
                break
        os.kill(os.getpid(), requested)

    threading.Thread(target=watch, name="stop-on-request", daemon=True).start()


def relay_output() -> None:
    """fds 1 and 2 (inherited by the workers) become pipes copied to the real ones by threads that survive a
    broken channel; at exit the copies are drained. A channel that stops draining (the link is down: sshd's buffers
    fill and TCP has not given up yet) must not block the agent or the workers on a write: the real fds are
    non-blocking, and once the head is gone (``HEAD_GONE``) what cannot be written is dropped."""
    pumps = []
    for fd in (1, 2):
        sys.stdout.flush()
        sys.stderr.flush()
        real = os.dup(fd)
        os.set_blocking(real, False)
        read, write = os.pipe()
        os.dup2(write, fd)
        os.close(write)

        def pump(read: int = read, real: int = real) -> None:
            while chunk := os.read(read, 65536):
                while chunk and not HEAD_GONE.is_set():
                    try:
                        chunk = chunk[os.write(real, chunk) :]
                    except BlockingIOError:
                        select.select([], [real], [], 1.0)
                    except OSError:
                        break  # the channel is gone: keep draining so writers never block

        thread = threading.Thread(target=pump, name=f"relay-{fd}", daemon=True)
        thread.start()
        pumps.append(thread)

    def drain() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):
            os.dup2(devnull, fd)  # our write ends close: each pump reads to the end
        for thread in pumps:
            thread.join(timeout=5)

    atexit.register(drain)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.launch.node")
    for name in ("run_dir", "nnodes", "node", "endpoint", "run_id", "addr"):
        parser.add_argument(name)
    parser.add_argument("--over-ssh", action="store_true")
    parser.add_argument(
        "--restarts", type=int, default=None, help="the head restarts the job (this many times so far), not the agent"
    )
    args = parser.parse_args(argv)
    no_world_writable_files()  # a remote shell's umask is not ours: the workers inherit this one
    job = load_frozen(args.run_dir)
    if args.restarts is not None:
        os.environ[HEAD_RESTARTS] = str(args.restarts)  # the workers' DistEnv.restart_count (faults' attempt=)
    if args.over_ssh:
        relay_output()
        stop_on_request(float(getattr(job.cluster, "heartbeat_timeout_s", 60.0)))
    node = int(args.node)
    config = agent_config(
        job,
        int(args.nnodes),
        args.endpoint,
        args.run_id,
        args.addr,
        node,
        fixed=args.over_ssh,
        agent_restarts=args.restarts is None,
    )
    return run_agent(job, config, node=node, report=False)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
