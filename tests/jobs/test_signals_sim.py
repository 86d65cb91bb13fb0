"""The stop-signal matrix's cells on simulated nodes (tests/harness/stops.py): the sim head of 2 nodes x 1 rank, and
the same job healing in place (``cluster.min_nodes=1``: its keeper runs, and a stop must not read as a lost
node)."""

import pytest

from harness import heads
from harness.run import launcher_argv
from harness.stops import Cell, Outcome, cells, check, drive, drive_all, popen_logged, processes_of, selected

MODES = ("sim", "sim-healing")
SIM = ("+cluster=sim", "cluster.nodes=2", "cluster.procs_per_node=1")


def driver(cell: Cell, base):
    run_dir, log = base / cell.id / "run", base / cell.id / "head.log"
    healing = ("cluster.min_nodes=1",) if cell.mode == "sim-healing" else ()
    argv = launcher_argv(run_dir, *SIM, *healing, *cell.program_args(run_dir))

    def start() -> list[heads.Process]:
        return [popen_logged(argv, log)]

    def run() -> Outcome:
        run_dir.mkdir(parents=True)
        return drive(cell, start, run_dir, [log], 2, lambda: processes_of(run_dir))

    return run


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory):
    base = tmp_path_factory.mktemp("signals")
    return drive_all(lambda cell: driver(cell, base), selected(request))


@pytest.mark.parametrize("cell", cells(*MODES), ids=lambda c: c.id)
def test_a_stop_signal(outcomes, cell):
    out = outcomes[cell]
    check(out)
    assert "lost node" not in out.logs[0], out.tail()  # a stop is no lost machine, healing or not
