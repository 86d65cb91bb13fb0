"""bench/'s scripts that measure across network namespaces (root), run small on this host's loopback instead (issue
60, item 4): each one's ``main()`` in this process with its command line, as ``sudo python bench/X.py`` runs it, but
``SimNetwork`` a stand-in without namespaces (``Loopback``) and ``run_in_namespaces`` forking the ranks from
harness.ranks' fork server on loopback, each rank running the script's own ``--worker`` mode with torchrun's
variables, as in a namespace; the model and step counts cut to sizes that take milliseconds (``SMALL``, set in this
process and in every rank). So a change that breaks a script's measurement, its report or its JSON fails here,
without root, for a few CPU seconds; the namespaces themselves are the launcher's (tests/beds/test_sim.py).
What needs more than loopback stays out: the launcher's jobs on simulated nodes (``--trainer``, ``--accuracy``,
your_loop.py's job rows: bench/README.md says which scripts only answer ``--help`` in the suite, and why)."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from harness import REPO, ranks
from harness.run import DEADLINE_S
from launcher.base.env import DistEnv
from launcher.launch.ports import free_port
from models.mlp import MLP

BENCH = REPO / "bench"
Script = Callable[..., str]  # run_small(name, *argv): what the script printed


def small_mlp() -> Any:
    """your_loop.py's model (the trainer's model=mlp), 32 wide and 2 deep."""
    return MLP(in_channels=1, image_size=28, num_classes=10, hidden=32, depth=2)


SIZES = {"WIDTH": 32, "DEPTH": 2, "BATCH": 4, "COMPRESS_WARMUP": 2, "WARMUP": 3, "RUN": 1}  # (torch: warm-up >= 2)
SMALL: dict[str, dict[str, Any]] = {  # each script's module constants, cut (compression starts inside the warm-up)
    "compression": SIZES,
    "fsdp": SIZES,
    "hierarchy": {},  # (its sizes are options)
    "overlap": {"WIDTH": 32, "DEPTH": 2, "RUN": 1},
    "your_loop": {"PER_RANK": 4, "GLOBAL": 16, "COMPRESS_WARMUP": 2, "WARMUP": 3, "RUN": 1, "mlp": small_mlp},
}


class Loopback:
    """``SimNetwork``'s place: no namespace, every node this host's loopback, nothing counted on a link."""

    tag = "loopback"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> Loopback:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def addr(self, node: int) -> str:
        return "127.0.0.1"

    def ifname(self, node: int) -> str:
        return "lo"

    def tx_bytes(self, node: int) -> int:
        return 0


class NoCommands:
    """A rank's ``subprocess``: a rank on loopback runs no command (fsdp.py's ``tc`` would shape the host's own
    loopback)."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"subprocess.{name} in a rank on loopback")


def unshaped(env: DistEnv, gbit: float | None) -> None:
    """fsdp.py's ``shape_link`` on loopback: its barriers, no link shaped."""
    dist.barrier()


def shrink(module: Any) -> None:
    """The script's sizes cut (``SMALL``), its namespaces the loopback's."""
    for name, value in {**SMALL[module.__name__], "SimNetwork": Loopback}.items():
        assert hasattr(module, name), f"bench/{module.__name__}.py has no {name} (SMALL names what it cuts)"
        setattr(module, name, value)


def namespace_rank(name: str, argv: list[str], environ: dict[str, str], out: str) -> None:
    """One rank of ``run_in_namespaces``, forked: ``python bench/NAME.py ARGV`` (its ``--worker`` mode) with the
    rank's variables, its output into ``out``."""
    os.environ.update(environ)
    sys.path.insert(0, str(BENCH))
    module = importlib.import_module(name)
    shrink(module)
    for attr, value in (("shape_link", unshaped), ("subprocess", NoCommands())):
        if hasattr(module, attr):
            setattr(module, attr, value)
    sys.argv = [str(module.__file__), *argv]
    with open(out, "w") as f, contextlib.redirect_stdout(f):
        try:
            module.main()
        except BaseException:
            traceback.print_exc(file=f)  # (what the test shows of a failed rank)
            raise


