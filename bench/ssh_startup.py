"""The 2-machine ssh start-up where name resolution is slow (issue 51, item 7), on machines of scripts/ssh-hosts/
(network namespaces with sshd, started and stopped here; root).

    sudo .venv/bin/python bench/ssh_startup.py [--names full|bare|hinted] [--repo DIR] [--runs N] [--json PATH]

``--names full``: each machine's /etc/hosts as start.sh writes it (every machine, the head, and the IPv4-mapped
form of each address: how c10d sees an IPv4 peer). ``--names bare``: what many clusters have, one line per machine
and nothing else; a look-up of anything else asks the name server, which the machines cannot reach (the host's,
through the bridge that forwards nothing): each waits for its timeouts, as on a cloud machine whose reverse DNS
does not answer. ``--names hinted``: bare plus the lines the head's warnings then ask for. ``--repo``: the
launcher to run (a ``git worktree`` of an earlier commit measures "before"; the machines run the same checkout:
the ssh head starts them in its own directory).

A 4-step job on 2 machines x 1 rank; per run, seconds from the command: the head's plan printed, the host checks
begun, the node processes being started, rank 0 up (its first line), the end; and the lines that name a slow
look-up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import machine, table

REPO = Path(__file__).resolve().parent.parent
PREFIX, SUBNET, BRIDGE = "bnchvm", "10.95.0", "bnchbr0"
HOSTS = [f"{PREFIX}1", f"{PREFIX}2"]


def machines_env(state: Path) -> dict[str, str]:
    return {
        **os.environ,
        "SSH_HOSTS_PREFIX": PREFIX,
        "SSH_HOSTS_SUBNET": SUBNET,
        "SSH_HOSTS_BRIDGE": BRIDGE,
        "SSH_HOSTS_STATE": str(state),
        "SSH_HOSTS_N": str(len(HOSTS)),
    }


def bare_names(hinted: bool = False) -> None:
    """Each machine's /etc/hosts cut to localhost and one IPv4 line per machine, written in place (sshd's mount of
    the file sees it); ``hinted``: with the lines the head's warnings ask for (each address's IPv4-mapped form)."""
    lines = ["127.0.0.1 localhost", "::1 localhost", *(f"{SUBNET}.{i + 1} {h}" for i, h in enumerate(HOSTS))]
    lines += [f"::ffff:{SUBNET}.{i + 1} {h}" for i, h in enumerate(HOSTS)] if hinted else []
    for host in HOSTS:
        with open(f"/etc/netns/{host}/hosts", "r+") as f:
            f.truncate(0)
            f.write("\n".join(lines) + "\n")


def one_run(repo: Path, state: Path, run_dir: Path) -> dict:
    argv = [sys.executable, "-m", "launcher", "+cluster=ssh", f"cluster.hosts=[{','.join(HOSTS)}]"]
    argv += [f"cluster.ssh_options=[-F,{state}/ssh_config]", "cluster.procs_per_node=1", "train.max_steps=4"]
    argv += ["train.plots=false", f"hydra.run.dir={run_dir}"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LAUNCHER_", "TORCHELASTIC_"))}
    started = time.monotonic()
    head = subprocess.Popen(argv, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: dict = {"plan": None, "checks": None, "nodes": None, "rank 0 up": None, "slow": [], "lines": []}
    assert head.stdout is not None
    for line in head.stdout:
        at = round(time.monotonic() - started, 2)
        seen["lines"].append(f"{at:6.2f} {line.rstrip()[:200]}")
        if seen["plan"] is None and line.startswith("[launcher] mode"):
            seen["plan"] = at
        if seen["rank 0 up"] is None and "[launcher] rank 0/" in line:  # (prefixed with its machine's name)
            seen["rank 0 up"] = at
        if seen["checks"] is None and "[launcher] checking" in line:
            seen["checks"] = at
        if seen["nodes"] is None and "starting their node processes" in line:
            seen["nodes"] = at
        if "look-up" in line or "lookup" in line or "cannot be retrieved" in line:
            seen["slow"].append(f"{at:6.2f} {line.strip()[:200]}")
    code = head.wait()
    seen.update(done=round(time.monotonic() - started, 2), code=code)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--names", choices=("full", "bare", "hinted"), default="full")
    parser.add_argument("--repo", type=Path, default=REPO)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ssh-startup-") as tmp:
        state, env = Path(tmp) / "state", machines_env(Path(tmp) / "state")
        subprocess.run([REPO / "scripts" / "ssh-hosts" / "start.sh"], env=env, check=True, capture_output=True)
        try:
            if args.names != "full":
                bare_names(hinted=args.names == "hinted")
            runs = [one_run(args.repo.resolve(), state, Path(tmp) / f"run-{k}") for k in range(args.runs)]
        finally:
            subprocess.run([REPO / "scripts" / "ssh-hosts" / "stop.sh"], env=env, capture_output=True)
    keys = ("plan", "checks", "nodes", "rank 0 up", "done", "code")
    rows = [[str(k), *(str(r[key]) for key in keys)] for k, r in enumerate(runs)]
    print(f"{machine()}; names {args.names}; launcher at {args.repo}")
    print(table(["run", "plan printed", "host checks", "node processes", "rank 0 up", "done", "exit"], rows))
    for k, r in enumerate(runs):
        for line in r["slow"]:
            print(f"run {k}: {line}")
    if args.json:
        args.json.write_text(json.dumps({"names": args.names, "repo": str(args.repo), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
