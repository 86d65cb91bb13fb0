"""From a composed config to a launch plan: which mode, how many nodes and ranks, which backend, where.

Machine-dependent defaults are filled here (GPUs visible, torchrun's world) BEFORE validation, so the frozen
config holds the values the job really ran with. Anything wrong is a ``ConfigError`` before a process starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from ..config import ConfigError, JobConfig, to_job
from ..devices import backend_for
from ..env import DistEnv
from .netns import check_netns_possible

CPU_PROCS_PER_NODE = 2


@dataclass(frozen=True)
class LaunchPlan:
    mode: str  # local | torchrun
    nodes: int
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
                f"layout      : {self.nodes} node(s) x {self.procs_per_node} rank(s) = world size {self.world_size}",
                f"devices     : {devices} (backend {self.backend})",
                f"rendezvous  : {self.rendezvous}",
                f"max restarts: {self.max_restarts}",
                f"entry       : {self.entry}",
                f"run dir     : {self.run_dir}",
            ]
        )


def plan_job(cfg: DictConfig, env: DistEnv, gpus_visible: int) -> tuple[JobConfig, LaunchPlan]:
    """Fill machine defaults into ``cfg``, validate it into a JobConfig, and plan the launch."""
    # Already one rank of a running job (torchrun, or an srun task of a user's sbatch script): the launcher that
    # started us decided the layout; run in-process.
    under_torchrun = env.source in ("elastic", "slurm")
    starter = "torchrun" if env.source == "elastic" else "srun"
    cluster = cfg.cluster
    explicit = {"nodes": cluster.nodes, "procs_per_node": cluster.procs_per_node}
    if under_torchrun:
        cluster.nodes, cluster.procs_per_node = env.num_nodes, env.local_world_size
        if cluster.gpus_per_node is None:
            cluster.gpus_per_node = env.local_world_size if gpus_visible >= env.local_world_size else 0
    else:
        if cluster.gpus_per_node is None:
            cluster.gpus_per_node = gpus_visible if cluster.kind == "local" else 0
        if cluster.procs_per_node is None:
            gpus = cluster.gpus_per_node
            cluster.procs_per_node = gpus if isinstance(gpus, int) and gpus > 0 else CPU_PROCS_PER_NODE
    job = to_job(cfg)
    c = job.cluster

    if under_torchrun:
        for key, value in explicit.items():
            if value is not None and value != getattr(c, key) and not (key == "nodes" and value == 1):
                raise ConfigError(
                    f"cluster.{key}={value} but {starter} started {getattr(c, key)}; HINT: drop the override, "
                    f"{starter}'s layout (--nnodes/--nproc_per_node, -N/--ntasks-per-node) decides"
                )
    elif c.kind == "sim":
        if c.netns:
            check_netns_possible()
    elif c.kind == "local":
        if c.nodes > 1:
            raise ConfigError(
                f"cluster.nodes={c.nodes} cannot run on one machine without a multi-node launcher; HINT: "
                "+cluster=sim to simulate nodes here, +cluster=slurm, or torchrun on each node"
            )
        if c.gpus_per_node > gpus_visible:
            raise ConfigError(
                f"cluster.gpus_per_node={c.gpus_per_node} but this machine has {gpus_visible} visible GPU(s); "
                f"HINT: set cluster.gpus_per_node={gpus_visible}" + (" (CPU)" if gpus_visible == 0 else "")
            )
    if c.gpus_per_node and c.procs_per_node > c.gpus_per_node:
        raise ConfigError(
            f"cluster.procs_per_node={c.procs_per_node} exceeds cluster.gpus_per_node={c.gpus_per_node}: ranks "
            f"cannot share a GPU under nccl; HINT: set cluster.procs_per_node={c.gpus_per_node}"
        )
    if job.comm.backend == "nccl" and not c.gpus_per_node:
        raise ConfigError("comm.backend=nccl needs GPUs; HINT: comm.backend=auto (gloo on CPU)")

    backend = backend_for(bool(c.gpus_per_node)) if job.comm.backend == "auto" else job.comm.backend
    if under_torchrun and starter == "torchrun":
        mode, rendezvous = "torchrun", f"{env.master_addr}:{env.master_port} (torchrun's store)"
    elif under_torchrun:
        mode, rendezvous = "slurm-task", f"{env.master_addr}:{env.master_port} (rank 0 hosts the store)"
    elif c.kind == "slurm":
        mode = c.kind
        rendezvous = "Slurm: MASTER_ADDR = the job's first node, MASTER_PORT = " + (
            str(c.master_port) if c.master_port else "20000 + job id % 20000"
        )
    elif c.kind == "sim":
        mode = c.kind
        net = (
            (
                f"network namespaces on {c.subnet}.0/24"
                + (f", links shaped to {c.link_gbit} Gbit/s" if c.link_gbit else ", unshaped links")
            )
            if c.netns
            else "loopback"
        )
        rendezvous = f"c10d on node 0's agent; {net}"
    else:
        mode = c.kind
        port = c.master_port or "free port held by the store"
        rendezvous = f"c10d on {c.master_addr}:{port}"
    if job.doctor:
        entry = "doctor: reachability, interfaces, GPUs, allreduce per node and per node pair"
    elif job.script:
        entry = f"script {job.script} {' '.join(job.script_args)}".rstrip()
    else:
        entry = f"trainer: model {job.model['_target_']} on data {job.data.name}" + (
            " (after the doctor's preflight checks)" if job.preflight else ""
        )
    plan = LaunchPlan(
        mode=mode,
        nodes=c.nodes,
        procs_per_node=c.procs_per_node,
        gpus_per_node=c.gpus_per_node,
        backend=backend,
        rendezvous=rendezvous,
        max_restarts=c.max_restarts,
        run_dir=job.run_dir,
        entry=entry,
    )
    return job, plan
