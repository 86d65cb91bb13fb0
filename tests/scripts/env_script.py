"""A torchrun-compatible script that records what it was told (RANK & co.) and checks an allreduce."""

import json
import os
import sys

import torch
import torch.distributed as dist

out_dir = sys.argv[1]
dist.init_process_group("gloo")
seen = {
    k: os.environ.get(k)
    for k in (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "SLURMD_NODENAME",
        "SLURM_PROCID",
    )
}
total = torch.ones(1) * (int(os.environ["RANK"]) + 1)
dist.all_reduce(total)
seen["allreduce"] = total.item()
with open(os.path.join(out_dir, f"rank-{os.environ['RANK']}.json"), "w") as f:
    json.dump(seen, f)
dist.destroy_process_group()
