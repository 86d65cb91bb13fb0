"""The line a real ``script=`` job stopped by SIGTERM ends with: nothing about a checkpoint (the launcher writes
none for it). (The message's rules: tests/rules/test_stop_message.py.)"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from harness import REPO

# Each rank joins the group, says it is running (a marker file), then waits to be stopped; it saves nothing.
WAITING_SCRIPT = """
import os, sys, time
import torch.distributed as dist
dist.init_process_group("gloo")
open(os.path.join(sys.argv[1], f"running-{os.environ['RANK']}"), "w").close()
while True:
    time.sleep(0.05)
"""


def wait_for(paths: list[Path], launcher: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert launcher.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no {[p.name for p in paths]} within {timeout} s: " + log.read_text()
        time.sleep(0.05)


def test_sigterm_on_a_script_job_claims_no_checkpoint(tmp_path):
    """A real ``script=`` job, two local ranks: SIGTERM to the launcher once both run; it exits 143 with the
    script's line, no word of a checkpoint."""
    script, run_dir, log = tmp_path / "wait.py", tmp_path / "run", tmp_path / "launcher.log"
    script.write_text(WAITING_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LAUNCHER_", "TORCHELASTIC_"))}
    with open(log, "w") as stderr:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "launcher", f"hydra.run.dir={run_dir}", f"script={script}"]
            + ["cluster.procs_per_node=2", f"script_args=[{tmp_path}]"],
            cwd=REPO,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
        )
    try:
        wait_for([tmp_path / "running-0", tmp_path / "running-1"], launcher, log)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == 143, log.read_text()[-3000:]
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    stopped = [line for line in log.read_text().splitlines() if line.startswith("launcher: stopped by")]
    assert stopped == [
        "launcher: stopped by SIGTERM; the script's ranks were stopped (the launcher writes no checkpoint for a "
        "script=: whether it saved anything is up to the script)"
    ], log.read_text()[-3000:]
