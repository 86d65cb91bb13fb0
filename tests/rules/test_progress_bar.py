"""A tqdm bar on rank 0 (docs/watching.md): the steps' bar is drawn on rank 0's console when it is a terminal, from
the step a resumed run starts at; on the other ranks, and on a console that is no terminal (a log file, CI), none.
The trainer's loop draws it so (``Trainer._fit`` on a stand-in trainer: no process)."""

import io
from types import SimpleNamespace
from typing import Any, cast

from launcher.base.env import DistEnv
from launcher.train import records
from launcher.train.stop import Stopped
from launcher.train.trainer import Trainer


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def drawn(main: bool, console: io.StringIO, monkeypatch) -> str:
    monkeypatch.setattr(records, "console_stream", lambda: console)
    with records.progress_bar(total=40, initial=10, main=main) as bar:
        bar.update(5)
        bar.refresh()
    return console.getvalue()


def test_rank_0_draws_the_steps_bar_on_its_terminal(monkeypatch):
    shown = drawn(True, Terminal(), monkeypatch)
    assert "15/40" in shown and "step" in shown, shown


def test_no_bar_on_other_ranks_nor_into_a_file(monkeypatch):
    assert drawn(False, Terminal(), monkeypatch) == ""
    assert drawn(True, io.StringIO(), monkeypatch) == ""  # (not a terminal: tqdm's disable=None)


class Resumed:
    """What ``Trainer._fit`` reads of a trainer (rank ``rank`` of 2), resumed at step 10 of 40; its round trains 5
    steps on the bar the trainer draws, then stops."""

    def __init__(self, rank: int) -> None:
        self.env = DistEnv(rank=rank, local_rank=rank, world_size=2, local_world_size=2)
        self.state = SimpleNamespace(span=SimpleNamespace(total_steps=40), pos=SimpleNamespace(step=10))
        self.checkpointer = SimpleNamespace(resume=lambda *_: "step-10", wait=lambda _: None)
        self.job, self.totals = SimpleNamespace(train=SimpleNamespace(seed=0)), None
        self.seam, self.group, self.stop = SimpleNamespace(start=lambda _: None), None, None

    def _round(self, bar) -> Stopped:
        bar.update(5)
        bar.refresh()
        return Stopped(step=15, signum=0)


def test_the_trainers_bar_is_rank_0s_alone_from_the_step_it_resumes_at(monkeypatch):
    """The trainer's own loop (``Trainer._fit``), not the bar's helper alone: rank 0 of a run resumed at step 10
    shows 15/40 after 5 steps; rank 1, on a terminal too, shows nothing."""
    shown = {}
    for rank in (0, 1):
        console = Terminal()
        monkeypatch.setattr(records, "console_stream", lambda console=console: console)
        assert Trainer._fit(cast(Any, Resumed(rank))) == Stopped(step=15, signum=0)
        shown[rank] = console.getvalue()
    assert "15/40" in shown[0] and "step" in shown[0], shown[0]
    assert shown[1] == "", shown[1]
