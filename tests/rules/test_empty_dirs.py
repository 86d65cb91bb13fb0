"""``files.remove_empty_dirs``: elastic's empty log folders go, a folder with a file stays, and a folder another
node's agent removes meanwhile (machines started by hand share the run dir) is no error (it failed a finished job)."""

import os
import shutil

from launcher.base import files


def test_empty_folders_go_and_a_folder_removed_meanwhile_is_no_error(tmp_path, monkeypatch):
    root = tmp_path / "elastic"
    for sub in ("node-0/run_a/attempt_0/0", "node-1/run_b/attempt_0/1", "node-1/kept"):
        (root / sub).mkdir(parents=True)
    (root / "node-1" / "kept" / "error.json").write_text("{}")
    scandir = os.scandir

    def another_agent_first(path):  # the other node's agent removes its folder just before this walk reaches it
        if str(path).endswith("run_b"):
            shutil.rmtree(path)
        return scandir(path)

    monkeypatch.setattr(os, "scandir", another_agent_first)
    files.remove_empty_dirs(root)
    left = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert left == ["elastic", "elastic/node-1", "elastic/node-1/kept", "elastic/node-1/kept/error.json"], left
