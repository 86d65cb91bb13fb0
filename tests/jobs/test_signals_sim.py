"""The stop-signal matrix's cells on simulated nodes (tests/harness/stops.py): the sim head of 2 nodes x 1 rank, and
the same job healing in place (``cluster.min_nodes=1``: its keeper runs, and a stop must not read as a lost
node)."""

import pytest

from harness.run import launcher_argv
from harness.stops import Cell, cells, check, drive_module, job

MODES = ("sim", "sim-healing")
SIM = ("+cluster=sim", "cluster.nodes=2", "cluster.procs_per_node=1")


def driver(cell: Cell, base):
    run_dir, healing = base / cell.id / "run", ("cluster.min_nodes=1",) if cell.mode == "sim-healing" else ()
    argv = launcher_argv(run_dir, *SIM, *healing, *cell.program_args(run_dir))
    return job(cell, run_dir, lambda: [argv], [base / cell.id / "head.log"])


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory):
    return drive_module(request, tmp_path_factory.mktemp("signals"), driver)


@pytest.mark.parametrize("cell", cells(*MODES), ids=lambda c: c.id)
def test_a_stop_signal(outcomes, cell):
    out = outcomes[cell]
    check(out)
    assert "lost node" not in out.logs[0], out.tail()  # a stop is no lost machine, healing or not
