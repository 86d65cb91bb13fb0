"""Issue 49 (item 3): ``launcher.mesh()`` hands a ``script=`` job the launcher's topology as a DeviceMesh: on 2
simulated nodes x 2 ranks an FSDP2 script on it (HSDP: dims replicate x shard = 2 x 2) trains what the same script on
the flat mesh (``shard="world"``) trains, and what one process trains on the whole batch. Its shard groups are the
job's nodes: each the ranks one node's agent started (their parent process), its replicate groups one rank of each
(read by a wrapper around the script: the groups of the mesh it was handed)."""

import json

import pytest
import torch

from harness import REPO, path_override
from harness.run import run_launcher

SCRIPT = REPO / "tests" / "scripts" / "fsdp_mesh_script.py"
SIM = ("+cluster=sim", "cluster.nodes=2", "cluster.procs_per_node=2")
ON_MESH = """import json, os, runpy, sys
import torch.distributed as dist
import launcher

made = launcher.mesh


def recorded(*args, **kwargs):
    mesh = made(*args, **kwargs)
    groups = {dim: dist.get_process_group_ranks(mesh.get_group(dim)) for dim in mesh.mesh_dim_names}
    out = next(a.removeprefix("--out=") for a in sys.argv if a.startswith("--out="))
    with open(f"{out}.rank-{dist.get_rank()}", "w") as f:
        json.dump({"groups": groups, "agent": os.getppid(), "node": os.environ["GROUP_RANK"]}, f)
    return mesh


launcher.mesh = recorded
sys.argv = sys.argv[1:]  # the script, then its own arguments
runpy.run_path(sys.argv[0], run_name="__main__")
"""


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
    wrapper = tmp_path / "on_mesh.py"
    wrapper.write_text(ON_MESH)
    seen, ranks = {}, {}
    for name, flag in (("node", ()), ("world", ("--flat",))):
        out = tmp_path / f"{name}.json"
        args = (path_override("script", wrapper), *SIM, "--", str(SCRIPT), f"--out={out}", *flag)
        result = run_launcher(*args, run_dir=tmp_path / name)
        assert result.returncode == 0, result.stderr[-3000:]
        seen[name] = json.loads(out.read_text())
        ranks[name] = [json.loads(tmp_path.joinpath(f"{name}.json.rank-{r}").read_text()) for r in range(4)]
    assert (seen["node"]["dims"], seen["node"]["shape"]) == (["replicate", "shard"], [2, 2])  # HSDP
    assert (seen["world"]["dims"], seen["world"]["shape"]) == (["shard"], [4])
    node = ranks["node"]
    agents = [r["agent"] for r in node]
    assert len(set(agents)) == 2 and [r["node"] for r in node] == ["0", "0", "1", "1"], node  # (ranks node by node)
    for rank, mine in enumerate(node):
        assert mine["groups"]["shard"] == [r for r in range(4) if agents[r] == mine["agent"]], (rank, node)
        assert mine["groups"]["replicate"] == [r for r in range(4) if r % 2 == rank % 2], (rank, node)
    assert all(r["groups"] == {"shard": [0, 1, 2, 3]} for r in ranks["world"]), ranks["world"]
    reference = one_process_losses()
    assert seen["node"]["losses"] == pytest.approx(reference, rel=1e-5), (seen, reference)
    assert seen["world"]["losses"] == pytest.approx(reference, rel=1e-5), (seen, reference)
    assert reference[-1] < reference[0]
