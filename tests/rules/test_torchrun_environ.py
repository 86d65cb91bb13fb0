"""Issue 47 (item 6), the paths where no elastic agent starts a rank: a Slurm task's rank and a healing job's node
process give a script every variable torchrun's agent gives a worker (``DistEnv.torchrun_environ``), with its
meaning; an agent's own values (torchrun's role and restarts) are kept; which restarts a job may have
(``rank.work.restarts_allowed``). The same table against torchrun itself, on
real processes: tests/jobs/test_torchrun_env.py."""

from types import SimpleNamespace

from harness.config import plan
from launcher.base.env import HEAD_ATTEMPT, DistEnv
from launcher.rank.work import restarts_allowed
from launcher.trust.secret import Secret

SLURM = {
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "8",
    "SLURM_NODEID": "2",
    "SLURM_JOB_NUM_NODES": "4",
    "SLURM_JOB_NODELIST": "gpu[07-09],cpu1",
    "SLURM_TASKS_PER_NODE": "2(x4)",
    "SLURM_JOB_ID": "123456",
    "SLURM_STEP_ID": "0",
    "SLURM_RESTART_COUNT": "1",  # requeued once
}
# what torch 2.13's LocalElasticAgent._start_workers gives rank 5 of 4 nodes x 2 (and torchrun: OMP_NUM_THREADS)
TORCHRUN_NAMES = {
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "OMP_NUM_THREADS",
}


def test_a_slurm_task_gives_its_script_torchruns_variables():
    env = DistEnv.resolve(SLURM)
    assert env.max_restarts is None  # no agent restarts a Slurm task: the job's config says (below)
    job, _ = plan("+cluster=slurm", "cluster.max_requeues=5")  # (cluster.max_restarts: refused under Slurm)
    assert restarts_allowed(job, env) == 5  # Slurm starts the tasks again on a requeue, never after a failure
    users_sbatch, _ = plan("cluster.max_restarts=2")  # srun python -m launcher: no Slurm cluster composed
    assert restarts_allowed(users_sbatch, env) == 3  # the requeues it gets (task_entry.requeue: the defaults')
    seen = env.torchrun_environ(restarts_allowed(job, env), threads=3)
    assert seen == {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "2",  # the node's rank
        "GROUP_WORLD_SIZE": "4",  # the nodes
        "ROLE_RANK": "5",  # one role: the rank
        "ROLE_WORLD_SIZE": "8",
        "ROLE_NAME": "default",  # torchrun's --role default
        "MASTER_ADDR": "gpu07",  # node 0
        "MASTER_PORT": str(20000 + 123456 % 20000),
        "TORCHELASTIC_RESTART_COUNT": "1",  # SLURM_RESTART_COUNT: the requeues so far
        "TORCHELASTIC_MAX_RESTARTS": "5",
        "TORCHELASTIC_RUN_ID": "123456",  # the job id: the same on every task, and across requeues
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # rank 0 hosts the store before the script starts (rank.work)
        "OMP_NUM_THREADS": "3",  # the threads the rank runs (launcher.base.threads)
    }
    assert set(seen) == TORCHRUN_NAMES
    # a process the script starts resolves the same place from them (torchrun's table wins over Slurm's)
    again = DistEnv.resolve({**SLURM, **seen})
    assert again.source == "elastic" and again.agent_store
    fields = ("rank", "local_rank", "world_size", "local_world_size", "node_rank", "num_nodes")
    fields += ("master_addr", "master_port", "launch_id", "attempt", "role", "max_restarts")
    assert [getattr(again, f) for f in fields] == [getattr(env, f) for f in fields[:-1]] + [5]


def test_one_process_has_a_run_id_and_every_name_but_the_threads_when_none_given():
    seen = DistEnv().torchrun_environ(0)
    assert seen["TORCHELASTIC_RUN_ID"] == "none"  # torchrun's --rdzv-id default
    assert set(seen) == TORCHRUN_NAMES - {"OMP_NUM_THREADS"}


def test_an_agents_own_values_are_kept():
    """torchrun's (``--role``, ``--max-restarts``) pass through (our agents' role is torchrun's default:
    launch.nodes.agent); under a head that restarts the job itself, its attempts count and the agent's 0 does not."""
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}
    torchrun |= {"ROLE_NAME": "trainer", "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RESTART_COUNT": "2"}
    env = DistEnv.resolve(torchrun)
    assert (env.role, env.max_restarts, env.attempt) == ("trainer", 3, 2)
    seen = env.torchrun_environ(env.max_restarts)
    assert (seen["ROLE_NAME"], seen["TORCHELASTIC_MAX_RESTARTS"], seen["TORCHELASTIC_RESTART_COUNT"]) == (
        "trainer",
        "3",
        "2",
    )
    headed = DistEnv.resolve({**torchrun, "TORCHELASTIC_MAX_RESTARTS": "0", HEAD_ATTEMPT: "4"})
    assert (headed.max_restarts, headed.attempt) == (None, 6)
    job, _ = plan("+cluster=sim", "cluster.max_restarts=7")
    assert restarts_allowed(job, headed) == 7  # the head's limit: the job's cluster.max_restarts
    assert restarts_allowed(job, env) == 3  # torchrun's
    assert restarts_allowed(job, DistEnv()) == 0  # one process the launcher runs itself: nothing restarts it


def test_a_healing_jobs_node_process_gives_its_ranks_torchruns_variables():
    from launcher.heal.node_side import worker_envs

    sim = ("+cluster=sim", "cluster.nodes=3", "cluster.min_nodes=1", "train.batch_size=48")  # 6 ranks
    job, _ = plan(*sim, "cluster.max_restarts=2")
    args = SimpleNamespace(nodes=3, node=1, endpoint="10.0.0.1:4242", launch_id="abc", members="a,b,c", start=0)
    envs = worker_envs(job, args, Secret.new())
    assert sorted(envs) == [0, 1]
    for local, environ in envs.items():
        seen = {k: environ[k] for k in TORCHRUN_NAMES - {"OMP_NUM_THREADS"}}  # threads: each rank's own
        assert seen == {
            "RANK": str(2 + local),
            "LOCAL_RANK": str(local),
            "WORLD_SIZE": "6",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "1",
            "GROUP_WORLD_SIZE": "3",
            "ROLE_RANK": str(2 + local),
            "ROLE_WORLD_SIZE": "6",
            "ROLE_NAME": "default",
            "MASTER_ADDR": "10.0.0.1",  # the keeper's store
            "MASTER_PORT": "4242",
            "TORCHELASTIC_RESTART_COUNT": "0",  # the head's attempt is added by the rank (LAUNCHER_HEAD_ATTEMPT)
            "TORCHELASTIC_MAX_RESTARTS": "2",
            "TORCHELASTIC_RUN_ID": "abc",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }
