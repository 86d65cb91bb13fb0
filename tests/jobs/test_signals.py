"""The stop-signal matrix's cells on this machine (tests/harness/stops.py): the launcher's head of a local job,
torchrun running the launcher, and node 0's launcher of a job started by hand (two machines' commands, here on one:
node 0 listens on this machine's own address, as ``cluster.master_addr`` must be reachable from the others)."""

import shutil
import socket
import subprocess

import pytest

from harness.run import launcher_argv
from harness.stops import Cell, cells, check, check_script, drive_module, job, stop_line

MODES = ("local", "torchrun", "by-hand")


def this_machines_address() -> str:
    """This machine's first global IPv4 address (a by-hand job's node 0 refuses a loopback ``master_addr``); the
    cell is skipped, saying why, on a machine without ``ip`` or without such an address (issue 60)."""
    if shutil.which("ip") is None:
        pytest.skip("a by-hand job's cell needs iproute2's ip to find this machine's global IPv4 address")
    out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True, text=True)
    fields = out.stdout.split()
    if len(fields) < 4:
        pytest.skip("a by-hand job's cell needs a global IPv4 address on this machine (node 0 refuses loopback)")
    return fields[3].split("/")[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def argvs(cell: Cell, base, run_dir) -> list[list[str]]:
    args = cell.program_args(run_dir)
    if cell.mode == "local":
        return [launcher_argv(run_dir, "cluster.procs_per_node=2", *args)]
    if cell.mode == "torchrun":
        torchrun = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
        module = (*torchrun, f"--log-dir={base / cell.id / 'torchrun'}", "-m", "launcher")
        return [launcher_argv(run_dir, *args, module=module)]
    where = (f"cluster.master_addr={this_machines_address()}", f"cluster.master_port={free_port()}")
    nodes = ("cluster.nodes=2", "cluster.procs_per_node=1")
    return [launcher_argv(run_dir, *nodes, f"cluster.node_rank={k}", *where, *args) for k in (0, 1)]


def driver(cell: Cell, base):
    logs = [base / cell.id / name for name in ("head.log", "node-1.log")[: 2 if cell.mode == "by-hand" else 1]]
    run_dir = base / cell.id / "run"
    return job(cell, run_dir, lambda: argvs(cell, base, run_dir), logs)


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory):
    return drive_module(request, tmp_path_factory.mktemp("signals"), driver)


@pytest.mark.parametrize("cell", cells(*MODES), ids=lambda c: c.id)
def test_a_stop_signal(outcomes, cell):
    out = outcomes[cell]
    if cell.mode == "by-hand":  # node 1 is told through the rendezvous store: it stops as if it was signalled
        check(out, codes=[cell.code, cell.code])
        told = f"launcher: node 0 was stopped by SIG{cell.sig}: stopping this machine's ranks"
        assert told in out.logs[1] and stop_line(cell, out) in out.logs[1], out.tail()
        if cell.program == "script":  # each machine's launcher says how its own ranks ended
            check_script(cell, out, out.logs[1], [1])
    else:
        check(out, traceback_ok=cell.mode == "torchrun")
    if cell.mode == "torchrun" and cell.program == "trainer":
        assert "launcher: the command: " in out.logs[0], out.tail()
    if cell.mode in ("torchrun", "by-hand") and cell.program == "trainer":  # jobs the head does not start: their
        # ranks get no secret unless one is exported, and say so (docs/security.md); the launcher's own: signed
        unsigned = "store unsigned (no LAUNCHER_SECRET: docs/security.md)"
        assert all(unsigned in (out.run_dir / "logs" / f"rank-{r}.log").read_text() for r in (0, 1)), out.tail()
    elif cell.program == "trainer":
        assert "store signed with the job's secret" in (out.run_dir / "logs" / "rank-1.log").read_text()
