"""Bad input is refused before any process starts: the value and the fix named. (Exit code 2 and no traceback, as
``python -m launcher`` shows it: tests/jobs/test_config_processes.py.)"""

import os
import re

import pytest

from harness import REPO
from harness.config import plan
from launcher.config import ConfigError

CASES = [
    (["cluster.nodes=0"], "cluster.nodes=0 must be >= 1; HINT: set cluster.nodes=1"),
    (["cluster.procs_per_node=0"], "cluster.procs_per_node=0 must be >= 1"),
    (
        ["cluster.gpus_per_node=1"],
        "cluster.gpus_per_node=1 but this machine has 0 visible GPU(s); HINT: set cluster.gpus_per_node=0 (CPU)",
    ),
    (
        ["train.batch_size=63"],
        "train.batch_size=63 is not divisible by the world size 2 (cluster.nodes=1 x "
        "cluster.procs_per_node=2); HINT: use train.batch_size=64",
    ),
    (["cluster.procs_per_node=3", "train.batch_size=64"], "HINT: use train.batch_size=66"),
    (["script=no/such/train.py"], "script='no/such/train.py' does not exist"),
    (["cluster.nodes=2"], "HINT: +cluster=ssh cluster.hosts=[host1,host2] from one machine; or by hand"),
    (["cluster.nodes=2", "cluster.node_rank=2"], "cluster.node_rank=2 is out of range for cluster.nodes=2"),
    (
        ["cluster.nodes=2", "cluster.node_rank=1", "cluster.master_port=29500"],
        "cluster.master_addr=127.0.0.1 is this machine's loopback: the other machines cannot reach it",
    ),
    (
        ["cluster.nodes=2", "cluster.node_rank=1", "cluster.master_addr=node0"],
        "cluster.master_port=0 (a free port) cannot be agreed by machines started by hand; HINT: give every "
        "machine the same cluster.master_port",
    ),
    (["+cluster=ssh"], "+cluster=ssh: no hosts given; HINT: cluster.hosts=[host1,host2] or cluster.hostfile=PATH"),
    (["+cluster=ssh", "cluster.hosts=[a,b,a]"], "cluster.hosts lists a more than once"),
    (["+cluster=ssh", "cluster.hosts=[a,b]", "cluster.nodes=3"], "cluster.nodes=3 but only 2 host(s) are listed"),
    (["+cluster=ssh", "cluster.hostfile=/no/hosts"], "cluster.hostfile='/no/hosts' cannot be read"),
    (["+cluster=ssh", "cluster.hosts=[a]", "cluster.env=[A-B]"], "cluster.env entry 'A-B' is not a variable name"),
    (["+cluster=ssh", "cluster.hosts=[a]", "cluster.node_rank=0"], "HINT: drop cluster.node_rank"),
    (["model._target_=no.such.Net"], "model._target_='no.such.Net' cannot be imported"),
    (["data=idx"], "data.path=None is not a directory; HINT: data=idx data.path="),
    (["optim.lr=0"], "optim.lr=0.0 must be > 0"),
    (["comm.reducer=horovod"], "comm.reducer='horovod' is not a choice; HINT: comm.reducer=ddp, bucketed or fsdp"),
    (["train.resume=/nope.pt"], "train.resume='/nope.pt' is not a checkpoint; HINT: use auto, force, never, a path"),
    (
        ["cluster.stop_grace_s=-1"],
        "cluster.stop_grace_s=-1.0 must be >= 0 (the seconds the ranks have to exit after a stop signal); HINT: 30 is "
        "torchrun's, 0 kills them at once",
    ),
    (["+cluster=slurm", "cluster.stop_grace_s=-0.5"], "cluster.stop_grace_s=-0.5 must be >= 0"),
    (["+cluster=sim", "cluster.min_nodes=3"], "cluster.min_nodes=3 must be in 1..cluster.nodes=2"),
    (["+cluster=sim", "cluster.min_nodes=0"], "cluster.min_nodes=0 must be in 1..cluster.nodes=2"),
    (
        ["cluster.nodes=2", "cluster.node_rank=0", "cluster.min_nodes=1"],
        "cluster.min_nodes=1 < cluster.nodes=2: machines started by hand cannot go on with fewer machines (that "
        "needs the launcher's head, +cluster=ssh or +cluster=sim, or Slurm's --nodes=MIN-MAX, +cluster=slurm); "
        "HINT: use one of those, or drop cluster.min_nodes",
    ),
    (
        ["+cluster=sim", "cluster.nodes=3", "cluster.min_nodes=2", "cluster.procs_per_node=2"],
        "train.batch_size=64 is not divisible by the world size 6 (cluster.nodes=3 x cluster.procs_per_node=2); "
        "HINT: use train.batch_size=72",
    ),
    (
        ["+cluster=slurm", "cluster.nodes=3", "cluster.min_nodes=2", "cluster.procs_per_node=1", "train.batch_size=63"],
        "train.batch_size=63 is not divisible by the world size 2 (2 node(s), allowed by cluster.min_nodes=2, x 1 "
        "rank(s)); HINT: use train.batch_size=66",
    ),
    (
        ["+cluster=slurm", "cluster.max_restarts=2"],
        "cluster.max_restarts=2: a Slurm job is not started again after a failure (it is requeued after a preemption "
        "or its time limit, cluster.max_requeues=3); HINT: drop cluster.max_restarts",
    ),
    (
        ["+cluster=sim", "cluster.nodes=4", "cluster.min_nodes=3", "cluster.procs_per_node=1", "train.batch_size=66"],
        "train.batch_size=66 is not divisible by the world size 4 (cluster.nodes=4 x cluster.procs_per_node=1); "
        "HINT: use train.batch_size=72",
    ),
    (
        ["+cluster=sim", "cluster.nodes=4", "cluster.min_nodes=3", "cluster.procs_per_node=1", "train.batch_size=52"],
        "train.batch_size=52 is not divisible by the world size 3 (3 node(s), allowed by cluster.min_nodes=3, x 1 "
        "rank(s)); HINT: use train.batch_size=60",
    ),
    (
        ["+cluster=sim", "cluster.min_nodes=1", "train.batch_size_per_rank=16"],
        "cluster.min_nodes=1 < cluster.nodes=2 with train.batch_size_per_rank=16: on fewer machines the global batch "
        "would shrink and the run could not resume; HINT: set the global batch",
    ),
    (["train.precision=fp8"], "train.precision='fp8'; HINT: fp32, bf16, fp16"),
    (["train.accumulate_steps=0"], "train.accumulate_steps=0 must be >= 1"),
    (
        ["train.accumulate_steps=3"],
        "train.batch_size=64 is not divisible by the world size 2 (cluster.nodes=1 x cluster.procs_per_node=2) x "
        "train.accumulate_steps=3 micro-batches; HINT: use train.batch_size=66",
    ),
    (
        ["train.batch_size_per_rank=10", "train.accumulate_steps=4"],
        "train.batch_size_per_rank=10 does not split into train.accumulate_steps=4 equal micro-batches; HINT: use "
        "train.batch_size_per_rank=12",
    ),
    (["optim.clip_grad_norm=0"], "optim.clip_grad_norm=0.0 must be > 0 (or null: off)"),
    (["data._target_=no.such.data"], "data._target_='no.such.data' cannot be imported"),
    (["data.num_workers=-1"], "data.num_workers=-1 must be >= 0"),
]


