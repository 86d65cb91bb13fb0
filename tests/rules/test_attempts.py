"""The one attempt loop of the several-node heads (``launch/nodes/attempts.py``: ``run_on_machines``, ``run_attempt``,
the wait in ``waiting.py``) driven by a stand-in mode whose nodes and keeper are no processes: a plain attempt that
finishes; a machine lost by signal, its peers ended at once and the job restarted while restarts are left, then stopped
with the exit code and the job's report when none are; a healing attempt where the keeper's decision shrinks the
``Membership`` through its own method. The real modes on real processes: tests/beds/test_sim.py, tests/beds/test_ssh.py;
the wait on real processes with a stand-in keeper: tests/jobs/test_healing_processes.py."""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass, field

import pytest

from harness.config import plan
from launcher.base.node_args import NodeArgs
from launcher.base.run_dir import RunDir
from launcher.heal.rounds import Rounds
from launcher.launch.nodes import waiting
from launcher.launch.nodes.attempts import KeeperAt, Placement, run_on_machines
from launcher.launch.nodes.control import Control
from launcher.launch.nodes.restarts import Membership
from launcher.report.failures import exit_failure, record_exits
from launcher.trust.secret import Secret

NAMES = ["node-0", "node-1", "node-2"]
KILLED = -9
SIGHUP_TO_THE_HEAD = 1000  # (a script's "code": the head gets SIGHUP then)


class StandInNode:
    """A node process that is no process: it ends when its script says (at its start), or when the head's word
    stops it (``TERM``: 143; ``ABORT``: its ranks killed, 1), or when it is killed (-9)."""

    def __init__(self, args: NodeArgs, fails: bool = False) -> None:
        self.args, self.fails, self.words, self.code = args, fails, list[Control](), 0
        self.ended, self.finished = threading.Event(), False

    def end(self, code: int) -> None:
        if not self.ended.is_set():
            if code == 1 and self.fails:  # its rank's own record, as a failing rank writes it
                where = RunDir(self.args.run_dir).failure_attempt(self.args.launch_id, self.args.attempt)
                record_exits(where, [exit_failure(self.args.node, 4242, 1, "box", self.args.node, self.args.nodes)])
            self.code = code
            self.ended.set()

    def wait(self) -> int:
        if not self.ended.wait(10):  # (a broken driver: the test fails on what it sees, without hanging)
            self.end(99)
        return self.code

    def request(self, word: Control) -> None:
        self.words.append(word)
        if word in (Control.INT, Control.TERM, Control.HUP):
            self.end(128 + word.signum)
        elif word is Control.ABORT:
            self.end(1)

    def kill(self) -> None:
        self.end(KILLED)

    def finish(self) -> None:
        self.finished = True


@dataclass
class StandInMachines:
    """``attempts.Machines`` whose attempts follow ``script``: per attempt, the machine whose node ends at once and
    its exit code (a machine not named runs until the head stops it; ``None``: every node finishes, node K after
    K x 0.1 s)."""

    script: list[tuple[str, int] | None]
    heals: bool = False
    where: str = "node"
    placed: list[tuple[list[str], list[str]]] = field(default_factory=list)  # (the machines, those just lost)
    started: list[StandInNode] = field(default_factory=list)

    def place(self, members: Membership, lost: list[str]) -> Placement:
        self.placed.append((members.live, lost))
        if self.heals:
            return Placement(members.live, keeper=KeeperAt([], "10.0.0.254", 29400))
        return Placement(members.live, store="10.0.0.1:29400")

    def start(self, args: NodeArgs, name: str) -> StandInNode:
        node = StandInNode(args, fails=True)
        self.started.append(node)
        ends = self.script[min(args.attempt, len(self.script) - 1)]
        if ends is None:
            threading.Timer(0.1 * args.node, node.end, (0,)).start()
        elif ends[0] == name and ends[1] == SIGHUP_TO_THE_HEAD:
            os.kill(os.getpid(), signal.SIGHUP)  # as the last node starts
        elif ends[0] == name:
            node.end(ends[1])
        return node

    def lost(self, code: int) -> str:
        return "killed by SIGKILL" if code == KILLED else ""

    def answering(self, names: list[str]) -> list[str]:
        return []


