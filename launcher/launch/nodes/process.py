"""One node's process of a several-node job, running this node's ranks: under torch's elastic agent
(``elastic_agent``), or in a job that heals in place without one (``heal_worker``, with ``--members``):
``python -m launcher.launch.nodes.process RUN_DIR NODES NODE ENDPOINT LAUNCH_ID ADDR [--stdin-control]
[--static-rendezvous] [--head-restarts --attempt N] [--members A,B,... [--start K]]`` (built and parsed by
``base.node_args.NodeArgs``).

Started once per node by the head: the sim launcher (inside the node's network namespace when there is one) and
the ssh launcher on each host. The head reports once for all nodes.

``--static-rendezvous``: node ranks as given (the ssh hosts' order), torch's static rendezvous. ``--head-restarts``:
the head restarts the whole job (``--attempt N``: this is its attempt N, 0-based; the ssh head, and the sim head
under ``cluster.min_nodes``), so the agent does not. ``--members``: the job heals in place (``launcher.heal.node_side``
runs the ranks, ENDPOINT is the keeper's store). The job's secret comes in the first line of stdin with
``--stdin-control`` (ssh; with the forwarded environment, ``cluster.env``'s values), else in the environment.
``--stdin-control``: the head controls this node through stdin (``control.Control``: a line ``INT``, ``TERM`` or
``HUP`` stops the job as that signal would (a second one, the head's second stop signal, is passed on as that signal
again: the agent ends its workers at once, naming it), ``ABORT`` kills the workers at once: another machine is lost,
no checkpoint can be agreed; ``PING`` is a heartbeat; the end of input, when the head or its
connection is gone, stops it as SIGTERM),
and the workers' output goes through a pipe this process copies to the ssh channel: when the channel breaks, lines
are dropped (they are in the rank logs) instead of ranks
failing on a broken pipe while they checkpoint.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import select
import signal
import sys
import threading
from typing import Optional

from launcher.base.env import HEAD_ATTEMPT
from launcher.base.exiting import children
from launcher.base.files import no_world_writable_files
from launcher.base.node_args import NodeArgs
from launcher.base.titles import name_process
from launcher.config import JobConfig, load_frozen
from launcher.config.rules import entry_words
from launcher.launch.nodes.control import Control
from launcher.trust.secret import Secret, read_handoff

HEAD_GONE = threading.Event()  # the head stopped talking: relayed output is dropped instead of blocking on it


def stop_on_request(silent_s: float) -> None:
    """Turn the head's ``Control`` words on stdin into a stop signal for this process (the elastic agent passes it on
    to the workers, with their grace); a second stop word is a second stop signal (the agent ends the workers at
    once, naming it, as a second Ctrl-C to a local agent does); an ``ABORT`` (a machine lost) kills the workers at
    once. The head also writes ``PING`` every few seconds: silence for ``silent_s`` (its link or this
    host's is down, the head is suspended) stops the job as the end of input does."""

    def watch() -> None:
        pending, stopped = b"", 0  # the stop signals passed on (the head sends two at most)
        while True:
            ready, _, _ = select.select([0], [], [], silent_s)
            chunk = os.read(0, 4096) if ready else b""
            if not chunk:  # silence, or the end of input: the head or its connection is gone
                HEAD_GONE.set()
                if not ready:
                    print(f"launcher: nothing from the head for {silent_s:.0f} s: stopping", file=sys.stderr)
                if not stopped:
                    os.kill(os.getpid(), signal.SIGTERM)
                return
            *lines, pending = (pending + chunk).split(b"\n")
            words = [Control[w] for line in lines if (w := line.decode(errors="replace")) in Control.__members__]
            if Control.ABORT in words:  # a machine of the job is lost: end the ranks now
                for pid in children(os.getpid()):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                continue  # the agent sees its workers die, and ends
            stops = [word for word in words if word in (Control.INT, Control.TERM, Control.HUP)]  # PING: a heartbeat
            for word in stops[: max(0, 2 - stopped)]:  # the first: the ranks' grace; the second: at once, named
                stopped += 1
                os.kill(os.getpid(), word.signum)

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
    args = NodeArgs.parse(argv)
    job, secret = set_up(args)
    if args.members:  # healing in place (``--members``)
        return heal_worker(job, args, secret)
    return elastic_agent(job, args)


def set_up(args: NodeArgs) -> tuple[JobConfig, Optional[Secret]]:
    """What both paths need first: the head's hand-off (ssh), torch loaded quietly, the job's frozen config and
    secret, the head's attempt, and with ``--stdin-control`` the relayed output and the head's words."""
    if args.stdin_control:  # over ssh: the job's secret and the forwarded environment (cluster.env) come first on
        os.environ.update(read_handoff(0))  # stdin, never on a command line; set before torch reads its variables
    # This agent's own C++ warnings are noise (when a job ends, each agent whose store went away prints ~20 lines
    # of C++ frames; the head names what failed). torch reads the level once, as it loads (just below); the
    # workers, the user's code, do not inherit it.
    users_level = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = users_level or "ERROR"
    import launcher.launch.nodes.agent  # noqa: F401  (torch loads here)

    if users_level is None:
        del os.environ["TORCH_CPP_LOG_LEVEL"]
    no_world_writable_files()  # the head's umask (ssh: its remote shell set it) and never others' write: the workers'
    secret = Secret.from_environ(os.environ, keep=True)  # the agent's workers inherit it (and take it out of theirs)
    job = load_frozen(args.run_dir)
    name_process(f"node {args.node}/{args.nodes}", entry_words(job), job.run_dir)
    if args.head_restarts:
        os.environ[HEAD_ATTEMPT] = str(args.attempt)  # the workers' DistEnv.attempt (faults' attempt=)
    if args.stdin_control:
        relay_output()
        stop_on_request(float(getattr(job.cluster, "heartbeat_timeout_s", 60.0)))
    return job, secret


def elastic_agent(job: JobConfig, args: NodeArgs) -> int:
    """This node's ranks under torch's elastic agent, meeting the other nodes' agents at ``args.endpoint``."""
    from launcher.launch.nodes.agent import agent_config, run_agent

    config = agent_config(
        job,
        args.nodes,
        args.endpoint,
        args.launch_id,
        args.addr,
        args.node,
        static_rendezvous=args.static_rendezvous,
        head_restarts=args.head_restarts,
    )
    return run_agent(job, config, node=args.node, report=False)


def heal_worker(job: JobConfig, args: NodeArgs, secret: Optional[Secret]) -> int:
    """This node's ranks in a job that heals in place: no agents' rendezvous (``launcher.heal.node_side``), the
    keeper's store at ``args.endpoint``."""
    from launcher.heal.node_side import run_workers

    if secret is None:
        raise SystemExit("launcher: a node of a job that heals in place got no job secret from its head")
    return run_workers(job, args, secret)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
