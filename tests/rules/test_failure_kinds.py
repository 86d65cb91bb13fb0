"""Failures typed end to end (issue 57): the report classifies a launcher error by its kind, carried by its type,
never by its text (a reworded message keeps its kind; our old words in someone else's error mean nothing); torch's
own messages, the only text read, still classify (a peer gone, a collective timed out); ``HealStop`` is no
``RuntimeError``; an outcome that ends a rank cleanly (a rank out of a job that goes on, a Slurm task leaving for
its requeue) writes no failure record and ends the process 0; a record's kind reads back as the same word."""

import json

import pytest
import torch.distributed as dist

from launcher.base.env import DistEnv
from launcher.base.errors import RANKED, Kind, LauncherError, kind_of, torch_said
from launcher.base.run_dir import RunDir
from launcher.group.abort import PeerLost
from launcher.group.failed import CollectiveFailed, CollectiveTimedOut
from launcher.group.rendezvous import JoinError, PortTaken
from launcher.heal.rank_side import HealStop, LeftJob
from launcher.launch.slurm.task_entry import Requeued
from launcher.report import failures
from launcher.trust.signed import Forged

GLOO_CLOSED = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:13017"
GLOO_TIMEOUT = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 5000ms for recv"


@pytest.mark.parametrize(
    "error, kind",
    [
        (JoinError("ranks [1] did not join within 4 s (cluster.join_timeout_s)"), Kind.peer),
        (PortTaken("port 29500 is taken"), Kind.error),
        (CollectiveFailed("a collective failed after a peer did"), Kind.peer),
        (CollectiveTimedOut("a collective at step 12 timed out after 5 s"), Kind.peer),
        (PeerLost("node 1 lost: its heartbeat stopped"), Kind.peer),
        (HealStop("2 node(s) left, fewer than cluster.min_nodes=3; the job stops"), Kind.lost),
        (LeftJob("node-1 was declared lost while it ran"), Kind.left),
        (Requeued("stopped at step 15 on SIGUSR2: the job is requeued"), Kind.requeued),
        (Forged("the bytes from rank 1 do not verify"), Kind.error),
    ],
    ids=lambda x: type(x).__name__ if isinstance(x, BaseException) else x.value,
)
def test_each_launcher_error_classifies_by_its_kind_whatever_its_message(error, kind):
    assert kind_of(error) is kind and isinstance(error, LauncherError)
    reworded = type(error)("said in other words entirely: closed by peer, timed out after 5 s, Broken pipe")
    assert kind_of(reworded) is kind  # the type tells, not the words (torch's words included)


def test_our_old_words_in_an_error_of_no_type_of_ours_are_an_error():
    """The report once read our own errors back from their messages ("did not join within", "timed out after"): the
    same words in a user's error, or in a plain RuntimeError, are no consequence of a peer."""
    for said in ("ranks [1] did not join within 4 s", "a collective at step 12 timed out after 5 s (comm.timeout_s)"):
        assert kind_of(RuntimeError(said)) is Kind.error
        assert kind_of(ValueError(said)) is Kind.error


