"""The stop-signal matrix's cells over ssh (tests/harness/stops.py): the head of a job on the two ssh machines, one
rank each; nothing of it may be left on either machine."""

import pytest

from harness.beds import HOSTS, needs_ssh_machines, wait_nothing_left
from harness.run import launcher_argv
from harness.stops import Cell, cells, check, drive_module, job

pytestmark = needs_ssh_machines
MODES = ("ssh",)


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory, machines):
    ssh = ("+cluster=ssh", f"cluster.hosts=[{','.join(HOSTS)}]", f"cluster.ssh_options=[-F,{machines}/ssh_config]")

    def driver(cell: Cell, base):
        run_dir = base / cell.id / "run"
        argv = launcher_argv(run_dir, *ssh, "cluster.procs_per_node=1", *cell.program_args(run_dir))
        return job(cell, run_dir, lambda: [argv], [base / cell.id / "head.log"])

    return drive_module(request, tmp_path_factory.mktemp("signals"), driver, at_once=2)


@pytest.mark.parametrize("cell", cells(*MODES), ids=lambda c: c.id)
def test_a_stop_signal(outcomes, cell):
    check(outcomes[cell])


def test_nothing_of_the_stopped_jobs_is_left_on_the_machines(outcomes, machines):
    """(A cell's own check looks for its run dir's processes; an ssh session names none: this looks at them all.)"""
    wait_nothing_left(machines)