@pytest.mark.parametrize("overrides, message", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_validation_message(overrides, message):
    with pytest.raises(ConfigError) as info:
        plan(*overrides)
    assert message in str(info.value)


def test_min_nodes_accepts_a_batch_every_world_divides():
    job, _ = plan(
        "+cluster=sim", "cluster.nodes=3", "cluster.min_nodes=2", "cluster.procs_per_node=1", "train.batch_size=60"
    )
    assert (job.cluster.nodes, job.cluster.min_nodes) == (3, 2)


def test_gpu_layout_checks():
    with pytest.raises(
        ConfigError,
        match=r"procs_per_node=4 exceeds cluster.gpus_per_node=2.*HINT: set "
        r"cluster.procs_per_node=2",
    ):
        plan("cluster.procs_per_node=4", gpus_visible=2)
    job, p = plan(gpus_visible=2)
    assert (p.procs_per_node, p.gpus_per_node, p.backend) == (2, 2, "nccl")
    job, p = plan("cluster.gpus_per_node=0", gpus_visible=2)
    assert (p.procs_per_node, p.backend) == (2, "gloo")


def test_defaults_on_cpu():
    job, p = plan()
    assert (p.mode, p.nodes, p.procs_per_node, p.gpus_per_node, p.backend) == ("local", 1, 2, 0, "gloo")
    assert job.model["_target_"] == "models.lenet.LeNet" and job.data.name == "digits"
    assert (job.comm.reducer, job.train.resume) == ("ddp", "auto")


def test_batch_size_per_rank_skips_divisibility():
    job, p = plan("train.batch_size=63", "train.batch_size_per_rank=16", "cluster.procs_per_node=3")
    assert p.world_size == 3


def test_torchrun_layout_comes_from_torchrun():
    environ = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1234",
    }
    job, p = plan(environ=environ)
    assert (p.mode, p.nodes, p.procs_per_node) == ("torchrun", 1, 4)
    with pytest.raises(ConfigError, match=r"cluster.procs_per_node=2 but torchrun started 4"):
        plan("cluster.procs_per_node=2", environ=environ)