class StandInKeeper:
    """What the head sees of a keeper, deciding with the real rules (``Rounds``); once a round is decided the
    survivors finish (``then``)."""

    def __init__(self, prefix, addr, port, attempt, min_nodes, lost_after_s, names, secret) -> None:
        self.endpoint, self.rounds, self.told, self.closed = f"{addr}:{port}", Rounds(names, min_nodes), [], False
        self.then = lambda: None

    def lose(self, name: str, why: str) -> None:
        self.told.append((name, why))
        if (decision := self.rounds.lose({name: why}, 0.0)) is not None:
            self.put(("round", decision))
        self.then()

    def join(self, name, start, ranks, answered) -> None:
        raise AssertionError("no machine answers here")

    def read(self, put) -> None:
        self.put = put

    def close(self) -> None:
        self.closed = True


def job_of(tmp_path, min_nodes: int, max_restarts: int = 0):
    sim = ("+cluster=sim", "cluster.nodes=3", f"cluster.min_nodes={min_nodes}", "cluster.procs_per_node=1")
    job, _ = plan(*sim, f"cluster.max_restarts={max_restarts}", "train.batch_size=48", run_dir=tmp_path)
    return job


def test_a_plain_attempt_that_finishes(tmp_path, capfd):
    machines, job = StandInMachines([None]), job_of(tmp_path, min_nodes=3)
    members = Membership(RunDir(tmp_path), NAMES, 3, max_restarts=1)
    assert run_on_machines(machines, job, members, Secret.new()) == 0
    assert machines.placed == [(NAMES, [])] and members.attempt == 0  # one attempt, nothing spent
    assert [(n.args.node, n.args.nodes, n.args.endpoint, n.args.members) for n in machines.started] == [
        (0, 3, "10.0.0.1:29400", ""),
        (1, 3, "10.0.0.1:29400", ""),
        (2, 3, "10.0.0.1:29400", ""),
    ]
    assert len({n.args.launch_id for n in machines.started}) == 1
    assert all(n.finished and not n.words for n in machines.started)
    assert capfd.readouterr().err == ""


def test_a_machine_lost_restarts_the_job_while_restarts_are_left_then_it_stops(tmp_path, capfd):
    """Attempt 0: node-1's process killed: its peers are ended at once (ABORT: they wait for it in collectives),
    the loss is said, not blamed on them, and the job restarts on every node (restart 1 of 1). Attempt 1: node-0's
    rank fails: the others are stopped after the grace, the job's report names the failing rank, and with no
    restart left the job ends with exit 1."""
    machines, job = StandInMachines([("node-1", KILLED), ("node-0", 1)]), job_of(tmp_path, min_nodes=3)
    members = Membership(RunDir(tmp_path), NAMES, 3, max_restarts=1)
    assert run_on_machines(machines, job, members, Secret.new(), keeper=_no_keeper) == 1
    first, second = machines.started[:3], machines.started[3:]
    assert [n.args.attempt for n in machines.started] == [0, 0, 0, 1, 1, 1]
    assert machines.placed == [(NAMES, []), (NAMES, ["node-1"])]  # the lost one: not waited for by the checks
    assert [n.words for n in first] == [[Control.ABORT], [], [Control.ABORT]]
    assert [n.words for n in second] == [[], [Control.TERM], [Control.TERM]]
    assert members.spent_restarts == 1 and members.live == NAMES
    err = capfd.readouterr().err
    assert "launcher: stopping the nodes still running at once: they wait for a lost machine" in err
    assert "launcher: node 1 (node-1): killed by SIGKILL" in err
    assert "launcher: the ranks on the other nodes were ended (they waited for node-1 in collectives)" in err
    said = (
        "launcher: attempt 0 ended: node node-1 lost (killed by SIGKILL); restarting on every node: attempt 1 starts "
        "(restart 1 of 1, 0 left: cluster.max_restarts)"
    )
    assert err.count(said) == 1
    assert "launcher: stopping the nodes still running 0 s after the failure" in err
    assert "launcher: rank 0 (node 0, pid 4242) on box exited with code 1" in err  # the report, of attempt 1 only
    assert err.count("launcher: rank ") == 1 and err.index(said) < err.index("launcher: rank 0")


