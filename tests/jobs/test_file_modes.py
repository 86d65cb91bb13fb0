"""Never looser than the user's umask (issue 51): a short job under umask 077 (private, as on many shared login
nodes) and under 022, on this machine and on simulated nodes: every file and folder of its run dir (config, logs,
checkpoints, metrics, trace, the watch's files, Hydra's) has the mode the umask gives, never writable by others; a
file holding the job's secret would be 0600 (none does here: the secret travels in environments, which
``secrets_seen`` reads to look for it). The ssh machines and Slurm:
tests/beds/test_ssh.py::test_two_machines_train_the_default_job,
tests/beds/test_slurm.py::test_two_nodes_two_tasks_train."""

import pytest

from harness.modes import secrets_seen, umask, wrong_modes
from harness.run import LAUNCHER, run_launcher

MODES = {
    "local": ("cluster.procs_per_node=2",),
    "sim": ("+cluster=sim", "cluster.nodes=2", "cluster.procs_per_node=1"),
    "torchrun": (),
}
TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
JOB = (
    "train.max_steps=4",
    "train.checkpoint_every_steps=2",
    "train.log_every_steps=2",
    "comm.trace=true",
    "comm.trace_steps=1",
)


# every mode under 077 (private: what a mode that forced a mode of its own would break); 022 (the team reads) once
@pytest.mark.parametrize(
    "mode, mask",
    [(mode, 0o077) for mode in MODES] + [("local", 0o022)],
    ids=[*(f"{m}-077" for m in MODES), "local-022"],
)
def test_every_file_of_a_run_has_the_users_umask(tmp_path, mode, mask):
    run_dir = tmp_path / "run"
    # (torchrun's --log-dir: by default a torchelastic_* folder in the temp dir)
    module = (*TORCHRUN, f"--log-dir={tmp_path}/torchrun", "-m", "launcher") if mode == "torchrun" else LAUNCHER
    with umask(mask), secrets_seen() as secrets:
        out = run_launcher(*MODES[mode], *JOB, run_dir=run_dir, module=module)
    assert out.returncode == 0, out.stderr[-3000:]
    assert secrets or mode == "torchrun", "no process of the job was seen with the job's secret in its environment"
    assert sorted(run_dir.glob("checkpoints/step-*.pt")), "the job wrote no checkpoint"
    wrong = wrong_modes(run_dir, mask, secrets)
    assert not wrong, "\n".join(wrong)
