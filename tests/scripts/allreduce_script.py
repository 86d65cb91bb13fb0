"""A plain torchrun-compatible script (knows nothing of the launcher): the d2l notes' allreduce example.
Rank r contributes ones(2) * (r + 1) and writes the sum it receives to OUT_DIR/rank-<r>.txt."""

import os
import sys

import torch
import torch.distributed as dist

out_dir = sys.argv[1]
dist.init_process_group("gloo")  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
rank = int(os.environ["RANK"])
assert int(os.environ["LOCAL_RANK"]) == rank
data = torch.ones(2) * (rank + 1)
dist.all_reduce(data)
with open(os.path.join(out_dir, f"rank-{rank}.txt"), "w") as f:
    f.write(" ".join(str(int(v)) for v in data.tolist()))
print(f"script rank {rank} done")
dist.destroy_process_group()
