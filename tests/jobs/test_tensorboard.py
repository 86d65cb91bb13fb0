"""train.tensorboard=true (issue 40): rank 0 writes every number metrics.jsonl's train and eval records hold as a
TensorBoard scalar at the record's step into run_dir/tensorboard/, read back here with TensorBoard's own reader. A
run resumed from an earlier step writes into the same folder and TensorBoard drops what the first run wrote after
that step (no step twice; the values the resumed run logged). Without the flag there is no folder."""

import json

import pytest

from harness.run import run_launcher
from launcher.base.checkpoint_names import checkpoint_path
from launcher.base.run_dir import RunDir
from launcher.commands.plot import load_metrics

# the bucketed reducer: its records hold the exposed communication too (torch DDP's do not)
JOB = ("train.max_steps=12", "train.log_every_steps=4", "cluster.procs_per_node=2", "comm.reducer=bucketed")
KEPT = ("train.checkpoint_every_steps=4", "train.keep_checkpoints=3")  # step 8's checkpoint, to resume from


def scalars_written(run_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in run_dir/tensorboard/: tag -> [(step, value)], as TensorBoard shows them (all of them kept;
    purged events dropped)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reader = EventAccumulator(str(RunDir(run_dir).tensorboard), size_guidance={"scalars": 0})
    reader.Reload()
    return {tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]}


def scalars_expected(run_dir) -> dict[str, list[tuple[int, float]]]:
    """The same from metrics.jsonl: every numeric field but the step of each train, eval and checkpoint record (the
    last record of a (kind, step): a resumed run's), tagged ``train/<field>``, ``eval/<field without test_>``,
    ``checkpoint/blocked_ms``."""
    expected: dict[str, list[tuple[int, float]]] = {}
    train, evals = load_metrics(RunDir(run_dir))
    lines = RunDir(run_dir).metrics.read_text().splitlines()
    saves = {r["step"]: r for r in map(json.loads, lines) if r["kind"] == "checkpoint"}  # (a resumed run's last)
    for record in train + evals + [saves[step] for step in sorted(saves)]:
        kind = record["kind"]
        for key, value in record.items():
            if key in ("kind", "step") or value is None or isinstance(value, bool):
                continue
            tag = f"{kind}/{key.removeprefix('test_') if kind == 'eval' else key}"
            expected.setdefault(tag, []).append((record["step"], value))
    return expected


def assert_same_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    written, expected = scalars_written(run_dir), scalars_expected(run_dir)
    assert sorted(written) == sorted(expected)
    for tag, points in expected.items():
        steps = [step for step, _ in points]
        assert [step for step, _ in written[tag]] == steps, tag
        assert [value for _, value in written[tag]] == pytest.approx([v for _, v in points], rel=1e-6, abs=1e-12), tag
    return written


def test_tensorboard_holds_the_metrics_scalars_and_a_resume_drops_what_it_writes_again(tmp_path):
    run_dir = tmp_path / "run"
    first = run_launcher(*JOB, *KEPT, "train.tensorboard=true", run_dir=run_dir)
    assert first.returncode == 0, first.stderr
    written = assert_same_scalars(run_dir)
    for tag in ("train/loss", "train/lr", "train/samples_per_s", "train/step_s", "train/comm_exposed_s"):
        assert [step for step, _ in written[tag]] == [4, 8, 12], tag
    assert [step for step, _ in written["eval/accuracy"]] == [12] and 0 < written["eval/accuracy"][0][1] <= 1
    assert written["train/lr"][0][1] > written["train/lr"][1][1]  # the cosine schedule, logged as it went
    assert len(list(RunDir(run_dir).tensorboard.iterdir())) == 1  # rank 0 alone wrote

    # from step 8 again: steps 9..12 trained and logged twice in metrics.jsonl, once in TensorBoard (the second's)
    step_8 = checkpoint_path(RunDir(run_dir).checkpoints, 8)
    again = run_launcher(*JOB, *KEPT, "train.tensorboard=true", f"train.resume={step_8}", run_dir=run_dir)
    assert again.returncode == 0, again.stderr
    assert "resumed from" in again.stderr
    assert len(list(RunDir(run_dir).tensorboard.iterdir())) == 2
    written = assert_same_scalars(run_dir)  # the last record of each step: the resumed run's
    assert [step for step, _ in written["train/samples_per_s"]] == [4, 8, 12]
    assert [step for step, _ in written["eval/accuracy"]] == [12]


def test_no_tensorboard_folder_without_the_flag(tmp_path):
    result = run_launcher("train.max_steps=2", "train.log_every_steps=1", "cluster.procs_per_node=1", run_dir=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "metrics.jsonl").is_file() and not RunDir(tmp_path).tensorboard.exists()
