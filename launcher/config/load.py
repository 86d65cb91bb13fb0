"""From Hydra's composed config to a validated ``JobConfig``, frozen once into the run dir, and back."""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ValidationError

from launcher.base.checkpoint_names import list_checkpoints
from launcher.base.env import DistEnv
from launcher.base.files import write_atomic
from launcher.base.run_dir import RunDir
from launcher.config.schema import (
    ClusterConfig,
    ConfigError,
    JobConfig,
    SimClusterConfig,
    SlurmClusterConfig,
    SshClusterConfig,
)

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"  # the YAML Hydra composes onto the schemas

# One schema per cluster kind; ``+cluster=<kind>`` composes the subclass, the frozen YAML is read back with it.
CLUSTER_SCHEMAS: dict[str, type[ClusterConfig]] = {
    "local": ClusterConfig,
    "sim": SimClusterConfig,
    "slurm": SlurmClusterConfig,
    "ssh": SshClusterConfig,
}


def to_job(cfg: DictConfig) -> JobConfig:
    """Resolve interpolations and build the dataclasses; every ``__post_init__`` check runs here."""
    job = OmegaConf.to_object(cfg)
    if not isinstance(job, JobConfig):
        raise TypeError(f"config did not compose onto JobConfig (got {type(job).__name__})")
    return job


def to_yaml(job: JobConfig) -> str:
    """The job as YAML that reads back as this job: a script's arguments stay verbatim (a ``${`` in one escaped, not
    an interpolation when the ranks load it)."""
    config = OmegaConf.structured(job)
    config.script_args = [literal(arg) for arg in job.script_args]
    return OmegaConf.to_yaml(config)


def literal(text: str) -> str:
    """``text`` as OmegaConf gives it back verbatim: each ``${`` escaped (with the backslashes before it)."""
    return re.sub(r"(\\*)\$\{", lambda m: "\\" * (2 * len(m.group(1)) + 1) + "${", text)


def freeze(job: JobConfig) -> Path:
    """Write the resolved config the workers will run into its run dir, once, on the submitting host."""
    path = job.run.config
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(path, to_yaml(job))


def load_frozen(run_dir: str | Path) -> JobConfig:
    """The job frozen into ``run_dir`` (``freeze``), validated again: an edited or damaged file is a ConfigError
    naming it, not an assertion."""
    path = RunDir(run_dir).config
    raw = OmegaConf.load(path)
    hint = f"HINT: the launcher writes {path} once, before the ranks start; start the job again to write it anew"
    if not isinstance(raw, DictConfig):
        raise ConfigError(f"{path} holds no job (a YAML mapping of cluster, train, ...); {hint}")
    cluster = raw.get("cluster", {})
    kind = cluster.get("kind", "local") if isinstance(cluster, (DictConfig, dict)) else cluster
    if kind not in CLUSTER_SCHEMAS:
        raise ConfigError(f"{path}: cluster.kind={kind!r} is not one of {', '.join(CLUSTER_SCHEMAS)}; {hint}")
    schema = OmegaConf.structured(JobConfig)
    schema.cluster = OmegaConf.structured(CLUSTER_SCHEMAS[kind])
    try:
        merged = OmegaConf.merge(schema, raw)
    except ValidationError as exc:  # a value its field refuses: comm.compress: zstd
        raise ConfigError(f"{path}: {exc.full_key}: {str(exc).splitlines()[0]}; {hint}") from None
    assert isinstance(merged, DictConfig)
    return to_job(merged)


RESUME_KEYS = ("model", "data", "optim.name")  # what a checkpoint cannot be loaded across


def _flat(tree: object, prefix: str = "") -> dict[str, object]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, object] = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def check_resumable(job: JobConfig) -> None:
    """Before anything starts: ``train.resume=auto`` into a run dir whose checkpoints come from a different job
    (another model, data, optimizer or global batch) is refused, with the differing keys named. Another world size
    with the same global batch resumes (the same samples per step, the same schedule)."""
    where = job.run
    old_path = where.config
    if job.train.resume != "auto" or not old_path.is_file() or not list_checkpoints(where.checkpoints):
        return
    old = _flat(OmegaConf.to_container(OmegaConf.load(old_path)))
    new = _flat(OmegaConf.to_container(OmegaConf.structured(job), enum_to_str=True))
    diffs = [
        f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
        for key in sorted(set(old) | set(new))
        if key.startswith(RESUME_KEYS) and old.get(key) != new.get(key)
    ]
    world = lambda c: c.get("cluster.nodes", 1) * (c.get("cluster.procs_per_node") or 1)  # noqa: E731
    batch = lambda c: (c.get("train.batch_size_per_rank") or 0) * world(c) or c.get("train.batch_size")  # noqa: E731
    if batch(old) != batch(new):  # another world size is fine (the trajectory does not depend on it), not this
        fix = f"train.batch_size={batch(old)} train.batch_size_per_rank=null keeps it"
        diffs.insert(0, f"global batch: {batch(old)} -> {batch(new)} (world size {world(old)} -> {world(new)}; {fix})")
    if diffs:
        raise ConfigError(
            f"{where} holds checkpoints of a different job ({'; '.join(diffs)}); HINT: use a new hydra.run.dir, "
            "train.resume=never to start over there, or train.resume=force to load them anyway"
        )


def default_run_name(node_rank: int | None = None, master_addr: str = "", master_port: int = 0) -> str:
    """Run dir name for ``hydra.run.dir``, the same on every rank (or machine) that composes the config itself:
    torchrun's run id, the Slurm job id for srun tasks of a user's sbatch script (a requeued job finds its
    checkpoints), node 0's address and port for machines started by hand (``cluster.node_rank``); else a
    timestamp."""
    if node_rank is not None:
        return f"nodes-{master_addr}-{master_port}"
    env = DistEnv.resolve()
    if env.source == "elastic" and env.launch_id:
        return f"torchrun-{env.launch_id}"
    if env.source == "slurm":
        return f"slurm-{env.launch_id}"
    return datetime.now().strftime("%Y-%m-%d_%H-%M-%S.%f")[:-3]


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("launcher_run_name"):
        OmegaConf.register_new_resolver("launcher_run_name", default_run_name, use_cache=True)
