"""``launcher.Engine`` on real gloo ranks laid out as 2 virtual nodes x 2 (torchrun's variables set as torchrun sets
them): a user's loop through the engine trains what one process trains on the whole global batch (replicated with
torch DDP or our bucketed reducer, and sharded with FSDP2 inside a node and our cross-node stage); a loop stopped
mid-epoch and resumed continues bit for bit on the same ranks and within tolerance on another layout; the loader
gives the same global batches on 1, 2 and 3 ranks."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from harness.ranks import spawn_ranks

SAMPLES, FEATURES, CLASSES, BATCH, EPOCHS = 100, 8, 3, 16, 2  # 6 global batches an epoch (4 samples left out)


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(SAMPLES, FEATURES, generator=g), torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    )


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, CLASSES))


def reference(steps: int, skipped: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """One process, the whole global batch per step, in the order torch's own sampler gives one replica (``skipped``:
    steps whose batch is taken and whose update is not, as fp16's scaler skips an overflowing step)."""
    net, dataset = model(), data()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0, drop_last=True)
    done = 0
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for x, y in DataLoader(dataset, batch_size=BATCH, sampler=sampler, drop_last=True):
            if done == steps:
                return net.state_dict()
            F.cross_entropy(net(x), y).backward()
            if done not in skipped:
                opt.step()
            opt.zero_grad()
            done += 1
    return net.state_dict()


