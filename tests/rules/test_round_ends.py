"""How the trainer tells a lost machine from an ordinary error (issue 46): only the collective layer's ``PeerLost``
(carrying the keeper's decision, handed to the abort signal) or the backend's own error of a failed collective
followed by the abort's trip within the grace; never by an error's text. And the seam a job that does not heal
uses: nothing is ever a lost machine, at once."""

import threading
import time

import pytest
from torch.distributed import DistBackendError

from launcher.group.abort import Abort, PeerLost
from launcher.train.in_place import NoHealing

DECISION = object()  # the keeper's decision, as the heal watch hands it to the abort


def test_peer_lost_carries_what_tripped_the_abort():
    abort = Abort()
    abort.trip("node 1 (vm1) lost: its heartbeat stopped", cause=DECISION)
    lost = abort.loss_behind(RuntimeError("Connection closed by peer"), grace_s=0.0)
    assert isinstance(lost, PeerLost) and lost.cause is DECISION
    assert str(lost) == "node 1 (vm1) lost: its heartbeat stopped"
    raised = PeerLost("a collective was left", DECISION)
    assert abort.loss_behind(raised, grace_s=0.0) is raised


def test_the_backends_error_is_a_loss_once_the_abort_trips_within_the_grace():
    abort = Abort()
    threading.Timer(0.2, abort.trip, args=("node 1 lost",), kwargs={"cause": DECISION}).start()
    began = time.monotonic()
    lost = abort.loss_behind(RuntimeError("[gloo] Connection closed by peer"), grace_s=10.0)
    assert lost is not None and lost.cause is DECISION
    assert time.monotonic() - began < 5.0  # at the trip, not at the end of the grace
    assert Abort().loss_behind(DistBackendError("NCCL error"), grace_s=0.05) is None  # no trip: an ordinary error


@pytest.mark.parametrize(
    "error",
    [ValueError("bad shape"), KeyError("labels"), NotImplementedError("no"), type("Stop", (RuntimeError,), {})("x")],
    ids=["ValueError", "KeyError", "RuntimeError-subclass", "own-RuntimeError-subclass"],
)
def test_an_error_no_collective_raises_is_no_loss_and_waits_for_nothing(error):
    """Even with the word in its text, and even when the abort trips meanwhile: only the error types a failed
    collective raises are held for the keeper's decision."""
    abort = Abort()
    threading.Timer(0.05, abort.trip, args=("node 1 lost",)).start()
    began = time.monotonic()
    assert abort.loss_behind(error, grace_s=5.0) is None
    assert time.monotonic() - began < 0.5


def test_without_healing_no_error_is_a_lost_machine():
    seam = NoHealing()
    assert seam.abort is None and not seam.joins
    assert seam.lost(PeerLost("gone", DECISION)) is None and seam.growth(agreed=True) is None
    assert seam.start(None) is None
