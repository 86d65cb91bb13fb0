"""Job configuration: typed schema (``schema``) and composition helpers (``load``)."""

from launcher.config.load import CONF_DIR, check_resumable, freeze, load_frozen, register_resolvers, to_job, to_yaml
from launcher.config.schema import (
    ClusterConfig,
    CommConfig,
    ConfigError,
    DataConfig,
    JobConfig,
    OptimConfig,
    SimClusterConfig,
    SlurmClusterConfig,
    SshClusterConfig,
    TrainConfig,
    collective_timeout_s,
    register_configs,
)

__all__ = [
    "CONF_DIR",
    "check_resumable",
    "ClusterConfig",
    "CommConfig",
    "ConfigError",
    "DataConfig",
    "JobConfig",
    "OptimConfig",
    "SimClusterConfig",
    "SlurmClusterConfig",
    "SshClusterConfig",
    "TrainConfig",
    "collective_timeout_s",
    "freeze",
    "load_frozen",
    "register_configs",
    "register_resolvers",
    "to_job",
    "to_yaml",
]
