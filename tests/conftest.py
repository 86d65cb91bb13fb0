import atexit
import gc
import getpass
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# The suite runs three jobs at once on two cores: OpenMP's idle threads would spin (libgomp's default) on the cores
# the other jobs need; passive waiting took a one-rank job from 20 to 12 CPU seconds beside a busy core. Every
# process the tests start inherits it (before torch is imported here: libgomp reads it once).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(TESTS))  # ``import harness`` from any test module, tier or fork server (tests/README.md)

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


def torch_cache_dir() -> Path:
    """torch 2.13 creates its compile cache dir (/tmp/torchinductor_USER) whenever an optimizer is built (it
    imports torch._dynamo), in every rank of every job: if the run made it, the run removes it. The path is
    computed as torch does, without importing torch._inductor (that import creates it)."""
    return Path(
        os.environ.get("TORCHINDUCTOR_CACHE_DIR") or Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"
    )


SYSTEM_TEMP_ENV, PRIVATE_TEMP_ENV = "LAUNCHER_TESTS_SYSTEM_TMP", "LAUNCHER_TESTS_TMP"
_made_temp: list[Path] = []  # the session's temp dir, made by this process


def _remove_made_temp() -> None:
    for path in _made_temp:
        shutil.rmtree(path, ignore_errors=True)


# Registered at import, before torch imports multiprocessing: atexit runs it last, after multiprocessing's own
# finalizers have removed their pymp-* dirs inside it (its leftovers were named: ``new_in_temp``).
atexit.register(_remove_made_temp)


def pytest_configure(config):
    """The session's own temp dir (the controller makes it, the workers and every job inherit it as ``TMPDIR``):
    what the tests leave there is theirs alone, whatever other programs write to the system's meanwhile (pytest's
    base temp dir stays in the system's, kept for the last runs)."""
    os.chdir(TESTS.parent)  # the repository's root, wherever pytest was started (its paths are written from there)
    if PRIVATE_TEMP_ENV not in os.environ:
        system = tempfile.gettempdir()
        os.environ[SYSTEM_TEMP_ENV] = system
        os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", system)
        os.environ["TMPDIR"] = os.environ[PRIVATE_TEMP_ENV] = tempfile.mkdtemp(prefix="launcher-tests-", dir=system)
        tempfile.tempdir = None  # (computed again from TMPDIR)
        _made_temp.append(Path(os.environ[PRIVATE_TEMP_ENV]))
    config.torch_cache_existed = torch_cache_dir().exists()  # (xdist: each worker, and the controller first)


def pytest_unconfigure(config):
    """After every worker (xdist's controller ends last): a worker that found the dir made by another left it."""
    if not getattr(config, "torch_cache_existed", True):
        shutil.rmtree(torch_cache_dir(), ignore_errors=True)


BEDS_ENV = "LAUNCHER_REQUIRE_BEDS"  # .ci/run sets it: a test skipped for a missing bed fails instead
MAY_SKIP = ("no CUDA device",)  # the only skip the suite chooses (tests/README.md): GPUs are lent by chance
HOW_TO_RUN = (
    "as root with iproute2, openssh-server and Slurm 22.05 (slurm/README.md installs them; scripts/ssh-hosts/ "
    "starts the ssh machines) the suite runs every bed, as CI does"
)


