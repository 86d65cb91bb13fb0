"""Lightning's graceful shutdown under the launcher (issue 58): Ctrl-C reaches every rank of a ``script=`` job as
SIGINT, as under torchrun, so Lightning's ``OnExceptionCheckpoint`` writes its checkpoint before the ranks end."""

import os
import signal
import time

import pytest

from harness.run import start_head


@pytest.mark.slow
def test_lightnings_on_exception_checkpoint_is_written_on_ctrl_c(tmp_path):
    out, run_dir, log = tmp_path / "out", tmp_path / "run", tmp_path / "head.log"
    script = ("cluster.procs_per_node=2", "script=tests/scripts/lightning_interrupted.py", f"script_args=[{out}]")
    head = start_head(run_dir, *script, log=log)
    try:
        deadline = time.monotonic() + 180
        while not (out / "running").exists():
            assert head.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        os.killpg(head.pid, signal.SIGINT)  # Ctrl-C: the terminal's process group
        head.wait(timeout=60)
    finally:
        if head.poll() is None:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait()
    assert (out / "on_exception.ckpt").is_file(), log.read_text()[-3000:]
