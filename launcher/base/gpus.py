"""GPU choice by free memory, as the d2l notes do it by hand (query nvidia-smi, sort, set CUDA_VISIBLE_DEVICES):
``cluster.gpu_select=free_memory`` orders the GPUs this job may use by free memory, most free first, before any
worker initialises CUDA. NVML (``nvidia-ml-py``) when installed, else ``nvidia-smi``. Also which backend
the job's GPUs (or their absence) call for (``backend_for``). No torch here: the head plans with these."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping


def backend_for(use_gpu: bool) -> str:
    """nccl between GPUs, gloo on CPUs."""
    return "nccl" if use_gpu else "gloo"


def free_memory_mib() -> dict[int, int]:
    """Physical GPU index -> free MiB. Empty when neither NVML nor nvidia-smi answers."""
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        try:
            return {
                i: pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).free // 2**20
                for i in range(pynvml.nvmlDeviceGetCount())
            }
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # not installed, or no driver: fall back to the command line tool
        pass
    if shutil.which("nvidia-smi") is None:
        return {}
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,memory.free", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if out.returncode != 0:
        return {}
    free = {}
    for line in out.stdout.strip().splitlines():
        index, mib = (field.strip() for field in line.split(","))
        free[int(index)] = int(float(mib))
    return free


def by_free_memory(count: int, environ: Mapping[str, str] | None = None) -> str:
    """CUDA_VISIBLE_DEVICES naming the ``count`` GPUs with the most free memory (ties: lower index first),
    chosen among those already visible when CUDA_VISIBLE_DEVICES is set."""
    environ = os.environ if environ is None else environ
    free = free_memory_mib()
    allowed = environ.get("CUDA_VISIBLE_DEVICES")
    if allowed:
        keep = {int(i) for i in allowed.split(",") if i.strip().isdigit()}
        free = {i: m for i, m in free.items() if i in keep}
    if len(free) < count:
        raise RuntimeError(
            f"cluster.gpu_select=free_memory needs {count} GPU(s) but found {len(free)} "
            f"(NVML / nvidia-smi); HINT: cluster.gpu_select=index"
        )
    ranked = sorted(free, key=lambda i: (-free[i], i))
    return ",".join(str(i) for i in ranked[:count])
