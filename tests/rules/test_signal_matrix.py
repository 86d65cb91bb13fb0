"""The stop-signal matrix is whole (issue 51, item 3) where paths differ (issue 60): every launch mode under SIGINT and
SIGTERM with both programs, `local` and `slurm` with each program under each, SIGHUP where its path differs from
SIGINT's (``HUP_CELLS``), run by the module ``harness.stops.MODULE_OF_MODE`` names, each cell once."""

from harness import REPO
from harness.stops import HUP_CELLS, MODULE_OF_MODE, PROGRAMS, WHOLE_MODES, cells

MODES = ("local", "torchrun", "by-hand", "sim", "sim-healing", "ssh", "slurm")


def test_every_mode_and_signal_has_its_cells_and_every_program_its_signals():
    assert tuple(MODULE_OF_MODE) == MODES
    every = cells(*MODES)
    assert len({c.id for c in every}) == len(every) == 23
    for mode in MODES:  # every mode under SIGINT and SIGTERM (their paths differ everywhere), both programs
        mine = {(c.sig, c.program) for c in every if c.mode == mode}
        assert {sig for sig, _ in mine} >= {"INT", "TERM"} and {p for _, p in mine} == set(PROGRAMS), (mode, mine)
    for mode in WHOLE_MODES:
        assert {(c.sig, c.program) for c in every if c.mode == mode} >= {
            (s, p) for s in ("INT", "TERM") for p in PROGRAMS
        }
    assert {(c.mode, c.program) for c in every if c.sig == "HUP"} == HUP_CELLS


def test_each_module_parametrizes_the_cells_of_its_modes():
    """A module runs ``cells(*MODES)`` with its ``MODES`` tuple naming exactly the modes the table gives it."""
    for module in set(MODULE_OF_MODE.values()):
        text = (REPO / module).read_text()
        modes = tuple(m for m, where in MODULE_OF_MODE.items() if where == module)
        assert f"MODES = {modes!r}".replace("'", '"') in text, (module, modes)
        assert '@pytest.mark.parametrize("cell", cells(*MODES)' in text, module
