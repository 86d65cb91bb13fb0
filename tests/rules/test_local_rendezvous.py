"""A local job's agent (launcher/launch/local.py ``one_machine``): elastic's static rendezvous when it does not
restart (c10d's dynamic one cost every launch ~0.5 s: bench/launch.py), c10d when it does (a script's own
``init_process_group`` puts no attempt prefix on the agent's store: over the static one's, a restarted rank read
the dead ranks' addresses; tests/jobs/test_script_restarts.py restarts one); the plan says which."""

from harness.config import plan
from launcher.launch.local import LocalMode, one_machine


def test_a_job_that_does_not_restart_meets_at_the_agents_store_and_one_that_does_over_c10d(tmp_path):
    job, _ = plan("cluster.procs_per_node=2", run_dir=tmp_path / "run")
    config = one_machine(job)
    assert (config.rdzv_backend, config.max_restarts, config.min_nodes, config.max_nodes) == ("static", 0, 1, 1)
    assert config.rdzv_configs == {"rank": 0, "timeout": 120}
    assert LocalMode().rendezvous(job, None) == "the agent's store on 127.0.0.1:free port held by the store"
    job, _ = plan("cluster.procs_per_node=2", "cluster.max_restarts=2", run_dir=tmp_path / "run")
    config = one_machine(job)
    assert (config.rdzv_backend, config.max_restarts) == ("c10d", 2)
    assert (config.rdzv_configs["join_timeout"], config.rdzv_configs["is_host"]) == (120, True)
    assert LocalMode().rendezvous(job, None) == "c10d on 127.0.0.1:free port held by the store (restarts)"
