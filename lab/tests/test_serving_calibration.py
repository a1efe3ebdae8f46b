"""The serving benchmarks' statistics on identical arms from the stored runs (lab/serving/calibration.py): how
often they call a difference that is not there, and how often they find a true 1.25x one. Printed, so a CI log says
what a verdict of this lab can and cannot resolve on the machine the runs came from."""

from __future__ import annotations

import pytest

from lab.serving import calibration

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pools():
    return calibration.pools(calibration.aa_rounds())


def test_identical_arms_are_called_different_about_5_percent_of_the_time(pools):
    rates = {}
    for label, stored in pools["all"].items():
        for rounds in (3, 5, 8):
            verdicts = calibration.simulate(stored, rounds, sets=1000, seed=rounds)
            rates[(label, rounds)] = verdicts.get("ahead", 0) + verdicts.get("behind", 0)
    print("\nfalse verdicts on identical arms (every stored A/A round):")
    for (label, rounds), rate in sorted(rates.items()):
        print(f"  {label:<9} {rounds} rounds: {rate:.1%}")
    for rounds in (3, 5, 8):
        pooled = sum(rate for (_, r), rate in rates.items() if r == rounds) / len(pools["all"])
        assert 0.035 <= pooled <= 0.065, f"{rounds} rounds: {pooled:.1%} false verdicts over the figures"
    assert max(rates.values()) <= 0.08, rates


def test_a_true_125x_slowdown_is_found_and_the_rounds_it_takes_are_said(pools):
    """On a quiet machine 8 rounds find it at least 80% of the time; 5 rounds do not on this machine (printed: the
    run plans take their round counts from here)."""
    power = {}
    for name, figures in pools.items():
        for rounds in (3, 5, 8):
            found = calibration.simulate(figures["TTFT p50"], rounds, sets=2000, effect=1.25, seed=100 + rounds)
            power[(name, rounds)] = found.get("behind", 0)
    print("\npower to call a true 1.25x TTFT p50 slowdown:")
    for (name, rounds), share in sorted(power.items()):
        print(f"  {name:<6} {rounds} rounds: {share:.1%}")
    assert power[("quiet", 8)] >= 0.80
    for name in pools:
        assert power[(name, 3)] < power[(name, 5)] < power[(name, 8)]