def torchrun_vars(rank: int, world: int, per_node: int) -> None:
    """This rank's environment as torchrun gives it (nodes of ``per_node`` ranks)."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank % per_node),
        LOCAL_WORLD_SIZE=str(per_node),
        GROUP_RANK=str(rank // per_node),
        GROUP_WORLD_SIZE=str(world // per_node),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="1",  # (the group is open already: no store is reached)
    )


def _loop(rank, world, out, per_node, settings, stop_at=None, resume=False, resumed_at=8):
    """The documented loop; rank 0 writes the final weights (``stop_at``: saves there and leaves)."""
    import launcher

    torchrun_vars(rank, world, per_node)
    settings = dict(settings)
    fused = settings.pop(
        "fused", None
    )  # the optimizer's (the sharded engine builds it again: fused SGD has no DTensor rule)
    engine = launcher.Engine(run_dir=str(out / "run"), checkpoint_every_steps=0, **settings)
    bare = model()
    net, opt = engine.setup(bare, torch.optim.SGD(bare.parameters(), lr=0.1, momentum=0.9, fused=fused))
    loader = engine.loader(data(), batch_size=BATCH, shuffle=True)
    extra = engine.resume() if resume else {}
    assert not resume or engine.global_step == resumed_at, engine.global_step
    assert not resume or extra == ({"note": "mid-epoch", "at": 8} if resumed_at == 8 else {}), extra
    for _epoch in range(engine.epoch, EPOCHS):
        for x, y in loader:
            with engine.step():
                if "accumulate_steps" in settings:  # micro-batches, one synchronisation
                    for xs, ys in engine.micro_batches((x, y)):
                        engine.backward(F.cross_entropy(net(xs), ys))
                else:
                    engine.backward(F.cross_entropy(net(x), y))
                opt.step()
                opt.zero_grad()
            if engine.global_step == stop_at:
                engine.save({"note": "mid-epoch", "at": stop_at})
                engine.close()
                return
    whole = engine.model_state_dict()
    if rank == 0:
        torch.save(whole, out / "final.pt")
    engine.close()


def _bare(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.removeprefix("module."): v for k, v in state.items()}


SETTINGS = {
    "ddp": {"hierarchical": "true"},
    "bucketed": {"reducer": "bucketed", "hierarchical": "true", "bucket_cap_mb": 0.001},
    "fsdp": {"reducer": "fsdp", "fsdp_min_params": 1, "fused": True},
    "bucketed-accumulated": {"reducer": "bucketed", "hierarchical": "true", "accumulate_steps": 2},
}


@pytest.mark.parametrize("kind", list(SETTINGS))
def test_a_loop_through_the_engine_equals_one_process_on_the_whole_batch(tmp_path, kind):
    spawn_ranks(_loop, 4, tmp_path, 2, SETTINGS[kind])
    got, want = _bare(torch.load(tmp_path / "final.pt")), reference(steps=2 * 6)
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-6, msg=key)


def test_stopped_mid_epoch_and_resumed_it_goes_on_bit_for_bit_and_on_another_layout_within_tolerance(tmp_path):
    """Stopped at step 8 (the second epoch's third batch) with a checkpoint, resumed: on the same 2x2 ranks the
    final weights are the uninterrupted run's bit for bit; on 1 node x 2 ranks, one process's within tolerance."""
    settings = {"hierarchical": "true", "compress": "none"}
    whole, same, other = (tmp_path / name for name in ("whole", "same", "other"))
    for path in (whole, same, other):
        path.mkdir()
    spawn_ranks(_loop, 4, whole, 2, settings)
    spawn_ranks(_loop, 4, same, 2, settings, 8)
    assert sorted(p.name for p in (same / "run" / "checkpoints").glob("step-*.pt")) == ["step-00000008.pt"]
    (other / "run").symlink_to(same / "run")  # the same run dir: its newest checkpoint
    spawn_ranks(_loop, 4, same, 2, settings, None, True)
    spawn_ranks(_loop, 2, other, 2, settings, None, True)
    uninterrupted = torch.load(whole / "final.pt")
    for key, value in torch.load(same / "final.pt").items():
        assert torch.equal(value, uninterrupted[key]), key
    want = reference(steps=2 * 6)
    for key, value in _bare(torch.load(other / "final.pt")).items():
        torch.testing.assert_close(value, want[key], rtol=1e-4, atol=1e-6, msg=key)


def test_the_loader_gives_the_same_global_batches_on_1_2_and_3_ranks_and_resumes_mid_epoch():
    from launcher.engine.loader import EngineLoader
    from launcher.train.progress import Position

    indices = TensorDataset(torch.arange(SAMPLES))

    def batches(world: int, pos: Position) -> list[list[int]]:
        loaders = [
            EngineLoader(indices, 12, world, r, 0, Position(**vars(pos)), torch.device("cpu")) for r in range(world)
        ]
        steps = [list(loader) for loader in loaders]
        return [sorted(int(i) for rank in steps for i in rank[k][0]) for k in range(len(steps[0]))]

    for epoch in (0, 1):
        one = batches(1, Position(epoch=epoch))
        assert len(one) == SAMPLES // 12 and len({i for b in one for i in b}) == 12 * len(one)  # each sample once
        assert batches(2, Position(epoch=epoch)) == one and batches(3, Position(epoch=epoch)) == one
        assert batches(3, Position(epoch=epoch, batch_in_epoch=5)) == one[5:]  # mid-epoch: the rest of it
    assert batches(1, Position(epoch=0)) != batches(1, Position(epoch=1))  # reshuffled each epoch


def test_after_a_heal_the_loader_hands_out_the_dropped_global_batch_again_re_split_over_the_ranks_left():
    """Three ranks' loaders (each its own position, as each rank holds one) in a user's loop over two epochs; global
    step 3 is dropped by a heal that leaves two ranks (``give_back``, then ``regroup``) and is handed out again,
    split over the two; and a rank joining at the end of an epoch (its position not settled) ends that epoch with
    nothing, as the others do. The global batches, each once, are one rank's (the same samples, in the same steps)."""
    from launcher.engine.loader import EngineLoader
    from launcher.train.progress import Position

    indices = TensorDataset(torch.arange(SAMPLES))
    one = [
        sorted(int(i) for i in b[0])
        for epoch in (0, 1)
        for b in EngineLoader(indices, 12, 1, 0, 0, Position(epoch=epoch), torch.device("cpu"))
    ]
    positions = [Position() for _ in range(3)]
    loaders = [EngineLoader(indices, 12, 3, r, 0, positions[r], torch.device("cpu")) for r in range(3)]

    def loop(loader):  # the user's: for epoch in range(2): for batch in loader: with engine.step(): ...
        for _ in range(2):
            yield from loader
            yield "end of epoch"

    loops = [loop(loader) for loader in loaders]
    seen: list[list[int]] = []
    while True:
        parts = [next(each, None) for each in loops]
        if parts[0] is None:
            break
        if isinstance(parts[0], str):
            assert all(p == "end of epoch" for p in parts), parts
            continue
        if len(seen) == 2 and len(loops) == 3:  # step 3, handed out: a machine is lost inside it (dropped)
            for rank, loader in enumerate(loaders[:2]):
                loader.give_back(positions[rank].step)
                loader.regroup(rank, 2)
            loops, loaders = loops[:2], loaders[:2]
            continue
        seen.append(sorted(int(i) for part in parts for i in part[0]))
        for pos in positions:
            pos.step += 1
    assert seen == one and len(seen) == 2 * (SAMPLES // 12)
    assert [(p.step, p.epoch, p.batch_in_epoch) for p in positions[:2]] == [(len(one), 2, 0)] * 2
    done = SAMPLES // 12  # a rank joining with the position at the end of epoch 0 (a survivor's, sent to it)
    joined = Position(step=done, epoch=0, batch_in_epoch=done)
    assert list(EngineLoader(indices, 12, 3, 2, 0, joined, torch.device("cpu"))) == []
    assert (joined.epoch, joined.batch_in_epoch) == (1, 0)


@pytest.fixture
def alone(tmp_path, monkeypatch):
    """One process (no torchrun variables): the engine opens a group of one and closes it."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path


def test_a_setting_no_section_has_or_a_value_its_field_refuses_is_named_with_the_fix(alone):
    import launcher

    with pytest.raises(ValueError, match=r"Engine\(comprss=\.\.\.\): .*'comprss'; HINT: did you mean compress"):
        launcher.Engine(comprss="bf16")
    with pytest.raises(ValueError, match=r"Engine\(compress='zstd'\): .*zstd"):
        launcher.Engine(compress="zstd")
    with pytest.raises(ValueError, match=r"precision"):
        launcher.Engine(precision="fp8")


def test_setup_and_loader_misuse_is_named_with_the_fix(alone):
    import launcher

    with launcher.Engine(run_dir=str(alone / "run")) as engine:
        net = model()
        with pytest.raises(ValueError, match=r"engine.step\(\) before engine.setup\(model, optimizer\); HINT: setup"):
            with engine.step():
                pass
        ddp_like = nn.parallel.DistributedDataParallel.__new__(nn.parallel.DistributedDataParallel)
        with pytest.raises(ValueError, match=r"wrapped already \(torch DistributedDataParallel\); HINT: pass the bare"):
            engine.setup(ddp_like, torch.optim.SGD(net.parameters(), lr=0.1))
        with pytest.raises(ValueError, match=r"not this model's parameters; HINT: build it over model.parameters"):
            engine.setup(net, torch.optim.SGD(model().parameters(), lr=0.1))
        net, opt = engine.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        with pytest.raises(ValueError, match=r"engine.setup\(\) was called already"):
            engine.setup(net, opt)
        with pytest.raises(ValueError, match=r"map-style data set with __len__ and __getitem__"):
            engine.loader(iter(range(10)), batch_size=4)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"holds 100 samples, not one global batch; HINT: batch_size <= 100"):
            engine.loader(data(), batch_size=128)
        with pytest.raises(ValueError, match=r"takes no closure"):
            opt.step(lambda: 0.0)
        assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "EngineSGD"


def _signalled(rank, world, out, per_node):
    """The loop with rank 1 sent SIGTERM in its fifth step; every rank records how it ended."""
    import signal

    import launcher

    torchrun_vars(rank, world, per_node)
    engine = launcher.Engine(run_dir=str(out / "run"), checkpoint_every_steps=0, hierarchical="true")
    bare = model()
    net, opt = engine.setup(bare, torch.optim.SGD(bare.parameters(), lr=0.1, momentum=0.9))
    try:
        for x, y in engine.loader(data(), batch_size=BATCH):
            with engine.step():
                if rank == 1 and engine.global_step == 4:
                    os.kill(os.getpid(), signal.SIGTERM)  # (its handler only records it: the step goes on)
                engine.backward(F.cross_entropy(net(x), y))
                opt.step()
                opt.zero_grad()
    except SystemExit as exc:
        (out / f"exit-{rank}.txt").write_text(f"{exc.code} {engine.global_step}")
        return
    (out / f"exit-{rank}.txt").write_text(f"finished {engine.global_step}")


def test_a_stop_signal_to_one_rank_stops_every_rank_at_one_step_with_a_checkpoint_and_resumes(tmp_path):
    spawn_ranks(_signalled, 4, tmp_path, 2)
    # rank 1's signal in step 5, known to all at the next boundary (the answer is read a step later): step 6
    assert [(tmp_path / f"exit-{r}.txt").read_text() for r in range(4)] == ["143 6"] * 4
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*.pt")) == ["step-00000006.pt"]
    spawn_ranks(_loop, 2, tmp_path, 2, {"hierarchical": "true"}, None, True, 6)  # resumed on 1 node x 2 ranks
    want = reference(steps=2 * 6)
    for key, value in _bare(torch.load(tmp_path / "final.pt")).items():
        torch.testing.assert_close(value, want[key], rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_through_the_engine_follows_one_process_in_fp32_closely(tmp_path, precision):
    """The forward under autocast, fp16's gradient scaler (scaled backward, unscaled before the step, an overflowing
    step skipped): the weights end near one fp32 process's that skips the same step, the scaler in the checkpoint."""
    spawn_ranks(_loop, 4, tmp_path, 2, {"hierarchical": "true", "precision": precision}, 12)  # saved at the end
    saved = torch.load(tmp_path / "run" / "checkpoints" / "step-00000012.pt", weights_only=True)
    scaler = saved["stepper"].get("scaler")
    if precision == "fp16":  # the first step overflowed at the initial scale and was skipped, the 11 others were not
        assert (scaler["scale"], scaler["_growth_tracker"]) == (2.0**15, 11), scaler
    else:
        assert scaler is None, saved["stepper"]
    got, want = _bare(saved["model"]), reference(steps=2 * 6, skipped=(0,) if precision == "fp16" else ())
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0.05, atol=0.02, msg=key)


