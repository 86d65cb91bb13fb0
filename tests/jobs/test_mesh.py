"""Issue 49 (item 3): ``launcher.mesh()`` hands a ``script=`` job the launcher's topology as a DeviceMesh: on 2
simulated nodes x 2 ranks an FSDP2 script on it (HSDP: dims replicate x shard = 2 x 2) trains what the same script on
the flat mesh (``shard="world"``) trains, and what one process trains on the whole batch."""

import json

import pytest
import torch

from harness.run import run_launcher

SCRIPT = "script=tests/scripts/fsdp_mesh_script.py"
SIM = ("+cluster=sim", "cluster.nodes=2", "cluster.procs_per_node=2")


def one_process_losses(steps: int = 8) -> list[float]:
    """The script's model and data in one process, on the whole batch (the reference)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)], torch.nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    inputs, targets = torch.randn(64, 32, generator=g), torch.randint(0, 4, (64,), generator=g)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
def test_an_fsdp2_script_on_the_launchers_mesh_trains_what_a_flat_mesh_and_one_process_train(tmp_path):
    seen = {}
    for name, flag in (("node", ()), ("world", ("--flat",))):
        out = tmp_path / f"{name}.json"
        result = run_launcher(SCRIPT, *SIM, "--", f"--out={out}", *flag, run_dir=tmp_path / name)
        assert result.returncode == 0, result.stderr[-3000:]
        seen[name] = json.loads(out.read_text())
    assert (seen["node"]["dims"], seen["node"]["shape"]) == (["replicate", "shard"], [2, 2])  # HSDP
    assert (seen["world"]["dims"], seen["world"]["shape"]) == (["shard"], [4])
    reference = one_process_losses()
    assert seen["node"]["losses"] == pytest.approx(reference, rel=1e-5), (seen, reference)
    assert seen["world"]["losses"] == pytest.approx(reference, rel=1e-5), (seen, reference)
    assert reference[-1] < reference[0]
