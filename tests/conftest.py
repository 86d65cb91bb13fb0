import getpass
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

LINGER_S = 5.0  # a job's processes end with it; grace for the kernel to reap what was just killed


def processes_mentioning(text: str) -> list[str]:
    """``pid: command line`` of every live process whose command line holds ``text`` (a test's run dir)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{proc.name}: {cmdline[:160]}")
    return found


@pytest.fixture(autouse=True, scope="session")
def torch_cache_dir_removed():
    """torch 2.13 creates its compile cache dir (/tmp/torchinductor_USER) whenever an optimizer is built (it
    imports torch._dynamo), in every rank of every job: if the run made it, the run removes it. The path is
    computed as torch does, without importing torch._inductor (that import creates it)."""
    path = Path(
        os.environ.get("TORCHINDUCTOR_CACHE_DIR") or Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"
    )
    existed = path.exists()
    yield
    if not existed:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def nothing_of_the_job_remains(request):
    """After every test that used a tmp_path (every launcher run's run dir lives there): no process of the job
    (launcher, agents, ranks: their command lines name the run dir) is left, pass or fail."""
    yield
    tmp_path = request.node.funcargs.get("tmp_path")
    if tmp_path is None:
        return
    deadline = time.monotonic() + LINGER_S
    while (left := processes_mentioning(str(tmp_path))) and time.monotonic() < deadline:
        time.sleep(0.1)
    for line in left:  # the next test starts clean either way
        try:
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
        except OSError:
            pass
    assert not left, "processes of the job still running after the test:\n" + "\n".join(left)
