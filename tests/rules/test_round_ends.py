"""How the trainer tells a lost machine from an ordinary error (issue 46; typed in issue 57): the one place that
turns torch's errors into ours (``group.failed.typed_errors``) makes ``PeerLost`` of a collective's error once the
abort signal tripped (it carries the keeper's decision, handed to the abort) and ``CollectiveFailed`` of torch's
own error of a failed collective; the healing seam then waits for the abort's trip within the grace. Never by an
error's text of our own, and an ordinary error is raised as it is, waiting for nothing. And the seam a job that does
not heal uses: nothing is ever a lost machine, at once."""

import threading
import time
from dataclasses import dataclass

import pytest
from torch.distributed import DistBackendError

from launcher.group.abort import Abort, PeerLost
from launcher.group.failed import CollectiveFailed, typed_errors
from launcher.train.in_place import NoHealing


@dataclass(frozen=True)
class Said:
    """Stands in for the keeper's decision, as the heal watch hands it to the abort (``abort.Cause``)."""

    why: str

    def said(self) -> str:
        return self.why


DECISION = Said("node 1 (vm1) lost: its heartbeat stopped")
GLOO_CLOSED = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:13017"


def _raised_through(error: BaseException, abort: Abort | None) -> BaseException:
    try:
        with typed_errors(abort):
            raise error
    except BaseException as exc:  # noqa: BLE001 - what left the one place, whatever it is
        return exc
    raise AssertionError("nothing raised")


def test_peer_lost_carries_what_tripped_the_abort():
    abort = Abort()
    abort.trip(DECISION.said(), cause=DECISION)
    lost = _raised_through(RuntimeError(GLOO_CLOSED), abort)
    assert isinstance(lost, PeerLost) and lost.cause is DECISION and str(lost) == DECISION.said()
    assert type(lost.__cause__) is RuntimeError  # torch's own error stays in the traceback
    raised = PeerLost("a collective was left", DECISION)
    assert _raised_through(raised, abort) is raised  # ours already: as it is


def test_torchs_wrapper_of_our_peer_lost_is_a_peer_lost_once_the_abort_tripped():
    """A comm hook's future failed with PeerLost reaches the trainer as torch's RuntimeError, its text all that is
    left of our type: the abort signal's state tells, not the text."""
    wrapped = RuntimeError("Got the following error when running the callback: PeerLost: node 1 lost\n\nAt:\n  x")
    abort = Abort()
    assert _raised_through(wrapped, abort) is wrapped  # not tripped: no text of ours is read
    abort.trip("node 1 lost", cause=DECISION)
    lost = _raised_through(wrapped, abort)
    assert isinstance(lost, PeerLost) and lost.cause is DECISION


def test_the_backends_error_is_a_loss_once_the_abort_trips_within_the_grace():
    abort = Abort()
    failed = _raised_through(RuntimeError(GLOO_CLOSED), abort)  # a killed peer's reset, before the keeper decides
    assert isinstance(failed, CollectiveFailed) and not isinstance(failed, PeerLost)
    threading.Timer(0.2, abort.trip, args=("node 1 lost",), kwargs={"cause": DECISION}).start()
    began = time.monotonic()
    lost = abort.lost_within(10.0)
    assert lost is not None and lost.cause is DECISION
    assert time.monotonic() - began < 5.0  # at the trip, not at the end of the grace
    assert Abort().lost_within(0.05) is None  # no trip: no loss
    nccl = _raised_through(DistBackendError("NCCL communicator was aborted on rank 0"), None)
    assert isinstance(nccl, CollectiveFailed)


@pytest.mark.parametrize(
    "error",
    [
        ValueError("bad shape"),
        KeyError("labels"),
        NotImplementedError("no"),
        type("Stop", (RuntimeError,), {})("Connection closed by peer"),
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x2)"),
    ],
    ids=["ValueError", "KeyError", "RuntimeError-subclass", "own-RuntimeError-subclass", "users-RuntimeError"],
)
def test_an_error_no_collective_raises_passes_unchanged_and_waits_for_nothing(error):
    """Even with torch's words in its text (an exception type of the user's own is never read), and while the
    abort is about to trip: raised as it is, the same object, nothing chained to it, at once."""
    abort = Abort()
    threading.Timer(0.05, abort.trip, args=("node 1 lost",)).start()
    began = time.monotonic()
    assert _raised_through(error, abort) is error
    assert error.__cause__ is None and error.__context__ is None
    assert time.monotonic() - began < 0.5


def test_without_healing_no_error_is_a_lost_machine():
    seam = NoHealing()
    assert seam.abort is None and not seam.joins
    assert seam.lost(PeerLost("gone", DECISION)) is None and seam.growth(agreed=True) is None
    assert seam.start(None) is None
