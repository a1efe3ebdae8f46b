"""The serving benchmarks' intervals (lab/serving/stats.py) on made-up runs: a real difference is called
ahead or behind, noise is called level, and drift between rounds widens the interval."""

from __future__ import annotations

import numpy as np
import pytest

from lab.serving import stats


def _rounds(scale: float, rounds: int, requests: int = 200, seed: int = 0, drift=None) -> list[dict[int, float]]:
    rng = np.random.default_rng(seed)
    base = np.random.default_rng(99).lognormal(-1.0, 0.6, requests)  # the same requests in every arm
    return [{i: float(t * scale * (drift[r] if drift else 1.0) * rng.lognormal(0, 0.05))
             for i, t in enumerate(base)} for r in range(rounds)]


def test_a_clear_difference_is_ahead_or_behind():
    faster = stats.paired_ratio(_rounds(0.7, 3, seed=1), _rounds(1.0, 3, seed=2), 50)
    assert faster["verdict"] == "ahead" and faster["high"] < 1 and 0.6 < faster["ratio"] < 0.8
    slower = stats.paired_ratio(_rounds(1.3, 3, seed=3), _rounds(1.0, 3, seed=4), 90)
    assert slower["verdict"] == "behind" and slower["low"] > 1


def test_noise_alone_is_level():
    same = stats.paired_ratio(_rounds(1.0, 3, seed=5), _rounds(1.0, 3, seed=6), 50)
    assert same["verdict"] == "level" and same["low"] < 1 < same["high"]


def test_drift_between_rounds_widens_the_interval():
    steady = stats.paired_ratio(_rounds(1.0, 4, seed=7), _rounds(1.0, 4, seed=8), 50)
    drift = [0.5, 1.0, 1.5, 2.0]
    # The arm's rounds drift in one direction, the baseline's in the other: pairing rounds does not cancel that.
    drifting = stats.paired_ratio(_rounds(1.0, 4, seed=7, drift=drift), _rounds(1.0, 4, seed=8, drift=drift[::-1]),
                                  50)
    assert drifting["high"] - drifting["low"] > 2 * (steady["high"] - steady["low"])


def test_failed_requests_are_left_out_and_no_data_is_said():
    arm, base = _rounds(1.0, 2, seed=9), _rounds(1.0, 2, seed=10)
    for r in arm:
        del r[0]
    assert stats.paired_ratio(arm, base, 50)["rounds"] == 2
    assert stats.paired_ratio([{}], [{1: 0.1}], 50)["verdict"] == "no data"


def test_a_per_run_figure_where_more_is_better_is_ahead_only_when_every_round_agrees():
    """Requests per second of saturated runs: more is ahead; one run a round, so rounds are all there is to draw."""
    more = stats.per_run_ratio([1.30, 1.25, 1.35], [1.00, 1.02, 0.98])
    assert more["verdict"] == "ahead" and more["low"] > 1 and 1.25 < more["ratio"] < 1.35
    less = stats.per_run_ratio([0.80, 0.85, 0.82], [1.00, 1.02, 0.98])
    assert less["verdict"] == "behind" and less["high"] < 1
    split = stats.per_run_ratio([1.10, 0.90, 1.05], [1.00, 1.00, 1.00])  # the rounds disagree
    assert split["verdict"] == "level" and split["low"] < 1 < split["high"]
    assert stats.per_run_ratio([None, 1.1], [1.0, None])["verdict"] == "no data"


def test_the_point_is_the_median_of_the_per_round_paired_ratios():
    """Not a ratio of medians taken over rounds apart: in round 1 both arms are slow (the machine was busy), and
    only pairing within the round says the arm is 0.8x of its baseline every time."""
    arm = [{0: 0.8, 1: 0.8}, {0: 8.0, 1: 8.0}, {0: 0.4, 1: 0.4}]
    base = [{0: 1.0, 1: 1.0}, {0: 10.0, 1: 10.0}, {0: 0.5, 1: 0.5}]
    cell = stats.paired_ratio(arm, base, 50)
    assert cell["ratio"] == pytest.approx(0.8) and cell["per_round"] == [0.8, 0.8, 0.8]
    assert cell["low"] == pytest.approx(0.8) and cell["high"] == pytest.approx(0.8) and cell["verdict"] == "ahead"


def test_one_round_has_no_interval_and_no_verdict():
    cell = stats.paired_ratio(_rounds(0.5, 1, seed=11), _rounds(1.0, 1, seed=12), 50)
    assert cell["low"] is None and cell["verdict"] == "one round: no interval" and cell["ratio"] < 0.6


def test_equivalent_only_inside_a_margin_and_never_without_one():
    assert stats.verdict(0.97, 1.04) == "level"
    assert stats.verdict(0.97, 1.04, margin=1.05) == "equivalent"
    assert stats.verdict(0.93, 1.04, margin=1.05) == "level"  # the interval leaves the margin: no claim either way
