"""The ssh side of ``+cluster=ssh``: the hosts and their slots (``cluster.hosts`` / ``cluster.hostfile``), and the
checks every host passes before anything starts (``launch/ssh/host_check.py`` over ssh, in parallel, run by the
command ``launch/ssh/clients.py`` builds), also before each restart, where under ``cluster.min_nodes`` a host failing
them is lost and one passing them again joins (``launch/nodes/restarts.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig

from launcher.config import ConfigError, JobConfig, SshClusterConfig
from launcher.config.rules import TENSORBOARD_HINT, heals_in_place, writes_tensorboard
from launcher.launch.nodes.restarts import Membership
from launcher.launch.ssh.clients import (
    NO_CWD,
    NOT_FOUND,
    SETUP_FAILED,
    SSH_LOST,
    remote_shell,
    setup_input,
    ssh_command,
)
from launcher.launch.ssh.host_check import HostFacts


def parse_hostfile(path: str) -> list[tuple[str, int | None]]:
    """``host [slots=N]`` per line (DeepSpeed / MPI hostfiles), ``#`` comments, blank lines ignored."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(
            f"cluster.hostfile={path!r} cannot be read ({exc.strerror or exc}); HINT: a file with one host per "
            "line, optionally 'slots=N'"
        ) from None
    hosts = []
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        slots = None
        for extra in fields[1:]:
            key, _, value = extra.partition("=")
            if key != "slots" or not value.isdigit() or int(value) < 1:
                raise ConfigError(
                    f"cluster.hostfile={path!r} line {number}: {extra!r} is not understood; HINT: lines are "
                    "'HOST' or 'HOST slots=N' (N >= 1)"
                )
            slots = int(value)
        hosts.append((fields[0], slots))
    return hosts


def resolve_hosts(cluster: DictConfig) -> None:
    """``cluster.hosts`` or ``cluster.hostfile`` into the hosts the job uses (``cluster.nodes`` of them, every one
    listed by default), their ranks per node (the hostfile's ``slots``, all equal, unless
    ``cluster.procs_per_node`` says) and ``cluster.master_addr`` (the first host unless given); written into the
    composed config before validation."""
    if cluster.hostfile and cluster.hosts:
        raise ConfigError("cluster.hosts and cluster.hostfile are both set; HINT: give the hosts one way")
    listed = parse_hostfile(cluster.hostfile) if cluster.hostfile else [(str(h), None) for h in cluster.hosts]
    if not listed:
        where = f"cluster.hostfile={cluster.hostfile!r} lists no host" if cluster.hostfile else "no hosts given"
        raise ConfigError(f"+cluster=ssh: {where}; HINT: cluster.hosts=[host1,host2] or cluster.hostfile=PATH")
    hosts = [host for host, _ in listed]
    for host in hosts:
        if not host or host.startswith("-") or any(ch.isspace() or not ch.isprintable() for ch in host):
            raise ConfigError(
                f"cluster.hosts: {host!r} is not a host name (ssh would read a leading '-' as an option; no "
                "whitespace or control characters); HINT: a name or address ssh reaches, e.g. node1, user@node1, "
                "10.0.0.2"
            )
    if dups := sorted({h for h in hosts if hosts.count(h) > 1}):
        raise ConfigError(
            f"cluster.hosts lists {', '.join(dups)} more than once; HINT: one entry per machine, "
            "cluster.procs_per_node ranks run on each"
        )
    nodes = int(cluster.nodes) or len(hosts)
    if nodes > len(hosts):
        raise ConfigError(
            f"cluster.nodes={nodes} but only {len(hosts)} host(s) are listed; HINT: list more hosts or omit "
            "cluster.nodes (every listed host is used)"
        )
    used = listed[:nodes]
    slots = {host: n for host, n in used if n is not None}
    if cluster.procs_per_node is None and slots:
        if len(set(slots.values())) > 1 or len(slots) < nodes:
            given = ", ".join(f"{h}: {n if n is not None else 'none'}" for h, n in used)
            raise ConfigError(
                f"the hostfile's slots differ ({given}); every node runs the same number of ranks; HINT: set "
                f"cluster.procs_per_node={min(slots.values())}"
            )
        cluster.procs_per_node = next(iter(slots.values()))
    elif cluster.procs_per_node is not None:
        for host, n in slots.items():
            if cluster.procs_per_node > n:
                raise ConfigError(
                    f"cluster.procs_per_node={cluster.procs_per_node} but the hostfile gives {host} slots={n}; "
                    f"HINT: cluster.procs_per_node={n}, or raise its slots"
                )
    cluster.hosts, cluster.nodes = [h for h, _ in used], nodes
    cluster.master_addr = cluster.master_addr or used[0][0]


