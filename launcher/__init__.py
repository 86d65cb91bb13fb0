"""launcher: one Hydra config, a distributed PyTorch job run locally, under torchrun, or on Slurm.

The names below are imported when first used: importing a head-side module (``launcher.launch.ssh.head``,
``launcher.launch.nodes.restarts``) does not import torch through this package."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from launcher.base.devices import try_all_gpus, try_gpu
    from launcher.base.env import DistEnv
    from launcher.comm.ddp_hook import comm_hook
    from launcher.engine import Engine
    from launcher.group.mesh import mesh
    from launcher.group.rendezvous import process_group

__version__ = "0.1.0"
__all__ = ["DistEnv", "Engine", "comm_hook", "mesh", "process_group", "try_all_gpus", "try_gpu", "__version__"]
_WHERE = {
    "DistEnv": "base.env",
    "Engine": "engine",
    "comm_hook": "comm.ddp_hook",
    "mesh": "group.mesh",
    "process_group": "group.rendezvous",
    "try_all_gpus": "base.devices",
    "try_gpu": "base.devices",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'launcher' has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f".{_WHERE[name]}", __name__), name)
