"""Job configuration: typed schema (``schema``) and composition helpers (``load``)."""

from .load import freeze, load_frozen, register_resolvers, to_job, to_yaml
from .schema import (
    ClusterConfig,
    CommConfig,
    ConfigError,
    DataConfig,
    JobConfig,
    OptimConfig,
    SimClusterConfig,
    SlurmClusterConfig,
    TrainConfig,
    register_configs,
)

__all__ = [
    "ClusterConfig",
    "CommConfig",
    "ConfigError",
    "DataConfig",
    "JobConfig",
    "OptimConfig",
    "SimClusterConfig",
    "SlurmClusterConfig",
    "TrainConfig",
    "freeze",
    "load_frozen",
    "register_configs",
    "register_resolvers",
    "to_job",
    "to_yaml",
]
