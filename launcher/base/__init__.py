"""The base, the lowest layer: who a process is in the job (``env.DistEnv``), what it runs on (``devices``, ``gpus``,
``threads``), where its files go (``run_dir.RunDir``, written by ``files``), every interval (``liveness``), how it
logs (``logs``) and ends (``exiting``), and the failure tests' faults (``faults``). Imports nothing of the launcher
above it."""
