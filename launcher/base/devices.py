"""Devices, as the d2l (Dive into Deep Learning) GPU chapter teaches them: ``try_gpu(i)`` falls back to the CPU,
``try_all_gpus()`` never returns empty.

A rank owns ``cuda:LOCAL_RANK`` when the job uses GPUs; the index is the one the program sees (after
``CUDA_VISIBLE_DEVICES``), not the physical GPU number.
"""

from __future__ import annotations

import random

import torch


def try_gpu(i: int = 0) -> torch.device:
    """GPU ``i`` if it exists, else the CPU."""
    if torch.cuda.device_count() >= i + 1:
        return torch.device(f"cuda:{i}")
    return torch.device("cpu")


def try_all_gpus() -> list[torch.device]:
    """All visible GPUs, or ``[cpu]`` when there are none."""
    devices = [torch.device(f"cuda:{i}") for i in range(torch.cuda.device_count())]
    return devices or [torch.device("cpu")]


def gpu_count() -> int:
    """Visible GPUs (NVML count: does not initialise CUDA, safe before spawning workers)."""
    return torch.cuda.device_count()


def rank_device(local_rank: int, use_gpu: bool) -> torch.device:
    """The device a rank computes on: ``cuda:LOCAL_RANK`` (made current) or the CPU."""
    if not use_gpu:
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise RuntimeError(
            f"local rank {local_rank} needs cuda:{local_rank} but only {torch.cuda.device_count()} GPU(s) are "
            "visible; HINT: set cluster.procs_per_node <= cluster.gpus_per_node"
        )
    device = torch.device(f"cuda:{local_rank}")
    torch.cuda.set_device(device)
    return device


def describe_device(device: torch.device) -> str:
    """``cpu``, or ``cuda:i NAME (GPU-uuid)``: which physical GPU a rank got, as nvidia-smi names it."""
    if device.type != "cuda":
        return str(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    return f"cuda:{index} {props.name}" + (f" (GPU-{uuid})" if uuid else "")


def seed_all(seed: int) -> None:
    """Seed Python, torch's CPU generator and every GPU's generator (``manual_seed_all``)."""
    random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def rng_state() -> dict:
    """Every generator a training step may draw from, to restore a resumed run exactly."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
