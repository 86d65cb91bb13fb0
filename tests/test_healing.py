"""Healing in place, the head's rules without a job: the keeper's round decisions (``membership.Rounds``) and the
head's wait (``launch/healing.wait_healing``) on real processes standing in for nodes, with a stand-in keeper.
The whole path runs in tests/test_sim.py (node killed, node frozen) and tests/test_ssh.py (the first machine's
link down)."""

import signal
import subprocess
import sys

import pytest

from launcher.launch import healing
from launcher.membership import Membership, Rounds

NAMES = ["node-0", "node-1", "node-2"]


def test_rounds_name_the_survivors_in_order_and_stop_below_min_nodes():
    rounds = Rounds(NAMES, min_nodes=2)
    assert rounds.lose({"node-7": "?"}, 1.0) is None  # not in the round: nothing to decide
    first = rounds.lose({"node-0": "gone"}, 5.0)
    assert first == {
        "round": 1,
        "members": ["node-1", "node-2"],
        "before": NAMES,
        "lost": {"node-0": "gone"},
        "fault_time": 5.0,
        "stop": "",
    }
    second = rounds.lose({"node-2": "frozen", "node-0": "again"}, 6.0)  # node-0 is no longer in the round
    assert (second["round"], second["members"], second["lost"]) == (2, [], {"node-2": "frozen"})
    assert second["stop"] == "1 node(s) left, fewer than cluster.min_nodes=2"


class StandInKeeper:
    """What the head sees of a keeper: ``lose`` is answered with the decision at once (``answer``: Rounds)."""

    def __init__(self, min_nodes: int, ends: bool = False) -> None:
        self.rounds, self.ends, self.told, self.put = Rounds(NAMES, min_nodes), ends, [], None

    def lose(self, name, why):
        self.told.append((name, why))
        self.put(("round", self.rounds.lose({name: why}, 0.0)))

    def read(self, put):
        self.put = put
        if self.ends:
            put(("keeper", -9))


def nodes(*codes_after: str) -> list[subprocess.Popen]:
    """Node processes: each runs the given Python statement (``wait``: until stopped)."""
    body = {"wait": "import time; time.sleep(60)", "ok": "pass", "killed": "import os; os.kill(os.getpid(), 9)"}
    return [subprocess.Popen([sys.executable, "-c", body[what]]) for what in codes_after]


def wait(procs, keeper, tmp_path, min_nodes):
    members = Membership(tmp_path, NAMES, min_nodes, max_restarts=0)
    why = lambda code: f"killed by {signal.Signals(-code).name}" if code < 0 else ""  # noqa: E731
    try:
        return healing.wait_healing(procs, NAMES, keeper, members, subprocess.Popen.terminate, why), members
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_a_killed_node_is_reported_and_the_others_go_on(tmp_path, capfd):
    keeper = StandInKeeper(min_nodes=2)
    out, members = wait(nodes("ok", "killed", "ok"), keeper, tmp_path, min_nodes=2)
    assert keeper.told == [("node-1", "killed by SIGKILL")]
    assert (out.first, out.lost, out.keeper_ended) == (-1, {1}, False)
    assert members.live == ["node-0", "node-2"]
    err = capfd.readouterr().err
    assert "launcher: lost node-1 (killed by SIGKILL): the survivors heal in place, continuing on 2 of 3 nodes" in err


def test_too_few_left_stops_the_others_at_once(tmp_path, capfd):
    out, _ = wait(nodes("wait", "killed", "wait"), StandInKeeper(min_nodes=3), tmp_path, min_nodes=3)
    assert (out.first, out.lost) == (1, {1})
    assert out.codes[0] == out.codes[2] == -signal.SIGTERM  # stopped, not waited for
    err = capfd.readouterr().err
    assert (
        "launcher: lost node-1 (killed by SIGKILL): 2 node(s) left, fewer than cluster.min_nodes=3; the job stops"
        in err
    )
    assert "stopping the nodes still running at once: too few nodes are left" in err


