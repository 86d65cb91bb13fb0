"""The stop-signal matrix is whole (issue 51, item 3): every launch mode x SIGINT / SIGTERM x the trainer and a script
has its cell, SIGHUP where its path differs from SIGINT's (``HUP_CELLS``, issue 60), run by the module
``harness.stops.MODULE_OF_MODE`` names, each cell once."""

from harness import REPO
from harness.stops import HUP_CELLS, MODULE_OF_MODE, PROGRAMS, cells

MODES = ("local", "torchrun", "by-hand", "sim", "sim-healing", "ssh", "slurm")


def test_every_mode_signal_and_program_has_one_cell():
    assert tuple(MODULE_OF_MODE) == MODES
    every = cells(*MODES)
    assert len({c.id for c in every}) == len(every) == len(MODES) * 2 * len(PROGRAMS) + len(HUP_CELLS) == 33
    assert {(c.mode, c.program) for c in every if c.sig == "HUP"} == HUP_CELLS
    assert {(c.mode, c.sig, c.program) for c in every} >= {
        (m, s, p) for m in MODES for s in ("INT", "TERM") for p in PROGRAMS
    }


def test_each_module_parametrizes_the_cells_of_its_modes():
    """A module runs ``cells(*MODES)`` with its ``MODES`` tuple naming exactly the modes the table gives it."""
    for module in set(MODULE_OF_MODE.values()):
        text = (REPO / module).read_text()
        modes = tuple(m for m, where in MODULE_OF_MODE.items() if where == module)
        assert f"MODES = {modes!r}".replace("'", '"') in text, (module, modes)
        assert '@pytest.mark.parametrize("cell", cells(*MODES)' in text, module
