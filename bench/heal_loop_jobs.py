"""``bench/heal_loop.py``'s jobs: the command of each (the Engine loop or the trainer, N simulated nodes, a fault),
its run under a timeout with the cut made from here, and what is measured of it (see heal_loop.py's docstring)."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

from heal_loop_net import (
    CUT_DELAY_S,
    FIRED,
    HEALED,
    REPO,
    RESUMED,
    STEP_LINE,
    _descendants,
    _end_leftovers,
    _ip,
    _job_tag,
    _naming,
    _restore,
)


def _stamp(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _p95(values: list[float]) -> Optional[float]:
    if len(values) < 2:
        return None
    return statistics.quantiles(values, n=20, method="inclusive")[18]


# ---------------------------------------------------------------------------------------------------- processes
def global_batch(nodes: int, args: argparse.Namespace) -> int:
    """``--batch``, or the smallest multiple of lcm(N-1, N) from 48 up (48, 60, 132 on 3, 6, 12 nodes): the global
    batch must split evenly over N and over the N-1 survivors."""
    every = math.lcm(nodes - 1, nodes)
    if args.batch:
        if args.batch % every:
            raise SystemExit(
                f"--batch {args.batch} does not split over {nodes - 1} and {nodes} ranks: use a multiple of {every}"
            )
        return args.batch
    return -(-48 // every) * every


def _command(kind: str, nodes: int, fault: str, args: argparse.Namespace, run_dir: Path) -> list[str]:
    batch = global_batch(nodes, args)
    cmd = [
        sys.executable, "-m", "launcher", "+cluster=sim", f"cluster.nodes={nodes}", f"cluster.min_nodes={nodes - 1}",
        "cluster.procs_per_node=1", f"cluster.lost_after_s={args.lost_after}", "train.threads_per_rank=1",
        f"train.batch_size={batch}", "train.plots=false", f"run_dir={run_dir}",
    ]  # fmt: skip
    if fault == "cut":
        cmd.append("cluster.netns=true")
    if kind == "engine":
        return [*cmd, "script=bench/heal_loop_job.py", "--", str(args.steps), str(batch)]
    return [*cmd, f"train.max_steps={args.steps}", "train.log_every_steps=1", "train.eval_every_epochs=1000"]


def _fault_spec(fault: str, args: argparse.Namespace, hold: Path) -> str:
    where = f"step={args.at},rank=1,attempt=0"
    if fault == "cut":
        return f"{where},delay={CUT_DELAY_S},while={hold}"
    return f"{where},signal={'KILL' if fault == 'kill' else 'STOP'},target=node"


def _reached(kind: str, run_dir: Path, step: int) -> bool:
    """The job completed ``step`` (rank 1's step line; the trainer's rank 0 metrics record)."""
    if kind == "engine":
        path = run_dir / "logs" / "rank-1.log"
        return path.is_file() and f"rank 1: step {step} on " in path.read_text(errors="replace")
    path = run_dir / "metrics.jsonl"
    return path.is_file() and f'"kind": "train", "step": {step},' in path.read_text(errors="replace")


def run_job(kind: str, nodes: int, fault: str, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """One job, measured; ``error`` set when it failed or could not be measured."""
    result: dict[str, Any] = {"kind": kind, "nodes": nodes, "fault": fault, "run_dir": str(run_dir)}
    hold = run_dir.parent / f"{run_dir.name}.hold"
    console = run_dir.parent / f"{run_dir.name}.console.txt"
    cmd = _command(kind, nodes, fault, args, run_dir)
    env = {**os.environ, "LAUNCHER_FAULT": _fault_spec(fault, args, hold)}
    result["command"] = f"LAUNCHER_FAULT='{env['LAUNCHER_FAULT']}' " + " ".join(cmd[1:])
    if fault == "cut":
        hold.touch()
    seen: dict[int, str] = {}
    tag, cut_at, problems = None, None, []
    load = round(os.getloadavg()[0], 2)
    start = time.time()
    deadline = start + args.timeout
    with open(console, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            looked = 0.0
            while proc.poll() is None and time.time() < deadline:
                if time.time() - looked > 0.5:  # (a scan of /proc: not at every 20 ms poll)
                    seen.update(_descendants(proc.pid))
                    looked = time.time()
                if fault == "cut" and cut_at is None and _reached(kind, run_dir, args.at - 1):
                    tag = _job_tag({proc.pid, *seen})
                    if tag is None:
                        problems.append("the job's network namespaces were not found: no cut")
                        cut_at = float("nan")
                    else:
                        cut_at = time.time()  # just before: the loss is no later than this
                        down = _ip("-n", f"lnch{tag}n1", "link", "set", f"v{tag}1", "down")
                        if down.returncode:
                            problems.append(f"ip link set down failed: {down.stderr.strip()}")
                        if kind == "engine":  # how long after step AT-1 (rank 1's stamp) the link went down
                            result["cut_after_step_s"] = round(cut_at - _last_step_time(run_dir, args.at - 1), 3)
                    hold.unlink(missing_ok=True)
                time.sleep(0.02 if fault == "cut" and cut_at is None else 0.25)
            if proc.poll() is None:
                result["error"] = f"timed out after {args.timeout} s"
        finally:  # (also on Ctrl-C here)
            hold.unlink(missing_ok=True)
            if proc.poll() is None:
                seen.update(_descendants(proc.pid))
                proc.send_signal(signal.SIGTERM)  # the launcher ends its nodes and deletes its namespaces
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            if tag is not None:
                problems += _restore(tag)
            seen.update(_naming(str(run_dir)))
            left = _end_leftovers(seen)
            if left:
                problems.append("left running after the job, killed: " + "; ".join(left))
    result["wall_s"] = round(time.time() - start, 2)
    result["load_before_after"] = [load, round(os.getloadavg()[0], 2)]  # 1-min load: others' work shares the cores
    result["exit"] = proc.returncode
    if problems:
        result["problems"] = problems
    if proc.returncode and "error" not in result:
        result["error"] = f"exit code {proc.returncode}"
    if "error" in result:
        result["console_tail"] = console.read_text(errors="replace")[-3000:]
        return result
    try:
        result.update(_measure(kind, nodes, fault, args, run_dir, console, cut_at))
    except (OSError, ValueError, KeyError, IndexError, AssertionError) as e:
        result["error"] = f"not measured: {type(e).__name__}: {e}"
        result["console_tail"] = console.read_text(errors="replace")[-3000:]
    return result


def _last_step_time(run_dir: Path, step: int) -> float:
    """When the engine loop's rank 1 completed ``step`` (its stamp)."""
    for _, s, _, at in STEP_LINE.findall((run_dir / "logs" / "rank-1.log").read_text(errors="replace")):
        if int(s) == step:
            return float(at)
    return float("nan")


