"""Healing in place, the head's wait (``launch.nodes.waiting.wait_for_nodes``) on real processes standing in for nodes,
with a stand-in keeper; the real keeper process with a stranger writing into its store. (The rules without a process:
tests/rules/test_healing.py; the attempt loop with a stand-in mode: tests/rules/test_attempts.py.)"""

import signal
import subprocess
import sys

from launcher.base.run_dir import RunDir
from launcher.heal import head_side as healing
from launcher.heal.protocol import Decision
from launcher.heal.rounds import Rounds
from launcher.launch.nodes import waiting
from launcher.launch.nodes.control import ProcessNode
from launcher.launch.nodes.restarts import Membership

NAMES = ["node-0", "node-1", "node-2"]


class StandInKeeper:
    """What the head sees of a keeper: ``lose`` is answered with the decision at once (``answer``: Rounds)."""

    def __init__(self, min_nodes: int, ends: bool = False) -> None:
        self.rounds, self.ends, self.told, self.put = Rounds(NAMES, min_nodes), ends, [], None

    def lose(self, name, why):
        self.told.append((name, why))
        if (decision := self.rounds.lose({name: why}, 0.0)) is not None:  # (none: not in the round)
            self.put(("round", decision))

    def join(self, name, start, ranks, answered):
        self.told.append((name, f"joins as start {start} with {ranks} rank(s)"))
        self.put(("round", self.rounds.join(name, answered)))

    def read(self, put):
        self.put = put
        if self.ends:
            put(("keeper", -9))


class StandInRejoin:
    """A lost node answers again at the first check; its node process runs ``body`` (a ``nodes`` word)."""

    ranks, every_s = 2, 0.05

    def __init__(self, body: str) -> None:
        self.body, self.started, self.checked, self.procs = body, [], [], []  # procs: the joiner's

    def answering(self, names):
        self.checked.append(list(names))
        return names if len(self.checked) == 1 else []  # once

    def start(self, name, start, members):
        self.started.append((name, start, members))
        self.procs = nodes(self.body)
        return ProcessNode(self.procs[0])


def nodes(*codes_after: str) -> list[subprocess.Popen]:
    """Node processes: each runs the given Python statement (``wait``: until stopped; ``input``: until its input
    ends, ``end``)."""
    body = {"wait": "import time; time.sleep(60)", "ok": "pass", "killed": "import os; os.kill(os.getpid(), 9)"}
    body["input"] = "import sys; sys.stdin.read()"
    return [
        subprocess.Popen([sys.executable, "-c", body[what]], stdin=subprocess.PIPE if what == "input" else None)
        for what in codes_after
    ]


def end(procs: list[subprocess.Popen]) -> None:
    """End the ``input`` ones (exit 0)."""
    for proc in procs:
        if proc.stdin is not None:
            proc.stdin.close()


def wait(procs, keeper, tmp_path, min_nodes, rejoin=None):
    members = Membership(RunDir(tmp_path), NAMES, min_nodes, max_restarts=0)
    why = lambda code: f"killed by {signal.Signals(-code).name}" if code < 0 else ""  # noqa: E731
    held = [ProcessNode(proc) for proc in procs]  # a joiner is added to it
    try:
        healing = waiting.HealingAttempt(keeper, members, rejoin)
        return waiting.wait_for_nodes(held, NAMES, why, healing=healing), members
    finally:
        for node in held:
            node.proc.kill()
            node.proc.wait()


def test_a_killed_node_is_reported_and_the_others_go_on(tmp_path, capfd):
    keeper, procs = StandInKeeper(min_nodes=2), nodes("input", "killed", "input")
    told = keeper.lose
    keeper.lose = lambda name, why: (told(name, why), end(procs))  # the survivors end once the loss is decided
    out, members = wait(procs, keeper, tmp_path, min_nodes=2)
    assert keeper.told == [("node-1", "killed by SIGKILL")]
    assert (out.first, out.lost, out.keeper_ended) == (-1, {1}, False)
    assert members.live == ["node-0", "node-2"]
    err = capfd.readouterr().err
    assert "launcher: lost node-1 (killed by SIGKILL): the survivors heal in place, continuing on 2 of 3 nodes" in err


