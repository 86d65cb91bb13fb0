"""Healing in place, its first piece (launcher/abandon.py, rendezvous.next_round) on real gloo ranks: the
survivors of a lost rank leave the broken process group and form the next one among themselves, in the same
processes, fast: whether the lost rank was killed (its connections reset) or froze (no error ever reaches them;
the store says it is lost). The lost rank is rank 2 of 3."""

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

from launcher import abandon
from launcher.env import DistEnv
from launcher.exiting import end_process_at_exit
from launcher.rendezvous import next_round, process_group

pytestmark = pytest.mark.slow
WORLD, LOST_RANK, TIMEOUT_S = 3, 2, 30  # the old group's timeout: what a survivor would wait without all this
LOST_KEY = "test/lost"


def _rank(rank: int, out_dir: str, case: str) -> None:
    out = Path(out_dir)
    env = DistEnv(rank=rank, local_rank=rank, world_size=WORLD, local_world_size=WORLD)
    store = dist.FileStore(str(out / "filestore"), WORLD)
    with process_group(env, "gloo", timeout_s=TIMEOUT_S, store=store) as group:
        stop = threading.Event()
        abandon.enable()
        abandon.watch_store(group.store, LOST_KEY, stop, lambda value: value.decode())
        x = torch.ones(1 << 14)
        for step in range(1000):
            if rank == LOST_RANK and step == 5:
                if case == "killed":
                    os._exit(0)  # its sockets close: the peers' collectives fail
                group.store.set("test/frozen", str(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP)  # frozen: the peers hear nothing
            if rank == 0 and step == 5 and case == "frozen":  # stands in for the launcher's loss detection
                group.store.wait(["test/frozen"])
                group.store.set(LOST_KEY, "rank 2 is frozen (the test says so)")
            try:
                abandon.wait(dist.all_reduce(x, async_op=True))
            except abandon.PeerLost as exc:
                why = f"PeerLost: {exc}"
                break
            except RuntimeError as exc:  # killed: this rank's own collective failed
                abandon.lost(f"rank {rank}'s collective failed: {exc}")
                why = f"error: {str(exc)[:80]}"
                break
        left_at = time.time()
        stop.set()
        survivor = DistEnv(rank=rank, local_rank=rank, world_size=WORLD - 1, local_world_size=WORLD - 1)
        group = next_round(1, survivor, group.store, "gloo", group.timeout_s)
        abandon.reset()
        y = torch.full((2,), rank + 1.0)
        dist.all_reduce(y)  # the new round works: 1 + 2
        result = {"step": step, "why": why, "sum": y.tolist(), "round_s": time.time() - left_at}
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
            p.join(TIMEOUT_S / 2)  # well before the old group's timeout
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
        assert result["round_s"] < 2.0, result  # the old group left at once, not at its timeout