def test_the_keeper_ending_fails_the_attempt(tmp_path, capfd):
    out, _ = wait(nodes("wait", "wait", "wait"), StandInKeeper(min_nodes=2, ends=True), tmp_path, min_nodes=2)
    assert out.keeper_ended and out.first == 0 and out.codes[0] == 1  # a failure: restarted if max_restarts allows
    assert "the keeper (the job's store, on the head's host) ended with code -9" in capfd.readouterr().err


def test_a_failing_node_ends_the_attempt_as_without_healing(tmp_path, monkeypatch):
    monkeypatch.setattr(healing, "AFTER_FAILURE_GRACE_S", 0.0)  # the others' time to end on their own
    procs = [subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"]), *nodes("wait", "wait")]
    keeper = StandInKeeper(min_nodes=1)
    out, _ = wait(procs, keeper, tmp_path, min_nodes=1)
    assert keeper.told == []  # a failure is no lost machine
    assert (out.first, out.codes[0], out.lost) == (0, 1, set())


def test_a_round_that_loses_a_member_while_forming_is_left_for_the_next_decision():
    """The ranks' side: members check in on the keeper's store before their group forms; one that never comes
    (lost meanwhile) does not hold the others up until the group's timeout: the keeper's next decision does."""
    import json

    import torch.distributed as dist

    from launcher.env import DistEnv
    from launcher.membership import ROUND_END_KEY
    from launcher.train.heal import Healer

    store = dist.HashStore()
    healer = Healer("node-0", lost_after_s=1.0, store=store, number=1)
    env = DistEnv(rank=0, world_size=2, local_world_size=1, num_nodes=2)
    store.set("heal/in/1/1", "1")  # the other member arrived: the round forms
    assert healer._check_in(env) is None
    healer.number = 2
    decision = {"round": 3, "members": ["node-0"], "lost": {"node-1": "gone"}, "stop": "", "fault_time": 0.0}
    store.set(ROUND_END_KEY.format(2), json.dumps(decision))  # node-1 lost before it checked in to round 2
    assert healer._check_in(env) == decision


def test_the_keeper_loses_a_silent_node_but_not_one_whose_ranks_ended(tmp_path):
    """The real keeper process: two nodes beat; then node-0 says its ranks ended and falls silent, node-1 just falls
    silent (frozen). Only node-1 is lost, after ``lost_after_s``, in the store and on stdout."""
    import json
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from launcher.launch.ports import free_port
    from launcher.membership import DONE_KEY, HEARTBEAT_KEY, ROUND_END_KEY
    from launcher.rendezvous import attempt_prefix

    port = free_port("127.0.0.1")
    keeper = healing.Keeper([], "127.0.0.1", port, 0, 1, 1.0, ["node-0", "node-1"])
    try:
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        store = dist.PrefixStore(attempt_prefix(0), client)
        for _ in range(3):
            time.sleep(0.2)  # the heartbeat's pace (a node beats every 0.5 s)
            for name in ("node-0", "node-1"):
                store.add(HEARTBEAT_KEY.format(name), 1)
        silent = time.time()
        store.set(DONE_KEY.format("node-0"), "1")
        store.wait([ROUND_END_KEY.format(0)], timedelta(seconds=10))
        took = time.time() - silent
        decision = json.loads(store.get(ROUND_END_KEY.format(0)))
        assert decision["members"] == ["node-0"] and list(decision["lost"]) == ["node-1"], decision
        assert decision["lost"]["node-1"].startswith("no heartbeat for 1."), decision
        assert 1.0 <= took < 3.0, took
        with pytest.raises(RuntimeError):  # node-0, as silent as node-1 was by now, is never lost
            store.wait([ROUND_END_KEY.format(1)], timedelta(seconds=1.5))
    finally:
        keeper.close()
    assert keeper.proc.returncode == 0
