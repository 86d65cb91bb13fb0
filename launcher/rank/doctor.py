"""``python -m launcher doctor [cluster overrides]``: check a cluster before spending its hours on it.

Launched exactly like the job (local, ``+cluster=sim``, ``+cluster=slurm``), every rank reports:
its host and node, how MASTER_ADDR resolves there and how long a TCP connect to the rendezvous store takes,
the network interface its traffic to MASTER_ADDR leaves on (and GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME), and the
GPUs it sees. Then an allreduce of ``DOCTOR_ALLREDUCE_MB`` is timed inside every node (all nodes at once) and
between the leaders of every pair of nodes (one pair at a time, so pairs do not share the wire), median of
``REPS`` (``time_links``).

Verdict: a node whose every link is more than ``SLOW`` x slower than the links between the other nodes is named,
then any single link (or node-internal allreduce) more than ``SLOW`` x the median of its kind. With two nodes there
is one link and nothing to compare it with: its figures are printed. Rank 0 writes ``doctor.json`` in the run dir;
the launcher prints the report and exits 1 when problems were found. ``preflight=true`` runs the same checks at
the start of a training job and logs them (problems as warnings).
"""

from __future__ import annotations

import logging
import os
import socket
import statistics
import subprocess
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from launcher.base.devices import describe_device
from launcher.base.env import DistEnv
from launcher.base.files import write_json_atomic
from launcher.base.names import slow_lookups, time_lookups
from launcher.base.run_dir import RunDir
from launcher.comm.sizes import MB
from launcher.comm.strategy import median_seconds
from launcher.group import helpers as rank_helpers

log = logging.getLogger(__name__)

DOCTOR_ALLREDUCE_MB = 1.0  # the size of each timed allreduce (inside a node, between two nodes' leaders)
REPS = 5  # timed repetitions per allreduce (after one warm-up); the median counts
SLOW = 2.0  # "slow" means more than this factor above the median of its kind
MAX_PAIRWISE_NODES = 16  # above this, each node is timed against its ring neighbour only


