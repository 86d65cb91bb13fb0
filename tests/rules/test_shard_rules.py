"""Sharded training's pure rules (``comm.reducer=fsdp``): which modules become FSDP2 units (``comm/shard.py``
``units``), what the sync plan says of the layout (``comm/sync_plan.py``), and the combinations refused with the fix
before any rank starts (``config/comm.py``, ``config/schema.py``)."""

import pytest
import torch
from torch import nn

from harness.config import plan
from launcher.base.sync_modes import Compress, Overlap, Reducer, Shard
from launcher.comm.shard import ShardSpec, units
from launcher.comm.sync_plan import SyncAsk, SyncWorld, plan_sync
from launcher.config import ConfigError


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.attn, self.mlp = nn.Linear(width, width), nn.Linear(width, 4 * width)

    def forward(self, x):
        return self.mlp(self.attn(x))


class Net(nn.Module):
    def __init__(self, tied=False):
        super().__init__()
        self.embed = nn.Embedding(100, 32)
        self.blocks = nn.ModuleList(Block(32) for _ in range(3))
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 100, bias=False)
        if tied:
            self.head.weight = self.embed.weight


def names(model, **spec):
    return [name for name, _ in units(model, ShardSpec(**spec))]


def test_units_are_the_modules_holding_enough_parameters_children_first():
    # Linear(32, 128) holds 4224, Linear(32, 32) 1056, the embedding and the head 3200 each
    assert names(Net(), min_params=3000) == ["embed", "blocks.0.mlp", "blocks.1.mlp", "blocks.2.mlp", "head"]
    # a parent gathers what its children left: each block's attn and mlp together
    assert names(Net(), min_params=5000) == ["blocks.0", "blocks.1", "blocks.2"]


def test_the_classes_named_are_the_units():
    assert names(Net(), unit_classes=("Block",)) == ["blocks.0", "blocks.1", "blocks.2"]
    assert names(Net(), unit_classes=("Block", "Embedding")) == ["embed", "blocks.0", "blocks.1", "blocks.2"]


def test_the_default_size_is_an_eighth_of_a_small_model_without_blocks():
    """No ModuleList of blocks: the size rule, from an eighth of the model (the same modules, in a Sequential)."""
    net = Net()
    flat = nn.Sequential(net.embed, *(module for block in net.blocks for module in (block.attn, block.mlp)), net.head)
    total = sum(p.numel() for p in flat.parameters())  # 22,240: a unit from 2,780 parameters
    assert total // 8 == 2780
    assert names(flat) == ["0", "2", "4", "6", "7"]  # the embedding, each block's mlp, the head


def test_by_default_the_units_are_the_blocks_of_the_models_module_lists():
    """Torch's recipe (a transformer's layers): each block a unit, the embedding and the head with the root; the
    size rule where comm.fsdp_min_params is set."""
    assert names(Net()) == ["blocks.0", "blocks.1", "blocks.2"]
    assert names(Net(), min_params=3000) == ["embed", "blocks.0.mlp", "blocks.1.mlp", "blocks.2.mlp", "head"]


def test_containers_that_are_never_called_are_never_units():
    """The blocks' attn layers left over (3,168 parameters) sit in a ModuleList, which has no forward: FSDP2 would
    never gather them; they stay with the root."""
    assert "blocks" not in names(Net(), min_params=3000)


def test_modules_sharing_a_parameter_are_never_units_of_their_own():
    """Tied weights (the head is the embedding's transpose): FSDP2 refuses a parameter in two units, so both stay
    with the root."""
    assert names(Net(tied=True), min_params=3000) == ["blocks.0.mlp", "blocks.1.mlp", "blocks.2.mlp"]


TWO_BY_TWO = SyncWorld(nodes=2, world_size=4, useful=True, model_bytes=1 << 20)


class NoLinks:
    def strategy_ms(self, numel):
        raise AssertionError("sharded training measures no strategy")

    def link(self, hierarchical):
        raise AssertionError("nothing to measure")


@pytest.mark.parametrize(
    "world, shard, node_first, said",
    [
        (TWO_BY_TWO, Shard.node, True, "comm.shard=node: sharded among the ranks of a node"),
        (TWO_BY_TWO, Shard.world, False, "comm.shard=world: one flat shard group over 4 ranks; every all-gather"),
        (SyncWorld(1, 2, False, 1 << 20), Shard.node, False, "comm.reducer=fsdp on one node: sharded among its ranks"),
    ],
)
def test_the_plan_names_the_sharded_layout_and_measures_nothing(world, shard, node_first, said):
    p = plan_sync(SyncAsk(reducer=Reducer.fsdp, shard=shard), world, NoLinks())
    assert p.hierarchical is node_first and p.strategy.reason.startswith(said), p.strategy.reason
    assert p.overlap is Overlap.backward and p.overlap_reason.startswith("comm.reducer=fsdp: the sharded optimizer")


