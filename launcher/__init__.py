"""launcher: one Hydra config, a distributed PyTorch job run locally, under torchrun, or on Slurm."""

from .devices import try_all_gpus, try_gpu
from .env import DistEnv
from .rendezvous import process_group

__version__ = "0.1.0"
__all__ = ["DistEnv", "process_group", "try_all_gpus", "try_gpu", "__version__"]
