import pytest

from launcher.base.env import DistEnv, expand_hostlist, parse_tasks_per_node, slurm_port

TORCHRUN = {
    "RANK": "3",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "abc",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
}
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
}


def test_torchrun_table():
    env = DistEnv.resolve(TORCHRUN)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (3, 1, 4, 2)
    assert (env.node_rank, env.num_nodes, env.master_addr, env.master_port) == (1, 2, "10.0.0.1", 29500)
    assert env.source == "elastic" and env.agent_store and env.launch_id == "abc"


def test_slurm_table():
    env = DistEnv.resolve(SLURM)
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (5, 1, 8, 2)
    assert (env.node_rank, env.num_nodes) == (2, 4)
    assert env.master_addr == "gpu07"
    assert env.master_port == slurm_port("123456") == 20000 + 123456 % 20000
    assert env.source == "slurm" and not env.agent_store


def test_requeued_slurm_job_is_a_later_attempt():
    env = DistEnv.resolve({**SLURM, "SLURM_RESTART_COUNT": "2"})
    assert env.attempt == 2 and env.describe().endswith("via slurm, attempt 2")


def test_torchrun_wins_over_slurm():
    """torchrun inside a Slurm allocation: torchrun's variables describe this process."""
    assert DistEnv.resolve({**SLURM, **TORCHRUN}).source == "elastic"


def test_slurm_batch_step_is_not_a_rank():
    """The sbatch script itself (no SLURM_STEP_ID) is not rank 0 of the job."""
    batch = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    assert DistEnv.resolve(batch).source == "single"


def test_single_process():
    env = DistEnv.resolve({})
    assert (env.rank, env.world_size, env.source) == (0, 1, "single") and env.is_main and not env.is_distributed


def test_frozen():
    env = DistEnv.resolve({})
    with pytest.raises(AttributeError):
        env.rank = 1  # type: ignore[misc]


def test_bad_values_name_the_variable():
    with pytest.raises(ValueError, match=r"RANK='x' is not an integer"):
        DistEnv.resolve({**TORCHRUN, "RANK": "x"})
    with pytest.raises(ValueError, match=r"rank 4 outside world size 4"):
        DistEnv.resolve({**TORCHRUN, "RANK": "4"})


def test_missing_local_world_size_means_one_node():
    env = DistEnv.resolve({k: v for k, v in TORCHRUN.items() if k not in ("LOCAL_WORLD_SIZE", "GROUP_RANK")})
    assert (env.local_world_size, env.num_nodes, env.node_rank) == (4, 1, 0)


@pytest.mark.parametrize(
    "hostlist, hosts",
    [
        ("node1", ["node1"]),
        ("node[1-3,7]", ["node1", "node2", "node3", "node7"]),
        ("gpu[07-09],cpu1", ["gpu07", "gpu08", "gpu09", "cpu1"]),
        ("a[1-2]-ib,b", ["a1-ib", "a2-ib", "b"]),
    ],
)
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("spec, counts", [("2", [2]), ("2(x3)", [2, 2, 2]), ("4,2(x2)", [4, 2, 2]), ("", [1, 1])])
def test_tasks_per_node(spec, counts):
    assert parse_tasks_per_node(spec, 2) == counts
