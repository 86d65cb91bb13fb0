"""Record a green run of the suite (``./scripts/test.sh --durations [--fast]``): its figures in
tests/suite_figures.json, where its time went in tests/durations/<lane>.txt (per tier and per module, slowest
first), and the README's figures rewritten from them (between ``<!-- suite:LANE -->`` and
``<!-- /suite:LANE -->``), so the README's counts and times are measured, never typed
(tests/rules/test_suite_figures.py holds them to the record).

    python scripts/suite_figures.py --lane fast|full --junit RESULTS.xml --whole-s S --pytest-s S
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ROOT / "tests" / "suite_figures.json"
DURATIONS = ROOT / "tests" / "durations"  # <lane>.txt
README = ROOT / "README.md"
TIERS = ("rules", "ranks", "jobs", "beds")
BUDGET = {"fast": {"pytest_s": 45.0, "whole_s": 90.0}, "full": {"whole_s": 15 * 60.0}}  # issue 60, item 3


def over_budget(lane: str, fig: dict) -> list[str]:
    """Each figure of a lane over its budget, said (the recording prints them; they do not fail a run)."""
    return [f"{key} {fig[key]:.0f} s > {limit:.0f} s" for key, limit in BUDGET[lane].items() if fig[key] > limit]


def marker(lane: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- suite:{lane} -->)(.*?)(<!-- /suite:{lane} -->)", re.S)


def sentence(lane: str, fig: dict) -> str:
    """The README's words for a lane's figures (test_suite_figures.py reads them back with ``read_sentence``)."""
    whole = f"{fig['whole_s'] / 60:.1f} min" if fig["whole_s"] >= 300 else f"{fig['whole_s']:.0f} s"
    return (
        f"{fig['passed']:,} tests passed, {fig['skipped']:,} skipped, pytest {fig['pytest_s']:.0f} s, "
        f"{whole} in all ({fig['date']}, {fig['cores']}-core box)"
    )


SENTENCE = re.compile(
    r"([\d,]+) tests passed, ([\d,]+) skipped, pytest (\d+) s, ([\d.]+) (min|s) in all \((\S+), (\d+)-core box\)"
)


def read_sentence(text: str) -> dict:
    """The figures a README sentence states (``sentence``'s inverse)."""
    m = SENTENCE.fullmatch(text.strip())
    if not m:
        raise ValueError(f"not a suite figures sentence: {text!r}")
    whole = float(m[4]) * (60 if m[5] == "min" else 1)
    counts = {"passed": int(m[1].replace(",", "")), "skipped": int(m[2].replace(",", ""))}
    return counts | {"pytest_s": float(m[3]), "whole_s": whole, "date": m[6], "cores": int(m[7])}


def module_times(junit: Path) -> tuple[dict[str, float], dict[str, int]]:
    """Seconds per test module (setup, call and teardown: a module fixture's job counts in its module) and counts
    of outcomes, from pytest's JUnit XML."""
    times: dict[str, float] = defaultdict(float)
    counts = {"passed": 0, "skipped": 0, "failed": 0}
    for case in ET.parse(junit).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        module = "/".join(parts[: next((i + 1 for i, p in enumerate(parts) if p.startswith("test_")), len(parts))])
        times[module + ".py"] += float(case.get("time", 0))
        kinds = {child.tag for child in case}
        counts["failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"] += 1
    return dict(times), counts


def durations_text(lane: str, times: dict[str, float], fig: dict) -> str:
    tiers: dict[str, float] = defaultdict(float)
    for module, seconds in times.items():
        tiers[next((t for t in TIERS if f"/{t}/" in f"/{module}"), "other")] += seconds
    lines = [f"# ./scripts/test.sh --durations{' --fast' if lane == 'fast' else ''}: {sentence(lane, fig)}"]
    lines.append("# seconds of test time (setup + call + teardown, summed over the workers), per tier, then module")
    lines += [f"{seconds:9.1f}  {tier}/" for tier, seconds in sorted(tiers.items(), key=lambda kv: -kv[1])]
    lines += [f"{seconds:9.1f}  {module}" for module, seconds in sorted(times.items(), key=lambda kv: -kv[1])]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lane", choices=("fast", "full"), required=True)
    parser.add_argument("--junit", type=Path, required=True)
    parser.add_argument("--whole-s", type=float, required=True)
    parser.add_argument("--pytest-s", type=float, required=True)
    parser.add_argument("--cores", type=int, default=len(__import__("os").sched_getaffinity(0)))
    args = parser.parse_args()
    times, counts = module_times(args.junit)
    if counts["failed"]:
        raise SystemExit(f"{counts['failed']} tests failed: only a green run is recorded")
    fig = {"passed": counts["passed"], "skipped": counts["skipped"], "pytest_s": round(args.pytest_s, 1)}
    fig |= {"whole_s": round(args.whole_s, 1), "date": datetime.date.today().isoformat(), "cores": args.cores}
    record = json.loads(FIGURES.read_text()) if FIGURES.exists() else {}
    record[args.lane] = fig
    FIGURES.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    DURATIONS.mkdir(exist_ok=True)
    (DURATIONS / f"{args.lane}.txt").write_text(durations_text(args.lane, times, fig))
    readme = README.read_text()
    if not marker(args.lane).search(readme):
        raise SystemExit(f"README.md has no <!-- suite:{args.lane} --> ... <!-- /suite:{args.lane} --> markers")
    README.write_text(marker(args.lane).sub(lambda m: m[1] + sentence(args.lane, fig) + m[3], readme))
    print(f"recorded the {args.lane} lane: {sentence(args.lane, fig)}")
    if over := over_budget(args.lane, fig):
        print(f"the {args.lane} lane is over its budget: {', '.join(over)} (tests/durations/{args.lane}.txt)")


if __name__ == "__main__":
    main()
