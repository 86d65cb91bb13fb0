"""Which checkpoints exist, read torch-free by the head (the stop line, the keeper's membership records) as the
trainer writes them: a replicated job's ``step-N.pt`` files and a sharded job's ``step-N/`` directories, the latter
only once whole (DCP's ``.metadata`` and rank 0's ``train.pt`` in it); a directory being written (``.tmp``), one
being replaced (``.old``) or one without either file is never the newest. (Torch-free: pyproject.toml's head-side
contract.)"""

from pathlib import Path

from launcher.base.checkpoint_names import (
    DCP_METADATA,
    TRAIN_STATE,
    checkpoint_path,
    leftovers,
    list_checkpoints,
    newest,
    newest_step,
    sharded_path,
)
from launcher.base.run_dir import RunDir
from launcher.report.stops import stop_message


def sharded(directory: Path, step: int, *files: str, suffix: str = "") -> Path:
    """A sharded checkpoint's directory at ``step`` holding ``files`` (empty)."""
    path = sharded_path(directory, step).with_name(f"step-{step:08d}{suffix}")
    path.mkdir(parents=True)
    for name in files:
        (path / name).write_bytes(b"")
    return path


WHOLE = (DCP_METADATA, TRAIN_STATE, "__0_0.distcp", "__1_0.distcp", "own-0.pt", "own-1.pt")


def test_only_whole_sharded_directories_count(tmp_path):
    whole = sharded(tmp_path, 20, *WHOLE)
    assert newest(tmp_path) == whole and newest_step(tmp_path) == 20
    being_written = sharded(tmp_path, 40, *WHOLE, suffix=".tmp")  # renamed only once whole
    being_replaced = sharded(tmp_path, 50, *WHOLE, suffix=".old")
    no_metadata = sharded(tmp_path, 30, TRAIN_STATE, "__0_0.distcp")  # DCP's coordinator had not finished
    no_train_state = sharded(tmp_path, 35, DCP_METADATA, "__0_0.distcp")
    sharded(tmp_path, 60, *WHOLE, suffix=".pt.tmp")  # nor anything else named near it
    (tmp_path / "step-00000070.pt.sha256").write_text("0\n")
    assert list_checkpoints(tmp_path) == [whole]
    assert newest_step(tmp_path) == 20
    assert sorted(leftovers(tmp_path)) == [being_written, being_replaced]  # what rank 0 clears (not the others:
    assert no_metadata.exists() and no_train_state.exists()  # not its own names, left to whoever made them)


def test_files_and_directories_are_ordered_by_step(tmp_path):
    """A run dir may hold both (a replicated run continued as a sharded one is refused at resume, not hidden)."""
    for step in (5, 100):
        checkpoint_path(tmp_path, step).write_bytes(b"")
    sharded(tmp_path, 7, *WHOLE)
    sharded(tmp_path, 20, *WHOLE)
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "step-00000005.pt",
        "step-00000007",
        "step-00000020",
        "step-00000100.pt",
    ]
    assert newest_step(tmp_path) == 100
    assert newest(tmp_path / "missing") is None and newest_step(tmp_path / "missing") is None


def test_stop_line_names_a_sharded_checkpoint(tmp_path):
    """The resume command the stop line prints, for a sharded job: its newest whole directory."""
    checkpoints = tmp_path / "checkpoints"
    sharded(checkpoints, 10, *WHOLE)
    sharded(checkpoints, 12, *WHOLE, suffix=".tmp")  # the stop's own write, cut short
    assert stop_message(143, RunDir(tmp_path), script=False) == (
        f"launcher: stopped by SIGTERM; the newest checkpoint is {checkpoints / 'step-00000010'} (step 10): run "
        f"again with hydra.run.dir={tmp_path} to continue from it"
    )