def ready_hosts(
    job: JobConfig, c: SshClusterConfig, members: Membership, skip: list[str]
) -> tuple[list[str], str, list[HostFacts]]:
    """The hosts the next attempt runs on, their master address and their facts. The first start needs every host
    (each failing one is named, nothing starts). A restart checks the running hosts and, under
    ``cluster.min_nodes``, those lost earlier but not in ``skip`` (just lost: not waited for): a running host that
    fails the checks is lost (if enough are left), one lost earlier that passes them joins."""
    candidates = [h for h in members.all if h in members.live or (members.may_shrink and h not in skip)]
    while True:
        master = c.master_addr if candidates[0] == members.all[0] else candidates[0]
        results = check_hosts(job, c, candidates, master)
        failing = {host: problems for host, (_, problems) in zip(candidates, results) if problems}
        down = {h: f"fails the host checks: {problems[0]}" for h, problems in failing.items() if h in members.live}
        if down and (members.attempt == 0 or not members.may_shrink or not members.change(down)):
            lines = [f"  {host}: {p}" for host, problems in failing.items() for p in problems]
            raise ConfigError(f"{len(lines)} problem(s) on the hosts, nothing started:\n" + "\n".join(lines))
        if candidates[0] in failing:  # the master is gone: check the others again against the next one
            candidates = [h for h in candidates if h not in failing]
            continue
        ready = [(host, facts) for host, (facts, problems) in zip(candidates, results) if facts and not problems]
        members.change({}, joined=[host for host, _ in ready if host not in members.live])
        return [host for host, _ in ready], as_address(master, [facts for _, facts in ready]), [f for _, f in ready]


def as_address(master: str, facts: list[HostFacts]) -> str:
    """The store's address rather than its name where every host resolved the name to the same one: no rank then
    resolves it again on each store connection (``base/names.py``: where that is slow, it is slow every time)."""
    seen = {f.master_ip for f in facts}
    return seen.pop() if len(seen) == 1 and "" not in seen else master


def ssh_problem(stderr: str, host: str) -> str:
    """ssh's own failure (exit 255), with the fix."""
    said = stderr.strip().splitlines()[-1] if stderr.strip() else "ssh failed without a message"
    if "Permission denied" in said:
        hint = f"passwordless ssh to {host} (ssh-copy-id {host}); the launcher never answers a password prompt"
    elif "Host key verification failed" in said:
        hint = f"ssh {host} once to accept its host key, or cluster.ssh_options=[-o,StrictHostKeyChecking=accept-new]"
    else:
        hint = f"is {host} up and reachable from here? (ssh {host} true)"
    return f"ssh failed: {said}; HINT: {hint}"


