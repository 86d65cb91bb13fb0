"""``python -m launcher``: one Hydra config, three ways to run it.

Train the default job (LeNet on the bundled digits, 2 gloo ranks on CPU, nccl with one rank per GPU)::

    python -m launcher
    python -m launcher model=resnet18 train.epochs=3 cluster.procs_per_node=4
    python -m launcher train.batch_size_per_rank=32 optim.lr_scaling=linear
    python -m launcher dry_run=true                      # print the resolved config and plan, start nothing
    python -m launcher script=train.py script_args=[--lr,0.1]   # any torchrun-compatible script

Under torchrun (no second spawn; torchrun's world decides the layout)::

    torchrun --standalone --nproc_per_node=2 -m launcher train.epochs=2

Resume: runs resume from the newest checkpoint in their run dir (``train.resume=auto``)::

    python -m launcher hydra.run.dir=runs/exp1      # run again with the same dir to continue

Simulated nodes and Slurm::

    python -m launcher +cluster=sim cluster.procs_per_node=2 [cluster.netns=true cluster.link_gbit=1]
    python -m launcher +cluster=slurm cluster.nodes=2 cluster.procs_per_node=4 cluster.partition=gpu
    python -m launcher -m +cluster=slurm optim.lr=0.1,0.05          # a sweep: one job per point

Watch and check::

    python -m launcher plot RUN_DIR                      # RUN_DIR/plots/curves.png (also written at the end)
    python -m launcher export RUN_DIR [--step N] OUT     # the model alone: one state_dict file (or .safetensors)
    python -m launcher doctor [cluster overrides]        # reachability, interfaces, GPUs, per-link allreduce times
    python -m launcher comm.trace=true                   # RUN_DIR/trace.json: Chrome/Perfetto timeline of a few steps

Exit codes: 0 every rank finished; 1 a rank failed (named on stderr); 2 bad configuration (nothing started); 130 /
143 / 129 stopped by Ctrl-C / SIGTERM / SIGHUP (the trainer checkpoints; a ``script=`` gets the signal to save).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, open_dict

from launcher.base.devices import gpu_count
from launcher.base.env import DistEnv
from launcher.base.exiting import end_process_at_exit, exit_code, settle_exit_code
from launcher.base.files import no_world_writable_files
from launcher.base.run_dir import RunDir
from launcher.base.sync_modes import Compress
from launcher.base.titles import name_process
from launcher.commands.command_line import prepared
from launcher.commands.dry_run import dry_run
from launcher.commands.export import export_command
from launcher.commands.pipes import quiet_closed_pipes
from launcher.commands.plot import plot_all
from launcher.commands.sweep import Sweep
from launcher.config import (
    CONF_DIR,
    ConfigError,
    JobConfig,
    check_resumable,
    freeze,
    register_configs,
    register_resolvers,
)
from launcher.config.keys import choice_overrides, own_model
from launcher.config.rules import entry_words
from launcher.launch.mode import LaunchPlan
from launcher.launch.plan import plan_job
from launcher.report import attempts
from launcher.report.summary import RunSummary
from launcher.train.banner import describe_span

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2


def run_job(cfg: DictConfig, sweep: Optional[Sweep] = None) -> int:
    """Validate, plan, freeze and launch one job. Returns the exit code. In a sweep, batch jobs (Slurm) are only
    submitted here; ``Sweep.finish`` waits for all of them together."""
    env, since = DistEnv.resolve(), time.time()
    try:
        job, plan, mode = plan_job(cfg, env, gpus_visible=gpu_count())
        check_resumable(job)
    except ConfigError as exc:
        print(f"launcher: error: {exc}", file=sys.stderr)
        with contextlib.suppress(Exception):  # the run dir Hydra made, empty: nothing started, nothing left
            Path(cfg.run_dir).rmdir()
        if sweep is not None:
            sweep.add(None, code=EXIT_CONFIG)
        return EXIT_CONFIG
    if job.dry_run:  # printed, and what it builds built here: an error in the user's code shows before anything
        return dry_run(job, plan, mode)
    if mode.in_process:  # this process is one rank (of torchrun, or srun in an sbatch): rank_main freezes
        finished = mode.run(plan, job, env) == EXIT_OK
        own = exit_code() or EXIT_OK  # the rank's (a script's that ended on a Ctrl-C it did not handle: 130)
        if not env.is_main:
            return own
        if not job.doctor:
            if finished:  # no head writes and prints the summary: rank 0 does, as the launcher would
                end_job(job, plan, EXIT_OK, since, launch=env.launch_id)
                print_summary(job.run, job.train.plots)
            return own
        code = print_doctor(job.run)
        end_process_at_exit(code)  # the rank registered 0; the doctor's verdict decides
        return code
    freeze(job)
    attempts.clear(job.run)  # the markers describe this run's attempts
    name_process(f"head {mode.name}", entry_words(job), job.run_dir)
    print(f"[launcher] {plan.describe()}".replace("\n", "\n[launcher] "), file=sys.stderr)
    try:
        if mode.batch and sweep is not None:
            sweep.add(job.run, submitted=mode.submit(plan, job))
            return EXIT_OK
        code = mode.run(plan, job, env)
    except ConfigError as exc:
        print(f"launcher: error: {exc}", file=sys.stderr)
        code = EXIT_CONFIG
    end_job(job, plan, code, since)
    if code == EXIT_OK and job.doctor:
        code = print_doctor(job.run)
    elif code == EXIT_OK:
        print_summary(job.run, job.train.plots)
    if sweep is not None:
        sweep.add(job.run, code=code)
    return code


def end_job(job: JobConfig, plan: LaunchPlan, code: int, since: float, launch: Optional[str] = None) -> None:
    """summary.json's job part (every entry's: ``launcher.report.attempts``), and the attempts when several."""
    layout = (plan.nodes, plan.procs_per_node)
    script = job.script is not None  # (its end line: it has no trainer's table)
    for line in attempts.end_of_job(job.run, entry_words(job), layout, code, since, launch, script=script):
        print(line, file=sys.stderr)


def print_summary(run_dir: RunDir, plots: bool = True) -> None:
    """The end-of-run table (what summary.json holds) and the curves, rendered next to it (``plots``)."""
    s = RunSummary.read(run_dir)
    if s is None:
        return
    seen = describe_span(s.steps, s.steps_per_epoch) if s.steps_per_epoch else f"{s.epochs} epoch(s)"
    rows = [("run dir", str(run_dir))]
    try:
        paths = plot_all(run_dir) if plots else []
        rows += [("curves" if i == 0 else "timeline", str(path)) for i, path in enumerate(paths)]
    except Exception as exc:  # a plot is a convenience: never fail a finished run over it
        rows.append(("curves", f"not rendered ({exc})"))
    if not plots:
        rows.append(("curves", f"not rendered (train.plots=false): python -m launcher plot {run_dir}"))
    print(
        f"[launcher] done: {s.steps} steps, {seen} on {s.world_size} rank(s) in {s.wall_s:.1f} s\n"
        + summary_table(s, rows),
        file=sys.stderr,
    )


def print_doctor(run_dir: RunDir) -> int:
    """The doctor's report (doctor.json, written by rank 0); exit code 1 when it found problems."""
    from launcher.rank.doctor import format_doctor_report

    path = run_dir.doctor
    if not path.is_file():
        print(
            f"launcher: error: the doctor wrote no report ({path}); see the rank logs in {run_dir.logs}",
            file=sys.stderr,
        )
        return EXIT_FAILED
    report = json.loads(path.read_text())
    print(format_doctor_report(report) + f"\n[launcher] report: {path}", file=sys.stderr)
    return EXIT_FAILED if report["problems"] else EXIT_OK