def hostfile(tmp_path, text):
    path = tmp_path / "hosts"
    path.write_text(text)
    return f"cluster.hostfile={path}"


def test_ssh_hostfile_slots_comments_and_first_host_as_master(tmp_path):
    job, p = plan("+cluster=ssh", hostfile(tmp_path, "# lab\nnode-a slots=4  # big one\n\nnode-b slots=4\n"))
    assert (p.mode, p.nodes, p.procs_per_node) == ("ssh", 2, 4)
    assert (job.cluster.hosts, job.cluster.master_addr) == (["node-a", "node-b"], "node-a")
    job, p = plan("+cluster=ssh", "cluster.hosts=[a,b,c]", "cluster.nodes=2", "cluster.procs_per_node=1")
    assert (job.cluster.hosts, p.world_size) == (["a", "b"], 2)  # the first nodes hosts


@pytest.mark.parametrize(
    "text, overrides, message",
    [
        ("a\nb slots=x\n", [], "line 2: 'slots=x' is not understood; HINT: lines are 'HOST' or 'HOST slots=N'"),
        ("a cpus=2\n", [], "line 1: 'cpus=2' is not understood"),
        ("# nothing\n", [], "lists no host"),
        (
            "a slots=4\nb slots=2\n",
            [],
            "the hostfile's slots differ (a: 4, b: 2); every node runs the same number "
            "of ranks; HINT: set cluster.procs_per_node=2",
        ),
        ("a slots=2\nb\n", [], "the hostfile's slots differ (a: 2, b: none)"),
        ("a slots=2\n", ["cluster.procs_per_node=3"], "cluster.procs_per_node=3 but the hostfile gives a slots=2"),
        ("a\n", ["cluster.hosts=[b]"], "cluster.hosts and cluster.hostfile are both set"),
        ("-oProxyCommand=x\n", [], "cluster.hosts: '-oProxyCommand=x' is not a host name (ssh would read a leading"),
    ],
)
def test_ssh_hostfile_errors_name_the_line_and_fix(tmp_path, text, overrides, message):
    with pytest.raises(ConfigError) as info:
        plan("+cluster=ssh", hostfile(tmp_path, text), *overrides)
    assert message in str(info.value)


