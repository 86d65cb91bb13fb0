"""The job's secret at gloo's own rendezvous (docs/security.md), on real gloo ranks: a process group formed through
``process_group`` with the job's secret does not form on an address a stranger wrote (the group's rendezvous
refuses it as it arrives, naming it), nor on one of the job's own from an earlier attempt (the attempt prefix is
signed with every key: a replayed value does not verify)."""

import re
import time

import pytest
import torch
import torch.distributed as dist

from harness.ranks import spawn_ranks
from launcher.base.env import DistEnv
from launcher.group.rendezvous import attempt_prefix, process_group
from launcher.trust.secret import MAC_BYTES

SECRET = "ab" * 32  # the job's
REFUSED = "does not verify: written by a process without the job's secret"


class Recording(dist.Store):
    """A plain store that remembers the keys written through it (the stranger learns a rank's keys this way; a
    stranger listing a TCPStore's keys sees the same)."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner, self.written = inner, []

    def set(self, key, value):
        self.written.append(key)
        self.inner.set(key, value)

    def get(self, key):
        return self.inner.get(key)

    def add(self, key, amount):
        return self.inner.add(key, amount)

    def check(self, keys):
        return self.inner.check(keys)

    def wait(self, keys, timeout=None):
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def delete_key(self, key):
        return self.inner.delete_key(key)

    def num_keys(self):
        return self.inner.num_keys()

    def set_timeout(self, timeout):
        self.inner.set_timeout(timeout)


def _refused_addresses(rank, world, out_dir):
    from launcher.trust.secret import Secret
    from launcher.trust.signed import guard

    # spawn_ranks' plain group: this test forms its own, on a signed store. Both ranks through it first: a rank that
    # destroyed it while the other's gloo was still connecting failed that one ("Connection closed by peer")
    dist.barrier()
    dist.destroy_process_group()
    secret = Secret.from_hex(SECRET)
    store = Recording(dist.FileStore(str(out_dir / "signed-store"), world))

    def env(attempt):
        return DistEnv(rank=rank, world_size=world, local_world_size=world, local_rank=rank, attempt=attempt)

    # attempt 0: both ranks hold the job's secret: the group forms
    with process_group(env(0), "gloo", timeout_s=30, store=store, secret=secret):
        ones = torch.ones(2)
        dist.all_reduce(ones)
        assert ones.tolist() == [2.0, 2.0]
    if rank == 1:  # now a stranger: no secret, but it saw the keys rank 1 wrote (its check-in, its gloo address)
        check_in, address = sorted(store.written)[::-1]  # ".../joined/1", ".../0//cpu//0/1"
        assert attempt_prefix(0) in check_in and check_in.endswith("joined/1"), store.written
        for attempt in (1, 2):
            # attempt 1: the job's own signed values of attempt 0, replayed; attempt 2: the same, unsigned
            forge = (lambda value: value) if attempt == 1 else (lambda value: value[MAC_BYTES:])
            # its check-in is real (a forged one is no arrival: tests/rules/test_claims_check_ins.py), its address not
            guard(store, secret, attempt_prefix(attempt)).set("joined/1", "rank 1's host")
            # rank 1's address beside rank 0's, once rank 0 wrote it (gloo numbers its groups: a failed one counts)
            ours = address.replace(attempt_prefix(0), attempt_prefix(attempt))
            head, _, tail = ours.partition("/0//")
            keys = [f"{head}/{group}//{tail}" for group in range(4)]
            while not any(store.inner.check([key[:-1] + "0"]) for key in keys):
                time.sleep(0.01)
            key = next(key for key in keys if store.inner.check([key[:-1] + "0"]))
            store.inner.set(key, forge(store.get(address)))
        store.inner.wait(["rank 0 is done"])  # (its FileStore outlives neither rank's)
        return
    for attempt in (1, 2):
        began = time.monotonic()
        with pytest.raises(Exception, match=REFUSED) as refused:
            with process_group(env(attempt), "gloo", timeout_s=10, store=store, secret=secret):
                raise AssertionError(f"attempt {attempt}: the group formed on rank 1's forged address")
        assert re.match(r"\d+//cpu//0/1 in the rendezvous store", str(refused.value)), refused.value  # rank 1's address
        assert time.monotonic() - began < 15, "refused as it arrived, not after the group's timeout"
    store.inner.set("rank 0 is done", "1")


def test_gloo_refuses_a_forged_or_replayed_address(tmp_path):
    spawn_ranks(_refused_addresses, 2, tmp_path)
