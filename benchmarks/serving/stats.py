"""Repeated runs, medians and intervals for the serving benchmarks (serve_trace.py, chat_rounds.py).

Arms run interleaved (A B C A B C ...): run r of every arm is one "round", close together in time, so a machine that
drifts between rounds moves every arm of the round alike. A ratio's interval comes from a bootstrap that resamples
rounds, then requests within each chosen round (the same requests in every arm: paired), so both the run-to-run drift
and the request mix count. A ratio is "ahead" (under 1: less time) or "behind" only when its 95% interval excludes 1;
else "level". tests/benchmarks/test_serving_stats.py checks each on made-up runs.
"""

from __future__ import annotations

import statistics
from typing import Callable, Sequence

import numpy as np

RESAMPLES = 2000


def percentile(values: Sequence[float], p: float) -> float | None:
    """The p-th percentile (inclusive method, as replay.summary's) of the values, None when there are none."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    if len(values) == 1:
        return float(values[0])
    return float(np.percentile(values, p, method="linear"))


def median_of_runs(runs: Sequence[dict], read: Callable[[dict], float | None]) -> float | None:
    values = [v for v in (read(run) for run in runs) if v is not None]
    return float(statistics.median(values)) if values else None


def paired_ratio(arm_rounds: Sequence[dict[int, float]], base_rounds: Sequence[dict[int, float]], p: float,
                 seed: int = 0, resamples: int = RESAMPLES) -> dict:
    """The ratio arm / base of the p-th percentile of a per-request figure, with a 95% bootstrap interval.

    `arm_rounds[r]` and `base_rounds[r]`: request index -> seconds, of the two arms' runs in round r (requests that
    failed in either are left out of that round). Point: the ratio of the medians over rounds of each run's
    percentile. Interval: rounds drawn with replacement, then each drawn round's requests with replacement (the same
    draw for both arms), percentiles over the pooled draws."""
    rounds = []
    for arm, base in zip(arm_rounds, base_rounds):
        common = sorted(set(arm) & set(base))
        if common:
            rounds.append((np.array([arm[i] for i in common]), np.array([base[i] for i in common])))
    if not rounds:
        return {"ratio": None, "low": None, "high": None, "verdict": "no data", "rounds": 0}
    point = statistics.median(np.percentile(a, p) for a, _ in rounds) / \
        statistics.median(np.percentile(b, p) for _, b in rounds)
    rng = np.random.default_rng(seed)
    ratios = np.empty(resamples)
    for k in range(resamples):
        picked = rng.integers(0, len(rounds), len(rounds))
        arm_draw, base_draw = [], []
        for r in picked:
            a, b = rounds[r]
            rows = rng.integers(0, len(a), len(a))
            arm_draw.append(a[rows])
            base_draw.append(b[rows])
        ratios[k] = np.percentile(np.concatenate(arm_draw), p) / np.percentile(np.concatenate(base_draw), p)
    low, high = (float(x) for x in np.percentile(ratios, (2.5, 97.5)))
    return {"ratio": round(float(point), 4), "low": round(low, 4), "high": round(high, 4),
            "verdict": verdict(low, high), "rounds": len(rounds)}


def per_run_ratio(arm_runs: Sequence[float | None], base_runs: Sequence[float | None], seed: int = 0,
                  resamples: int = RESAMPLES) -> dict:
    """The ratio arm / base of a figure measured once per run, where more is better (a saturated run's requests per
    second), with a 95% interval. `arm_runs[r]` and `base_runs[r]`: the two arms' figures in round r. Point: the ratio
    of the medians over rounds. Interval: rounds drawn with replacement (a run has one such figure, so there are no
    requests to resample): with three rounds it can exclude 1 only when all three agree."""
    pairs = [(a, b) for a, b in zip(arm_runs, base_runs) if a and b]
    if not pairs:
        return {"ratio": None, "low": None, "high": None, "verdict": "no data", "rounds": 0}
    arm, base = (np.array(column, dtype=float) for column in zip(*pairs))
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(pairs), (resamples, len(pairs)))
    ratios = np.median(arm[picks], axis=1) / np.median(base[picks], axis=1)
    low, high = (float(x) for x in np.percentile(ratios, (2.5, 97.5)))
    return {"ratio": round(float(np.median(arm) / np.median(base)), 4), "low": round(low, 4),
            "high": round(high, 4), "rounds": len(pairs),
            "verdict": verdict(1 / high, 1 / low)}  # verdict reads a time ratio: more served is less time


def verdict(low: float, high: float) -> str:
    """How the docs may speak of a time ratio (arm / baseline) with this 95% interval."""
    if high < 1.0:
        return "ahead"
    if low > 1.0:
        return "behind"
    return "level"


def per_request(outcomes: Sequence[dict], field: str) -> dict[int, float]:
    """request index -> the field (seconds) of the requests that succeeded."""
    return {o["index"]: o[field] for o in outcomes if o["ok"]}
