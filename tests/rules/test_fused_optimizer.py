"""The trainer's optimizer is torch's fused kernel where it applies (``train/optim.fusable``): the same steps as
the plain optimizer, including a parameter whose first gradient comes after the others' (fused SGD takes every
momentum buffer or none: the trainer creates them up front) and a step over a subset of the parameters (the
forward overlap updates bucket by bucket); never with sparse gradients or the fp16 gradient scaler."""

import pytest
import torch
from torch import nn

from launcher.config import OptimConfig
from launcher.train.optim import build_optimizer, fusable, load_optimizer_state


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.late = nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = self.body(x)
        return self.late(h).sum() + h.sum() if step > 0 else h.sum()  # ``late`` gets no gradient at step 0


def train(optimizer_of, steps: int = 5) -> list[torch.Tensor]:
    model = TwoHeads()
    optimizer = optimizer_of(model)
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        model(torch.randn(4, 8, generator=gen), step).backward()
        if step == 3:  # a step over a subset: the forward overlap's per-bucket update
            late = {id(p) for p in model.late.parameters()}
            saved = {p: p.grad for p in model.parameters() if id(p) in late}
            for p in saved:
                p.grad = None
            optimizer.step()
            for p, grad in saved.items():
                p.grad = grad
            for p in model.parameters():
                if id(p) not in late:
                    p.grad = None
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", ["sgd", "adamw"])
def test_the_fused_optimizer_takes_the_plain_ones_steps(name):
    cfg = OptimConfig(name=name, lr=0.1, momentum=0.9, weight_decay=0.01)
    assert fusable(TwoHeads(), "fp32")
    fused = train(lambda m: build_optimizer(cfg, m, world_size=1))
    assert all(group["fused"] for group in build_optimizer(cfg, TwoHeads(), 1).param_groups)
    if name == "sgd":
        plain = train(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01, foreach=False))
    else:
        plain = train(lambda m: torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.01, foreach=False))
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_not_fused_with_sparse_gradients_or_the_fp16_scaler():
    assert not fusable(TwoHeads(), "fp16")
    assert not fusable(nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2)), "fp32")
    assert fusable(nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 2)), "bf16")
    sparse = nn.Embedding(10, 4, sparse=True)
    optimizer = build_optimizer(OptimConfig(), sparse, world_size=1)
    assert not optimizer.param_groups[0]["fused"]
    sparse(torch.tensor([1, 2])).sum().backward()
    optimizer.step()  # a fused SGD would refuse the sparse gradient


def test_not_fused_where_a_parameter_is_not_contiguous():
    """Our reducer's gradients are contiguous views; a fused kernel walks memory in order, so a ``channels_last``
    weight would take the wrong elements (seen: 21.4 apart after 4 steps): such a model is not fused."""
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    assert not conv.weight.is_contiguous() and not fusable(conv, "fp32")
    assert not build_optimizer(OptimConfig(), conv, world_size=1).param_groups[0]["fused"]


def test_a_resume_keeps_how_this_run_built_its_optimizer():
    """torch's load_state_dict takes the saved groups' flags: a checkpoint written unfused (before the fused kernels)
    would switch fusing off for the rest of the run, and a fused one would pass over ``fusable``."""
    old_model = TwoHeads()
    old = torch.optim.SGD(old_model.parameters(), lr=0.1, momentum=0.9)  # unfused, as before; no buffer for ``late``
    old_model(torch.randn(4, 8), 0).backward()
    old.step()
    saved = old.state_dict()
    assert len(saved["state"]) == 2 and saved["param_groups"][0]["fused"] is None

    model = TwoHeads()
    optimizer = build_optimizer(OptimConfig(), model, world_size=1)
    load_optimizer_state(optimizer, saved)
    assert optimizer.param_groups[0]["fused"] is True
    assert all(optimizer.state[p]["momentum_buffer"] is not None for p in model.parameters())  # ``late``'s: zeros
    model(torch.randn(4, 8), 1).backward()
    optimizer.step()  # every buffer present: the fused kernel takes them

    plain = build_optimizer(OptimConfig(), TwoHeads(), world_size=1, precision="fp16")
    load_optimizer_state(plain, optimizer.state_dict())
    assert not plain.param_groups[0]["fused"]


def test_a_sparse_gradient_it_could_not_foresee_unfuses_the_optimizer(caplog):
    """A functional embedding's sparse gradient (no ``nn.Embedding(sparse=True)`` to see at build time): the fused
    kernel would refuse it; the optimizer steps unfused from then on, the same step as the plain SGD's."""
    table = nn.Parameter(torch.ones(10, 4))
    holder = nn.ParameterList([table])
    optimizer = build_optimizer(OptimConfig(momentum=0.0), holder, world_size=1)
    assert optimizer.param_groups[0]["fused"]
    torch.nn.functional.embedding(torch.tensor([1, 2]), table, sparse=True).sum().backward()
    optimizer.step()
    assert not optimizer.param_groups[0]["fused"] and "sparse gradient" in caplog.text
    assert torch.equal(table[1], torch.full((4,), 0.9)) and torch.equal(table[0], torch.ones(4))
