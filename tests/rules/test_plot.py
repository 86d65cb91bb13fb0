"""``launcher.commands.plot``: metrics.jsonl loading (last record per step wins, broken lines skipped), the PNGs of the
curves and of the comm.trace timeline. matplotlib is one of the launcher's dependencies (pyproject.toml): no
skip without it (a module-level ``importorskip`` was a skip ``LAUNCHER_REQUIRE_BEDS=1`` did not see)."""

import json
import logging
import re

import pytest

from launcher.base.run_dir import RunDir
from launcher.commands.plot import load_metrics, plot_all, plot_run, plot_trace, run_title
from launcher.report.summary import RunSummary

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _train(step, loss, comm=None):
    rec = {
        "kind": "train",
        "step": step,
        "epoch": step // 20,
        "loss": loss,
        "lr": 0.1,
        "samples_per_s": 4000.0 + step,
        "step_s": 0.016,
    }
    if comm is not None:
        rec["comm_exposed_s"] = comm
    return rec


def _eval(step, epoch, loss, acc):
    return {"kind": "eval", "step": step, "epoch": epoch, "test_loss": loss, "test_accuracy": acc}


def _write(run_dir, records, tail=""):
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in records) + tail
    (run_dir / "metrics.jsonl").write_text(text, encoding="utf-8")
    return run_dir


def _resumed_run(run_dir, comm=True):
    """Steps 10..40 and an eval at 20, then a restart from step 20 re-logs 30 and 40, then a kill."""
    c = 0.004 if comm else None
    first = [
        _train(10, 2.0, c),
        _train(20, 1.5, c),
        _eval(20, 0, 0.9, 0.70),
        _train(30, 1.2, c),
        _train(40, 1.0, c),
        _eval(40, 1, 0.8, 0.75),
    ]
    resumed = [_train(30, 1.1, c), _train(40, 0.9, c), _eval(40, 1, 0.6, 0.85)]
    return _write(run_dir, first + resumed, tail='{"kind": "train", "step": 50, "lo')


def _assert_png(path):
    assert path.is_file()
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert 20_000 < len(data) < 5_000_000  # a 2x2 figure at ~110 dpi, not an empty canvas


def test_load_metrics_last_record_wins_and_sorted(tmp_path, caplog):
    run = _resumed_run(tmp_path / "run")
    with caplog.at_level(logging.WARNING, logger="launcher.commands.plot"):
        train, evals = load_metrics(RunDir(run))
    assert [r["step"] for r in train] == [10, 20, 30, 40]
    assert [r["loss"] for r in train] == [2.0, 1.5, 1.1, 0.9]  # the resumed run's values
    assert [(r["step"], r["test_accuracy"], r["test_loss"]) for r in evals] == [(20, 0.70, 0.9), (40, 0.85, 0.6)]
    assert any("metrics.jsonl:10" in m for m in caplog.messages)  # the truncated line, by line number


def test_load_metrics_sorts_out_of_order_steps(tmp_path):
    run = _write(
        tmp_path / "run",
        [_train(30, 0.3), _train(10, 0.1), _eval(22, 1, 0.5, 0.9), _train(20, 0.2), _eval(11, 0, 0.7, 0.8)],
    )
    train, evals = load_metrics(RunDir(run))
    assert [(r["step"], r["loss"]) for r in train] == [(10, 0.1), (20, 0.2), (30, 0.3)]
    assert [r["epoch"] for r in evals] == [0, 1]


@pytest.mark.parametrize("comm", [True, False])
def test_plot_run_writes_png(tmp_path, comm):
    run = _resumed_run(tmp_path / "run", comm=comm)
    out = plot_run(RunDir(run))
    assert out == run / "plots" / "curves.png"
    _assert_png(out)


def test_plot_without_evals_and_with_summary(tmp_path):
    run = _write(tmp_path / "run", [_train(10, 2.0), _train(20, 1.0)])
    (run / "summary.json").write_text(
        json.dumps(
            {
                "world_size": 4,
                "nodes": 2,
                "procs_per_node": 2,
                "reducer": "bucketed",
                "hierarchical": True,
                "model": "models.lenet.LeNet",
                "data": "digits",
            }
        )
    )
    train, evals = load_metrics(RunDir(run))
    assert len(train) == 2 and evals == []
    _assert_png(plot_run(RunDir(run)))


def test_run_title_from_the_typed_summary(tmp_path):
    summary = RunSummary(
        world_size=4, nodes=2, procs_per_node=2, backend="gloo", device="cpu", reducer="bucketed",
        hierarchical=True, hierarchical_reason="", model="models.lenet.LeNet", data="digits", epochs=1, steps=2,
        global_batch=64, final_loss=0.5, test_accuracy=None, samples_per_s=None, wall_s=1.0, resumed_from=None,
        hosts=["a", "b"],
    )  # fmt: skip
    assert run_title(summary) == "LeNet · digits · 2 nodes × 2 ranks · bucketed, hierarchical"
    summary.write(RunDir(tmp_path))
    assert RunSummary.read(RunDir(tmp_path)) == summary
    assert run_title(None) == ""
    (tmp_path / "summary.json").write_text("{not json")
    assert RunSummary.read(RunDir(tmp_path)) is None  # unreadable: plots lose the title, nothing fails


def _curves_texts(run, monkeypatch):
    """Every text drawn on ``run``'s curves.png (``plot_run``, its figure read as it is saved)."""
    from matplotlib.figure import Figure
    from matplotlib.text import Text

    texts: list[str] = []
    save = Figure.savefig

    def saving(fig, *args, **kwargs):
        texts.extend(t.get_text() for t in fig.findobj(Text))
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", saving)
    _assert_png(plot_run(RunDir(run)))
    return texts


