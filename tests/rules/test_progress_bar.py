"""A tqdm bar on rank 0 (docs/watching.md): the steps' bar is drawn on rank 0's console when it is a terminal, from
the step a resumed run starts at; on the other ranks, and on a console that is no terminal (a log file, CI), none."""

import io

from launcher.train import records


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
