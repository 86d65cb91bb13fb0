"""The progress watch across nodes: in every multi-node mode (``+cluster=sim``, ``+cluster=ssh``, Slurm) a job whose
last rank, on the second node, is stuck (a ``script=`` blocked in its own code, or the trainer's ``stall`` fault).
Each test asserts what the user sees: the first ``hang:`` line on the console names the culprit (with its host)
before the ranks that wait for it, with a frame of its live stack; the launcher's failure report leads with the
culprit ``hung:``; ``RUN_DIR/hangs/*/report.json`` names it; and the whole run ends within a bound of
``comm.timeout_s``. On this host: tests/jobs/test_hangs.py; on Slurm: tests/beds/test_slurm.py (its cluster)."""

from __future__ import annotations

import socket

from harness.beds import HOSTS, needs_ssh_machines
from harness.checks import assert_hang_named
from harness.jobs import HANG_SCRIPT as SCRIPT
from harness.jobs import STALL_FRAME, STUCK, STUCK_FRAME, WATCH
from harness.run import run_timed

# ------------------------------------------------------------------------------------------------ sim
SIM = ("+cluster=sim", "cluster.nodes=2", "cluster.procs_per_node=1")


def test_sim_script_stuck_on_the_second_node(tmp_path):
    run = run_timed([*SIM, SCRIPT, *WATCH], tmp_path, {**STUCK, "HANG_RANK": "1"})
    assert_hang_named(run, tmp_path, 1, socket.gethostname(), [0], r"node 1, pid \d+", STUCK_FRAME)


def test_sim_trainer_stalled_on_the_second_node(tmp_path):
    args = [*SIM, *WATCH, "train.max_steps=30", "train.checkpoint_every_steps=0"]
    run = run_timed(args, tmp_path, {"LAUNCHER_FAULT": "step=5,rank=1,stall"})
    assert_hang_named(run, tmp_path, 1, socket.gethostname(), [0], r"node 1, pid \d+", STALL_FRAME)


# ------------------------------------------------------------------------------------------------ ssh
@needs_ssh_machines
def test_ssh_script_stuck_on_the_second_machine(ssh_args, tmp_path):
    """2 machines x 2 ranks, rank 3 stuck; HANG_* reach the machines through cluster.env."""
    args = [*ssh_args, "cluster.procs_per_node=2", "cluster.env=[HANG_CASE,HANG_RANK]", SCRIPT, *WATCH]
    run = run_timed(args, tmp_path, {**STUCK, "HANG_RANK": "3"})
    assert_hang_named(run, tmp_path, 3, HOSTS[1], [0, 1, 2], r"node 1, pid \d+", STUCK_FRAME)
    assert run.first(r"\bhang: ")[1].startswith(f"[{HOSTS[0]}] [launcher] hang: "), "not rank 0's console"


# Slurm (the stuck last rank on the second node): tests/beds/test_slurm.py, on its session's cluster.
