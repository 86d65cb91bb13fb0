"""The trainer's engine for a user's own training loop (``launcher.Engine``: docs/your-loop.md). It sits between the
rank's work (which hands a ``script=``'s process its job: ``settings.hand_over``) and the trainer's parts it
assembles: the sync (``train/sync.py``), the state and checkpoints (``train/state.py``, ``train/saving.py``), the
loader (``train/data.py``)."""

from launcher.engine.engine import Engine

__all__ = ["Engine"]
