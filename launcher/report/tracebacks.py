"""How a rank's failure reads: its traceback without the frames that only carry a rank to its work, and, for a
rank that died without one, the lines of its log that say why (``launcher.report.failures`` writes and reports them)."""

from __future__ import annotations

import traceback

from launcher.base.run_dir import RunDir

# Frames that only carry a rank to its work: runpy, elastic's ``@record`` wrapper, our rank entry, and for a rank in
# the launcher's own process (torchrun, srun) the CLI's, Hydra's and submitit's (the Slurm task's unpickling).
WRAPPER_FRAMES = (
    "runpy",
    "elastic/multiprocessing/errors",
    "launcher/__main__.py",
    "launcher/commands/cli.py",
    "hydra/main.py",
    "hydra/_internal/",
    "hydra/core/utils.py",
    "launcher/launch/torchrun.py",
    "launcher/launch/slurm/task_entry.py",
    "submitit/core/",
    "launcher/rank/entry.py",
    "launcher/rank/work.py",
    "launcher/report/failures.py",
    "launcher/group/failed.py",  # re-raises torch's error of a failed collective as ours (from it: both are shown)
    "/contextlib.py",  # (the with statement that does it)
)


def format_traceback(exc: BaseException) -> str:
    """The traceback as Python prints it, without the frames of WRAPPER_FRAMES; nothing when no frame is left (a
    script's ``sys.exit(2)``, raised on by the rank's own frames: its failure's summary says it all)."""
    kept, skipping = [], False
    for line in "".join(traceback.format_exception(exc)).splitlines():
        if line.startswith('  File "'):
            skipping = any(part in line.split('"')[1] for part in WRAPPER_FRAMES)
        elif not line.startswith("    "):
            skipping = False
        if not skipping:
            kept.append(line)
    if not any(line.startswith('  File "') for line in kept):  # every frame a wrapper's: the summary says it all
        return ""
    return "\n".join(kept)


def log_tail(run_dir: RunDir, rank: int) -> str:
    """A rank that died without a record: why, when its log says (a C++ abort: gloo's "what():  ... Received data
    size doesn't match expected size. Is there a distributed collective mismatch in your code?")."""
    try:
        text = run_dir.rank_log(rank).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    said = [i for i, line in enumerate(text) if "what():" in line or line.startswith("terminate called")]
    return "its log says:\n" + "\n".join("  " + text[i].strip() for i in said[-2:]) if said else ""
