"""Losing a replica group under torchft 0.2.0: the scenario of ``bench/heal.py``, measured on torchft instead.

3 replica groups x 1 rank (gloo, CPU), a lighthouse, an MLP on synthetic data, 16 samples per group (global batch 48
while all 3 train: torchft's sampler gives each group a fixed shard, so the global batch shrinks to 32 when one is
lost), ``--steps`` steps. Group 2 sends itself the fault once step ``--at`` is committed ("between": before the next
step's quorum) or in the next step once the quorum is formed, as the others enter the gradient allreduce
("allreduce": the signal instead of its backward). Printed per case: the whole case's wall time, the time from the
fault (group 2's own record, just before the signal) to training again (the survivors' first committed step after
step ``--at``, the later of the two), how many step attempts the survivors threw away and ran again (torchft skips
their batches), and the global batch before -> after. The gradients go through torchft's ``DistributedDataParallel``
(``ddp``) or, ``manual``, through ``Manager.allreduce`` of each gradient and ``wait()`` (its documented API). The
lighthouse runs with the settings of torchft's README (``torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100
--join_timeout_ms 10000``, heartbeat_timeout at its 5 s default). join_timeout is how long the lighthouse waits
for heartbeating stragglers before issuing a quorum without them; torchft's Python ``LighthouseServer`` defaults it
to 100 ms (``--join-timeout-ms 100``: a dead group is dropped in ~0.2 s, and so is any group that late to a quorum).

Set up the venv (outside the repo; no internet but PyPI) and run, with the testbed's lock held:

    python3 -m venv /tmp/tfvenv && /tmp/tfvenv/bin/pip install torch==2.13.0
    cd /tmp && /tmp/tfvenv/bin/pip download torchft==0.2.0 --no-deps
    /tmp/tfvenv/bin/pip install --no-deps /tmp/torchft-0.2.0*.whl
    /tmp/tfvenv/bin/pip install 'opentelemetry-api>=1.39.0' 'opentelemetry-sdk>=1.39.0' \
        'opentelemetry-exporter-otlp-proto-http>=1.39.0' torch==2.13.0
    /tmp/tfvenv/bin/python bench/torchft_heal.py [--case kill/between/ddp ...]
        [--at 15] [--steps 40] [--join-timeout-ms 10000] [--heartbeat-ms 5000] [--timeout 60]

(or any Python >= 3.11 with ``--python /tmp/tfvenv/bin/python``: the driver imports neither torch nor torchft).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GROUPS, VICTIM, BATCH = 3, 2, 16  # replica groups, the faulted one, samples per group and step
CASES = ["kill/between/ddp", "stop/between/ddp", "kill/allreduce/ddp", "kill/allreduce/manual", "stop/allreduce/manual"]


def serve(args: argparse.Namespace) -> None:
    """The lighthouse and a store the groups meet at before step 1 (so the first quorum holds all 3)."""
    from importlib.metadata import version

    import torch
    from torch.distributed import TCPStore
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(
        bind="[::]:0",
        min_replicas=1,
        join_timeout_ms=args.join_timeout_ms,
        quorum_tick_ms=100,
        heartbeat_timeout_ms=args.heartbeat_ms,
    )
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    info = {"lighthouse": lighthouse.address(), "store_port": store.port, "torch": torch.__version__}
    info.update(torchft=version("torchft"), python=sys.version.split()[0])
    print(json.dumps(info), flush=True)
    sys.stdin.read()  # until the driver closes the pipe or ends the process group


def worker(args: argparse.Namespace) -> None:
    """One replica group of one rank; one JSON line per step attempt (and the fault) to ``args.log``."""
    from datetime import timedelta

    import torch
    from torch import nn
    from torch.distributed import TCPStore
    from torch.utils.data import DataLoader, TensorDataset
    from torchft import DistributedDataParallel, DistributedSampler, Manager, Optimizer, ProcessGroupGloo

    rid, (sig, where, grads) = args.worker, args.case[-1].split("/")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    log = open(args.log, "a", buffering=1)
    shared = TCPStore("localhost", args.store_port, is_master=False, timeout=timedelta(seconds=60))
    own = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)  # this group's store (torchrun's, usually)
    g = torch.Generator().manual_seed(1)
    n = BATCH * GROUPS * (args.steps + 10)
    data = TensorDataset(torch.randn(n, 784, generator=g), torch.randint(0, 10, (n,), generator=g))
    sampler = DistributedSampler(
        data, replica_rank=rid, num_replica_groups=GROUPS, group_rank=0, num_replicas=1, shuffle=False
    )
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    model = nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
    inner = torch.optim.SGD(model.parameters(), lr=0.05)

    def load_state_dict(state: dict) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    timeout = timedelta(seconds=args.timeout)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=load_state_dict,
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        min_replica_size=1,
        timeout=timeout,
        rank=0,
        world_size=1,
        store_addr="localhost",
        store_port=own.port,
        lighthouse_addr=args.lighthouse,
        replica_id=f"group_{rid}",
    )
    net = DistributedDataParallel(manager, model) if grads == "ddp" else model
    optimizer = Optimizer(manager, inner)
    shared.set(f"ready{rid}", "1")  # every group heartbeats before anyone asks for the first quorum
    shared.wait([f"ready{r}" for r in range(GROUPS)], timedelta(seconds=60))

    def fault() -> None:
        log.write(json.dumps({"fault": time.time(), "signal": sig}) + "\n")
        os.kill(os.getpid(), signal.SIGKILL if sig == "kill" else signal.SIGSTOP)

    while manager.current_step() < args.steps:
        for x, y in loader:
            before = manager.current_step()
            faulty = rid == VICTIM and before == args.at
            if faulty and where == "between":
                fault()
            optimizer.zero_grad()  # starts the quorum
            loss = nn.functional.cross_entropy(net(x), y)
            if faulty and where == "allreduce":  # the quorum holds this group; the others are entering the allreduce
                manager.wait_quorum()
                fault()
            loss.backward()
            if grads == "manual":
                for work in [manager.allreduce(p.grad) for p in model.parameters()]:
                    work.wait()
            optimizer.step()  # commits if every participant's allreduce went through
            after = manager.current_step()
            record = {
                "t": time.time(),
                "step": after,
                "committed": after > before,
                "groups": manager.num_participants(),
            }
            log.write(json.dumps(record) + "\n")
            if after >= args.steps:
                break
    manager.shutdown(wait=False)


def crash_lines(stderr: str) -> str:
    """The last torchft frame and the exception of a traceback in a worker's stderr ('' if none)."""
    if "Traceback" not in stderr:
        return ""
    tail = stderr[stderr.rindex("Traceback") :].splitlines()
    frames = [i for i, line in enumerate(tail) if re.match(r'\s+File ".*torchft/', line)]
    where = f"{tail[frames[-1]].strip()}: {tail[frames[-1] + 1].strip()} -> " if frames else ""
    errors = [line for line in tail if re.match(r"^[\w.]+(Error|Exception)\b", line)]
    return where + (errors[-1] if errors else tail[-1])


