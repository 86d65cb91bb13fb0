"""Fault injection for the failure tests (and for trying the failure paths yourself): ``LAUNCHER_FAULT``.

``LAUNCHER_FAULT="step=K[,rank=R][,signal=SIG|,stall][,target=parent][,backward][,attempt=A][;...more faults]"``

- rank R (default 0) raises at optimiser step K; ``signal=USR2|KILL|TERM|INT`` sends that signal to itself
  instead (``target=parent``: to its parent, the launcher or elastic agent; ``target=node``: to its agent and
  every worker of that agent, as when the machine is lost); ``stall`` blocks forever, as a rank stuck in user code
  or a driver would;
- ``step=0`` acts before the rank joins the process group (a rank that never joins);
- ``backward``: acts inside step K's backward pass (from a gradient hook: the first parameter's, or under FSDP2 the
  first layer's output's), while the peers wait inside the step's gradient allreduce;
- ``slow=F``: from step K on, rank R takes F times as long per step (a straggler: each forward first waits
  F - 1 times the work the rank did since the previous one);
- ``delay=S``: from step K on, rank R spends S seconds more on each step (a job slow enough for a test to act
  while it runs: unlike ``slow``, a pause between steps, e.g. a heal, adds nothing); ``while=PATH``: only while
  that file exists (the test removes it when it has seen what it waited for);
- ``write=S``: step K's checkpoint on rank R takes S seconds more to be made whole (before rank 0's file is
  written, or a sharded directory renamed; under ``train.checkpoint_async`` on the writer thread): a write in
  flight for a test to kill a rank in;
- ``attempt=A``: only in attempt A (the DistEnv's 0-based attempt: elastic or head restarts, Slurm requeues);
- several faults are separated by ``;`` (e.g. one preemption per attempt).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

from launcher.base.env import DistEnv
from launcher.base.exiting import children

FAULT_ENV = "LAUNCHER_FAULT"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fault:
    step: int
    rank: int = 0
    signum: Optional[int] = None
    stall: bool = False
    target: str = "self"
    backward: bool = False
    slow: float = 0.0
    delay: float = 0.0
    while_path: str = ""
    write: float = 0.0

    def hold_write(self) -> None:
        """``write=S``: the checkpoint of this step, slower to complete (called where it would be made whole)."""
        if self.write:
            log.warning(
                "%s: the checkpoint of step %d waits %g s before it is made whole", FAULT_ENV, self.step, self.write
            )
            time.sleep(self.write)  # simulated slow storage, not synchronisation

    def fire(self) -> None:
        log.warning("%s: firing %s at step %d", FAULT_ENV, self, self.step)  # the rank's log says when
        if self.stall:
            threading.Event().wait()  # forever: only the launcher ends this rank
        if self.signum is None:
            raise RuntimeError(f"injected fault at step {self.step} on rank {self.rank} ({FAULT_ENV})")
        if self.target == "node":  # the machine is lost: its agent first (it must not react), then its workers
            agent = os.getppid()
            for pid in [agent, *(p for p in children(agent) if p != os.getpid())]:
                os.kill(pid, self.signum)
        os.kill(os.getppid() if self.target == "parent" else os.getpid(), self.signum)


def fire_at(faults: dict[int, Fault], step: int, model: Any) -> None:
    """The trainer, before step ``step``: fire its fault now, inside its backward pass when the first layer's
    gradient is computed (the last buckets are already in flight), or slow the rank down from now on."""
    fault = faults.get(step)
    if fault is None or fault.write:  # (write=S: the checkpointer's)
        return
    if fault.slow:
        model.register_forward_pre_hook(_SlowDown(fault.slow))
    elif fault.delay:
        model.register_forward_pre_hook(_Delay(fault.delay, fault.while_path))
    elif fault.backward:
        first = next(p for p in model.parameters() if p.requires_grad)
        if type(first).__name__ != "DTensor":
            first.register_hook(lambda grad: fault.fire())
        else:  # FSDP2's shards get no gradient hook of their own: the first layer's output's gradient, then
            _on_first_layers_gradient(model, fault)
    else:
        fault.fire()


def _on_first_layers_gradient(model: Any, fault: Fault) -> None:
    """Fire ``fault`` when the backward reaches the first module holding parameters (its output's gradient)."""
    layer = next(m for m in model.modules() if any(True for _ in m.parameters(recurse=False)))

    def forward_hook(module: Any, args: Any, output: Any) -> None:
        if getattr(output, "requires_grad", False):
            output.register_hook(lambda grad: fault.fire())
            handle.remove()

    handle = layer.register_forward_hook(forward_hook)


class _Delay:
    """A forward pre-hook: waits ``seconds`` (while ``path`` exists, if given)."""

    def __init__(self, seconds: float, path: str) -> None:
        self.seconds, self.path = seconds, path

    def __call__(self, module: Any, args: Any) -> None:
        if not self.path or os.path.exists(self.path):
            time.sleep(self.seconds)  # simulated work, not synchronisation


class _SlowDown:
    """A forward pre-hook: waits ``factor - 1`` times the work done since the previous forward ended waiting."""

    def __init__(self, factor: float) -> None:
        self.factor, self.previous = factor, 0.0

    def __call__(self, module: Any, args: Any) -> None:
        now = time.perf_counter()
        if self.previous:
            time.sleep((self.factor - 1) * (now - self.previous))  # simulated work, not synchronisation
        self.previous = time.perf_counter()


def faults_for(env: DistEnv, spec: Optional[str] = None) -> dict[int, Fault]:
    """This rank's faults in this attempt (``env.attempt``: restarts or requeues so far), by step."""
    spec = os.environ.get(FAULT_ENV, "") if spec is None else spec
    rank, attempt = env.rank, str(env.attempt)
    mine = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        fields: dict[str, str] = {}
        for item in part.split(","):
            key, _, value = item.partition("=")
            fields[key] = value if value else "1"
        if fields.get("attempt", attempt) != attempt or int(fields.get("rank", 0)) != rank:
            continue
        fault = Fault(
            step=int(fields["step"]),
            rank=rank,
            stall="stall" in fields,
            target=fields.get("target", "self"),
            backward="backward" in fields,
            slow=float(fields.get("slow", 0)),
            delay=float(fields.get("delay", 0)),
            while_path=fields.get("while", ""),
            write=float(fields.get("write", 0)),
            signum=getattr(signal, f"SIG{fields['signal']}") if "signal" in fields else None,
        )
        mine[fault.step] = fault
    return mine
