"""The straggler score (``verdict.find_stragglers``, vectorised over ranks) against the definition written out
plainly: in each step, a rank's lateness is the most it entered one of the step's collectives after the median of
the others; a straggler is the latest in at least 75 % of the window's steps, by the median of its lateness."""

import random
import statistics

import pytest

from launcher.watch.verdict import find_stragglers

BASE = 1_795_000_000_000_000_000  # ns: a wall clock's magnitude
STEP_NS, PER_STEP = 100_000_000, 3


def arrivals(ranks: int, steps: int, slow: int, seed: int) -> dict[int, dict[int, tuple[int, str]]]:
    rng = random.Random(seed)
    out: dict[int, dict[int, tuple[int, str]]] = {r: {} for r in range(ranks)}
    for step in range(steps):
        for c in range(PER_STEP):
            at = BASE + step * STEP_NS + c * 5_000_000
            for r in range(ranks):
                late = rng.randint(20_000_000, 40_000_000) if r == slow else 0
                out[r][step * PER_STEP + c] = (at + rng.randint(0, 3_000_000) + late, f"op{c}")
    return out


def plain_lateness(arr: dict[int, dict[int, tuple[int, str]]], rank: int, steps: int) -> float:
    per_step = []
    for step in range(steps - 1):  # the last step has no next one: the score's steps run start to start
        seqs = range(step * PER_STEP, (step + 1) * PER_STEP)
        per_step.append(
            max(arr[rank][s][0] - statistics.median(arr[o][s][0] for o in arr if o != rank) for s in seqs) / 1e9
        )
    return statistics.median(per_step)


@pytest.mark.parametrize("ranks", [2, 3, 4, 7, 64])
def test_the_score_is_the_plain_definition(ranks):
    steps, slow = 20, ranks // 2
    arr = arrivals(ranks, steps, slow, seed=ranks)
    [found] = find_stragglers(arr, window_s=60, min_share=0.1)
    assert found.rank == slow
    assert found.late_s == pytest.approx(plain_lateness(arr, slow, steps), abs=1e-6)
    assert found.step_s == pytest.approx(STEP_NS / 1e9, abs=2e-3)
