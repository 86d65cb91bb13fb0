"""Issue 49: ``launcher.mesh()`` refuses what it cannot build, naming the fix (no process group yet, an unknown
``shard``)."""

import pytest

import launcher


def test_the_mesh_needs_the_process_group_and_a_known_shard():
    with pytest.raises(ValueError, match=r"launcher.mesh\(shard='rows'\); HINT: shard='node'"):
        launcher.mesh(shard="rows")
    with pytest.raises(RuntimeError, match=r"needs the job's process group; HINT: call dist.init_process_group\(\)"):
        launcher.mesh()
