"""``+cluster=slurm``: submitted through submitit (``submit``); inside each task one rank (``task_entry``); whether a
job has ended, from the controller (``job_state``); how its end is reported (``ending``)."""