def run_case(case: str, args: argparse.Namespace, tmp: Path) -> dict:
    script = str(Path(__file__).resolve())
    flags = ["--steps", str(args.steps), "--at", str(args.at), "--timeout", str(args.timeout)]
    serve_cmd = [args.python, script, "--serve", "--heartbeat-ms", str(args.heartbeat_ms)]
    serve_cmd += ["--join-timeout-ms", str(args.join_timeout_ms)]
    with open(tmp / "lighthouse.err", "w") as err:  # its log: every quorum, at INFO
        server = subprocess.Popen(
            serve_cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, process_group=0
        )
    workers: list[subprocess.Popen] = []
    try:
        ready, _, _ = select.select([server.stdout], [], [], 60)
        line = server.stdout.readline() if ready else ""
        if not line:
            raise SystemExit(f"the lighthouse did not start within 60 s (exit code {server.poll()})")
        info = json.loads(line)
        start = time.time()
        for rid in range(GROUPS):
            cmd = [args.python, script, "--worker", str(rid), "--case", case, "--log", str(tmp / f"{rid}.jsonl")]
            cmd += ["--lighthouse", info["lighthouse"], "--store-port", str(info["store_port"]), *flags]
            with open(tmp / f"{rid}.err", "w") as err:
                workers.append(subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT, process_group=server.pid))
        codes = []
        for rid in range(GROUPS):
            if rid != VICTIM:  # the victim is dead or frozen: the survivors' exit ends the case
                try:
                    codes.append(workers[rid].wait(timeout=max(1.0, start + args.deadline - time.time())))
                except subprocess.TimeoutExpired:
                    codes.append(None)
        wall = time.time() - start
    finally:
        os.killpg(server.pid, signal.SIGKILL)  # the lighthouse, the groups, whatever they started; frozen ones too
        for proc in [server, *workers]:
            proc.wait()
    return {**info, **summarize(tmp, codes, args.at), "wall_s": wall}