def held_to_the_beds(report, what: str = "this test") -> None:
    """A skip for a missing test bed (root, network namespaces, the local Slurm, sshd, a bare python, a package)
    fails under ``LAUNCHER_REQUIRE_BEDS=1`` (CI: no area may go untested and green); elsewhere it says how to run
    it. Only ``MAY_SKIP``'s skips stay skips."""
    if not report.skipped or not isinstance(report.longrepr, tuple):
        return
    path, line, reason = report.longrepr
    reason = reason.removeprefix("Skipped: ")
    if any(allowed in reason for allowed in MAY_SKIP):
        return
    if os.environ.get(BEDS_ENV) == "1":
        report.outcome = "failed"
        report.longrepr = f"{BEDS_ENV}=1: {what} would be skipped ({reason}): its bed is missing on this machine"
    elif "HINT:" not in reason:
        report.longrepr = (path, line, f"{reason}; HINT: {HOW_TO_RUN}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test's skip, at its setup or in its body (``held_to_the_beds``)."""
    outcome = yield
    held_to_the_beds(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A skip while collecting (a module-level ``pytest.importorskip`` or ``pytest.skip(allow_module_level=True)``):
    every test of the module, which never become items (``held_to_the_beds``; under ``LAUNCHER_REQUIRE_BEDS=1`` a
    collection error)."""
    outcome = yield
    report = outcome.get_result()
    held_to_the_beds(report, f"every test of {report.nodeid}")


@pytest.hookimpl(tryfirst=True)
def pytest_generate_tests(metafunc):
    """tests/beds/test_slurm.py runs on two local Slurm clusters (its ``slurm`` fixture: one-host, then netns); a
    test its ``NETNS_TOO`` does not name is generated for the one-host cluster alone (the netns one's 100 s requeue
    would overrun the suite's time), rather than generated and skipped there: only ``MAY_SKIP`` may skip. (Before
    the fixtures' own parametrization: a test's parametrize mark takes precedence over the fixture's params.)"""
    netns_too = getattr(metafunc.module, "NETNS_TOO", None)
    if netns_too is not None and "slurm" in metafunc.fixturenames and metafunc.function.__name__ not in netns_too:
        metafunc.definition.add_marker(pytest.mark.parametrize("slurm", ["one-host"], indirect=True), append=False)


HEADS = "tests/harness/heads.py"  # (its command line)


def descendants(pid: int) -> list[str]:
    """``pid: command line`` of every live process below ``pid``, the long-lived helpers aside (multiprocessing's
    resource tracker, the fork server of ``harness.ranks.spawn_ranks`` and harness.heads' server of preloaded
    heads live as long as the test process; the ranks and heads forked from them count); zombies are not running."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            state, ppid = (proc / "stat").read_text().rpartition(")")[2].split()[:2]
        except (OSError, ValueError):
            continue
        if state != "Z":
            children.setdefault(int(ppid), []).append(int(proc.name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        todo += children.get(child, [])
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        helper = any(h in cmdline for h in ("multiprocessing.resource_tracker", "multiprocessing.forkserver", HEADS))
        if not (helper and child in children.get(pid, [])):  # the fork server's own children (ranks) count
            found.append(f"{child}: {cmdline[:160]}")
    return found


def nothing_left(find: Callable[[], list[str]], what: str) -> None:
    """Wait up to LINGER_S for ``find()`` to come back empty; kill what is left (the next test starts clean
    either way) and fail naming it."""
    deadline = time.monotonic() + LINGER_S
    while (left := find()) and time.monotonic() < deadline:
        time.sleep(0.1)
    for line in left:
        try:
            os.kill(int(line.split(":")[0]), signal.SIGKILL)
        except OSError:
            pass
    assert not left, f"processes still running after {what}:\n" + "\n".join(left)


@pytest.fixture(autouse=True)
def nothing_of_the_job_remains(request):
    """After every test that used a tmp_path (every launcher run's run dir lives there): no process of the job
    (launcher, agents, ranks: their command lines name the run dir) is left, pass or fail; and ``sys.path`` as it
    was (a fork server started later carries it on its command line: a test's folder there reads as its leftover)."""
    path = list(sys.path)
    yield
    assert sys.path == path, f"the test changed sys.path (monkeypatch.setattr(sys, 'path', ...)): {sys.path[:3]}"
    tmp_path = request.node.funcargs.get("tmp_path")
    if tmp_path is not None:
        nothing_left(lambda: processes_mentioning(str(tmp_path)), "the test")


@pytest.fixture(autouse=True, scope="module")
def nothing_of_the_module_remains(request, tmp_path_factory):
    """After a test module, once its module fixtures are torn down (ranks a fixture spawned once for several tests,
    the ssh machines' sshd and what ran on them): no process started under the session's temporary directory, no
    process of this one's is left, and nothing new in the temp dir (with one pytest process; under pytest-xdist
    the other worker's modules write there meanwhile: the controller checks the whole session instead)."""
    temp = Path(tempfile.gettempdir())
    before = {p.name for p in temp.iterdir()}
    yield
    base = str(tmp_path_factory.getbasetemp()) + os.sep  # not a later run's pytest-NN when this one is pytest-N
    nothing_left(lambda: sorted({*processes_mentioning(base), *descendants(os.getpid())}), "the module")
    if not hasattr(request.config, "workerinput"):
        new_in_temp(temp, before, tmp_path_factory.getbasetemp())


# The test beds are one per host each: the network namespaces of simulated nodes (named per job, but the doctor's
# slow-link tests shape links with tc), the ssh machines (vm1, vm2 on their bridge) and the local Slurm (its daemons,
# its /etc/hosts lines). Under pytest-xdist (`-n 3 --dist loadgroup`, scripts/test.sh) the modules that use one bed
# run one after another on one worker; the three beds share nothing, so they run beside each other, and every other
# module runs whole on one worker (its module fixtures once).
BED_OF_MODULE = {
    "test_sim": "bed-netns",
    "test_heal_loop": "bed-netns",  # (simulated nodes: one after another with the others)
    "test_watch": "bed-netns",
    "test_slurm": "bed-slurm",
    "test_ssh": "bed-ssh",
    "test_hang_clusters": "bed-ssh",
    "test_signals_ssh": "bed-ssh",
}


# The suite's four tiers, one folder each (tests/README.md); each test is marked with its folder's name, so that
# `pytest -m "rules or ranks"` selects what `pytest tests/rules tests/ranks` runs.
TIERS = ("rules", "ranks", "jobs", "beds")


def tier_of(path: Path) -> str | None:
    """The tier of a test file: the folder under tests/ it sits in (None outside the four)."""
    try:
        folder = path.resolve().relative_to(TESTS).parts[0]
    except (ValueError, IndexError):
        return None
    return folder if folder in TIERS else None


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the marks (its loadgroup)
def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__ if item.module else "?"
        item.add_marker(pytest.mark.xdist_group(BED_OF_MODULE.get(module, module)))
        if tier := tier_of(item.path):
            item.add_marker(getattr(pytest.mark, tier))


def pytest_collection_finish(session):
    gc.freeze()  # the modules collected live as long as the process: full collections walk what the tests made only


def pytest_sessionstart(session):
    session.config.temp_before = {p.name for p in Path(tempfile.gettempdir()).iterdir()}
    session.config.system_before = {p.name for p in Path(os.environ[SYSTEM_TEMP_ENV]).iterdir()}


def pytest_sessionfinish(session, exitstatus):
    """Under pytest-xdist, the controller: nothing new in the temp dir after the whole session (pytest's base temp
    dirs aside); the session fails naming what was left."""
    xdist = getattr(session.config.option, "numprocesses", None) and not hasattr(session.config, "workerinput")
    if xdist:
        system, private = Path(os.environ[SYSTEM_TEMP_ENV]), Path(tempfile.gettempdir())
        try:
            new_in_temp(private, session.config.temp_before, Path("/"))
            # what escaped it (a fixed path, an ssh machine's process): only ours, another program's is not looked at
            new_in_temp(system, session.config.system_before | {private.name}, Path("/"), only_ours=True)
        except AssertionError as exc:
            print(f"\n{exc}", file=sys.stderr)
            session.exitstatus = 1


OWN_TEMP = ("pytest-of-", "torchinductor_", "pymp-")  # pytest's base temp dir (it keeps the last runs); torch's cache
# dir is removed once at the end of the session (torch_cache_dir_removed); multiprocessing's (the fork server's socket,
# harness.ranks.spawn_ranks) goes with the test process that made it
OURS = ("torchelastic_", "launcher-")  # what a job or a test of ours makes there: removed when left


def new_in_temp(temp: Path, before: set[str], basetemp: Path, only_ours: bool = False) -> None:
    """No entry the module's jobs made in the temp dir survives it (e.g. torch elastic's ``torchelastic_*`` log
    dirs when no log dir is given): the module fails naming each one; ours are removed (another program's entry
    that appeared meanwhile is named, never touched; ``only_ours``: not even looked at)."""
    own = {basetemp.name} if basetemp.parent == temp else set()
    left = sorted(p for p in temp.iterdir() if p.name not in before | own and not p.name.startswith(OWN_TEMP))
    left = [p for p in left if p.name.startswith(OURS)] if only_ours else left
    for path in left:
        if path.name.startswith(OURS) and path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
    assert not left, f"left in {temp} by the module's jobs: " + ", ".join(p.name for p in left)
