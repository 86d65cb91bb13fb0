"""The sync plan (``launcher/comm/sync_plan.py``, issue 46): what was asked, the world and the measured links in, one
frozen plan out, with the reasons the banner prints. Links here are figures handed in, and each test says which
were asked for, in which order (every rank must ask the same collectives). The choices are Enums of
``launcher/base/sync_modes.py``: the command line, frozen run dirs and summary.json keep their text, and a value that
is no member is refused with the value and the members named."""

import ast
import dataclasses
import json
import re
from pathlib import Path

import pytest

from harness.config import plan
from launcher.base.sync_modes import Compress, Hierarchical, Overlap, Reducer
from launcher.comm.policy import LinkFit, bucket_cap_mb
from launcher.comm.sizes import DDP_BUCKET_CAP_MB, MB
from launcher.comm.sync_plan import KEPT, SyncAsk, SyncPlan, SyncWorld, plan_sync
from launcher.config import CommConfig, ConfigError, load_frozen, to_yaml
from launcher.config.keys import choice_overrides
from launcher.report.summary import RunSummary

MODEL = 40 * MB  # bytes of the model's trained parameters: the strategy's probe is the 25 MB cap's floats
PROBE = int(DDP_BUCKET_CAP_MB * MB) // 4
ONE_NODE = SyncWorld(nodes=1, world_size=2, useful=False, model_bytes=MODEL)
TWO_BY_TWO = SyncWorld(nodes=2, world_size=4, useful=True, model_bytes=MODEL)
TWO_BY_ONE = SyncWorld(nodes=2, world_size=2, useful=False, model_bytes=MODEL)


class Links:
    """Measured figures handed in; ``asked``: what the plan measured, in order."""

    def __init__(self, flat_ms=10.0, hier_ms=5.0, node_first_mb_s=2000.0, flat_mb_s=3000.0, alpha_s=1e-3):
        self.flat_ms, self.hier_ms, self.alpha_s = flat_ms, hier_ms, alpha_s
        self.rates = {True: node_first_mb_s * MB, False: flat_mb_s * MB}
        self.asked: list[tuple[str, object]] = []

    def strategy_ms(self, numel):
        self.asked.append(("strategy", numel))
        return self.flat_ms, self.hier_ms

    def link(self, hierarchical):
        self.asked.append(("link", hierarchical))
        return LinkFit(self.alpha_s, self.rates[hierarchical])


def planned(world=TWO_BY_TWO, links=None, **asked) -> tuple[SyncPlan, Links]:
    links = links or Links()
    return plan_sync(SyncAsk(**asked), world, links), links


