"""The launch-mode protocol: each way to start a job is one module in ``launch/`` with one ``BaseMode`` subclass,
run with the ``LaunchPlan`` that ``plan_job`` (``launch/plan.py``) made.

A mode answers five questions, in this order, for ``plan_job``:
  detect         is it the mode of this process? (``MODES`` asks in a fixed order, the first yes wins)
  fill_defaults  machine-dependent defaults into the composed config, before validation (so the frozen config
                 holds what the job really ran with); may refuse an override that contradicts the starter
  validate       mode-specific checks on the typed job (``ConfigError`` with the fix, before anything starts)
  rendezvous     one line for the plan: where the ranks meet
  run            start the job and return the exit code
``in_process`` modes are already one rank of a job that something else started (torchrun, srun); ``batch``
modes can submit and return (``submit``), so a sweep waits for all its points together.

Adding a mode: a module with a class following ``BaseMode``, its schema in ``config/clusters.py`` (a
``ClusterConfig`` subclass, registered in ``config/load.py``), ``conf/cluster/<kind>.yaml``, and its place in
``MODES`` (``launch/plan.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from omegaconf import DictConfig

from launcher.base.env import DistEnv
from launcher.config import ConfigError, JobConfig

CPU_PROCS_PER_NODE = 2


@dataclass(frozen=True)
class LaunchPlan:
    """What ``plan_job`` decided, handed to the mode's ``run`` (``dry_run=true`` prints ``describe()``)."""

    mode: str  # the chosen mode's name (plan.MODES)
    nodes: int
    min_nodes: int  # cluster.min_nodes: the job may run on fewer machines, down to this (= nodes: never)
    procs_per_node: int
    gpus_per_node: int
    backend: str
    rendezvous: str
    max_restarts: int
    run_dir: str
    entry: str
    on_loss: str = ""  # what losing a machine does (a job that may shrink: plan.describe_on_loss)
    threads: str = ""  # threads per rank (launcher.base.threads.plan_line)
    sharding: str = ""  # comm.reducer=fsdp: who holds which shard (config.rules.describe_planned_sharding)

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def may_shrink(self) -> bool:
        """The job may run on fewer machines than ``nodes`` (``ClusterConfig.may_shrink``)."""
        return self.min_nodes < self.nodes

    def describe(self) -> str:
        devices = f"{self.gpus_per_node} GPU(s)/node, nccl" if self.gpus_per_node else "CPU"
        return "\n".join(
            [
                f"mode        : {self.mode}",
                f"layout      : {self.nodes} node(s) x {self.procs_per_node} rank(s) = world size {self.world_size}"
                + (f" (or down to {self.min_nodes} node(s): cluster.min_nodes)" if self.may_shrink else ""),
                f"devices     : {devices} (backend {self.backend})",
                f"rendezvous  : {self.rendezvous}",
                f"max restarts: {self.max_restarts}",
                *([f"lost machine: {self.on_loss}"] if self.on_loss else []),
                *([f"threads     : {self.threads}"] if self.threads else []),
                f"entry       : {self.entry}",
                *([f"sharding    : {self.sharding}"] if self.sharding else []),
                f"run dir     : {self.run_dir}",
            ]
        )


class BaseMode:
    """Defaults shared by the modes that start processes themselves (local, sim, ssh, Slurm)."""

    name: ClassVar[str] = ""
    in_process: ClassVar[bool] = False  # this process is already one rank
    batch: ClassVar[bool] = False  # ``submit`` returns at once with a pending job

    def detect(self, env: DistEnv, kind: str) -> bool:
        return kind == self.name

    def fill_defaults(self, cluster: DictConfig, env: DistEnv, gpus_visible: int) -> None:
        if cluster.gpus_per_node is None:
            cluster.gpus_per_node = 0  # the submitting host's GPUs say nothing about the nodes'
        if cluster.procs_per_node is None:
            gpus = cluster.gpus_per_node
            cluster.procs_per_node = gpus if isinstance(gpus, int) and gpus > 0 else CPU_PROCS_PER_NODE

    def validate(self, job: JobConfig, env: DistEnv, gpus_visible: int) -> None:
        pass

    def rendezvous(self, job: JobConfig, env: DistEnv) -> str:
        raise NotImplementedError

    def ranks_on_this_machine(self, job: JobConfig, env: DistEnv) -> int | None:
        """How many of the job's ranks share this machine's cores (None: they run on other machines)."""
        return None

    def run(self, plan: LaunchPlan, job: JobConfig, env: DistEnv) -> int:
        raise NotImplementedError

    def preview(self, job: JobConfig) -> str:
        """Extra text for ``dry_run=true`` (e.g. the sbatch script)."""
        return ""

    def submit(self, plan: LaunchPlan, job: JobConfig) -> Any:
        raise NotImplementedError(f"{self.name} jobs are not submitted in batch")


NO_SUMMARY = -1  # StartedMode.run: the rank's work ended without a summary to print


class StartedMode(BaseMode):
    """Already one rank of a job another launcher started (torchrun, srun): its layout decides."""

    in_process = True
    source: ClassVar[str] = ""  # the DistEnv source that says this process was started so
    starter: ClassVar[str] = ""  # who started us, for messages
    layout_flags: ClassVar[str] = ""  # how the user sets the layout there
    store_host: ClassVar[str] = ""  # who hosts the rendezvous store

    def detect(self, env: DistEnv, kind: str) -> bool:
        return env.source == self.source

    def fill_defaults(self, cluster: DictConfig, env: DistEnv, gpus_visible: int) -> None:
        given = {"nodes": cluster.nodes, "procs_per_node": cluster.procs_per_node}
        started = {"nodes": env.num_nodes, "procs_per_node": env.local_world_size}
        for key, value in given.items():
            if value is not None and value != started[key] and not (key == "nodes" and value == 1):
                raise ConfigError(
                    f"cluster.{key}={value} but {self.starter} started {started[key]}; HINT: drop the override, "
                    f"{self.starter}'s layout ({self.layout_flags}) decides"
                )
        cluster.nodes, cluster.procs_per_node = started["nodes"], started["procs_per_node"]
        if cluster.gpus_per_node is None:
            cluster.gpus_per_node = env.local_world_size if gpus_visible >= env.local_world_size else 0

    def rendezvous(self, job: JobConfig, env: DistEnv) -> str:
        return f"{env.master_addr}:{env.master_port} ({self.store_host})"

    def ranks_on_this_machine(self, job: JobConfig, env: DistEnv) -> int | None:
        return env.local_world_size

    def run(self, plan: LaunchPlan, job: JobConfig, env: DistEnv) -> int:
        """0 when the rank's work returned its summary (the trainer finished), ``NO_SUMMARY`` otherwise (a script,
        a stop): rank 0 prints the end-of-run table only for the former."""
        return 0 if self.run_rank(job, env) is not None else NO_SUMMARY

    def run_rank(self, job: JobConfig, env: DistEnv) -> Any:
        """This process's rank of ``job`` (every rank composed the config itself); the trainer's summary or None."""
        raise NotImplementedError
