"""The progress watch across machines: in every multi-node mode (``+cluster=sim``, ``+cluster=ssh``, Slurm) a job
whose last rank, on the second node, is stuck (a ``script=`` blocked in its own code). Each test asserts what the user
sees: the first ``hang:`` line on the console names the culprit (with its host) before the ranks that wait for it,
with a frame of its live stack; the launcher's failure report leads with the culprit ``hung:``;
``RUN_DIR/hangs/*/report.json`` names it; and the whole run ends within a bound of ``comm.timeout_s``. Here the ssh
machines; on this host and on simulated nodes (no machine needed): tests/jobs/test_hangs.py; on Slurm:
tests/beds/test_slurm.py (its cluster)."""

from __future__ import annotations

from harness.beds import HOSTS, needs_ssh_machines
from harness.checks import assert_hang_named
from harness.jobs import HANG_SCRIPT as SCRIPT
from harness.jobs import STUCK, STUCK_FRAME, WATCH
from harness.run import run_timed


# ------------------------------------------------------------------------------------------------ ssh
@needs_ssh_machines
def test_ssh_script_stuck_on_the_second_machine(ssh_args, tmp_path):
    """2 machines x 2 ranks, rank 3 stuck; HANG_* reach the machines through cluster.env."""
    args = [*ssh_args, "cluster.procs_per_node=2", "cluster.env=[HANG_CASE,HANG_RANK]", SCRIPT, *WATCH]
    run = run_timed(args, tmp_path, {**STUCK, "HANG_RANK": "3"})
    assert_hang_named(run, tmp_path, 3, HOSTS[1], [0, 1, 2], r"node 1, pid \d+", STUCK_FRAME)
    assert run.first(r"\bhang: ")[1].startswith(f"[{HOSTS[0]}] [launcher] hang: "), "not rank 0's console"


# Slurm (the stuck last rank on the second node): tests/beds/test_slurm.py, on its session's cluster.
