"""Scale benchmark (issue 39): the launcher's control plane at many ranks and nodes, simulated on one machine.

    python bench/scale.py [--sizes 8:2,64:16,256:64,1024:256 | --ranks 1024] [--lost-after-s 3] [--json PATH]

Drives the launcher's real code, not a model of it, with lightweight stand-ins for the ranks and nodes:

- keeper (``keeper_decide_s``): the real keeper process (``launcher.heal.head_side.KeeperClient``) on a real TCPStore,
  and one thread per simulated node running the real heartbeat (``launcher.heal.node_side.beat``, signed with the job's
  secret, its own store client); once every node has been heard, one node falls silent. Measured: from its last
  heartbeat plus ``cluster.lost_after_s`` to the keeper's decision (goal: within 1 s).
- report (``report_s``): every rank's failure record, as the progress watch writes them when it ends a hang (the
  culprit's with its stack, a peer record for every other rank), then the real report (``launcher.report.failures``).
  Measured: writing the records and printing the report (goal: 10 s at 1,024 ranks); the report must name the
  culprit first.
- start-up (``ready_p95_s``, ``torch_store_ready_s``): bench/scale_start.py, every rank a thread with a store client of
  its own on ``--hosts`` processes, from one moment to every rank joined the job's signed store and checked in
  (``launcher.group.rendezvous.check_in``); against torch's store barrier alone over the same number of clients on
  the same store server (issue 61's goals at 16,384 ranks: p95 <= 10 s and <= 1.0x torch's). The p95 of the
  connect alone is printed beside them (c10d's connect stalls on this box: bench/scale_start.py).
- watch (``watch_name_s``, ``rank0_watch_cpu``): bench/scale_watch.py, every rank a real progress publisher over
  a simulated flight recorder (``--hosts`` processes host them), rank 0 the real watch thread (publisher and
  reporter). Measured: the CPU share of one core rank 0's watch thread uses in a clean run of ``--clean-s``
  seconds (goal: 5 %), and the time from the stall (the last completed collective) to the culprit named (goal:
  ``comm.hang_warn_s`` + 5 s; here ``--warn-s``).

Sizes are RANKS:NODES. Prints a table; ``--json`` writes {"ranks": [...], "nodes": [...], "watch_name_s": [...],
"rank0_watch_cpu": [...], "keeper_decide_s": [...], "report_s": [...], "ready_p95_s": [...],
"torch_store_ready_s": [...]}.
"""

from __future__ import annotations

import argparse
import io
import json
import queue
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
from common import machine, table
from scale_start import KINDS, quantile, ready_times

from launcher.base.errors import Kind
from launcher.base.run_dir import RunDir
from launcher.group.rendezvous import attempt_prefix
from launcher.heal.head_side import KeeperClient
from launcher.heal.node_side import beat
from launcher.heal.protocol import node_id
from launcher.launch.ports import free_port
from launcher.report import failures
from launcher.trust.secret import Secret
from launcher.trust.signed import SignedStore

HERE = Path(__file__).resolve().parent
HEARD_S = 2.5  # every node beats a few times (every 0.5 s) before one falls silent: the keeper has heard them all


class TimedStore(SignedStore):
    """A node's signed store view that remembers when its last heartbeat landed."""

    last_set = 0.0

    def set(self, key: str, value: object) -> None:
        super().set(key, value)
        self.last_set = time.time()


def keeper_decision(nodes: int, lost_after_s: float) -> float:
    """Seconds from the silent node's last heartbeat + lost_after_s to the keeper's decision."""
    port, secret = free_port("127.0.0.1"), Secret.new()
    names = [f"node-{i}" for i in range(nodes)]
    keeper = KeeperClient([], "127.0.0.1", port, 0, 1, lost_after_s, names, secret)
    decisions: queue.Queue = queue.Queue()
    keeper.read(decisions.put)
    stops = [threading.Event() for _ in names]
    stores: list[TimedStore] = []
    try:
        for name, stop in zip(names, stops):
            client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
            store = TimedStore(client, secret, attempt_prefix(0))
            stores.append(store)
            threading.Thread(target=beat, args=(store, node_id(name, 0), stop), daemon=True).start()
        time.sleep(HEARD_S)  # (a pace, not a synchronisation: the keeper hears each node's next beats)
        stops[0].set()  # node-0 falls silent (frozen: no "done" mark)
        kind, decision = decisions.get(timeout=lost_after_s + 60)
        decided = time.time()
        if kind != "round" or set(decision.lost) != {"node-0"}:
            raise SystemExit(f"the keeper decided {kind} {decision!r}, not node-0 lost")
        return decided - (stores[0].last_set + lost_after_s)
    finally:
        for stop in stops:
            stop.set()
        keeper.close()


