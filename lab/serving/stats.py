"""Repeated runs, medians and intervals for the serving benchmarks (serve_trace.py, chat_rounds.py).

Arms run interleaved, one run of every arm per round, close together in time. A comparison's statistic is the
**median over rounds of the per-round paired ratio**: in round r, the arm's percentile over the requests both arms
served, divided by the baseline's over the same requests (a request's latency in an open-loop replay depends on the
queue behind it, so requests are not resampled as if independent; a round's ratio carries that and its own noise).
Its 95% interval is built for that statistic: on the log scale, the median plus or minus t(R-1) times the rounds'
standard error (R rounds; one round has no interval: nothing measures the run-to-run spread). Calibrated by
simulation on identical arms from the stored runs (lab/serving/calibration.py; lab/tests/
test_serving_calibration.py prints the false-verdict rate at 3, 5 and 8 rounds and the power at 5).

Words, one rule (`verdict`): "ahead" / "behind" only where the interval excludes 1; "equivalent" only where the whole
interval lies inside a margin fixed before the run (e.g. 1.10: within 10% either way); else "level", which says the
run could not tell, never "as fast". A set whose A/A pair (the baseline against itself) is not level is void
(lab/serving/report.py applies it).
"""

from __future__ import annotations

import math
import statistics
from typing import Callable, Sequence

import numpy as np

# t(0.975, df) for df = rounds - 1 (from 31 rounds on, the normal's 1.96 is within 2%).
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
         11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
         20: 2.086, 25: 2.060, 30: 2.042}


def median_of_runs(runs: Sequence[dict], read: Callable[[dict], float | None]) -> float | None:
    """Descriptive: the median over runs of one arm's figure (the tables' per-arm columns; no verdict comes from
    it: verdicts come from paired ratios)."""
    values = [v for v in (read(run) for run in runs) if v is not None]
    return float(statistics.median(values)) if values else None


def t975(df: int) -> float:
    if df in _T975:
        return _T975[df]
    below = max(k for k in _T975 if k <= df)
    return _T975[below] if df < 30 else 1.96 + (_T975[30] - 1.96) * 30 / df


def round_log_ratios(arm_rounds: Sequence[dict[int, float]], base_rounds: Sequence[dict[int, float]],
                     p: float) -> list[float]:
    """Per round, log(arm's p-th percentile / baseline's) over the requests both served in that round."""
    logs = []
    for arm, base in zip(arm_rounds, base_rounds):
        common = sorted(set(arm) & set(base))
        if common:
            a = np.percentile([arm[i] for i in common], p)
            b = np.percentile([base[i] for i in common], p)
            if a > 0 and b > 0:
                logs.append(math.log(a / b))
    return logs


def interval(logs: Sequence[float], margin: float | None = None, more_is_better: bool = False) -> dict:
    """The median of per-round log ratios, its 95% interval (module docstring) and the word for it. `margin`: the
    equivalence margin fixed before the run (a ratio above 1). `more_is_better`: the figure is a rate (requests per
    second), so a ratio above 1 is ahead."""
    if not logs:
        return {"ratio": None, "low": None, "high": None, "verdict": "no data", "rounds": 0}
    centre = statistics.median(logs)
    cell = {"ratio": round(math.exp(centre), 4), "rounds": len(logs),
            "per_round": [round(math.exp(x), 4) for x in logs]}
    if len(logs) < 2:
        return {**cell, "low": None, "high": None, "verdict": "one round: no interval"}
    half = t975(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    low, high = math.exp(centre - half), math.exp(centre + half)
    word = verdict(1 / high, 1 / low, margin) if more_is_better else verdict(low, high, margin)
    return {**cell, "low": round(low, 4), "high": round(high, 4), "verdict": word}


def paired_ratio(arm_rounds: Sequence[dict[int, float]], base_rounds: Sequence[dict[int, float]], p: float,
                 margin: float | None = None) -> dict:
    """The arm / baseline ratio of a per-request figure's p-th percentile, paired per round. `arm_rounds[r]` and
    `base_rounds[r]`: request index -> seconds, of the two arms' runs in round r (requests that failed in either
    are left out of that round)."""
    return interval(round_log_ratios(arm_rounds, base_rounds, p), margin)


def per_run_ratio(arm_runs: Sequence[float | None], base_runs: Sequence[float | None],
                  margin: float | None = None) -> dict:
    """The arm / baseline ratio of a figure measured once per run where more is better (a saturated run's requests
    per second), paired per round: `arm_runs[r]` and `base_runs[r]` are the two arms' figures in round r."""
    return interval([math.log(a / b) for a, b in zip(arm_runs, base_runs) if a and b], margin, more_is_better=True)


def verdict(low: float, high: float, margin: float | None = None) -> str:
    """How the docs may speak of a time ratio (arm / baseline) with this 95% interval (module docstring)."""
    if high < 1.0:
        return "ahead"
    if low > 1.0:
        return "behind"
    if margin is not None and 1 / margin <= low and high <= margin:
        return "equivalent"
    return "level"


def per_request(outcomes: Sequence[dict], field: str) -> dict[int, float]:
    """request index -> the field (seconds) of the requests that succeeded."""
    return {o["index"]: o[field] for o in outcomes if o["ok"]}
