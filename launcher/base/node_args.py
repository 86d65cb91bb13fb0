"""A node process's command line (``NodeArgs``): ``python -m launcher.launch.nodes.process``'s arguments, built by
the head (``launch/nodes/attempts.py``, for the sim and ssh modes) with ``argv`` and read back by the node process
with ``parse``, so the two sides cannot drift apart. It lives here, below both, because the node process's two
paths read it: torch's elastic agent (``launch/nodes/process.py``) and a healing job's ranks
(``heal/node_side.py``, which may not import the launch layer). No torch here: the head builds it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeArgs:
    """``python -m launcher.launch.nodes.process``'s command line: built by the head (ssh, sim) with ``argv``, read
    back by process.py with ``parse``."""

    run_dir: str
    nodes: int  # the nodes of this attempt
    node: int  # this node's rank among them (0 hosts the rendezvous store)
    endpoint: str  # HOST:PORT of the rendezvous store, on node 0
    launch_id: str  # this attempt's identity (the elastic run id; failure records are kept under it)
    addr: str  # this node's address, as the other nodes reach it
    stdin_control: bool = False  # the head controls the node through stdin (``control.Control``); output relayed
    static_rendezvous: bool = False  # node ranks as given, no agent restarts (machines named by the user)
    head_restarts: bool = False  # the head restarts the whole job, not the agent (ssh; sim under min_nodes)
    attempt: int = 0  # the head's 0-based attempt number (with ``head_restarts``): the workers' DistEnv.attempt
    members: str = ""  # healing in place: this attempt's nodes by name (a,b,...); ``endpoint`` is the keeper's store
    start: int = 0  # healing in place: this node process's start in the attempt (``protocol.node_id``); > 0: joins
    words: tuple[str, ...] = ()  # what the job runs (``config.rules.entry_argv``): for ps, and room for the title

    def argv(self, python: str) -> list[str]:
        argv = [python, "-u", "-m", "launcher.launch.nodes.process", self.run_dir, str(self.nodes), str(self.node)]
        argv += [self.endpoint, self.launch_id, self.addr]
        argv += ["--stdin-control"] if self.stdin_control else []
        argv += ["--static-rendezvous"] if self.static_rendezvous else []
        argv += ["--head-restarts", "--attempt", str(self.attempt)] if self.head_restarts else []
        argv += ["--members", self.members] if self.members else []
        argv += ["--start", str(self.start)] if self.start else []
        return argv + ["--", *self.words]

    @classmethod
    def parse(cls, argv: list[str]) -> NodeArgs:
        parser = argparse.ArgumentParser(prog="python -m launcher.launch.nodes.process", description=cls.__doc__)
        for name in ("run_dir", "nodes", "node", "endpoint", "launch_id", "addr"):
            parser.add_argument(name, type=int if name in ("nodes", "node") else str)
        for flag in ("--stdin-control", "--static-rendezvous", "--head-restarts"):
            parser.add_argument(flag, action="store_true")
        parser.add_argument("--attempt", type=int, default=0)
        parser.add_argument("--members", default="")
        parser.add_argument("--start", type=int, default=0)
        cut = argv.index("--") if "--" in argv else len(argv)  # the job's words after it, as they are
        return cls(**vars(parser.parse_args(argv[:cut])), words=tuple(argv[cut + 1 :]))
