"""Who am I in the job? One frozen answer, resolved once, in a fixed order: torchrun env -> Slurm env -> single.

Every launcher names the same facts differently; the names live in the two tables below and nowhere else.
Nothing here writes ``os.environ``.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

# torchrun / torch.distributed.elastic (and any launcher following the env:// convention): every variable torch's
# agent gives a worker (LocalElasticAgent._start_workers, torch 2.13; OMP_NUM_THREADS from torchrun itself), each
# given to a script= job with the same meaning in every mode (``DistEnv.torchrun_environ``).
TORCHRUN_VARS = {
    "rank": "RANK",
    "local_rank": "LOCAL_RANK",
    "world_size": "WORLD_SIZE",
    "local_world_size": "LOCAL_WORLD_SIZE",
    "node_rank": "GROUP_RANK",
    "num_nodes": "GROUP_WORLD_SIZE",
    "role_rank": "ROLE_RANK",  # one role: the rank
    "role_world_size": "ROLE_WORLD_SIZE",  # one role: the world size
    "role": "ROLE_NAME",
    "master_addr": "MASTER_ADDR",
    "master_port": "MASTER_PORT",
    "launch_id": "TORCHELASTIC_RUN_ID",
    "agent_store": "TORCHELASTIC_USE_AGENT_STORE",
    "attempt": "TORCHELASTIC_RESTART_COUNT",
    "max_restarts": "TORCHELASTIC_MAX_RESTARTS",
    "threads": "OMP_NUM_THREADS",
    "nccl_async_errors": "TORCH_NCCL_ASYNC_ERROR_HANDLING",  # torchrun's agent: 1 unless set (nccl's own: 3)
}
ROLE = "default"  # torchrun's --role default (one role per job)
NO_RUN_ID = "none"  # torchrun's --rdzv-id default: the run id where none is known

# Slurm, one task per rank (srun / submitit); never nested under torchrun.
SLURM_VARS = {
    "rank": "SLURM_PROCID",
    "local_rank": "SLURM_LOCALID",
    "world_size": "SLURM_NTASKS",
    "node_rank": "SLURM_NODEID",
    "num_nodes": "SLURM_JOB_NUM_NODES",
    "nodelist": "SLURM_JOB_NODELIST",
    "tasks_per_node": "SLURM_TASKS_PER_NODE",
    "launch_id": "SLURM_JOB_ID",
    "step_id": "SLURM_STEP_ID",
    "node_name": "SLURMD_NODENAME",  # the (possibly virtual) node a task runs on; `hostname` may not tell
    "attempt": "SLURM_RESTART_COUNT",  # set in a requeued job
}

# The head's attempt number, when the head restarts the whole job with new agents (ssh; sim under
# cluster.min_nodes): their own restart count starts at 0 again, so this is added to TORCHELASTIC_RESTART_COUNT.
HEAD_ATTEMPT = "LAUNCHER_HEAD_ATTEMPT"


def head_attempt(environ: Mapping[str, str]) -> int:
    """The head's attempt number (0 unless the head restarts the job): added to the agent's own restarts."""
    return _int(environ, HEAD_ATTEMPT, 0)


SLURM_PORT_BASE = 20000
SLURM_PORT_SPAN = 20000


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job. ``source`` says which table it came from."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    source: str = "single"
    hostname: str = ""
    launch_id: str = ""  # this launch's identity: the elastic run id, or Slurm's job id
    agent_store: bool = False  # the elastic agent already hosts the TCPStore at master_addr:master_port
    attempt: int = 0  # 0-based: restarts / requeues so far; logs mark it, store keys and failure records kept apart
    role: str = ROLE  # the elastic role (torchrun's --role): one per job
    # the restarts the elastic agent that started this rank may make (torchrun's --max-restarts, ours): None where
    # no agent restarts it (Slurm, one process, a head that restarts the job itself): the job's config says
    max_restarts: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world size {self.world_size} ({self.source} env)")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(
                f"local rank {self.local_rank} outside local world size {self.local_world_size} ({self.source} env)"
            )

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def describe(self) -> str:
        attempt = f", attempt {self.attempt}" if self.attempt else ""
        return (
            f"rank {self.rank}/{self.world_size} (node {self.node_rank}/{self.num_nodes}, "
            f"local {self.local_rank}/{self.local_world_size}) on {self.hostname or '?'} via {self.source}{attempt}"
        )

    def torchrun_environ(self, max_restarts: int, threads: int | None = None) -> dict[str, str]:
        """Every variable torchrun gives a worker, describing this rank with torchrun's meaning (the reverse of
        ``TORCHRUN_VARS``), whichever launcher started it: for scripts written against torchrun and for processes
        this one starts. ``max_restarts``: how many times the job's ranks may be started again
        (TORCHELASTIC_MAX_RESTARTS; TORCHELASTIC_RESTART_COUNT is ``attempt``, every restart counted, the head's
        too); ``threads``: the rank's threads (OMP_NUM_THREADS; None: left to the rank). The script's store is
        hosted before it starts (by the agent, or by rank 0: ``rank.work``), so every rank's
        ``init_process_group`` connects to it as a client: TORCHELASTIC_USE_AGENT_STORE=True, as under torchrun."""
        v = TORCHRUN_VARS
        environ = {
            v["rank"]: str(self.rank),
            v["local_rank"]: str(self.local_rank),
            v["world_size"]: str(self.world_size),
            v["local_world_size"]: str(self.local_world_size),
            v["node_rank"]: str(self.node_rank),
            v["num_nodes"]: str(self.num_nodes),
            v["role_rank"]: str(self.rank),
            v["role_world_size"]: str(self.world_size),
            v["role"]: self.role,
            v["master_addr"]: self.master_addr,
            v["master_port"]: str(self.master_port),
            v["launch_id"]: self.launch_id or NO_RUN_ID,
            v["agent_store"]: str(True),
            v["attempt"]: str(self.attempt),
            v["max_restarts"]: str(max_restarts),
        }
        if threads is not None:
            environ[v["threads"]] = str(threads)
        return environ

    @classmethod
    def resolve(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        """torchrun env if RANK & co. are set, else Slurm task env, else a single process."""
        environ = os.environ if environ is None else environ
        if all(TORCHRUN_VARS[k] in environ for k in ("rank", "world_size", "master_addr", "master_port")):
            return _from_torchrun(environ)
        if all(SLURM_VARS[k] in environ for k in ("rank", "world_size", "step_id", "nodelist")):
            return _from_slurm(environ)
        return cls(hostname=socket.gethostname())


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = environ.get(name)
    if raw is None:
        if default is None:
            raise ValueError(f"environment variable {name} is required but not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def _from_torchrun(environ: Mapping[str, str]) -> DistEnv:
    v = TORCHRUN_VARS
    world = _int(environ, v["world_size"])
    local_world = _int(environ, v["local_world_size"], world)
    rank = _int(environ, v["rank"])
    role = environ.get(v["role"]) or ROLE
    heads_restarts = HEAD_ATTEMPT in environ  # the agent's own count and limit (0) are not the job's
    return DistEnv(
        rank=rank,
        local_rank=_int(environ, v["local_rank"], rank % local_world),
        world_size=world,
        local_world_size=local_world,
        node_rank=_int(environ, v["node_rank"], rank // local_world),
        num_nodes=_int(environ, v["num_nodes"], max(1, world // local_world)),
        master_addr=environ[v["master_addr"]],
        master_port=_int(environ, v["master_port"]),
        source="elastic",
        hostname=socket.gethostname(),
        launch_id=environ.get(v["launch_id"], ""),
        agent_store=environ.get(v["agent_store"], "") == "True",
        attempt=_int(environ, v["attempt"], 0) + head_attempt(environ),
        role=role,
        max_restarts=None if heads_restarts or v["max_restarts"] not in environ else _int(environ, v["max_restarts"]),
    )


def _from_slurm(environ: Mapping[str, str]) -> DistEnv:
    v = SLURM_VARS
    hosts = expand_hostlist(environ[v["nodelist"]])
    node_rank = _int(environ, v["node_rank"], 0)
    per_node = parse_tasks_per_node(environ.get(v["tasks_per_node"], ""), len(hosts))
    job_id = environ.get(v["launch_id"], "0")  # Slurm's job id
    return DistEnv(
        rank=_int(environ, v["rank"]),
        local_rank=_int(environ, v["local_rank"], 0),
        world_size=_int(environ, v["world_size"]),
        local_world_size=per_node[node_rank] if node_rank < len(per_node) else 1,
        node_rank=node_rank,
        num_nodes=_int(environ, v["num_nodes"], len(hosts)),
        master_addr=hosts[0],
        master_port=slurm_port(job_id),
        source="slurm",
        hostname=environ.get(v["node_name"]) or socket.gethostname(),
        launch_id=job_id,
        attempt=_int(environ, v["attempt"], 0),
    )


def slurm_port(job_id: str) -> int:
    """Every task of a job derives the same port from the job id without talking to the others."""
    digits = re.sub(r"\D", "", job_id.split("_")[0]) or "0"
    return SLURM_PORT_BASE + int(digits) % SLURM_PORT_SPAN


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand Slurm's compact host list: ``node[1-3,7],gpu[01-02]`` -> node1 node2 node3 node7 gpu01 gpu02."""
    hosts: list[str] = []
    for prefix, ranges, suffix in re.findall(r"([^,\[]+)(?:\[([^\]]+)\])?([^,\[]*)", hostlist):
        if not ranges:
            hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            width = len(lo)
            for i in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{i:0{width}d}{suffix}")
    if not hosts:
        raise ValueError(f"cannot parse Slurm host list {hostlist!r}")
    return hosts


def parse_tasks_per_node(spec: str, num_nodes: int) -> list[int]:
    """Parse SLURM_TASKS_PER_NODE (``2``, ``2(x3)``, ``4,2(x2)``) into one count per node."""
    counts: list[int] = []
    for part in filter(None, spec.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise ValueError(f"cannot parse SLURM_TASKS_PER_NODE={spec!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts or [1] * num_nodes