def test_a_stop_signal_to_the_head_stops_every_node_and_ends_the_job(tmp_path, capfd):
    """SIGHUP to the head while the nodes start: passed on as HUP to every node, those started after it included;
    the job ends with 129 and the stop line, no restart although one is left."""
    machines, job = StandInMachines([("node-2", SIGHUP_TO_THE_HEAD)]), job_of(tmp_path, min_nodes=3)
    members = Membership(RunDir(tmp_path), NAMES, 3, max_restarts=1)
    before = signal.signal(signal.SIGHUP, lambda *_: None)  # (a driver that forwards nothing: the test fails, lives)
    try:
        assert run_on_machines(machines, job, members, Secret.new(), keeper=_no_keeper) == 129
    finally:
        signal.signal(signal.SIGHUP, before)
    assert [n.words[:1] for n in machines.started] == [[Control.HUP]] * 3 and members.attempt == 0
    err = capfd.readouterr().err
    assert "launcher: SIGHUP: stopping the job on every node (the ranks checkpoint)" in err
    assert "launcher: stopped by SIGHUP; no checkpoint was written yet in " in err
    assert "restarting" not in err and "exited with code" not in err


def test_a_machine_lost_under_min_nodes_goes_on_without_it(tmp_path, capfd):
    """``cluster.min_nodes=2``: the next attempt runs on the two left (a loss spends no restart); losing one more
    leaves too few: the job stops."""
    machines, job = StandInMachines([("node-1", KILLED), ("node-2", KILLED)]), job_of(tmp_path, min_nodes=2)
    members = Membership(RunDir(tmp_path), NAMES, 2, max_restarts=0)
    assert run_on_machines(machines, job, members, Secret.new(), keeper=_no_keeper) == 1
    assert machines.placed == [(NAMES, []), (["node-0", "node-2"], ["node-1"])]
    assert [n.args.nodes for n in machines.started] == [3, 3, 3, 2, 2]
    err = capfd.readouterr().err
    assert "launcher: lost node-1 (killed by SIGKILL): continuing on 2 of 3 nodes from the start" in err
    assert "launcher: lost node-2 (killed by SIGKILL): 1 node(s) left, fewer than cluster.min_nodes=2" in err
    assert len((tmp_path / "membership.jsonl").read_text().splitlines()) == 1


def test_a_healing_attempt_shrinks_the_membership_through_the_keepers_decision(tmp_path, capfd):
    """Healing in place: node-1's process killed is told to the keeper, whose decision drops it: the head's
    Membership follows it (``Membership.apply``), nothing restarts, the survivors finish, exit 0."""
    machines, job = StandInMachines([("node-1", KILLED)], heals=True), job_of(tmp_path, min_nodes=2)
    members = Membership(RunDir(tmp_path), NAMES, 2, max_restarts=1)
    keepers: list[StandInKeeper] = []

    def keeper(*args) -> StandInKeeper:
        keepers.append(StandInKeeper(*args))
        keepers[-1].then = lambda: [n.end(0) for n in machines.started if n.args.node != 1]  # the survivors finish
        return keepers[-1]

    assert run_on_machines(machines, job, members, Secret.new(), keeper=keeper) == 0
    [held] = keepers
    assert held.told == [("node-1", "killed by SIGKILL")] and held.closed
    assert members.live == ["node-0", "node-2"] and members.all == NAMES and members.attempt == 0
    assert [(n.args.endpoint, n.args.members) for n in machines.started] == [("10.0.0.254:29400", ",".join(NAMES))] * 3
    assert all(not n.words for n in machines.started)  # nobody stopped: the survivors went on
    err = capfd.readouterr().err
    assert (
        "launcher: lost node-1 (killed by SIGKILL): the survivors heal in place, continuing on 2 of 3 nodes "
        "(round 1, cluster.min_nodes=2)" in err
    )
    assert "restarting" not in err and "launcher: rank " not in err
    with pytest.raises(AttributeError):  # Membership changes only through its methods
        members.live = NAMES  # type: ignore[misc]


def _no_keeper(*args):
    raise AssertionError("a job that does not heal has no keeper")


@pytest.fixture(autouse=True)
def no_grace(monkeypatch):
    """The others' time to end on their own after a failure: none here (they end only when told)."""
    monkeypatch.setattr(waiting, "AFTER_FAILURE_GRACE_S", 0.0)
