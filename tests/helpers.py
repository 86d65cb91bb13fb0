"""Shared test machinery: real processes, bounded by timeouts, so a hang fails fast."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from launcher.env import DistEnv
from launcher.exiting import end_process_at_exit
from launcher.rendezvous import process_group

REPO = Path(__file__).resolve().parent.parent
RANK_TIMEOUT_S = 120


def user_env(env: dict | None = None, drop: tuple[str, ...] = ()) -> dict[str, str]:
    """This environment as a user's shell has it (none of the launcher's or elastic's own variables, nor ``drop``'s
    prefixes), plus ``env``."""
    prefixes = ("LAUNCHER_", "TORCHELASTIC_", *drop)
    full = {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}
    full.update(env or {})
    return full


def launcher_argv(run_dir: Path, *args: str) -> list[str]:
    """``python -m launcher hydra.run.dir=<run_dir> args...``."""
    return [sys.executable, "-m", "launcher", f"hydra.run.dir={run_dir}", *args]


# the heal tests' job (test_sim, test_ssh; conftest.one_process_heal_job is its one-process reference): 20 steps,
# the trajectory check's span (float32 summation orders drift apart over hundreds), one thread per rank; the LR
# schedule of the 10 epochs (29 steps each), nearly constant over the 20: the drift the check's tolerance is set for
HEAL_SCHEDULE = "optim.schedule_steps=290"
HEAL_JOB = ("train.max_steps=20", "train.batch_size=48", "cluster.procs_per_node=1", "train.threads_per_rank=1")
HEAL_JOB += (HEAL_SCHEDULE,)


def start_head(run_dir: Path, *overrides: str, log: Path, env: dict | None = None) -> subprocess.Popen:
    """``python -m launcher`` in the background, in its own process group (as a shell gives a foreground job),
    stderr to ``log``."""
    with open(log, "w") as stderr:
        return subprocess.Popen(
            launcher_argv(run_dir, *overrides), cwd=REPO, env=user_env(env), stdout=subprocess.DEVNULL,
            stderr=stderr, start_new_session=True,
        )  # fmt: skip


def wait_first_checkpoint(head: subprocess.Popen, run_dir: Path, log: Path, timeout: float = 120) -> list[Path]:
    """Until the job wrote a checkpoint (the head must still run); the checkpoints then."""
    deadline = time.monotonic() + timeout
    while not list(run_dir.glob("checkpoints/step-*.pt")):
        assert head.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    return sorted(run_dir.glob("checkpoints/step-*.pt"))


def run_launcher(
    *overrides: str,
    run_dir: Path,
    timeout: float = 240,
    env: dict | None = None,
    module: tuple[str, ...] = ("-m", "launcher"),
) -> subprocess.CompletedProcess:
    """``python -m launcher hydra.run.dir=<run_dir> overrides...`` as a user would type it."""
    full_env = user_env(env)
    flags = [o for o in overrides if o.startswith("-")]  # e.g. -m: Hydra wants flags before overrides
    rest = [o for o in overrides if not o.startswith("-")]
    return subprocess.run(
        [sys.executable, *module, *flags, f"hydra.run.dir={run_dir}", *rest],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _rank_main(
    fn: Callable, rank: int, world: int, store_path: str, out_dir: str, args: tuple, environ: dict, cwd: str
) -> None:
    os.environ.clear()  # the test's environment and directory now, as a spawned process would have them (the
    os.environ.update(environ)  # fork server's are those of its own start)
    os.chdir(cwd)
    env = DistEnv(rank=rank, local_rank=rank, world_size=world, local_world_size=world)
    try:
        store = dist.FileStore(store_path, world)
        with process_group(env, "gloo", timeout_s=60, store=store):
            fn(rank, world, Path(out_dir), *args)
    except BaseException:
        Path(out_dir, f"error-{rank}.txt").write_text(traceback.format_exc())
        raise
    end_process_at_exit(0)  # as the launcher's workers do (see its docstring)


# What every rank of ``spawn_ranks`` imports: loaded once by the fork server, not by each rank (torch and the
# torch._dynamo any optimizer imports cost a rank ~4 s of CPU here, more than most tests' own work)
RANK_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel", "launcher.comm.reducer", "helpers"]


def _rank_context() -> Any:
    """multiprocessing's fork server, one per test process: each rank is forked from a process that imported
    ``RANK_PRELOAD`` and nothing else (no thread, no process group: fork-safe), in milliseconds."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(RANK_PRELOAD)
    return ctx


def spawn_ranks(fn: Callable, world: int, tmp_path: Path, *args: Any, timeout: float = RANK_TIMEOUT_S) -> None:
    """Run module-level ``fn(rank, world, out_dir, *args)`` on ``world`` real gloo ranks (FileStore, no ports).
    Fails with the failing rank's traceback; kills every rank if any is still running after ``timeout``."""
    ctx = _rank_context()
    store = tmp_path / "filestore"
    common = (str(store), str(tmp_path), args, dict(os.environ), os.getcwd())
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world, *common)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errors = {
        r: (tmp_path / f"error-{r}.txt").read_text() for r in range(world) if (tmp_path / f"error-{r}.txt").exists()
    }
    if errors:
        raise AssertionError("\n".join(f"rank {r} failed:\n{tb}" for r, tb in errors.items()))
    assert not hung, f"ranks {hung} still running after {timeout}s"
    codes = [p.exitcode for p in procs]
    assert codes == [0] * world, f"exit codes {codes}"


