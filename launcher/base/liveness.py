"""Every heartbeat, poll interval and fixed timeout of the launcher, named once, in seconds, with what it guards
(``env.py`` does the same for environment variables). The user's own settings (``comm.timeout_s``,
``comm.hang_warn_s``, ``cluster.lost_after_s``, ``cluster.heartbeat_timeout_s``, ``cluster.join_timeout_s``) are in
the config schema; these are the launcher's, chosen so the user's hold.

Who beats whom, at a glance::

    rank --WATCH_BEAT_S--> its progress file --WATCH_BEAT_S--> rank 0's reporter (a hang, a straggler, a silent rank)
    node process --NODE_BEAT_S--> keeper's store --KEEPER_LOOK_S--> keeper (lost after cluster.lost_after_s)
    ssh head --HEAD_PING_S--> each node process (it ends after cluster.heartbeat_timeout_s without one)
"""

from __future__ import annotations

# ---- the progress watch (every rank; launcher/watch/)
WATCH_BEAT_S = 1.0  # each rank publishes its progress, and rank 0's reporter compares them, this often
WATCH_BACKSTOP_S = 10.0  # with the watch on, the trainer's process group times out this much after comm.timeout_s
STEP_NOTE_S = 0.25  # the trainer's steps are noted this often (64 notes: 16 s, more than the straggler window)
ARRIVALS_EVERY_S = 8.0  # the flight recorder is read whole this often for the straggler score (~20 ms / 2000 entries)
STRAGGLER_WINDOW_S = 15.0  # the newest seconds of collectives a straggler is scored on
KEEP_ARRIVALS_S = 60.0  # arrivals older than this are dropped from the straggler score
STRAGGLER_MIN_LATE_S = 0.01  # a straggler is this late at least, whatever the step (7 ms seen as a loaded box noise)
STALE_S = 10.0  # a rank whose progress file is older than this is silent (stopped or frozen) ...
SILENT_MIN_S = 3.0  # ... or older than comm.hang_warn_s when that is shorter, but at least this (three missed beats)
ANSWER_WAIT_S = 6.0  # a hang report waits this long for the ranks' stacks

# ---- collectives, stopping and failing (every rank, the heads)
TRAINER_TIMEOUT_S = 300.0  # the trainer's collective timeout when comm.timeout_s is null
STOP_DEADLINE_S = 25.0  # a signalled rank's time to reach a step boundary (killed after cluster.stop_grace_s: 30 s)
AFTER_FAILURE_GRACE_S = 5.0  # after one node failed, the others' time to end on their own before the report
STOP_POLL_S = 0.1  # in a stop's grace (cluster.stop_grace_s) the ranks' ends and a second stop are looked at this often
KILLED_WAIT_S = 5.0  # a rank killed (SIGKILL) after its grace is waited for this long (one stuck in the kernel is left)
WARNING_DONE_S = 60.0  # a script rank whose script ended waits this long at most for the requeue a Slurm warning began

# ---- healing in place (launcher/heal/)
NODE_BEAT_S = 0.5  # a node process beats its signed heartbeat to the keeper's store this often
KEEPER_LOOK_S = 0.1  # the keeper looks at the heartbeats and at what the head said this often
RANK_STORE_POLL_S = 0.05  # a rank asks the keeper's store for a decision this often (a blocking wait would warn in C++)
CHECK_IN_S = 60.0  # every member of a round being formed must check in this soon (a lost one: within lost_after_s)

# ---- the heads
HEAD_PING_S = 5.0  # the ssh head pings every node process this often (cluster.heartbeat_timeout_s ends a silent one)
SLOW_PHASE_S = 2.0  # an ssh start-up phase that takes longer says what the head waits for (one line)
SWEEP_POLL_S = 1.0  # a sweep asks its pending points whether they are done this often
STOP_SEEN_S = 5.0  # by hand: the machine signalled waits this long at most for the others to see its stop
SLURM_POLL_S = 1.0  # the Slurm head streams rank 0's log and asks the controller for the job's state this often
SLURM_RESULTS_WAIT_S = 0.5  # submitit's wait for a task's result file (its own default: 15 s per task)
SLURM_SETTLE_S = 1.0  # after the first failure record, the report waits until none came for this long
# rank 0 counts a requeue in requeues.json before it asks for it (``scontrol requeue``, 60 s at most): a job that
# looks ended meanwhile is waited for this long before it is taken as ended
REQUEUE_GRACE_S = 60.0
# a requeue revokes the job's credential on its nodes as of that second; slurmd refuses a start whose credential is
# from that second or before ("Job credential revoked": the job FAILED). Slurm's own hold (~10 s) avoids that; the
# launcher's release keeps this margin after the requeue instead
REVOKED_MARGIN_S = 2

# rank 0's output: at its end, each tee (its output to the console and its log) passes on what is left within this
TEE_DRAIN_S = 5.0

# name resolution (``base/names.py``): a look-up this long is named (a healthy one takes milliseconds); none is
# waited for longer than the limit (two resolver timeouts of 5 s, and some)
SLOW_LOOKUP_S = 1.0
LOOKUP_LIMIT_S = 12.0
