"""The beds' shared fixtures: the ssh machines (started once per module that uses them, stopped after it, nothing
of them left), a job's ssh overrides (nothing of the job left on the machines after it), and the heal tests'
one-process reference."""

import os
import signal
import subprocess
from pathlib import Path

import pytest

from harness import REPO
from harness.beds import ALL, BRIDGE, HOSTS, PREFIX, SUBNET, job_processes, wait_nothing_left
from harness.jobs import HEAL_JOB
from harness.run import run_launcher


@pytest.fixture(scope="module")
def machines(tmp_path_factory):
    state = tmp_path_factory.mktemp("ssh-hosts")
    env = {
        **os.environ,
        "SSH_HOSTS_PREFIX": PREFIX,
        "SSH_HOSTS_SUBNET": SUBNET,
        "SSH_HOSTS_BRIDGE": BRIDGE,
        "SSH_HOSTS_STATE": str(state / "state"),
        "SSH_HOSTS_N": str(len(ALL)),
    }
    try:
        subprocess.run([REPO / "scripts" / "ssh-hosts" / "start.sh"], env=env, check=True, timeout=300)
        yield state / "state"
    finally:
        subprocess.run([REPO / "scripts" / "ssh-hosts" / "stop.sh"], env=env, capture_output=True, timeout=60)
        namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        left = [f"namespace {h}" for h in ALL if h in namespaces]
        left += [f"/etc/netns/{h}" for h in ALL if Path(f"/etc/netns/{h}").exists()]
        links = (BRIDGE, *(f"{h}h" for h in ALL))
        left += [f"link {link}" for link in links if Path(f"/sys/class/net/{link}").exists()]
        left += [f"state dir {state / 'state'}"] if (state / "state").exists() else []
        assert not left, "the machines' stop left: " + ", ".join(left)


@pytest.fixture
def ssh_args(machines):
    """The job's ssh overrides; afterwards, nothing of it may be left on the machines."""
    yield ["+cluster=ssh", f"cluster.hosts=[{','.join(HOSTS)}]", f"cluster.ssh_options=[-F,{machines}/ssh_config]"]
    try:
        wait_nothing_left(machines)
    finally:
        for pid in job_processes(machines):  # the next test starts clean even after a failure here
            os.kill(int(pid.split(":")[0]), signal.SIGKILL)


@pytest.fixture(scope="session")
def one_process_heal_job(tmp_path_factory):
    """The heal tests' reference (test_sim, test_ssh): ``HEAL_JOB`` trained by one process, the same global
    batches; its run dir."""
    run_dir = tmp_path_factory.mktemp("one-process")
    alone = run_launcher(*HEAL_JOB, run_dir=run_dir)
    assert alone.returncode == 0, alone.stderr[-3000:]
    return run_dir
