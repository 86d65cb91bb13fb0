"""Sizes in one place: the megabyte the engine's settings speak in (MiB, as torch DDP's ``bucket_cap_mb``) and a
tensor's bytes."""

from __future__ import annotations

import torch

MB = 1024 * 1024
DDP_BUCKET_CAP_MB = 25.0  # torch DDP's default bucket cap


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def mb(tensor: torch.Tensor) -> float:
    return nbytes(tensor) / MB