@pytest.mark.parametrize("reducer", ["fsdp", "ddp"])
def test_the_curves_name_the_reducer_that_ran_where_exposed_communication_was_not_measured(
    tmp_path, monkeypatch, reducer
):
    """Issue 60 (6.6): an FSDP run's curves said "not measured (comm.reducer=ddp)"; they name the run's reducer,
    from its summary, or from its frozen config while it runs (no summary yet)."""
    run = _write(tmp_path / "run", [_train(10, 2.0), _train(20, 1.0)])  # (no comm_exposed_s: not measured)
    (run / "config.yaml").write_text(f"comm:\n  reducer: {reducer}\n  shard: world\n")
    said = f"exposed communication not measured (comm.reducer={reducer})"
    assert said in _curves_texts(run, monkeypatch)
    summary = RunSummary(
        world_size=2, nodes=2, procs_per_node=1, backend="gloo", device="cpu", reducer=reducer, hierarchical=False,
        hierarchical_reason="", model="models.text_classifier.TextClassifier", data="text", epochs=1, steps=20,
        global_batch=64, final_loss=0.5, test_accuracy=None, samples_per_s=None, wall_s=1.0, resumed_from=None,
    )  # fmt: skip
    summary.write(RunDir(run))
    (run / "config.yaml").unlink()
    texts = _curves_texts(run, monkeypatch)
    assert said in texts and not [t for t in texts if "comm.reducer=" in t and t != said], texts


def test_missing_run_dir_names_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=re.escape(f"no metrics in {missing / 'metrics.jsonl'}")):
        plot_run(RunDir(missing))
    assert not (missing / "plots").exists()


@pytest.mark.parametrize("content", ["", "\n", '{"kind": "tr'])
def test_empty_or_unreadable_metrics_raise(tmp_path, content):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(content)
    with pytest.raises(ValueError, match="metrics.jsonl"):
        load_metrics(RunDir(run))


def _span(rank, name, tid, ts, dur, **args):
    """A complete ("X") event as launcher.comm.trace.Tracer.record writes it."""
    return {"name": name, "ph": "X", "pid": rank, "tid": tid, "ts": ts, "dur": dur, **({"args": args} if args else {})}


def _trace(run_dir):
    """Two ranks: forward, backward with a nested wait, overlapping buckets (what launcher.comm.trace writes)."""
    events = []
    for rank in (0, 1):
        events += [
            {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": "step"}},
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": 1, "args": {"name": "buckets"}},
        ]
        events += [
            _span(rank, *e)
            for e in [
                ("forward", 0, 0, 100),
                ("backward", 0, 100, 200),
                ("wait for buckets", 0, 250, 50),
                ("bucket 0", 1, 150, 80),
                ("bucket 1", 1, 200, 90),
                ("optimizer", 0, 300, 5),
            ]
        ]
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "trace.json").write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return run_dir


def test_plot_trace_and_plot_all(tmp_path):
    run_dir = _resumed_run(tmp_path / "run")
    assert plot_all(RunDir(run_dir)) == [run_dir / "plots" / "curves.png"]  # no trace.json: curves only
    _trace(run_dir)
    paths = plot_all(RunDir(run_dir))
    assert paths == [run_dir / "plots" / "curves.png", run_dir / "plots" / "trace.png"]
    for path in paths:
        _assert_png(path)


def test_plot_trace_without_trace_names_the_fix(tmp_path):
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "trace.json")) + ".*comm.trace=true"):
        plot_trace(RunDir(tmp_path))


def test_a_single_logged_step_still_plots(tmp_path):
    _assert_png(plot_run(RunDir(_write(tmp_path / "run", [_train(5, 2.0, 0.003)]))))


def _write_trace(run_dir):
    """2 ranks × tracks step and buckets; buckets overlap each other, "wait for buckets" nests in backward;
    written as launcher.comm.trace does (metadata first, ranks' events merged, not sorted by time)."""
    events = []
    for rank in (1, 0):  # out of order: the plot sorts ranks
        events += [
            {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank} (host)"}},
            {"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}},
        ]
        for tid, track in enumerate(("step", "buckets")):
            events += [
                {"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": track}},
                {"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid, "args": {"sort_index": tid}},
            ]
        for step in range(3):
            t = 30_000.0 * step + 500.0 * rank
            events += [
                _span(rank, "forward", 0, t, 4_000.0),
                _span(rank, "backward", 0, t + 4_100.0, 20_000.0),
                _span(rank, "bucket 0", 1, t + 6_000.0, 8_000.0, mb=0.5),
                _span(rank, "bucket 1", 1, t + 9_000.0, 9_000.0, mb=0.4),
                _span(rank, "bucket 2", 1, t + 17_000.0, 6_000.0, mb=0.1),
                _span(rank, "wait for buckets", 0, t + 16_000.0, 8_000.0),
                _span(rank, "optimizer", 0, t + 24_200.0, 700.0),
            ]
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "trace.json").write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return run_dir


def test_plot_trace_sorted_ranks_tracks_with_args(tmp_path):
    run = _write_trace(tmp_path / "run")
    out = plot_trace(RunDir(run))
    assert out == run / "plots" / "trace.png"
    _assert_png(out)


def test_plot_trace_without_events_raises(tmp_path):
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": [], "displayTimeUnit": "ms"}))
    with pytest.raises(ValueError, match="no events"):
        plot_trace(RunDir(tmp_path))
