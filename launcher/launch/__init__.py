"""Launch modes, one module each, behind one protocol (``mode.py``), asked in this fixed order:

1. ``torchrun``: this process is a rank of torchrun (or any elastic agent): run it here;
2. ``slurm-task``: this process is an srun task of a user's sbatch script: run it here;
3. ``slurm``: ``+cluster=slurm``, submit through submitit;
4. ``ssh``: ``+cluster=ssh``, one elastic agent per host, started over ssh from this head host;
5. ``sim``: ``+cluster=sim``, one elastic agent per virtual node on this host;
6. ``local``: one elastic agent on this host (or, by hand, this machine's node of a several-machine job).

The order is ``MODES`` in ``plan.py``; ``plan_job`` there chooses the mode and plans the job. Nothing is imported
here, so the head-side modules (``ssh``, ``sim``, ``hosts``, ``head``) import without torch.
"""
