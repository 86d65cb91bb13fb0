"""The jobs that modules of more than one tier run, named once: the heal tests' job, the failing rank's (the root
cause named first) and the stuck rank's (the hang named live)."""

from __future__ import annotations

import os

from harness import REPO, path_override

# ------------------------------------------------------------------------------------------------ healing
# the heal tests' job (test_sim, test_ssh; tests/beds/conftest.py's one_process_heal_job is its one-process
# reference): 20 steps, the trajectory check's span (float32 summation orders drift apart over hundreds), one thread
# per rank; the LR schedule of the 10 epochs (29 steps each), nearly constant over the 20: the drift the check's
# tolerance is set for
HEAL_SCHEDULE = "optim.schedule_steps=290"
HEAL_JOB = ("train.max_steps=20", "train.batch_size=48", "cluster.procs_per_node=1", "train.threads_per_rank=1")
HEAL_JOB += (HEAL_SCHEDULE,)

# ------------------------------------------------------------------------------------------------ a failing rank
# (test_root_cause on this host, test_ssh and test_slurm across machines; checks.expect_root_cause)
REPEAT = int(os.environ.get("LAUNCHER_STRESS", "1"))  # each case N times (test_root_cause's docstring)
FAIL_SCRIPT = REPO / "tests" / "scripts" / "fail_script.py"
TRAIN = ("train.max_steps=8", "train.checkpoint_every_steps=0", "train.log_every_steps=4")
# trainer faults: before the first collective (before joining), between collectives, inside one (backward)
FAULTS = {"before": "step=0", "between": "step=3", "inside": "step=3,backward"}
MESSAGES = {
    "before": {
        "script": "boom before the first collective on rank {r}",
        "trainer": "injected fault at step 0 on rank {r}",
    },
    "between": {"script": "boom between collectives on rank {r}", "trainer": "injected fault at step 3 on rank {r}"},
    "inside": {"script": "boom inside a collective on rank {r}", "trainer": "injected fault at step 3 on rank {r}"},
}
# The trainer's fault has one message wherever it fires; where it fired is in the cause's traceback: inside a
# collective means from a gradient hook, during ``loss.backward()`` (the peers wait in the step's allreduce);
# between collectives, before the step's forward.
IN_BACKWARD = ".backward()"  # the trainer's backward pass (launcher/train/step.py)


def job_args(kind: str, where: str, rank: int) -> tuple[list[str], dict[str, str]]:
    """(overrides, environment) of a job whose ``rank`` fails ``where`` (``before``, ``between``, ``inside`` a
    collective): a ``script=`` (``kind="script"``) or the trainer's injected fault."""
    if kind == "script":
        return [path_override("script", FAIL_SCRIPT), f"script_args=[{where},{rank}]"], {}
    return list(TRAIN), {"LAUNCHER_FAULT": f"{FAULTS[where]},rank={rank}"}


# ------------------------------------------------------------------------------------------------ a stuck rank
# (test_hang_clusters, test_slurm; checks.assert_hang_named)
HANG_SCRIPT = "script=tests/scripts/hang_script.py"
WARN_S, TIMEOUT_S = 4, 10  # comm.hang_warn_s, comm.timeout_s: the report at ~4 s of the hang, the end at ~10 s
WATCH = (f"comm.hang_warn_s={WARN_S}", f"comm.timeout_s={TIMEOUT_S}")
BOUND_S = 75  # the whole run: start-up, the hang up to comm.timeout_s, the end and the report (typical 25 s)
STUCK = {"HANG_CASE": "stuck"}
# a frame and its source line (over ssh each console line starts with "[host] ")
STUCK_FRAME = r'hang_script\.py", line \d+, in stuck_in_user_code\n[^\n]*  time\.sleep\(1\)'
STALL_FRAME = r'faults\.py", line \d+, in fire\n[^\n]*  threading\.Event\(\)\.wait\(\)'