def report_time(ranks: int, nodes: int, run_dir: Path) -> float:
    """Seconds to write every rank's record as the watch does when it ends a hang, then print the report."""
    culprit, per_node, now = ranks // 2 + 1, max(1, ranks // nodes), time.time_ns()

    def ident(rank: int) -> dict:
        return {"rank": rank, "host": f"sim-{rank // per_node}", "node": rank // per_node, "nodes": nodes}

    stack = "".join(f'  File "train.py", line {i}, in step\n    work()\n' for i in range(30))
    records = [
        failures.Failure(**ident(culprit), kind=Kind.hang, summary="has not entered collective #9", traceback=stack)
    ]
    records += [
        failures.Failure(
            **ident(r), kind=Kind.peer, summary=f"waited 6 s in collective #9 for rank {culprit}", time_ns=now
        )
        for r in range(ranks)
        if r != culprit
    ]
    out = io.StringIO()
    start = time.perf_counter()
    folder = RunDir(run_dir).failure_attempt("scale", 0)
    folder.mkdir(parents=True, exist_ok=True)
    failures.record_exits(folder, records)
    failures.print_report(RunDir(run_dir), "scale", file=out)
    took = time.perf_counter() - start
    first = out.getvalue().splitlines()[0]
    if f"rank {culprit} " not in first or "hung:" not in first:
        raise SystemExit(f"the report does not name rank {culprit} first: {first}")
    return took


def watch_run(ranks: int, nodes: int, warn_s: float, clean_s: float, hosts: int, run_dir: Path) -> dict:
    """Rank 0's watch over ``ranks`` simulated ranks (bench/scale_watch.py): its CPU share and the naming time."""
    from scale_watch import STEP_S

    t0 = time.time() + 10.0  # every process is up by then (imports), on this 2-core box
    stall_at, culprit = int((clean_s + 2) / STEP_S), ranks // 2 + 1
    common = [str(run_dir), f"{t0:.3f}", str(ranks), str(nodes)]
    script = [sys.executable, str(HERE / "scale_watch.py")]
    cuts = [1 + (ranks - 1) * i // hosts for i in range(hosts + 1)]
    procs = [
        subprocess.Popen([*script, "host", *common, str(a), str(b), str(stall_at), str(culprit)])
        for a, b in zip(cuts, cuts[1:])
        if b > a
    ]
    try:
        zero = [*script, "zero", *common, f"{warn_s:g}", f"{clean_s:g}", str(stall_at), str(culprit)]
        out = subprocess.run(zero, capture_output=True, text=True, timeout=clean_s + warn_s + 120)
        if out.returncode:
            raise SystemExit(f"{ranks} ranks: rank 0's watch failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    watched = json.loads(out.stdout.strip().splitlines()[-1])
    if watched["named_s"] is None:  # a stall at this size must be named, and with the right rank
        raise SystemExit(f"{ranks} ranks: the watch did not name rank {culprit} (it said: {watched['other']})")
    return watched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8:2,64:16,256:64,1024:256", help="RANKS:NODES, comma-separated")
    parser.add_argument("--lost-after-s", type=float, default=3.0, help="cluster.lost_after_s for the keeper")
    parser.add_argument("--warn-s", type=float, default=10.0, help="comm.hang_warn_s for the watch")
    parser.add_argument("--clean-s", type=float, default=20.0, help="seconds of clean run before the stall")
    parser.add_argument("--hosts", type=int, default=3, help="processes hosting the simulated ranks")
    parser.add_argument("--ranks", help="RANKS[,RANKS...]: the sizes with 4 ranks a node (instead of --sizes)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.ranks:
        args.sizes = ",".join(f"{r}:{max(1, int(r) // 4)}" for r in args.ranks.split(","))
    sizes = [tuple(int(x) for x in size.split(":")) for size in args.sizes.split(",")]
    result: dict[str, list] = {k: [] for k in ("ranks", "nodes", "watch_name_s", "rank0_watch_cpu")}
    result.update(keeper_decide_s=[], report_s=[], ready_p95_s=[], torch_store_ready_s=[])
    for ranks, nodes in sizes:
        (ours_connect, ours), (torch_connect, torch_ready) = (ready_times(k, ranks, args.hosts) for k in KINDS)
        with tempfile.TemporaryDirectory() as tmp:
            watched = watch_run(ranks, nodes, args.warn_s, args.clean_s, args.hosts, Path(tmp) / "watch")
            report_s = report_time(ranks, nodes, Path(tmp) / "report")
        keeper_s = keeper_decision(nodes, args.lost_after_s)
        ready = [quantile(ours, 0.95), quantile(torch_ready, 0.95)]
        figures = (ranks, nodes, watched["named_s"], watched["cpu"], keeper_s, report_s, *ready)
        for key, value in zip(result, figures):
            result[key].append(value)
        print(
            f"# {ranks} ranks, {nodes} nodes: {watched}, keeper +{keeper_s:.2f} s, report {report_s:.2f} s, ready "
            f"p50 {quantile(ours, 0.5):.2f} p95 {ready[0]:.2f} s (connected p95 {quantile(ours_connect, 0.95):.2f} s), "
            f"torch's store alone p95 {ready[1]:.2f} s (connected {quantile(torch_connect, 0.95):.2f} s)",
            flush=True,
        )
    print(f"# control plane at scale; keeper: cluster.lost_after_s={args.lost_after_s:g}; {machine()}")
    rows = [list(row) for row in zip(*result.values())]
    headers = ["ranks", "nodes", "watch names (s)", "rank 0 watch CPU", "keeper after lost_after_s (s)", "report (s)"]
    headers += ["ready p95 (s)", "torch's store alone p95 (s)"]
    print(table(headers, rows))
    print(
        f"# goals at 1,024 ranks / 256 nodes: named within warn_s + 5 s = {args.warn_s + 5:g} s; rank 0's watch "
        "under 5 % of a core; keeper within 1 s after lost_after_s; report within 10 s; at 16,384 ranks: ready p95 "
        "<= 10 s and <= 1.0x torch's store alone"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
