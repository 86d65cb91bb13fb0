"""A rank of a real job refuses an unsigned value in its store (docs/security.md: every value the launcher acts on
is signed): rank 1 never joins (``LAUNCHER_FAULT`` stalls it before), and a stranger who read the job's secret's
namespace (here: from rank 0's environment, as root could) writes rank 1's check-in and gloo address into the
rendezvous store, unsigned. Rank 0 does not take the forged check-in for rank 1's arrival (said once in its log):
no group forms with the stranger, and the job fails at the join timeout naming rank 1 as the rank that never
came. (gloo's own refusal of a forged or replayed address, past a real check-in:
tests/ranks/test_claims_trust.py.) On this machine (the head's agent hosts the store); simulated nodes' ranks check
in through the same ``process_group``."""

import contextlib
import secrets
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from harness.run import run_launcher
from launcher.trust.secret import SECRET_ENV, Secret

MARK = "CLAIMS_STORE_PROBE"  # in this job's environment only: which processes are this test's


def rank_zero(token: str) -> dict[str, str] | None:
    """Rank 0's environment as it was started (/proc/PID/environ), if it runs yet."""
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError):
            environ = dict(v.split("=", 1) for v in (proc / "environ").read_text().split("\0") if "=" in v)
            if environ.get(MARK) == token and environ.get("RANK") == "0" and SECRET_ENV in environ:
                return environ
    return None


def forge(token: str, done: threading.Event, wrote: list[str]) -> None:
    """The stranger: rank 1's check-in and gloo address (the first group's key for rank 1), unsigned, at the job's
    real keys of attempt 0."""
    while (environ := rank_zero(token)) is None and not done.wait(0.05):
        pass
    if environ is None:
        return
    root = f"{Secret.from_hex(environ[SECRET_ENV]).namespace()}/launcher/attempt-0"
    address = (environ["MASTER_ADDR"], int(environ["MASTER_PORT"]))
    store = dist.TCPStore(*address, is_master=False, timeout=timedelta(seconds=30), wait_for_workers=False)
    store.set(f"{root}/joined/1", b"stranger")
    store.set(f"{root}/0//cpu//0/1", b"an address of the stranger's")
    wrote.append(root)


@pytest.mark.parametrize("mode", [()], ids=["local"])  # (sim's ranks check in through the same process_group)
def test_a_rank_refuses_an_unsigned_address(tmp_path, mode):
    token, done, wrote = secrets.token_hex(8), threading.Event(), []
    stranger = threading.Thread(target=forge, args=(token, done, wrote), daemon=True)
    stranger.start()
    began = time.monotonic()
    try:
        env = {MARK: token, "LAUNCHER_FAULT": "step=0,rank=1,stall"}  # rank 1 never joins
        result = run_launcher(*mode, "cluster.join_timeout_s=6", "train.max_steps=2", run_dir=tmp_path, env=env)
    finally:
        done.set()
        stranger.join(timeout=10)
    took = time.monotonic() - began
    assert wrote, "the stranger found no rank 0 to write beside"
    assert result.returncode == 1, result.stderr[-3000:]
    assert "ranks [1] did not join within 6 s (cluster.join_timeout_s)" in result.stderr, result.stderr[-3000:]
    said = "ignored a value of launcher/attempt-0/joined/1 in the rendezvous store at "
    assert (tmp_path / "logs" / "rank-0.log").read_text().count(said) == 1
    assert took < 40, took  # the join timeout, not the group's (300 s)