def compose(*overrides: str, run_dir: Path | None = None):
    """The job config exactly as ``python -m launcher overrides...`` composes it (Hydra compose API)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from launcher.config import register_configs, register_resolvers

    register_resolvers()
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return hydra_compose("config", overrides=[f"run_dir={run_dir or '.'}", *overrides])


def plan(*overrides: str, run_dir: Path | None = None, gpus_visible: int = 0, environ: dict | None = None):
    """(JobConfig, LaunchPlan) for ``overrides`` on a machine with ``gpus_visible`` GPUs."""
    from launcher.launch.plan import plan_job

    job, launch_plan, _ = plan_job(compose(*overrides, run_dir=run_dir), DistEnv.resolve(environ or {}), gpus_visible)
    return job, launch_plan


@contextlib.contextmanager
def in_background(work: Callable[[], None], done: threading.Event) -> Iterator[None]:
    """``work`` in a daemon thread while the block runs; then ``done`` is set and the thread joined."""
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=10)


@contextlib.contextmanager
def scanning_processes(needle: str) -> Iterator[dict[str, set[str]]]:
    """While the block runs, every process's command line and environment on this host (the ssh test machines' and
    simulated nodes' processes too: one kernel) are read every 50 ms. Yields what was found: ``argv``, the
    command lines holding ``needle`` (must stay empty for a secret); ``ranks``, the RANK of each process whose
    environment holds it (the value reached the ranks)."""
    found: dict[str, set[str]] = {"argv": set(), "ranks": set()}
    done, wanted = threading.Event(), needle.encode()

    def scan() -> None:
        while not done.wait(0.05):
            for proc in Path("/proc").iterdir():
                if not proc.name.isdigit():
                    continue
                try:
                    argv = (proc / "cmdline").read_bytes()
                    if wanted in argv:
                        found["argv"].add(argv.replace(b"\0", b" ").decode(errors="replace")[:200])
                    environ = (proc / "environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                if any(wanted in v for v in environ):
                    found["ranks"].update(v[5:].decode() for v in environ if v.startswith(b"RANK="))

    with in_background(scan, done):
        yield found


@contextlib.contextmanager
def stranger_writing(into: str = "launcher.heal.keeper") -> Iterator[list[str]]:
    """A process without the job's secret that writes into a running healing job's keeper store for as long as the
    block runs, as in issue 34: it finds the keeper's port on its command line and writes forged decisions (the job
    stops), heartbeats and readiness marks at the plain key names; and, having read the secret's namespace (as a
    stranger who guessed it), decisions and readiness marks at the job's real keys, signed with another secret (not
    the live heartbeats: overwritten, a real value is gone, which no store without access control prevents; the
    keeper's test forges those). Yields what it wrote, and "argv of PID" for any process whose command line holds
    the job's secret."""
    from datetime import timedelta

    import torch.distributed as dist

    from launcher.heal.protocol import Decision, Keys, node_id
    from launcher.rendezvous import attempt_prefix
    from launcher.secret import SECRET_ENV, Secret
    from launcher.signed import SignedStore

    done, wrote = threading.Event(), []

    def keeper() -> tuple[str, int, Secret] | None:
        for proc in Path("/proc").iterdir():
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
                if into.encode() in argv:
                    at = argv.index(into.encode())
                    environ = dict(
                        line.split("=", 1) for line in (proc / "environ").read_text().split("\0") if "=" in line
                    )
                    return argv[at + 1].decode(), int(argv[at + 2]), Secret.from_hex(environ[SECRET_ENV])
            except (OSError, ValueError, IndexError, KeyError):
                continue
        return None

    def run() -> None:
        while (found := keeper()) is None and not done.wait(0.1):
            pass
        if found is None:
            return
        addr, port, secret = found
        client = None
        while client is None and not done.is_set():  # the keeper's store listens once it started (seconds, loaded)
            with contextlib.suppress(RuntimeError):  # (DistNetworkError: not listening yet)
                wait = timedelta(seconds=5)
                client = dist.TCPStore(addr, port, is_master=False, timeout=wait, wait_for_workers=False)
        if client is None:
            return
        plain = dist.PrefixStore(attempt_prefix(0), client)
        guessed = SignedStore(client, Secret.new(), attempt_prefix(0))
        guessed._root = SignedStore(client, secret, attempt_prefix(0))._root  # the namespace, not the key
        stop = Decision(round=1, members=("node-0",), before=("node-0",), stop="forged by a stranger").to_bytes()
        for store in (plain, guessed):  # decisions once (a later one would hide the keeper's own from late readers)
            for number in range(3):
                store.set(Keys.round_end(number), stop)
        wrote.append("decisions")
        secret_hex = secret.environ()[SECRET_ENV].encode()
        while not done.wait(0.5):
            with contextlib.suppress(RuntimeError):
                for name in ("node-0", "node-1", "node-2"):
                    plain.set(Keys.heartbeat(node_id(name, 0)), b"1")
                    for store in (plain, guessed):  # (a real key a stranger overwrites loses its real value)
                        store.set(Keys.ready(node_id(name, 1), 0), b"1")
                wrote.append("beats")
            for proc in Path("/proc").iterdir():  # the secret is on no command line (issue 34)
                with contextlib.suppress(OSError):
                    if proc.name.isdigit() and secret_hex in (proc / "cmdline").read_bytes():
                        wrote.append(f"argv of {proc.name}")

    with in_background(run, done):
        yield wrote
