"""Launch modes, one module each, behind one protocol (``mode.py``), asked in this fixed order:

1. ``torchrun``: this process is a rank of torchrun (or any elastic agent): run it here;
2. ``slurm-task``: this process is an srun task of a user's sbatch script: run it here;
3. ``slurm``: ``+cluster=slurm``, submit through submitit;
4. ``ssh``: ``+cluster=ssh``, one elastic agent per host, started over ssh from this head host;
5. ``sim``: ``+cluster=sim``, one elastic agent per virtual node on this host;
6. ``local``: one elastic agent on this host (or, by hand, this machine's node of a several-machine job).
"""

from .local import LocalMode
from .mode import BaseMode
from .plan import LaunchPlan, plan_job
from .sim import SimMode
from .slurm import SlurmMode
from .slurm_task import SlurmTaskMode
from .ssh import SshMode
from .torchrun import TorchrunMode

MODES: tuple[BaseMode, ...] = (TorchrunMode(), SlurmTaskMode(), SlurmMode(), SshMode(), SimMode(), LocalMode())

__all__ = ["MODES", "BaseMode", "LaunchPlan", "plan_job"]