def summarize(tmp: Path, codes: list, at: int) -> dict:
    files = {rid: tmp / f"{rid}.jsonl" for rid in range(GROUPS)}
    logs = {rid: [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else [] for rid, f in files.items()}
    faults = [r["fault"] for r in logs[VICTIM] if "fault" in r]
    if not faults:
        raise SystemExit(f"group {VICTIM} never fired its fault:\n{(tmp / f'{VICTIM}.err').read_text()[-3000:]}")
    fired, backs, redone, groups = faults[0], [], [], []
    survivors = [rid for rid in range(GROUPS) if rid != VICTIM]
    for rid in survivors:
        after = [r for r in logs[rid] if r["t"] > fired]
        first = next((r for r in after if r["committed"] and r["step"] > at), None)  # not step `at` itself
        backs.append(first["t"] - fired if first else None)
        redone.append(sum(not r["committed"] for r in after))  # attempts thrown away (their batches skipped)
        groups.append(first["groups"] if first else None)
    crashes = [crash_lines((tmp / f"{rid}.err").read_text()) if code else "" for rid, code in zip(survivors, codes)]
    if None in codes:
        result = "hung"
    elif any(codes):
        result = f"crashed (exit {', '.join(str(c) for c in codes)})"
    else:
        result = "ok"
    back = None if None in backs else max(backs)
    return {"back_s": back, "redone": max(redone), "groups_after": groups[0], "result": result, "crashes": crashes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", help=f"fault/where/grads, repeatable; default: {' '.join(CASES)}")
    parser.add_argument("--at", type=int, default=15)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--heartbeat-ms", type=int, default=5000, help="the lighthouse's heartbeat_timeout_ms")
    parser.add_argument("--join-timeout-ms", type=int, default=10000, help="the lighthouse's join_timeout_ms")
    parser.add_argument("--timeout", type=int, default=60, help="s: the Manager's timeout and gloo's (torchft: 60)")
    parser.add_argument("--deadline", type=float, default=300.0, help="s: a case whose survivors run longer hung")
    parser.add_argument("--python", default=sys.executable, help="the torchft venv's python")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    for name in ("--log", "--lighthouse", "--store-port"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(args)
    if args.worker is not None:
        args.store_port = int(args.store_port)
        return worker(args)
    rows = []
    for case in args.case or CASES:
        with tempfile.TemporaryDirectory() as tmp:
            rows.append((case, run_case(case, args, Path(tmp))))
    info = rows[0][1]
    print(f"# torchft heal: torch {info['torch']}, torchft {info['torchft']}, python {info['python']}, gloo")
    print(
        f"{GROUPS} replica groups x 1 rank, MLP 784-128-10, {BATCH} samples per group, group {VICTIM} faulted at step "
        f"{args.at} of {args.steps}; lighthouse join_timeout {args.join_timeout_ms / 1000:g} s, heartbeat_timeout "
        f"{args.heartbeat_ms / 1000:g} s; Manager and gloo timeout {args.timeout} s"
    )
    print(
        f"{'fault/where/grads':<22} {'wall s':>7} {'loss->step s':>13} {'steps twice':>12} {'global batch':>13}  result"
    )
    for case, r in rows:
        back = f"{r['back_s']:13.2f}" if r["back_s"] is not None else f"{'-':>13}"
        batch = f"{BATCH * GROUPS}->{BATCH * r['groups_after']}" if r["groups_after"] else "-"
        print(f"{case:<22} {r['wall_s']:7.2f} {back} {r['redone']:12d} {batch:>13}  {r['result']}")
    for case, r in rows:
        for rid, crash in zip([g for g in range(GROUPS) if g != VICTIM], r["crashes"]):
            if crash:
                print(f"# {case}, group {rid}: {crash}")
    # what a survivor waits for: a frozen group inside the allreduce holds gloo's sockets open until gloo's timeout;
    # otherwise (between steps, or killed: its sockets reset at once) the next quorum waits for the lighthouse to
    # drop the silent group, min(join_timeout, heartbeat_timeout) after its last heartbeat
    lighthouse = f"min(join_timeout, heartbeat_timeout) = {min(args.join_timeout_ms, args.heartbeat_ms) / 1000:g} s"
    bounds = {
        lighthouse: min(args.join_timeout_ms, args.heartbeat_ms) / 1000,
        f"timeout = {args.timeout} s": args.timeout,
    }
    for name, bound in bounds.items():
        ratios = [
            f"{case} {r['back_s'] / bound:.2f}"
            for case, r in rows
            if r["back_s"] is not None and (case.startswith("stop/allreduce/") == name.startswith("timeout"))
        ]
        if ratios:
            print(f"loss->step / {name}: " + ", ".join(ratios))


if __name__ == "__main__":
    main()