def test_a_lost_node_that_answers_again_gets_a_node_process_that_joins(tmp_path, capfd):
    """node-1 is killed; the next check finds it answering: a node process is started for it (its start number 1,
    the round it expects to join: itself last), the keeper is told, its decision brings the world back to 3."""
    keeper, rejoin = StandInKeeper(min_nodes=2), StandInRejoin("input")
    procs = nodes("input", "killed", "input")
    keeper.join = lambda *said, join=keeper.join: (join(*said), end([*procs, *rejoin.procs]))  # then all end
    out, members = wait(procs, keeper, tmp_path, min_nodes=2, rejoin=rejoin)
    assert rejoin.started == [("node-1", 1, ["node-0", "node-2", "node-1"])]
    assert keeper.told == [("node-1", "killed by SIGKILL"), ("node-1", "joins as start 1 with 2 rank(s)")]
    assert members.live == ["node-0", "node-2", "node-1"] and out.names == [*NAMES, "node-1"]
    assert (out.first, out.lost) == (-1, {1})  # the killed one: lost, no failure; the joiner: a member
    err = capfd.readouterr().err
    assert "launcher: node-1 answers again: starting its ranks to join the job in place" in err
    assert "launcher: node-1 joined, continuing on 3 of 3 nodes (round 2, cluster.min_nodes=2)" in err


