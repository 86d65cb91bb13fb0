"""A torchrun-compatible script that records, while the group is up, every TCP listener of the launcher's process
tree (the elastic agent and its workers) into OUT_DIR/listeners.txt: ``ss -ltnpH`` lines of those pids."""

import os
import subprocess
import sys

import torch
import torch.distributed as dist

out_dir = sys.argv[1]
dist.init_process_group("gloo")
dist.all_reduce(torch.ones(1))  # gloo pairs are connected now
if dist.get_rank() == 0:
    agent = os.getppid()
    children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(agent)], capture_output=True, text=True).stdout
    pids = {str(agent), *children.split()}
    lines = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout.splitlines()
    mine = [line for line in lines if any(f"pid={pid}," in line for pid in pids)]
    with open(os.path.join(out_dir, "listeners.txt"), "w") as f:
        f.write("\n".join(mine) + "\n")
dist.barrier()
dist.destroy_process_group()
