"""End-to-end benchmark: training throughput of each reducer, strategy and overlap on a simulated 2-node cluster.

    sudo python bench/end_to_end.py [--link-gbit 1] [--steps 30] [--json PATH] [--compression]

Runs ``python -m launcher +cluster=sim cluster.netns=true cluster.link_gbit=...`` (2 namespaces x 2 ranks) with
an MLP of ~24 MB of gradients on synthetic data, once per variant, and reports samples/s as the median over the
logged windows after the first (start-up excluded), with ratios to torch DDP (flat) measured in the same run.
``--compression``: the variants of ``comm.compress`` instead (issue 38's check), compression from step 6 on and
the windows before step 15 excluded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import machine, table

REPO = Path(__file__).resolve().parent.parent
VARIANTS = [  # (comm.reducer, comm.hierarchical, comm.overlap, comm.compress)
    ("ddp", "false", "backward", "none"),
    ("ddp", "true", "backward", "none"),
    ("bucketed", "false", "backward", "none"),
    ("bucketed", "false", "forward", "none"),
    ("bucketed", "true", "backward", "none"),
    ("bucketed", "true", "forward", "none"),
    ("bucketed", "auto", "forward", "none"),
]
COMPRESSION_VARIANTS = [
    ("ddp", "false", "backward", "none"),
    ("ddp", "true", "backward", "powersgd"),
    ("bucketed", "auto", "forward", "none"),
    ("bucketed", "auto", "forward", "bf16"),
    ("bucketed", "auto", "forward", "powersgd"),
    ("bucketed", "auto", "forward", "auto"),
]


def run(reducer: str, hierarchical: str, overlap: str, compress: str, args: argparse.Namespace, run_dir: Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "launcher",
        "+cluster=sim",
        "cluster.netns=true",
        f"cluster.link_gbit={args.link_gbit}",
        "cluster.procs_per_node=2",
        "model=mlp",
        "model.hidden=1024",
        "model.depth=6",
        "data=synthetic",
        "train.batch_size=128",
        f"train.max_steps={args.steps}",
        "train.log_every_steps=5",
        "train.checkpoint_every_steps=0",
        "train.eval_every_epochs=100",
        f"comm.reducer={reducer}",
        f"comm.hierarchical={hierarchical}",
        f"comm.overlap={overlap}",
        f"comm.compress={compress}",
        "comm.compress_warmup_steps=5",
        "train.plots=false",
        f"hydra.run.dir={run_dir}",
    ]
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    windows = [r for r in records if r["kind"] == "train"][3 if args.compression else 1 :]
    summary = json.loads((run_dir / "summary.json").read_text())
    exposed = [r["comm_exposed_s"] for r in windows if "comm_exposed_s" in r]
    return {
        "reducer": reducer,
        "hierarchical": hierarchical,
        "overlap": overlap,
        "compress": compress,
        "compression": summary.get("compression", ""),
        "used_hierarchical": summary["hierarchical"],
        "samples_per_s": statistics.median(r["samples_per_s"] for r in windows),
        "step_ms": statistics.median(r["step_s"] for r in windows) * 1e3,
        "exposed_ms": statistics.median(exposed) * 1e3 if exposed else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link-gbit", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--compression", action="store_true", help="the comm.compress variants instead")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench/end_to_end.py creates network namespaces: run it as root")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (reducer, hierarchical, overlap, compress) in enumerate(
            COMPRESSION_VARIANTS if args.compression else VARIANTS
        ):
            results.append(run(reducer, hierarchical, overlap, compress, args, Path(tmp) / str(i)))
            print(
                f"# {reducer} hierarchical={hierarchical} overlap={overlap} compress={compress}: "
                f"{results[-1]['samples_per_s']:.0f} samples/s",
                flush=True,
            )
    anchor = results[0]["samples_per_s"]
    rows = [
        [
            r["reducer"],
            r["hierarchical"],
            r["overlap"],
            r["compress"],
            r["used_hierarchical"],
            r["samples_per_s"],
            r["samples_per_s"] / anchor,
            r["step_ms"],
            "" if r["exposed_ms"] is None else r["exposed_ms"],
        ]
        for r in results
    ]
    print(
        f"# end to end: +cluster=sim, 2 namespaces x 2 ranks, link {args.link_gbit} Gbit/s, MLP 1024x6 "
        f"(~24 MB grads), global batch 128, {args.steps} steps; {machine()}"
    )
    print(
        table(
            [
                "reducer",
                "hierarchical",
                "overlap",
                "compress",
                "used",
                "samples/s",
                "/ ddp flat",
                "step ms",
                "exposed ms",
            ],
            rows,
        )
    )
    if args.json:
        args.json.write_text(json.dumps({"rows": results}, indent=2))


if __name__ == "__main__":
    main()
