"""On the ssh machines (issue 51): a job's files keep the user's umask although the machines' shells have their own,
and a ``cluster.setup`` line is on no command line. Slurm's case is in test_slurm.py (its cluster's fixtures); this
machine's and simulated nodes' in tests/jobs/test_file_modes.py.

The setup line comes from a config file (``--config-dir``, as a user keeps a cluster's settings), not the head's
own command line, so that no process of the job, the head included, may show it."""

import secrets as random_tokens

from harness.beds import HOSTS, needs_ssh_machines
from harness.modes import secrets_seen, umask, wrong_modes
from harness.probes import scanning_processes
from harness.run import run_launcher

pytestmark = needs_ssh_machines
JOB = ("cluster.procs_per_node=1", "train.max_steps=4", "train.checkpoint_every_steps=2", "train.log_every_steps=2")


def test_an_ssh_run_has_the_heads_umask_and_its_setup_lines_on_no_command_line(ssh_args, machines, tmp_path):
    """One ssh job, two promises. The ranks on both machines (rank 0 writes the checkpoints there, every rank its
    log and the watch's files) run under the head's umask, 077, not the one their machine's shell gives (022 on the
    test machines: a job that did not carry it would pass under 022; that the launcher is never tighter than 022:
    tests/jobs/test_file_modes.py). And a token exported by a ``cluster.setup`` line (where users put ``export
    HF_TOKEN=...``) is in the environment of every rank on both machines and on no process's command line there or
    here, ssh's included (a shared login node's ``ps`` shows them to every user)."""
    token, mask, run_dir = "setup-probe-" + random_tokens.token_hex(8), 0o077, tmp_path / "run"
    conf = tmp_path / "conf" / "cluster"
    conf.mkdir(parents=True)
    (conf / "probe_ssh.yaml").write_text(
        "defaults:\n  - ssh_schema\n  - _self_\n"
        f"hosts: [{', '.join(HOSTS)}]\n"
        f"ssh_options: [-F, {machines}/ssh_config]\n"
        f"setup:\n  - cd .\n  - export LAUNCHER_PROBE_TOKEN={token}\n"
    )
    with umask(mask), secrets_seen() as secrets, scanning_processes(token) as seen:
        args = (f"--config-dir={tmp_path / 'conf'}", "+cluster=probe_ssh", *JOB)
        out = run_launcher(*args, run_dir=run_dir, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert secrets, "no process of the job was seen with the job's secret in its environment"
    assert (run_dir / "logs" / "rank-1.log").exists() and sorted(run_dir.glob("checkpoints/step-*.pt"))
    wrong = wrong_modes(run_dir, mask, secrets)
    assert not wrong, "\n".join(wrong)
    assert not seen["argv"], seen["argv"]
    assert seen["ranks"] == {"0", "1"}, seen  # the setup ran before each machine's node process: its ranks have it
