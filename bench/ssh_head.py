"""The ssh head's cost per machine (issue 39): the real head (``python -m launcher +cluster=ssh``) on N simulated
machines.

    python bench/ssh_head.py [--machines 10,100,300,1000] [--json PATH]

Each machine is a loopback address (127.0.x.y: distinct names that resolve, nothing to clean up), ``ssh`` on the
head's PATH is a stub that runs the remote script here, and ``cluster.python`` is a stub too: the host check
prints a machine's facts at once, a node process reads its stdin (the job's handoff, then the head's pings) and
ends on the head's stop word. So the head runs all of its own code (the host names resolved and validated, every host
checked in parallel, one ssh client per machine with its pipes and reader threads, the pings, the stop) and only
the machines are fake. Measured per size, once every node runs: the time from the head's start (after its
imports), its open descriptors, threads, resident memory and CPU time; then the time from SIGTERM to its exit.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import machine, table

REPO = Path(__file__).resolve().parent.parent
SSH_STUB = """#!/bin/bash
# ssh [options] HOST SCRIPT: run SCRIPT here, as HOST would (the head's address as sshd would give it)
host="${@: -2:1}"
export SSH_CONNECTION="127.0.0.1 50000 $host 22" BENCH_HOST="$host"
exec bash -c "${@: -1}"
"""
PYTHON_STUB = """#!/bin/bash
# cluster.python on a simulated machine: the host check's facts, or a node process that reads its stdin to the end
case "$2" in
  launcher.launch.ssh.host_check)  # RUN_DIR TOKEN MASTER_ADDR PORT ...: every field of its HostFacts
    port=null; [ "$6" != "-" ] && port=29500
    facts='"head": "127.0.0.1", "head_lookup_s": 0.0, "gpus": 0, "tensorboard": false, "problems": []'
    printf '{"host": "%s", "addr": "%s", "port": %s, "master_ip": "%s", %s, "slow_lookups": []}\\n' \\
      "$BENCH_HOST" "$BENCH_HOST" "$port" "$5" "$facts";;
  *) : > "$BENCH_MARKS/$BENCH_HOST"  # a node process: ends as a real one would on the head's stop words
     while IFS= read -r word; do case "$word" in TERM) exit 143;; INT) exit 130;; ABORT) exit 1;; esac; done;;
esac
"""


def addresses(n: int) -> list[str]:
    return [f"127.0.{1 + i // 250}.{1 + i % 250}" for i in range(n)]


def proc_status(pid: int) -> dict[str, float]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return {
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": int(fields["Threads"]),
        "rss_mb": int(fields["VmRSS"].split()[0]) / 1024,
        "cpu_s": (int(cpu[11]) + int(cpu[12])) / ticks,
    }


def one_size(n: int, folder: Path) -> dict[str, float]:
    marks = folder / f"marks-{n}"
    marks.mkdir()
    hosts = addresses(n)
    env = {**os.environ, "PATH": f"{folder}:{os.environ['PATH']}", "BENCH_MARKS": str(marks)}
    argv = [sys.executable, "-m", "launcher", "+cluster=ssh", f"cluster.hosts=[{','.join(hosts)}]"]
    argv += [
        f"cluster.python={folder / 'python'}",
        f"hydra.run.dir={folder / f'run-{n}'}",
        "cluster.procs_per_node=1",
        f"train.batch_size={n}",
    ]
    log = open(folder / f"head-{n}.log", "w")  # noqa: SIM115 (open while the head runs)
    head = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        started = None
        deadline = time.monotonic() + 120 + n * 0.5
        while len(os.listdir(marks)) < n:
            assert head.poll() is None, (folder / f"head-{n}.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"{len(os.listdir(marks))} of {n} nodes started"
            if started is None and (folder / f"run-{n}" / "config.yaml").exists():
                started = time.monotonic()  # the head's imports and config are done: its own work begins
            time.sleep(0.05)
        up_s = time.monotonic() - (started or time.monotonic())
        time.sleep(2.0)  # steady: the pings run
        figures = {"machines": n, "up_s": up_s, **proc_status(head.pid)}
        stop = time.monotonic()
        head.send_signal(signal.SIGTERM)
        head.wait(timeout=120 + n * 0.2)
        figures["stop_s"] = time.monotonic() - stop
        return figures
    finally:
        if head.poll() is None:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--machines", default="10,100,300,1000")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(dir=REPO / "bench") as tmp:  # (its run dirs must be on a "shared" path)
        folder = Path(tmp)
        for name, text in (("ssh", SSH_STUB), ("python", PYTHON_STUB)):
            (folder / name).write_text(text)
            (folder / name).chmod(stat.S_IRWXU)
        for n in (int(m) for m in args.machines.split(",")):
            rows.append(one_size(n, folder))
            print(f"# {n} machines: {rows[-1]}", flush=True)
    print(f"# the ssh head on simulated machines; {machine()}")
    keys = ["machines", "up_s", "fds", "threads", "rss_mb", "cpu_s", "stop_s"]
    print(table(keys, [[r[k] if k == "machines" else round(r[k], 2) for k in keys] for r in rows]))
    if args.json:
        args.json.write_text(json.dumps({k: [r[k] for r in rows] for k in keys}, indent=2))


if __name__ == "__main__":
    main()
