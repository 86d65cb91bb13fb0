"""From a composed config to a launch plan (``LaunchPlan``, in ``launch/mode.py``): which mode (``MODES``, in
detection order), how many nodes and ranks, which backend, where.

Machine-dependent defaults are filled by the mode BEFORE validation, so the frozen config holds the values the
job really ran with. Anything wrong is a ``ConfigError`` before a process starts.
"""

from __future__ import annotations

import os

from omegaconf import DictConfig

from launcher.base.env import DistEnv
from launcher.base.sync_modes import Backend
from launcher.base.threads import plan_line
from launcher.config import ConfigError, JobConfig, to_job
from launcher.config.keys import check_model_keys
from launcher.config.rules import check_tensorboard, describe_planned_sharding, heals_in_place, job_backend
from launcher.launch.local import LocalMode
from launcher.launch.mode import BaseMode, LaunchPlan
from launcher.launch.sim.head import SimMode
from launcher.launch.slurm.submit import SlurmMode
from launcher.launch.slurm.task_entry import SlurmTaskMode
from launcher.launch.ssh.head import SshMode
from launcher.launch.torchrun import TorchrunMode
from launcher.train.scores import build, metric_specs

# The detection order (``launch/__init__.py``'s docstring says why): the first mode that says yes runs the job.
MODES: tuple[BaseMode, ...] = (TorchrunMode(), SlurmTaskMode(), SlurmMode(), SshMode(), SimMode(), LocalMode())


def choose_mode(env: DistEnv, kind: str) -> BaseMode:
    """The first mode in ``MODES`` order that recognises this process (torchrun, srun task) or the cluster kind."""
    for mode in MODES:
        if mode.detect(env, kind):
            return mode
    raise ConfigError(f"cluster.kind={kind!r} has no launch mode; HINT: one of {[m.name for m in MODES]}")


def plan_job(cfg: DictConfig, env: DistEnv, gpus_visible: int) -> tuple[JobConfig, LaunchPlan, BaseMode]:
    """Choose the mode, fill its defaults into ``cfg``, validate into a JobConfig, and plan the launch."""
    mode = choose_mode(env, str(cfg.cluster.kind))
    mode.fill_defaults(cfg.cluster, env, gpus_visible)
    if cfg.cluster.min_nodes is None:  # every machine needed: the frozen config says so with the number
        cfg.cluster.min_nodes = cfg.cluster.nodes
    job = to_job(cfg)
    check_model_keys(job.model)
    check_tensorboard(job)
    build_metrics(job)
    mode.validate(job, env, gpus_visible)
    c = job.cluster
    procs, gpus = int(c.procs_per_node or 0), int(c.gpus_per_node or 0)
    if gpus and procs > gpus:
        raise ConfigError(
            f"cluster.procs_per_node={procs} exceeds cluster.gpus_per_node={gpus}: ranks cannot share a GPU under "
            f"nccl; HINT: set cluster.procs_per_node={gpus}"
        )
    if job.comm.backend is Backend.nccl and not gpus:
        raise ConfigError("comm.backend=nccl needs GPUs; HINT: comm.backend=auto (gloo on CPU)")
    plan = LaunchPlan(
        mode=mode.name,
        nodes=c.nodes,
        min_nodes=cfg.cluster.min_nodes,
        procs_per_node=procs,
        gpus_per_node=gpus,
        backend=job_backend(job),
        rendezvous=mode.rendezvous(job, env),
        max_restarts=c.max_restarts,
        run_dir=job.run_dir,
        entry=describe_entry(job),
        on_loss=describe_on_loss(job),
        threads=plan_line(job.train.threads_per_rank, mode.ranks_on_this_machine(job, env), os.environ),
        sharding=describe_planned_sharding(job, procs),
    )
    return job, plan, mode


def build_metrics(job: JobConfig) -> None:
    """Each metric of ``train.metrics`` built once here, before any rank starts (a trainer's job): one that cannot be
    built is named with its key and the fix now, not at every rank's first step. (The dotted paths and the arguments
    each one needs were checked with the config: ``config/targets.py``; the model and the data are built by the dry
    run: on a real run each rank builds them, and they may be large.)"""
    if job.script is not None or job.doctor:
        return
    for name, spec in metric_specs(job.train).items():
        try:
            build(name, spec)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc


def describe_on_loss(job: JobConfig) -> str:
    """What losing a machine does to a job that may shrink ("" for one that may not)."""
    if not job.cluster.may_shrink:
        return ""
    heals = heals_in_place(job)
    if heals:
        through = " through launcher.Engine" if job.script else ""
        return f"the survivors heal in place{through} (cluster.heal)"
    if job.script:
        return f"restart on the machines left ({heals.reason})"
    return f"restart from the checkpoint ({heals.reason})"


def describe_entry(job: JobConfig) -> str:
    if job.doctor:
        return "doctor: reachability, interfaces, GPUs, allreduce per node and per node pair"
    if job.script:
        return f"script {job.script} {' '.join(job.script_args)}".rstrip()
    preflight = " (after the doctor's preflight checks)" if job.preflight else ""
    return f"trainer: model {job.model['_target_']} on data {job.data.label}{preflight}"
