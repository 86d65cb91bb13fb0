"""Issue 50 (item 3): ``python -m launcher export RUN_DIR [--step N] OUT`` writes the model alone, one state dict
that the model class loads with ``torch.load(OUT, weights_only=True)`` (or safetensors'), from a replicated job's
``step-N.pt`` and from a sharded job's directory of DCP shards, in one process without a process group. The
exported model computes what the checkpoint's own model computes: the ``.pt``'s ``model`` for a replicated job;
torch's own converter (``dcp_to_torch_save``) and the replicated run of the same seed for a sharded one. The line of
Python the command prints is run as printed. Refusals name what exists and the fix."""

import os
import pickle
import re
import shutil
import subprocess
import sys

import pytest
import torch
from hydra.utils import instantiate
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from harness import REPO
from harness.run import run_launcher
from launcher.base.checkpoint_names import checkpoint_path, sharded_path
from launcher.commands.export import export_command
from launcher.config import load_frozen
from launcher.train import checkpoint as ckpt

pytestmark = pytest.mark.slow
JOB = ("cluster.procs_per_node=2", "train.max_steps=6", "train.checkpoint_every_steps=3", "train.threads_per_rank=1")


@pytest.fixture(scope="module")
def replicated(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("replicated")
    result = run_launcher(*JOB, run_dir=run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("sharded")
    result = run_launcher(*JOB, "comm.reducer=fsdp", run_dir=run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def export(*args):
    """``python -m launcher export ...`` as a user types it, from the repository root."""
    argv = [sys.executable, "-m", "launcher", "export", *map(str, args)]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)


def loaded(result):
    """The model the printed line of Python builds and loads, run as printed."""
    assert result.returncode == 0, result.stderr[-3000:]
    line = result.stdout.splitlines()[-1]
    scope = {}
    exec(line, scope)  # noqa: S102 - the command's own output, what the user is told to run
    return scope["model"].eval()


def rebuilt(run_dir, state):
    """The run's model class from its config, with ``state`` loaded: the reference the outputs are compared to."""
    model = instantiate(load_frozen(run_dir).model)
    model.load_state_dict(state)
    return model.eval()


@torch.no_grad()
def outputs(model):
    return model(torch.randn(16, 1, 28, 28, generator=torch.Generator().manual_seed(0)))


def test_a_replicated_checkpoint_exports_the_model_alone(replicated, tmp_path):
    out = tmp_path / "model.pt"
    result = export(replicated, out)
    newest = checkpoint_path(replicated / "checkpoints", 6)
    assert re.match(
        rf"exported {re.escape(str(out))} \(torch.save, {out.stat().st_size:,} bytes\): the model at step 6, "
        rf"8 tensors, 129,068 parameters \(buffers included\), from {re.escape(str(newest))}\nload it with:\n",
        result.stdout,
    ), result.stdout
    saved = torch.load(out, weights_only=True)
    reference = rebuilt(replicated, ckpt.read(newest)["model"])
    assert list(saved) == list(reference.state_dict()) and all(type(t) is torch.Tensor for t in saved.values())
    assert torch.equal(outputs(loaded(result)), outputs(reference))

    earlier = export(replicated, "--step", 3, tmp_path / "step3.pt")  # not the newest: the one asked for
    step3 = rebuilt(replicated, ckpt.read(checkpoint_path(replicated / "checkpoints", 3))["model"])
    assert torch.equal(outputs(loaded(earlier)), outputs(step3))
    assert not torch.equal(outputs(step3), outputs(reference))


def test_a_sharded_checkpoint_exports_whole_in_one_process(sharded, replicated, tmp_path):
    """Every rank's shards assembled, the optimiser left out; equal to torch's own conversion of the directory and,
    to float32's summation order, to the replicated run of the same seed (fsdp and ddp train the same weights)."""
    directory = sharded_path(sharded / "checkpoints", 6)
    dcp_to_torch_save(directory, tmp_path / "torch.pt")
    reference = rebuilt(sharded, torch.load(tmp_path / "torch.pt", weights_only=False)["model"])
    for name in ("model.pt", "model.safetensors"):
        result = export(sharded, tmp_path / name)
        assert f"from {directory}\n" in result.stdout and ("safetensors" in name) == ("load_file" in result.stdout)
        assert torch.equal(outputs(loaded(result)), outputs(reference)), name
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    assert list(saved) == list(reference.state_dict()) and all(type(t) is torch.Tensor for t in saved.values())
    ddp = rebuilt(replicated, ckpt.read(checkpoint_path(replicated / "checkpoints", 6))["model"])
    torch.testing.assert_close(outputs(loaded(result)), outputs(ddp), rtol=1e-4, atol=1e-5)


def test_refusals_name_what_exists_and_the_fix(replicated, tmp_path, capsys, monkeypatch):
    def refused(*args):
        assert export_command([str(a) for a in args]) == 2
        return capsys.readouterr().err

    out = tmp_path / "out.pt"
    assert f"{replicated / 'checkpoints'} has no checkpoint at step 4, only at 3, 6; HINT: --step" in refused(
        replicated, "--step", 4, out
    )
    assert f"no run dir {replicated}x; {replicated.parent} holds the run dirs " in refused(f"{replicated}x", out)
    assert f"{tmp_path} holds no complete checkpoint" in refused(tmp_path, out)
    assert "usage: python -m launcher export RUN_DIR [--step N] OUT" in refused(replicated)
    monkeypatch.setitem(sys.modules, "safetensors", None)  # (an import of it fails: not installed)
    assert "the safetensors package is not installed; HINT: pip install safetensors, or name OUT .pt" in refused(
        replicated, tmp_path / "out.safetensors"
    )
    assert sorted(tmp_path.iterdir()) == []  # nothing written


def test_nothing_unverified_is_unpickled(replicated, sharded, tmp_path, capsys):
    """A ``.pt`` whose bytes differ from its sha256 is refused, and a DCP index that would build anything but DCP's
    own classes is never unpickled (DCP's own reader would run what it names)."""
    copy = shutil.copytree(replicated, tmp_path / "replicated")
    with open(checkpoint_path(copy / "checkpoints", 6), "r+b") as f:
        f.seek(200)
        f.write(b"\0" * 8)
    assert export_command([str(copy), str(tmp_path / "a.pt")]) == 2
    assert "step-00000006.pt is corrupted (sha256 differs" in capsys.readouterr().err

    copy = shutil.copytree(sharded, tmp_path / "sharded")
    (sharded_path(copy / "checkpoints", 6) / ".metadata").write_bytes(pickle.dumps(Ran()))
    assert export_command([str(copy), str(tmp_path / "b.pt")]) == 2
    assert f"refused to build {__name__}.ran: not part of DCP's index" in capsys.readouterr().err
    assert RAN == [] and not (tmp_path / "b.pt").exists()


RAN = []


def ran(what):
    RAN.append(what)


class Ran:
    def __reduce__(self):  # unpickled, it would call ran("the index's code")
        return ran, ("the index's code",)


def test_help_lists_export():
    help_text = subprocess.run([sys.executable, "-m", "launcher", "--help"], cwd=REPO, capture_output=True, text=True)
    assert "python -m launcher export RUN_DIR OUT" in help_text.stdout, help_text.stdout


def test_no_command_ends_in_a_traceback_on_a_closed_pipe(replicated, tmp_path):
    """Issue 60, item 6 (edge 8): ``python -m launcher export RUN OUT | head -1`` ended in a BrokenPipeError
    traceback (``--cfg job | head``: Hydra's, from inside its ``run_and_report``, and exit 2). Each command that prints
    meets a pipe whose reader has gone before it writes: it runs to its end (the model is exported), exit 0, and
    says nothing on stderr."""
    commands = {
        "export": ["export", replicated, tmp_path / "model.pt"],
        "plot": ["plot", replicated],
        "help": ["--help"],
        "cfg": ["--cfg", "job", f"hydra.run.dir={tmp_path / 'cfg'}"],
    }
    read, write = os.pipe()
    os.close(read)  # (head -1 has had its line)
    try:
        procs = {
            name: subprocess.Popen(
                [sys.executable, "-m", "launcher", *map(str, args)], cwd=REPO, stdout=write, stderr=subprocess.PIPE
            )
            for name, args in commands.items()
        }
    finally:
        os.close(write)
    ended = {name: (proc.wait(timeout=120), proc.stderr.read().decode()) for name, proc in procs.items()}
    assert ended == {name: (0, "") for name in commands}, ended
    assert (tmp_path / "model.pt").is_file()
