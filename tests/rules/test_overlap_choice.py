"""Which overlap the bucketed reducer runs (``comm/updates.choose_overlap``) and the trainer's one reason to prefer
the backward overlap itself: under ``comm.compress=auto`` on a link fast enough that nothing is compressed, the
forward overlap's per-bucket work cost more than the wire time it hid (bench/compression.py at 10 Gbit: 0.91x
torch DDP flat with it, 1.04-1.07x with the backward overlap; issue 38)."""

import pytest
import torch

from launcher.comm.policy import fast_link_overlap
from launcher.comm.updates import choose_overlap

SGD = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)


def test_forward_where_it_can_run_unless_a_reason_prefers_backward():
    assert choose_overlap(None, SGD, False) == ("forward", None)
    assert choose_overlap(None, SGD, False, "none", "a fast link") == ("backward", "a fast link")
    assert choose_overlap("forward", SGD, False, "none", "a fast link") == ("forward", None)  # asked for: kept
    assert choose_overlap(None, SGD, False, "powersgd")[1].startswith("PowerSGD")
    assert choose_overlap(None, None, False, "none", "a fast link")[1].startswith("no optimizer")  # refusal first
    with pytest.raises(ValueError, match="overlap='forward' cannot run here: find_unused_parameters"):
        choose_overlap("forward", SGD, True)


@pytest.mark.parametrize(
    ("compress", "chosen", "nodes", "backward"),
    [
        ("auto", "none", 2, True),  # auto compressed nothing across nodes: a fast link
        ("auto", "bf16", 2, False),  # a slow link: the forward overlap hides the wire time
        ("auto", "none", 1, False),  # one node: no link was judged
        ("none", "none", 2, False),  # the default: the forward overlap, as before
    ],
)
def test_compress_auto_on_a_fast_link_prefers_the_backward_overlap(compress, chosen, nodes, backward):
    why = fast_link_overlap(compress, chosen, nodes)
    assert (why is not None) == backward
    if backward:
        assert why.startswith("comm.compress=auto: a fast link, nothing compressed")
