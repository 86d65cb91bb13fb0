"""A torchrun-compatible script that writes what torchrun's variables it was given (names and values) to
``OUT_DIR/rank-<RANK>.json``, with the threads torch runs (``torch.get_num_threads``), after an allreduce through
its own ``init_process_group`` (the variables must also work). Usage: ``print_torchrun_env.py OUT_DIR``."""

import json
import os
import sys

import torch
import torch.distributed as dist

# What torch's agent gives a worker (LocalElasticAgent._start_workers, torch 2.13) and torchrun itself
# (OMP_NUM_THREADS), listed here, not taken from the launcher's table; every TORCHELASTIC_* seen is kept too.
NAMES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "OMP_NUM_THREADS",
)

out_dir = sys.argv[1]
seen = {k: v for k, v in os.environ.items() if k in NAMES or k.startswith("TORCHELASTIC_")}
dist.init_process_group("gloo")
total = torch.ones(1)
dist.all_reduce(total)
record = {"env": seen, "threads": torch.get_num_threads(), "allreduce": total.item()}
with open(os.path.join(out_dir, f"rank-{os.environ['RANK']}.json"), "w") as f:
    json.dump(record, f, indent=1, sort_keys=True)
dist.barrier()  # without one more collective, rank 0 may leave while a peer still finishes the allreduce
dist.destroy_process_group()