def test_compression_applies_to_the_cross_node_stage():
    p = plan_sync(SyncAsk(reducer=Reducer.fsdp, compress=Compress.powersgd), TWO_BY_TWO, NoLinks())
    assert p.hierarchical and p.compression is Compress.powersgd


@pytest.mark.parametrize(
    "overrides, said",
    [
        (
            ("comm.reducer=fsdp", "comm.shard=world", "comm.compress=bf16"),
            "comm.compress=bf16 with comm.shard=world: a flat shard group has no cross-node stage to compress",
        ),
        (("comm.fsdp_min_params=0",), "comm.fsdp_min_params=0 must be >= 1 (or null)"),
        (("comm.shard=rows",), "comm.shard='rows' is not a choice; HINT: comm.shard=auto, node or world"),
    ],
)
def test_combinations_that_cannot_run_are_refused_with_the_fix(overrides, said):
    with pytest.raises(ConfigError, match=said.replace("(", r"\(").replace(")", r"\)")):
        plan(*overrides)


@pytest.mark.parametrize(
    "overrides, said",
    [
        ((), "FSDP2 among the 2 rank(s) of each node (each holds 1/2 of the model), replicated across 2 nodes: only"),
        (("comm.shard=world",), "FSDP2 over every rank: each of 4 holds 1/4 of the parameters, gradients and opt"),
        (("comm.compress=powersgd",), "only each shard's gradient crosses nodes, powersgd across nodes"),
    ],
)
def test_the_launch_plan_says_who_holds_which_shard_and_what_crosses_nodes(overrides, said):
    _, launch = plan("comm.reducer=fsdp", "+cluster=sim", "cluster.nodes=2", "cluster.procs_per_node=2", *overrides)
    assert said in launch.describe(), launch.describe()
    assert "sharding" not in plan("+cluster=sim", "cluster.nodes=2", "cluster.procs_per_node=2")[1].describe()


def test_unit_classes_the_model_lacks_are_named_with_the_classes_it_has():
    with pytest.raises(
        ValueError,
        match=r"comm.fsdp_units=\['Blok'\]: no module of Net is one .* HINT: the classes "
        r"holding parameters: Block, Embedding, LayerNorm, Linear, ModuleList, Net",
    ):
        units(Net(), ShardSpec(unit_classes=("Blok",)))


class GptBlock(nn.Module):
    """A Hugging Face-style decoder block: pre-norm attention and an ``nn.Sequential`` MLP, each a residual sum."""

    def __init__(self, width):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(width), nn.MultiheadAttention(width, 2, batch_first=True)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class Gpt(nn.Module):
    """Token ids in, a dict with ``loss`` and ``logits`` out (``model(**batch)``), as Hugging Face's models."""

    def __init__(self, vocab=100, width=32, layers=2):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(16, width)
        self.h = nn.ModuleList(GptBlock(width) for _ in range(layers))
        self.ln_f, self.lm_head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, input_ids, labels):
        x = self.wte(input_ids) + self.wpe(torch.arange(input_ids.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return {"loss": nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()), "logits": logits}


def _text_classifier():
    from models.text_classifier import TextClassifier

    return TextClassifier(vocab_size=64, num_classes=2, max_len=16)


def _views(model, chosen):
    """The units (and the root) whose forward returned a view requiring grad: what FSDP2 warns of ("returned a view
    tensor ... wrong gradients"), by its own test (``collect_grad_tensors``, then ``._base``)."""
    from torch.distributed.fsdp._common_utils import collect_grad_tensors

    seen = set()
    for name, module in [*chosen, ("<root>", model)]:
        module.register_forward_hook(
            lambda m, args, out, n=name: seen.update(n for t in collect_grad_tensors(out) if t._base is not None)
        )
    torch.manual_seed(0)
    ids = torch.randint(1, 64, (2, 16))
    model(input_ids=ids, labels=ids if isinstance(model, Gpt) else ids[:, 0] % 2)
    return sorted(seen)


@pytest.mark.parametrize("build, block", [(_text_classifier, "TransformerEncoderLayer"), (Gpt, "GptBlock")])
def test_the_default_units_of_a_hugging_face_style_model_return_no_view(build, block):
    """Issue 60 (6.3): the size rule made an attention, a Linear on a sequence or a Sequential ending in one a unit of
    its own, and torch warned on every FSDP run; the default units are the model's blocks, whose outputs (residual
    sums) are no views."""
    model = build()
    chosen = units(model, ShardSpec())
    assert [type(m).__name__ for _, m in chosen] == [block, block]
    assert _views(model, chosen) == []
    model = build()
    eighth = sum(p.numel() for p in model.parameters()) // 8  # the size rule's default, the default before
    assert _views(model, units(model, ShardSpec(min_params=eighth))), "the size rule's units return views here"
