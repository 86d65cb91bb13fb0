"""comm.trace: a timeline merged from ranks on several hosts, whose monotonic clocks count from each boot."""

import json

from launcher.comm.trace import Tracer, write_trace


def test_each_host_is_aligned_at_its_own_start_and_ranks_on_one_host_keep_their_offsets(tmp_path):
    tracers = [Tracer(0, "a"), Tracer(1, "a"), Tracer(2, "b")]
    tracers[0].record("forward", "step", 1_000_000, 2_000_000)
    tracers[1].record("forward", "step", 1_500_000, 2_500_000)
    tracers[2].record("forward", "step", 9_000_000_000, 9_001_000_000)  # host b booted long before host a
    path = write_trace(tmp_path / "trace.json", [t.trace_events() for t in tracers])
    starts = {e["pid"]: e["ts"] for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"}
    assert starts == {0: 0.0, 1: 500.0, 2: 0.0}, starts