def check_host(
    job: JobConfig, c: SshClusterConfig, host: str, token: str, master: str, port: str
) -> tuple[Optional[HostFacts], list[str]]:
    """One host's facts (``launch/ssh/host_check.py``) and its problems."""
    names = ",".join(c.hosts)  # (each resolved and looked up in reverse there, timed)
    keeper = "1" if heals_in_place(job) else "0"  # (the head hosts the job's store: its address is looked up too)
    argv = [c.python, "-m", "launcher.launch.ssh.host_check", job.run_dir, token, master, port, names, keeper]
    try:
        out = subprocess.run(
            ssh_command(c, host, remote_shell(c, argv)),
            capture_output=True,
            text=True,
            timeout=c.check_timeout_s,
            input=setup_input(c),
        )
    except subprocess.TimeoutExpired:
        return None, [
            f"did not answer within {c.check_timeout_s:.0f} s (cluster.check_timeout_s); HINT: is it up and "
            "reachable? (ssh -o BatchMode=yes HOST true)"
        ]
    said = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else ""
    if out.returncode == SSH_LOST:
        return None, [ssh_problem(out.stderr, host)]
    if out.returncode == NO_CWD:
        return None, [f"no directory {os.getcwd()} there; HINT: start the launcher from a directory every host shares"]
    if out.returncode == SETUP_FAILED:
        return None, [f"cluster.setup failed there ({said}); HINT: try the lines with ssh {host}"]
    if out.returncode == NOT_FOUND:
        return None, [
            f"cluster.python={c.python} is not there ({said}); HINT: the same python must exist on every host: set "
            "cluster.python, or cluster.setup to activate an environment"
        ]
    if "No module named" in out.stderr:
        return None, [
            f"{c.python} cannot import the launcher there ({said}); HINT: install it on every host (pip install "
            "-e .), or reach it through PYTHONPATH (forwarded) or cluster.setup"
        ]
    try:
        facts = HostFacts.parse(out.stdout, host)
    except ValueError as exc:  # its answer, but not with the keys read here
        return None, [str(exc)]
    if facts is None:
        return None, [f"the check failed (exit {out.returncode}): {said or out.stdout.strip()[-300:]}"]
    problems = list(facts.problems)
    if (c.gpus_per_node or 0) > facts.gpus:
        problems.append(
            f"cluster.gpus_per_node={c.gpus_per_node} but it has {facts.gpus} GPU(s); HINT: "
            f"cluster.gpus_per_node={facts.gpus}"
        )
    if writes_tensorboard(job) and not facts.tensorboard:  # any host may hold rank 0 after a heal
        problems.append(f"train.tensorboard=true, but no tensorboard package there; HINT: {TENSORBOARD_HINT} on it")
    return facts, problems


def check_hosts(
    job: JobConfig, c: SshClusterConfig, hosts: list[str], master: str, picks_port: bool = True
) -> list[tuple[Optional[HostFacts], list[str]]]:
    """Every host in parallel, before anything starts: each one's facts and problems (the first host, the
    master, picks the port, unless not ``picks_port``: hosts that join a running job)."""
    token = uuid.uuid4().hex
    marker = job.run.host_check(token)
    marker.write_text(token)
    try:
        with ThreadPoolExecutor(len(hosts)) as pool:
            ports = [str(c.master_port) if node == 0 and picks_port else "-" for node in range(len(hosts))]
            results = list(pool.map(lambda hp: check_host(job, c, hp[0], token, master, hp[1]), zip(hosts, ports)))
    finally:
        marker.unlink(missing_ok=True)
    unused = {
        host: facts.gpus
        for host, (facts, problems) in zip(hosts, results)
        if facts and not problems and facts.gpus and not c.gpus_per_node
    }
    for host, said in dict.fromkeys(
        (h, s) for h, (facts, _) in zip(hosts, results) if facts for s in facts.slow_lookups
    ):
        print(f"launcher: warning: {host}: {said}", file=sys.stderr)  # (slow start-up, every store connection: named)
    if unused:
        print(
            f"launcher: warning: {', '.join(f'{h} has {n}' for h, n in unused.items())} GPU(s) but "
            f"cluster.gpus_per_node=0: training on the CPU; HINT: cluster.gpus_per_node={min(unused.values())}",
            file=sys.stderr,
        )
    return results


# The head's open files per machine while a job runs: its ssh client's three pipes, and the host check's three while
# the hosts are checked in parallel (with headroom for the store's clients and the run dir's files)
FILES_PER_HOST, FILES_BASE = 6, 256


def open_files_for(hosts: int) -> None:
    """Raise this head's soft limit on open files to what ``hosts`` machines need (up to the hard limit; a default
    soft limit of 1,024 holds about 130 machines); a ``ConfigError`` naming the limit when the hard one is lower."""
    import resource

    need = FILES_BASE + FILES_PER_HOST * hosts
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise ConfigError(
            f"cluster.hosts: {hosts} machines need about {need} open files on this head, over its hard limit of "
            f"{hard}; HINT: raise it (`ulimit -Hn {need}` as root, or nofile in /etc/security/limits.conf), or "
            "start the job from a head with a higher limit"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