def test_ssh_forwards_the_launchers_variables_over_stdin_never_on_the_command_line(monkeypatch):
    """cluster.env's values (tokens, keys), cluster.setup's lines and the job's secret travel over the connection's
    stdin; only paths and device lists are on the remote command line (issues 35, 51)."""
    from launcher.config import SshClusterConfig
    from launcher.launch.ssh.clients import forwarded_env, handoff, remote_shell, setup_input
    from launcher.trust.secret import SECRET_ENV, Secret, read_handoff

    for name, value in {
        "LAUNCHER_FAULT": "step=5,rank=3",
        "NCCL_DEBUG": "INFO",
        "MY_TOKEN": "a b'c\nd",
        "HOME": "/x",
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "off",
        "WANDB_DIR": "/w",
        "PYTHONPATH": "/src lib",
        "LAUNCHER_SECRET": "ab" * 32,  # a by-hand user's: never forwarded (issue 34)
    }.items():
        monkeypatch.setenv(name, value)
    setup = ["source /v/bin/activate", "export HF_TOKEN=hf-probe"]
    c = SshClusterConfig(nodes=1, hosts=["a"], env=["MY_TOKEN", "WANDB_*"], setup=setup)
    env = forwarded_env(c)
    assert {"LAUNCHER_FAULT", "NCCL_DEBUG", "MY_TOKEN", "OMP_NUM_THREADS", "WANDB_MODE", "WANDB_DIR"} <= set(env)
    assert "HOME" not in env and "LAUNCHER_SECRET" not in env
    shell = remote_shell(c, ["/py", "-m", "x"])
    assert shell.splitlines()[-1] == "exec env PYTHONPATH='/src lib' /py -m x", shell
    assert "a b" not in shell and "ab" * 32 not in shell and "WANDB" not in shell and "step=5" not in shell
    assert "/v/bin" not in shell and "hf-probe" not in shell  # the setup comes over stdin (issue 51)
    assert '{ eval "$launcher_setup"; } </dev/null || exit 96' in shell  # the setup cannot read the secret line
    secret = Secret.new()
    line = handoff(c, secret)
    reader, writer = os.pipe()
    os.write(writer, line + b"INT\n")  # a control word after it stays in the stream
    lines = setup_input(c).encode()
    assert os.read(reader, len(lines)) == b"1\nsource /v/bin/activate && export HF_TOKEN=hf-probe\n"  # the shell's
    got = read_handoff(reader)
    assert os.read(reader, 100) == b"INT\n"
    os.close(reader), os.close(writer)
    assert got["MY_TOKEN"] == "a b'c\nd" and got["WANDB_DIR"] == "/w" and got["LAUNCHER_FAULT"] == "step=5,rank=3"
    assert "PYTHONPATH" not in got and Secret.from_environ(got, keep=True) is not None and got[SECRET_ENV] != "ab" * 32


def test_by_hand_default_run_dir_is_the_same_on_every_machine():
    """Each machine composes its own config: the default run dir must agree (one dir on a shared file system)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from launcher.config import register_configs, register_resolvers

    register_resolvers()
    register_configs()
    dirs = set()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        for node in (0, 1):
            by_hand = [
                f"cluster.node_rank={node}",
                "cluster.nodes=2",
                "cluster.master_addr=n0",
                "cluster.master_port=5",
            ]
            cfg = compose("config", overrides=by_hand, return_hydra_config=True)
            dirs.add(OmegaConf.select(cfg, "hydra.run.dir"))
    assert dirs == {"runs/nodes-n0-5"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("- a list\n", "holds no job (a YAML mapping of cluster, train, ...)"),
        ("cluster:\n  kind: k8s\n", "kind='k8s'"),
        ("cluster: null\n", "kind=None"),
    ],
)
def test_a_damaged_frozen_config_is_named_not_asserted(tmp_path, text, message):
    """A rank reads the job frozen into the run dir; an edited or damaged file is a ConfigError naming it."""
    from launcher.config import load_frozen

    (tmp_path / "config.yaml").write_text(text)
    with pytest.raises(ConfigError, match=rf"{tmp_path}/config.yaml.*{re.escape(message)}.*HINT: the launcher writes"):
        load_frozen(tmp_path)


def test_a_path_with_hydras_own_characters_reaches_the_job_whole():
    """Issue 60: the tests hand paths (a clone's, anywhere) to Hydra quoted (``harness.path_override``): a path with
    a space, ``,``, ``=``, ``(``, ``)`` or a quote arrives as it was."""
    from harness import path_override
    from harness.config import compose

    for path in ("/opt/my clone,v=2 (x)/tests/scripts/s.py", "/data/it's/s.py", "C:\\data\\s.py"):
        assert compose(path_override("script", path)).script == path