def test_a_machine_whose_node_process_ends_before_it_joined_is_no_failure(tmp_path, capfd):
    """The joiner's node process fails before the keeper let it in: said, the keeper told, and the job goes on
    (exit 0) without it."""
    keeper, rejoin = StandInKeeper(min_nodes=2), StandInRejoin("killed")
    keeper.join = lambda name, *_: keeper.told.append((name, "joins"))  # never ready: no decision
    procs = nodes("input", "killed", "input")
    told = keeper.lose
    keeper.lose = lambda name, why: (told(name, why), len(keeper.told) == 3 and end(procs))
    out, members = wait(procs, keeper, tmp_path, min_nodes=2, rejoin=rejoin)
    assert keeper.told[1:] == [("node-1", "joins"), ("node-1", "its node process ended before it joined")]
    assert out.first == -1 and members.live == ["node-0", "node-2"]
    assert "launcher: node-1 did not join (its node process ended with code -9)" in capfd.readouterr().err


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
    monkeypatch.setattr(waiting, "AFTER_FAILURE_GRACE_S", 0.0)  # the others' time to end on their own
    procs = [subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"]), *nodes("wait", "wait")]
    keeper = StandInKeeper(min_nodes=1)
    out, _ = wait(procs, keeper, tmp_path, min_nodes=1)
    assert keeper.told == []  # a failure is no lost machine
    assert (out.first, out.codes[0], out.lost) == (0, 1, set())


def test_the_real_keeper_ignores_a_stranger_loses_a_silent_node_lets_it_join_and_never_loses_a_finished_one(
    tmp_path, capfd, caplog
):
    """The real keeper process: two nodes beat; then node-0 says its ranks ended and falls silent, node-1 just falls
    silent (frozen), while a stranger (a plain store client with another secret, or none) beats for node-1 and
    writes its own decision. Only node-1 is lost, after ``lost_after_s``, in the store and on stdout; the stranger's
    values are ignored and said once each. The head then says node-1 answers again (a new node process, start 1,
    two ranks): once both its ranks are ready it joins (a forged ready mark does not count; the round it joins is in
    the store for it); the old process beating again counts for nothing: the new one, silent, is lost again. The
    stranger also replays node-1's own old signed heartbeats: a count that does not grow is no beat.
    node-0, silent all along, never is."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from launcher.group.rendezvous import attempt_prefix
    from launcher.heal.protocol import Keys, node_id
    from launcher.launch.ports import free_port
    from launcher.trust.secret import Secret
    from launcher.trust.signed import SignedStore

    port, secret = free_port("127.0.0.1"), Secret.new()
    keeper = healing.KeeperClient([], "127.0.0.1", port, 0, 1, 1.0, ["node-0", "node-1"], secret)
    decisions: list = []
    keeper.read(decisions.append)
    try:
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        store = SignedStore(client, secret, attempt_prefix(0), where="a rank's view")
        # a stranger who learnt the job's namespace but not its secret, and one who knows neither
        stranger = SignedStore(client, Secret.new(), attempt_prefix(0))
        stranger._root = store._root
        plain = dist.PrefixStore(attempt_prefix(0), client)

        def forge(key: str, value: bytes) -> None:
            stranger.set(key, value)
            plain.set(key, value)

        beat_key = store._key(Keys.heartbeat(node_id("node-1", 0)))
        old_beats = []  # node-1's real signed heartbeats, as a stranger listing the keys can read them
        for count in range(1, 4):
            time.sleep(0.2)  # the heartbeat's pace (a node beats every 0.5 s)
            for name in ("node-0", "node-1"):
                store.set(Keys.heartbeat(node_id(name, 0)), str(count))
            old_beats.append(client.get(beat_key))
        silent = time.time()
        store.set(Keys.done(node_id("node-0", 0)), "1")
        forged = Decision(round=1, members=("node-1",), before=("node-0", "node-1"), stop="forged by a stranger")
        forge(Keys.round_end(0), forged.to_bytes())  # the forgery: ignored by every reader
        assert store.read(Keys.round_end(0)) is None
        for count in range(4, 24):  # the stranger keeps node-1 "alive": no heartbeat that verifies, old ones replayed
            if count % 2:
                forge(Keys.heartbeat(node_id("node-1", 0)), str(count).encode())
            else:
                client.set(beat_key, old_beats[count % 3])
            if store.check([Keys.round_end(0)]) and store.read(Keys.round_end(0)) is not None:
                break
            time.sleep(0.2)
        store.wait([Keys.round_end(0)], timedelta(seconds=10))
        while (value := store.read(Keys.round_end(0))) is None:  # the keeper's own, once written over the forgery
            time.sleep(0.05)
        took = time.time() - silent
        decision = Decision.from_bytes(value)
        assert decision.members == ("node-0",) and list(decision.lost) == ["node-1"], decision
        assert decision.lost["node-1"].startswith("no heartbeat for 1."), decision
        assert 1.0 <= took < 5.0, took  # lost_after_s=1: typical 1.2-1.5 s (3x and more above)

        keeper.join("node-1", 1, 2, answered=123.0)
        new = node_id("node-1", 1)
        store.set(Keys.heartbeat(new), "1")
        store.set(Keys.ready(new, 0), "1")
        forge(Keys.ready(new, 1), b"1")  # not the second rank: a forgery
        time.sleep(0.3)  # the keeper looks every 0.1 s: one rank of two ready is not enough
        assert store.read(Keys.joined(new)) is None
        store.set(Keys.ready(new, 1), "1")
        store.wait([Keys.joined(new)], timedelta(seconds=5))
        joined = time.time()
        assert store.read(Keys.joined(new)) == b"2"
        decision = Decision.from_bytes(store.read(Keys.round_end(1)) or b"")
        assert (decision.members, decision.joined, decision.lost) == (("node-0", "node-1"), ("node-1",), {})
        assert decision.answer_time == 123.0
        count = 4
        while time.time() - joined < 1.5:  # the cut-off old process beats again: not the member any more
            count += 1
            store.set(Keys.heartbeat(node_id("node-1", 0)), str(count))
            time.sleep(0.2)
        store.wait([Keys.round_end(2)], timedelta(seconds=5))
        decision = Decision.from_bytes(store.read(Keys.round_end(2)) or b"")
        assert decision.members == ("node-0",) and list(decision.lost) == ["node-1"], decision
    finally:
        keeper.close()
    assert keeper.proc.returncode == 0
    assert [d[1].round for d in decisions if d[0] == "round"] == [1, 2, 3]  # each said on stdout too
    err = capfd.readouterr().err
    # each forgery is said once, by its reader: the keeper reads heartbeats and readiness marks, never a decision
    for key in (Keys.heartbeat(node_id("node-1", 0)), Keys.ready(node_id("node-1", 1), 1)):
        said = f"ignored a value of {attempt_prefix(0)}/{key} in the keeper's store at 127.0.0.1:{port} that does not"
        assert err.count(said) == 1, err
    assert f"{Keys.round_end(0)} in the keeper's store" not in err, err
    # the decision's reader is a rank (here this test's view of the store, read again and again): once
    said = f"ignored a value of {attempt_prefix(0)}/{Keys.round_end(0)} in a rank's view that does not verify"
    assert [r.getMessage().startswith(said) for r in caplog.records].count(True) == 1, caplog.text
