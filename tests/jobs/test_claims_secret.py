"""The job's secret and the processes a rank starts (docs/security.md): a rank is handed the secret in its
environment and takes it out as it starts, so a program it starts (a user's subprocess, by exec) gets none of it,
on this machine and on simulated nodes (whose node processes keep it for their ranks)."""

import json

import pytest

from harness import path_override
from harness.run import run_launcher

# A script= rank: was it handed a secret (its environment at exec, /proc/self/environ), is it still in os.environ,
# and does the child it starts (by exec) see any of it, under any name, in its environment or on its command line?
SCRIPT = """import json, os, subprocess, sys

handed = [v for v in open("/proc/self/environ", "rb").read().split(b"\\0") if v.startswith(b"LAUNCHER_SECRET=")]
secret = handed[0].split(b"=", 1)[1] if handed else b""
child = subprocess.run(
    [sys.executable, "-c", "import sys; sys.stdout.buffer.write(open('/proc/self/environ', 'rb').read())"],
    capture_output=True, check=True,
)
seen = {
    "handed": len(secret) == 64,
    "in_os_environ": "LAUNCHER_SECRET" in os.environ,
    "child_environ": bool(secret) and secret in child.stdout,
    "child_names": b"LAUNCHER_SECRET" in child.stdout,
}
with open(os.path.join(sys.argv[1], f"rank-{os.environ['RANK']}.json"), "w") as f:
    json.dump(seen, f)
"""


@pytest.mark.parametrize("mode", [(), ("+cluster=sim", "cluster.procs_per_node=1")], ids=["local", "sim"])
def test_a_program_a_rank_starts_gets_no_secret(tmp_path, mode):
    script = tmp_path / "child_env_script.py"
    script.write_text(SCRIPT)
    out = tmp_path / "seen"
    out.mkdir()
    result = run_launcher(*mode, path_override("script", script), f"script_args=[{out}]", run_dir=tmp_path / "run")
    assert result.returncode == 0, result.stderr[-3000:]
    seen = [json.loads((out / f"rank-{rank}.json").read_text()) for rank in range(2)]
    expected = {"handed": True, "in_os_environ": False, "child_environ": False, "child_names": False}
    assert seen == [expected, expected], seen  # handed to each rank, taken out, never reaching its child
