"""From a composed config to a launch plan: which mode (``launch/mode.py``), how many nodes and ranks, which
backend, where.

Machine-dependent defaults are filled by the mode BEFORE validation, so the frozen config holds the values the
job really ran with. Anything wrong is a ``ConfigError`` before a process starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from ..config import ConfigError, JobConfig, to_job
from ..devices import backend_for
from ..env import DistEnv
from .mode import BaseMode


@dataclass(frozen=True)
class LaunchPlan:
    mode: str  # the chosen mode's name (launch.MODES)
    nodes: int
    min_nodes: int  # cluster.min_nodes: the job may run on fewer machines, down to this (= nodes: never)
    procs_per_node: int
    gpus_per_node: int
    backend: str
    rendezvous: str
    max_restarts: int
    run_dir: str
    entry: str

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    def describe(self) -> str:
        devices = f"{self.gpus_per_node} GPU(s)/node, nccl" if self.gpus_per_node else "CPU"
        return "\n".join(
            [
                f"mode        : {self.mode}",
                f"layout      : {self.nodes} node(s) x {self.procs_per_node} rank(s) = world size {self.world_size}"
                + (f" (or down to {self.min_nodes} node(s): cluster.min_nodes)" if self.min_nodes < self.nodes else ""),
                f"devices     : {devices} (backend {self.backend})",
                f"rendezvous  : {self.rendezvous}",
                f"max restarts: {self.max_restarts}",
                f"entry       : {self.entry}",
                f"run dir     : {self.run_dir}",
            ]
        )


def choose_mode(env: DistEnv, kind: str) -> BaseMode:
    """The first mode in ``MODES`` order that recognises this process (torchrun, srun task) or the cluster kind."""
    from . import MODES

    for mode in MODES:
        if mode.detect(env, kind):
            return mode
    raise ConfigError(f"cluster.kind={kind!r} has no launch mode; HINT: one of {[m.name for m in MODES]}")


def plan_job(cfg: DictConfig, env: DistEnv, gpus_visible: int) -> tuple[JobConfig, LaunchPlan, BaseMode]:
    """Choose the mode, fill its defaults into ``cfg``, validate into a JobConfig, and plan the launch."""
    mode = choose_mode(env, str(cfg.cluster.kind))
    mode.fill_defaults(cfg.cluster, env, gpus_visible)
    job = to_job(cfg)
    mode.validate(job, env, gpus_visible)
    c = job.cluster
    procs, gpus = int(c.procs_per_node or 0), int(c.gpus_per_node or 0)
    if gpus and procs > gpus:
        raise ConfigError(
            f"cluster.procs_per_node={procs} exceeds cluster.gpus_per_node={gpus}: ranks cannot share a GPU under "
            f"nccl; HINT: set cluster.procs_per_node={gpus}"
        )
    if job.comm.backend == "nccl" and not gpus:
        raise ConfigError("comm.backend=nccl needs GPUs; HINT: comm.backend=auto (gloo on CPU)")
    plan = LaunchPlan(
        mode=mode.name,
        nodes=c.nodes,
        min_nodes=c.fewest_nodes,
        procs_per_node=procs,
        gpus_per_node=gpus,
        backend=backend_for(bool(gpus)) if job.comm.backend == "auto" else job.comm.backend,
        rendezvous=mode.rendezvous(job, env),
        max_restarts=c.max_restarts,
        run_dir=job.run_dir,
        entry=describe_entry(job),
    )
    return job, plan, mode


def describe_entry(job: JobConfig) -> str:
    if job.doctor:
        return "doctor: reachability, interfaces, GPUs, allreduce per node and per node pair"
    if job.script:
        return f"script {job.script} {' '.join(job.script_args)}".rstrip()
    preflight = " (after the doctor's preflight checks)" if job.preflight else ""
    return f"trainer: model {job.model['_target_']} on data {job.data.name}{preflight}"