def route_interface(addr: str, port: int) -> tuple[str, str]:
    """(local ip, interface name) that traffic to ``addr`` leaves from, as the kernel routes it."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((addr, port or 9))  # no packet is sent for UDP connect
            local_ip = probe.getsockname()[0]
    except OSError as exc:
        return "?", f"no route ({exc.strerror or exc})"
    try:
        out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return local_ip, "?"
    for line in out.splitlines():  # "2: eth0    inet 10.0.0.5/24 brd ..."
        fields = line.split()
        if len(fields) > 3 and fields[3].split("/")[0] == local_ip:
            return local_ip, fields[1]
    return local_ip, "?"


def rank_facts(env: DistEnv, use_gpu: bool) -> dict[str, Any]:
    facts: dict[str, Any] = {
        "rank": env.rank,
        "host": env.hostname or socket.gethostname(),
        "node": env.node_rank,
        "local_rank": env.local_rank,
        "master": f"{env.master_addr}:{env.master_port}",
    }
    try:
        facts["master_ip"] = socket.getaddrinfo(env.master_addr, None, socket.AF_INET)[0][4][0]
    except OSError as exc:
        facts["master_ip"] = None
        facts["problem"] = f"MASTER_ADDR {env.master_addr!r} does not resolve on {facts['host']} ({exc})"
    lookups = time_lookups([env.master_addr, facts["host"]])  # each both ways (c10d: on every store connection)
    facts["slow_lookups"] = [lookup.said(facts["host"]) for lookup in slow_lookups(lookups)]
    facts["connect_ms"] = None
    if env.world_size > 1:  # one rank has no store to reach
        start = time.perf_counter()
        try:
            with socket.create_connection((env.master_addr, env.master_port), timeout=10):
                facts["connect_ms"] = (time.perf_counter() - start) * 1e3
        except OSError as exc:
            facts.setdefault("problem", f"cannot connect to {facts['master']} from {facts['host']} ({exc})")
    facts["local_ip"], facts["interface"] = route_interface(env.master_addr, env.master_port)
    facts["socket_ifname"] = os.environ.get("GLOO_SOCKET_IFNAME") or os.environ.get("NCCL_SOCKET_IFNAME")
    if facts["socket_ifname"] and not os.path.exists(f"/sys/class/net/{facts['socket_ifname']}"):
        facts.setdefault("problem", f"socket interface {facts['socket_ifname']!r} does not exist on {facts['host']}")
    facts["gpus"] = (
        [describe_device(torch.device(f"cuda:{i}")) for i in range(torch.cuda.device_count())] if use_gpu else []
    )
    if use_gpu and len(facts["gpus"]) < env.local_world_size:
        facts.setdefault(
            "problem",
            f"{facts['host']} shows {len(facts['gpus'])} GPU(s) to rank {env.rank}; its "
            f"node runs {env.local_world_size} rank(s), one GPU each",
        )
    return facts


def time_allreduce(
    group: dist.ProcessGroup | None, device: torch.device, mb: float = DOCTOR_ALLREDUCE_MB, reps: int = REPS
) -> float:
    """Median seconds of an allreduce of ``mb`` over ``group`` (every member calls this)."""
    tensor = torch.ones(max(1, int(mb * MB) // 4), device=device)
    return median_seconds(lambda: dist.all_reduce(tensor, group=group), device, reps, group=group)


def node_pairs(nodes: int) -> list[tuple[int, int]]:
    if nodes <= MAX_PAIRWISE_NODES:
        return [(a, b) for a in range(nodes) for b in range(a + 1, nodes)]
    return [(a, (a + 1) % nodes) for a in range(nodes)]


def time_links(
    env: DistEnv, device: torch.device, timeout_s: float | None = None, peers: rank_helpers.Peers = rank_helpers.Peers()
) -> tuple[dict[int, float], dict[tuple[int, int], float]]:
    """Collective: (node -> intra-node allreduce s, (node a, node b) -> leaders' allreduce s), on every rank."""
    from launcher.comm import Topology  # the sync engine's groups: ranks of my node, leaders

    with Topology.build(env, timeout_s=timeout_s) as topo:
        nodes = topo.layout.nodes
        intra = time_allreduce(topo.intra, device) if not topo.alone else None
        pairs = node_pairs(len(nodes))
        timeout = timedelta(seconds=timeout_s) if timeout_s else None
        groups = [dist.new_group([nodes[a][0], nodes[b][0]], timeout=timeout) for a, b in pairs]  # collective
        mine: dict[tuple[int, int], float] = {}
        for (a, b), group in zip(pairs, groups):
            if env.rank in (nodes[a][0], nodes[b][0]):
                seconds = time_allreduce(group, device)
                if env.rank == nodes[a][0]:
                    mine[(a, b)] = seconds
            rank_helpers.barrier()  # one pair at a time
        gathered = peers.all_gather_object((topo.layout.node_of(env.rank), intra, mine))
        for (a, b), group in zip(pairs, groups):
            if env.rank in (nodes[a][0], nodes[b][0]):  # release the pair groups (nccl communicators) now
                dist.destroy_process_group(group)
    intra_by_node = {node: s for node, s, _ in gathered if s is not None}
    links = {pair: s for _, _, m in gathered for pair, s in m.items()}
    return intra_by_node, links


def verdict(intra: dict[int, float], links: dict[tuple[int, int], float], hosts: dict[int, str]) -> list[str]:
    problems: list[str] = []
    explained: set[tuple[int, int]] = set()
    nodes = sorted({n for pair in links for n in pair})
    if len(nodes) >= 3:
        for node in nodes:
            mine = [s for pair, s in links.items() if node in pair]
            others = [s for pair, s in links.items() if node not in pair]
            if others and min(mine) > SLOW * statistics.median(others):
                problems.append(
                    f"node {node} ({hosts[node]}) is slow: its links take {statistics.median(mine) * 1e3:.1f} ms "
                    f"per {DOCTOR_ALLREDUCE_MB:g} MB allreduce, links between the other nodes "
                    f"{statistics.median(others) * 1e3:.1f} ms (> {SLOW:g}x)"
                )
                explained |= {pair for pair in links if node in pair}
        typical = statistics.median(links.values())
        for (a, b), s in sorted(links.items()):
            if (a, b) not in explained and s > SLOW * typical:
                problems.append(
                    f"link node {a} ({hosts[a]}) - node {b} ({hosts[b]}) is slow: {s * 1e3:.1f} ms vs "
                    f"{typical * 1e3:.1f} ms median (> {SLOW:g}x)"
                )
    if len(intra) >= 3:
        typical = statistics.median(intra.values())
        for node, s in sorted(intra.items()):
            if s > SLOW * typical:
                problems.append(
                    f"node {node} ({hosts[node]}): allreduce among its ranks takes {s * 1e3:.1f} ms vs "
                    f"{typical * 1e3:.1f} ms median (> {SLOW:g}x)"
                )
    return problems


def run_doctor(
    env: DistEnv,
    device: torch.device,
    run_dir: RunDir,
    use_gpu: bool,
    log_report: bool = True,
    timeout_s: float | None = None,
    peers: rank_helpers.Peers = rank_helpers.Peers(),
) -> dict[str, Any]:
    """Collective, inside the process group. Every rank returns the report; rank 0 writes ``doctor.json`` (and
    logs the report unless the launcher prints it). ``peers``: the job's secret signs the gathered facts."""
    facts = peers.all_gather_object(rank_facts(env, use_gpu))
    intra, links = time_links(env, device, timeout_s, peers)
    hosts = {f["node"]: f["host"] for f in sorted(facts, key=lambda f: -f["rank"])}  # a node's leader's host
    problems = [f"rank {f['rank']}: {f['problem']}" for f in facts if f.get("problem")]
    problems += list(dict.fromkeys(said for f in facts for said in f.get("slow_lookups", [])))  # (a host's once)
    problems += verdict(intra, links, hosts)
    report = {
        "world_size": env.world_size,
        "nodes": len(hosts),
        "allreduce_mb": DOCTOR_ALLREDUCE_MB,
        "ranks": facts,
        "intra_node_ms": {str(n): s * 1e3 for n, s in sorted(intra.items())},
        "links_ms": {f"{a}-{b}": s * 1e3 for (a, b), s in sorted(links.items())},
        "problems": problems,
    }
    if env.is_main:
        write_json_atomic(run_dir.doctor, report)
    for line in format_doctor_report(report).splitlines() if log_report else []:
        if line.startswith("PROBLEM"):
            log.warning("%s", line)
        else:
            log.info("%s", line)
    return report


def format_doctor_report(report: dict[str, Any]) -> str:
    lines = [f"doctor: {report['world_size']} rank(s) on {report['nodes']} node(s)"]
    for f in report["ranks"]:
        connect = (
            f"{f['connect_ms']:.1f} ms"
            if f.get("connect_ms") is not None
            else ("FAILED" if report["world_size"] > 1 else "-")
        )
        gpus = ", ".join(f["gpus"]) if f["gpus"] else "no GPU (CPU)"
        lines.append(
            f"  rank {f['rank']:>3} {f['host']} node {f['node']} local {f['local_rank']}: "
            f"master {f['master']} -> {f['master_ip']} connect {connect}; via {f['interface']} "
            f"({f['local_ip']}), socket ifname {f['socket_ifname'] or '-'}; {gpus}"
        )
    for node, ms in report["intra_node_ms"].items():
        lines.append(f"  node {node}: allreduce of {report['allreduce_mb']:g} MB among its ranks {ms:.2f} ms")
    for pair, ms in report["links_ms"].items():
        mb_s = report["allreduce_mb"] / (ms / 1e3) if ms else float("inf")
        lines.append(
            f"  link {pair}: allreduce of {report['allreduce_mb']:g} MB between leaders {ms:.2f} ms ({mb_s:.0f} MB/s)"
        )
    lines += [f"PROBLEM {p}" for p in report["problems"]] or ["  no problems found"]
    return "\n".join(lines)
