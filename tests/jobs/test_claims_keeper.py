"""The real keeper process (``launcher.heal.keeper``) and forged "ranks ended" marks (docs/security.md): a node
process whose ranks ended says so before its heartbeat stops (``Keys.done``: its silence is no loss). A stranger who
writes that mark for a frozen node, unsigned at the job's real key or signed with another secret, does not keep
it in the round: the keeper loses it after ``cluster.lost_after_s`` as if the mark were not there, and says once,
where it read it, that it ignored the value. (The keeper's other forgeries, decisions, heartbeats, readiness and
replayed heartbeats: tests/jobs/test_healing_processes.py.)"""

import time
from datetime import timedelta

import torch.distributed as dist

from launcher.group.rendezvous import attempt_prefix
from launcher.heal import head_side as healing
from launcher.heal.protocol import Decision, Keys, node_id
from launcher.launch.ports import free_port
from launcher.trust.secret import Secret
from launcher.trust.signed import SignedStore

NAMES = ["node-0", "node-1", "node-2"]


def test_the_keeper_ignores_forged_ranks_ended_marks(tmp_path, capfd):
    port, secret = free_port("127.0.0.1"), Secret.new()
    keeper = healing.KeeperClient([], "127.0.0.1", port, 0, 1, 1.0, NAMES, secret)
    decisions: list = []
    keeper.read(decisions.append)
    try:
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
        store = SignedStore(client, secret, attempt_prefix(0))
        guessed = SignedStore(client, Secret.new(), attempt_prefix(0))  # learnt the namespace, not the secret
        guessed._root = store._root
        plain = dist.PrefixStore(store._root.rstrip("/"), client)  # the real keys, unsigned
        for count in range(1, 4):  # every node beats (0.2 s apart: the heartbeat's pace is 0.5 s)
            for name in NAMES:
                store.set(Keys.heartbeat(node_id(name, 0)), str(count))
            time.sleep(0.2)
        silent = time.time()  # now every node falls silent; node-0's ranks ended, and it says so
        store.set(Keys.done(node_id("node-0", 0)), "1")
        plain.set(Keys.done(node_id("node-1", 0)), "1")  # node-1 and node-2 froze: a stranger says they ended
        guessed.set(Keys.done(node_id("node-2", 0)), "1")
        lost: dict = {}
        while set(lost) != {"node-1", "node-2"}:
            number = len([d for d in decisions if d[0] == "round"])
            store.wait([Keys.round_end(number)], timedelta(seconds=10))
            decision = Decision.from_bytes(store.read(Keys.round_end(number)) or b"")
            lost.update(decision.lost)
            assert "node-0" in decision.members, decision  # its silence is no loss: its own mark verifies
            while len([d for d in decisions if d[0] == "round"]) <= number:  # said to the head too
                time.sleep(0.05)
        took = time.time() - silent
        assert all(why.startswith("no heartbeat for 1.") for why in lost.values()), lost
        assert took < 5.0, took  # lost_after_s=1: found in the keeper's first looks after it (typical 1.2-1.5 s)
    finally:
        keeper.close()
    assert keeper.proc.returncode == 0
    err = capfd.readouterr().err
    for name in ("node-1", "node-2"):
        key = f"{attempt_prefix(0)}/{Keys.done(node_id(name, 0))}"
        said = f"ignored a value of {key} in the keeper's store at 127.0.0.1:{port} that does not verify"
        assert err.count(said) == 1, err  # where it was read, once
    assert f"{Keys.done(node_id('node-0', 0))} in" not in err, err  # the real one is no forgery
