"""GPU choice by free memory (the d2l notes' nvidia-smi recipe), with a fake nvidia-smi on PATH."""

import pytest

from launcher.base.gpus import by_free_memory, free_memory_mib

FAKE = """#!/bin/sh
# answers: nvidia-smi --query-gpu=index,memory.free --format=csv,noheader,nounits
printf '0, 1200\\n1, 30500\\n2, 30500\\n3, 8000\\n'
"""


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    tool = tmp_path / "nvidia-smi"
    tool.write_text(FAKE)
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)  # force the nvidia-smi path


def test_free_memory_from_nvidia_smi(fake_smi):
    assert free_memory_mib() == {0: 1200, 1: 30500, 2: 30500, 3: 8000}


def test_most_free_first_ties_by_index(fake_smi):
    assert by_free_memory(2, environ={}) == "1,2"
    assert by_free_memory(4, environ={}) == "1,2,3,0"


def test_respects_visible_devices(fake_smi):
    assert by_free_memory(2, environ={"CUDA_VISIBLE_DEVICES": "0,3"}) == "3,0"


def test_not_enough_gpus_is_named(fake_smi):
    with pytest.raises(RuntimeError, match=r"needs 5 GPU\(s\) but found 4 .*HINT: cluster.gpu_select=index"):
        by_free_memory(5, environ={})
