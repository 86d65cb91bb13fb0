"""Pure rules of the Slurm head: when a waiting head takes the job as ended (the controller's word, a requeue rank 0
asked for but the controller has not yet seen), when a requeue's hold is released and to when, and which tasks srun
saw end on their own. The real cluster runs them end to end in test_slurm."""

import json

import pytest

from launcher.base.run_dir import RunDir
from launcher.launch.slurm import job_state as slurm_state
from launcher.launch.slurm.ending import ended_on_their_own
from launcher.launch.slurm.job_state import JobWatch, Live


class Submitted:
    job_id = "7"
    state = "UNKNOWN"

    def done(self, force_check=False):
        raise AssertionError("the controller answered: accounting is not asked")


@pytest.fixture
def controller(monkeypatch):
    said, released, clock = [], [], [0.0]
    monkeypatch.setattr(slurm_state, "live", lambda job_id: said[-1])
    monkeypatch.setattr(slurm_state, "release", lambda job_id, at: released.append((job_id, at)))
    monkeypatch.setattr(slurm_state.time, "monotonic", lambda: clock[0])
    return said, released, clock


def test_a_job_that_looks_failed_while_its_requeue_is_on_the_way_is_waited_for(controller, tmp_path):
    said, _, clock = controller
    watch = JobWatch(Submitted(), RunDir(tmp_path))
    said.append(Live("RUNNING", "None", 1, "2026-11-26T05:00:00"))
    assert watch.ended() is None
    (tmp_path / "requeues.json").write_text(json.dumps({"count": 2}))  # rank 0 counted its requeue, then asks
    said.append(Live("FAILED", "None", 1, "2026-11-26T05:00:00"))
    assert watch.ended() is None
    clock[0] = slurm_state.REQUEUE_GRACE_S - 1
    assert watch.ended() is None
    clock[0] = slurm_state.REQUEUE_GRACE_S + 1  # the requeue never came (scontrol refused it): the job ended
    assert watch.ended() == "FAILED"


def test_a_job_ended_with_every_requeue_seen_is_ended_at_once(controller, tmp_path):
    said, _, _ = controller
    (tmp_path / "requeues.json").write_text(json.dumps({"count": 1}))
    said.append(Live("COMPLETED", "None", 1, "2026-11-26T05:00:00"))
    assert JobWatch(Submitted(), RunDir(tmp_path)).ended() == "COMPLETED"


def test_the_requeue_hold_is_released_once_per_requeue_and_never_on_the_first_start(controller, tmp_path):
    said, released, _ = controller
    watch = JobWatch(Submitted(), RunDir(tmp_path))
    said.append(Live("PENDING", "BeginTime", 0, "2026-11-26T05:00:00"))  # the user's --begin: kept
    assert watch.ended() is None and released == []
    said.append(Live("PENDING", "BeginTime", 1, "2026-11-26T05:01:00"))
    watch.ended(), watch.ended()
    assert released == [("7", "2026-11-26T05:01:00")]


def test_the_release_keeps_the_revoked_credentials_second(monkeypatch):
    ran = []
    monkeypatch.setattr(slurm_state.subprocess, "run", lambda argv, **kw: ran.append(argv))
    slurm_state.release("7", "2026-11-26T23:59:59")
    assert ran == [["scontrol", "update", "JobId=7", "StartTime=2026-11-27T00:00:01"]]


def test_the_tasks_srun_saw_end_before_it_terminated_the_step():
    text = (
        "srun: error: node2: task 3: Killed\n"
        "srun: error: node1: tasks 0-1: Exited with exit code 1\n"
        "srun: Terminating StepId=5.0\n"
        "srun: error: node2: task 2: Terminated\n"
    )
    assert ended_on_their_own(text) == {
        3: ("node2", "Killed"),
        0: ("node1", "Exited with exit code 1"),
        1: ("node1", "Exited with exit code 1"),
    }