@pytest.mark.parametrize(
    "error, timed_out",
    [
        (RuntimeError(GLOO_CLOSED), False),
        (RuntimeError("Got the following error when running the callback: RuntimeError: " + GLOO_CLOSED), False),
        (RuntimeError("[c10d] recvValue failed on SocketImpl(fd=12): Connection reset by peer"), False),
        (dist.DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed."), False),
        (dist.DistStoreError("Socket Timeout"), False),
        (dist.DistBackendError("NCCL communicator was aborted on rank 0."), False),
        (RuntimeError(GLOO_TIMEOUT), True),
        (dist.DistBackendError("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7)"), True),
    ],
    ids=[
        "gloo-closed",
        "callback-wrapped",
        "recvValue",
        "DistNetworkError",
        "DistStoreError",
        "nccl-abort",
        "gloo-timeout",
        "nccl-watchdog",
    ],
)
def test_torchs_own_messages_still_classify(error, timed_out):
    assert kind_of(error) is Kind.peer
    said = torch_said(error)
    assert said is not None and said.timed_out is timed_out


def test_torchs_words_count_only_in_errors_torch_raises():
    """A user's own exception type is never read, whatever it says; a timeout of anything but a collective is no
    collective timeout."""
    assert kind_of(ConnectionError("Connection refused by my data server")) is Kind.error
    assert kind_of(type("Mine", (RuntimeError,), {})(GLOO_CLOSED)) is Kind.error
    assert torch_said(RuntimeError("the download timed out after 30 s")) is None


def test_the_chain_is_walked_our_kind_first():
    """A user's error raised while handling torch's says a peer went first; a launcher error anywhere along the
    chain gives its own kind before any text is read; an interrupt is a stop."""
    try:
        try:
            raise RuntimeError(GLOO_CLOSED)
        except RuntimeError as torch_error:
            raise ValueError("the batch could not be moved") from torch_error
    except ValueError as exc:
        assert kind_of(exc) is Kind.peer
    try:
        try:
            raise dist.DistNetworkError("Connection refused")
        except RuntimeError:
            raise PortTaken("rank 0 cannot host the rendezvous store") from None
    except PortTaken as exc:
        assert kind_of(exc) is Kind.error  # its own kind, though torch's refusal is in its context
    assert kind_of(KeyboardInterrupt()) is Kind.stopped


def test_heal_stop_passes_through_every_net_for_torchs_errors():
    with pytest.raises(HealStop):
        try:
            raise HealStop("the job stops")
        except RuntimeError:  # noqa: B014 - what a net for torch's errors catches
            pytest.fail("HealStop was caught as a RuntimeError")
    assert not issubclass(HealStop, RuntimeError) and not issubclass(PeerLost, RuntimeError)


def _log(tmp_path, rank: int) -> failures.FailureLog:
    env = DistEnv(rank=rank, world_size=2, hostname="m0", launch_id="j")
    return failures.FailureLog(RunDir(tmp_path), env)


@pytest.mark.parametrize("outcome", [Requeued("the job is requeued"), LeftJob("node-1 was declared lost")])
def test_an_outcome_that_ends_cleanly_writes_no_record_and_ends_the_process_0(tmp_path, monkeypatch, outcome):
    from launcher.rank import entry

    codes: list[int] = []
    monkeypatch.setattr(entry, "end_process_at_exit", codes.append)  # (the real one would end pytest's process)
    log = _log(tmp_path, 0)
    log.record(outcome)
    entry.failed(log, _NoErrorFile(), outcome)  # type: ignore[arg-type]
    assert codes == [0] and not log.written
    assert failures.load_newest(RunDir(tmp_path), "j") == []
    entry.failed(log, _NoErrorFile(), RuntimeError("the cause"))
    assert codes == [0, 1] and [f.kind for f in failures.load_newest(RunDir(tmp_path), "j")] == [Kind.error]


class _NoErrorFile:
    def record_exception(self, exc: BaseException) -> None:
        pass


def test_a_slurm_tasks_stop_is_the_requeue_outcome(tmp_path):
    """After the stop checkpoint every task leaves with ``Requeued`` (no ``SystemExit``): requeued, or, the head
    having asked for the stop, not (rank 1 here: only rank 0 asks Slurm for the requeue)."""
    from harness.config import plan
    from launcher.launch.slurm.task_entry import requeue_after_stop
    from launcher.train.stop import Stopped

    job, _ = plan("+cluster=slurm", run_dir=tmp_path)
    rank1 = DistEnv(rank=1, world_size=2, launch_id="17", source="slurm")
    with pytest.raises(Requeued, match="stopped at step 15 on SIGUSR2: the job is requeued"):
        requeue_after_stop(job, rank1, Stopped(15, 12))
    job.run.stop_request.parent.mkdir(parents=True, exist_ok=True)
    job.run.stop_request.write_text("")
    with pytest.raises(Requeued, match="the launcher's head stopped the job, not requeued"):
        requeue_after_stop(job, rank1, Stopped(15, 12))


def test_a_records_kind_reads_back_as_the_same_word_and_ranks_lost_after_died(tmp_path):
    _log(tmp_path, 0).record(CollectiveFailed(GLOO_CLOSED))
    _log(tmp_path, 1).record(HealStop("2 node(s) left, fewer than cluster.min_nodes=3; the job stops"))
    path = RunDir(tmp_path).failure_attempt("j", 0)
    assert json.loads((path / "rank-0.json").read_text())["kind"] == "peer"  # the file's word, as before
    failures.record_exits(path, [failures.exit_failure(2, 99, -9, "m1")])
    (path / "rank-3.json").write_text(json.dumps({"rank": 3, "kind": "stopped", "summary": "an old record"}))
    records = sorted(failures.load_newest(RunDir(tmp_path), "j"), key=lambda f: f.rank)
    assert [f.kind for f in records] == [Kind.peer, Kind.lost, Kind.died, Kind.stopped]
    assert [f.rank for f in failures.ranked(records)] == [2, 1, 0, 3]  # died, lost, peer, stopped
    assert RANKED.index(Kind.died) < RANKED.index(Kind.lost) < RANKED.index(Kind.peer)
    assert records[0].summary == f"CollectiveFailed: {GLOO_CLOSED}"  # the type's name, not its module's path
    (path / "rank-4.json").write_text(json.dumps({"rank": 4, "kind": "no such kind", "summary": "?"}))
    assert len(failures.load_newest(RunDir(tmp_path), "j")) == 4  # unreadable: the others still tell the story


def test_a_stores_wait_that_gave_up_is_an_answer_and_nothing_else_is(tmp_path):
    """``group.failed.waited``: a FileStore's timeout (a plain ``RuntimeError``, not torch's ``DistError``) and a
    TCPStore's (``DistStoreError``) say "not there"; an error that is no timeout is raised as it is."""
    from datetime import timedelta

    import torch.distributed as dist

    from launcher.group.failed import waited

    short = timedelta(seconds=0.05)
    files = dist.FileStore(str(tmp_path / "store"), 1)
    assert not waited(files, ["missing"], short)
    files.set("there", "1")
    assert waited(files, ["there"], short)
    tcp = dist.TCPStore("127.0.0.1", 0, 1, True)
    assert not waited(tcp, ["missing"], short)

    class Broken(dist.Store):
        def wait(self, keys, timeout=None):
            raise RuntimeError("Broken store: the user's own error")

    with pytest.raises(RuntimeError, match="the user's own error"):
        waited(Broken(), ["x"], short)
