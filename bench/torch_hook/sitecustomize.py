"""For bench/compression_accuracy.py only: with LAUNCHER_BENCH_TORCH_POWERSGD=1 in the environment of a job run with
``comm.reducer=ddp comm.compress=powersgd``, torch DDP gets torch's own ``powerSGD_hook`` (same rank, same warm-up,
error feedback and warm start) where the launcher registers its node-first hook: the same job, torch's compression.
Put on PYTHONPATH by the benchmark; does nothing otherwise."""

import os
import sys

if os.environ.get("LAUNCHER_BENCH_TORCH_POWERSGD") == "1":
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    _register = DistributedDataParallel.register_comm_hook

    def _torch_powersgd(self, state, hook):  # type: ignore[no-untyped-def]
        compression = getattr(state, "compression", None)
        if getattr(compression, "name", "") == "powersgd":
            state = powerSGD_hook.PowerSGDState(
                None, matrix_approximation_rank=compression.rank, start_powerSGD_iter=max(2, compression.warmup_steps)
            )
            hook = powerSGD_hook.powerSGD_hook
            print("bench/torch_hook: torch's powerSGD_hook registered", file=sys.stderr, flush=True)
        return _register(self, state, hook)

    DistributedDataParallel.register_comm_hook = _torch_powersgd
