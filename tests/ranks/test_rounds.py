"""Healing in place, its first piece (the abort signal, launcher/group/abort.py; ``Healer._form``,
launcher/heal/rank_side.py) on real gloo ranks: the survivors of a lost rank leave the broken process group and form
the next one among themselves, in the same processes, fast: whether the lost rank was killed (its connections reset)
or froze (no error ever reaches them; the store says it is lost). The lost rank is rank 2 of 3. The store is signed
with the job's secret, as in every job the head starts."""

import json
import multiprocessing as mp
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from launcher.base.env import DistEnv
from launcher.base.exiting import end_process_at_exit
from launcher.group.abort import PeerLost
from launcher.group.rendezvous import process_group
from launcher.heal.protocol import Place
from launcher.heal.rank_side import Healer
from launcher.trust.secret import Secret

pytestmark = pytest.mark.slow
WORLD, LOST_RANK, TIMEOUT_S = 3, 2, 30  # the old group's timeout: what a survivor would wait without all this
LOST_KEY = "test/lost"
SECRET = Secret.from_hex("ef" * 32)


def watch_lost(store, healer: Healer, stop: threading.Event) -> None:
    """Stands in for the keeper's decision: trips the abort signal once the test says a rank is lost."""

    def run() -> None:
        while not stop.wait(0.05):
            if (why := store.read(LOST_KEY)) is not None:
                healer.abort.trip(why.decode())
                return

    threading.Thread(target=run, daemon=True).start()


def _rank(rank: int, out_dir: str, case: str) -> None:
    out = Path(out_dir)
    env = DistEnv(rank=rank, local_rank=rank, world_size=WORLD, local_world_size=WORLD)
    store = dist.FileStore(str(out / "filestore"), WORLD)
    with process_group(env, "gloo", timeout_s=TIMEOUT_S, store=store, secret=SECRET) as group:
        stop = threading.Event()
        healer = Healer(Place(f"node-{rank}"), 1.0, "gloo", SECRET, store=group.store, timeout_s=TIMEOUT_S)
        watch_lost(group.store, healer, stop)
        x = torch.ones(1 << 14)
        for step in range(1000):
            if rank == LOST_RANK and step == 5:
                group.store.set("test/lost_at", str(time.time()))
                if case == "killed":
                    os._exit(0)  # its sockets close: the peers' collectives fail
                os.kill(os.getpid(), signal.SIGSTOP)  # frozen: the peers hear nothing
            if rank == 0 and step == 5 and case == "frozen":  # stands in for the launcher's loss detection
                group.store.wait(["test/lost_at"])
                group.store.set(LOST_KEY, "rank 2 is frozen (the test says so)")
            try:
                healer.abort.abortable(dist.all_reduce(x, async_op=True).get_future()).wait()
            except PeerLost as exc:
                why = f"PeerLost: {exc}"
                break
            except RuntimeError as exc:  # killed: this rank's own collective failed
                healer.abort.trip(f"rank {rank}'s collective failed: {exc}")
                why = f"error: {str(exc)[:80]}"
                break
        left_at = time.time()
        lost_at = float(group.store.get("test/lost_at"))  # before the group is left: its store goes with it
        stop.set()
        survivor = DistEnv(rank=rank, local_rank=rank, world_size=WORLD - 1, local_world_size=WORLD - 1)
        healer.number = 1
        group = healer._form(survivor)
        assert not healer.abort.is_set()  # nothing is lost in the new round
        y = torch.full((2,), rank + 1.0)
        dist.all_reduce(y)  # the new round works: 1 + 2
        result = {"step": step, "why": why, "sum": y.tolist(), "round_s": time.time() - left_at}
        result["left_s"] = left_at - lost_at  # from the loss to leaving the broken group
        (out / f"rank-{rank}.json").write_text(json.dumps(result))
    end_process_at_exit(0)


@pytest.mark.parametrize("case", ["killed", "frozen"])
def test_survivors_form_the_next_round_in_the_same_processes(tmp_path, case):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path), case)) for r in range(WORLD)]
    started = time.monotonic()
    for p in procs:
        p.start()
    try:
        for p in procs[:LOST_RANK]:
            p.join(3 * TIMEOUT_S)  # start-up included (slow under load): the speed is checked from the loss below
        took = time.monotonic() - started
        assert [p.exitcode for p in procs[:LOST_RANK]] == [0, 0], f"survivors still running after {took:.0f} s"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    results = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(LOST_RANK)]
    for result in results:
        assert result["step"] == 5 and result["sum"] == [3.0, 3.0], result
        assert result["why"].startswith("PeerLost: rank 2 is frozen" if case == "frozen" else "error: "), result
        # the broken group left well before its timeout (typical 0.1 s), the next round formed at once (0.3 s)
        assert result["left_s"] < TIMEOUT_S / 3 and result["round_s"] < TIMEOUT_S / 3, result


def _agree(rank: int, world: int, out_dir: Path) -> None:
    from launcher.heal.rank_side import agree_on_state

    healer = Healer(Place(f"node-{rank}"), 1.0, "gloo", SECRET)

    def state() -> dict:
        assert rank == 1, f"rank {rank} is not the source: the lowest rank at the highest step is"
        return {"step": 6, "weights": torch.arange(4.0) * 10}

    top, got = agree_on_state([5, 6, 6], state, healer)  # rank 0 was one step behind when the loss came
    assert top == 6
    if rank == 0:
        assert got is not None and got["step"] == 6 and got["weights"].tolist() == [0.0, 10.0, 20.0, 30.0], got
    else:
        assert got is None  # already there: nothing to load
    assert agree_on_state([6, 6, 6], state if rank == 1 else None, healer) == (6, None)  # nobody behind: no traffic


def test_the_ranks_behind_take_the_state_of_the_lowest_rank_ahead(tmp_path):
    """Step 3 of a heal on real gloo ranks: the survivors' steps differ by one (a loss cut a gradient allreduce
    short), the lowest rank at the highest step sends its state, signed, to the ranks behind only."""
    from harness.ranks import spawn_ranks

    spawn_ranks(_agree, 3, tmp_path)
