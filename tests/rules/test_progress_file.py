"""A rank's progress file leaves out a group's members when they are every rank of the job (at 1,024 ranks the
list made every file 7 KB, read once a second each by rank 0: bench/scale.py); readers take None as every rank."""

import json

from launcher.base.env import DistEnv
from launcher.base.run_dir import RunDir
from launcher.watch import publisher as publisher_module
from launcher.watch.publisher import Publisher
from launcher.watch.reporter import group_label
from launcher.watch.stragglers import Stragglers


class _Recorder:
    descs = {"0": "default_pg", "7": "undefined"}

    def status(self):
        return {"0": (3, 3), "7": (1, 1)}

    def arrivals(self, limit):
        return []


def test_members_of_every_rank_are_left_out_and_read_back_as_every_rank(tmp_path, monkeypatch):
    monkeypatch.setattr(publisher_module.recorder, "members", lambda: {"0": [0, 1, 2], "7": [1, 2]})
    pub = Publisher(RunDir(tmp_path), DistEnv(rank=1, world_size=3, local_world_size=1, node_rank=1, num_nodes=3))
    pub.recorder = _Recorder()
    pub.beat(with_arrivals=False)
    groups = json.loads(pub.path.read_text())["groups"]
    assert groups["0"]["members"] is None and groups["7"]["members"] == [1, 2], groups
    assert group_label("7", {"groups": groups}) == "group 7 (ranks 1,2)"
    assert group_label("9", {"groups": {"9": {"members": None}}}) == "group 9 (every rank)"
    stragglers = Stragglers(tmp_path, print, world=3)
    stragglers.ranks = {1: {"groups": groups}}
    assert stragglers._members("0") == [0, 1, 2] and stragglers._members("7") == [1, 2]