def _measure(
    kind: str, nodes: int, fault: str, args: argparse.Namespace, run_dir: Path, console: Path, cut_at: Optional[float]
) -> dict[str, Any]:
    logs = run_dir / "logs"
    at = args.at
    changes = [json.loads(line) for line in (run_dir / "membership.jsonl").read_text().splitlines() if line.strip()]
    assert len(changes) == 1, f"{len(changes)} membership changes (one expected): {changes}"
    change = changes[0]
    assert change["how"] == "in place", f"the job did not heal in place: {change}"
    assert change["nodes_after"] == nodes - 1, f"{change['nodes_after']} nodes after the loss, {nodes - 1} expected"
    if fault == "cut":
        assert cut_at is not None and cut_at == cut_at, "the link was not cut"
        loss = cut_at
    else:
        fired = FIRED.search((logs / "rank-1.log").read_text(errors="replace"))
        assert fired is not None, "the fault did not fire"
        loss = _stamp(fired.group(1))
    survivors = [p for p in sorted(logs.glob("rank-*.log")) if p.name != "rank-1.log"]
    assert len(survivors) == nodes - 1, f"{len(survivors)} survivor logs"
    texts = {p.name: p.read_text(errors="replace") for p in [*survivors, logs / "rank-1.log"]}
    if kind == "engine":
        stamps = {int(s): float(t) for _, s, _, t in STEP_LINE.findall(texts["rank-0.log"])}
        back = stamps[at]
        done = [stamps[s] for s in range(at - 11, at + 11)]
        before = [b - a for a, b in zip(done[:11], done[1:11])]  # steps at-10 .. at-1
        after = [b - a for a, b in zip(done[11:], done[12:])]  # steps at+1 .. at+10
        twice, missing = 0, 0
        for name in (p.name for p in survivors):
            steps = [int(s) for _, s, _, _ in STEP_LINE.findall(texts[name])]
            twice += len(steps) - len(set(steps))
            missing += len(set(range(1, args.steps + 1)) - set(steps))
    else:
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        train = [r for r in records if r["kind"] == "train"]
        step_s = {r["step"]: r["step_s"] for r in train}
        healed = HEALED.search(texts["rank-0.log"])
        assert healed is not None and int(healed.group(2)) == at, "no 'healed in place' line for the step"
        back = _stamp(healed.group(1))
        before = [step_s[s] for s in range(at - 10, at)]
        after = [step_s[s] for s in range(at + 1, at + 11)]
        steps = [r["step"] for r in train]
        twice, missing = len(steps) - len(set(steps)), len(set(range(1, args.steps + 1)) - set(steps))
    summary = json.loads((run_dir / "summary.json").read_text())
    read = sum(len(RESUMED.findall(t)) for t in [*texts.values(), console.read_text(errors="replace")])
    read += int(summary.get("resumed_from") is not None)
    step = statistics.median(before + after)
    healing = back - loss
    return {
        "fault_to_step_s": change["fault_to_step_s"],
        "loss_to_step_s": round(healing, 3),
        "step_s": round(step, 5),
        "heal_extra_steps": round((healing - step) / step, 2),
        "steps_per_s_before": round(len(before) / sum(before), 2),
        "steps_per_s_after": round(len(after) / sum(after), 2),
        "steps_twice": twice,
        "steps_missing": missing,
        "checkpoints_read": read,
        "membership": change,
    }
