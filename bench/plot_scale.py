"""Plot bench/scale.py's figures against the number of ranks, each with its goal (issue 39).

python bench/scale.py --json scale.json && python bench/plot_scale.py scale.json bench/scale.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# (key, title, unit scale, the goal at 1,024 ranks, its words)
PANELS: list[tuple[str, str, float, float | None, str]] = [
    ("watch_name_s", "stall to culprit named (s)", 1.0, 15.0, "warn_s + 5 s (scale.py's warn_s 10)"),
    ("rank0_watch_cpu", "rank 0's watch (% of a core)", 100.0, 5.0, "5 %"),
    ("keeper_decide_s", "keeper after lost_after_s (s)", 1.0, 1.0, "1 s"),
    ("report_s", "failure report (s)", 1.0, 10.0, "10 s"),
]


def plot(source: str, target: str) -> None:
    data = json.loads(Path(source).read_text())
    ranks = data["ranks"]
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 3.2))
    for ax, (key, title, scale, goal, words) in zip(axes, PANELS):
        values = [v * scale for v in data[key]]
        ax.plot(ranks, values, "o-")
        if goal is not None:  # (every goal is at 1,024 ranks)
            ax.axhline(goal, color="tab:red", linestyle="--", label=f"goal: {words}")
            ax.legend(loc="upper left", fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks (nodes = ranks / 4)")
        ax.set_title(title, fontsize=10)
        ax.set_ylim(0, 1.2 * max(goal or 0.0, *values))
    fig.tight_layout()
    fig.savefig(target, dpi=100)
    print(target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="bench/scale.py's --json file")
    parser.add_argument("target", help="the image to write (PNG)")
    args = parser.parse_args()
    plot(args.source, args.target)


if __name__ == "__main__":
    main()
