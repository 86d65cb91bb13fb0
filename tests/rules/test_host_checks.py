"""The head's checks before anything starts that need no process: node 0 by hand must run on
``cluster.master_addr``, too few machines left stops the job, a slow start-up phase says what the head waits for.
Each host's checks over ssh (a stand-in ssh running the probe): tests/jobs/test_host_checks_processes.py."""

import pytest

from harness.config import plan
from launcher.base.run_dir import RunDir
from launcher.config import ConfigError
from launcher.launch.local import launch_local
from launcher.launch.nodes.restarts import Membership


def test_node_0_by_hand_must_run_on_master_addr(tmp_path):
    """docs/machines.md, "By hand": node 0 hosts the store, so it must run on the machine ``cluster.master_addr``
    names; here that address is none of this machine's (TEST-NET-3, never contacted): refused before anything starts."""
    job, launch_plan = plan(
        "cluster.nodes=2",
        "cluster.node_rank=0",
        "cluster.master_addr=203.0.113.7",
        "cluster.master_port=29541",
        run_dir=tmp_path,
    )
    with pytest.raises(ConfigError, match=r"cluster.master_addr=203.0.113.7 is not an address of this machine"):
        launch_local(launch_plan, job)
    assert not (tmp_path / "logs").exists(), "something started"


def test_fewer_than_min_nodes_left_stops_the_job(tmp_path, capsys):
    """docs/healing.md: losing machines down to ``cluster.min_nodes`` goes on; one more lost and the job stops,
    saying so, with no membership change recorded."""
    members = Membership(RunDir(tmp_path), ["a", "b", "c"], 2, 0)
    assert members.again({"a": "its link went down"}, "host")
    assert members.live == ["b", "c"]
    assert not members.again({"b": "its link went down"}, "host")
    err = capsys.readouterr().err
    assert "launcher: lost b (its link went down): 1 node(s) left, fewer than cluster.min_nodes=2; the job stops" in err
    assert members.live == ["b", "c"]
    assert len((tmp_path / "membership.jsonl").read_text().splitlines()) == 1


def test_a_start_up_phase_over_2_s_says_what_the_head_waits_for(monkeypatch, capfd):
    """One line per slow phase (issue 35: a head silent for 34 s between its plan and the first rank line); a fast
    phase says nothing."""
    import threading
    import time

    from launcher.launch.ssh import clients as ssh_nodes

    with ssh_nodes.saying_if_slow("checking 2 host(s) over ssh"):
        pass  # fast: well under SLOW_PHASE_S
    monkeypatch.setattr(ssh_nodes, "SLOW_PHASE_S", 0.01)
    heard = threading.Event()
    ssh_nodes.say_if_slow("connecting to vm1, vm2 over ssh", heard)  # said once the wait is over SLOW_PHASE_S
    deadline = time.monotonic() + 10
    while "connecting" not in (err := capfd.readouterr().err) and time.monotonic() < deadline:
        heard.wait(0.05)
    assert err == "[launcher] connecting to vm1, vm2 over ssh ...\n", err


def test_the_head_raises_its_open_files_limit_for_many_machines_or_names_it(monkeypatch):
    """1,000 machines hold ~6,000 descriptors on the head, over a default soft limit of 1,024: the head raises its
    soft limit up to the hard one, or refuses before anything starts, naming the limit and the fix."""
    import resource

    from launcher.launch.ssh.hosts import open_files_for

    set_to: list[tuple[int, int]] = []
    monkeypatch.setattr(resource, "getrlimit", lambda what: (1024, 4096))
    monkeypatch.setattr(resource, "setrlimit", lambda what, limits: set_to.append(limits))
    open_files_for(100)  # 856 files: within the soft limit
    assert set_to == []
    open_files_for(500)  # 3,256
    assert set_to == [(3256, 4096)]
    with pytest.raises(ConfigError, match=r"cluster.hosts: 1000 machines need about 6256 open files on this head, "
                       r"over its hard limit of 4096; HINT: raise it \(`ulimit -Hn 6256`"):  # fmt: skip
        open_files_for(1000)


def test_a_host_checks_answer_is_read_once_into_its_facts_and_a_wrong_key_names_the_host():
    """The JSON line ``launch/ssh/host_check.py`` prints on a host becomes one ``HostFacts`` at the head; an answer
    missing a key, or with one the head does not know (another launcher version there), is an error naming the
    host and the key; output that is no JSON object is no answer (the check failed before printing)."""
    import json

    from launcher.launch.ssh.host_check import HostFacts

    facts = HostFacts("vm1", "10.0.0.2", "10.0.0.1", 0.0, 29500, 0, True, [], "10.0.0.2", [])
    assert HostFacts.parse(f"a warning first\n{facts.line()}\n", "vm1") == facts
    raw = json.loads(facts.line())
    keys = ["host", "addr", "head", "head_lookup_s", "port", "gpus", "tensorboard", "problems", "master_ip"]
    assert sorted(raw) == sorted([*keys, "slow_lookups"])
    del raw["gpus"]
    with pytest.raises(ValueError, match=r"^the host check on vm1 answered without 'gpus': not this launcher's"):
        HostFacts.parse(json.dumps(raw), "vm1")
    with pytest.raises(ValueError, match=r"the host check on vm2 answered with unknown 'cuda'"):
        HostFacts.parse(json.dumps({**json.loads(facts.line()), "cuda": "12.4"}), "vm2")
    assert HostFacts.parse("Traceback (most recent call last):", "vm1") is None
    assert HostFacts.parse("", "vm1") is None
