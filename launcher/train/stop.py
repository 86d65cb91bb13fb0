"""Stopping on a signal without losing work: the signal handler only records the request; at the next step
boundary every rank learns whether ANY rank was signalled (one tiny MAX allreduce), so all ranks stop at the
same step, write one checkpoint together and leave. Used for Slurm preemption and timeouts (SIGUSR2)."""

from __future__ import annotations

import signal
from typing import Optional

import torch
import torch.distributed as dist


class Preempted(Exception):
    """Raised by the trainer after the stop checkpoint is written."""

    def __init__(self, step: int, signum: int) -> None:
        super().__init__(f"stopped at step {step} on {signal.Signals(signum).name}" if signum else
                         f"stopped at step {step} (another rank was signalled)")
        self.step, self.signum = step, signum


class StopRequest:
    def __init__(self) -> None:
        self.signum: Optional[int] = None

    def install(self, *signums: int) -> "StopRequest":
        for signum in signums:
            signal.signal(signum, self._record)
        return self

    def _record(self, signum: int, frame: object) -> None:
        self.signum = signum

    def agreed(self, device: torch.device) -> bool:
        """Collective: True on every rank if any rank was signalled."""
        flag = torch.tensor([1.0 if self.signum else 0.0], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
