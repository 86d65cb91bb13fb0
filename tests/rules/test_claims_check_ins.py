"""Check-ins a stranger forges (docs/security.md: "every value the launcher acts on is signed"), without a process:
a round of a healing job does not form on a member's forged check-in (its members wait for the real one, or for
the keeper's next decision), whether the forgery is unsigned at the job's real key or signed with another secret;
nor does a joining machine enter on a forged answer to its readiness; the ranks' own check-in before their group
forms is held to the same rule (``rendezvous.check_in``: only a value that verifies is an arrival)."""

import pytest
import torch.distributed as dist

from launcher.base.env import DistEnv
from launcher.group.rendezvous import JoinError, attempt_prefix, check_in
from launcher.heal.protocol import Decision, Keys, Place
from launcher.heal.rank_side import Healer
from launcher.trust.secret import Secret
from launcher.trust.signed import SignedStore


def job_and_strangers() -> tuple[SignedStore, list]:
    """The attempt's keys seen with the job's secret, and two strangers who learnt its namespace: one writing plain
    values at its real keys, one signing them with a secret of its own."""
    store = SignedStore(dist.HashStore(), Secret.new(), attempt_prefix(0))
    guessed = SignedStore(store.inner, Secret.new(), attempt_prefix(0))
    guessed._root = store._root
    plain = dist.PrefixStore(store._root.rstrip("/"), store.inner)
    return store, [plain, guessed]


@pytest.mark.parametrize("stranger", [0, 1], ids=["unsigned", "another-secret"])
def test_a_forged_check_in_does_not_form_a_round(stranger):
    store, strangers = job_and_strangers()
    healer = Healer(Place("node-0"), lost_after_s=1.0, backend="gloo", secret=store.secret, store=store, number=1)
    env = DistEnv(rank=0, world_size=2, local_world_size=1, num_nodes=2)
    strangers[stranger].set(Keys.checked_in(1, 1), "1")  # node-1 never came: a stranger says it did
    ended = Decision(round=2, members=("node-0",), before=("node-0", "node-1"), lost={"node-1": "gone"})
    store.set(Keys.round_end(1), ended.to_bytes())
    assert healer._check_in(env) == ended  # not None: the round did not form on the forgery


@pytest.mark.parametrize("stranger", [0, 1], ids=["unsigned", "another-secret"])
def test_a_forged_round_to_join_does_not_let_a_machine_in(stranger):
    """A joining machine's ranks say they are ready and wait for the round the keeper lets them into
    (``Keys.joined``): a stranger's answer is no answer (they give up after the group's timeout, as when the
    keeper never lets them in)."""
    from launcher.group.rendezvous import Group
    from launcher.heal.rank_side import HealStop

    store, strangers = job_and_strangers()
    healer = Healer(Place("node-1", start=1), lost_after_s=1.0, backend="gloo", secret=store.secret, joined=False)
    strangers[stranger].set(Keys.joined(Place("node-1", start=1).node), "1")
    env = DistEnv(rank=2, world_size=3, local_world_size=1, node_rank=2, num_nodes=3)
    with pytest.raises(HealStop, match="node-1 was not let in within"):
        healer.wait_to_join(Group(store, env, timeout_s=0.3))
    assert store.read(Keys.ready(Place("node-1", start=1).node, 0)) == b"1"  # it did say it was ready


@pytest.mark.parametrize("stranger", [0, 1], ids=["unsigned", "another-secret"])
def test_a_forged_join_check_in_is_no_arrival(stranger):
    store, strangers = job_and_strangers()
    strangers[stranger].set("joined/1", "stranger-host")  # rank 1 never came
    env = DistEnv(rank=0, world_size=2, local_world_size=2)
    with pytest.raises(JoinError, match=r"ranks \[1\] did not join"):
        check_in(store, env, join_s=0.3)
