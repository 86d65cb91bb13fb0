"""The sync and the training state are types (issue 57): each kind is a class of its own behind one protocol, and
no method of theirs asks which kind it is; "is this job sharded?" has one answer (``Reducer.sharded``, read by
``SyncPlan.sharded``); nothing in the trainer or healing decides by a missing attribute."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from launcher.comm.sync import BaseSync, Sync
from launcher.comm.sync_kinds import BucketedSync, DdpSync, ShardedSync
from launcher.train.state import ReplicatedState, ShardedState, TrainState

ROOT = Path(__file__).resolve().parents[2] / "launcher"
KIND_MODULES = ["comm/sync.py", "comm/sync_kinds.py", "train/state.py"]


def _methods(path: Path) -> list[tuple[str, ast.FunctionDef]]:
    tree = ast.parse(path.read_text())
    return [
        (f"{cls.name}.{fn.name}", fn)
        for cls in tree.body
        if isinstance(cls, ast.ClassDef)
        for fn in cls.body
        if isinstance(fn, ast.FunctionDef)
    ]


def _asks_its_kind(fn: ast.FunctionDef) -> list[str]:
    """What in ``fn`` tells kinds apart: a comm mode (``Reducer.x``), the ``sharded`` fact, ``isinstance(self``."""
    found = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Reducer":
            found.append(f"Reducer.{node.attr}")
        elif isinstance(node, ast.Attribute) and node.attr == "sharded":
            found.append(f".sharded (line {node.lineno})")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "isinstance"
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id == "self"
        ):
            found.append("isinstance(self, ...)")
    return found


@pytest.mark.parametrize("module", KIND_MODULES)
def test_no_method_of_a_kind_asks_which_kind_it_is(module):
    asking = {name: what for name, fn in _methods(ROOT / module) if (what := _asks_its_kind(fn))}
    assert not asking, f"{module}: methods branching on their kind (make it a method of each kind): {asking}"


@pytest.mark.parametrize("kind", [DdpSync, BucketedSync, ShardedSync])
def test_every_sync_kind_has_the_whole_protocol(kind):
    wanted = {name for name in vars(Sync) if not name.startswith("_")} - {"plan", "topology", "module", "description"}
    assert issubclass(kind, BaseSync) and wanted <= set(dir(kind)), sorted(wanted - set(dir(kind)))


def test_each_state_kind_owns_its_weights_save_load_and_regroup():
    owned = {"weights", "load_weights", "load_file", "save"}
    for kind in (ReplicatedState, ShardedState):
        assert owned <= set(vars(kind)), (kind.__name__, sorted(owned - set(vars(kind))))
    assert "regroup" in vars(ShardedState) and vars(TrainState)["regroup"] is TrainState.regroup
    assert ShardedState.by_place and not ReplicatedState.by_place


def test_is_this_job_sharded_has_one_answer():
    """``sharded`` is defined as a fact twice only: the config's choice (``Reducer``) and the plan reading it."""
    defined = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name == "sharded":
                defined.append(str(path.relative_to(ROOT)))
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Attribute) and target.attr == "sharded":
                        defined.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert sorted(defined) == ["base/sync_modes.py", "comm/sync_plan.py"], defined


@pytest.mark.parametrize("folder", ["train", "heal"])
def test_nothing_decides_by_a_missing_attribute(folder):
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and node.args
                and isinstance(node.args[0], ast.Name)
                and node.args[0].id == "self"
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.func.id}(self, ...)")
    assert not found, found


MODES = {"reducer", "hierarchical", "overlap", "compress", "shard", "backend"}  # comm.*'s Enums (base/sync_modes.py)


def test_no_comm_mode_is_compared_as_text():
    """``job.comm.backend == "auto"`` breaks silently when a value is renamed; a member (``is Backend.auto``) fails
    at import."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            moded = any(isinstance(s, ast.Attribute) and s.attr in MODES for s in sides)
            texts = [s for s in sides if isinstance(s, ast.Constant) and isinstance(s.value, str)]
            texts += [e for s in sides if isinstance(s, (ast.Tuple, ast.List, ast.Set)) for e in s.elts]
            if moded and any(isinstance(t, ast.Constant) and isinstance(t.value, str) for t in texts):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found


def test_comm_backend_is_a_choice():
    from launcher.base.sync_modes import Backend
    from launcher.config.comm import CommConfig
    from launcher.config.errors import ConfigError

    assert CommConfig(backend="nccl").backend is Backend.nccl
    with pytest.raises(
        ConfigError, match=r"^comm.backend='mpi' is not a choice; HINT: comm.backend=auto, gloo or nccl$"
    ):
        CommConfig(backend="mpi")
