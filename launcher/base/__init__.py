"""The base, the lowest layer: who a process is in the job (``env.DistEnv``), what it runs on (``devices``, ``gpus``,
``threads``), where its files go (``run_dir.RunDir``, written by ``files``), every interval (``liveness``), how it
logs (``logs``) and ends (``exiting``), the kinds of failure and the base of the launcher's errors (``errors``), the
failure tests' faults (``faults``), and the words of the gradient sync's choices (``sync_modes``: the config's and
the sync engine's, torch-free). Imports nothing of the launcher above it."""