def test_rows(s: RunSummary) -> list[tuple[str, str]]:
    """The last evaluation's metrics, each by its name (cross-entropy's accuracy, train.metrics)."""
    if s.test_loss is None and s.test_accuracy is None:
        return [("test", "n/a (no test split)")]
    return [(f"test {k}", "n/a" if v is None else f"{v:.4f}") for k, v in s.scores.items()]


def summary_table(s: RunSummary, extra: list[tuple[str, str]]) -> str:
    sync = f"{s.reducer}, {'hierarchical' if s.hierarchical else 'flat'}"
    sync += "" if s.compression == Compress.none else f", {s.compression}"
    rows = [
        ("layout", f"{s.nodes} node(s) x {s.procs_per_node} rank(s), {s.backend} on {s.device}"),
        ("model / data", f"{s.model} / {s.data}, global batch {s.global_batch}"),
        ("gradient sync", sync + (f" ({s.hierarchical_reason})" if s.hierarchical_reason else "")),
        ("final loss", f"{s.final_loss:.4f}"),
        *test_rows(s),
        ("throughput", f"{s.samples_per_s:.0f} samples/s" if s.samples_per_s else "n/a"),
        ("resumed from", s.resumed_from or "-"),
        *extra,
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def plot_command(args: list[str]) -> int:
    """``python -m launcher plot RUN_DIR``: render RUN_DIR/plots/curves.png from its metrics (and trace.png from
    trace.json when the run has one)."""
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m launcher plot RUN_DIR", file=sys.stderr)
        return EXIT_CONFIG
    try:
        print("\n".join(str(path) for path in plot_all(RunDir(args[0]))))
    except ValueError as exc:
        print(f"launcher: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    return EXIT_OK


def unwritable(directory: Path) -> Optional[str]:
    """Why files cannot be written under ``directory`` (probed at its nearest existing ancestor), or None."""
    existing = directory.absolute()
    while not existing.exists():
        existing = existing.parent
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".launcher-probe-") as probe:
            probe.write(b"\0" * 65536)  # a full disk refuses this; an empty file might still fit
            probe.flush()
            os.fsync(probe.fileno())
    except OSError as exc:
        return f"{exc.strerror or exc} at {existing}"
    return None


def check_output_dir(args: list[str]) -> None:
    """Refuse an unwritable or full run dir before Hydra creates it (Hydra would fail with a traceback)."""
    given = [a.split("=", 1)[1] for a in args if a.startswith(("hydra.run.dir=", "hydra.sweep.dir="))]
    for directory in given or ["runs"]:
        reason = unwritable(Path(directory))
        if reason:
            print(
                f"launcher: error: cannot write the run dir {directory} ({reason}); HINT: choose a writable "
                "place with hydra.run.dir=PATH, or free space there",
                file=sys.stderr,
            )
            raise SystemExit(EXIT_CONFIG)


def main() -> None:
    quiet_closed_pipes()  # `python -m launcher export RUN OUT | head -1`: no traceback when the reader has gone
    no_world_writable_files()  # before Hydra creates the run dir
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command in ("plot", "export"):
        raise SystemExit((plot_command if command == "plot" else export_command)(sys.argv[2:]))
    if command == "doctor":  # the same job, launched the same way, checking the cluster instead of training
        sys.argv = [sys.argv[0], *sys.argv[2:], "doctor=true"]
    check_output_dir(sys.argv[1:])
    try:
        sys.argv = [sys.argv[0], *choice_overrides(prepared(sys.argv[1:]))]  # comm.hierarchical=true: the member
    except ConfigError as exc:
        print(f"launcher: error: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None
    register_resolvers()
    register_configs()
    entered = []
    sweep = Sweep()

    @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
    def _task(cfg: DictConfig) -> int:
        entered.append(True)
        with open_dict(cfg):
            own_model(cfg.model, list(HydraConfig.get().overrides.task))
        if HydraConfig.get().mode == RunMode.RUN:
            raise SystemExit(run_job(cfg))
        code = run_job(cfg, sweep.point(" ".join(HydraConfig.get().overrides.task)))
        if sweep.should_end(code):  # a stop signal: no further point starts
            raise SystemExit(sweep.finish())
        return code

    try:
        _task()
        if entered:  # a sweep (-m): wait for its Slurm jobs, report every point
            raise SystemExit(sweep.finish())
    except SystemExit as exc:
        # Hydra exits with 1 when it rejects the command line or config (unknown group option, typo'd key):
        # that is a configuration error, exit code 2, like our own checks.
        if not entered and exc.code not in (0, None):
            raise SystemExit(EXIT_CONFIG) from None
        settle_exit_code(exc.code)  # a rank that ran in this process ends the process with this code
        raise
