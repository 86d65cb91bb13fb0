"""After a collective timed out, ``stall.explain_stall`` names the ranks that never reported waiting, with their
hosts from the store's ``joined/<rank>`` keys, and never blocks on a key that is missing (a round formed by
healing in place wrote none before: the store's get waited its whole timeout, 120 s)."""

import time
from datetime import timedelta

import torch.distributed as dist

from launcher.base.env import DistEnv
from launcher.group.rendezvous import Group
from launcher.group.stall import explain_stall


def _group(store: dist.Store) -> Group:
    env = DistEnv(rank=0, local_rank=0, world_size=3, local_world_size=1, node_rank=0, num_nodes=3)
    return Group(store, env, timeout_s=60.0)


def test_the_ranks_that_never_reported_are_named_with_their_hosts():
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=30))
    store.set("timed-out/2", "hostC|step 8")  # rank 2 was waiting too; rank 1 never came
    store.set("joined/1", "hostB")
    said = explain_stall(_group(store), "step 8", grace_s=0.2)
    assert said.startswith("stuck: rank 1 on hostB never reached it"), said


def test_a_rank_without_a_joined_key_is_named_at_once():
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=30))
    start = time.monotonic()
    said = explain_stall(_group(store), "step 8", grace_s=0.2)
    assert said.startswith("stuck: rank 1 on ?, rank 2 on ? never reached it"), said
    assert time.monotonic() - start < 5, "waited for a key that no one writes"
