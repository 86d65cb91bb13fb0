"""Which overlap the bucketed reducer runs (``comm/updates.choose_overlap``) and the trainer's one reason to prefer
the backward overlap itself: under ``comm.compress=auto`` on a link fast enough that nothing is compressed, the
forward overlap's per-bucket work cost more than the wire time it hid (bench/compression.py at 10 Gbit: 0.91x
torch DDP flat with it, 1.04-1.07x with the backward overlap; issue 38)."""

import pytest
import torch

from launcher.base.sync_modes import Compress, Overlap
from launcher.comm.policy import fast_link_overlap
from launcher.comm.updates import choose_overlap, forward_overlap_refusal

SGD = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
CAN = forward_overlap_refusal(SGD, False)  # None: the forward overlap can run


def test_forward_where_it_can_run_unless_a_reason_prefers_backward():
    assert CAN is None
    assert choose_overlap(None, CAN) == (Overlap.forward, None)
    assert choose_overlap(None, CAN, Compress.none, "a fast link") == (Overlap.backward, "a fast link")
    assert choose_overlap("forward", CAN, Compress.none, "a fast link") == (Overlap.forward, None)  # asked: kept
    assert choose_overlap(Overlap.backward, CAN, Compress.none, "the plan's") == (Overlap.backward, "the plan's")
    assert choose_overlap(None, CAN, Compress.powersgd)[1].startswith("PowerSGD")
    no_optimizer = forward_overlap_refusal(None, False)
    assert choose_overlap(None, no_optimizer, Compress.none, "a fast link")[1].startswith("no optimizer")  # first
    with pytest.raises(ValueError, match="overlap='forward' cannot run here: find_unused_parameters"):
        choose_overlap("forward", forward_overlap_refusal(SGD, True))
    with pytest.raises(ValueError, match="overlap='sideways'; HINT: 'forward', 'backward' or None"):
        choose_overlap("sideways", CAN)


@pytest.mark.parametrize(
    ("compress", "chosen", "nodes", "backward"),
    [
        (Compress.auto, Compress.none, 2, True),  # auto compressed nothing across nodes: a fast link
        (Compress.auto, Compress.bf16, 2, False),  # a slow link: the forward overlap hides the wire time
        (Compress.auto, Compress.none, 1, False),  # one node: no link was judged
        (Compress.none, Compress.none, 2, False),  # the default: the forward overlap, as before
    ],
)
def test_compress_auto_on_a_fast_link_prefers_the_backward_overlap(compress, chosen, nodes, backward):
    why = fast_link_overlap(compress, chosen, nodes)
    assert (why is not None) == backward
    if backward:
        assert why.startswith("comm.compress=auto: a fast link, nothing compressed")
