"""Typed schemas of where a job runs: ``cluster.*`` (local when no cluster is chosen) and one subclass per cluster
kind chosen with ``+cluster=<kind>`` (``conf/cluster/<kind>.yaml``). Each launch mode (``launcher/launch/``)
reads its own."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from launcher.config.errors import _check


@dataclass
class ClusterConfig:
    """Where the job runs. Local when no cluster is chosen; ``+cluster=sim|slurm|ssh`` picks a subclass."""

    kind: str = "local"  # set by the chosen cluster config: local | sim | slurm | ssh
    nodes: int = 1  # machines (or simulated nodes)
    node_rank: Optional[int] = None  # by hand on each machine (nodes > 1 without +cluster=...): this machine's node
    gpus_per_node: Optional[int] = None  # 0 = CPU only; null = every visible GPU for a local or by-hand run, one
    #                                      per rank under torchrun (when that many are visible), else 0 (sim, ssh
    #                                      and Slurm: this host's GPUs say nothing of the nodes')
    procs_per_node: Optional[int] = None  # ranks per node; null = gpus_per_node, or 2 on CPU (ssh: a hostfile's
    #                                       slots; torchrun: its --nproc_per_node)
    max_restarts: int = 0  # whole-group restarts after a rank fails: the trainer resumes from its newest
    #                        checkpoint, a script= starts again from its first line (its own snapshot, if it keeps one)
    min_nodes: Optional[int] = None  # sim, ssh: keep training on this many machines when others are lost (the
    #                                  built-in trainer and a script through launcher.Engine heal in place, from
    #                                  memory; another script=, cluster.heal=false and the other cases of
    #                                  config.rules.heals_in_place restart the survivors from the newest checkpoint);
    #                                  slurm: submit with --nodes=MIN-MAX (start on what is free); null = nodes,
    #                                  every machine needed (plan_job writes it)
    master_addr: str = "127.0.0.1"  # the rendezvous address: loopback for a local run (nothing listens outside);
    #                                 by hand (cluster.node_rank), node 0's address as the other machines reach it
    #                                 (sim and Slurm choose their own)
    master_port: int = 0  # 0 = a free port chosen and held by the rendezvous store (Slurm: 20000 + job id % 20000;
    #                       machines started by hand must all be given the same one)
    join_timeout_s: float = 120.0  # how long ranks may take to join the rendezvous
    gpu_select: str = "index"  # index (as CUDA numbers them) | free_memory (most free first: the d2l notes' recipe)
    heal: bool = True  # sim, ssh under cluster.min_nodes: a lost machine's survivors go on in place, from memory
    #                    (false: the head restarts them from the newest checkpoint; config.rules.heals_in_place)
    lost_after_s: float = 3.0  # healing: a machine whose heartbeat is silent this long is lost (frozen, link down)
    stop_grace_s: float = 30.0  # after a stop signal (SIGINT, SIGTERM, SIGHUP) is passed on to the ranks, how long
    #                             they have to exit before they are killed, and said (torchrun's 30 s): a script=
    #                             gets the signal itself (its handler saves, then exits); the trainer checkpoints at
    #                             the next step within 25 s. 0 kills at once. Slurm: its KillWait bounds it instead

    @property
    def may_shrink(self) -> bool:
        """``cluster.min_nodes`` < ``cluster.nodes``: the job may run on fewer machines than listed."""
        return self.min_nodes is not None and self.min_nodes < self.nodes

    def __post_init__(self) -> None:
        _check(self.nodes >= 1, f"cluster.nodes={self.nodes} must be >= 1; HINT: set cluster.nodes=1 for one machine")
        if self.node_rank is not None:
            _check(
                0 <= self.node_rank < self.nodes,
                f"cluster.node_rank={self.node_rank} is out of range for cluster.nodes={self.nodes}; HINT: number "
                f"the machines 0..{self.nodes - 1}, node 0 being cluster.master_addr",
            )
        if self.gpus_per_node is not None:
            _check(
                self.gpus_per_node >= 0,
                f"cluster.gpus_per_node={self.gpus_per_node} must be >= 0; HINT: 0 trains on the CPU",
            )
        if self.procs_per_node is not None:
            _check(
                self.procs_per_node >= 1,
                f"cluster.procs_per_node={self.procs_per_node} must be >= 1; HINT: omit it to use one rank per GPU "
                "(or 2 on CPU)",
            )
        _check(self.max_restarts >= 0, f"cluster.max_restarts={self.max_restarts} must be >= 0")
        if self.min_nodes is not None:
            _check(
                1 <= self.min_nodes <= self.nodes,
                f"cluster.min_nodes={self.min_nodes} must be in 1..cluster.nodes={self.nodes}; HINT: the fewest "
                "machines the job may go on with (omit it: every machine is needed)",
            )
            _check(
                self.min_nodes == self.nodes or (self.kind in ("sim", "ssh", "slurm") and self.node_rank is None),
                f"cluster.min_nodes={self.min_nodes} < cluster.nodes={self.nodes}: "
                f"{'machines started by hand' if self.node_rank is not None else self.kind + ' jobs'} cannot go on "
                "with fewer machines (that needs the launcher's head, +cluster=ssh or +cluster=sim, or Slurm's "
                "--nodes=MIN-MAX, +cluster=slurm); HINT: use one of those, or drop cluster.min_nodes",
            )
        _check(
            self.lost_after_s >= 1.0,
            f"cluster.lost_after_s={self.lost_after_s} must be >= 1 (machines beat every 0.5 s); HINT: 3 is the "
            "default",
        )
        _check(
            self.stop_grace_s >= 0,
            f"cluster.stop_grace_s={self.stop_grace_s} must be >= 0 (the seconds the ranks have to exit after a stop "
            "signal); HINT: 30 is torchrun's, 0 kills them at once",
        )
        _check(0 <= self.master_port < 65536, f"cluster.master_port={self.master_port} must be in 0..65535")
        _check(self.join_timeout_s > 0, f"cluster.join_timeout_s={self.join_timeout_s} must be > 0")
        _check(
            self.gpu_select in ("index", "free_memory"),
            f"cluster.gpu_select={self.gpu_select!r}; HINT: index or free_memory",
        )


@dataclass
class SimClusterConfig(ClusterConfig):
    """``+cluster=sim``: several virtual nodes on this host, one elastic agent each, so node-first reduction
    meets a real topology; with ``netns=true`` each node gets its own network namespace and a shaped link."""

    kind: str = "sim"
    nodes: int = 2
    netns: bool = False  # one network namespace per node, joined by a bridge (needs root and iproute2)
    link_gbit: Optional[float] = None  # shape each node's link to this rate (tbf; needs netns=true)
    link_burst: str = "2mbit"  # tbf burst: below ~64 KB tbf splits every segment and the CPU, not the link, limits
    node_link_gbit: list[float] = field(default_factory=list)  # per-node rates (overrides link_gbit), e.g. [1,1,0.05]
    subnet: str = "10.99.0"  # namespace addresses <subnet>.<node+1>/24; they exist only inside the namespaces

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.link_gbit is not None:
            _check(self.link_gbit > 0, f"cluster.link_gbit={self.link_gbit} must be > 0")
            _check(
                self.netns,
                f"cluster.link_gbit={self.link_gbit} shapes the namespace links; HINT: add cluster.netns=true",
            )
        if self.node_link_gbit:
            rates = list(self.node_link_gbit)
            _check(
                len(rates) == self.nodes and all(r > 0 for r in rates),
                f"cluster.node_link_gbit={rates} needs one rate > 0 per node (cluster.nodes={self.nodes})",
            )
            _check(
                self.netns, f"cluster.node_link_gbit={rates} shapes the namespace links; HINT: add cluster.netns=true"
            )
        _check(
            not self.gpus_per_node,
            f"cluster.gpus_per_node={self.gpus_per_node}: simulated nodes run on the CPU; "
            "HINT: cluster.gpus_per_node=0",
        )
        octets = self.subnet.split(".")
        _check(
            len(octets) == 3 and all(o.isdigit() and int(o) < 256 for o in octets),
            f"cluster.subnet={self.subnet!r} must be three octets like 10.99.0",
        )


@dataclass
class SlurmClusterConfig(ClusterConfig):
    """``+cluster=slurm``: one Slurm task per rank through submitit (never torchrun inside a task)."""

    kind: str = "slurm"
    partition: Optional[str] = None  # null = the cluster's default partition
    account: Optional[str] = None  # sbatch --account (null: your default)
    qos: Optional[str] = None  # sbatch --qos (null: your default quality of service)
    time_min: int = 60  # the job's time limit in minutes (sbatch --time); longer than cluster.signal_delay_s
    cpus_per_task: int = 1  # CPUs of each task (one task per rank)
    mem_gb: Optional[float] = None  # memory per node in GB (sbatch --mem; null: the partition's default)
    constraint: Optional[str] = None  # sbatch --constraint: node features, e.g. a100
    exclude: Optional[str] = None  # sbatch --exclude: nodes not to use, e.g. node[3-4]
    extra_sbatch: dict[str, str] = field(default_factory=dict)  # any other #SBATCH option: {key: value}
    setup: list[str] = field(default_factory=list)  # shell lines run before the tasks start (module load ...)
    signal_delay_s: int = 120  # Slurm sends SIGUSR2 this long before the time limit: checkpoint and requeue
    max_requeues: int = 3  # preemptions/timeouts survived (each resumes from the checkpoint)
    job_name: str = "launcher"  # the Slurm job's name (squeue)
    folder: str = "submitit"  # submitit's files, inside the run dir
    wait: bool = True  # wait for the job, streaming rank 0's log; false returns after submission

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.time_min > 0, f"cluster.time_min={self.time_min} must be > 0")
        _check(self.cpus_per_task >= 1, f"cluster.cpus_per_task={self.cpus_per_task} must be >= 1")
        _check(self.signal_delay_s >= 0, f"cluster.signal_delay_s={self.signal_delay_s} must be >= 0")
        _check(self.max_requeues >= 0, f"cluster.max_requeues={self.max_requeues} must be >= 0")
        _check(
            self.max_restarts == 0,
            f"cluster.max_restarts={self.max_restarts}: a Slurm job is not started again after a failure (it is "
            f"requeued after a preemption or its time limit, cluster.max_requeues={self.max_requeues}); HINT: drop "
            "cluster.max_restarts, or submit the job again with the same hydra.run.dir to resume from its checkpoint",
        )
        _check(
            self.signal_delay_s < self.time_min * 60,
            f"cluster.signal_delay_s={self.signal_delay_s} must be shorter than the time limit "
            f"(cluster.time_min={self.time_min}); HINT: raise time_min or lower signal_delay_s",
        )
        reserved = {
            "nodes",
            "ntasks-per-node",
            "ntasks_per_node",
            "gres",
            "gpus-per-node",
            "partition",
            "time",
            "signal",
            "job-name",
            "output",
            "error",
        }
        clash = sorted(k for k in self.extra_sbatch if k.replace("_", "-") in reserved or k in reserved)
        _check(
            not clash,
            f"cluster.extra_sbatch sets {clash}, which the launcher derives from cluster.* keys; "
            "HINT: set cluster.nodes / procs_per_node / gpus_per_node / partition / time_min instead",
        )
        if self.mem_gb is not None:
            _check(self.mem_gb > 0, f"cluster.mem_gb={self.mem_gb} must be > 0")


@dataclass
class SshClusterConfig(ClusterConfig):
    """``+cluster=ssh``: one elastic agent per machine, started over ssh from this (head) host; the run dir must be
    on a file system every machine shares. ``nodes`` defaults to the number of hosts (a smaller value uses the
    first ``nodes`` hosts)."""

    kind: str = "ssh"
    nodes: int = 0  # 0 = every listed host
    hosts: list[str] = field(default_factory=list)  # [host1, host2, ...] as ssh reaches them (or hostfile)
    hostfile: Optional[str] = None  # one host per line, optional "slots=N" (DeepSpeed/MPI style), # comments
    master_addr: str = ""  # "" = the first host; the address every machine reaches node 0's store on
    ssh_options: list[str] = field(default_factory=list)  # extra ssh arguments, e.g. [-p, "2222", -F, my_config]
    python: str = ""  # "" = this interpreter's path (the same path must exist on every host)
    env: list[str] = field(default_factory=list)  # more variables to forward: NAME, or PREFIX_* for a prefix
    setup: list[str] = field(default_factory=list)  # shell lines run on each host before its agent (module load ...)
    check_timeout_s: float = 30.0  # how long each host may take to answer the checks before anything starts
    heartbeat_timeout_s: float = 60.0  # a host stops its ranks after hearing nothing from the head this long
    #                                    (its link is down, the head is suspended); the head writes every 5 s
    rejoin_every_s: float = 2.0  # healing in place: the head checks the lost hosts this often, and one that
    #                              passes the host checks again joins at a step boundary (0: it stays out)

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(
            self.node_rank is None,
            "cluster.node_rank is for machines started by hand; +cluster=ssh numbers "
            "the hosts in their order; HINT: drop cluster.node_rank",
        )
        _check(self.check_timeout_s > 0, f"cluster.check_timeout_s={self.check_timeout_s} must be > 0")
        _check(self.rejoin_every_s >= 0, f"cluster.rejoin_every_s={self.rejoin_every_s} must be >= 0 (0: never)")
        _check(
            self.heartbeat_timeout_s >= 15,
            f"cluster.heartbeat_timeout_s={self.heartbeat_timeout_s} must be >= 15 (the head writes every 5 s)",
        )
        for name in self.env:
            _check(
                name.removesuffix("*").replace("_", "a").isalnum(),
                f"cluster.env entry {name!r} is not a variable name; HINT: NAME, or PREFIX_* for every variable "
                "starting with PREFIX_",
            )
