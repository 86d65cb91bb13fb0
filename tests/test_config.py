"""Bad input is refused before any process starts: exit code 2, the value and the fix named, no traceback."""

import pytest

from helpers import plan, run_launcher
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
    (["cluster.nodes=2"], "HINT: +cluster=sim to simulate nodes here"),
    (["model._target_=no.such.Net"], "model._target_='no.such.Net' cannot be imported"),
    (["data=idx"], "data.path=None is not a directory; HINT: data=idx data.path="),
    (["optim.lr=0"], "optim.lr=0.0 must be > 0"),
    (["comm.reducer=horovod"], "comm.reducer='horovod'; HINT: ddp or bucketed"),
    (["train.resume=/nope.pt"], "train.resume='/nope.pt' is not a checkpoint file"),
]


@pytest.mark.parametrize("overrides, message", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_validation_message(overrides, message):
    with pytest.raises(ConfigError) as info:
        plan(*overrides)
    assert message in str(info.value)


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


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["cluster.nodes=0"], "launcher: error: cluster.nodes=0 must be >= 1"),
        (["model=nope"], "Could not find 'model/nope'"),
        (["data=nope"], "Could not find 'data/nope'"),
        (["train.epoch=3"], "Key 'epoch' not in 'TrainConfig'"),
        (["script=missing.py"], "launcher: error: script='missing.py' does not exist"),
    ],
)
def test_cli_exit_code_2_and_nothing_started(tmp_path, overrides, message):
    run_dir = tmp_path / "run"
    result = run_launcher(*overrides, run_dir=run_dir, timeout=60)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert not (run_dir / "logs").exists() and not (run_dir / "config.yaml").exists()


def test_dry_run_prints_plan_and_starts_nothing(tmp_path):
    result = run_launcher("dry_run=true", "cluster.procs_per_node=4", run_dir=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "layout      : 1 node(s) x 4 rank(s) = world size 4" in result.stdout
    assert "_target_: models.lenet.LeNet" in result.stdout
    assert not (tmp_path / "logs").exists() and not (tmp_path / "config.yaml").exists()