def _unseeded(rank, world, out, per_node, settings):
    import launcher

    torchrun_vars(rank, world, per_node)
    torch.manual_seed(100 + rank)  # each rank initialises its model differently
    bare = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, CLASSES))
    engine = launcher.Engine(run_dir=str(out / "run"), **{k: v for k, v in settings.items() if k != "fused"})
    engine.setup(bare, torch.optim.SGD(bare.parameters(), lr=0.1))
    torch.save(engine.model_state_dict(), out / f"setup-{rank}.pt")
    engine.close()


@pytest.mark.parametrize("kind", ["ddp", "bucketed", "fsdp"])
def test_setup_gives_every_rank_rank_0s_weights(tmp_path, kind):
    spawn_ranks(_unseeded, 4, tmp_path, 2, SETTINGS[kind])
    ranks = [0] if kind == "fsdp" else range(4)  # (a sharded model's whole weights are gathered to rank 0)
    states = [_bare(torch.load(tmp_path / f"setup-{rank}.pt")) for rank in ranks]
    torch.manual_seed(100)
    want = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, CLASSES)).state_dict()
    for state in states:
        for key, value in want.items():
            assert torch.equal(state[key], value), key


def test_a_registered_scheduler_is_saved_and_resumed_with_the_checkpoint(alone):
    """``engine.register``: the loop's own objects with a state go into every checkpoint and come back with
    ``resume``; an object without ``state_dict``/``load_state_dict`` is named with the fix."""
    import launcher

    def run(steps: int) -> torch.optim.lr_scheduler.LambdaLR:
        with launcher.Engine(run_dir=str(alone / "run")) as engine:
            net = model()
            net, opt = engine.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
            scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
            engine.register(scheduler=scheduler)
            with pytest.raises(ValueError, match=r"engine.register\(count=int\): an object with state_dict\(\)"):
                engine.register(count=3)
            engine.resume()
            for x, y in zip(torch.randn(steps, 4, FEATURES), torch.randint(0, CLASSES, (steps, 4))):
                with engine.step():
                    engine.backward(F.cross_entropy(net(x), y))
                    opt.step()
                    opt.zero_grad()
                    scheduler.step()
            engine.save()
            return scheduler

    assert run(3).last_epoch == 3
    resumed = run(0)
    assert (resumed.last_epoch, resumed.get_last_lr()) == (3, [0.1 * 0.5**3])


def test_what_a_loop_that_heals_must_not_do_is_named_with_the_fix():
    """The engine's checks of a loop that heals in place (``engine/checks.py``; called around every step of such a
    loop, tests/beds/test_heal_loop.py): a step applied by another optimizer, a parameter changed between steps, an
    LR scheduler stepping the engine's optimizer unregistered; none when the parameters did not move or the
    scheduler is registered."""
    from launcher.engine.checks import check_changed, check_schedulers, versions

    net = model()
    before = versions(net)
    check_changed(before, versions(net), inside=True)
    with torch.no_grad():
        next(net.parameters()).mul_(0.5)
    with pytest.raises(ValueError, match=r"1 parameter\(s\) changed inside engine.step\(\) but not through the opt"):
        check_changed(before, versions(net), inside=True)
    with pytest.raises(ValueError, match=r"1 parameter\(s\) changed between two engine.step\(\) blocks: .*HINT: make"):
        check_changed(before, versions(net), inside=False)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    check_schedulers(optimizer, {})
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    with pytest.raises(ValueError, match=r"HINT: engine.register\(scheduler=scheduler\)"):
        check_schedulers(optimizer, {})
    check_schedulers(optimizer, {"scheduler": scheduler})