def test_the_defaults_on_one_node_measure_nothing():
    p, links = planned(ONE_NODE)
    assert (p.reducer, p.hierarchical, p.compression, p.overlap) == (
        Reducer.ddp,
        False,
        Compress.none,
        Overlap.backward,
    )
    assert p.strategy.reason == "one node: nothing crosses nodes" and p.compression_reason == ""
    assert p.overlap_reason == "comm.reducer=ddp: torch DDP waits for its buckets in backward"
    assert (p.bucket_cap_mb, p.cap_reason) == (DDP_BUCKET_CAP_MB, "torch DDP's default") and links.asked == []
    assert planned(ONE_NODE, overlap=Overlap.backward)[0].overlap_reason is None  # nothing to say: as asked
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.bucket_cap_mb = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("flat_ms", "hier_ms", "hierarchical", "reason"),
    [
        (10.0, 5.0, True, "measured 5.0 ms < flat 10.0 ms on 25.0 MB"),
        (10.0, 9.6, False, "measured flat 10.0 ms vs hierarchical 9.6 ms on 25.0 MB (the hierarchy must win by 5%)"),
        (10.0, 9.4, True, "measured 9.4 ms < flat 10.0 ms on 25.0 MB"),
    ],
)
def test_auto_picks_the_strategy_by_the_measured_numbers(flat_ms, hier_ms, hierarchical, reason):
    p, links = planned(links=Links(flat_ms, hier_ms))
    assert (p.hierarchical, p.strategy.reason) == (hierarchical, reason)
    assert (p.strategy.flat_ms, p.strategy.hier_ms) == (flat_ms, hier_ms)
    assert links.asked == [("strategy", PROBE)]  # ddp: no link measured for its cap
    small = planned(links=Links(flat_ms, hier_ms), bucket_cap_mb=2.0)[1]
    assert small.asked == [("strategy", int(2.0 * MB) // 4)]  # the probe is a bucket's size


@pytest.mark.parametrize(
    ("world", "reason"),
    [(ONE_NODE, "one node: nothing crosses nodes"), (TWO_BY_ONE, "one rank per node: nothing to reduce inside a node")],
)
def test_auto_measures_only_where_the_hierarchy_could_pay(world, reason):
    p, links = planned(world)
    assert (p.hierarchical, p.strategy.reason, links.asked) == (False, reason, [])


def test_set_or_kept_the_strategy_is_not_measured():
    for value, hierarchical in ((Hierarchical.true, True), (Hierarchical.false, False)):
        p, links = planned(hierarchical=value)
        assert (p.hierarchical, p.strategy.reason, links.asked) == (hierarchical, f"comm.hierarchical={value}", [])
    kept = SyncWorld(2, 4, True, MODEL, kept_hierarchical=False)
    p, links = planned(kept)
    assert (p.hierarchical, p.strategy.reason, links.asked) == (False, KEPT, [])
    p, _ = planned(kept, hierarchical=Hierarchical.true)  # set by the user: the checkpoint's does not override it
    assert (p.hierarchical, p.strategy.reason) == (True, "comm.hierarchical=true")


@pytest.mark.parametrize("compress", [Compress.bf16, Compress.powersgd])
def test_compression_runs_node_first_and_says_so(compress):
    p, links = planned(hierarchical=Hierarchical.false, compress=compress)
    assert (p.compression, p.compression_reason, p.compresses) == (compress, f"comm.compress={compress}", True)
    assert (p.hierarchical, p.strategy.reason) == (True, f"comm.compress={compress}: compression runs node-first")
    p, _ = planned(ONE_NODE, compress=compress)
    assert (p.compression, p.hierarchical) == (Compress.none, False)
    assert p.compression_reason == f"comm.compress={compress}: one node, nothing crosses nodes: nothing compressed"


@pytest.mark.parametrize(
    ("rate_mb_s", "compression", "why"),
    [
        (100.0, Compress.powersgd, "comm.compress=auto: node-first allreduce at 100 MB/s < 300 MB/s"),
        (500.0, Compress.bf16, "comm.compress=auto: node-first allreduce at 500 MB/s < 800 MB/s"),
        (2000.0, Compress.none, "comm.compress=auto: node-first allreduce at 2000 MB/s, fast enough: nothing"),
    ],
)
def test_compress_auto_by_the_node_first_link(rate_mb_s, compression, why):
    links = Links(flat_ms=10.0, hier_ms=20.0, node_first_mb_s=rate_mb_s)  # flat faster, on one rank a node:
    p, _ = planned(TWO_BY_ONE, links, reducer=Reducer.bucketed, compress=Compress.auto)  # no strategy probe
    assert p.compression is compression and p.compression_reason.startswith(why)
    assert p.hierarchical == (compression is not Compress.none)
    cap_link = [] if compression is Compress.powersgd else [("link", p.hierarchical)]  # PowerSGD: few buckets
    assert links.asked == [("link", True), *cap_link]


def test_compress_auto_compresses_nothing_where_flat_measured_faster():
    links = Links(flat_ms=10.0, hier_ms=20.0, node_first_mb_s=100.0)  # a slow link, but flat measured faster
    p, _ = planned(TWO_BY_TWO, links, compress=Compress.auto)
    assert (p.compression, p.hierarchical) == (Compress.none, False)
    assert p.compression_reason.endswith("the flat allreduce measured faster than node-first: nothing compressed")
    assert links.asked == [("strategy", PROBE), ("link", True)]


@pytest.mark.parametrize(
    ("asked", "overlap", "why"),
    [
        ({}, Overlap.forward, None),
        ({"overlap": Overlap.backward}, Overlap.backward, None),
        ({"whole_gradient": "clipping"}, Overlap.backward, "not the forward overlap: clipping"),
        ({"forward_refusal": "LBFGS is not known"}, Overlap.backward, "LBFGS is not known"),
        ({"compress": Compress.powersgd}, Overlap.backward, "PowerSGD: little wire time to hide behind the next"),
        ({"compress": Compress.bf16}, Overlap.forward, None),
        ({"compress": Compress.auto}, Overlap.backward, "comm.compress=auto: a fast link, nothing compressed: little"),
    ],
)
def test_the_bucketed_overlap_and_why(asked, overlap, why):
    p, _ = planned(reducer=Reducer.bucketed, **asked)
    assert p.overlap is overlap
    assert p.overlap_reason == why if why is None else p.overlap_reason.startswith(why)


def test_the_bucketed_cap_set_kept_or_sized_from_the_link_of_the_chosen_path():
    p, links = planned(reducer=Reducer.bucketed, hierarchical=Hierarchical.false, bucket_cap_mb=3.0)
    assert (p.bucket_cap_mb, p.cap_reason, p.first_bucket_mb, links.asked) == (3.0, "comm.bucket_cap_mb", 1.0, [])
    p, _ = planned(SyncWorld(2, 4, True, MODEL, kept_cap_mb=0.5), reducer=Reducer.bucketed)
    assert (p.bucket_cap_mb, p.cap_reason, p.first_bucket_mb) == (0.5, KEPT, 0.5)  # the first bucket: at most the cap
    p, links = planned(SyncWorld(1, 1, False, MODEL), reducer=Reducer.bucketed)
    assert (p.bucket_cap_mb, p.cap_reason, links.asked) == (DDP_BUCKET_CAP_MB, "one rank: nothing to overlap", [])
    for hierarchical in (Hierarchical.true, Hierarchical.false):
        links = Links(alpha_s=2e-3)
        p, _ = planned(links=links, reducer=Reducer.bucketed, hierarchical=hierarchical)
        fit = LinkFit(2e-3, links.rates[p.hierarchical])
        assert links.asked == [("link", p.hierarchical)]
        assert p.bucket_cap_mb == bucket_cap_mb(fit, MODEL) and p.bucket_cap_mb not in (DDP_BUCKET_CAP_MB, 1.0)
        assert p.cap_reason == f"sized from the link: {fit.describe()}, model 40.0 MB"


# ------------------------------------------------------------------------------------- the choices as the user types


@pytest.mark.parametrize(
    "override", ["comm.compress=zstd", "comm.compress=none,zstd", "comm.reducer=horovod", "comm.overlap=sideways"]
)
def test_a_value_that_is_no_member_is_refused_naming_it_and_the_members(override):
    key, value = override.split("=")
    members = {"comm.compress": "none, bf16, powersgd or auto", "comm.reducer": "ddp, bucketed or fsdp"}
    members["comm.overlap"] = "forward or backward"
    bad = value.split(",")[-1]
    with pytest.raises(ConfigError, match=re.escape(f"{key}='{bad}' is not a choice; HINT: {key}={members[key]}")):
        plan(override)
    with pytest.raises(ConfigError, match=re.escape(f"{key}='{bad}' is not a choice")):
        choice_overrides(["-m", override])  # python -m launcher: before Hydra composes
    with pytest.raises(ConfigError, match=re.escape(f"{key}='{bad}' is not a choice; HINT: {key}={members[key]}")):
        CommConfig(**{key.split(".")[1]: bad})  # a config built in Python


def test_a_frozen_config_with_no_member_names_the_file_the_value_and_the_members(tmp_path):
    (tmp_path / "config.yaml").write_text("comm:\n  compress: zstd\n")
    with pytest.raises(ConfigError, match=r"config.yaml: comm.compress: Invalid value 'zstd', expected one of "):
        load_frozen(tmp_path)


@pytest.mark.parametrize(
    ("override", "member"),
    [
        ("comm.hierarchical=true", Hierarchical.true),
        ("comm.hierarchical=false", Hierarchical.false),
        ("comm.hierarchical=True", Hierarchical.true),
        ("comm.hierarchical=auto", Hierarchical.auto),
        ("comm.hierarchical='true'", Hierarchical.true),
    ],
)
def test_hierarchical_takes_true_false_and_auto_as_it_always_did(override, member):
    job, _ = plan(override)
    assert job.comm.hierarchical is member


def test_true_and_false_become_the_members_names_sweeps_too():
    assert choice_overrides(["-m", "comm.hierarchical=true,auto", "train.epochs=true", "--cfg", "job"]) == [
        "-m",
        "comm.hierarchical='true',auto",
        "train.epochs=true",  # not a choice: as it was
        "--cfg",
        "job",
    ]
    assert choice_overrides(["+comm.hierarchical=FALSE", "comm.hierarchical=choice(true,false)"]) == [
        "+comm.hierarchical='false'",
        "comm.hierarchical=choice('true','false')",
    ]


def test_run_dirs_and_summaries_keep_their_text(tmp_path):
    job, _ = plan("comm.reducer=bucketed", "comm.hierarchical=true", "comm.compress=bf16", "comm.overlap=backward")
    text = to_yaml(job)
    for line in ("reducer: bucketed", "hierarchical: 'true'", "compress: bf16", "overlap: backward"):
        assert f"\n  {line}\n" in text, text
    old = "comm:\n  reducer: bucketed\n  hierarchical: 'true'\n  compress: powersgd\n  overlap: backward\n"
    (tmp_path / "config.yaml").write_text(old + "model:\n  _target_: models.lenet.LeNet\n")  # an older run's
    comm = load_frozen(tmp_path).comm
    assert (comm.reducer, comm.hierarchical, comm.compress, comm.overlap) == (
        Reducer.bucketed,
        Hierarchical.true,
        Compress.powersgd,
        Overlap.backward,
    )
    assert (f"{comm.compress}", str(comm.reducer)) == ("powersgd", "bucketed")  # printed as typed
    summary = RunSummary(
        world_size=4, nodes=2, procs_per_node=2, backend="gloo", device="cpu", reducer=comm.reducer,
        hierarchical=True, hierarchical_reason="", model="m", data="d", epochs=1, steps=2, global_batch=8,
        final_loss=0.5, test_accuracy=None, samples_per_s=None, wall_s=1.0, resumed_from=None,
    )  # fmt: skip
    written = json.loads(json.dumps(summary.to_json()))
    assert (written["reducer"], written["hierarchical"]) == ("bucketed", True)
    assert type(summary.reducer) is str


# ------------------------------------------------------------------------------------- no mode compared as text

PACKAGE = Path(__file__).resolve().parents[2] / "launcher"
MODES = {member.value for kind in (Reducer, Hierarchical, Overlap, Compress) for member in kind}
MODE_OPERAND = re.compile(r"\.(reducer|overlap|compress|hierarchical)\b|\bcompress(ed|ion)?\b|compression\.name")


def _texts(node: ast.AST) -> set[str]:
    elements = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {e.value for e in elements if isinstance(e, ast.Constant) and isinstance(e.value, str)}


def test_no_comm_mode_is_compared_as_text():
    """``== "powersgd"``, ``in ("bf16", ...)``: the modes are Enum members, compared as members. A comparison with a
    mode's text counts where the other side names a mode (``.compress``, ``compression.name``, ...), and anywhere in
    the sync engine (comm/); ``train.precision == "bf16"`` elsewhere is not a comm mode."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(PACKAGE))
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            operands = [node.left, *node.comparators]
            named = any(MODE_OPERAND.search(ast.unparse(o)) for o in operands if not _texts(o))
            if set().union(*map(_texts, operands)) & MODES and (named or where.startswith("comm/")):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "a comm mode compared as text (compare the Enum member):\n" + "\n".join(found)
