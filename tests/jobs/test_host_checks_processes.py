"""The checks every host of a ``+cluster=ssh`` job passes before anything starts (docs/machines.md,
step 1), each failure named with its host, cause and fix. The head's check code and the probe run for real; only
ssh is replaced by a stand-in on PATH that runs the remote shell script here, as the named host would (one whose
run dir is another directory, one whose python lacks the launcher's imports, one that never answers, ...). What
ssh itself says (no key, unknown host key, unreachable) is checked on real machines in tests/beds/test_ssh.py; the
head's other rules without a process in tests/rules/test_host_checks.py."""

import dataclasses
import os
import socket
import stat
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness.config import plan
from launcher.base.devices import gpu_count
from launcher.launch.ssh.hosts import check_hosts

FAKE_SSH = """#!/usr/bin/env bash
# ssh's stand-in: `ssh [options] HOST SCRIPT` runs SCRIPT here as HOST would (see test_host_checks.py)
host=${@: -2:1} script=${@: -1}
export FAKE_SSH_HOST=$host SSH_CONNECTION="10.0.0.1 40000 10.0.0.2 22"
case $host in
  slow) exec sleep 60 ;;  # never answers (exec: the check's timeout kills this very process)
  hostkey) echo "Host key verification failed." >&2; exit 255 ;;
  notshared) script=${script//"$FAKE_SSH_RUN_DIR"/"$FAKE_SSH_OTHER_DIR"} ;;  # another disk at that path
  nolauncher) script=${script//"$FAKE_SSH_PYTHON"/"$FAKE_SSH_BARE_PYTHON"} ;;  # a python without torch
  notensorboard) script=${script//"$FAKE_SSH_PYTHON"/"$FAKE_SSH_NO_TB_PYTHON"} ;;  # tensorboard not installed
esac
exec bash -c "$script"
"""


BARE_PYTHON = "/usr/bin/python3"


@pytest.fixture
def fake_ssh(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ssh = bin_dir / "ssh"
    ssh.write_text(FAKE_SSH)
    ssh.chmod(ssh.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "run").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SSH_RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setenv("FAKE_SSH_OTHER_DIR", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("FAKE_SSH_PYTHON", sys.executable)
    monkeypatch.setenv("FAKE_SSH_BARE_PYTHON", BARE_PYTHON)
    return tmp_path / "run"


NO_TB_PYTHON = """#!/usr/bin/env bash
# this python as if the tensorboard package were not installed (every import or look-up of it fails)
exec "$FAKE_SSH_PYTHON" -c 'import runpy, sys
class Hidden:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "tensorboard":
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, Hidden())
sys.argv = sys.argv[2:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)' "$@"
"""


def checks(hosts: list[str], master: str, run_dir, **cluster):
    """The head's check of ``hosts`` against ``master`` (composed here: Hydra's compose is not thread-safe), to run
    in a thread: each host's problems."""
    overrides = ("+cluster=ssh", f"cluster.hosts=[{','.join(hosts)}]", "cluster.procs_per_node=1")
    job, _ = plan(*overrides, "train.batch_size_per_rank=8", run_dir=run_dir)
    job.cluster = dataclasses.replace(job.cluster, **cluster)

    def run() -> dict[str, list[str]]:
        return {host: problems for host, (_, problems) in zip(hosts, check_hosts(job, job.cluster, hosts, master))}

    return run


def test_each_host_check_names_its_host_cause_and_fix(fake_ssh):
    """Port taken on the first host, run dir not shared, launcher not importable, a failing ``cluster.setup`` line,
    ``master_addr`` not resolving, too few GPUs, no answer within ``cluster.check_timeout_s``, an unknown host key:
    each on its own host, each named, and nothing else wrong with it."""
    if not os.access(BARE_PYTHON, os.X_OK):
        pytest.skip(f"needs {BARE_PYTHON} (a python without the launcher's dependencies)")
    setup = '[ "$FAKE_SSH_HOST" != badsetup ]'
    with socket.socket() as holder, ThreadPoolExecutor(3) as pool:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        calls = [
            checks(
                ["first", "notshared", "nolauncher", "badsetup"],
                "127.0.0.1",
                fake_ssh,
                master_port=port,
                setup=[setup],
            ),
            checks(["nodns"], "no-such-host.invalid", fake_ssh, gpus_per_node=gpu_count() + 1, setup=[setup]),
            checks(["slow", "hostkey"], "127.0.0.1", fake_ssh, check_timeout_s=1.0),
        ]
        found = {host: problems for done in pool.map(lambda call: call(), calls) for host, problems in done.items()}
    expected = {
        "first": f"cannot listen on 127.0.0.1:{port} here (Address already in use); HINT: cluster.master_port=0",
        "notshared": f"the run dir {fake_ssh.parent / 'elsewhere'} is not the head's or not writable here",
        "nolauncher": f"{sys.executable} cannot import the launcher there (ModuleNotFoundError: No module named",
        "badsetup": "cluster.setup failed there",
        "nodns": "cannot resolve cluster.master_addr=no-such-host.invalid",
        "slow": "did not answer within 1 s (cluster.check_timeout_s); HINT:",
        "hostkey": "ssh failed: Host key verification failed.; HINT: ssh hostkey once to accept its host key",
    }
    for host, text in expected.items():
        assert any(text in p for p in found[host]), f"{host}: expected {text!r} in {found[host]}"
    assert any("HINT: the run dir must be on a file system every host shares" in p for p in found["notshared"])
    assert any("HINT: try the lines with ssh badsetup" in p for p in found["badsetup"])
    gpus = gpu_count()
    too_few = f"cluster.gpus_per_node={gpus + 1} but it has {gpus} GPU(s); HINT: cluster.gpus_per_node={gpus}"
    assert too_few in found["nodns"], found["nodns"]
    assert [len(found[h]) for h in expected] == [1, 1, 1, 1, 2, 1, 1], found


def test_a_host_without_tensorboard_is_named_when_the_job_writes_events(fake_ssh, tmp_path, monkeypatch):
    """train.tensorboard=true: rank 0 writes the events, and after a heal any host may hold it, so every host needs
    the package; a host without it is named before anything starts (and nothing is asked of it otherwise)."""
    python = tmp_path / "bin" / "python-no-tensorboard"
    python.write_text(NO_TB_PYTHON)
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("FAKE_SSH_NO_TB_PYTHON", str(python))
    overrides = ("+cluster=ssh", "cluster.hosts=[first,notensorboard]", "cluster.procs_per_node=1")
    found = {}
    for tensorboard in ("true", "false"):
        job, _ = plan(*overrides, "train.batch_size_per_rank=8", f"train.tensorboard={tensorboard}", run_dir=fake_ssh)
        found[tensorboard] = check_hosts(job, job.cluster, ["first", "notensorboard"], "127.0.0.1")
    (first, ok), (facts, problems) = found["true"]
    assert first.tensorboard is True and ok == [] and facts.tensorboard is False
    assert problems == [
        "train.tensorboard=true, but no tensorboard package there; HINT: pip install tensorboard (in this checkout: "
        "pip install -e '.[tensorboard]') on it"
    ]
    assert [problems for _, problems in found["false"]] == [[], []]  # not asked for: nothing to find