def on_loopback(name: str, tmp_path: Path) -> Any:
    """``common.run_in_namespaces`` with the ranks forked on loopback (see the module's docstring)."""

    def run_in_namespaces(net: Any, placement: list, per_node: int, port: int, cmd: list) -> dict:
        ctx, port, world = ranks._rank_context(), free_port("127.0.0.1"), len(placement)
        outs = [tmp_path / f"rank-{rank}.out" for rank in range(world)]
        procs = []
        for rank, (node, local) in enumerate(placement):
            where = DistEnv(rank, local, world, per_node, node, world // per_node, "127.0.0.1", port)
            environ = {**where.torchrun_environ(0), "GLOO_SOCKET_IFNAME": "lo"}
            environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
            args = (name, [str(c) for c in cmd[1:]], environ, str(outs[rank]))
            procs.append(ctx.Process(target=namespace_rank, args=args))
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(DEADLINE_S)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        codes = [proc.exitcode for proc in procs]
        said = "\n".join(f"rank {r}: {out.read_text()[-2000:]}" for r, out in enumerate(outs) if codes[r])
        assert codes == [0] * world, f"exit codes {codes}:\n{said}"
        return json.loads(outs[0].read_text().strip().splitlines()[-1])

    return run_in_namespaces


@pytest.fixture
def run_small(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> Iterator[Script]:
    """``run_small(name, *argv)``: ``sudo python bench/NAME.py ARGV...`` on loopback, small; what it printed."""
    monkeypatch.syspath_prepend(str(BENCH))

    def run(name: str, *argv: Any) -> str:
        module = importlib.import_module(name)
        for attr, value in {**SMALL[name], "SimNetwork": Loopback}.items():
            monkeypatch.setattr(module, attr, value)
        monkeypatch.setattr(module, "run_in_namespaces", on_loopback(name, tmp_path))
        monkeypatch.setattr(os, "geteuid", lambda: 0)  # (no namespace: root is not needed)
        monkeypatch.setattr(sys, "argv", [str(module.__file__), *map(str, argv)])
        module.main()
        return capsys.readouterr().out

    yield run
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(BENCH)):
            del sys.modules[name]


def test_compression(run_small: Script, tmp_path: Path) -> None:
    out = tmp_path / "compression.json"
    said = run_small("compression", "--rounds", 1, "--json", out)
    result = json.loads(out.read_text())
    assert set(result) == {"link_gbit", "step_ms", "cap_mb", "link", "auto"}
    assert set(result["step_ms"]) == set(sys.modules["compression"].VARIANTS)
    assert "x torch's hook" in said


def test_hierarchy(run_small: Script, tmp_path: Path) -> None:
    out = tmp_path / "hierarchy.json"
    run_small("hierarchy", "--mb", 0.01, "--reps", 1, "--links", 1, "--json", out)  # (one link: 2 runs of 4 ranks)
    rows = json.loads(out.read_text())["rows"]
    assert [(r["link_gbit"], r["interleaved"]) for r in rows] == [(1.0, False), (1.0, True)]
    assert all(set(r) == {"link_gbit", "interleaved", "ms", "bytes_per_node", "auto"} for r in rows), rows
    assert all(set(r["ms"]) == {"flat", "hierarchical", "auto"} for r in rows), rows


def test_overlap(run_small: Script, tmp_path: Path) -> None:
    """Its rows' keys are bench/overlap.json's (bench/README.md's run); ``--trace`` writes both levels' traces."""
    out = tmp_path / "overlap.json"
    said = run_small("overlap", "--steps", 1, "--json", out, "--trace", tmp_path / "trace")
    rows, recorded = json.loads(out.read_text())["rows"], json.loads((BENCH / "overlap.json").read_text())["rows"]
    assert [set(r) for r in rows] == [set(recorded[0])] * len(recorded)
    assert {(r["factor"], r["variant"]) for r in rows} == {(r["factor"], r["variant"]) for r in recorded}
    assert (tmp_path / "trace-1x.json").exists() and (tmp_path / "trace-2x.json").exists()
    assert "# trace 2x" in said


def test_your_loop(run_small: Script, tmp_path: Path) -> None:
    """The loops only (``--trainer-steps 0``: the job rows are launcher jobs on simulated nodes)."""
    out = tmp_path / "your_loop.json"
    run_small("your_loop", "--rounds", 1, "--trainer-steps", 0, "--json", out)
    result = json.loads(out.read_text())
    assert set(result) == {"link_gbit", "step_ms", "notes", "trainer", "samples_per_s", "x_ddp_plain", "goals"}
    module = sys.modules["your_loop"]
    assert set(result["step_ms"]) == {*module.LOOPS, *module.engine_loops()}


def test_fsdp(run_small: Script, tmp_path: Path) -> None:
    out = tmp_path / "fsdp.json"
    run_small("fsdp", "--rounds", 1, "--json", out)
    result = json.loads(out.read_text())
    figures = {"step_ms", "unshaped_ms", "link_share_ms", "node_tx_mb_per_step", "unshaped_node_tx_mb_per_step"}
    assert set(result) == {"link_gbit", *figures, "bytes_per_rank", "powersgd_matrices", "matrices_ok", "goals"}
    assert all(set(result[k]) == set(sys.modules["fsdp"].VARIANTS) for k in figures), result
