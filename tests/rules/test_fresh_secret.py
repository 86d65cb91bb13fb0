"""A fresh random secret for every job the head starts (docs/security.md): two local jobs of one head (a sweep's
points) hand their agents different secrets, and neither is left in the head's environment after its job."""

import os

from harness.config import plan
from launcher.launch import local
from launcher.trust.secret import SECRET_ENV


def test_each_job_of_a_head_gets_its_own_secret(monkeypatch, tmp_path):
    given: list[str] = []

    def agent(job, config, **kwargs):  # what the agent (and so every rank it starts) would inherit
        given.append(os.environ[SECRET_ENV])
        return 0

    monkeypatch.setattr(local, "run_agent", agent)
    monkeypatch.delenv(SECRET_ENV, raising=False)
    for point in ("a", "b"):
        job, launch_plan = plan("cluster.procs_per_node=2", run_dir=tmp_path / point)
        assert local.launch_local(launch_plan, job) == 0
        assert SECRET_ENV not in os.environ  # (not the next job's, nor anything the head starts later)
    assert len(given) == 2 and given[0] != given[1] and all(len(bytes.fromhex(s)) == 32 for s in given), given
